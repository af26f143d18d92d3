package quant

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/comm"
)

// QGZConfig configures the hierarchical quantized reduce-scatter.
type QGZConfig struct {
	// Bits is the code width of both quantization rounds: 4 or 8.
	Bits int
	// GroupSize is the number of elements per quantization group (groups
	// never straddle a partition); >= 0, 0 means DefaultGroupSize (2048).
	GroupSize int
	// ErrorFeedback keeps a per-rank residual of both quantization rounds
	// (what quantization lost) and adds it to the next call's input, so
	// that repeated reductions carry no bias.
	ErrorFeedback bool
}

// Validate reports the first invalid field: Bits other than 4 and 8, or
// a negative GroupSize. NewQGZ refuses a config that any rank has invalid
// with this error, naming the rank, on every rank.
func (c QGZConfig) Validate() error {
	if err := c.check(); err != nil {
		return fmt.Errorf("quant: %w", err)
	}
	return nil
}

// check is Validate without the package prefix.
func (c QGZConfig) check() error {
	switch {
	case c.Bits != 4 && c.Bits != 8:
		return fmt.Errorf("QGZConfig.Bits = %d: want 4 or 8", c.Bits)
	case c.GroupSize < 0:
		return fmt.Errorf("QGZConfig.GroupSize = %d: want >= 0 (0 for DefaultGroupSize, %d)", c.GroupSize, DefaultGroupSize)
	}
	return nil
}

// QGZ is the hierarchical quantized reduce-scatter of ZeRO++ ("qgZ") for a
// tensor of n elements on a node-major layout of W = Nodes*RanksPerNode
// ranks. It follows the spec (quant.md) step by step, with exactly two
// quantization rounds and two all-to-all hops whatever W is:
//
//  1. every rank quantizes each of its W partitions of P = Padded()/W
//     elements (groups of GroupSize inside each partition);
//  2. intra-node all-to-all: local rank b receives, from every rank of its
//     node, the partitions node_a*RanksPerNode + b of every node a;
//  3. it dequantizes and sums them in float32, in ascending order of the
//     sending local rank;
//  4. it re-quantizes each partial sum;
//  5. inter-node all-to-all among the ranks of local index b: the partial
//     sum of partition node_a*RanksPerNode + b goes to node a;
//  6. it dequantizes and sums them in ascending node order and divides by
//     W: the true mean (the reference divides by the node count only).
//
// Per call each rank sends about (R-1)/R*n*bits/8 bytes inside its node
// (R = RanksPerNode) and (Nodes-1)/W*n*bits/8 across nodes, plus one
// float32 scale per group and a 16-byte header per destination; a float32
// ring reduce-scatter sends (W-1)/W*4n, an fp16 ring allreduce
// 2(W-1)/W*2n.
//
// A QGZ holds its buffers (and the error-feedback residuals) and
// allocates nothing per call. It is used by one goroutine at a time; all
// ranks of the layout call ReduceScatter together.
type QGZ struct {
	l                 *comm.Layout
	n, padded, part   int
	bits, group       int
	nodes, rpn, world int
	ef                bool

	partCodes, partGroups, partBytes int // one quantized partition
	chunkIntra, chunkInter           int // one all-to-all chunk, header included

	intraSend, intraRecv []byte
	interSend, interRecv []byte
	partial              []float32 // Nodes*P: the partial sums of step 3
	scales, negScales    []float32 // one partition's scales
	tmp                  []float32 // P: a padded or fed-back partition
	res1                 []float32 // Padded(): residual of round 1 (error feedback)
	res2                 []float32 // Nodes*P: residual of round 2 (error feedback)
}

// hdrLen is the header at the start of every all-to-all chunk: the rank
// (plus 1, 0 for none) that called with bad lengths, and those lengths, so
// that every rank reports the bad call instead of waiting for it.
const hdrLen = 16

// cfgLen is what each rank contributes to the construction agreement: the
// six settings and a flag saying that this rank's layout is inconsistent.
const cfgLen = 8 * 7

