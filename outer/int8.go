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
// elements is handled as W chunks of C = ceil(m/W) elements (zero
// padded). Phase 1: every rank quantizes each chunk (int8 codes, one
// float32 scale per group of Int8GroupSize) and sends chunk j to rank j
// (all-to-all). Rank j dequantizes the W versions of its chunk and sums
// them in float32 in ascending rank order, divides by W, quantizes the
// mean again, and phase 2 all-gathers every rank's quantized mean, which
// every rank dequantizes: the same bytes, so the same result everywhere.
// A message is 4*ceil(C/Int8GroupSize) bytes of little-endian scales,
// then C codes; each rank sends 2(W-1) of them.
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

// encode quantizes x (C elements) into msg.
func (q *int8Codec) encode(msg []byte, x []float32) error {
	ng := quant.NumGroups(len(x), Int8GroupSize)
	sc := q.scales[:ng]
	if err := quant.Quantize(msg[4*ng:], sc, x, 8, Int8GroupSize); err != nil {
		return err
	}
	for i, s := range sc {
		binary.LittleEndian.PutUint32(msg[4*i:], math.Float32bits(s))
	}
	return nil
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
		if err := q.encode(q.send[j*msg:(j+1)*msg], chunk); err != nil {
			return fmt.Errorf("quantize: %w", err)
		}
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
	if err := q.encode(q.gsend[:msg], acc); err != nil {
		return fmt.Errorf("quantize: %w", err)
	}
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
