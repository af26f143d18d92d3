package onebit_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/conformance"
	"github.com/lowbit-ml/lowbit/onebit"
)

func f32bytes(p []float32) []byte {
	if len(p) == 0 {
		return []byte{}
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&p[0])), 4*len(p))
}

// deviceRank is one rank's tensor and state on a device.
type deviceRank struct {
	dev accel.Device
	buf accel.Span
	st  *onebit.DeviceState
}

func newDeviceRank(t testing.TB, dev accel.Device, n, w int) *deviceRank {
	b, err := dev.Alloc(4 * n)
	require.NoError(t, err)
	st, err := onebit.NewDeviceState(dev, n, w)
	require.NoError(t, err)
	return &deviceRank{dev: dev, buf: accel.Whole(b), st: st}
}

// step runs one device allreduce of in and returns the output and both
// error buffers, copied to the host.
func (d *deviceRank) step(ctx context.Context, c comm.Comm, in []float32) (out, worker, server []float32, err error) {
	if err := d.dev.CopyIn(d.buf, f32bytes(in)); err != nil {
		return nil, nil, nil, err
	}
	if err := onebit.AllReduceDevice(ctx, c, d.buf, d.st); err != nil {
		return nil, nil, nil, err
	}
	out = make([]float32, len(in))
	if err := d.dev.CopyOut(f32bytes(out), d.buf); err != nil {
		return nil, nil, nil, err
	}
	worker = make([]float32, d.st.WorkerError().Elems())
	server = make([]float32, d.st.ServerError().Elems())
	return out, worker, server, d.st.Errors(worker, server)
}

// sameBits returns an error naming the first element of got that is not
// bit for bit want's. (The ranks run on goroutines: they return errors
// rather than stop the test.)
func sameBits(what string, want, got []float32) error {
	if len(got) != len(want) {
		return fmt.Errorf("%s: length %d, host path %d", what, len(got), len(want))
	}
	for i := range want {
		if math.Float32bits(want[i]) != math.Float32bits(got[i]) {
			return fmt.Errorf("%s[%d] = %g (%#08x), host path %g (%#08x): not bit-identical",
				what, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
		}
	}
	return nil
}

// stepBoth runs one step of in on the host path (host) and on the device
// and compares them bit for bit.
func (d *deviceRank) stepBoth(ctx context.Context, c comm.Comm, host *onebit.State, in []float32, what string) error {
	buf := append([]float32(nil), in...)
	if err := onebit.AllReduce(ctx, c, buf, host); err != nil {
		return err
	}
	out, worker, server, err := d.step(ctx, c, in)
	if err != nil {
		return err
	}
	return sameAsHost(what, host, buf, out, worker, server)
}

// sameAsHost compares a device step's output and errors bit for bit with
// the host path's (its output want and its state host).
func sameAsHost(what string, host *onebit.State, want, out, worker, server []float32) error {
	if err := sameBits(what+" output", want, out); err != nil {
		return err
	}
	if err := sameBits(what+" worker error", host.WorkerError, worker); err != nil {
		return err
	}
	return sameBits(what+" server error", host.ServerError, server)
}

// TestAllReduceDeviceMatchesHost runs AllReduce and AllReduceDevice (on the
// CPU device) side by side on the same inputs for several steps: outputs
// and both error buffers must be bit-identical. (The two sum the norms in
// different orders, so a scale could in principle round differently, about
// once in 10^8; with these fixed inputs none does, and the check stays
// exact so that any real difference in the arithmetic shows.)
//
// The CPU device writes the output of every chunk in one operation
// (accel.ChunkUnpacker); wrapped in plainDevice, which hides that, the
// collective unpacks chunk by chunk: both paths are checked.
func TestAllReduceDeviceMatchesHost(t *testing.T) {
	for _, w := range []int{1, 2, 3, 4, 8} {
		for _, n := range []int{1, 7, 8, 100, 1000, 4099} {
			for _, fused := range []bool{true, false} {
				t.Run(fmt.Sprintf("w%d/n%d/fused=%t", w, n, fused), func(t *testing.T) {
					err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
						r := c.Rank()
						rng := rand.New(rand.NewPCG(uint64(n), uint64(r)))
						host, err := onebit.NewState(n, w)
						if err != nil {
							return err
						}
						var d accel.Device = accel.NewCPU()
						if !fused {
							d = plainDevice{d}
						}
						dev := newDeviceRank(t, d, n, w)
						defer dev.st.Close()
						for k := 0; k < 4; k++ {
							in := randn(rng, n)
							if k == 2 && n > 4 { // zeros and signed zeros take the +1 branch
								in[0], in[1] = 0, float32(math.Copysign(0, -1))
							}
							if err := dev.stepBoth(ctx, c, host, in, fmt.Sprintf("rank %d step %d", r, k)); err != nil {
								return err
							}
						}
						return nil
					})
					require.NoError(t, err)
				})
			}
		}
	}
}

