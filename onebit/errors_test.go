package onebit_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
	"github.com/lowbit-ml/lowbit/quant"
)

// prefixes are the package prefixes of lowbit's errors.
var prefixes = []string{"optim", "onebit", "zero", "quant", "comm", "local", "mpi"}

// assertPrefixOnce requires err's message to start with a package prefix
// and to carry no package's prefix twice (at the start or after ": ").
func assertPrefixOnce(t *testing.T, what string, err error) {
	t.Helper()
	require.Error(t, err, what)
	msg := err.Error()
	t.Logf("%s: %s", what, msg)
	head, _, ok := strings.Cut(msg, ": ")
	assert.True(t, ok && strings.Contains(strings.Join(prefixes, " "), head), "%s: %q does not start with a package prefix", what, msg)
	for _, p := range prefixes {
		n := strings.Count(": "+msg, ": "+p+": ")
		assert.LessOrEqual(t, n, 1, "%s: %q carries %q %d times", what, msg, p+": ", n)
	}
}

// failing is a communicator whose collectives other than AllReduce fail:
// the finite-gradient agreement (an AllReduce) passes on every rank, and
// what comes after it fails on every rank alike.
type failing struct{ comm.Comm }

var errInjected = errors.New("injected failure")

func (f failing) ReduceScatter(context.Context, []float32, []float32, comm.Op) error {
	return errInjected
}
func (f failing) AllGather(context.Context, []float32, []float32) error { return errInjected }
func (f failing) AllGatherBytes(context.Context, []byte, []byte) error  { return errInjected }
func (f failing) AllToAll(context.Context, []float32, []float32) error  { return errInjected }
func (f failing) AllToAllBytes(context.Context, []byte, []byte) error   { return errInjected }

// TestErrorPrefixOnce: a representative set of errors of the optimizers
// (constructors, Step inside and outside the compressed allreduce, SetLR,
// Load, Close) and of the schedules and quant constructors carry their
// package prefix once.
func TestErrorPrefixOnce(t *testing.T) {
	ctx := context.Background()
	type mk func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error)
	adam1 := onebit.DefaultAdamConfig()
	adam1.FreezeStep = 0
	lamb1 := onebit.DefaultLambConfig()
	lamb1.FreezeStep = 1
	zo := onebit.DefaultZeroOneAdamConfig()
	zo.VarFreezeStep = 1
	fp16 := optim.DefaultAdamConfig()
	fp16.Reduce = optim.ReduceFP16
	opts := []struct {
		name string
		mk   mk
	}{
		{"optim.Adam", func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			return optim.NewAdam(ctx, c, p, fp16)
		}},
		{"optim.Lamb", func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			return optim.NewLamb(ctx, c, p, optim.LambConfig{AdamConfig: fp16, MaxCoeff: 10})
		}},
		{"onebit.Adam", func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewAdam(ctx, c, p, adam1)
		}},
		{"onebit.Lamb", func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewLamb(ctx, c, p, lamb1)
		}},
		{"onebit.ZeroOneAdam", func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewZeroOneAdam(ctx, c, p, zo)
		}},
		{"zero.Adam", func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			return zero.NewAdam(ctx, c, p, zero.DefaultConfig())
		}},
	}
	for _, o := range opts {
		t.Run(o.name, func(t *testing.T) {
			// Constructor: a nil parameter.
			_, err := o.mk(ctx, nil, []*optim.Param{nil})
			assertPrefixOnce(t, "nil parameter", err)

			opt, err := o.mk(ctx, nil, configParams())
			require.NoError(t, err)
			// SetLR and SetSchedule (the frame's checks).
			if s, ok := opt.(optim.LRSetter); ok {
				assertPrefixOnce(t, "SetLR", s.SetLR(-1))
			}
			// Step with a parameter resized after construction.
			p := opt.Params()[0]
			saved := p.Value
			p.Value = optim.NewParam("w", 4).Value
			assertPrefixOnce(t, "resized parameter", opt.Step(ctx))
			p.Value = saved
			// Load of another algorithm's checkpoint.
			other, err := optim.NewAdam(ctx, nil, configParams(), optim.DefaultAdamConfig())
			require.NoError(t, err)
			ck, err := other.State()
			require.NoError(t, err)
			if o.name != "optim.Adam" {
				assertPrefixOnce(t, "Load", opt.Load(ck))
			}
			// Step after Close.
			require.NoError(t, opt.Close())
			err = opt.Step(ctx)
			assert.ErrorIs(t, err, optim.ErrClosed)
			assertPrefixOnce(t, "Step after Close", err)

			// A communicator error inside the step's collectives (after the
			// finite-gradient agreement): the averaging in fp16, the 1-bit
			// allreduce, zero's reduce-scatter.
			errs := make([]error, 2)
			_ = local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
				opt, err := o.mk(ctx, failing{c}, configParams())
				if err != nil { // zero.Adam agrees on its arguments at construction
					errs[c.Rank()] = err
					return nil
				}
				defer opt.Close()
				// The warm-up stages average with AllReduce: step until the
				// first collective that fails.
				for range 3 {
					if errs[c.Rank()] = opt.Step(ctx); errs[c.Rank()] != nil {
						break
					}
				}
				return nil
			})
			for r, err := range errs {
				assertPrefixOnce(t, "communicator error on rank "+string(rune('0'+r)), err)
				assert.ErrorIs(t, err, errInjected, "rank %d", r)
			}
		})
	}

	_, err := optim.CosineDecay(-1, 0, 10)
	assertPrefixOnce(t, "CosineDecay", err)
	_, err = optim.ConstantLR(-1)
	assertPrefixOnce(t, "ConstantLR", err)
	var qerr error
	require.NoError(t, local.Run(ctx, 1, func(ctx context.Context, c comm.Comm) error {
		l, err := comm.NewLayout(ctx, c, 1)
		if err != nil {
			return err
		}
		defer l.Close()
		_, qerr = quant.NewQGZ(ctx, l, 10, quant.QGZConfig{Bits: 5})
		return nil
	}))
	assertPrefixOnce(t, "NewQGZ", qerr)
}

