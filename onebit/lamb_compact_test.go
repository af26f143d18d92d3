package onebit_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/testnet"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// lcShapes is the model of the tests of 1-bit LAMB's StateCompact: small
// tensors, an empty one, and one long enough to span several unpacking
// blocks and to be cut by every chunk boundary.
var lcShapes = [][]int{{3, 7}, {13}, {0}, {1}, {9001}}

// lcConfig is 1-bit LAMB with weight decay, bias correction and masks
// (zeros, ones, a half and a negative element) on two tensors, in mode.
func lcConfig(freeze int, mode onebit.StateMode) onebit.LambConfig {
	cfg := onebit.DefaultLambConfig()
	cfg.LR = 0.01
	cfg.WeightDecay = 0.01
	cfg.FreezeStep = freeze
	cfg.StateMode = mode
	m1 := make([]float32, 13)
	for i := range m1 {
		m1[i] = []float32{1, 0, 0.5, -1}[i%4]
	}
	m4 := make([]float32, 9001)
	for i := range m4 {
		m4[i] = float32(i % 3 % 2) // 0, 1, 0, 0, 1, 0, ...
	}
	cfg.ExpAvgMask = map[string][]float32{"w1": m1, "w4": m4}
	return cfg
}

// lcRun runs w ranks of 1-bit LAMB over shapes from step from to step to,
// loading per-rank checkpoints from dir first when load is set and saving
// them at the end when save is set. It returns every rank's parameters
// and, with every, every rank's checkpoint after every step (cks[s][r]).
func lcRun(t *testing.T, w int, cfg onebit.LambConfig, shapes [][]int, dir string, from, to int, load, save, every bool) ([][][]uint32, [][]*optim.Checkpoint) {
	t.Helper()
	out, cks, err := tryLcRun(t, w, cfg, shapes, dir, from, to, load, save, every)
	require.NoError(t, err)
	return out, cks
}

func tryLcRun(t *testing.T, w int, cfg onebit.LambConfig, shapes [][]int, dir string, from, to int, load, save, every bool) ([][][]uint32, [][]*optim.Checkpoint, error) {
	t.Helper()
	var mu sync.Mutex
	out := make([][][]uint32, w)
	var cks [][]*optim.Checkpoint
	if every {
		cks = make([][]*optim.Checkpoint, to-from+1)
		for s := range cks {
			cks[s] = make([]*optim.Checkpoint, w)
		}
	}
	err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		ps := adamParams(t, shapes...)
		opt, err := onebit.NewLamb(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		path := filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", c.Rank()))
		if load {
			ck, err := optim.LoadFile(path)
			if err != nil {
				return err
			}
			if err := opt.Load(ck); err != nil {
				return err
			}
		}
		for s := from; s <= to; s++ {
			adamGrads(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
			if every {
				ck, err := opt.State()
				if err != nil {
					return err
				}
				mu.Lock()
				cks[s-from][c.Rank()] = ck
				mu.Unlock()
			}
		}
		if save {
			ck, err := opt.State()
			if err != nil {
				return err
			}
			if err := optim.SaveFile(path, ck); err != nil {
				return err
			}
		}
		mu.Lock()
		out[c.Rank()] = adamBits(ps)
		mu.Unlock()
		return opt.Close()
	})
	return out, cks, err
}

// lcSameCheckpoint requires a StateCompact checkpoint (which records its
// mode) to be the StateFull one, bit for bit.
func lcSameCheckpoint(t *testing.T, full, compact *optim.Checkpoint, what string) {
	t.Helper()
	require.Equal(t, int64(onebit.StateCompact), compact.Ints[onebit.IntStateMode], what)
	c := *compact
	c.Ints = map[string]int64{}
	for k, v := range compact.Ints {
		if k != onebit.IntStateMode {
			c.Ints[k] = v
		}
	}
	require.NoError(t, testnet.SameBits(full, &c), what)
	assert.Equal(t, full.ErrorsReset, c.ErrorsReset, what)
}

