package main

// lowbit bench --trace: a per-phase timeline of every timed onebit call on
// every rank, written as Chrome trace-event JSON (chrome://tracing and
// Perfetto open it), and a per-phase summary in the table.

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/size"
)

// phaseCall is the pseudo-phase of a whole call, after onebit's phases.
const phaseCall = onebit.NumPhases

// phaseName names onebit's phases and phaseCall.
func phaseName(ph int) string {
	if ph == phaseCall {
		return "call"
	}
	return onebit.Phase(ph).String()
}

// traceEvent is one span on one rank: phase ph of piece piece of timed
// call call, from start to start+dur (Unix nanoseconds: ranks on one
// machine share the clock).
type traceEvent struct {
	ph    int
	piece int
	call  int
	start int64
	dur   int64
}

// traceEventLen is the bytes of one encoded traceEvent: phase (1), piece
// (int16), call (int32), one byte unused, start and duration (int64 each).
const traceEventLen = 24

func (e traceEvent) put(b []byte) {
	b[0] = byte(e.ph)
	binary.LittleEndian.PutUint16(b[1:], uint16(int16(e.piece)))
	binary.LittleEndian.PutUint32(b[3:], uint32(int32(e.call)))
	binary.LittleEndian.PutUint64(b[8:], uint64(e.start))
	binary.LittleEndian.PutUint64(b[16:], uint64(e.dur))
}

func getTraceEvent(b []byte) traceEvent {
	return traceEvent{
		ph:    int(b[0]),
		piece: int(int16(binary.LittleEndian.Uint16(b[1:]))),
		call:  int(int32(binary.LittleEndian.Uint32(b[3:]))),
		start: int64(binary.LittleEndian.Uint64(b[8:])),
		dur:   int64(binary.LittleEndian.Uint64(b[16:])),
	}
}

// benchTracer is the onebit.Tracer of one rank's onebit case: it records
// the spans of the timed calls (call >= 0) and ignores the warm-up's.
type benchTracer struct {
	mu     sync.Mutex
	call   int // the timed call under way; -1 during warm-up
	events []traceEvent
	// base is when the tracer was made: every start is placed at base's
	// wall-clock time plus the monotonic time since base (at), so that
	// the spans of one rank keep their order and nesting when the wall
	// clock is adjusted under them (a phase ended 25 us after its call in
	// a run of TestBenchTraceInOrder beside other load, when both were
	// placed by their own wall-clock readings).
	base time.Time
}

func newBenchTracer() *benchTracer { return &benchTracer{call: -1, base: time.Now()} }

// at is t as nanoseconds since the Unix epoch, by base's wall clock and
// the monotonic clock from there.
func (t *benchTracer) at(u time.Time) int64 { return t.base.UnixNano() + int64(u.Sub(t.base)) }

// Span implements onebit.Tracer.
func (t *benchTracer) Span(ph onebit.Phase, piece int, start, end time.Time) {
	t.mu.Lock()
	if t.call >= 0 {
		t.events = append(t.events, traceEvent{ph: int(ph), piece: piece, call: t.call,
			start: t.at(start), dur: int64(end.Sub(start))})
	}
	t.mu.Unlock()
}

// begin marks the start of timed call i; no call is under way.
func (t *benchTracer) begin(i int) {
	t.mu.Lock()
	t.call = i
	t.mu.Unlock()
}

// end records timed call i as a whole, from start to end.
func (t *benchTracer) end(i int, start, end time.Time) {
	t.mu.Lock()
	t.events = append(t.events, traceEvent{ph: phaseCall, call: i, start: t.at(start), dur: int64(end.Sub(start))})
	t.mu.Unlock()
}

// gatherTrace gives every rank every rank's events (the Comm has no gather
// to one root): an all-gather of the counts, then one of the events, each
// rank's padded to the largest count.
func gatherTrace(ctx context.Context, c comm.Comm, events []traceEvent) ([][]traceEvent, error) {
	w := c.Size()
	counts := make([]byte, 8*w)
	if err := c.AllGatherBytes(ctx, binary.LittleEndian.AppendUint64(nil, uint64(len(events))), counts); err != nil {
		return nil, err
	}
	most := 0
	for j := range w {
		most = max(most, int(binary.LittleEndian.Uint64(counts[8*j:])))
	}
	send, all := make([]byte, most*traceEventLen), make([]byte, w*most*traceEventLen)
	for i, e := range events {
		e.put(send[i*traceEventLen:])
	}
	if err := c.AllGatherBytes(ctx, send, all); err != nil {
		return nil, err
	}
	out := make([][]traceEvent, w)
	for j := range w {
		n := int(binary.LittleEndian.Uint64(counts[8*j:]))
		out[j] = make([]traceEvent, n)
		for i := range n {
			out[j][i] = getTraceEvent(all[(j*most+i)*traceEventLen:])
		}
	}
	return out, nil
}

// tracedSize is what rank 0 keeps of one traced onebit size.
type tracedSize struct {
	bytes     int64
	pipelined bool
	ranks     [][]traceEvent // per rank
}

