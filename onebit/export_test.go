package onebit

// SetPieces makes st travel in at most k pieces per chunk (1: no
// pipelining), so that tests can pipeline small tensors.
func SetPieces(st *State, k int) { st.setPieces(k, st.world) }

// Pieces is the number of pieces st travels in.
func Pieces(st *State) int { return st.pieces }

// SetDevicePieces is SetPieces for a DeviceState's wire layout.
func SetDevicePieces(st *DeviceState, k int) { st.wire.setPieces(k, st.world) }

// AdamBucketStates is the State of every bucket of a.
func AdamBucketStates(a *Adam) []*State { return a.bkt.states }
