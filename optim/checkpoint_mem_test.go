package optim

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// memCheckpoint returns a checkpoint holding stateBytes bytes of float32
// data in tensors of equal size, shaped like an Adam checkpoint's.
func memCheckpoint(stateBytes, tensors int) *Checkpoint {
	ck := &Checkpoint{
		Algorithm: AlgorithmAdam, World: 1, Stage: StageExact,
		Ints:   map[string]int64{IntStep: 7, IntSteps: 7, IntSkipped: 0},
		Floats: map[string]float64{"lr": 1e-3},
	}
	n := stateBytes / 4 / tensors
	for i := range tensors {
		d := make([]float32, n)
		for j := range d {
			d[j] = float32(i*n+j) * 0.25
		}
		ck.Tensors = append(ck.Tensors, Tensor{Name: fmt.Sprintf("param/layer%d.weight", i), Shape: []int{n}, Data: d})
	}
	return ck
}

func stateBytes(ck *Checkpoint) uint64 {
	var n uint64
	for _, t := range ck.Tensors {
		n += 4 * uint64(len(t.Data))
	}
	return n
}

// allocatedDuring returns the heap bytes f allocates, with the garbage
// collector off: nothing f allocates is freed before it returns, so this
// bounds f's peak heap from above.
func allocatedDuring(f func()) uint64 {
	runtime.GC()
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// peakHeapDuring returns the highest the heap's objects rose above their
// size at the start while f ran, with the garbage collector on, sampled
// every 100 µs.
func peakHeapDuring(f func()) uint64 {
	const heap = "/memory/classes/heap/objects:bytes"
	runtime.GC()
	s := []metrics.Sample{{Name: heap}}
	metrics.Read(s)
	base := s[0].Value.Uint64()
	peak := base
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		s := []metrics.Sample{{Name: heap}}
		tick := time.NewTicker(100 * time.Microsecond)
		defer tick.Stop()
		for {
			metrics.Read(s)
			peak = max(peak, s[0].Value.Uint64())
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	f()
	close(done)
	wg.Wait()
	return peak - base
}

// loadFileWhole is LoadFile as it was before it streamed: the whole file
// in memory, then decoded. It is the baseline of BenchmarkLoadFilePeak.
func loadFileWhole(path string) (*Checkpoint, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	ck := new(Checkpoint)
	if err := ck.UnmarshalBinary(b); err != nil {
		return nil, err
	}
	return ck, nil
}

// LoadFile's heap peaks at the state it returns plus a bounded margin: it
// streams the file instead of holding a copy of it beside the state.
func TestLoadFilePeakMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("writes and reads a 32 MiB checkpoint")
	}
	ck := memCheckpoint(32<<20, 64)
	path := filepath.Join(t.TempDir(), "ck")
	require.NoError(t, SaveFile(path, ck))
	state := stateBytes(ck)
	ck = nil
	var back *Checkpoint
	var err error
	alloc := allocatedDuring(func() { back, err = LoadFile(path) })
	require.NoError(t, err)
	require.Equal(t, state, stateBytes(back))
	limit := state + state/4
	require.LessOrEqual(t, alloc, limit, "LoadFile allocated %.1f MiB for a %.1f MiB state (%.2fx)",
		float64(alloc)/(1<<20), float64(state)/(1<<20), float64(alloc)/float64(state))
}

// BenchmarkLoadFilePeak reports the heap peak of loading a 256 MiB
// checkpoint, against the old way of reading the whole file first:
// alloc-MiB is what the load allocated with the garbage collector off (an
// upper bound of the peak), peak-MiB the heap's sampled peak with it on,
// both over the state's size (x-state).
func BenchmarkLoadFilePeak(b *testing.B) {
	ck := memCheckpoint(256<<20, 256)
	path := filepath.Join(b.TempDir(), "ck")
	require.NoError(b, SaveFile(path, ck))
	state := stateBytes(ck)
	ck = nil
	for _, bc := range []struct {
		name string
		load func(string) (*Checkpoint, error)
	}{{"LoadFile", LoadFile}, {"whole-file", loadFileWhole}} {
		b.Run(bc.name, func(b *testing.B) {
			var alloc, peak uint64
			for b.Loop() {
				var err error
				alloc = max(alloc, allocatedDuring(func() { _, err = bc.load(path) }))
				require.NoError(b, err)
				peak = max(peak, peakHeapDuring(func() { _, err = bc.load(path) }))
				require.NoError(b, err)
			}
			b.ReportMetric(float64(state)/(1<<20), "state-MiB")
			b.ReportMetric(float64(alloc)/(1<<20), "alloc-MiB")
			b.ReportMetric(float64(alloc)/float64(state), "alloc-x-state")
			b.ReportMetric(float64(peak)/(1<<20), "peak-MiB")
			b.ReportMetric(float64(peak)/float64(state), "peak-x-state")
		})
	}
}

// BenchmarkLoadManyParams resumes an Adam optimizer of P small parameters
// (3P tensors) from a file: LoadFile and Load. It is O(P): ten times the
// parameters take about ten times as long (ns/param stays flat).
func BenchmarkLoadManyParams(b *testing.B) {
	for _, p := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("P=%d", p), func(b *testing.B) {
			ps := make([]*Param, p)
			for i := range ps {
				ps[i] = NewParam(fmt.Sprintf("layer%d.weight", i), 4)
			}
			opt, err := NewAdam(context.Background(), nil, ps, DefaultAdamConfig())
			require.NoError(b, err)
			ck, err := opt.State()
			require.NoError(b, err)
			path := filepath.Join(b.TempDir(), "ck")
			require.NoError(b, SaveFile(path, ck))
			for b.Loop() {
				ck, err := LoadFile(path)
				if err != nil {
					b.Fatal(err)
				}
				if err := opt.Load(ck); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(p), "ns/param")
		})
	}
}

// BenchmarkLoadFileSpeed is the time to load a 256 MiB checkpoint, against
// the old way of reading the whole file first.
func BenchmarkLoadFileSpeed(b *testing.B) {
	ck := memCheckpoint(256<<20, 256)
	path := filepath.Join(b.TempDir(), "ck")
	require.NoError(b, SaveFile(path, ck))
	state := int64(stateBytes(ck))
	ck = nil
	for _, bc := range []struct {
		name string
		load func(string) (*Checkpoint, error)
	}{{"LoadFile", LoadFile}, {"whole-file", loadFileWhole}} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(state)
			for b.Loop() {
				if _, err := bc.load(path); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// UnmarshalBinary allocates the checkpoint it returns and little beside
// it: it converts the tensors' bytes where they lie in its input instead
// of copying them through a buffer first.
func TestUnmarshalBinaryAllocations(t *testing.T) {
	ck := memCheckpoint(1<<20, 4)
	b, err := ck.MarshalBinary()
	require.NoError(t, err)
	state := stateBytes(ck)
	// TotalAlloc counts the whole process: a goroutine left by an earlier
	// test, or the race detector's runtime, can allocate during one
	// measurement. The least of three is UnmarshalBinary's own, and a
	// 64 KiB margin still rules out any copy of the 1 MiB state.
	var back Checkpoint
	alloc := uint64(math.MaxUint64)
	for range 3 {
		back = Checkpoint{}
		alloc = min(alloc, allocatedDuring(func() { err = back.UnmarshalBinary(b) }))
		require.NoError(t, err)
	}
	require.Equal(t, ck, &back)
	require.LessOrEqual(t, alloc, state+64<<10, "UnmarshalBinary allocated %d bytes for a %d-byte state", alloc, state)
}
