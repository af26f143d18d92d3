package onebit_test

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/errorfeedback"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// muonModes are 1-bit Muon's state modes as the command lines name them.
var muonModes = []string{"full", "compact", "compact-bf16", "owners", "owners2"}

// muonWarmupModes are muonModes with WarmupAdamWOnly, named with the
// suffix muonModeConfig takes.
var muonWarmupModes = []string{"full+warmup-adamw", "compact+warmup-adamw", "compact-bf16+warmup-adamw", "owners+warmup-adamw"}

// muonModeConfig is muonTestConfig(freeze) in the state mode named mode
// ("owners": StateFull with ExchangeOwners, "owners2" the same with
// OwnerBits 2), with WarmupAdamWOnly where mode ends in "+warmup-adamw".
func muonModeConfig(t testing.TB, freeze int, mode string) onebit.MuonConfig {
	t.Helper()
	cfg := muonTestConfig(freeze)
	var err error
	mode, cfg.WarmupAdamWOnly = strings.CutSuffix(mode, "+warmup-adamw")
	switch mode {
	case "owners":
		mode, cfg.Exchange = "full", onebit.ExchangeOwners
	case "owners2":
		mode, cfg.Exchange, cfg.OwnerBits = "full", onebit.ExchangeOwners, 2
	}
	cfg.StateMode, cfg.MomentumBF16, err = onebit.ParseMuonStateMode(mode)
	require.NoError(t, err)
	return cfg
}

// An invalid combination is a ConfigError: StateSharded, MomentumBF16
// without StateCompact, an unknown name on the command line.
func TestMuonCompactConfig(t *testing.T) {
	cfg := muonTestConfig(2)
	cfg.StateMode = onebit.StateSharded
	var ce *optim.ConfigError
	require.ErrorAs(t, cfg.Validate(), &ce)
	assert.Equal(t, "StateMode", ce.Field)
	cfg.StateMode, cfg.MomentumBF16 = onebit.StateFull, true
	require.ErrorAs(t, cfg.Validate(), &ce)
	assert.Equal(t, "MomentumBF16", ce.Field)
	cfg.StateMode = onebit.StateCompact
	require.NoError(t, cfg.Validate())
	_, _, err := onebit.ParseMuonStateMode("sharded")
	require.ErrorContains(t, err, `unknown Muon state mode "sharded"`)
}

// The first compression step of the compact mode (float32 momentum) is
// StateFull's to bfloat16 precision: the inputs added into the worker
// errors are rounded to bfloat16 (8 significant bits), which keeps every
// sign and moves the scales, and with them each parameter's step, by less
// than 2^-9 of the step (measured: 1.1e-5 to 1.5e-5 of it). On 3 ranks no
// element of the server's sum is near zero, so no sign flips there. So is
// the first step with WarmupAdamWOnly, the Muon group's compressed and the
// AdamW group's exact, whose parameters are then StateFull's bit for bit
// through the warm-up.
func TestMuonCompactFirstStepIsFullsToBF16(t *testing.T) {
	const w, freeze = 3, 2
	for _, tc := range []struct {
		full, compact string
		first, steps  int // the first compressed step, the steps run
	}{{"full", "compact", freeze + 1, freeze + 1}, {"full+warmup-adamw", "compact+warmup-adamw", 1, freeze}} {
		t.Run(tc.compact, func(t *testing.T) {
			var mu sync.Mutex
			got := map[string][][][]float32{} // mode: [step][param] on rank 0, step 0 the initial values
			for _, mode := range []string{tc.full, tc.compact} {
				got[mode] = make([][][]float32, tc.steps+1)
				for _, p := range muonParams() {
					got[mode][0] = append(got[mode][0], p.Data())
				}
				muonRun(t, w, tc.steps, muonModeConfig(t, freeze, mode), func(s, r int, _ *onebit.Muon, ps []*optim.Param) error {
					if r == 0 {
						mu.Lock()
						for _, p := range ps {
							got[mode][s] = append(got[mode][s], append([]float32(nil), p.Data()...))
						}
						mu.Unlock()
					}
					return nil
				})
			}
			full, compact := got[tc.full], got[tc.compact]
			require.Equal(t, full[tc.first-1], compact[tc.first-1], "the steps before are the same")
			for i, pm := range muonModel {
				before, f, c := full[tc.first-1][i], full[tc.first][i], compact[tc.first][i]
				var step, dev float64
				for k := range f {
					step = max(step, math.Abs(float64(f[k])-float64(before[k])))
					dev = max(dev, math.Abs(float64(c[k])-float64(f[k])))
				}
				t.Logf("%s: largest step %.3g, largest difference %.3g (%.2g of it)", pm.name, step, dev, dev/step)
				require.Positive(t, step)
				assert.LessOrEqual(t, dev, step/512, pm.name)
			}
			for s := tc.first; s <= tc.steps && tc.first <= freeze; s++ {
				for i, pm := range muonModel[3:] {
					require.Equal(t, full[s][3+i], compact[s][3+i], "step %d (warm-up): %s, the AdamW group's", s, pm.name)
				}
			}
		})
	}
}

