package outer

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/commtest"
)

// testShared is a shared-index codec of rank rank of w over one fragment
// of m elements in chunks of 7, 0.3 of each sent in vbits bits, decay
// 0.9.
func testShared(m, w, rank, vbits int) *sparseCodec {
	return testOwners(m, w, rank, vbits, SparseShared)
}

// Error feedback telescopes on both sides: what every rank sent is what
// left its accumulator (e before, decayed, plus delta, less e after); the
// ranks' mean of it, summed over the exchanges, is what was applied plus
// the owners' server accumulators at the end (no re-selection: the
// owners lose only int8 rounding, which they keep). Every rank applies
// the same average, bit for bit, non-zero only at k entries per chunk,
// the owner's; on 3 ranks over 6 exchanges of a fragment of 40 elements
// (rank 2 owning a short last chunk) and of 10 (rank 2 owning none), 1
// and 2 value bits.
func TestSharedTelescopes(t *testing.T) {
	const w, exchanges = 3, 6
	for _, m := range []int{40, 10} {
		for _, vbits := range []int{1, 2} {
			for _, xc := range []SparseExchange{SparseShared, SparseVoted} {
				t.Run(fmt.Sprintf("%d/bits%d/%s", m, vbits, xc), func(t *testing.T) {
					mk := func(rank int) *sparseCodec { return testOwners(m, w, rank, vbits, xc) }
					sents, outs, srvs := ownerExchanges(t, w, m, exchanges, mk, (*sparseCodec).allReduceShared)
					// Every rank sent at the same entries, k per chunk.
					for x := range exchanges {
						for a := 0; a < m; a += 7 {
							l := min(a+7, m) - a
							k := max(1, int(math.Round(0.3*float64(l))))
							for r := range w {
								nz := 0
								for i := a; i < a+l; i++ {
									if sents[r][x][i] != 0 {
										nz++
									}
								}
								assert.LessOrEqual(t, nz, k, "exchange %d, rank %d, chunk at %d", x, r, a)
							}
							nz := 0
							for i := a; i < a+l; i++ {
								if outs[0][x][i] != 0 {
									nz++
								}
							}
							assert.LessOrEqual(t, nz, k, "exchange %d: applied entries of the chunk at %d", x, a)
						}
					}
					requireTelescopes(t, w, m, 1, sents, outs, srvs)
				})
			}
		}
	}
}

// Malformed bytes are refused in every collective (commtest.Spoiling's
// call 0 is the offsets' all-gather, 1 the all-to-all, 2 the averages'
// all-gather), before anything is applied, on every rank that receives
// them (before the server accumulator changes, up to the all-to-all):
// offsets that do not ascend, non-zero padding bits or bytes, a scale
// that is not finite or negative, an int8 code of -128.
func TestSharedRefusesMalformed(t *testing.T) {
	// 10 elements in 2 chunks of 7 and 3 on 3 ranks: rank 0 owns the
	// first (2 offsets of 3 bits: 1 byte), rank 1 the short one (1
	// offset), rank 2 none (its segments all padding). Values in 2 bits:
	// 9 bytes a segment; averages 4 + 2 bytes.
	const w, m = 3, 10
	s0 := testShared(m, w, 0, 2)
	segI, segV, segA := s0.sharedSegs(m, w)
	require.Equal(t, []int{1, 9, 6}, []int{segI, segV, segA})
	for _, k := range []struct {
		name   string
		call   int
		spoil  func(recv []byte)
		detect []int
		want   string
	}{
		{"offsets/descending", 0, func(recv []byte) { recv[0] = 0b001_010 }, []int{0, 1, 2}, "offsets: segment of rank 0, chunk at element 0"},
		{"offsets/repeated", 0, func(recv []byte) { recv[0] = 0 }, []int{0, 1, 2}, "offsets: segment of rank 0, chunk at element 0"},
		{"offsets/out of the chunk", 0, func(recv []byte) { recv[1] = 5 }, []int{0, 1, 2}, "offset 5 after -1 in a chunk of 3"},
		{"offsets/padding bits", 0, func(recv []byte) { recv[0] |= 0x80 }, []int{0, 1, 2}, "padding bits"},
		{"offsets/padding byte", 0, func(recv []byte) { recv[2] = 1 }, []int{0, 1, 2}, "offsets: segment of rank 2"},
		{"values/scale", 1, func(recv []byte) { binary32(recv[segV:], float32(math.NaN())) }, []int{0, 1}, "phase 1: segment of rank 1"},
		{"values/padding", 1, func(recv []byte) { recv[segV-1] = 1 }, []int{2}, "phase 1: segment of rank 0"},
		{"averages/scale", 2, func(recv []byte) { binary32(recv, -1) }, []int{0, 1, 2}, "phase 2: segment of rank 0"},
		{"averages/code", 2, func(recv []byte) { recv[4] = 0x80 }, []int{0, 1, 2}, "code 0 is -128"},
		{"averages/padding", 2, func(recv []byte) { recv[segA+5] = 1 }, []int{0, 1, 2}, "phase 2: segment of rank 1"},
	} {
		t.Run(k.name, func(t *testing.T) {
			errs, applied, kept := spoiledExchange(t, w, m, func(rank int) *sparseCodec { return testShared(m, w, rank, 2) }, (*sparseCodec).allReduceShared,
				func(c comm.Comm) comm.Comm { return &commtest.Spoiling{Comm: c, Call: k.call, Spoil: k.spoil} })
			for _, r := range k.detect {
				require.Error(t, errs[r], "rank %d", r)
				assert.False(t, applied[r], "rank %d applied an average", r)
				assert.ErrorIs(t, errs[r], errSparseMessage, "rank %d", r)
				assert.ErrorContains(t, errs[r], k.want, "rank %d", r)
				if k.call < 2 {
					assert.True(t, kept[r], "rank %d: the server accumulator changed", r)
				}
			}
		})
	}
}

