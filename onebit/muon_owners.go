package onebit

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/signpack"
)

// MuonExchange is how 1-bit Muon averages its Muon group over the ranks
// after the warm-up (MuonConfig.Exchange). docs/muon.md has the design of
// each and what was measured.
type MuonExchange int

const (
	// ExchangePolar, the default: every rank orthogonalizes its own
	// momentum and the ranks' polar factors are averaged through the
	// error-compensated 1-bit allreduce. The average of polar factors is
	// not the polar factor of the average: the scheme is biased, more so
	// with more ranks (docs/muon.md, issue 61).
	ExchangePolar MuonExchange = iota
	// ExchangeOwners: every Muon matrix has an owner rank, which
	// orthogonalizes an estimate of the ranks' mean momentum (EF21-Muon's
	// order: compress, then one orthogonalization). Each rank sends the
	// owner the 1-bit (MuonConfig.OwnerBits 2: two-bit) compression of its
	// momentum less the estimate of it the owner already holds (EF21's
	// tracking), the owner orthogonalizes
	// the mean of its estimates (with Nesterov's term from their
	// increment) and sends every rank the 1-bit compression of the update
	// plus its own error feedback. Each compression first rotates its
	// chunk by random signs and a Walsh-Hadamard transform every rank can
	// repeat. Its fixed point is exact Muon's; its bytes are the 1-bit
	// exchange's (with two bits, 1.5x), the segments padded to the most
	// loaded owner's matrices. Each owner orthogonalizes only its own
	// matrices. StateFull only.
	ExchangeOwners
)

// String returns the name ParseMuonExchange reads.
func (e MuonExchange) String() string {
	switch e {
	case ExchangePolar:
		return "polar"
	case ExchangeOwners:
		return "owners"
	}
	return fmt.Sprintf("MuonExchange(%d)", int(e))
}

// ParseMuonExchange parses "" or "polar" (ExchangePolar) and "owners"
// (ExchangeOwners).
func ParseMuonExchange(s string) (MuonExchange, error) {
	switch s {
	case "", "polar":
		return ExchangePolar, nil
	case "owners":
		return ExchangeOwners, nil
	}
	return 0, fmt.Errorf("onebit: unknown Muon exchange %q (want polar or owners)", s)
}

// Checkpoint names of ExchangeOwners. HyperOwners is the hyperparameter
// that records it (absent for ExchangePolar), HyperOwnerBits its
// OwnerBits (1 or 2). On more than one rank every
// rank saves its tracking estimate of every Muon matrix under TrackPrefix;
// the owner of a matrix saves the mean estimate under OwnerMeanPrefix and
// its error feedback under OwnerErrorPrefix.
const (
	HyperOwners      = "muon_exchange_owners"
	HyperOwnerBits   = "muon_owner_bits"
	TrackPrefix      = "muon_track/"
	OwnerMeanPrefix  = "muon_owner_mean/"
	OwnerErrorPrefix = "muon_owner_error/"
)

// ownerChunk is the elements of a chunk of ExchangeOwners' compression:
// one float32 scale and a Walsh-Hadamard rotation per chunk.
const ownerChunk = 1024

// muonOwners is ExchangeOwners' state on more than one rank.
type muonOwners struct {
	world, rank int
	owner       []int       // per matrix (o.mats order): its owner
	n           []int       // per matrix: its elements
	trk         [][]float32 // per matrix: this rank's estimate h of its momentum
	mean        [][]float32 // per matrix: the owner's mean estimate (nil unless owned)
	fb          [][]float32 // per matrix: the owner's error feedback of the update (nil unless owned)
	to, from    ownerLayout // the messages to the owners (the all-to-all's) and from them (the all-gather's)
	send, recv  []byte      // the all-to-all's (W segments each way)
	out, all    []byte      // the all-gather's: this rank's segment, every rank's
	a, b, c     []float32   // work: as long as the largest matrix
	mag         []float32   // work: a chunk's magnitude bits (two-bit messages)
}

