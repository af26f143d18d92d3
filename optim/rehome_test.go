package optim

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

func TestIsErrorBuffer(t *testing.T) {
	for name, want := range map[string]bool{
		"worker_error":            true,
		"server_error":            true,
		"worker_error/fc1.weight": true,
		"server_error/w":          true,
		"worker_error/":           true,
		"worker_errors":           false,
		"worker_error_x/w":        false,
		"param/worker_error":      false,
		"exp_avg/server_error/w":  false,
		"sync_anchor/w":           false,
		"":                        false,
	} {
		assert.Equal(t, want, IsErrorBuffer(name), name)
	}
}

func TestResetErrors(t *testing.T) {
	ck := sampleCheckpoint()
	ck.Tensors = append(ck.Tensors, Tensor{Name: ServerErrorName, Shape: []int{2}, Data: []float32{1, 2}})
	out := ck.ResetErrors()
	require.NotNil(t, out)
	assert.True(t, out.ErrorsReset)
	assert.False(t, ck.ErrorsReset, "the original is unchanged")
	assert.Equal(t, ck.Algorithm, out.Algorithm)
	assert.Equal(t, ck.World, out.World, "World still names the group that made it")
	assert.Equal(t, ck.Rank, out.Rank)
	assert.Equal(t, ck.Stage, out.Stage)
	assert.Equal(t, ck.Ints, out.Ints)
	var names []string
	for _, tn := range out.Tensors {
		names = append(names, tn.Name)
	}
	assert.Equal(t, []string{"param/w", "param/s", "param/e"}, names)
	assert.NotNil(t, ck.Tensor("worker_error/w"), "the original keeps its error buffers")
	assert.NotNil(t, ck.Tensor(ServerErrorName))

	// A deep copy.
	out.Ints["step"] = 1000
	out.Floats["coeff"] = 7
	out.Tensors[0].Data[0] = 42
	out.Tensors[0].Shape[0] = 9
	assert.Equal(t, int64(12), ck.Ints["step"])
	assert.Equal(t, 0.25, ck.Floats["coeff"])
	assert.Equal(t, float32(1), ck.Tensors[0].Data[0])
	assert.Equal(t, 2, ck.Tensors[0].Shape[0])

	assert.Nil(t, (*Checkpoint)(nil).ResetErrors())
}

// A checkpoint without flags is still written as version 1 (readable by
// builds that predate the flag); one with ErrorsReset as version 2, which
// round-trips the flag and is refused when damaged like any other.
func TestCheckpointEncodesErrorsReset(t *testing.T) {
	plain := encode(t, sampleCheckpoint())
	assert.Equal(t, uint32(1), binary.LittleEndian.Uint32(plain[8:12]))

	reset := sampleCheckpoint().ResetErrors()
	b := encode(t, reset)
	assert.Equal(t, uint32(2), binary.LittleEndian.Uint32(b[8:12]))
	var back Checkpoint
	require.NoError(t, back.UnmarshalBinary(b))
	assert.True(t, back.ErrorsReset)
	assert.Equal(t, reset.World, back.World)
	assert.Equal(t, reset.Ints, back.Ints)
	require.Len(t, back.Tensors, len(reset.Tensors))
	assert.Equal(t, b, encode(t, &back))

	for n := 0; n < len(b); n++ {
		var ck Checkpoint
		require.ErrorIs(t, ck.UnmarshalBinary(b[:n]), ErrCorruptCheckpoint, "truncated to %d bytes", n)
	}
	for i := range b {
		for bit := 0; bit < 8; bit++ {
			c := append([]byte(nil), b...)
			c[i] ^= 1 << bit
			var ck Checkpoint
			require.ErrorIs(t, ck.UnmarshalBinary(c), ErrCorruptCheckpoint, "bit %d of byte %d flipped", bit, i)
		}
	}

	// Unknown flags and unknown versions are refused even with a valid
	// checksum.
	flagsOff := ckHeaderLen + 4 + len(reset.Algorithm) + 8 + 8 + 4 + len(reset.Stage)
	require.Equal(t, uint32(1), binary.LittleEndian.Uint32(b[flagsOff:]))
	c := append([]byte(nil), b...)
	c[flagsOff] = 3
	fixCRC(c)
	var ck Checkpoint
	assert.ErrorContains(t, ck.UnmarshalBinary(c), "unknown flags 0x2")
	c = append([]byte(nil), b...)
	c[8] = 3
	assert.ErrorContains(t, ck.UnmarshalBinary(c), "format version 3")
	assert.ErrorIs(t, ck.UnmarshalBinary(c), ErrCorruptCheckpoint)

	// A version-2 file with no flag set decodes too.
	v2 := append([]byte(nil), b...)
	v2[flagsOff] = 0
	fixCRC(v2)
	require.NoError(t, ck.UnmarshalBinary(v2))
	assert.False(t, ck.ErrorsReset)
}