// plainDevice is a Device with none of the optional interfaces of package
// accel (ChunkUnpacker, HostAllocator).
type plainDevice struct{ accel.Device }

// TestAllReduceDeviceMixedRanks: device ranks and host ranks in one group
// speak the same wire format, pieces included, and choose between whole
// chunks and pieces together (pieces=0: tuned, with 4 pieces, so that the
// opening switches between the two). Ranks 0 and 2 of three run
// AllReduceDevice (CPU device), rank 1 AllReduce; every rank's output and
// errors are bit-identical to an all-host run.
func TestAllReduceDeviceMixedRanks(t *testing.T) {
	const w, n, steps = 3, 20_011, 6
	for _, pieces := range []int{1, 4, 0} {
		t.Run(fmt.Sprintf("pieces=%d", pieces), func(t *testing.T) {
			run := func(mixed bool) [][]float32 {
				outs := make([][]float32, w)
				err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
					r := c.Rank()
					rng := rand.New(rand.NewPCG(5, uint64(r)))
					var out []float32
					if mixed && r != 1 {
						dev := newDeviceRank(t, accel.NewCPU(), n, w)
						defer dev.st.Close()
						if pieces == 0 {
							onebit.TuneDevicePieces(dev.st, 4)
						} else {
							onebit.SetDevicePieces(dev.st, pieces)
						}
						for range steps {
							o, worker, server, err := dev.step(ctx, c, randn(rng, n))
							if err != nil {
								return err
							}
							out = append(append(o, worker...), server...)
						}
					} else {
						host, err := onebit.NewState(n, w)
						if err != nil {
							return err
						}
						if pieces == 0 {
							onebit.TunePieces(host, 4)
						} else {
							onebit.SetPieces(host, pieces)
						}
						for range steps {
							buf := randn(rng, n)
							if err := onebit.AllReduce(ctx, c, buf, host); err != nil {
								return err
							}
							out = append(append(buf, host.WorkerError...), host.ServerError...)
						}
					}
					outs[r] = out
					return nil
				})
				require.NoError(t, err)
				return outs
			}
			want, got := run(false), run(true)
			for r := range w {
				require.NoError(t, sameBits(fmt.Sprintf("rank %d output and errors", r), want[r], got[r]))
			}
		})
	}
}

// TestAllReduceDeviceConformance replays the conformance traces through
// AllReduceDevice on the CPU device: within the spec's tolerance of the
// reference, and bit-identical to AllReduce.
func TestAllReduceDeviceConformance(t *testing.T) {
	cases, err := conformance.Load(conformance.Dir())
	require.NoError(t, err)
	ran := 0
	for _, cs := range cases {
		if cs.Kind != "onebit" {
			continue
		}
		ran++
		t.Run(cs.Name, func(t *testing.T) {
			err := local.Run(ctxT(t), cs.World, func(ctx context.Context, c comm.Comm) error {
				r := c.Rank()
				host, err := onebit.NewState(cs.Numel, cs.World)
				if err != nil {
					return err
				}
				dev := newDeviceRank(t, accel.NewCPU(), cs.Numel, cs.World)
				defer dev.st.Close()
				for k, step := range cs.Steps {
					in := conformance.Floats(step.Inputs[r])
					out, worker, server, err := dev.step(ctx, c, in)
					if err != nil {
						return fmt.Errorf("step %d: %w", k, err)
					}
					if err := conformance.CompareFloats(fmt.Sprintf("step %d output", k), out, step.Output); err != nil {
						return err
					}
					if err := conformance.CompareFloats(fmt.Sprintf("step %d worker error", k), worker, step.WorkerError[r]); err != nil {
						return err
					}
					if err := conformance.CompareFloats(fmt.Sprintf("step %d server error", k), server, step.ServerError[r]); err != nil {
						return err
					}
					buf := append([]float32(nil), in...)
					if err := onebit.AllReduce(ctx, c, buf, host); err != nil {
						return err
					}
					if err := sameAsHost(fmt.Sprintf("step %d", k), host, buf, out, worker, server); err != nil {
						return err
					}
				}
				return nil
			})
			require.NoError(t, err)
		})
	}
	require.GreaterOrEqual(t, ran, 5, "every onebit vector must run")
}