// ownerLayout is where each matrix's message lies in its owner's segment
// of one of ExchangeOwners' collectives.
type ownerLayout struct {
	bits      int   // bits an element of the messages
	off, size []int // per matrix: its message's offset in its owner's segment, and bytes
	seg       int   // bytes of a segment: the most loaded owner's messages
}

// newOwnerLayout lays out the messages of matrices of sizes elements at
// bits bits an element, each in its owner's segment, in matrix order.
func newOwnerLayout(sizes, owner []int, world, bits int) ownerLayout {
	l := ownerLayout{bits: bits, off: make([]int, len(sizes)), size: make([]int, len(sizes))}
	used := make([]int, world)
	for k, n := range sizes {
		l.off[k], l.size[k] = used[owner[k]], ownerMessageBytes(n, bits)
		used[owner[k]] += l.size[k]
	}
	l.seg = slices.Max(used)
	return l
}

// message is matrix k's message in segs, the collective's W segments, in
// the segment of the matrix's owner.
func (l ownerLayout) message(segs []byte, owner []int, k int) []byte {
	return segs[owner[k]*l.seg+l.off[k]:][:l.size[k]]
}

// ownersOf deals matrices of the given element counts out to world ranks:
// the largest first (ties to the lower index), each to the rank with the
// fewest elements so far (ties to the lower rank). Every rank computes the
// same.
func ownersOf(sizes []int, world int) []int {
	order := make([]int, len(sizes))
	for k := range order {
		order[k] = k
	}
	slices.SortStableFunc(order, func(a, b int) int { return sizes[b] - sizes[a] })
	load := make([]int, world)
	owner := make([]int, len(sizes))
	for _, k := range order {
		r := 0
		for j := range load {
			if load[j] < load[r] {
				r = j
			}
		}
		owner[k] = r
		load[r] += sizes[k]
	}
	return owner
}

// ownerMessageBytes is the bytes of a message of n elements at bits (1 or
// 2) bits an element: a float32 scale per chunk, then the packed signs,
// then, at 2 bits, the packed magnitude bits.
func ownerMessageBytes(n, bits int) int {
	return 4*((n+ownerChunk-1)/ownerChunk) + bits*signpack.PackedLen(n)
}

// Lloyd-Max's quantizer of a unit normal into four levels (the two-bit
// workers' phase, MuonConfig.OwnerBits 2): |y| below lmCut times the
// chunk's root mean square is sent as lmLow times it, at or above as
// lmHigh times it, with y's sign. After the rotation a chunk's values are
// close to normal.
const (
	lmCut  = 0.9816
	lmLow  = 0.4528
	lmHigh = 1.510
)

func newMuonOwners(mats []muonMatrix, params []*optim.Param, world, rank, bits int) *muonOwners {
	sizes := make([]int, len(mats))
	most := 0
	for k, mt := range mats {
		sizes[k] = params[mt.i].Numel()
		most = max(most, sizes[k])
	}
	owner := ownersOf(sizes, world)
	w := &muonOwners{world: world, rank: rank, owner: owner, n: sizes,
		to: newOwnerLayout(sizes, owner, world, bits), from: newOwnerLayout(sizes, owner, world, 1),
		mag: make([]float32, ownerChunk),
		trk: make([][]float32, len(mats)), mean: make([][]float32, len(mats)), fb: make([][]float32, len(mats)),
		a: make([]float32, most), b: make([]float32, most), c: make([]float32, most)}
	for k, n := range sizes {
		w.trk[k] = make([]float32, n)
		if owner[k] == rank {
			w.mean[k], w.fb[k] = make([]float32, n), make([]float32, n)
		}
	}
	w.send, w.recv = make([]byte, world*w.to.seg), make([]byte, world*w.to.seg)
	w.out, w.all = make([]byte, w.from.seg), make([]byte, world*w.from.seg)
	return w
}

// rotation is the seed of the rotation of matrix k's message in phase ph
// (1: from rank r to the owner, 2: from the owner) at step t.
func rotation(t int64, ph, k, r int) uint64 {
	return uint64(t)<<24 ^ uint64(ph)<<20 ^ uint64(k)<<10 ^ uint64(r) ^ 0x6f776e657273 // "owners"
}

