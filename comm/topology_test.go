package comm_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

func layoutCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// checkLayout verifies l's fields and that Intra and Inter connect the
// ranks they should: an allgather of world ranks over each.
func checkLayout(ctx context.Context, l *comm.Layout, nodes, rpn int) error {
	r := l.World.Rank()
	switch {
	case l.Nodes != nodes || l.RanksPerNode != rpn:
		return fmt.Errorf("layout %v, want %d x %d", l, nodes, rpn)
	case l.Node != r/rpn || l.Local != r%rpn:
		return fmt.Errorf("rank %d: node %d local %d", r, l.Node, l.Local)
	case l.Intra.Size() != rpn || l.Intra.Rank() != l.Local:
		return fmt.Errorf("rank %d: intra %d/%d", r, l.Intra.Rank(), l.Intra.Size())
	case l.Inter.Size() != nodes || l.Inter.Rank() != l.Node:
		return fmt.Errorf("rank %d: inter %d/%d", r, l.Inter.Rank(), l.Inter.Size())
	}
	in := make([]float32, rpn)
	if err := l.Intra.AllGather(ctx, []float32{float32(r)}, in); err != nil {
		return err
	}
	for i, v := range in {
		if int(v) != l.Node*rpn+i {
			return fmt.Errorf("rank %d: intra member %d is rank %v", r, i, v)
		}
	}
	out := make([]float32, nodes)
	if err := l.Inter.AllGather(ctx, []float32{float32(r)}, out); err != nil {
		return err
	}
	for i, v := range out {
		if int(v) != i*rpn+l.Local {
			return fmt.Errorf("rank %d: inter member %d is rank %v", r, i, v)
		}
	}
	return nil
}

func TestLayoutExplicit(t *testing.T) {
	for _, c := range []struct{ nodes, rpn int }{{1, 1}, {1, 4}, {4, 1}, {2, 2}, {3, 2}, {2, 3}, {4, 2}} {
		t.Run(fmt.Sprintf("%dx%d", c.nodes, c.rpn), func(t *testing.T) {
			ctx := layoutCtx(t)
			err := local.Run(ctx, c.nodes*c.rpn, func(ctx context.Context, w comm.Comm) error {
				l, err := comm.NewLayout(ctx, w, c.rpn)
				if err != nil {
					return err
				}
				defer l.Close()
				return checkLayout(ctx, l, c.nodes, c.rpn)
			})
			require.NoError(t, err)
		})
	}
}

func TestLayoutFromBackend(t *testing.T) {
	for _, c := range []struct{ nodes, rpn int }{{1, 4}, {2, 2}, {3, 2}, {6, 1}} {
		t.Run(fmt.Sprintf("%dx%d", c.nodes, c.rpn), func(t *testing.T) {
			ctx := layoutCtx(t)
			err := local.Run(ctx, c.nodes*c.rpn, func(ctx context.Context, w comm.Comm) error {
				l, err := comm.NewLayout(ctx, w, 0)
				if err != nil {
					return err
				}
				defer l.Close()
				return checkLayout(ctx, l, c.nodes, c.rpn)
			}, local.WithRanksPerNode(c.rpn))
			require.NoError(t, err)
		})
	}
	t.Run("default is one node", func(t *testing.T) {
		ctx := layoutCtx(t)
		require.NoError(t, local.Run(ctx, 3, func(ctx context.Context, w comm.Comm) error {
			l, err := comm.NewLayout(ctx, w, 0)
			if err != nil {
				return err
			}
			defer l.Close()
			return checkLayout(ctx, l, 1, 3)
		}))
	})
	t.Run("split keeps nodes", func(t *testing.T) {
		// Ranks 0..7 on 4 nodes of 2; the even ranks form a group of 4
		// ranks on 4 different nodes, the odd ones likewise.
		ctx := layoutCtx(t)
		require.NoError(t, local.Run(ctx, 8, func(ctx context.Context, w comm.Comm) error {
			sub, err := w.Split(ctx, w.Rank()%2, w.Rank())
			if err != nil {
				return err
			}
			defer sub.Close()
			l, err := comm.NewLayout(ctx, sub, 0)
			if err != nil {
				return err
			}
			defer l.Close()
			return checkLayout(ctx, l, 4, 1)
		}, local.WithRanksPerNode(2)))
	})
}

func TestLayoutErrors(t *testing.T) {
	cases := []struct {
		name string
		size int
		rpn  func(rank int) int
		opts []local.Option
		want string
	}{
		{"not dividing", 6, func(int) int { return 4 }, nil, "does not divide the group size 6"},
		{"negative", 4, func(int) int { return -1 }, nil, "must be >= 0"},
		{"disagree", 4, func(r int) int { return 1 + r%2 }, nil, "ranks disagree on ranks per node (1 and 2)"},
		{"half asks backend", 4, func(r int) int { return 2 * (r % 2) }, []local.Option{local.WithRanksPerNode(1)}, "disagree"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx := layoutCtx(t)
			errs := make([]error, c.size)
			_ = local.Run(ctx, c.size, func(ctx context.Context, w comm.Comm) error {
				l, err := comm.NewLayout(ctx, w, c.rpn(w.Rank()))
				errs[w.Rank()] = err
				if err == nil {
					l.Close()
				}
				return err
			}, c.opts...)
			for r, err := range errs {
				require.Error(t, err, "rank %d", r)
				assert.Contains(t, err.Error(), c.want, "rank %d", r)
			}
		})
	}
	t.Run("backend option", func(t *testing.T) {
		_, err := local.New(6, local.WithRanksPerNode(4))
		require.ErrorContains(t, err, "4 ranks per node does not divide the group size 6")
		_, err = local.New(6, local.WithRanksPerNode(0))
		require.Error(t, err)
	})
	t.Run("nil", func(t *testing.T) {
		_, err := comm.NewLayout(context.Background(), nil, 1)
		require.Error(t, err)
	})
}

// ExampleNewLayout lays 6 in-process ranks out as 3 machines of 2 ranks,
// the shape hierarchical collectives work on.
func ExampleNewLayout() {
	ctx := context.Background()
	out := make([]string, 6)
	err := local.Run(ctx, 6, func(ctx context.Context, c comm.Comm) error {
		l, err := comm.NewLayout(ctx, c, 0) // 0: ask the backend
		if err != nil {
			return err
		}
		defer l.Close()
		out[c.Rank()] = fmt.Sprintf("rank %d: node %d, local %d (%v)", c.Rank(), l.Node, l.Local, l)
		return nil
	}, local.WithRanksPerNode(2))
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, s := range out {
		fmt.Println(s)
	}
	// Output:
	// rank 0: node 0, local 0 (3 nodes x 2 ranks)
	// rank 1: node 0, local 1 (3 nodes x 2 ranks)
	// rank 2: node 1, local 0 (3 nodes x 2 ranks)
	// rank 3: node 1, local 1 (3 nodes x 2 ranks)
	// rank 4: node 2, local 0 (3 nodes x 2 ranks)
	// rank 5: node 2, local 1 (3 nodes x 2 ranks)
}
