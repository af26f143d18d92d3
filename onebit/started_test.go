package onebit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// startComm gives an in-process rank comm.Starter: the started
// collectives run the blocking ones, in the order started, on a goroutine
// of their own, so that the call goes on computing while they travel, as
// on comm/mpi, and the race detector sees any pass that touches their
// buffers meanwhile. starts counts the collectives started; stop ends the
// goroutine.
type startComm struct {
	comm.Comm
	starts  *atomic.Int64 // the data collectives started
	headers *atomic.Int64 // the headers started (onebit.HeaderLen bytes), if not nil
	jobs    chan func()
}

func (s *startComm) stop() {
	if s.jobs != nil {
		close(s.jobs)
	}
}

func (s *startComm) Starts() bool { return true }

func (s *startComm) StartAllToAllBytes(ctx context.Context, send, recv []byte) (comm.Request, error) {
	return s.start(s.starts, func() error { return s.Comm.AllToAllBytes(ctx, send, recv) }), nil
}

func (s *startComm) StartAllGatherBytes(ctx context.Context, send, recv []byte) (comm.Request, error) {
	count := s.starts
	if len(send) == onebit.HeaderLen {
		count = s.headers
	}
	return s.start(count, func() error { return s.Comm.AllGatherBytes(ctx, send, recv) }), nil
}

// start runs run on the communicator's goroutine and counts it in count
// (if not nil).
func (s *startComm) start(count *atomic.Int64, run func() error) comm.Request {
	if count != nil {
		count.Add(1)
	}
	if s.jobs == nil {
		s.jobs = make(chan func(), 64)
		go func() {
			for job := range s.jobs {
				job()
			}
		}()
	}
	r := &goRequest{done: make(chan error, 1)}
	s.jobs <- func() { r.done <- run() }
	return r
}

type goRequest struct {
	done     chan error
	finished bool
	err      error
}

func (r *goRequest) Test() (bool, error) {
	if !r.finished {
		select {
		case r.err = <-r.done:
			r.finished = true
		default:
			return false, nil
		}
	}
	return true, r.err
}

func (r *goRequest) Wait() error {
	if !r.finished {
		r.err, r.finished = <-r.done, true
	}
	return r.err
}

// startedRun runs calls AllReduce calls of n elements on w ranks, in at
// most pieces pieces per chunk, each rank's communicator a startComm if
// started says so (overlap off on the ranks in blocking), and returns
// every rank's output and error buffers after the last call and the
// collectives started.
func startedRun(t *testing.T, w, n, pieces, calls int, started bool, blocking ...int) ([][]float32, int64) {
	out := make([][]float32, 3*w)
	var starts atomic.Int64
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		if started {
			sc := &startComm{Comm: c, starts: &starts}
			defer sc.stop()
			c = sc
		}
		st, err := onebit.NewState(n, w)
		if err != nil {
			return err
		}
		st.SetPieces(pieces)
		st.SetOverlap(!slices.Contains(blocking, r))
		rng := rand.New(rand.NewPCG(uint64(r), 11))
		buf := make([]float32, n)
		for range calls {
			copy(buf, randn(rng, n))
			if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
				return err
			}
		}
		out[r], out[w+r], out[2*w+r] = buf, slices.Clone(st.WorkerError), slices.Clone(st.ServerError)
		return nil
	})
	require.NoError(t, err)
	return out, starts.Load()
}

// A call whose collectives travel while it computes gives the bits of one
// that runs them blocking: outputs and both error buffers, over calls,
// padded or not, in whole chunks and in pieces (against whole chunks run
// blocking). Tensors of less than 1M elements run them blocking anyway.
func TestStartedBitIdentical(t *testing.T) {
	big := startBig(t)
	ws, ks := []int{1, 2, 3, 4}, []int{2, 4}
	if raceOn {
		ws, ks = []int{1, 3}, []int{3}
	}
	for _, w := range ws {
		sizes := []int{5 * w, 1000*w + 3, big + 3, 3*big + 1}
		if raceOn {
			sizes = []int{5 * w, big + 3}
		}
		for _, n := range sizes {
			want, none := startedRun(t, w, n, 1, 3, false)
			got, starts := startedRun(t, w, n, 1, 3, true)
			assert.Zero(t, none)
			if n < big {
				assert.Zero(t, starts, "w=%d n=%d: too small to start", w, n)
			} else {
				assert.Equal(t, int64(3*2*w), starts, "w=%d n=%d: every call starts both collectives", w, n)
			}
			for i := range want {
				require.Equal(t, want[i], got[i], "w=%d n=%d buffer %d", w, n, i)
			}
			if w == 1 || n < big {
				continue
			}
			for _, k := range ks {
				got, starts := startedRun(t, w, n, k, 3, true)
				assert.Equal(t, int64(3*2*k*w), starts, "w=%d n=%d: every call starts 2 collectives per piece", w, n)
				for i := range want {
					require.Equal(t, want[i], got[i], "w=%d n=%d %d pieces buffer %d", w, n, k, i)
				}
			}
		}
	}
}

// A rank whose State has overlap off makes every rank run the call's
// collectives blocking (MPI's non-blocking collectives do not match
// blocking ones): no rank starts one, and the bits are the same.
func TestStartedNeedsEveryRank(t *testing.T) {
	const w = 3
	n := startBig(t)
	want, _ := startedRun(t, w, n, 1, 2, false)
	for _, k := range []int{1, 3} {
		got, starts := startedRun(t, w, n, k, 2, true, 1)
		assert.Zero(t, starts, "%d pieces", k)
		for i := range want {
			require.Equal(t, want[i], got[i], "%d pieces buffer %d", k, i)
		}
	}
}

