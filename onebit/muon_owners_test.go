package onebit_test

import (
	"context"
	"encoding/binary"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/commtest"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// Malformed bytes are refused (commtest.Spoiling's call 0 is NewMuon's
// agreement, 1 the owners' all-to-all of the first compression step, 2
// their all-gather): a scale that is not finite or negative, a
// padding bit set. A message spoiled on its way to its owner fails the
// step on every rank (the owner's segment of the all-gather is then one
// that every rank refuses); one spoiled in the all-gather fails it on
// the rank that received it, whose exit stops the others. muonTestConfig's three matrices of 60
// elements on 3 ranks: one each, 4 bytes of scale and 8 of signs (4
// padding bits) a message.
func TestMuonOwnersRefusesMalformed(t *testing.T) {
	const w, freeze = 3, 1
	nan := func(recv []byte) { binary.LittleEndian.PutUint32(recv[12:], math.Float32bits(float32(math.NaN()))) }
	for _, tc := range []struct {
		name  string
		call  int
		spoil func(recv []byte)
		every bool
		bits  int
	}{
		{"a NaN scale to its owner", 1, nan, true, 0},
		{"a negative scale to its owner", 1, func(recv []byte) { binary.LittleEndian.PutUint32(recv[12:], math.Float32bits(-1)) }, true, 0},
		{"a padding bit to its owner", 1, func(recv []byte) { recv[12+11] |= 1 }, true, 0},
		{"an infinite scale to every rank", 2, func(recv []byte) { binary.LittleEndian.PutUint32(recv[24:], math.Float32bits(float32(math.Inf(1)))) }, false, 0},
		{"a padding bit to every rank", 2, func(recv []byte) { recv[11] |= 2 }, false, 0},
		// Two bits: 4 bytes of scale, 8 of signs and 8 of magnitude bits.
		{"a padding magnitude bit to its owner", 1, func(recv []byte) { recv[20+19] |= 1 }, true, 2},
		{"a NaN scale to its owner, two bits", 1, func(recv []byte) { binary.LittleEndian.PutUint32(recv[20:], math.Float32bits(float32(math.NaN()))) }, true, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := muonTestConfig(freeze)
			cfg.Exchange, cfg.OwnerBits = onebit.ExchangeOwners, tc.bits
			cs, err := local.New(w)
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			errs := make([]error, w)
			var wg sync.WaitGroup
			for r := range w {
				wg.Go(func() {
					defer cs[r].Close() // as a process exits: peers waiting for it are aborted
					var c comm.Comm = cs[r]
					if r == 0 {
						c = &commtest.Spoiling{Comm: cs[r], Call: tc.call, Spoil: tc.spoil}
					}
					ps := muonParams()
					o, err := onebit.NewMuon(ctx, c, ps, cfg)
					if err != nil {
						errs[r] = err
						return
					}
					defer o.Close()
					for s := 1; s <= 2; s++ {
						muonGrad(ps, r, s)
						if errs[r] = o.Step(ctx); errs[r] != nil {
							return
						}
					}
				})
			}
			wg.Wait()
			require.ErrorContains(t, errs[0], "sent a malformed message")
			for r := 1; r < w; r++ {
				if tc.every {
					assert.ErrorContains(t, errs[r], "rank 0 sent a malformed message", "rank %d", r)
				} else if errs[r] != nil {
					assert.ErrorIs(t, errs[r], comm.ErrAborted, "rank %d: stopped by rank 0's exit, not hung", r)
				}
			}
		})
	}
}

// On another number of ranks Regroup carries the owners' state: every
// new rank's estimates are the old ranks' mean, each owner's mean
// estimate is that same mean, and its error feedback is the old owner's;
// the new group steps on with its parameters one on every rank.
func TestMuonOwnersRegroup(t *testing.T) {
	cfg := muonTestConfig(2)
	cfg.Exchange = onebit.ExchangeOwners
	mk := newMuon1(cfg)
	three := muonStates(t, 3, 1, 4, mk, nil)
	for _, w := range []int{1, 2, 4} {
		next := make([]*optim.Checkpoint, w)
		for r := range next {
			var err error
			next[r], err = onebit.Regroup(three, w, r)
			require.NoError(t, err)
		}
		if w > 1 {
			owners := map[string]int{}
			for r, ck := range next {
				for _, pm := range []string{"wide", "tall", "conv"} {
					h := ck.Tensor(onebit.TrackPrefix + pm).Data
					var sum float64
					for _, old := range three {
						for _, x := range old.Tensor(onebit.TrackPrefix + pm).Data[:1] {
							sum += float64(x)
						}
					}
					assert.InDelta(t, sum/3, h[0], 1e-6, "rank %d: %s's estimate", r, pm)
					if m := ck.Tensor(onebit.OwnerMeanPrefix + pm); m != nil {
						owners[pm]++
						assert.Equal(t, h, m.Data, "the owner's mean estimate is the ranks' estimate")
						var e []float32
						for _, old := range three {
							if t := old.Tensor(onebit.OwnerErrorPrefix + pm); t != nil {
								e = t.Data
							}
						}
						assert.Equal(t, e, ck.Tensor(onebit.OwnerErrorPrefix+pm).Data, "the old owner's error feedback")
					}
				}
			}
			assert.Equal(t, map[string]int{"wide": 1, "tall": 1, "conv": 1}, owners, "one owner per matrix")
		}
		var mu sync.Mutex
		params := make([][][]uint32, w)
		muonRunWith(t, w, 5, 7, mk, next, func(s, r int, _ optim.Optimizer, ps []*optim.Param) error {
			mu.Lock()
			params[r] = muonBits(ps)
			mu.Unlock()
			return nil
		})
		for r := 1; r < w; r++ {
			require.Equal(t, params[0], params[r])
		}
	}
}

// OwnerBits is 0 or 1, or 2 with ExchangeOwners: anything else is a
// ConfigError naming the field.
func TestMuonOwnerBitsConfig(t *testing.T) {
	cfg := onebit.DefaultMuonConfig()
	var ce *optim.ConfigError
	for _, bad := range []struct {
		ex   onebit.MuonExchange
		bits int
	}{{onebit.ExchangePolar, 2}, {onebit.ExchangeOwners, 3}, {onebit.ExchangeOwners, -1}} {
		cfg.Exchange, cfg.OwnerBits = bad.ex, bad.bits
		if assert.ErrorAs(t, cfg.Validate(), &ce, "%v, %d bits", bad.ex, bad.bits) {
			assert.Equal(t, "OwnerBits", ce.Field)
		}
	}
	for _, bits := range []int{0, 1, 2} {
		cfg.Exchange, cfg.OwnerBits = onebit.ExchangeOwners, bits
		assert.NoError(t, cfg.Validate(), "%d bits", bits)
	}
}