// StateBytes per element of a Muon matrix on 4 ranks, to the byte: the
// growth of StateBytes with one more 256 x 256 matrix (a bucket of its
// own; the wire buffers the buckets share, the scratch matrix and the
// Newton-Schulz work matrices are per shape or per model, not per
// element) is 13 bytes per element in StateFull (momentum 4, slot 4,
// worker error 4, server error 1), 7 in StateCompact (momentum 4, worker
// error 2, server error 1), 5 with MomentumBF16 (2 + 2 + 1), besides the
// bucket's scales, norms and header and the matrix's k_p and step. Measured in the
// compression stage (FreezeStep 0), whose layout it is; the live heap
// grows by what StateBytes counts.
func TestMuonCompactStateBytes(t *testing.T) {
	const w, side = 4, 256
	const n = side * side
	// Every bucket's worker scales, server scales, norms and header.
	perBucket := int64(4*w+4*w) + w*int64(unsafe.Sizeof(errorfeedback.Norm{})) + 8*(1+w)
	per := map[string]int64{"full": 13, "compact": 7, "compact-bf16": 5}
	perParam := map[string]int64{"full": 4, "compact": 8, "compact-bf16": 8} // k_p, and the step in compact
	measure := func(mode string, k int) (rank0 int64, heap float64) {
		cfg := muonModeConfig(t, 0, mode)
		cfg.BucketBytes = 4 * n
		cs, err := local.New(w)
		require.NoError(t, err)
		ps := make([][]*optim.Param, w)
		for r := range ps {
			for i := range k {
				ps[r] = append(ps[r], optim.NewParam(fmt.Sprint("m", i), side, side))
			}
		}
		opts := make([]*onebit.Muon, w)
		base := heapNow()
		var wg sync.WaitGroup
		for r := range w {
			wg.Go(func() {
				var err error
				opts[r], err = onebit.NewMuon(context.Background(), cs[r], ps[r], cfg)
				assert.NoError(t, err)
			})
		}
		wg.Wait()
		grown := heapNow() - base
		var sum int64
		for _, o := range opts {
			require.NotNil(t, o)
			require.Equal(t, optim.StageCompression, o.Stage())
			sum += o.StateBytes()
			require.NoError(t, o.Close())
		}
		return opts[0].StateBytes(), float64(grown) / float64(sum)
	}
	for _, mode := range muonModes {
		if strings.HasPrefix(mode, "owners") {
			// Its bytes per element depend on which rank owns what: the
			// heap's growth only.
			_, heap := measure(mode, 2)
			assert.InDelta(t, 1, heap, 0.01, "owners: the heap grows by what StateBytes counts")
			continue
		}
		t.Run(mode, func(t *testing.T) {
			two, heap := measure(mode, 2)
			three, _ := measure(mode, 3)
			assert.Equal(t, per[mode]*n+perBucket+perParam[mode], three-two, "one more matrix")
			t.Logf("%s on %d ranks: %d bytes per element of a Muon matrix, %.3f with everything of the %d-element model counted; heap/StateBytes %.4f",
				mode, w, per[mode], float64(two)/float64(2*n), 2*n, heap)
			assert.InDelta(t, 1, heap, 0.01, "the heap grows by what StateBytes counts")
		})
	}
	assert.LessOrEqual(t, per["compact-bf16"], int64(6), "issue 50's goal")
}