// phaseP50s returns, per rank and phase (onebit's, then phaseCall), the
// median over calls of the phase's total time in one call, in
// nanoseconds, and which phases occurred at all.
func (ts *tracedSize) phaseP50s(calls int) (p50 [][]int64, seen []bool) {
	seen = make([]bool, phaseCall+1)
	p50 = make([][]int64, len(ts.ranks))
	perCall := make([]int64, calls)
	for r, events := range ts.ranks {
		p50[r] = make([]int64, phaseCall+1)
		for ph := range phaseCall + 1 {
			clear(perCall)
			for _, e := range events {
				if e.ph == ph && e.call >= 0 && e.call < calls {
					perCall[e.call] += e.dur
					seen[ph] = true
				}
			}
			sorted := slices.Clone(perCall)
			slices.Sort(sorted)
			p50[r][ph] = percentile(sorted, 0.5)
		}
	}
	return p50, seen
}

// writeTraceSummary writes the per-phase table of one traced size: per
// rank, the p50 over calls of each phase's total time in a call (ms).
func writeTraceSummary(w io.Writer, ts *tracedSize, calls int) error {
	p50, seen := ts.phaseP50s(calls)
	var b strings.Builder
	note := "not pipelined: the phases run one after the other"
	switch {
	case !ts.pipelined && seen[onebit.PhaseWait]:
		note = "not pipelined, the collectives started: all-to-all spans worker-error, all-gather spans " +
			"server-compress, the own chunk's decompress and worker-error's rest, run while the data travels; wait is the caller blocked at their end"
	case ts.pipelined:
		note = "pipelined: the collectives (all-to-all, all-gather) run without the caller (started by it, or on a goroutine of their own), " +
			"overlapping the rest; wait is the caller blocked on them"
	}
	fmt.Fprintf(&b, "# onebit %s per phase, ms: p50 over %d calls of the phase's total in a call (%s)\n",
		size.Format(ts.bytes), calls, note)
	fmt.Fprintf(&b, "%-6s", "rank")
	for ph, ok := range seen {
		if ok {
			fmt.Fprintf(&b, " %*s", max(8, len(phaseName(ph))), phaseName(ph))
		}
	}
	b.WriteString("\n")
	for r := range p50 {
		fmt.Fprintf(&b, "%-6d", r)
		for ph, ok := range seen {
			if ok {
				fmt.Fprintf(&b, " %*.2f", max(8, len(phaseName(ph))), float64(p50[r][ph])/1e6)
			}
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// chromeEvent is one event of the Chrome trace-event format.
type chromeEvent struct {
	Name string         `json:"name"`
	Ph   string         `json:"ph"`
	Ts   float64        `json:"ts"`            // microseconds
	Dur  float64        `json:"dur,omitempty"` // microseconds
	Pid  int            `json:"pid"`
	Tid  int            `json:"tid"`
	Args map[string]any `json:"args,omitempty"`
}

// Threads of a rank in the trace: the caller's phases and the calls, and
// the collectives (which may run without the caller: started by it, or on
// a goroutine of their own).
const (
	tidCaller      = 0
	tidCollectives = 1
)

// writeChromeTrace writes the traced sizes to name as Chrome trace-event
// JSON: one process per rank, times in microseconds from the first event.
func writeChromeTrace(name string, sizes []*tracedSize) error {
	var origin int64
	first := true
	for _, ts := range sizes {
		for _, events := range ts.ranks {
			for _, e := range events {
				if first || e.start < origin {
					origin, first = e.start, false
				}
			}
		}
	}
	var out []chromeEvent
	if len(sizes) > 0 {
		for r := range sizes[0].ranks {
			out = append(out,
				chromeEvent{Name: "process_name", Ph: "M", Pid: r, Args: map[string]any{"name": fmt.Sprintf("rank %d", r)}},
				chromeEvent{Name: "thread_name", Ph: "M", Pid: r, Tid: tidCaller, Args: map[string]any{"name": "caller"}},
				chromeEvent{Name: "thread_name", Ph: "M", Pid: r, Tid: tidCollectives, Args: map[string]any{"name": "collectives"}})
		}
	}
	for _, ts := range sizes {
		for r, events := range ts.ranks {
			for _, e := range events {
				tid := tidCaller
				if e.ph != phaseCall && onebit.Phase(e.ph).Collective() {
					tid = tidCollectives
				}
				args := map[string]any{"size": size.Format(ts.bytes), "call": e.call}
				if e.ph != phaseCall {
					args["piece"] = e.piece
				}
				out = append(out, chromeEvent{Name: phaseName(e.ph), Ph: "X",
					Ts: float64(e.start-origin) / 1e3, Dur: float64(e.dur) / 1e3, Pid: r, Tid: tid, Args: args})
			}
		}
	}
	f, err := os.Create(name)
	if err != nil {
		return fmt.Errorf("trace: %w", err)
	}
	enc := json.NewEncoder(f)
	if err := enc.Encode(struct {
		TraceEvents     []chromeEvent `json:"traceEvents"`
		DisplayTimeUnit string        `json:"displayTimeUnit"`
	}{out, "ms"}); err != nil {
		f.Close()
		return fmt.Errorf("trace: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("trace: %w", err)
	}
	return nil
}
