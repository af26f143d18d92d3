package optim

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/lowbit-ml/lowbit/comm"
)

// MuonConfig.Split: each rank orthogonalizes its own share of the Muon
// matrices and one all-gather shares the updates.

// muonSplit is the plan of a Split Muon on more than one rank.
type muonSplit struct {
	c     comm.Comm
	rank  int
	owner []int // per matrix of Muon.mats: the rank that orthogonalizes it (-1: no elements)
	off   []int // per matrix: where its update starts in its owner's share
	share int   // S, the largest share's elements: every rank's part of the all-gather
	send  []float32
	recv  []float32 // W*S: rank r's share at r*S
}

func newMuonSplit(c comm.Comm, mats []muonMatrix) *muonSplit {
	dims := make([][2]int, len(mats))
	for k, mt := range mats {
		if mt.ns != nil {
			dims[k] = [2]int{mt.rows, mt.cols}
		}
	}
	owner, off, share := splitMatrices(dims, c.Size())
	return &muonSplit{
		c: c, rank: c.Rank(), owner: owner, off: off, share: share,
		send: make([]float32, share), recv: make([]float32, c.Size()*share),
	}
}

// nsCost is the floating-point operations of one Newton-Schulz iteration
// on a rows x cols matrix: with r <= c its smaller and larger dimension,
// the symmetric A = X X^T (r²c, half a general product's 2r²c), the
// symmetric A A (r³) and B X (2r²c).
func nsCost(rows, cols int) int64 {
	r, c := int64(min(rows, cols)), int64(max(rows, cols))
	return 3*r*r*c + r*r*r
}

// splitMatrices assigns the matrices of the given dimensions (rows, cols;
// a matrix without elements has none to assign and gets owner -1) to
// world ranks, balancing nsCost: largest cost first (ties in order), each
// onto the rank with the least cost so far (ties to the lowest rank). It
// returns each matrix's owner, its offset in its owner's share (the
// owner's matrices in order), and the largest share's elements. It
// depends only on its arguments, so every rank computes the same plan.
func splitMatrices(dims [][2]int, world int) (owner, off []int, share int) {
	owner, off = make([]int, len(dims)), make([]int, len(dims))
	order := make([]int, 0, len(dims))
	for k, d := range dims {
		owner[k] = -1
		if d[0]*d[1] > 0 {
			order = append(order, k)
		}
	}
	slices.SortStableFunc(order, func(a, b int) int {
		return cmp.Compare(nsCost(dims[b][0], dims[b][1]), nsCost(dims[a][0], dims[a][1]))
	})
	load := make([]int64, world)
	for _, k := range order {
		r := 0
		for q := range load {
			if load[q] < load[r] {
				r = q
			}
		}
		owner[k] = r
		load[r] += nsCost(dims[k][0], dims[k][1])
	}
	used := make([]int, world)
	for k, d := range dims {
		if r := owner[k]; r >= 0 {
			off[k] = used[r]
			used[r] += d[0] * d[1]
		}
	}
	return owner, off, slices.Max(used)
}

// splitUpdate is the Muon group's step with Split: every rank updates
// every momentum, orthogonalizes its own matrices into its share of the
// all-gather (the update that the step without Split subtracts,
// lr*scale*X rounded to float32, in the parameter's layout; zero for a
// zero momentum), then applies every matrix's update from the gathered
// shares with the same rounding as without Split.
func (o *Muon) splitUpdate(ctx context.Context, lr, decay float32) error {
	cfg, sp := o.cfg, o.split
	for k, mt := range o.mats {
		p := o.params[mt.i]
		m, g := o.m[mt.i], p.GradData()
		Momentum(m, g, cfg.Momentum)
		if sp.owner[k] != sp.rank {
			continue
		}
		mt.ns.orthogonalize(sp.send[sp.off[k]:], m, g, mt.rows, mt.cols, cfg, mt.step(lr))
	}
	if sp.share == 0 { // every rank's plan is the same: none gathers
		return nil
	}
	if err := sp.c.AllGather(ctx, sp.send, sp.recv); err != nil {
		return fmt.Errorf("gathering the orthogonalized updates: %w", err)
	}
	for k, mt := range o.mats {
		r := sp.owner[k]
		if r < 0 {
			continue
		}
		at := r*sp.share + sp.off[k]
		p := o.params[mt.i].Data()
		u := sp.recv[at : at+len(p)]
		for j, x := range u {
			p[j] = float32(p[j]*decay) - x
		}
	}
	return nil
}

// storeNS writes step*x into dst, x transposed back to the rows x cols
// layout when rows > cols, each product rounded to float32 (applyNS's
// rounding).
func storeNS(dst, x []float32, rows, cols int, step float32) {
	if rows <= cols {
		x = x[:len(dst)]
		for k, v := range x {
			dst[k] = float32(step * v)
		}
		return
	}
	for r := range rows {
		row := dst[r*cols : (r+1)*cols]
		for c := range row {
			row[c] = float32(step * x[c*rows+r])
		}
	}
}