// Once running, a compression step of the compact modes allocates
// nothing (both ranks' goroutines counted).
func TestMuonCompactStepAllocatesNothing(t *testing.T) {
	for _, mode := range muonModes[1:] {
		assert.Zero(t, muonStepAllocsOnTwoRanks(t, muonModeConfig(t, 1, mode)), mode)
	}
}

// Regroup carries the compact modes to another number of ranks as it
// carries StateFull (the momenta their mean, the worker errors averaged):
// the new group loads the result and keeps its parameters the same on
// every rank.
func TestMuonCompactRegroup(t *testing.T) {
	for _, mode := range muonModes[1:] {
		t.Run(mode, func(t *testing.T) {
			mk := newMuon1(muonModeConfig(t, 2, mode))
			three := muonStates(t, 3, 1, 4, mk, nil)
			two := make([]*optim.Checkpoint, 2)
			for r := range two {
				var err error
				two[r], err = onebit.Regroup(three, 2, r)
				require.NoError(t, err)
			}
			var mu sync.Mutex
			params := make([][][]uint32, 2)
			muonRunWith(t, 2, 5, 7, mk, two, func(s, r int, _ optim.Optimizer, ps []*optim.Param) error {
				mu.Lock()
				params[r] = muonBits(ps)
				mu.Unlock()
				return nil
			})
			require.Equal(t, params[0], params[1])
		})
	}
}

// MomentumBF16's stochastic rounding draws fresh bits at every step: under
// a constant gradient of 0.7 (between two bfloat16 values), on 2 ranks
// with the bfloat16 momentum from the first step, the mean of every
// matrix's momentum over the elements and steps 50-300 is the float32
// momentum's within 2e-4 (measured: 0.69568 against 0.69571). The same
// bits at every step hold each element where the first steps left it:
// 0.664.
func TestMuonMomentumBF16FreshBits(t *testing.T) {
	const w, steps, from, g = 2, 300, 50, 0.7
	cfg := muonModeConfig(t, 2, "compact-bf16+warmup-adamw")
	var got, want float64
	err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		ps := muonParams()
		opt, err := onebit.NewMuon(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		defer opt.Close()
		exact := []float32{0}
		for s := 1; s <= steps; s++ {
			muonGrad(ps, c.Rank(), s)
			for _, name := range opt.MuonParams() {
				for _, p := range ps {
					if p.Name == name {
						for j := range p.GradData() {
							p.GradData()[j] = g
						}
					}
				}
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
			optim.Momentum(exact, []float32{g}, cfg.Momentum)
			if c.Rank() != 0 || s < from {
				continue
			}
			ck, err := opt.State()
			if err != nil {
				return err
			}
			var sum float64
			n := 0
			for _, name := range opt.MuonParams() {
				for _, x := range ck.Tensor(optim.MomentumBufferPrefix + name).Data {
					sum += float64(x)
					n++
				}
			}
			got += sum / float64(n)
			want += float64(exact[0])
		}
		return nil
	})
	require.NoError(t, err)
	got, want = got/(steps-from+1), want/(steps-from+1)
	t.Logf("mean momentum over steps %d-%d: %.6f, float32 %.6f", from, steps, got, want)
	assert.InDelta(t, want, got, 2e-4)
}
