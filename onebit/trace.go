package onebit

// Tracing of AllReduce: a per-phase timeline of each call, for finding
// where the time goes. Off (no Tracer set) it costs one nil check per
// phase and allocates nothing.

import "time"

// Phase is a step of one AllReduce call, as a Tracer sees it.
type Phase uint8

// The phases of an AllReduce call, in the order a call starts them. A
// pipelined call (a large tensor, sent in pieces) reports the worker,
// server and output phases once per piece, and the step 3 pass once; its
// collectives run on a goroutine of their own, concurrently with the
// caller's phases, and PhaseWait is the time the caller spends blocked on
// them. An unpipelined call runs its collectives on the caller's goroutine
// and reports no PhaseWait.
const (
	// PhaseCompress is the worker side's first pass: x = pad(buf) +
	// worker_error and its sum of squares (steps 1-2); pipelined, of one
	// piece, and packing sgn(x) too (step 4).
	PhaseCompress Phase = iota
	// PhaseHeader is the all-gather of every rank's length (and, not
	// pipelined, worker scale).
	PhaseHeader
	// PhaseWorkerError is the worker side's second pass, step 3,
	// worker_error = x - worker_scale * sgn(x), over the whole tensor: not
	// pipelined with step 4, packing sgn(x); pipelined while the pieces
	// are on the wire.
	PhaseWorkerError
	// PhaseAllToAll is the phase 1 all-to-all of the packed worker
	// signs (of one piece).
	PhaseAllToAll
	// PhaseServerReduce is the server side, steps 5-6, on one piece:
	// unpack the chunks received, sum them scaled, add the server error.
	PhaseServerReduce
	// PhaseServerCompress is the server side, steps 8-9, on one piece:
	// server_error = c - server_scale * sgn(c) and pack sgn(c).
	PhaseServerCompress
	// PhaseAllGather is the phase 2 all-gather of the packed server
	// chunks (of one piece).
	PhaseAllGather
	// PhaseDecompress is the output of one piece: unpacking every rank's
	// server chunk, scaled, into buf.
	PhaseDecompress
	// PhaseWait is a pipelined call's caller blocked on its collectives.
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
// all-gather), which a pipelined call runs on a goroutine of its own.
func (p Phase) Collective() bool {
	return p == PhaseHeader || p == PhaseAllToAll || p == PhaseAllGather
}

// A Tracer receives the phases of the AllReduce calls made with a State
// (see State.SetTracer). Span reports that phase ph of piece piece (0 when
// a call is not pipelined, -1 for a phase over the whole tensor) ran from
// start to end. In a pipelined call Span is called from two goroutines at
// once (the collectives from one, the rest from the other), so it must be
// safe for concurrent use. It is called on the hot path: it should
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