// splitmix is SplitMix64's step: the next state and its output.
func splitmix(s uint64) (uint64, uint64) {
	s += 0x9e3779b97f4a7c15
	z := s
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return s, z ^ z>>31
}

// flipSigns multiplies x by random signs from seed (its own inverse).
func flipSigns(x []float32, seed uint64) {
	s := seed
	for a := 0; a < len(x); a += 64 {
		var bits uint64
		s, bits = splitmix(s)
		blk := x[a:min(a+64, len(x))]
		for i := range blk {
			blk[i] = math.Float32frombits(math.Float32bits(blk[i]) ^ uint32(bits>>i&1)<<31)
		}
	}
}

// hadamard applies the orthonormal Walsh-Hadamard transform to x's pieces,
// the largest power of two first: its own inverse.
func hadamard(x []float32) {
	for len(x) > 0 {
		n := 1
		for n*2 <= len(x) {
			n *= 2
		}
		p := x[:n]
		for h := 1; h < n; h *= 2 {
			for i := 0; i < n; i += 2 * h {
				for j := i; j < i+h; j++ {
					a, b := p[j], p[j+h]
					p[j], p[j+h] = a+b, a-b
				}
			}
		}
		f := float32(1 / math.Sqrt(float64(n)))
		for i := range p {
			p[i] *= f
		}
		x = x[n:]
	}
}

// encodeOwner writes x's message into dst (ownerMessageBytes(len(x), 1)
// bytes): per chunk, its root mean square (summed in float64, rounded
// once) and the signs of the chunk rotated (random signs from the seed,
// then the Walsh-Hadamard transform). With mag (a chunk long) the message
// has two bits an element (ownerMessageBytes(len(x), 2) bytes): after the
// signs, each element's magnitude bit, set where the rotated value's
// absolute value is at least lmCut times the scale. x is overwritten with
// the rotated chunks.
func encodeOwner(dst []byte, x []float32, seed uint64, mag []float32) {
	nch := (len(x) + ownerChunk - 1) / ownerChunk
	signs := dst[4*nch:]
	mags := signs[signpack.PackedLen(len(x)):]
	for j := range nch {
		ch := x[j*ownerChunk : min((j+1)*ownerChunk, len(x))]
		var s float64
		for _, v := range ch {
			s += float64(v) * float64(v)
		}
		sc := float32(math.Sqrt(s / float64(len(ch))))
		binary.LittleEndian.PutUint32(dst[4*j:], math.Float32bits(sc))
		cs, _ := splitmix(seed + uint64(j))
		flipSigns(ch, cs)
		hadamard(ch)
		signpack.Pack(signs[j*ownerChunk/8:], ch)
		if mag != nil {
			cut, m := lmCut*sc, mag[:len(ch)]
			for i, v := range ch {
				m[i] = float32(math.Abs(float64(v))) - cut
			}
			signpack.Pack(mags[j*ownerChunk/8:], m)
		}
	}
}

// decodeOwner writes the values of src's message into dst: per chunk the
// scale times the signs (with mag, a chunk long, a two-bit message's:
// lmLow or lmHigh times the scale by the magnitude bit), rotated back.
func decodeOwner(dst []float32, src []byte, seed uint64, mag []float32) {
	nch := (len(dst) + ownerChunk - 1) / ownerChunk
	signs := src[4*nch:]
	mags := signs[signpack.PackedLen(len(dst)):]
	for j := range nch {
		ch := dst[j*ownerChunk : min((j+1)*ownerChunk, len(dst))]
		sc := math.Float32frombits(binary.LittleEndian.Uint32(src[4*j:]))
		signpack.UnpackScale(ch, signs[j*ownerChunk/8:], sc)
		if mag != nil {
			m := mag[:len(ch)]
			signpack.Unpack(m, mags[j*ownerChunk/8:])
			for i := range ch {
				if m[i] > 0 {
					ch[i] *= lmHigh
				} else {
					ch[i] *= lmLow
				}
			}
		}
		hadamard(ch)
		cs, _ := splitmix(seed + uint64(j))
		flipSigns(ch, cs)
	}
}

