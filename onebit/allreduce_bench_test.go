package onebit_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
)

// The compressed allreduce against the exact one, on 4 in-process ranks
// with 64 MiB of float32 per rank.
const (
	benchRanks = 4
	benchElems = 16 << 20 // 64 MiB of float32
	benchBytes = benchElems * 4
)

// benchOp is one allreduce under test, called on one rank.
type benchOp struct {
	name string
	call func(ctx context.Context, c comm.Comm, buf []float32, st *onebit.State) error
}

var (
	exactOp = benchOp{"exact", func(ctx context.Context, c comm.Comm, buf []float32, _ *onebit.State) error {
		return c.AllReduce(ctx, buf, comm.Mean)
	}}
	onebitOp = benchOp{"onebit", func(ctx context.Context, c comm.Comm, buf []float32, st *onebit.State) error {
		return onebit.AllReduce(ctx, c, buf, st)
	}}
)

// BenchmarkAllReduce64MiB times the exact float32 allreduce (comm.Mean) and
// the 1-bit compressed one, each alone and both in one run ("both", which
// reports the onebit/exact time ratio measured on the same inputs in the
// same iterations). ns/op covers the collective calls only: restoring the
// input before each call and the barrier after it are not timed. Each
// reports the bytes rank 0 sent per call, from comm.Stats, and the
// compressed one the ratio of a float32 ring allreduce's bytes to its own,
// which must be at least 30.
func BenchmarkAllReduce64MiB(b *testing.B) {
	b.Run("exact", func(b *testing.B) { benchAllReduce(b, exactOp) })
	b.Run("onebit", func(b *testing.B) { benchAllReduce(b, onebitOp) })
	b.Run("both", func(b *testing.B) { benchAllReduce(b, exactOp, onebitOp) })
}

// benchAllReduce runs ops, in order, on the same inputs b.N times on
// benchRanks in-process ranks; rank 0 times each call between a barrier
// and its return.
func benchAllReduce(b *testing.B, ops ...benchOp) {
	ctx := context.Background()
	cs, err := local.New(benchRanks)
	if err != nil {
		b.Fatal(err)
	}
	type rank struct {
		input, buf []float32
		st         *onebit.State
	}
	ranks := make([]rank, benchRanks)
	for r := range ranks {
		st, err := onebit.NewState(benchElems, benchRanks)
		if err != nil {
			b.Fatal(err)
		}
		ranks[r] = rank{input: make([]float32, benchElems), buf: make([]float32, benchElems), st: st}
		fillRandom(ranks[r].input, uint64(r))
	}

	elapsed := make([]time.Duration, len(ops))
	sent := make([]int64, len(ops))
	errs := make([]error, benchRanks)
	b.SetBytes(int64(benchBytes * len(ops)))
	b.ReportAllocs()
	b.ResetTimer()
	b.StopTimer()
	var wg sync.WaitGroup
	for r := range ranks {
		wg.Go(func() {
			c, d := cs[r], &ranks[r]
			// Round -1 is an untimed warm-up: the first exact AllReduce
			// sizes the backend's scratch buffer once.
			for i := -1; i < b.N; i++ {
				timed := r == 0 && i >= 0
				for k, op := range ops {
					copy(d.buf, d.input)
					if err := c.Barrier(ctx); err != nil {
						errs[r] = err
						c.Close()
						return
					}
					var before comm.Stats
					var t0 time.Time
					if timed {
						before = c.Stats()
						b.StartTimer()
						t0 = time.Now()
					}
					if err := op.call(ctx, c, d.buf, d.st); err != nil {
						errs[r] = fmt.Errorf("rank %d: %s: %w", r, op.name, err)
						c.Close() // wake the peers
						return
					}
					if timed {
						elapsed[k] += time.Since(t0)
						b.StopTimer()
						sent[k] += c.Stats().Sub(before).Total().BytesSent
					}
				}
			}
		})
	}
	wg.Wait()
	for _, c := range cs {
		c.Close()
	}
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}

	n := float64(b.N)
	ring := float64(comm.RingAllReduceBytes(benchBytes, benchRanks))
	for k, op := range ops {
		b.ReportMetric(float64(elapsed[k].Nanoseconds())/n/1e6, op.name+"-ms/op")
		bytes := float64(sent[k]) / n
		b.ReportMetric(bytes, op.name+"-sent-B/op")
		if op.name == onebitOp.name {
			ratio := ring / bytes
			b.ReportMetric(ratio, "ring/onebit-bytes")
			if ratio < 30 {
				b.Fatalf("onebit sent %.0f bytes per rank, only %.1fx less than a float32 ring allreduce (%.0f); want >= 30x",
					bytes, ratio, ring)
			}
		}
	}
	if len(ops) == 2 {
		b.ReportMetric(float64(elapsed[1])/float64(elapsed[0]), ops[1].name+"/"+ops[0].name)
	}
}

// fillRandom fills x with deterministic pseudo-random values in [-1, 1)
// (splitmix64), different for every seed.
func fillRandom(x []float32, seed uint64) {
	z := seed * 0x9e3779b97f4a7c15
	for i := range x {
		z += 0x9e3779b97f4a7c15
		v := z
		v = (v ^ v>>30) * 0xbf58476d1ce4e5b9
		v = (v ^ v>>27) * 0x94d049bb133111eb
		v ^= v >> 31
		x[i] = float32(int32(v>>40)-1<<23) * (1.0 / (1 << 23))
	}
}
