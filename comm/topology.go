package comm

import (
	"context"
	"errors"
	"fmt"
)

// NodeSplitter is implemented by communicators that know which of their
// ranks share a machine (a node). comm/local groups its ranks by its
// WithRanksPerNode option; comm/mpi asks MPI which ranks share memory.
type NodeSplitter interface {
	// SplitNode returns a communicator of the ranks that share this rank's
	// node, ordered by their rank in this communicator. Every rank of the
	// group must call it. A wrapper (see Wrapper) whose wrapped
	// communicator cannot tell returns an error wrapping
	// errors.ErrUnsupported, on every rank, without communicating; callers
	// then take each rank to be a node of its own, as for a communicator
	// that does not implement NodeSplitter.
	SplitNode(ctx context.Context) (Comm, error)
}

// Layout is a node-major view of a communicator, the shape hierarchical
// collectives (the quantized qgZ reduce-scatter, the two-level
// reduce-scatter) work on: Nodes machines of RanksPerNode ranks each, with
// World rank = Node*RanksPerNode + Local.
//
// Intra connects the ranks of one node (Intra.Rank() == Local) and Inter
// connects the ranks of every node that share this rank's local index
// (Inter.Rank() == Node): the "rail" that crosses machines.
type Layout struct {
	World Comm // the whole group
	Intra Comm // the ranks of this node, ordered by Local
	Inter Comm // one rank per node (those with this Local index), ordered by Node

	Nodes        int // number of nodes
	RanksPerNode int // ranks on every node
	Node         int // this rank's node: World.Rank() / RanksPerNode
	Local        int // this rank's index on its node: World.Rank() % RanksPerNode
}

// NewLayout builds the node-major layout of c. Every rank of c must call it.
//
// With ranksPerNode > 0 the layout is explicit: ranks [0, k) are node 0,
// [k, 2k) node 1, and so on. This is how tests and benchmarks lay out
// several "machines" on one. With ranksPerNode == 0 the backend says which
// ranks share a machine (the NodeSplitter that As finds in c; a
// communicator without one is taken to be one rank per node). Every node must hold the same
// number of ranks, and the ranks of a node must be consecutive (node-major),
// as mpirun's default --map-by core places them.
//
// Bad layouts are an error on every rank: ranksPerNode < 0, a size that
// ranksPerNode does not divide, ranks that pass different values, nodes of
// different sizes, or ranks that are not node-major.
func NewLayout(ctx context.Context, c Comm, ranksPerNode int) (*Layout, error) {
	if c == nil {
		return nil, errors.New("comm: layout: nil communicator")
	}
	size, rank := c.Size(), c.Rank()
	// First agreement: what every rank asked for, so that every rank
	// returns the same error.
	lo, hi, _, err := minMax(ctx, c, ranksPerNode, 0)
	switch {
	case err != nil:
		return nil, fmt.Errorf("comm: layout: agreeing on ranks per node: %w", err)
	case lo != hi:
		return nil, fmt.Errorf("comm: layout: ranks disagree on ranks per node (%d and %d)", lo, hi)
	case ranksPerNode < 0:
		return nil, fmt.Errorf("comm: layout: ranks per node must be >= 0, got %d", ranksPerNode)
	case ranksPerNode > 0 && size%ranksPerNode != 0:
		return nil, fmt.Errorf("comm: layout: %d ranks per node does not divide the group size %d", ranksPerNode, size)
	}
	rpn := ranksPerNode
	var intra Comm
	if rpn == 0 {
		intra, err = SplitNode(ctx, c)
		switch {
		case errors.Is(err, errors.ErrUnsupported):
			rpn = 1
		case err != nil:
			return nil, fmt.Errorf("comm: layout: %w", err)
		default:
			rpn = intra.Size()
			// Second agreement: the nodes the backend found must be of
			// one size and node-major.
			bad := 0
			if intra.Rank() != rank%rpn || (rank/rpn)*rpn+intra.Rank() != rank {
				bad = 1
			}
			var outOfOrder bool
			lo, hi, outOfOrder, err = minMax(ctx, c, rpn, bad)
			switch {
			case err != nil:
				err = fmt.Errorf("comm: layout: agreeing on the nodes: %w", err)
			case lo != hi:
				err = fmt.Errorf("comm: layout: nodes hold different numbers of ranks (%d to %d); hierarchical collectives need the same number on every node", lo, hi)
			case outOfOrder || size%rpn != 0:
				err = fmt.Errorf("comm: layout: the ranks of a node are not consecutive (rank = node*%d + local); launch ranks node-major (mpirun --map-by core) or give ranks per node explicitly", rpn)
			}
			if err != nil {
				closeAll(intra)
				return nil, err
			}
		}
	}
	l := &Layout{World: c, Nodes: size / rpn, RanksPerNode: rpn, Node: rank / rpn, Local: rank % rpn}
	if intra == nil {
		if intra, err = c.Split(ctx, l.Node, l.Local); err != nil {
			return nil, fmt.Errorf("comm: layout: node communicator: %w", err)
		}
	}
	l.Intra = intra
	if l.Inter, err = c.Split(ctx, l.Local, l.Node); err != nil {
		closeAll(intra)
		return nil, fmt.Errorf("comm: layout: cross-node communicator: %w", err)
	}
	return l, nil
}

// String describes the layout, e.g. "2 nodes x 4 ranks".
func (l *Layout) String() string {
	return fmt.Sprintf("%d nodes x %d ranks", l.Nodes, l.RanksPerNode)
}

// Close releases Intra and Inter; World stays open.
func (l *Layout) Close() error {
	return errors.Join(closeAll(l.Intra), closeAll(l.Inter))
}

// minMax returns the smallest and largest v over the ranks of c, and
// whether any rank passed a non-zero flag.
func minMax(ctx context.Context, c Comm, v, flag int) (lo, hi int, anyFlag bool, err error) {
	agree := []float32{float32(v), -float32(v), float32(flag)}
	if err := c.AllReduce(ctx, agree, Max); err != nil {
		return 0, 0, false, err
	}
	return int(-agree[1]), int(agree[0]), agree[2] != 0, nil
}

func closeAll(c Comm) error {
	if c == nil {
		return nil
	}
	return c.Close()
}
