package outer

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/quant"
)

// int8Codec is CodecInt8's two-phase allreduce. On W ranks a buffer of m
// elements is handled as W chunks of C = ceil(m/W) elements (the last ones
// zero padded). Phase 1: every rank quantizes each chunk (int8 codes, one
// float32 scale per group of Int8GroupSize, see encode) and sends chunk j
// to rank j (all-to-all). Rank j dequantizes the W versions of its chunk
// and sums them in float32 in ascending rank order, divides by W,
// quantizes the mean again, and phase 2 all-gathers every rank's quantized
// mean, which every rank dequantizes: the same bytes, so the same result
// everywhere. A message is 4*ceil(C/Int8GroupSize) bytes of little-endian
// scales, then C codes; each rank sends 2(W-1) of them.
type int8Codec struct {
	send, recv   []byte    // W messages
	gsend, grecv []byte    // phase 2: one message, W messages
	chunk, acc   []float32 // C elements
	scales       []float32 // scales of one chunk
}

func newInt8Codec(largest, w int) *int8Codec {
	c := (largest + w - 1) / w
	msg := int8MsgLen(c)
	return &int8Codec{
		send: make([]byte, w*msg), recv: make([]byte, w*msg),
		gsend: make([]byte, msg), grecv: make([]byte, w*msg),
		chunk: make([]float32, c), acc: make([]float32, c),
		scales: make([]float32, quant.NumGroups(c, Int8GroupSize)),
	}
}

// int8MsgLen is the bytes of one quantized chunk of c elements.
func int8MsgLen(c int) int { return 4*quant.NumGroups(c, Int8GroupSize) + quant.CodesLen(c, 8) }

// encode quantizes x (C elements) into msg, symmetrically: in every group,
// everything in float32,
//
//	amax  = max |x|
//	scale = amax / 127                     (stored)
//	q     = min(127 / amax, MaxFloat32)    (0 when amax = 0)
//	code  = round_half_even(clamp(x * q, -127, 127))
//
// so that the codes of -x are those of x negated, ±amax come back as
// ±127*scale (±1 exactly), and the code -128 is never used. (quant's
// Quantize, DeepSpeed's formula, maps +amax to 128 clamped to 127, which
// shrinks the largest positive element by 1/128 every time it is
// quantized; the outer codec quantizes twice per exchange, with no error
// feedback.) A value dequantizes to code * scale.
func (q *int8Codec) encode(msg []byte, x []float32) {
	ng := quant.NumGroups(len(x), Int8GroupSize)
	codes := msg[4*ng:]
	for g := range ng {
		lo, hi := g*Int8GroupSize, min((g+1)*Int8GroupSize, len(x))
		var amax float32
		for _, v := range x[lo:hi] {
			if a := float32(math.Abs(float64(v))); a > amax {
				amax = a
			}
		}
		var qs float32
		if amax > 0 {
			qs = min(127/amax, math.MaxFloat32)
		}
		binary.LittleEndian.PutUint32(msg[4*g:], math.Float32bits(amax/127))
		for i, v := range x[lo:hi] {
			codes[lo+i] = byte(int8(symCode(v * qs)))
		}
	}
}

// symCode rounds y, clamped to [-127, 127] (NaN to -127), half to even.
func symCode(y float32) int32 {
	if !(y > -127) {
		y = -127
	}
	if !(y < 127) {
		y = 127
	}
	return int32(math.RoundToEven(float64(y)))
}

// decodeAdd adds what msg stands for to dst (C elements).
func (q *int8Codec) decodeAdd(dst []float32, msg []byte) error {
	ng := quant.NumGroups(len(dst), Int8GroupSize)
	sc := q.scales[:ng]
	for i := range sc {
		sc[i] = math.Float32frombits(binary.LittleEndian.Uint32(msg[4*i:]))
	}
	return quant.DequantizeAdd(dst, msg[4*ng:], sc, 8, Int8GroupSize)
}

// allReduce replaces buf with its int8 average over c's ranks.
func (q *int8Codec) allReduce(ctx context.Context, c comm.Comm, buf []float32) error {
	w, m := c.Size(), len(buf)
	cl := (m + w - 1) / w
	msg := int8MsgLen(cl)
	chunk, acc := q.chunk[:cl], q.acc[:cl]
	part := func(j int) []float32 { return buf[min(j*cl, m):min((j+1)*cl, m)] }
	for j := range w {
		p := part(j)
		copy(chunk, p)
		clear(chunk[len(p):])
		q.encode(q.send[j*msg:(j+1)*msg], chunk)
	}
	if err := c.AllToAllBytes(ctx, q.send[:w*msg], q.recv[:w*msg]); err != nil {
		return fmt.Errorf("phase 1 all-to-all: %w", err)
	}
	clear(acc)
	for j := range w {
		if err := q.decodeAdd(acc, q.recv[j*msg:(j+1)*msg]); err != nil {
			return fmt.Errorf("dequantize: %w", err)
		}
	}
	fw := float32(w)
	for i := range acc {
		acc[i] /= fw
	}
	q.encode(q.gsend[:msg], acc)
	if err := c.AllGatherBytes(ctx, q.gsend[:msg], q.grecv[:w*msg]); err != nil {
		return fmt.Errorf("phase 2 all-gather: %w", err)
	}
	for j := range w {
		clear(chunk)
		if err := q.decodeAdd(chunk, q.grecv[j*msg:(j+1)*msg]); err != nil {
			return fmt.Errorf("dequantize: %w", err)
		}
		copy(part(j), chunk)
	}
	return nil
}