func TestCheckCompatibleErrorsReset(t *testing.T) {
	ps := testParams(t, 1, []int{2, 3}, []int{4})
	opt, err := NewAdam(context.Background(), nil, ps, DefaultAdamConfig())
	require.NoError(t, err)
	ck, err := opt.State()
	require.NoError(t, err)

	// A checkpoint with per-rank state (a 1-bit optimizer's, here by its
	// name alone) is refused on another group size, the error naming the
	// lossless way first.
	ck.Algorithm = AlgorithmOnebitAdam
	err = ck.CheckCompatible(AlgorithmOnebitAdam, 4, ps)
	assert.ErrorIs(t, err, ErrIncompatibleCheckpoint)
	assert.ErrorContains(t, err, "made on 1 ranks, this group has 4; onebit.Regroup(")
	assert.ErrorContains(t, err, "ResetErrors is the lossy way")

	reset := ck.ResetErrors()
	require.NoError(t, reset.CheckCompatible(AlgorithmOnebitAdam, 4, ps))
	require.NoError(t, reset.CheckCompatible(AlgorithmOnebitAdam, 1, ps))
	// The algorithm and the shapes still have to match.
	assert.ErrorContains(t, reset.CheckCompatible(AlgorithmLamb, 4, ps), `algorithm "onebit-adam"`)
	other := testParams(t, 1, []int{3, 2}, []int{4})
	assert.ErrorContains(t, reset.CheckCompatible(AlgorithmOnebitAdam, 4, other), "shape [2 3] in the checkpoint, [3 2] here")
	assert.ErrorContains(t, reset.CheckCompatible(AlgorithmOnebitAdam, 4, ps[:1]), "holds 2 parameters, this optimizer 1")
	// The flag without the buffers dropped is inconsistent.
	bad := *reset
	bad.Tensors = append(append([]Tensor(nil), reset.Tensors...), Tensor{Name: "worker_error/a-param", Shape: []int{8}, Data: make([]float32, 8)})
	err = bad.CheckCompatible(AlgorithmOnebitAdam, 4, ps)
	assert.ErrorIs(t, err, ErrIncompatibleCheckpoint)
	assert.ErrorContains(t, err, `holds error buffer "worker_error/a-param"`)
}

// TestRankChangeExact is the exact optimizers' rows of docs/gomlx.md's
// table "Changing the number of ranks": their state is the same on every
// rank (Replicated), so any old rank's checkpoint loads as it is on a
// group of another size, 4 ranks to 2 and 2 to 3, with every tensor and
// counter carried bit for bit; a ResetErrors copy, which drops nothing,
// loads the same without a warning; training goes on with identical ranks.
func TestRankChangeExact(t *testing.T) {
	muonCfg := DefaultMuonConfig()
	muonCfg.Split = true
	for _, tc := range []struct {
		name string // the table's row
		mk   func(ctx context.Context, c comm.Comm, ps []*Param, opts ...Option) (Optimizer, error)
	}{
		{"Adam/AdamW", func(ctx context.Context, c comm.Comm, ps []*Param, opts ...Option) (Optimizer, error) {
			cfg := DefaultAdamConfig()
			cfg.WeightDecay = 0.01
			return NewAdam(ctx, c, ps, cfg, opts...)
		}},
		{"Adam, bfloat16 moments", func(ctx context.Context, c comm.Comm, ps []*Param, opts ...Option) (Optimizer, error) {
			cfg := DefaultAdamConfig()
			cfg.MomentsBF16 = true
			return NewAdam(ctx, c, ps, cfg, opts...)
		}},
		{"LAMB", func(ctx context.Context, c comm.Comm, ps []*Param, opts ...Option) (Optimizer, error) {
			return NewLamb(ctx, c, ps, DefaultLambConfig(), opts...)
		}},
		{"Muon", func(ctx context.Context, c comm.Comm, ps []*Param, opts ...Option) (Optimizer, error) {
			return NewMuon(ctx, c, ps, muonCfg, opts...)
		}},
	} {
		for _, move := range [][2]int{{4, 2}, {2, 3}} {
			t.Run(fmt.Sprintf("%s/%dto%d", tc.name, move[0], move[1]), func(t *testing.T) {
				shapes := [][]int{{5, 3}, {11}, {4, 6}}
				from, to := move[0], move[1]
				cks := make([]*Checkpoint, from)
				err := local.Run(context.Background(), from, func(ctx context.Context, c comm.Comm) error {
					ps := testParams(t, 9, shapes...)
					opt, err := tc.mk(ctx, c, ps)
					if err != nil {
						return err
					}
					defer opt.Close()
					for s := 1; s <= 3; s++ {
						fillGrads(ps, c.Rank(), s)
						if err := opt.Step(ctx); err != nil {
							return err
						}
					}
					cks[c.Rank()], err = opt.State()
					return err
				})
				require.NoError(t, err)
				require.True(t, Replicated(cks[0].Algorithm))

				var mu sync.Mutex
				final := make([][][]float32, to)
				err = local.Run(context.Background(), to, func(ctx context.Context, c comm.Comm) error {
					core, logs := observer.New(zapcore.InfoLevel)
					ps := testParams(t, 10, shapes...)
					opt, err := tc.mk(ctx, c, ps, WithLogger(zap.New(core)))
					if err != nil {
						return err
					}
					defer opt.Close()
					ck := cks[(c.Rank()+1)%from] // another rank's, as it is
					for _, load := range []*Checkpoint{ck.ResetErrors(), ck} {
						if err := opt.Load(load); err != nil {
							return err
						}
						got, err := opt.State()
						if err != nil {
							return err
						}
						for _, tn := range ck.Tensors {
							assert.Equal(t, bits(tn.Data), bits(got.Tensor(tn.Name).Data), tn.Name)
						}
						assert.Equal(t, ck.Ints, got.Ints)
					}
					assert.Empty(t, logs.FilterLevelExact(zapcore.WarnLevel).All(), "nothing was lost")
					for s := 4; s <= 6; s++ {
						fillGrads(ps, c.Rank(), s)
						if err := opt.Step(ctx); err != nil {
							return err
						}
					}
					mu.Lock()
					final[c.Rank()] = snapshot(ps)
					mu.Unlock()
					return nil
				})
				require.NoError(t, err)
				for r := 1; r < to; r++ {
					for i := range final[0] {
						assert.Equal(t, bits(final[0][i]), bits(final[r][i]), "rank %d, parameter %d", r, i)
						assert.True(t, Finite(final[0][i]))
					}
				}
			})
		}
	}
}