// splitRecorder records the communicators split off it.
type splitRecorder struct {
	comm.Comm
	subs *[]comm.Comm
}

func (s splitRecorder) Split(ctx context.Context, color, key int) (comm.Comm, error) {
	sub, err := s.Comm.Split(ctx, color, key)
	if err == nil {
		*s.subs = append(*s.subs, sub)
	}
	return sub, err
}

// TestCloseReleasesSplits: every optimizer that splits communicators off
// its group (two-level averaging in the warm-up of the 1-bit optimizers,
// the node layout of zero's int8 mode) closes them in Close, which is
// idempotent, and refuses Step afterwards with optim.ErrClosed.
func TestCloseReleasesSplits(t *testing.T) {
	two := optim.DefaultAdamConfig()
	two.Reduce, two.RanksPerNode = optim.ReduceTwoLevel, 2
	a := onebit.DefaultAdamConfig()
	a.AdamConfig = two
	l := onebit.DefaultLambConfig()
	l.AdamConfig = two
	z := onebit.DefaultZeroOneAdamConfig()
	z.AdamConfig = two
	zc := zero.DefaultConfig()
	zc.ReduceScatter, zc.RanksPerNode = zero.ReduceInt8, 2
	for name, mk := range map[string]func(context.Context, comm.Comm, []*optim.Param) (optim.Optimizer, error){
		"onebit.Adam": func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewAdam(ctx, c, p, a)
		},
		"onebit.Lamb": func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewLamb(ctx, c, p, l)
		},
		"onebit.ZeroOneAdam": func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewZeroOneAdam(ctx, c, p, z)
		},
		"zero.Adam": func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			return zero.NewAdam(ctx, c, p, zc)
		},
	} {
		err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Comm) error {
			var subs []comm.Comm
			ps := configParams()
			opt, err := mk(ctx, splitRecorder{c, &subs}, ps)
			if err != nil {
				return err
			}
			for i := range ps[0].GradData() {
				ps[0].GradData()[i] = float32(c.Rank() + i)
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
			require.NotEmpty(t, subs, "%s: the first step (or the constructor) splits the group", name)
			require.NoError(t, opt.Close())
			for _, s := range subs {
				assert.ErrorIs(t, s.Barrier(ctx), comm.ErrClosed, "%s: a split communicator is still open", name)
			}
			require.NoError(t, opt.Close(), "%s: Close is idempotent", name)
			assert.ErrorIs(t, opt.Step(ctx), optim.ErrClosed, name)
			return nil
		})
		require.NoError(t, err, name)
	}
}
