package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/cliflag"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/size"
)

// maxDemoBytes bounds lowbit demo --size: the demo holds several buffers of
// this size per rank.
const maxDemoBytes = 4 << 30

func init() {
	register(command{
		name:  "demo",
		usage: "exact vs 1-bit compressed allreduce on in-process ranks",
		run:   demoMain,
	})
}

// demoMain averages a gradient-like buffer over in-process ranks, once with
// the exact allreduce and once with the 1-bit compressed one, and prints
// the relative error, the bytes each rank sent and the times.
func demoMain(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	ranks := fs.Int("ranks", 4, "in-process ranks")
	nbytes := int64(64 << 20)
	fs.Var(&size.Value[int64]{P: &nbytes, Min: 4, Max: maxDemoBytes}, "size", "bytes of float32 data per rank (`size`: 64Mi, 100M)")
	steps := fs.Int("steps", 10, "compressed steps on the same input, to show error feedback at work")
	if err := cliflag.Parse(fs, args); err != nil {
		return err
	}
	switch {
	case fs.NArg() > 0:
		return cliflag.Usagef("unexpected arguments: %q", fs.Args())
	case *ranks < 1 || *ranks > maxLocalRanks:
		return cliflag.Bad(fs, "ranks", "want 1 to %d ranks", maxLocalRanks)
	case *steps < 1 || *steps > maxBenchIters:
		return cliflag.Bad(fs, "steps", "want 1 to %d steps", maxBenchIters)
	}
	n := int(nbytes / 4)
	w := *ranks
	fmt.Fprintf(stdout, "lowbit demo: %d in-process ranks, %s float32 per rank (%s)\n\n", w, size.FormatCount(int64(n)), human(int64(n)*4))

	exact := make([]float32, n)
	var (
		exactTime, onebitTime, firstTime time.Duration
		exactSent, onebitSent            int64
		relFirst, relAvg                 float64
	)
	err := runRanks(context.Background(), "local", w, func(ctx context.Context, c comm.Comm) error {
		in := demoInput(c.Rank(), n)
		buf := make([]float32, n)

		copy(buf, in)
		s0 := c.Stats()
		t0 := time.Now()
		if err := c.AllReduce(ctx, buf, comm.Mean); err != nil {
			return err
		}
		if c.Rank() == 0 {
			exactTime = time.Since(t0)
			exactSent = c.Stats().Sub(s0).Total().BytesSent
			copy(exact, buf)
		}

		st, err := onebit.NewState(n, w)
		if err != nil {
			return err
		}
		var avg []float64
		if c.Rank() == 0 {
			avg = make([]float64, n)
		}
		s1 := c.Stats()
		t1 := time.Now()
		for k := 0; k < *steps; k++ {
			copy(buf, in)
			if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
				return err
			}
			if c.Rank() != 0 {
				continue
			}
			if k == 0 {
				firstTime = time.Since(t1)
				onebitSent = c.Stats().Sub(s1).Total().BytesSent
				relFirst = relErr(buf, exact)
			}
			for i, v := range buf {
				avg[i] += float64(v) / float64(*steps)
			}
		}
		if c.Rank() == 0 {
			onebitTime = time.Since(t1) / time.Duration(*steps)
			relAvg = relErr64(avg, exact)
		}
		return nil
	})
	if err != nil {
		return err
	}
	ring := comm.RingAllReduceBytes(int64(n)*4, w)
	fmt.Fprintf(stdout, "%-28s %12s %14s %12s\n", "", "time", "sent per rank", "rel. error")
	fmt.Fprintf(stdout, "%-28s %12s %14s %12s\n", "exact allreduce (float32)", exactTime.Round(time.Millisecond), human(exactSent), "0")
	fmt.Fprintf(stdout, "%-28s %12s %14s %12.3f\n", "1-bit allreduce, one call", firstTime.Round(time.Millisecond), human(onebitSent), relFirst)
	fmt.Fprintf(stdout, "%-28s %12s %14s %12.3f\n", fmt.Sprintf("1-bit, mean of %d calls", *steps), onebitTime.Round(time.Millisecond), human(onebitSent), relAvg)
	fmt.Fprintf(stdout, "\nbytes sent: %.1fx fewer than a float32 ring allreduce (%s per rank)\n",
		float64(ring)/float64(onebitSent), human(ring))
	fmt.Fprintf(stdout, "time: compressed/exact = %.2f in this run (in-process ranks share memory; make bench-net measures a 1 Gbit network)\n",
		float64(firstTime)/float64(exactTime))
	fmt.Fprintf(stdout, "error feedback: averaging %d compressed calls of the same input cuts the error from %.3f to %.3f\n",
		*steps, relFirst, relAvg)
	return nil
}

// demoInput is a gradient-like buffer: a shared signal plus per-rank noise.
func demoInput(rank, n int) []float32 {
	shared := rand.New(rand.NewPCG(42, 0))
	own := rand.New(rand.NewPCG(42, uint64(rank)+1))
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(shared.NormFloat64() + 0.5*own.NormFloat64())
	}
	return x
}

func relErr(got, want []float32) float64 {
	var num, den float64
	for i := range got {
		d := float64(got[i]) - float64(want[i])
		num += d * d
		den += float64(want[i]) * float64(want[i])
	}
	return math.Sqrt(num / den)
}

func relErr64(got []float64, want []float32) float64 {
	var num, den float64
	for i := range got {
		d := got[i] - float64(want[i])
		num += d * d
		den += float64(want[i]) * float64(want[i])
	}
	return math.Sqrt(num / den)
}

// human formats a byte count with binary units.
func human(b int64) string {
	const unit = 1024
	if b < unit {
		return fmt.Sprintf("%d B", b)
	}
	div, exp := int64(unit), 0
	for n := b / unit; n >= unit; n /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(b)/float64(div), "KMGTPE"[exp])
}
