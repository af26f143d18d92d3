package optim

// Checkpoint is one rank's optimizer state: everything that decides the next
// step, parameters included. The 1-bit optimizers store each rank's own
// error buffers in it, so a checkpoint is per rank.
//
// SaveFile writes one atomically; LoadFile reads one back and rejects a
// truncated or corrupted file.
type Checkpoint struct {
	Algorithm string // "adam", "lamb", "onebit-adam", "onebit-lamb", "zeroone-adam"
	World     int    // group size it was made on
	Rank      int    // rank that made it
	Stage     Stage

	// Ints holds counters and flags (step, var_interval, ...).
	Ints map[string]int64
	// Floats holds scalar state (LAMB coefficients, lrs, ...); float32
	// values are stored exactly.
	Floats map[string]float64
	// Tensors holds parameters and per-parameter buffers, in a fixed order.
	Tensors []Tensor
}

// Tensor is one named buffer of a checkpoint.
type Tensor struct {
	Name  string // e.g. "param/fc1.weight", "exp_avg/fc1.weight", "worker_error/fc1.weight"
	Shape []int
	Data  []float32
}