// A whole-chunk call starts its header where it may start its collectives
// (it travels during the first pass), on every rank that may, whatever the
// others do: a started header and a blocking one are the same exchange.
// A pipelined call and a call too small to start exchange it blocking.
func TestStartedHeader(t *testing.T) {
	const w, calls = 3, 2
	big := startBig(t)
	for _, tc := range []struct {
		n, pieces int
		blocking  []int
		want      int64
	}{
		{big, 1, nil, w * calls},
		{big, 1, []int{1}, (w - 1) * calls},
		{big, 3, nil, 0},
		{1000, 1, nil, 0},
	} {
		var starts, headers atomic.Int64
		err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
			sc := &startComm{Comm: c, starts: &starts, headers: &headers}
			defer sc.stop()
			st, err := onebit.NewState(tc.n, w)
			if err != nil {
				return err
			}
			st.SetPieces(tc.pieces)
			st.SetOverlap(!slices.Contains(tc.blocking, c.Rank()))
			buf := make([]float32, tc.n)
			for range calls {
				if err := onebit.AllReduce(ctx, sc, buf, st); err != nil {
					return err
				}
			}
			return nil
		})
		require.NoError(t, err)
		assert.Equal(t, tc.want, headers.Load(), "%+v", tc)
	}
}

// 1-bit Adam takes the same steps on ranks that start their collectives as
// on ranks that run them blocking, in each of its state modes (the sharded
// mode's worker error kept in bfloat16 forms x a block at a time).
func TestStartedAdamModes(t *testing.T) {
	const w, steps = 4, 3
	n := startBig(t) + 5
	modes := []struct {
		mode onebit.StateMode
		bf   onebit.BF16State
	}{
		{onebit.StateFull, 0}, {onebit.StateCompact, 0}, {onebit.StateSharded, 0},
		{onebit.StateSharded, onebit.BF16WorkerError | onebit.BF16Variance},
	}
	if raceOn {
		modes = []struct {
			mode onebit.StateMode
			bf   onebit.BF16State
		}{{onebit.StateFull, 0}, {onebit.StateSharded, onebit.BF16WorkerError | onebit.BF16Variance}}
	}
	for _, tc := range modes {
		run := func(started bool) ([][]float32, int64) {
			out := make([][]float32, w)
			var starts atomic.Int64
			err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
				r := c.Rank()
				if started {
					sc := &startComm{Comm: c, starts: &starts}
					defer sc.stop()
					c = sc
				}
				cfg := onebit.DefaultAdamConfig()
				cfg.LR, cfg.FreezeStep = 0.01, 2
				cfg.StateMode, cfg.BF16 = tc.mode, tc.bf
				p := optim.NewParam("w", n)
				for i := range p.Data() {
					p.Data()[i] = float32(math.Sin(float64(i)))
				}
				opt, err := onebit.NewAdam(ctx, c, []*optim.Param{p}, cfg)
				if err != nil {
					return err
				}
				for s := range steps {
					for i := range p.GradData() {
						p.GradData()[i] = float32(math.Cos(float64(s*7919+r*104729+3*i))) * float32(1+r)
					}
					if err := opt.Step(ctx); err != nil {
						return err
					}
				}
				out[r] = p.Data()
				return nil
			})
			require.NoError(t, err)
			return out, starts.Load()
		}
		want, _ := run(false)
		got, starts := run(true)
		assert.Positive(t, starts, "%v %v", tc.mode, tc.bf)
		for r := range want {
			require.Equal(t, want[r], got[r], "%v %v rank %d", tc.mode, tc.bf, r)
		}
	}
}

// A tuning State on ranks that start their collectives tries, in its
// opening, pieces, whole chunks started and whole chunks blocking, the
// same on every rank, and gives the bits of whole chunks run blocking.
func TestTuneStartedWays(t *testing.T) {
	const w, calls = 3, 18
	n := startBig(t) + 3
	want, _ := startedRun(t, w, n, 1, calls, false)
	out := make([][]float32, 3*w)
	pieces, started := make([][]int, w), make([][]bool, w)
	var starts atomic.Int64
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		sc := &startComm{Comm: c, starts: &starts}
		defer sc.stop()
		st, err := onebit.NewState(n, w)
		if err != nil {
			return err
		}
		onebit.TunePieces(st, 2)
		rng := rand.New(rand.NewPCG(uint64(r), 11))
		buf := make([]float32, n)
		for range calls {
			copy(buf, randn(rng, n))
			if err := onebit.AllReduce(ctx, sc, buf, st); err != nil {
				return err
			}
			pieces[r] = append(pieces[r], st.Pieces())
			started[r] = append(started[r], st.Started())
		}
		out[r], out[w+r], out[2*w+r] = buf, slices.Clone(st.WorkerError), slices.Clone(st.ServerError)
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, []int{2, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1}, pieces[0][:16], "the opening's cuts")
	assert.Equal(t, []bool{true, true, true, false, true, true, false, true, true, false, true, true, false, true, true, false},
		started[0][:16], "the opening's collectives started")
	for r := range w {
		assert.Equal(t, pieces[0], pieces[r], "rank %d", r)
		assert.Equal(t, started[0], started[r], "rank %d", r)
	}
	for i := range want {
		require.Equal(t, want[i], out[i], "buffer %d", i)
	}
}

// startBig is the length from which the started tests' tensors start their
// collectives: startMin's 1M, or 64Ki under the race detector, progressed
// every 16Ki elements instead of 256Ki (SetStartSizes): the collectives'
// goroutines and the polls between passes are what it checks, and 1M
// elements a rank took most of its run.
func startBig(t *testing.T) int {
	if !raceOn {
		return 1 << 20
	}
	onebit.SetStartSizes(t, 1<<16, 16<<10)
	return 1 << 16
}