// StateCompact takes StateFull's steps bit for bit (warm-up, the switch,
// the compression stage; masks with zeros and negative elements, weight
// decay or none (whose factor needs no update sums), bias correction or
// none, an empty parameter, parameters cut by chunks and blocks) and
// writes the same checkpoints after every step, but for the mode it
// records; on every rank.
func TestLambCompactIsFullBitForBit(t *testing.T) {
	const total = 9
	ws := []int{2, 3, 4}
	if testing.Short() {
		ws = []int{3} // -short (make test-race): one world size of the grid
	}
	for _, w := range ws {
		for _, freeze := range []int{1, 3} {
			for _, bc := range []bool{true, false} {
				for _, wd := range []float32{0.01, 0} {
					t.Run(fmt.Sprintf("W=%d/freeze=%d/bias_correction=%v/wd=%v", w, freeze, bc, wd), func(t *testing.T) {
						full, compact := lcConfig(freeze, onebit.StateFull), lcConfig(freeze, onebit.StateCompact)
						full.BiasCorrection, compact.BiasCorrection = bc, bc
						full.WeightDecay, compact.WeightDecay = wd, wd
						want, wantCks := lcRun(t, w, full, lcShapes, t.TempDir(), 1, total, false, false, true)
						got, gotCks := lcRun(t, w, compact, lcShapes, t.TempDir(), 1, total, false, false, true)
						require.Equal(t, want, got)
						for r := 1; r < w; r++ {
							require.Equal(t, got[0], got[r], "rank %d against rank 0", r)
						}
						for s := range wantCks {
							for r := range w {
								lcSameCheckpoint(t, wantCks[s][r], gotCks[s][r], fmt.Sprintf("step %d, rank %d", s+1, r))
							}
						}
						assert.Equal(t, optim.StageCompression, gotCks[total-1][0].Stage)
					})
				}
			}
		}
	}
}

// The same with a fused buffer long enough for the compressed allreduce
// to be pipelined (its gathered messages in pieces).
func TestLambCompactIsFullBitForBitPipelined(t *testing.T) {
	if testing.Short() {
		t.Skip("two million parameters")
	}
	const w, freeze, total = 2, 1, 4
	shapes := [][]int{{1 << 21}, {12345}, {7}}
	full, compact := lcConfig(freeze, onebit.StateFull), lcConfig(freeze, onebit.StateCompact)
	full.ExpAvgMask, compact.ExpAvgMask = nil, nil
	mask := make([]float32, 12345)
	for i := range mask {
		mask[i] = float32(i % 2)
	}
	full.ExpAvgMask = map[string][]float32{"w1": mask}
	compact.ExpAvgMask = full.ExpAvgMask
	fullDir, compactDir := t.TempDir(), t.TempDir()
	want, _ := lcRun(t, w, full, shapes, fullDir, 1, total, false, true, false)
	got, _ := lcRun(t, w, compact, shapes, compactDir, 1, total, false, true, false)
	require.Equal(t, want, got)
	for r := range w {
		name := fmt.Sprintf("rank%d.ckpt", r)
		a, err := optim.LoadFile(filepath.Join(fullDir, name))
		require.NoError(t, err)
		b, err := optim.LoadFile(filepath.Join(compactDir, name))
		require.NoError(t, err)
		lcSameCheckpoint(t, a, b, name)
	}
}

