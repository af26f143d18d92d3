package costmodel

import "github.com/lowbit-ml/lowbit/comm"

// step is one stage of a collective call: pre seconds of local work, then a
// message exchange of rounds latency-bound rounds in which each rank sends
// bytes; work seconds of local work run alongside the exchange, overlapped
// in pieces when pieces > 1 (pipelining), after it otherwise.
type step struct {
	pre, work float64
	rounds    float64
	bytes     int64
	pieces    int
}

// collective is the machine-independent cost structure of one collective
// on float32 data.
type collective struct {
	name, desc string
	// wireBytes is what each of w ranks sends for n float32 elements,
	// counted as comm.Stats counts it (the sum of the steps' bytes).
	wireBytes func(n int64, w int) int64
	// steps is a call on n elements per rank on w ranks, with compute
	// seconds of local work in all (0 for the exact collectives), as its
	// algorithm runs it.
	steps func(n int64, w int, compute float64) []step
	// compresses says whether the call has local compression work: the
	// 1-bit allreduce's time without a network.
	compresses bool
	// fitAs names the collective whose measurements this one borrows ("":
	// its own).
	fitAs string
	// uncalibrated, when set, says what the model does not measure.
	uncalibrated string
}

// collectives are the collectives the model knows, in table order; the
// first is the exact allreduce the others are compared with.
var collectives = []collective{
	{
		name:      "allreduce",
		desc:      "exact float32 ring allreduce (MPI_Allreduce)",
		wireBytes: func(n int64, w int) int64 { return comm.RingAllReduceBytes(4*n, w) },
		steps: func(n int64, w int, _ float64) []step {
			return []step{{rounds: float64(2 * (w - 1)), bytes: comm.RingAllReduceBytes(4*n, w)}}
		},
	},
	{
		name:       "onebit",
		desc:       "1-bit error-compensated allreduce (onebit.AllReduce)",
		wireBytes:  onebitWireBytes,
		steps:      onebitSteps,
		compresses: true,
	},
	{
		name:      "fp16",
		desc:      "allreduce with float16 on the wire",
		wireBytes: func(n int64, w int) int64 { return comm.RingAllReduceBytes(2*n, w) },
		steps: func(n int64, w int, _ float64) []step {
			return []step{{rounds: float64(2 * (w - 1)), bytes: comm.RingAllReduceBytes(2*n, w)}}
		},
		fitAs:        "allreduce",
		uncalibrated: "not measured: the exact allreduce's model at half the bytes, float16 conversion left out",
	},
}

// Collective describes one collective the model knows.
type Collective struct {
	// Name is what Job.Collectives and the calibration's runs call it.
	Name string
	// Desc says what it is, in a line.
	Desc string
	// Uncalibrated, when not empty, says what the model of this
	// collective does not measure (its figures are derived from another
	// collective's fit).
	Uncalibrated string
	// Outer says that it is a row of the outer optimizer (package outer):
	// an exchange every Job.OuterH/Job.OuterFragments steps, averaged
	// over the steps.
	Outer bool
	// Muon says that it is a row of Muon (muon, onebit-muon): an
	// optimizer's step, its exchange and the orthogonalization.
	Muon bool
}

// Collectives lists what Job.Collectives may name: the collectives the
// model knows, "allreduce" (the exact float32 ring allreduce, the
// baseline of Row.SpeedupExact), "onebit" (onebit.AllReduce) and "fp16"
// (not calibrated), then the outer optimizer's rows, one per codec:
// "outer-fp32", "outer-bf16" (not calibrated), "outer-int8" (not
// calibrated), "outer-1bit" and "outer-sparse" (not calibrated), then
// Muon's rows, "muon", "muon-split", "onebit-muon" and (opt-in)
// "onebit-muon-owners" (muon.go).
func Collectives() []Collective {
	out := make([]Collective, 0, len(collectives)+len(outerCodecs)+2)
	for _, c := range collectives {
		out = append(out, Collective{Name: c.name, Desc: c.desc, Uncalibrated: c.uncalibrated})
	}
	for _, c := range outerCodecs {
		out = append(out, Collective{Name: c.name, Desc: c.desc, Uncalibrated: c.uncalibrated, Outer: true})
	}
	return append(out,
		Collective{Name: OptMuon, Muon: true, Desc: "Muon (optim.NewMuon): exact float32 allreduce of the gradients, then every rank orthogonalizes every Muon matrix (Newton-Schulz)"},
		Collective{Name: OptMuonSplit, Muon: true, Desc: "Muon with MuonConfig.Split: exact float32 allreduce of the gradients, each rank orthogonalizes its share of the Muon matrices, then an all-gather of the updates"},
		Collective{Name: OptOnebitMuon, Muon: true, Desc: "1-bit Muon (onebit.NewMuon) after its warm-up (FreezeStep steps of exact Muon): every rank orthogonalizes its own momentum, then the 1-bit allreduce of the results and the AdamW group's momentum"},
		Collective{Name: OptOnebitMuonOwners, Muon: true, Uncalibrated: ownersCollective(&MuonPlan{}).uncalibrated,
			Desc: "1-bit Muon with ExchangeOwners (opt-in): each rank sends the owner of each Muon matrix its momentum's change at 1 bit, the owner orthogonalizes the mean's estimate and sends the update at 1 bit; segments padded to the most loaded owner's; the AdamW group through the 1-bit allreduce"})
}

