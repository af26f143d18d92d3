package conformance

import (
	"context"
	"encoding/json"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/quant"
)

// QuantCase is a quant vector: one buffer quantized in groups.
type QuantCase struct {
	Bits        int     `json:"bits"`
	GroupSize   int     `json:"group_size"`
	Input       []Float `json:"input"`
	Codes       []int   `json:"codes"`
	Scales      []Float `json:"scales"`
	Dequantized []Float `json:"dequantized"`
	Packed      []int   `json:"packed"`
}

// QGZCase is a qgz vector: every rank's input and output of one
// hierarchical quantized reduce-scatter.
type QGZCase struct {
	Nodes        int       `json:"nodes"`
	RanksPerNode int       `json:"ranks_per_node"`
	Bits         int       `json:"bits"`
	GroupSize    int       `json:"group_size"`
	Numel        int       `json:"numel"`
	Inputs       [][]Float `json:"inputs"`
	Outputs      [][]Float `json:"outputs"`
	ExactMean    [][]Float `json:"exact_mean"`
}

// RSCCase is an rsc vector: every rank's tensors and owned outputs of one
// coalesced reduce-scatter.
type RSCCase struct {
	World   int         `json:"world"`
	Shapes  [][]int     `json:"shapes"`
	Inputs  [][][]Float `json:"inputs"`
	Outputs [][][]Float `json:"outputs"`
}

// Quant decodes c as a quant case.
func (c *Case) Quant() (*QuantCase, error) {
	q := &QuantCase{}
	return q, c.decode("quant", q)
}

// QGZ decodes c as a qgz case.
func (c *Case) QGZ() (*QGZCase, error) {
	q := &QGZCase{}
	if err := c.decode("qgz", q); err != nil {
		return nil, err
	}
	w := q.Nodes * q.RanksPerNode
	if q.Nodes < 1 || q.RanksPerNode < 1 || len(q.Inputs) != w || len(q.Outputs) != w {
		return nil, fmt.Errorf("qgz case: %d nodes x %d ranks with %d inputs and %d outputs",
			q.Nodes, q.RanksPerNode, len(q.Inputs), len(q.Outputs))
	}
	return q, nil
}

// RSC decodes c as an rsc case.
func (c *Case) RSC() (*RSCCase, error) {
	q := &RSCCase{}
	if err := c.decode("rsc", q); err != nil {
		return nil, err
	}
	if q.World < 1 || len(q.Inputs) != q.World || len(q.Outputs) != q.World {
		return nil, fmt.Errorf("rsc case: world %d with %d inputs and %d outputs", q.World, len(q.Inputs), len(q.Outputs))
	}
	return q, nil
}

func (c *Case) decode(kind string, v any) error {
	if c.Kind != kind {
		return fmt.Errorf("case %s is of kind %q, not %q", c.Name, c.Kind, kind)
	}
	if err := json.Unmarshal(c.Raw, v); err != nil {
		return fmt.Errorf("conformance: %s: %w", c.Path, err)
	}
	return nil
}

// WorldSize is the number of ranks a case needs: 0 for the kinds that run
// on one rank.
func (c *Case) WorldSize() int {
	switch c.Kind {
	case "onebit", KindOptimizer:
		return c.World
	case "qgz":
		if q, err := c.QGZ(); err == nil {
			return q.Nodes * q.RanksPerNode
		}
	case "rsc":
		if q, err := c.RSC(); err == nil {
			return q.World
		}
	}
	return 0
}