// NewQGZ returns a QGZ for tensors of n elements on the layout l. Every
// rank of l.World must call it together: it runs one small all-gather so
// that a bad configuration on any rank (n <= 0, or what cfg.Validate
// refuses) and configurations that differ across ranks are an error on
// every rank.
func NewQGZ(ctx context.Context, l *comm.Layout, n int, cfg QGZConfig) (*QGZ, error) {
	if l == nil || l.World == nil || l.Intra == nil || l.Inter == nil {
		return nil, errors.New("quant: qgz: nil or incomplete layout")
	}
	if cfg.GroupSize == 0 {
		cfg.GroupSize = DefaultGroupSize
	}
	w := l.World.Size()
	// An inconsistent layout (one not made by comm.NewLayout) is refused
	// inside the agreement, so that the peers of the rank that has it
	// return an error too instead of waiting for it.
	var layoutErr error
	if l.Nodes*l.RanksPerNode != w || l.Intra.Size() != l.RanksPerNode || l.Inter.Size() != l.Nodes {
		layoutErr = fmt.Errorf("quant: qgz: inconsistent layout: %v with %d ranks, node groups of %d and %d",
			l, w, l.Intra.Size(), l.Inter.Size())
	}
	ef := 0
	if cfg.ErrorFeedback {
		ef = 1
	}
	refused := 0
	if layoutErr != nil {
		refused = 1
	}
	mine := [7]int{n, cfg.Bits, cfg.GroupSize, ef, l.Nodes, l.RanksPerNode, refused}
	send := make([]byte, cfgLen)
	for i, v := range mine {
		binary.LittleEndian.PutUint64(send[8*i:], uint64(int64(v)))
	}
	all := make([]byte, cfgLen*w)
	if err := l.World.AllGatherBytes(ctx, send, all); err != nil {
		return nil, fmt.Errorf("quant: qgz: agreeing on the configuration: %w", err)
	}
	get := func(r, i int) int { return int(int64(binary.LittleEndian.Uint64(all[r*cfgLen+8*i:]))) }
	if layoutErr != nil {
		return nil, layoutErr
	}
	for r := 0; r < w; r++ {
		if get(r, 6) != 0 {
			return nil, fmt.Errorf("quant: qgz: rank %d refused: inconsistent layout on that rank", r)
		}
	}
	for r := 0; r < w; r++ {
		if err := checkQGZ(get(r, 0), get(r, 1), get(r, 2)); err != nil {
			return nil, fmt.Errorf("quant: qgz: rank %d: %w", r, err)
		}
	}
	names := [6]string{"tensor length", "bits", "group size", "error feedback", "nodes", "ranks per node"}
	for r := 1; r < w; r++ {
		for i, name := range names {
			if got, want := get(r, i), get(0, i); got != want {
				return nil, fmt.Errorf("quant: qgz: %w", &comm.MismatchError{
					Collective: comm.CAllGather, What: "qgz " + name, Rank: r, Got: got, Want: want})
			}
		}
	}

	q := &QGZ{l: l, n: n, bits: cfg.Bits, group: cfg.GroupSize, ef: cfg.ErrorFeedback,
		nodes: l.Nodes, rpn: l.RanksPerNode, world: w}
	q.padded = (n + w - 1) / w * w
	q.part = q.padded / w
	q.partCodes = CodesLen(q.part, q.bits)
	q.partGroups = NumGroups(q.part, q.group)
	q.partBytes = q.partCodes + 4*q.partGroups
	q.chunkIntra = hdrLen + q.nodes*q.partBytes
	q.chunkInter = hdrLen + q.partBytes
	q.intraSend = make([]byte, q.rpn*q.chunkIntra)
	q.intraRecv = make([]byte, q.rpn*q.chunkIntra)
	q.interSend = make([]byte, q.nodes*q.chunkInter)
	q.interRecv = make([]byte, q.nodes*q.chunkInter)
	q.partial = make([]float32, q.nodes*q.part)
	q.scales = make([]float32, q.partGroups)
	q.negScales = make([]float32, q.partGroups)
	q.tmp = make([]float32, q.part)
	if q.ef {
		q.res1 = make([]float32, q.padded)
		q.res2 = make([]float32, q.nodes*q.part)
	}
	return q, nil
}

func checkQGZ(n, bits, group int) error {
	if n <= 0 {
		return fmt.Errorf("tensor length %d: want > 0", n)
	}
	return QGZConfig{Bits: bits, GroupSize: group}.check()
}

// Len is the tensor length n the QGZ was made for.
func (q *QGZ) Len() int { return q.n }

// PartLen is the length of each rank's partition: Padded()/W.
func (q *QGZ) PartLen() int { return q.part }

// Padded is n rounded up to a multiple of W. The zero pad sits at the end
// of the last partitions and comes back as zeros.
func (q *QGZ) Padded() int { return q.padded }

// Reset zeroes the error-feedback residuals (a no-op without error
// feedback).
func (q *QGZ) Reset() {
	clear(q.res1)
	clear(q.res2)
}

// Residuals returns the error-feedback residuals, nil without error
// feedback: what round 1 lost on each of this rank's partitions (Padded()
// values, partition p at [p*P, (p+1)*P)) and what round 2 lost on the
// partial sums this rank re-quantized (Nodes*PartLen() values, node a's at
// [a*P, (a+1)*P)). They are live: a checkpoint saves and restores them.
func (q *QGZ) Residuals() (round1, round2 []float32) { return q.res1, q.res2 }

