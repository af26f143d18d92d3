package onebit

// HeaderLen is the bytes each rank sends to each peer in a call's header.
const HeaderLen = headerLen

// SetPieces makes st travel in at most k pieces per chunk (1: no
// pipelining), so that tests can pipeline small tensors.
func SetPieces(st *State, k int) { st.SetPieces(k) }

// Pieces is the number of pieces st travels in.
func Pieces(st *State) int { return st.pieces }

// SetDevicePieces is SetPieces for a DeviceState's wire layout.
func SetDevicePieces(st *DeviceState, k int) { st.wire.SetPieces(k) }

// AdamBucketStates is the State of every bucket of a.
func AdamBucketStates(a *Adam) []*State { return a.bkt.states }

// TunePieces cuts st's chunks into at most k pieces on the calls that send
// pieces and lets the calls choose between those and whole chunks, as a
// State large enough for pieces does, so that tests can tune small
// tensors.
func TunePieces(st *State, k int) {
	st.setPieces(k, st.world)
	st.tune = tuner{}
}

// TuneDevicePieces is TunePieces for a DeviceState's wire.
func TuneDevicePieces(st *DeviceState, k int) { TunePieces(&st.wire, k) }

// The tuner's ways, for TuneWay.
const (
	WayPieces   = wayPieces
	WayWhole    = wayWhole
	WayBlocking = wayBlocking
)

// TuneWay is the way the tuner picks for call u after recording the given
// times (microseconds) of calls of each way (pieces, whole, whole
// blocking).
func TuneWay(u int, times ...[]uint64) int {
	var t tuner
	for w, ts := range times {
		for _, x := range ts {
			t.times[w][t.n[w]%tuneSamples] = x
			t.n[w]++
		}
	}
	return t.decide(u)
}

// TuneRun drives a new State's tuner through calls calls, as the headers
// do: the group's time of call u, run in way w, is time(u, w). It returns
// the way of every call.
func TuneRun(calls int, time func(u, way int) uint64) []int {
	var t tuner
	ways := make([]int, calls)
	var last uint64
	for u := range ways {
		ways[u] = t.way
		t.take(last) // call u's header: the time of call u-1
		last = time(u, t.way)
		t.way = t.nextWay
	}
	return ways
}

// MuonBucketStates is the State of every bucket of o.
func MuonBucketStates(o *Muon) []*State { return o.bkt.states }

// SetStartSizes makes tensors from start elements (padded) start their
// collectives and progresses them every block elements (a multiple of
// 16Ki), for the test's duration: the race detector's run of the started
// tests uses smaller tensors than startMin's 1M.
func SetStartSizes(t interface{ Cleanup(func()) }, start, block int) {
	oldStart, oldBlock := startMin, progressBlock
	startMin, progressBlock = start, block
	t.Cleanup(func() { startMin, progressBlock = oldStart, oldBlock })
}

// Hadamard is the owners' exchange's orthonormal Walsh-Hadamard transform
// (muon_schemes_test.go's harness rotates with it too).
var Hadamard = hadamard