// RunQuant checks a quant case: the codes, the packed bytes and the scales
// must match exactly, the dequantized values to the spec's tolerance, and
// the int4 decoder must give the codes back.
func RunQuant(c *Case) error {
	q, err := c.Quant()
	if err != nil {
		return err
	}
	in := Floats(q.Input)
	n := len(in)
	if len(q.Codes) != n || len(q.Packed) != quant.CodesLen(n, q.Bits) || len(q.Scales) != quant.NumGroups(n, q.GroupSize) {
		return fmt.Errorf("case has %d codes, %d packed bytes and %d scales for %d inputs",
			len(q.Codes), len(q.Packed), len(q.Scales), n)
	}
	packed := make([]byte, quant.CodesLen(n, q.Bits))
	scales := make([]float32, quant.NumGroups(n, q.GroupSize))
	if err := quant.Quantize(packed, scales, in, q.Bits, q.GroupSize); err != nil {
		return err
	}
	for i, b := range q.Packed {
		if int(packed[i]) != b {
			return fmt.Errorf("packed[%d] = %#02x, want %#02x", i, packed[i], b)
		}
	}
	for i, s := range q.Scales {
		if math.Float32bits(scales[i]) != math.Float32bits(float32(s)) {
			return fmt.Errorf("scales[%d] = %g, want %g", i, scales[i], float32(s))
		}
	}
	codes := make([]int8, n)
	if q.Bits == 4 {
		if err := quant.Unpack4(codes, packed); err != nil {
			return err
		}
	} else {
		for i, b := range packed {
			codes[i] = int8(b)
		}
	}
	for i, want := range q.Codes {
		if int(codes[i]) != want {
			return fmt.Errorf("codes[%d] = %d, want %d", i, codes[i], want)
		}
	}
	deq := make([]float32, n)
	if err := quant.DequantizeAdd(deq, packed, scales, q.Bits, q.GroupSize); err != nil {
		return err
	}
	return CompareFloats("dequantized", deq, q.Dequantized)
}

// RunQGZRank runs a qgz case as rank l.World.Rank() of the layout l, which
// must be the case's nodes x ranks per node: the rank's output must match
// the case's to the spec's tolerance. Every rank of l must call it
// together.
func RunQGZRank(ctx context.Context, l *comm.Layout, c *Case) error {
	q, err := c.QGZ()
	if err != nil {
		return err
	}
	if l.Nodes != q.Nodes || l.RanksPerNode != q.RanksPerNode {
		return fmt.Errorf("case needs %d nodes x %d ranks, the layout is %d x %d",
			q.Nodes, q.RanksPerNode, l.Nodes, l.RanksPerNode)
	}
	r := l.World.Rank()
	qg, err := quant.NewQGZ(ctx, l, q.Numel, quant.QGZConfig{Bits: q.Bits, GroupSize: q.GroupSize})
	if err != nil {
		return err
	}
	recv := make([]float32, qg.PartLen())
	if err := qg.ReduceScatter(ctx, Floats(q.Inputs[r]), recv); err != nil {
		return err
	}
	return CompareFloats(fmt.Sprintf("rank %d output", r), recv, q.Outputs[r])
}

// RunRSCRank runs an rsc case as rank cm.Rank(), whose size must be the
// case's world: every owned output must match. Every rank of cm must call
// it together.
func RunRSCRank(ctx context.Context, cm comm.Comm, c *Case) error {
	q, err := c.RSC()
	if err != nil {
		return err
	}
	if cm.Size() != q.World {
		return fmt.Errorf("case needs %d ranks, communicator has %d", q.World, cm.Size())
	}
	r := cm.Rank()
	sizes := make([]int, len(q.Shapes))
	for i, s := range q.Shapes {
		sizes[i] = 1
		for _, d := range s {
			sizes[i] *= d
		}
	}
	if len(q.Inputs[r]) != len(sizes) || len(q.Outputs[r]) != len(sizes) {
		return fmt.Errorf("rank %d: %d inputs and %d outputs for %d shapes", r, len(q.Inputs[r]), len(q.Outputs[r]), len(sizes))
	}
	rs, err := quant.NewCoalesced(ctx, cm, sizes)
	if err != nil {
		return err
	}
	inputs := make([][]float32, len(sizes))
	for i, t := range q.Inputs[r] {
		inputs[i] = Floats(t)
	}
	outs, err := rs.ReduceScatter(ctx, inputs)
	if err != nil {
		return err
	}
	for i, want := range q.Outputs[r] {
		if err := CompareFloats(fmt.Sprintf("rank %d tensor %d", r, i), outs[i], want); err != nil {
			return err
		}
	}
	return nil
}