// ReduceScatter leaves in recv the mean over all ranks of partition
// l.World.Rank() of send: len(send) == n, len(recv) == PartLen(). Elements
// of recv beyond n (the pad) are zero. A rank that calls with other
// lengths still takes part in both hops, so that every rank returns the
// error.
func (q *QGZ) ReduceScatter(ctx context.Context, send, recv []float32) error {
	st := status{}
	if len(send) != q.n || len(recv) != q.part {
		st = status{rank: q.l.World.Rank() + 1, send: len(send), recv: len(recv)}
	}
	P, R, N := q.part, q.rpn, q.nodes

	// Step 1: quantize every partition; the chunk for local rank b holds
	// partitions a*R + b for every node a, in node order.
	for b := 0; b < R; b++ {
		chunk := q.intraSend[b*q.chunkIntra : (b+1)*q.chunkIntra]
		st.put(chunk)
		if st.bad() {
			continue
		}
		for a := 0; a < N; a++ {
			p := a*R + b
			lo := min(p*P, q.n)
			hi := min(lo+P, q.n)
			var res []float32
			if q.ef {
				res = q.res1[p*P : (p+1)*P]
			}
			q.encode(chunk[hdrLen+a*q.partBytes:hdrLen+(a+1)*q.partBytes], send[lo:hi], res)
		}
	}

	// Step 2: intra-node all-to-all.
	if err := q.l.Intra.AllToAllBytes(ctx, q.intraSend, q.intraRecv); err != nil {
		return fmt.Errorf("quant: qgz: intra-node all-to-all: %w", err)
	}
	st = st.merge(q.intraRecv, q.chunkIntra, R)

	// Steps 3 and 4: sum the partitions of every node in local-rank
	// order and re-quantize the partial sums, the one of node a in the
	// chunk for node a.
	for a := 0; a < N; a++ {
		chunk := q.interSend[a*q.chunkInter : (a+1)*q.chunkInter]
		st.put(chunk)
		if st.bad() {
			continue
		}
		acc := q.partial[a*P : (a+1)*P]
		clear(acc)
		for l := 0; l < R; l++ {
			off := l*q.chunkIntra + hdrLen + a*q.partBytes
			q.decodeAdd(acc, q.intraRecv[off:off+q.partBytes])
		}
		var res []float32
		if q.ef {
			res = q.res2[a*P : (a+1)*P]
		}
		q.encode(chunk[hdrLen:], acc, res)
	}

	// Step 5: inter-node all-to-all.
	if err := q.l.Inter.AllToAllBytes(ctx, q.interSend, q.interRecv); err != nil {
		return fmt.Errorf("quant: qgz: inter-node all-to-all: %w", err)
	}
	if st = st.merge(q.interRecv, q.chunkInter, N); st.bad() {
		return fmt.Errorf("quant: qgz: rank %d called ReduceScatter with len(send) %d and len(recv) %d, want %d and %d",
			st.rank-1, st.send, st.recv, q.n, q.part)
	}

	// Step 6: sum in node order and divide by W.
	clear(recv)
	for a := 0; a < N; a++ {
		off := a*q.chunkInter + hdrLen
		q.decodeAdd(recv, q.interRecv[off:off+q.partBytes])
	}
	w := float32(q.world)
	for i := range recv {
		recv[i] /= w
	}
	return nil
}

// encode quantizes src, zero-padded to P elements, plus res when error
// feedback is on, into dst (codes, then little-endian scales); res becomes
// what the quantization lost.
func (q *QGZ) encode(dst []byte, src []float32, res []float32) {
	x := src
	if len(src) < q.part || res != nil {
		k := copy(q.tmp, src)
		clear(q.tmp[k:])
		for i, r := range res {
			q.tmp[i] += r
		}
		x = q.tmp
	}
	codes := dst[:q.partCodes]
	quantizeWith(&fast, codes, q.scales, x, q.bits, q.group)
	putScales(dst[q.partCodes:q.partBytes], q.scales)
	if res != nil {
		copy(res, x)
		for i, s := range q.scales {
			q.negScales[i] = -s
		}
		dequantizeAddWith(&fast, res, codes, q.negScales, q.bits, q.group)
	}
}

// decodeAdd adds the partition quantized in src to dst.
func (q *QGZ) decodeAdd(dst []float32, src []byte) {
	getScales(q.scales, src[q.partCodes:q.partBytes])
	dequantizeAddWith(&fast, dst, src[:q.partCodes], q.scales, q.bits, q.group)
}

// status is the header of a chunk: the lowest rank (plus 1) known to have
// called with bad lengths, and its lengths.
type status struct{ rank, send, recv int }

func (s status) bad() bool { return s.rank != 0 }

func (s status) put(chunk []byte) {
	binary.LittleEndian.PutUint32(chunk[0:], uint32(s.rank))
	binary.LittleEndian.PutUint32(chunk[4:], uint32(min(uint64(max(s.send, 0)), math.MaxUint32)))
	binary.LittleEndian.PutUint32(chunk[8:], uint32(min(uint64(max(s.recv, 0)), math.MaxUint32)))
	binary.LittleEndian.PutUint32(chunk[12:], 0)
}

// merge returns the status of the lowest bad rank among s and the headers
// of the count chunks of buf.
func (s status) merge(buf []byte, chunkLen, count int) status {
	for j := 0; j < count; j++ {
		h := buf[j*chunkLen:]
		r := int(binary.LittleEndian.Uint32(h[0:]))
		if r != 0 && (s.rank == 0 || r < s.rank) {
			s = status{rank: r, send: int(binary.LittleEndian.Uint32(h[4:])), recv: int(binary.LittleEndian.Uint32(h[8:]))}
		}
	}
	return s
}
