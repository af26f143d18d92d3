package outer_test

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/outer"
)

// goldenSizes are the parameters of TestGoldenBits: 241 elements, two
// fragments of 120 and 121.
var goldenSizes = []int{150, 91}

// goldenMomenta are the outer steps of TestGoldenBits: DiLoCo's Nesterov
// 0.9, heavy ball 0.5, and no momentum (the 1-bit and sparse codecs'
// defaults).
var goldenMomenta = []struct {
	mu       float32
	nesterov bool
}{{0.9, true}, {0.5, false}, {0, true}}

// goldenConfig is the config of one case of TestGoldenBits: H 4, the
// sparse codec 2 of every chunk of 8, the 1-bit codec in buckets of 50
// elements (several per fragment).
func goldenConfig(codec outer.Codec, frags, delay int, mu float32, nesterov bool) outer.Config {
	cfg := outer.DefaultConfig()
	cfg.H, cfg.Fragments, cfg.Delay, cfg.Codec = 4, frags, delay, codec
	cfg.Momentum, cfg.Nesterov = mu, nesterov
	cfg.SparseChunk, cfg.Density = 8, 0.25
	cfg.BucketBytes = 4 * 50
	return cfg
}

// goldenRun runs 13 calls (3 exchanges of every fragment) on w ranks and
// returns the SHA-256 of every rank's parameters and θ_g, as float32
// bits, rank after rank.
func goldenRun(t *testing.T, w int, cfg outer.Config) string {
	const calls = 13
	out := newPerRank[[]float32](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, goldenSizes)
		o, err := steppedOn(ctx, c, ps, cfg, calls)
		if err != nil {
			return err
		}
		out.set(c.Rank(), append(flat(ps), o.Global()...))
		return o.Close()
	})
	h := sha256.New()
	for _, v := range out.v {
		for _, x := range v {
			h.Write(binary.LittleEndian.AppendUint32(nil, math.Float32bits(x)))
		}
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// The outer optimizer's results, bit for bit, with every codec, 1 and 2
// fragments, delay 0 and 1, 2 and 3 ranks, and three outer steps: the
// hashes were recorded before the buffers were cut to what each codec
// needs (docs/outer.md, "Memory"), which changes no result.
func TestGoldenBits(t *testing.T) {
	for _, codec := range allCodecs {
		for _, w := range []int{2, 3} {
			for _, frags := range []int{1, 2} {
				for _, delay := range []int{0, 1} {
					for _, m := range goldenMomenta {
						name := fmt.Sprintf("%s/W%d/F%d/D%d/mu%g/nesterov%t", codec, w, frags, delay, m.mu, m.nesterov)
						got := goldenRun(t, w, goldenConfig(codec, frags, delay, m.mu, m.nesterov))
						assert.Equal(t, goldenHashes[name], got, "%s", name)
					}
				}
			}
		}
	}
}

// goldenHashes are goldenRun's hashes, recorded at commit 7906c36.
var goldenHashes = map[string]string{
	"fp32/W2/F1/D0/mu0.9/nesterovtrue":    "ed5d3fe13c2685f3",
	"fp32/W2/F1/D0/mu0.5/nesterovfalse":   "09a6b16fb0a384ab",
	"fp32/W2/F1/D0/mu0/nesterovtrue":      "8dce23611c0fc90a",
	"fp32/W2/F1/D1/mu0.9/nesterovtrue":    "6f34dfef1dc6dad8",
	"fp32/W2/F1/D1/mu0.5/nesterovfalse":   "dd36680bafb334ce",
	"fp32/W2/F1/D1/mu0/nesterovtrue":      "fedc4deedfc0ffeb",
	"fp32/W2/F2/D0/mu0.9/nesterovtrue":    "35340d4849f22ecd",
	"fp32/W2/F2/D0/mu0.5/nesterovfalse":   "f9171b54030a906d",
	"fp32/W2/F2/D0/mu0/nesterovtrue":      "962f3df4efed5787",
	"fp32/W2/F2/D1/mu0.9/nesterovtrue":    "df04af4f29a849be",
	"fp32/W2/F2/D1/mu0.5/nesterovfalse":   "7c71680ccec1a380",
	"fp32/W2/F2/D1/mu0/nesterovtrue":      "c7dd23940d725e92",
	"fp32/W3/F1/D0/mu0.9/nesterovtrue":    "9a82960de08eab73",
	"fp32/W3/F1/D0/mu0.5/nesterovfalse":   "d5a5b478f46fc0de",
	"fp32/W3/F1/D0/mu0/nesterovtrue":      "ce3dd98f47f3928b",
	"fp32/W3/F1/D1/mu0.9/nesterovtrue":    "6055711c4925178c",
	"fp32/W3/F1/D1/mu0.5/nesterovfalse":   "e1d0c5f630387a02",
	"fp32/W3/F1/D1/mu0/nesterovtrue":      "1cfa1592cc0fe9ed",
	"fp32/W3/F2/D0/mu0.9/nesterovtrue":    "6296c6b94a4bfbc5",
	"fp32/W3/F2/D0/mu0.5/nesterovfalse":   "0d55edf83bac7eea",
	"fp32/W3/F2/D0/mu0/nesterovtrue":      "94cf5d11014079d4",
	"fp32/W3/F2/D1/mu0.9/nesterovtrue":    "2ee3182101fea9bb",
	"fp32/W3/F2/D1/mu0.5/nesterovfalse":   "eed36bf43376ffe1",
	"fp32/W3/F2/D1/mu0/nesterovtrue":      "a41924bf4328270b",
	"bf16/W2/F1/D0/mu0.9/nesterovtrue":    "8962dc6794430dd0",
	"bf16/W2/F1/D0/mu0.5/nesterovfalse":   "b6e42802fc3c053b",
	"bf16/W2/F1/D0/mu0/nesterovtrue":      "88fd8a0397ce9210",
	"bf16/W2/F1/D1/mu0.9/nesterovtrue":    "c1a7462274a84529",
	"bf16/W2/F1/D1/mu0.5/nesterovfalse":   "8db42ddbb227822f",
	"bf16/W2/F1/D1/mu0/nesterovtrue":      "ec6ab8a4ca2a9c34",
	"bf16/W2/F2/D0/mu0.9/nesterovtrue":    "84a4b70db9c73c68",
	"bf16/W2/F2/D0/mu0.5/nesterovfalse":   "30d5c25ee52755ed",
	"bf16/W2/F2/D0/mu0/nesterovtrue":      "fed64e0b106b5a1e",
	"bf16/W2/F2/D1/mu0.9/nesterovtrue":    "a57841d06bc4b337",
	"bf16/W2/F2/D1/mu0.5/nesterovfalse":   "e0815f48f9b2a5d5",
	"bf16/W2/F2/D1/mu0/nesterovtrue":      "3be91ebfe5d40335",
	"bf16/W3/F1/D0/mu0.9/nesterovtrue":    "c1249f3bad2487c6",
	"bf16/W3/F1/D0/mu0.5/nesterovfalse":   "3b4a2f179f3d4c35",
	"bf16/W3/F1/D0/mu0/nesterovtrue":      "964b2a4d3df6aeae",
	"bf16/W3/F1/D1/mu0.9/nesterovtrue":    "315c5d7adffa3d15",
	"bf16/W3/F1/D1/mu0.5/nesterovfalse":   "685b159b1a9e9f28",
	"bf16/W3/F1/D1/mu0/nesterovtrue":      "a5d711a99e516ba5",
	"bf16/W3/F2/D0/mu0.9/nesterovtrue":    "d44083b52eefb3f8",
	"bf16/W3/F2/D0/mu0.5/nesterovfalse":   "312d319f2c57d073",
	"bf16/W3/F2/D0/mu0/nesterovtrue":      "967cb483e4f451f8",
	"bf16/W3/F2/D1/mu0.9/nesterovtrue":    "e5a5d1c450d40aa0",
	"bf16/W3/F2/D1/mu0.5/nesterovfalse":   "962343de86a13f36",
	"bf16/W3/F2/D1/mu0/nesterovtrue":      "eb37e81b1cbe7b26",
	"int8/W2/F1/D0/mu0.9/nesterovtrue":    "0bdd0cfbc696f6a6",
	"int8/W2/F1/D0/mu0.5/nesterovfalse":   "015808d1d8937b42",
	"int8/W2/F1/D0/mu0/nesterovtrue":      "aa38c2ac130fab79",
	"int8/W2/F1/D1/mu0.9/nesterovtrue":    "c695d8299aae0a73",
	"int8/W2/F1/D1/mu0.5/nesterovfalse":   "5afcda11c78619dc",
	"int8/W2/F1/D1/mu0/nesterovtrue":      "dd5ab827504e0e47",
	"int8/W2/F2/D0/mu0.9/nesterovtrue":    "ae6c7ebebf364f37",
	"int8/W2/F2/D0/mu0.5/nesterovfalse":   "b80a3bdde2e4e853",
	"int8/W2/F2/D0/mu0/nesterovtrue":      "30611d43aedf527a",
	"int8/W2/F2/D1/mu0.9/nesterovtrue":    "15d09dfe27a37cd1",
	"int8/W2/F2/D1/mu0.5/nesterovfalse":   "a2ce9cacf461f2fb",
	"int8/W2/F2/D1/mu0/nesterovtrue":      "ff8f9bd7c256ba63",
	"int8/W3/F1/D0/mu0.9/nesterovtrue":    "04d77a8172d5d2e3",
	"int8/W3/F1/D0/mu0.5/nesterovfalse":   "fab98fbb6ac2a06e",
	"int8/W3/F1/D0/mu0/nesterovtrue":      "b1d0f401e5fc464d",
	"int8/W3/F1/D1/mu0.9/nesterovtrue":    "8b5e2eb1de93c682",
	"int8/W3/F1/D1/mu0.5/nesterovfalse":   "72dfacff185f6f7e",
	"int8/W3/F1/D1/mu0/nesterovtrue":      "7654f028c99ce967",
	"int8/W3/F2/D0/mu0.9/nesterovtrue":    "a6477f197cc4bd81",
	"int8/W3/F2/D0/mu0.5/nesterovfalse":   "a0b4fc58225ed361",
	"int8/W3/F2/D0/mu0/nesterovtrue":      "a2ec27dc89859420",
	"int8/W3/F2/D1/mu0.9/nesterovtrue":    "6cad22a740443a56",
	"int8/W3/F2/D1/mu0.5/nesterovfalse":   "558a517852140959",
	"int8/W3/F2/D1/mu0/nesterovtrue":      "21c2b97eb149ca58",
	"1bit/W2/F1/D0/mu0.9/nesterovtrue":    "b8a3edb3c641cda7",
	"1bit/W2/F1/D0/mu0.5/nesterovfalse":   "6cf40d0f21ce3a0d",
	"1bit/W2/F1/D0/mu0/nesterovtrue":      "73b294f8ea461e98",
	"1bit/W2/F1/D1/mu0.9/nesterovtrue":    "dc915f082ff02c1e",
	"1bit/W2/F1/D1/mu0.5/nesterovfalse":   "3e28d95286dca97a",
	"1bit/W2/F1/D1/mu0/nesterovtrue":      "959705261b80d66c",
	"1bit/W2/F2/D0/mu0.9/nesterovtrue":    "bbdfac8e1e65062a",
	"1bit/W2/F2/D0/mu0.5/nesterovfalse":   "962baf4245788008",
	"1bit/W2/F2/D0/mu0/nesterovtrue":      "72fd3581e431fac0",
	"1bit/W2/F2/D1/mu0.9/nesterovtrue":    "ccbcf611b4e2cf88",
	"1bit/W2/F2/D1/mu0.5/nesterovfalse":   "15c046268de42e9a",
	"1bit/W2/F2/D1/mu0/nesterovtrue":      "83c38420d631b466",
	"1bit/W3/F1/D0/mu0.9/nesterovtrue":    "8c9aa5b62dcd5341",
	"1bit/W3/F1/D0/mu0.5/nesterovfalse":   "fc8d6a06d768cbea",
	"1bit/W3/F1/D0/mu0/nesterovtrue":      "3e29658e41743d8b",
	"1bit/W3/F1/D1/mu0.9/nesterovtrue":    "7ba1a7f27170e140",
	"1bit/W3/F1/D1/mu0.5/nesterovfalse":   "d322a41758e315a6",
	"1bit/W3/F1/D1/mu0/nesterovtrue":      "b4bd8e9ace3f6e52",
	"1bit/W3/F2/D0/mu0.9/nesterovtrue":    "41bd4a96fcda1afc",
	"1bit/W3/F2/D0/mu0.5/nesterovfalse":   "ff821b96c5f876af",
	"1bit/W3/F2/D0/mu0/nesterovtrue":      "5d4273f3f1b0204d",
	"1bit/W3/F2/D1/mu0.9/nesterovtrue":    "c8185a58551b1560",
	"1bit/W3/F2/D1/mu0.5/nesterovfalse":   "5c8eba5a6abe1cc9",
	"1bit/W3/F2/D1/mu0/nesterovtrue":      "69b1c665d6e6dc05",
	"sparse/W2/F1/D0/mu0.9/nesterovtrue":  "71777b95f6eaebfe",
	"sparse/W2/F1/D0/mu0.5/nesterovfalse": "f98becb129117303",
	"sparse/W2/F1/D0/mu0/nesterovtrue":    "67527ec0796c35b3",
	"sparse/W2/F1/D1/mu0.9/nesterovtrue":  "d8792813bccac14d",
	"sparse/W2/F1/D1/mu0.5/nesterovfalse": "f875bc6016770f5c",
	"sparse/W2/F1/D1/mu0/nesterovtrue":    "77717432d948d942",
	"sparse/W2/F2/D0/mu0.9/nesterovtrue":  "f9f2068ce3a41ffb",
	"sparse/W2/F2/D0/mu0.5/nesterovfalse": "6ee055e59c26af14",
	"sparse/W2/F2/D0/mu0/nesterovtrue":    "b82b127641dd456c",
	"sparse/W2/F2/D1/mu0.9/nesterovtrue":  "16a866ed70e1c772",
	"sparse/W2/F2/D1/mu0.5/nesterovfalse": "cbc5508a4f963d83",
	"sparse/W2/F2/D1/mu0/nesterovtrue":    "6b6ce21d06459250",
	"sparse/W3/F1/D0/mu0.9/nesterovtrue":  "370e19cd276cb9d6",
	"sparse/W3/F1/D0/mu0.5/nesterovfalse": "a93af65f4174104e",
	"sparse/W3/F1/D0/mu0/nesterovtrue":    "61cc38d5148f6ddb",
	"sparse/W3/F1/D1/mu0.9/nesterovtrue":  "474f7dda6c7f4d43",
	"sparse/W3/F1/D1/mu0.5/nesterovfalse": "e909c3c1ece283ca",
	"sparse/W3/F1/D1/mu0/nesterovtrue":    "0dbfdb2325d2fbdc",
	"sparse/W3/F2/D0/mu0.9/nesterovtrue":  "a901cd807b33422b",
	"sparse/W3/F2/D0/mu0.5/nesterovfalse": "081e1c8d9b9cccf8",
	"sparse/W3/F2/D0/mu0/nesterovtrue":    "3b46321aaf1f7470",
	"sparse/W3/F2/D1/mu0.9/nesterovtrue":  "bda0767e95c10d8b",
	"sparse/W3/F2/D1/mu0.5/nesterovfalse": "967a21efde2d9956",
	"sparse/W3/F2/D1/mu0/nesterovtrue":    "54a30888cc067b51",
}
