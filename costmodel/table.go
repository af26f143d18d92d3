package costmodel

// StateRow is one row of the optimizer state table of a plan.
type StateRow struct {
	// Optimizer is the row's name: one of StateOptimizers, OptMuon,
	// OptOnebitMuon, OptOnebitMuonCompactBF16 (on more than one rank), or
	// an outer row ("outer-sparse": the outer optimizer with that codec
	// around outer.NewAdam's AdamW, both at their defaults; OptOuterMuon:
	// the 1-bit codec around Muon, as the Muon rows see the model), or
	// OptOuterSparseFP32.
	Optimizer string
	// Bytes is the state of rank 0, parameters and gradients not
	// included; Err, when set, says why it could not be counted (more
	// than an int64 holds).
	Bytes int64
	Err   error
}

// StateTable returns the optimizer state per rank that lowbit plan prints
// for j (Params, Ranks, BucketBytes; the Muon and outer fields): every
// StateOptimizers row with the model as one tensor (StateBytes), Muon and
// 1-bit Muon with the model as Plan's Muon rows see it (MuonPlan: whole
// matrices of one shape and one AdamW tensor), 1-bit Muon's smallest
// mode the same way (on more than one rank), and with OuterH > 0 the
// outer optimizer around exact AdamW, one row per codec of
// OuterStateBytes and its inner AdamW's (the sparse codec's where its chunk
// fits the smallest fragment), the 1-bit codec around Muon (OptOuterMuon,
// Muon's state as the OptMuon row counts it), and the sparse codec with
// float32 state (OptOuterSparseFP32).
func (j Job) StateTable() []StateRow {
	var rows []StateRow
	for _, name := range StateOptimizers() {
		b, err := StateBytes(name, []int64{j.Params}, j.Ranks, j.BucketBytes)
		rows = append(rows, StateRow{Optimizer: name, Bytes: b, Err: err})
	}
	mp := muonPlan(j)
	rows = append(rows, StateRow{Optimizer: OptMuon, Bytes: muonState(mp.Shape, mp.Matrices, mp.Other)})
	b, err := onebitMuonState(mp.Shape, mp.Matrices, mp.Other, j.Ranks, j.BucketBytes)
	rows = append(rows, StateRow{Optimizer: OptOnebitMuon, Bytes: b, Err: err})
	if err == nil && j.Ranks > 1 && mp.Matrices > 0 {
		most := mp.Shape[0] * mp.Shape[1]
		tensors := mp.Matrices
		if mp.Other > 0 {
			tensors++
		}
		b += muonCompactDelta(mp.Matrices*most, mp.Other, most, tensors, j.Ranks, j.BucketBytes, true)
		rows = append(rows, StateRow{Optimizer: OptOnebitMuonCompactBF16, Bytes: b})
	}
	for _, name := range j.outerStateRows() {
		oc, _ := findOuterCodec(name)
		b, err := OuterStateBytes(oc.stateName(), j)
		if err == nil || err == errTooLarge {
			inner := outerInnerBytes(oc.codec, j.Params)
			if oc.muon {
				inner = muonState(mp.Shape, mp.Matrices, mp.Other)
			}
			rows = append(rows, StateRow{Optimizer: name, Bytes: b + inner, Err: err})
		}
		if name == "outer-sparse" && err == nil {
			rows = append(rows, StateRow{Optimizer: OptOuterSparseFP32, Bytes: b - sparseBF16Delta(j) + 8*j.Params})
		}
	}
	return rows
}

// OptOuterSparseFP32 is the state row of the outer optimizer's sparse
// codec with float32 state, what was its default before bfloat16: its
// accumulator in float32 (outer.Config.AccumulatorBF16 false) around an
// AdamW with float32 moments (optim.AdamConfig.MomentsBF16 false), 8
// bytes per parameter.
const OptOuterSparseFP32 = "outer-sparse-fp32"

// outerInnerBytes is the state of outer.NewAdam's AdamW over params
// parameters at outer.DefaultAdamConfigFor(codec), codec as
// outer.ParseCodec names it: its moments in bfloat16 with the sparse
// codec, 4 bytes per parameter, in float32 with the others, 8.
func outerInnerBytes(codec string, params int64) int64 {
	if codec == "sparse" {
		return 4 * params
	}
	return 8 * params
}

// sparseBF16Delta is what outer.Config.AccumulatorBF16, the sparse
// codec's default, changes in its buffers: the accumulator in bfloat16
// (2 bytes per parameter instead of 4) and a float32 chunk to widen it
// into; nothing on one rank, where the codec keeps no accumulator.
func sparseBF16Delta(j Job) int64 {
	if j.Ranks < 2 {
		return 0
	}
	return -2*j.Params + 4*sparseOf(j).chunk
}