// maxOwnerScale is the largest scale a message may carry: the
// Walsh-Hadamard transform back sums up to ownerChunk values of it before
// it divides, which must stay finite.
const maxOwnerScale = math.MaxFloat32 / (2 * ownerChunk)

// checkOwnerScales refuses a message of bits bits an element whose scales
// are negative, not a number or above maxOwnerScale, and nonzero padding
// bits after its signs (and after its magnitude bits).
func checkOwnerScales(src []byte, n, bits int) error {
	nch := (n + ownerChunk - 1) / ownerChunk
	for j := range nch {
		sc := math.Float32frombits(binary.LittleEndian.Uint32(src[4*j:]))
		if !(sc >= 0) || sc > maxOwnerScale {
			return fmt.Errorf("a scale of %v (want 0 to %v: the transform back of a larger one overflows)", sc, maxOwnerScale)
		}
	}
	if r := n % 8; r != 0 {
		for b := 1; b <= bits; b++ {
			if last := src[4*nch+b*signpack.PackedLen(n)-1]; last&(1<<(8-r)-1) != 0 {
				return fmt.Errorf("padding bits set after %d signs", n)
			}
		}
	}
	return nil
}

// check refuses a segment of the matrices (of sizes elements) of owner
// whose messages are malformed or whose padding is not zero.
func (l ownerLayout) check(seg []byte, owner int, owners, sizes []int) error {
	end := 0
	for k, n := range sizes {
		if owners[k] != owner {
			continue
		}
		if err := checkOwnerScales(seg[l.off[k]:], n, l.bits); err != nil {
			return err
		}
		end = max(end, l.off[k]+l.size[k])
	}
	for _, b := range seg[end:] {
		if b != 0 {
			return fmt.Errorf("nonzero padding after byte %d", end)
		}
	}
	return nil
}

