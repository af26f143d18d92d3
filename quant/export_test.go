package quant

// SetTwoLevelPieces makes t's allreduce cut its slices into p pieces
// (where its communicators can overlap), whatever their size, so that the
// tests under mpirun reach the pipelined path with small tensors.
func SetTwoLevelPieces(t *TwoLevel, p int) { t.pieces = p }