func findCollective(name string) (collective, bool) {
	for _, c := range collectives {
		if c.name == name {
			return c, true
		}
	}
	return collective{}, false
}

// onebitPaddedLen is onebit.PaddedLen (the padded length of n elements on
// w ranks: a multiple of w*lcm(w, 8)), copied so that the cost model does
// not import the optimizers; TestOnebitCopiesMatch checks the copy.
func onebitPaddedLen(n int64, w int) int64 {
	if n <= 0 {
		return 0
	}
	m := onebitPadUnit(w)
	return (n + m - 1) / m * m
}

// onebitPadUnit is what onebit pads a tensor on w ranks to a multiple of:
// w*lcm(w, 8).
func onebitPadUnit(w int) int64 {
	g, h := w, 8
	for h != 0 {
		g, h = h, g%h
	}
	return int64(w) * int64(w/g*8)
}

// The pipelining of onebit.AllReduce (onebit/pipeline.go: pieceTarget,
// maxPieces, State.setPieces): each chunk's packed bytes travel in pieces
// of about 64 KiB per destination, at most 4. TestOnebitStepsFollowAlgorithm
// checks the copy against the collective's behaviour on the local backend.
const (
	onebitPieceTarget = 64 << 10
	onebitMaxPieces   = 4
)

// onebitPieces is K, the pieces each chunk of a call on n elements and w
// ranks travels in (1: not pipelined), as onebit.NewState picks it.
func onebitPieces(n int64, w int) int {
	k, _ := onebitPiecing(n, w)
	return k
}

// onebitPiecing is onebitPieces and the packed bytes per destination of
// each piece (0 when not pipelined on one rank).
func onebitPiecing(n int64, w int) (pieces int, pieceBytes int64) {
	if w < 2 {
		return 1, 0
	}
	chunkBytes := onebitPaddedLen(n, w) / int64(w) / 8
	k := max(1, min(chunkBytes/onebitPieceTarget, onebitMaxPieces, chunkBytes))
	pieceBytes = (chunkBytes + k - 1) / k
	if pieceBytes == 0 {
		return 1, 0
	}
	return int((chunkBytes + pieceBytes - 1) / pieceBytes), pieceBytes
}

// onebitWireBytes is what each rank sends in onebit.AllReduce: with N the
// padded length and C = N/W its chunk, the header all-gather of the length
// ((W-1)*8), the phase 1 all-to-all of packed signs and worker scales
// ((W-1)*(C/8+4)), and the phase 2 all-gather of server scale and signs
// ((W-1)*(4+C/8)).
func onebitWireBytes(n int64, w int) int64 {
	if w <= 1 {
		return 0
	}
	c := onebitPaddedLen(n, w) / int64(w)
	return int64(w-1) * (2*(c/8) + 16)
}

// onebitSteps is onebit.AllReduce (three collectives, large tensors
// pipelined in K pieces), with its local work split by the passes it
// makes over the padded buffer of N elements (C = N/W): the worker norm
// or the worker residual (N), packing with error feedback (N), the
// server's unpack-and-sum of W chunks (N) and its compression (C),
// unpacking the output (N): 4 + 1/W passes.
//
//   - header: all-gather of the length, at once (where the collectives
//     are started it travels beside the first pass; the model puts that
//     pass before it, unpipelined);
//   - phase 1: all-to-all of the packed chunks, each followed by the
//     worker scale, after packing; pipelined, packing, the worker residual
//     and the server's sum overlap the pieces on the wire, and the worker
//     scales travel in the piece that starts the second half;
//   - phase 2: all-gather of server scale and signs, after the server's
//     compression (and its sum, unpipelined); unpacking the output follows
//     it, or overlaps its pieces when pipelined.
//
// Every collective is counted as W-1 latency-bound rounds (ring all-gather,
// pairwise all-to-all), once per piece.
func onebitSteps(n int64, w int, compute float64) []step {
	if w <= 1 || n <= 0 {
		return nil
	}
	c := onebitPaddedLen(n, w) / int64(w)
	k := onebitPieces(n, w)
	pass := compute / (4 + 1/float64(w))
	r := float64(w - 1)
	hdr := step{pre: pass, rounds: r, bytes: int64(w-1) * 8}
	p1 := step{rounds: float64(k) * r, bytes: int64(w-1) * (4 + c/8), pieces: k}
	p2 := step{rounds: float64(k) * r, bytes: int64(w-1) * (4 + c/8), pieces: k, work: pass}
	if k > 1 {
		hdr.pre = 0
		p1.work = 3 * pass
		p2.pre = pass / float64(w)
	} else {
		p1.pre = pass
		p2.pre = pass * (1 + 1/float64(w))
	}
	return []step{hdr, p1, p2}
}