// A StateCompact run resumes bit-identically from its own checkpoints and
// from StateFull's, and StateFull from StateCompact's, at every stage: in
// the warm-up, after the freezing step (before the first compression
// step), after the first compression step and later; also from a
// checkpoint whose error buffers were reset, as StateFull does.
func TestLambCompactResumeAndConvert(t *testing.T) {
	const w, freeze, total = 3, 3, 9
	full, compact := lcConfig(freeze, onebit.StateFull), lcConfig(freeze, onebit.StateCompact)
	want, _ := lcRun(t, w, full, lcShapes, t.TempDir(), 1, total, false, false, false)
	ks, resetKs := []int{1, freeze - 1, freeze, freeze + 1, freeze + 3}, []int{1, freeze, freeze + 1, freeze + 2}
	if testing.Short() {
		// -short (make test-race): one stop in each stage.
		ks, resetKs = []int{1, freeze, freeze + 1}, []int{1, freeze + 1}
	}
	for _, k := range ks {
		for _, tc := range []struct {
			name       string
			save, load onebit.LambConfig
		}{
			{"compact", compact, compact},
			{"full into compact", full, compact},
			{"compact into full", compact, full},
		} {
			t.Run(fmt.Sprintf("%s/k=%d", tc.name, k), func(t *testing.T) {
				dir := t.TempDir()
				lcRun(t, w, tc.save, lcShapes, dir, 1, k, false, true, false)
				got, _ := lcRun(t, w, tc.load, lcShapes, dir, k+1, total, true, false, false)
				assert.Equal(t, want, got)
			})
		}
	}
	// Errors reset: StateCompact continues as StateFull does, on the same
	// group size and on others (whose chunks cannot pack the momentum:
	// StateCompact holds it as float32 until the next compression step).
	for _, k := range resetKs {
		for _, w2 := range []int{w, 2, 4} {
			t.Run(fmt.Sprintf("errors reset/k=%d/W=%d", k, w2), func(t *testing.T) {
				dir := t.TempDir()
				lcRun(t, w, full, lcShapes, dir, 1, k, false, true, false)
				for r := range w2 {
					ck, err := optim.LoadFile(filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", r%w)))
					require.NoError(t, err)
					require.NoError(t, optim.SaveFile(filepath.Join(dir, fmt.Sprintf("reset%d.ckpt", r)), ck.ResetErrors()))
				}
				for r := range w2 {
					require.NoError(t, copyFile(filepath.Join(dir, fmt.Sprintf("reset%d.ckpt", r)), filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", r))))
				}
				a, aCks := lcRun(t, w2, full, lcShapes, dir, k+1, total, true, false, true)
				b, bCks := lcRun(t, w2, compact, lcShapes, dir, k+1, total, true, false, true)
				assert.Equal(t, a, b)
				for s := range aCks {
					for r := range w2 {
						lcSameCheckpoint(t, aCks[s][r], bCks[s][r], fmt.Sprintf("step %d, rank %d", k+1+s, r))
					}
				}
			})
		}
	}
}

// copyFile copies the file at from to to.
func copyFile(from, to string) error {
	b, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	return os.WriteFile(to, b, 0o644)
}

// lcEdit rewrites every rank's checkpoint in dir with edit.
func lcEdit(t *testing.T, w int, dir string, edit func(ck *optim.Checkpoint)) {
	t.Helper()
	for r := range w {
		path := filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", r))
		ck, err := optim.LoadFile(path)
		require.NoError(t, err)
		edit(ck)
		require.NoError(t, optim.SaveFile(path, ck))
	}
}

// A checkpoint StateCompact cannot hold (a momentum that is not ±scale
// per chunk over the scaling times the masks after the first compression
// step; non-zero worker errors or a v_fresh that is not the frozen v
// before it) is refused, saying what to do, and leaves the optimizer as it
// was; StateFull takes it as it is.
func TestLambCompactRefusesAStateItCannotHold(t *testing.T) {
	const w, freeze = 2, 2
	for _, tc := range []struct {
		name string
		k    int
		edit func(ck *optim.Checkpoint)
		want string
	}{
		{"momentum", freeze + 2, func(ck *optim.Checkpoint) { ck.Tensor(optim.ExpAvgPrefix + "w4").Data[4] *= 1.5 }, "not a compressed one"},
		{"masked momentum not zero", freeze + 2, func(ck *optim.Checkpoint) { ck.Tensor(optim.ExpAvgPrefix + "w4").Data[3] = 0.5 }, "not a compressed one"},
		{"v_fresh before the first compression step", freeze, func(ck *optim.Checkpoint) {
			ck.Tensor(onebit.ExpAvgSqFreshPrefix + "w0").Data[2] *= 2
		}, "v_fresh"},
		{"v_fresh in the warm-up", 1, func(ck *optim.Checkpoint) {
			ck.Tensor(onebit.ExpAvgSqFreshPrefix + "w0").Data[2] = 1
		}, "v_fresh"},
		{"worker errors before the first compression step", freeze, func(ck *optim.Checkpoint) {
			ck.Tensor(onebit.FusedWorkerError).Data[5] = 0.25
		}, "worker errors"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			lcRun(t, w, lcConfig(freeze, onebit.StateCompact), lcShapes, dir, 1, tc.k, false, true, false)
			lcEdit(t, w, dir, tc.edit)
			_, _, err := tryLcRun(t, w, lcConfig(freeze, onebit.StateCompact), lcShapes, dir, tc.k+1, tc.k+1, true, false, false)
			require.Error(t, err)
			require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
			assert.Contains(t, err.Error(), tc.want)
			assert.Contains(t, err.Error(), "StateFull")
			_, _, err = tryLcRun(t, w, lcConfig(freeze, onebit.StateFull), lcShapes, dir, tc.k+1, tc.k+1, true, false, false)
			require.NoError(t, err)
		})
	}
	// A refused Load changes nothing: the optimizer takes the next
	// checkpoint as if it had never seen the bad one.
	dir, bad := t.TempDir(), t.TempDir()
	lcRun(t, w, lcConfig(freeze, onebit.StateCompact), lcShapes, dir, 1, freeze+2, false, true, false)
	lcRun(t, w, lcConfig(freeze, onebit.StateCompact), lcShapes, bad, 1, freeze+2, false, true, false)
	lcEdit(t, w, bad, func(ck *optim.Checkpoint) { ck.Tensor(optim.ExpAvgPrefix + "w0").Data[1] *= 3 })
	want, _ := lcRun(t, w, lcConfig(freeze, onebit.StateCompact), lcShapes, dir, freeze+3, freeze+5, true, false, false)
	got := make([][][]uint32, w)
	require.NoError(t, local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		ps := adamParams(t, lcShapes...)
		opt, err := onebit.NewLamb(ctx, c, ps, lcConfig(freeze, onebit.StateCompact))
		if err != nil {
			return err
		}
		name := fmt.Sprintf("rank%d.ckpt", c.Rank())
		badCk, err := optim.LoadFile(filepath.Join(bad, name))
		if err != nil {
			return err
		}
		if err := opt.Load(badCk); err == nil {
			return fmt.Errorf("rank %d: a bad momentum loaded", c.Rank())
		}
		ck, err := optim.LoadFile(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		if err := opt.Load(ck); err != nil {
			return err
		}
		for s := freeze + 3; s <= freeze+5; s++ {
			adamGrads(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		got[c.Rank()] = adamBits(ps)
		return opt.Close()
	}))
	assert.Equal(t, want, got)
}

// A checkpoint of another state mode (StateSharded is 1-bit Adam's) is
// refused.
func TestLambCompactRefusesAnotherMode(t *testing.T) {
	const w, freeze = 2, 2
	dir := t.TempDir()
	lcRun(t, w, lcConfig(freeze, onebit.StateCompact), lcShapes, dir, 1, freeze+1, false, true, false)
	lcEdit(t, w, dir, func(ck *optim.Checkpoint) { ck.Ints[onebit.IntStateMode] = int64(onebit.StateSharded) })
	for _, mode := range []onebit.StateMode{onebit.StateFull, onebit.StateCompact} {
		_, _, err := tryLcRun(t, w, lcConfig(freeze, mode), lcShapes, dir, freeze+2, freeze+2, true, false, false)
		require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint, "%v", mode)
		assert.Contains(t, err.Error(), "StateSharded")
	}
}

// On one rank StateCompact runs as StateFull (there is no compressed
// allreduce), recording its mode.
func TestLambCompactOneRank(t *testing.T) {
	const freeze, total = 2, 6
	want, wantCks := lcRun(t, 1, lcConfig(freeze, onebit.StateFull), lcShapes, t.TempDir(), 1, total, false, false, true)
	got, gotCks := lcRun(t, 1, lcConfig(freeze, onebit.StateCompact), lcShapes, t.TempDir(), 1, total, false, false, true)
	require.Equal(t, want, got)
	for s := range wantCks {
		lcSameCheckpoint(t, wantCks[s][0], gotCks[s][0], fmt.Sprintf("step %d", s+1))
	}
}

// StateCompact resumes bit-identically on the small network of the other
// LAMB tests, and skips non-finite steps as StateFull does.
func TestLambCompactResumeAndSkips(t *testing.T) {
	cfg := lambTestConfig(4)
	cfg.StateMode = onebit.StateCompact
	lzResume(t, lzSetup(3, newLamb(cfg)), 10, 2, 3, 4, 5, 8)
	lzNaN(t, lzSetup(3, newLamb(cfg)), 12, map[int64]int{2: 1, 4: 0, 5: 2, 8: 1})
}

func TestLambCompactZeroAllocs(t *testing.T) {
	for _, tc := range []struct {
		name      string
		w, freeze int
		warm      int
	}{
		{"warmup/W=2", 2, 1000, 2},
		{"compression/W=2", 2, 1, 3},
		{"compression/W=3", 3, 2, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := lambTestConfig(tc.freeze)
			cfg.StateMode = onebit.StateCompact
			lzZeroAllocs(t, tc.w, tc.warm, newLamb(cfg))
		})
	}
}

// The recorded DeepSpeed 1-bit LAMB run replays bit for bit the same in
// StateCompact as in StateFull (TestDeepSpeedRuns checks both against
// DeepSpeed).
func TestLambCompactDeepSpeedReplay(t *testing.T) {
	run := loadDSRun(t, filepath.Join("testdata", "deepspeed", "onebit_lamb_w3.json"))
	fullMk, _ := dsOptimizer(t, run, onebit.StateFull)
	compactMk, _ := dsOptimizer(t, run, onebit.StateCompact)
	want, got := dsReplay(t, run, fullMk), dsReplay(t, run, compactMk)
	for s := range want {
		for r := range want[s] {
			lcSameCheckpoint(t, want[s][r], got[s][r], fmt.Sprintf("step %d, rank %d", s+1, r))
		}
	}
}

// BenchmarkLambCompactStep times a compression step of 1-bit LAMB on two
// ranks of comm/local (rank 1 steps alongside on its own goroutine), in
// StateFull and in StateCompact, with and without weight decay (without,
// the factor needs no update sums and StateCompact's first pass skips
// them), on a model of 4Mi parameters.
//
//	go test ./onebit -run '^$' -bench LambCompactStep -benchtime 20x
func BenchmarkLambCompactStep(b *testing.B) {
	const w, n = 2, 4 << 20
	for _, wd := range []float32{0, 0.01} {
		for _, mode := range []onebit.StateMode{onebit.StateFull, onebit.StateCompact} {
			b.Run(fmt.Sprintf("wd=%v/%v", wd, mode), func(b *testing.B) {
				cs, err := local.New(w)
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				opts := make([]optim.Optimizer, w)
				for r := range w {
					cfg := onebit.DefaultLambConfig()
					cfg.FreezeStep = 1
					cfg.WeightDecay = wd
					cfg.StateMode = mode
					if opts[r], err = onebit.NewLamb(ctx, cs[r], lzBenchModel(n), cfg); err != nil {
						b.Fatal(err)
					}
				}
				steps := func(r, k int) error {
					for range k {
						if err := opts[r].Step(ctx); err != nil {
							return err
						}
					}
					return nil
				}
				var wg sync.WaitGroup
				wg.Go(func() {
					if err := steps(1, 3+b.N); err != nil {
						b.Error(err)
					}
				})
				if err := steps(0, 3); err != nil {
					b.Fatal(err)
				}
				b.ResetTimer()
				if err := steps(0, b.N); err != nil {
					b.Error(err)
				}
				b.StopTimer()
				wg.Wait()
				b.ReportMetric(float64(opts[0].(optim.MemoryReporter).StateBytes())/n, "state-B/param")
			})
		}
	}
}

// A checkpoint whose error buffers were reset on another group size (its
// momentum gathered in other chunks) loads in StateCompact with m held as
// float32 until the next compression step: StateBytes is 4 bytes per
// parameter more from the Load to that step, and back after it.
func TestLambCompactLooseMomentum(t *testing.T) {
	const freeze, k = 3, 5
	dir := t.TempDir()
	lcRun(t, 3, lcConfig(freeze, onebit.StateFull), lcShapes, dir, 1, k, false, true, false)
	total := 0
	for _, s := range lcShapes {
		n := 1
		for _, d := range s {
			n *= d
		}
		total += n
	}
	require.NoError(t, local.Run(adamCtx(t), 2, func(ctx context.Context, c comm.Comm) error {
		ps := adamParams(t, lcShapes...)
		opt, err := onebit.NewLamb(ctx, c, ps, lcConfig(freeze, onebit.StateCompact))
		if err != nil {
			return err
		}
		built := opt.StateBytes()
		ck, err := optim.LoadFile(filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", c.Rank())))
		if err != nil {
			return err
		}
		if err := opt.Load(ck.ResetErrors()); err != nil {
			return err
		}
		loaded := opt.StateBytes()
		adamGrads(ps, c.Rank(), k+1)
		if err := opt.Step(ctx); err != nil {
			return err
		}
		if loaded != built+4*int64(total) || opt.StateBytes() != built {
			return fmt.Errorf("StateBytes %d after construction, %d after the Load, %d after a step", built, loaded, opt.StateBytes())
		}
		return opt.Close()
	}))
}