func TestAllReduceDeviceBadInput(t *testing.T) {
	ctx := ctxT(t)
	cs, err := local.New(2)
	require.NoError(t, err)
	dev := accel.NewCPU()
	st, err := onebit.NewDeviceState(dev, 10, 2)
	require.NoError(t, err)
	b11, err := dev.Alloc(4 * 11)
	require.NoError(t, err)
	b10, err := dev.Alloc(4 * 10)
	require.NoError(t, err)

	// Rank 1 makes a valid call each time; rank 0's bad call still meets
	// it in the header, so both return at once: rank 0 with its own error,
	// rank 1 with one naming rank 0.
	peer := newDeviceRank(t, accel.NewCPU(), 10, 2)
	bad := func(buf accel.Span, st *onebit.DeviceState, want string) {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- onebit.AllReduceDevice(ctx, cs[1], peer.buf, peer.st) }()
		assert.ErrorContains(t, onebit.AllReduceDevice(ctx, cs[0], buf, st), want)
		assert.ErrorContains(t, <-done, "rank 0 refused the call")
	}
	bad(accel.Whole(b11), st, "state made for 10 elements")
	bad(accel.Whole(b10), nil, "nil state")
	st4, err := onebit.NewDeviceState(dev, 10, 4)
	require.NoError(t, err)
	bad(accel.Whole(b10), st4, "on 4 ranks")

	// A tensor on another device, or a span past the end of its buffer.
	other, err := accel.NewCPU().Alloc(4 * 10)
	require.NoError(t, err)
	bad(accel.Whole(other), st, "another device")
	bad(accel.Span{Buf: b10, Off: 4, Len: 40}, st, "out of a 40-byte buffer")

	// Host copies of the errors with the wrong length.
	assert.Error(t, st.Errors(make([]float32, 3), make([]float32, 8)))
	assert.Error(t, st.SetErrors(make([]float32, 16), make([]float32, 3)))

	_, err = onebit.NewDeviceState(nil, 10, 2)
	assert.Error(t, err)
	_, err = onebit.NewDeviceState(dev, -1, 2)
	assert.Error(t, err)

	// A freed state and a closed device give errors, not crashes.
	require.NoError(t, st.Close())
	bad(accel.Whole(b10), st, accel.ErrFreed.Error())
	require.NoError(t, dev.Close())
	_, err = onebit.NewDeviceState(dev, 10, 2)
	assert.Error(t, err)
}

// TestAllReduceDeviceMismatchedSizes: ranks whose tensors differ get an
// error on every rank, as with AllReduce.
func TestAllReduceDeviceMismatchedSizes(t *testing.T) {
	sizes := [2]int{5, 6}
	err := local.Run(ctxT(t), 2, func(ctx context.Context, c comm.Comm) error {
		d := newDeviceRank(t, accel.NewCPU(), sizes[c.Rank()], 2)
		err := onebit.AllReduceDevice(ctx, c, d.buf, d.st)
		var me *comm.MismatchError
		require.ErrorAs(t, err, &me, "rank %d", c.Rank())
		return nil
	})
	require.NoError(t, err)
}