// stepOwners is ExchangeOwners' step of the Muon group at step t with learning
// rate lr: the momenta, the all-to-all to the owners, their
// orthogonalization and the all-gather of the updates, applied on every
// rank.
func (o *Muon) stepOwners(ctx context.Context, t int64, lr float32) error {
	w, cfg := o.ow, o.cfg
	sizes := w.n
	if w.from.seg == 0 {
		return nil // no Muon matrix with an element
	}
	var mag []float32 // the workers' phase's magnitude bits, at two bits
	if w.to.bits == 2 {
		mag = w.mag
	}
	// The workers' phase: C(m - h) to the owner, h += what was sent.
	clear(w.send)
	for k, mt := range o.mats {
		n := sizes[k]
		m, h, d := o.mom[mt.i], w.trk[k], w.a[:n]
		optim.Momentum(m, o.params[mt.i].GradData(), cfg.Momentum)
		for i := range d {
			d[i] = m[i] - h[i]
		}
		msg := w.to.message(w.send, w.owner, k)
		seed := rotation(t, 1, k, w.rank)
		encodeOwner(msg, d, seed, mag)
		decodeOwner(d, msg, seed, mag)
		for i := range h {
			h[i] += d[i]
		}
	}
	if err := o.f.Comm().AllToAllBytes(ctx, w.send, w.recv); err != nil {
		return fmt.Errorf("the owners' all-to-all: %w", err)
	}
	// A malformed message reaches its owner only: the owner then sends a
	// segment every rank refuses (its first bytes all ones: a NaN scale,
	// or padding not zero where it owns nothing), so that the step fails
	// on every rank.
	clear(w.out)
	for j := range w.world {
		if err := w.to.check(w.recv[j*w.to.seg:(j+1)*w.to.seg], w.rank, w.owner, sizes); err != nil {
			for b := range w.out[:min(4, len(w.out))] {
				w.out[b] = 0xff
			}
			if err := o.f.Comm().AllGatherBytes(ctx, w.out, w.all); err != nil {
				return fmt.Errorf("the owners' all-gather: %w", err)
			}
			return fmt.Errorf("the owners' all-to-all: rank %d sent a malformed message: %w", j, err)
		}
	}
	// The owners' phase: the mean estimate, orthogonalized, the update
	// with error feedback compressed to every rank.
	nc := cfg.MuonConfig
	nc.Nesterov = false
	inv := 1 / float32(w.world)
	for k, mt := range o.mats {
		if w.owner[k] != w.rank {
			continue
		}
		n := sizes[k]
		inc, c, u := w.a[:n], w.b[:n], w.c[:n]
		clear(inc)
		for j := range w.world {
			decodeOwner(c, w.recv[j*w.to.seg+w.to.off[k]:][:w.to.size[k]], rotation(t, 1, k, j), mag)
			for i := range inc {
				inc[i] += c[i]
			}
		}
		hb := w.mean[k]
		for i := range inc {
			inc[i] *= inv
			hb[i] += inc[i]
			u[i] = hb[i]
			if cfg.Nesterov {
				u[i] += cfg.Momentum * inc[i]
			}
		}
		if mt.orth == nil || !mt.orth.Orthogonalize(c, u, nil, mt.rows, mt.cols, nc, 1) {
			clear(c)
		}
		step := float32(float64(lr) * float64(mt.scale))
		e := w.fb[k]
		for i := range c {
			c[i] = float32(step*c[i]) + e[i]
			u[i] = c[i]
		}
		msg := w.out[w.from.off[k]:][:w.from.size[k]]
		seed := rotation(t, 2, k, 0)
		encodeOwner(msg, c, seed, nil)
		decodeOwner(c, msg, seed, nil)
		for i := range e {
			e[i] = u[i] - c[i]
		}
	}
	if err := o.f.Comm().AllGatherBytes(ctx, w.out, w.all); err != nil {
		return fmt.Errorf("the owners' all-gather: %w", err)
	}
	for j := range w.world {
		if err := w.from.check(w.all[j*w.from.seg:(j+1)*w.from.seg], j, w.owner, sizes); err != nil {
			return fmt.Errorf("the owners' all-gather: rank %d sent a malformed message: %w", j, err)
		}
	}
	decay := float32(1 - float64(lr)*float64(cfg.WeightDecay))
	for k, mt := range o.mats {
		n := sizes[k]
		c := w.a[:n]
		decodeOwner(c, w.from.message(w.all, w.owner, k), rotation(t, 2, k, 0), nil)
		p := o.params[mt.i].Data()
		for i := range c {
			p[i] = float32(p[i]*decay) - c[i]
		}
	}
	return nil
}

// isOwners reports whether ck was made with ExchangeOwners.
func isOwners(ck *optim.Checkpoint) bool { return ck.Floats[optim.HyperPrefix+HyperOwners] == 1 }

// sync sets every estimate to the momenta, which are the same on every rank
// at the end of an exact warm-up.
func (w *muonOwners) sync(mats []muonMatrix, mom [][]float32) {
	for k, mt := range mats {
		copy(w.trk[k], mom[mt.i])
		if w.mean[k] != nil {
			copy(w.mean[k], mom[mt.i])
			clear(w.fb[k])
		}
	}
}

// each calls fn with the checkpoint name, shape and buffer of every state
// tensor of w (none for nil): every matrix's tracking estimate, and the
// owned matrices' mean estimate and error feedback.
func (w *muonOwners) each(mats []muonMatrix, params []*optim.Param, fn func(name string, shape []int, buf []float32)) {
	if w == nil {
		return
	}
	for k, mt := range mats {
		p := params[mt.i]
		fn(TrackPrefix+p.Name, p.Shape(), w.trk[k])
		if w.mean[k] != nil {
			fn(OwnerMeanPrefix+p.Name, p.Shape(), w.mean[k])
			fn(OwnerErrorPrefix+p.Name, p.Shape(), w.fb[k])
		}
	}
}

// stateBytes is the bytes of w's buffers (0 for nil).
func (w *muonOwners) stateBytes() int64 {
	if w == nil {
		return 0
	}
	n := optim.Float32Bytes(w.trk...) + optim.Float32Bytes(w.mean...) + optim.Float32Bytes(w.fb...) + optim.Float32Bytes(w.a, w.b, w.c, w.mag)
	return n + int64(len(w.send)+len(w.recv)+len(w.out)+len(w.all))
}
