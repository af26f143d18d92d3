package onebit

// Tracing of AllReduce: a per-phase timeline of each call, for finding
// where the time goes. Off (no Tracer set) it costs one nil check per
// phase and allocates nothing.

import "time"

// Phase is a step of one AllReduce call, as a Tracer sees it.
type Phase uint8

// The phases of an AllReduce call, in the order of the algorithm's steps
// (a call with whole chunks starts its header first). A pipelined call (a
// large tensor, sent in pieces) reports the first worker pass, the
// server's sum and the output once per piece; step 3 over the whole
// tensor (piece -1) in one span or more (while the caller waits for phase
// 1's pieces, then while phase 2 travels), and step 8 and the output of
// the rank's own chunk once each (piece -1, while phase 2 travels); its
// collectives run without the caller (started by it on a comm.Starter, or
// on a goroutine of their own), concurrently with the caller's phases, and
// PhaseWait is the time the caller spends blocked on them. A call with
// whole chunks reports each phase once, but the output twice (this rank's own chunk before the all-gather ends, then the
// others'). It runs its collectives blocking, each in its place, and
// reports no PhaseWait; or, on a communicator that starts them
// (comm.Starter), its collective spans run from their start to their end,
// over the passes run meanwhile (the first pass during the header; step 3
// during the all-to-all; step 8 and the own chunk's output during the
// all-gather), and PhaseWait is the time the caller spends blocked on them
// at their end.
const (
	// PhaseCompress is the worker side's first pass: x = pad(buf) +
	// worker_error, its sum of squares and sgn(x) packed (steps 1, 2 and
	// 4); pipelined, of one piece.
	PhaseCompress Phase = iota
	// PhaseHeader is the all-gather of every rank's length and tuning
	// fields.
	PhaseHeader
	// PhaseWorkerError is the worker side's second pass, step 3,
	// worker_error = x - worker_scale * sgn(x), over the whole tensor:
	// pipelined while the caller waits for phase 1's pieces and then
	// while phase 2 travels, and with whole chunks after the all-to-all
	// has started (while it travels, if started).
	PhaseWorkerError
	// PhaseAllToAll is the phase 1 all-to-all of the packed worker
	// signs (of one piece).
	PhaseAllToAll
	// PhaseServerReduce is the server side, steps 5, 6 and 9, on one
	// piece: the chunks received summed, scaled, the server error added,
	// and sgn(c) packed.
	PhaseServerReduce
	// PhaseServerCompress is the server side, step 8, server_error = c -
	// server_scale * sgn(c), over the chunk, after the all-gather has
	// started.
	PhaseServerCompress
	// PhaseAllGather is the phase 2 all-gather of the packed server
	// chunks (of one piece).
	PhaseAllGather
	// PhaseDecompress is the output of one piece: unpacking every rank's
	// server chunk, scaled, into buf (pipelined, the other ranks'; the
	// own chunk's is a span of its own).
	PhaseDecompress
	// PhaseWait is the caller blocked on collectives that run without it:
	// a pipelined call's, or a whole-chunk call's started ones.
	PhaseWait

	numPhases
)

// NumPhases is the number of phases: every Phase is below it.
const NumPhases = int(numPhases)

var phaseNames = [numPhases]string{
	PhaseCompress:       "compress",
	PhaseHeader:         "header",
	PhaseWorkerError:    "worker-error",
	PhaseAllToAll:       "all-to-all",
	PhaseServerReduce:   "server-reduce",
	PhaseServerCompress: "server-compress",
	PhaseAllGather:      "all-gather",
	PhaseDecompress:     "decompress",
	PhaseWait:           "wait",
}

// String returns the phase's name, such as "all-to-all".
func (p Phase) String() string {
	if p < numPhases {
		return phaseNames[p]
	}
	return "phase?"
}

// Collective reports whether p is a collective (header, all-to-all or
// all-gather), which may run without the caller (see the phases).
func (p Phase) Collective() bool {
	return p == PhaseHeader || p == PhaseAllToAll || p == PhaseAllGather
}

// A Tracer receives the phases of the AllReduce calls made with a State
// (see State.SetTracer). Span reports that phase ph of piece piece (0 when
// a call is not pipelined, -1 for a phase over the whole tensor) ran from
// start to end. In a pipelined call whose collectives run on a goroutine,
// Span is called from two goroutines at once (the collectives from one,
// the rest from the other), so it must be safe for concurrent use. It is called on the hot path: it should
// record and return.
type Tracer interface {
	Span(ph Phase, piece int, start, end time.Time)
}

// SetTracer makes the AllReduce calls made with st report their phases to
// t; nil (the default) turns tracing off. It must not be called during a
// call.
func (st *State) SetTracer(t Tracer) { st.tracer = t }

// start is the start time of a traced phase: the zero Time, without a
// call to the clock, when tracing is off.
func (st *State) start() time.Time {
	if st.tracer == nil {
		return time.Time{}
	}
	return time.Now()
}

// span reports phase ph of piece p, begun at start, to the tracer, if any.
func (st *State) span(ph Phase, p int, start time.Time) {
	if st.tracer != nil {
		st.tracer.Span(ph, p, start, time.Now())
	}
}