// TestAllReduceDeviceResume: the device state holds its errors in the
// carried form; Errors turns them into residuals and SetErrors takes
// residuals back. A run checkpointed after two steps and resumed on a
// fresh state must go on bit for bit as the host path does without a
// break.
func TestAllReduceDeviceResume(t *testing.T) {
	const w, n = 3, 1001
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		rng := rand.New(rand.NewPCG(11, uint64(r)))
		host, err := onebit.NewState(n, w)
		if err != nil {
			return err
		}
		dev := newDeviceRank(t, accel.NewCPU(), n, w)
		for k := 0; k < 6; k++ {
			if k == 2 || k == 4 { // checkpoint, then resume on a new state (2) or the same (4)
				worker := make([]float32, dev.st.WorkerError().Elems())
				server := make([]float32, dev.st.ServerError().Elems())
				if err := dev.st.Errors(worker, server); err != nil {
					return err
				}
				if k == 2 {
					if err := dev.st.Close(); err != nil {
						return err
					}
					dev = newDeviceRank(t, accel.NewCPU(), n, w)
				}
				if err := dev.st.SetErrors(worker, server); err != nil {
					return err
				}
			}
			if err := dev.stepBoth(ctx, c, host, randn(rng, n), fmt.Sprintf("rank %d step %d", r, k)); err != nil {
				return err
			}
		}
		return dev.st.Close()
	})
	require.NoError(t, err)
}

func TestAllReduceDeviceEmptyAndReset(t *testing.T) {
	cs, err := local.New(1)
	require.NoError(t, err)
	d := newDeviceRank(t, accel.NewCPU(), 0, 1)
	require.NoError(t, onebit.AllReduceDevice(ctxT(t), cs[0], d.buf, d.st))

	d = newDeviceRank(t, accel.NewCPU(), 5, 1)
	require.NoError(t, d.st.SetErrors([]float32{1, 2, 3, 4, 5, 6, 7, 8}, []float32{1, 2, 3, 4, 5, 6, 7, 8}))
	require.NoError(t, d.st.Reset())
	worker, server := make([]float32, 8), make([]float32, 8)
	require.NoError(t, d.st.Errors(worker, server))
	assert.Equal(t, make([]float32, 8), worker)
	assert.Equal(t, make([]float32, 8), server)
}

func TestAllReduceDeviceAllocs(t *testing.T) {
	const w, n = 2, 4096
	cs, err := local.New(w)
	require.NoError(t, err)
	ctx := context.Background()
	ranks := make([]*deviceRank, w)
	for r := range ranks {
		ranks[r] = newDeviceRank(t, accel.NewCPU(), n, w)
		require.NoError(t, ranks[r].dev.CopyIn(ranks[r].buf, f32bytes(randn(rand.New(rand.NewPCG(3, uint64(r))), n))))
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 101; i++ {
			_ = onebit.AllReduceDevice(ctx, cs[1], ranks[1].buf, ranks[1].st)
		}
	}()
	allocs := testing.AllocsPerRun(100, func() { _ = onebit.AllReduceDevice(ctx, cs[0], ranks[0].buf, ranks[0].st) })
	<-done
	assert.Zero(t, allocs)
}

// serverFailingDevice is the CPU device whose server compression fails.
type serverFailingDevice struct{ accel.Device }

func (serverFailingDevice) SumCompressCarried(_, _ accel.Span, _ float32, _, _ accel.Span) (float32, error) {
	return 0, fmt.Errorf("injected server failure")
}

// TestAllReduceDeviceServerFailure: a rank whose device fails between the
// phases (after phase 1, before phase 2) still takes part in phase 2, so
// every rank returns an error promptly, the others naming it, unpipelined
// and pipelined, under a context that never ends.
func TestAllReduceDeviceServerFailure(t *testing.T) {
	for _, n := range []int{1000, 1 << 20} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			const w, bad = 3, 1
			errs := make([]error, w)
			start := time.Now()
			err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
				var dev accel.Device = accel.NewCPU()
				if c.Rank() == bad {
					dev = serverFailingDevice{dev}
				}
				d := newDeviceRank(t, dev, n, w)
				errs[c.Rank()] = onebit.AllReduceDevice(ctx, c, d.buf, d.st)
				return nil
			})
			require.NoError(t, err)
			assert.Less(t, time.Since(start), 5*time.Second)
			for r, e := range errs {
				require.Error(t, e, "rank %d", r)
				assert.NotErrorIs(t, e, comm.ErrAborted, "rank %d", r)
				if r == bad {
					assert.ErrorContains(t, e, "injected server failure")
				} else {
					assert.ErrorContains(t, e, "rank 1 failed its server compression")
				}
			}
		})
	}
}