// SparseVoted refuses malformed votes (offsets out of order, padding) on
// the owner that receives them, before anything is applied or the server
// accumulator changes.
func TestVotedRefusesMalformed(t *testing.T) {
	const w, m = 3, 10
	for _, k := range []struct {
		name  string
		spoil func(recv []byte)
		want  string
	}{
		{"descending", func(recv []byte) { recv[0] = 0b001_010 }, "votes: segment of rank 0, chunk at element 0"},
		{"padding", func(recv []byte) { recv[0] |= 0x80 }, "padding bits"},
	} {
		t.Run(k.name, func(t *testing.T) {
			mk := func(rank int) *sparseCodec { return testOwners(m, w, rank, 1, SparseVoted) }
			errs, applied, kept := spoiledExchange(t, w, m, mk, (*sparseCodec).allReduceShared, func(c comm.Comm) comm.Comm {
				return &commtest.Spoiling{Comm: c, Call: 0, Spoil: func(recv []byte) {
					if c.Rank() == 0 { // the owner of the 7-element chunk
						k.spoil(recv)
					}
				}}
			})
			require.ErrorIs(t, errs[0], errSparseMessage)
			assert.ErrorContains(t, errs[0], k.want)
			for r := range w {
				assert.Error(t, errs[r], "rank %d", r)
				assert.False(t, applied[r], "rank %d applied an average", r)
				assert.True(t, kept[r], "rank %d: the server accumulator changed", r)
			}
		})
	}
}

// Any bytes as the owners' offsets and averages of a fragment are refused
// or decode to at most k finite entries per chunk, never a panic.
func FuzzSharedDecode(f *testing.F) {
	const w, m = 3, 17 // 3 chunks of 7, 7 and 3, one per rank
	s := testShared(m, w, 0, 1)
	segI, _, segA := s.sharedSegs(m, w)
	good := make([]byte, w*(segI+segA))
	x := make([]float32, m)
	for i := range x {
		x[i] = float32(i%5) - 2.5
	}
	srv := make([]float32, 7)
	for j := range w {
		lo, hi := sparseRun(m, s.chunk, w, j)
		s.encodeOffsets(good[j*segI:], x[lo:hi])
		offs, err := s.readOffsets(good[j*segI:j*segI+s.sharedIdxLen(hi-lo)], hi-lo)
		require.NoError(f, err)
		vals := make([]float32, len(offs))
		for i, o := range offs {
			vals[i] = x[lo+int(o)]
		}
		encodeAverage(good[w*segI+j*segA:], vals, offs, srv)
	}
	f.Add(good)
	f.Add(make([]byte, w*(segI+segA)))
	f.Fuzz(func(t *testing.T, msg []byte) {
		if len(msg) != w*(segI+segA) {
			return // the collectives fix the length
		}
		idx, avg := msg[:w*segI], msg[w*segI:]
		if s.checkOffsets(idx, segI, m) != nil || s.checkAverages(avg, segA, m) != nil {
			return
		}
		dst := make([]float32, m)
		s.applyShared(idx, segI, avg, segA, m, func(lo int, a []float32) { copy(dst[lo:], a) })
		checkDecoded(t, dst, 2*s.k(7)+s.k(3))
	})
}

// echoComm is rank 0 of w whose collectives receive what it sends from
// every rank: enough to run an exchange alone.
type echoComm struct {
	comm.Comm
	w int
}

func (e echoComm) Size() int { return e.w }
func (e echoComm) Rank() int { return 0 }
func (e echoComm) AllGatherBytes(_ context.Context, send, recv []byte) error {
	for r := range e.w {
		copy(recv[r*len(send):], send)
	}
	return nil
}
func (e echoComm) AllToAllBytes(_ context.Context, send, recv []byte) error {
	seg := len(send) / e.w
	for r := range e.w {
		copy(recv[r*seg:(r+1)*seg], send[:seg])
	}
	return nil
}

// An exchange allocates nothing, with either choice of offsets.
func TestSharedNoAllocs(t *testing.T) {
	const w, m = 3, 3 * 4096
	for _, x := range []SparseExchange{SparseShared, SparseVoted} {
		cfg := DefaultConfig()
		cfg.Codec, cfg.SparseExchange = CodecSparse, x
		s := newSparseCodec(cfg, m, m, w)
		s.setServer([]int{0, m}, w, 0)
		var c comm.Comm = echoComm{w: w}
		ctx := context.Background()
		delta := func(lo int, d []float32) {
			for i := range d {
				d[i] = float32(math.Sin(float64(lo + i)))
			}
		}
		apply := func(int, []float32) {}
		allocs := testing.AllocsPerRun(5, func() {
			if err := s.allReduceShared(ctx, c, 0, 0, m, delta, apply); err != nil {
				panic(err)
			}
		})
		assert.Zero(t, allocs, "%s", x)
	}
}
