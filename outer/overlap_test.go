package outer_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/outer"
)

// slowLink makes every collective of the communicator it wraps last as
// long as its bytes take on a link of the given bandwidth, at least.
type slowLink struct {
	comm.Comm
	bytesPerSec float64
}

func (s *slowLink) wait(start time.Time, before int64) {
	sent := s.Comm.Stats().Total().BytesSent - before
	d := time.Duration(float64(sent) / s.bytesPerSec * float64(time.Second))
	time.Sleep(time.Until(start.Add(d)))
}

func (s *slowLink) timed(f func() error) error {
	start, before := time.Now(), s.Comm.Stats().Total().BytesSent
	err := f()
	s.wait(start, before)
	return err
}

func (s *slowLink) Concurrent() bool { return comm.CanOverlap(s.Comm) }

func (s *slowLink) AllReduce(ctx context.Context, buf []float32, op comm.Op) error {
	return s.timed(func() error { return s.Comm.AllReduce(ctx, buf, op) })
}

func (s *slowLink) AllGather(ctx context.Context, send, recv []float32) error {
	return s.timed(func() error { return s.Comm.AllGather(ctx, send, recv) })
}

func (s *slowLink) Split(ctx context.Context, color, key int) (comm.Comm, error) {
	c, err := s.Comm.Split(ctx, color, key)
	if err != nil || c == nil {
		return c, err
	}
	return &slowLink{Comm: c, bytesPerSec: s.bytesPerSec}, nil
}

// With a delay, the exchange overlaps the next inner steps: the compute
// utilization rises. Simulated: 2 ranks, 2^16 float32 elements (fp32: 256
// KiB per rank per exchange) on a 100 Mbit/s link, about 21 ms, and 5 ms
// of "forward and backward" per step.
func TestUtilizationOverlap(t *testing.T) {
	if testing.Short() {
		t.Skip("timing")
	}
	const w, steps, compute = 2, 48, 5 * time.Millisecond
	util := map[string]float64{}
	for _, k := range []struct {
		name string
		cfg  outer.Config
	}{
		{"H=8, 1 fragment, no delay", config(outer.CodecFP32, 8, 1, 0)},
		{"H=8, 2 fragments, delay 4", config(outer.CodecFP32, 8, 2, 4)},
	} {
		got := newPerRank[outer.OuterStats](w)
		runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
			sc := &slowLink{Comm: c, bytesPerSec: 100e6 / 8}
			ps := newParams(t, []int{1 << 15, 1 << 15})
			o, err := outer.NewAdam(ctx, sc, ps, k.cfg, innerConfig())
			if err != nil {
				return err
			}
			defer o.Close()
			for i := 1; i <= steps; i++ {
				time.Sleep(compute)
				setGrads(ps, c.Rank(), i)
				if err := o.Step(ctx); err != nil {
					return err
				}
			}
			got.set(c.Rank(), o.OuterStats())
			return nil
		})
		s := got.v[0]
		util[k.name] = s.Utilization()
		t.Logf("%s: utilization %.2f (wall %v, blocked on exchanges %v, inner steps %v, %d exchanges)",
			k.name, s.Utilization(), s.Wall.Round(time.Millisecond), s.Exchange.Round(time.Millisecond), s.Inner.Round(time.Millisecond), s.Exchanges)
	}
	assert.Greater(t, util["H=8, 2 fragments, delay 4"], util["H=8, 1 fragment, no delay"])
}
