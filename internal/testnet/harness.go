package testnet

import (
	"context"
	"fmt"
	"math"
	"path/filepath"
	"slices"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
)

// Setup describes a small data-parallel training run on in-process ranks:
// every rank builds the same network from Seed and trains it on its own
// shard of ShardN samples of a set generated from Seed.
type Setup struct {
	World         int
	Seed          uint64
	In, Hidden    int
	Classes       int
	ShardN, Batch int
	// Empty adds a parameter with zero elements after the network's.
	Empty bool
	// New builds the optimizer under test over params on c.
	New func(c comm.Comm, params []*optim.Param) (optim.Optimizer, error)
}

// Data returns the whole training set, World shards of ShardN samples.
func (s Setup) Data() Data {
	return Generate(s.Seed, s.World*s.ShardN, s.In, s.Classes)
}

// rank builds rank r's network (from netSeed), parameters, shard and
// optimizer.
func (s Setup) rank(c comm.Comm, d Data, netSeed uint64) (*Net, optim.Optimizer, Data, error) {
	net := New(netSeed, s.In, s.Hidden, s.Classes)
	params := net.Params()
	if s.Empty {
		params = append(slices.Clone(params), optim.NewParam("empty", 0))
	}
	opt, err := s.New(c, params)
	if err != nil {
		return nil, nil, Data{}, err
	}
	r := c.Rank()
	return net, opt, d.Shard(r*s.ShardN, (r+1)*s.ShardN), nil
}

// Uninterrupted trains steps steps and returns every rank's final
// checkpoint. before, when not nil, is called on every rank at every step
// after the gradient is written (see Train).
func (s Setup) Uninterrupted(ctx context.Context, steps int64, before func(rank int, t int64, net *Net)) ([]*optim.Checkpoint, error) {
	d := s.Data()
	out := make([]*optim.Checkpoint, s.World)
	err := local.Run(ctx, s.World, func(ctx context.Context, c comm.Comm) error {
		net, opt, shard, err := s.rank(c, d, s.Seed)
		if err != nil {
			return err
		}
		var hook func(int64)
		if before != nil {
			hook = func(t int64) { before(c.Rank(), t, net) }
		}
		if err := Train(ctx, opt, net, shard, s.Batch, 1, steps, hook); err != nil {
			return err
		}
		out[c.Rank()], err = opt.State()
		return err
	})
	return out, err
}

// Resumed trains k steps, writes every rank's checkpoint to its own file
// in dir with optim.SaveFile, ends that group, and then, in a new group
// whose networks start from other weights, reads the files back with
// optim.LoadFile, loads them into fresh optimizers and trains steps k+1 to
// steps. It returns every rank's final checkpoint.
func (s Setup) Resumed(ctx context.Context, dir string, k, steps int64) ([]*optim.Checkpoint, error) {
	d := s.Data()
	path := func(r int) string { return filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", r)) }
	err := local.Run(ctx, s.World, func(ctx context.Context, c comm.Comm) error {
		net, opt, shard, err := s.rank(c, d, s.Seed)
		if err != nil {
			return err
		}
		if err := Train(ctx, opt, net, shard, s.Batch, 1, k, nil); err != nil {
			return err
		}
		ck, err := opt.State()
		if err != nil {
			return err
		}
		return optim.SaveFile(path(c.Rank()), ck)
	})
	if err != nil {
		return nil, err
	}
	out := make([]*optim.Checkpoint, s.World)
	err = local.Run(ctx, s.World, func(ctx context.Context, c comm.Comm) error {
		net, opt, shard, err := s.rank(c, d, s.Seed+1000)
		if err != nil {
			return err
		}
		ck, err := optim.LoadFile(path(c.Rank()))
		if err != nil {
			return err
		}
		if err := opt.Load(ck); err != nil {
			return err
		}
		if err := Train(ctx, opt, net, shard, s.Batch, k+1, steps, nil); err != nil {
			return err
		}
		out[c.Rank()], err = opt.State()
		return err
	})
	return out, err
}

// SameBits reports the first difference between two checkpoints: stage,
// counters, scalars (compared as float64 bits) or tensors (names, shapes,
// and float32 bits).
func SameBits(a, b *optim.Checkpoint) error {
	if a.Algorithm != b.Algorithm || a.World != b.World || a.Rank != b.Rank || a.Stage != b.Stage {
		return fmt.Errorf("headers differ: %s/%d/%d/%s vs %s/%d/%d/%s",
			a.Algorithm, a.World, a.Rank, a.Stage, b.Algorithm, b.World, b.Rank, b.Stage)
	}
	if len(a.Ints) != len(b.Ints) || len(a.Floats) != len(b.Floats) || len(a.Tensors) != len(b.Tensors) {
		return fmt.Errorf("entry counts differ: %d/%d/%d vs %d/%d/%d",
			len(a.Ints), len(a.Floats), len(a.Tensors), len(b.Ints), len(b.Floats), len(b.Tensors))
	}
	for k, v := range a.Ints {
		if w, ok := b.Ints[k]; !ok || v != w {
			return fmt.Errorf("counter %s: %d vs %d", k, v, w)
		}
	}
	for k, v := range a.Floats {
		if w, ok := b.Floats[k]; !ok || math.Float64bits(v) != math.Float64bits(w) {
			return fmt.Errorf("scalar %s: %v vs %v", k, v, w)
		}
	}
	for i, t := range a.Tensors {
		u := b.Tensors[i]
		if t.Name != u.Name || !slices.Equal(t.Shape, u.Shape) || len(t.Data) != len(u.Data) {
			return fmt.Errorf("tensor %d: %s %v vs %s %v", i, t.Name, t.Shape, u.Name, u.Shape)
		}
		for j := range t.Data {
			if math.Float32bits(t.Data[j]) != math.Float32bits(u.Data[j]) {
				return fmt.Errorf("tensor %s[%d]: %v vs %v", t.Name, j, t.Data[j], u.Data[j])
			}
		}
	}
	return nil
}
