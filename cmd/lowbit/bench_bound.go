package main

// The memory bound of the 1-bit allreduce: on a fast link a call is bound
// by the bytes each rank reads and writes in memory, not by the wire.
// lowbit bench measures the streaming bandwidth each rank gets while every
// rank streams at once, and prints beside each onebit row the time those
// bytes take at that bandwidth and the share of it the call reached.

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/size"
)

// onebitMemBytes is the bytes one rank reads and writes in memory in one
// onebit.AllReduce of n float32 on w ranks, counted from the algorithm
// (../shared/spec/onebit.md), with N = PaddedLen(n, w) and C = N/w. Each
// side needs two passes over its floats, because its scale depends on all
// of them: the first keeps x (or c) in the error buffer, the second turns
// it into the new error. (Reading buf again instead of keeping x costs the
// same when n = N.) The server forms its sums from the packed bytes
// received, with no buffer; the scales and the header are not counted.
//
//	worker, steps 1, 2, 4: read buf 4n, read worker_error 4N, write x 4N,
//	                       write signs N/8
//	worker, step 3:        read x 4N, write worker_error 4N
//	phase 1:               read the signs sent N/8, write those received N/8
//	server, steps 5, 6, 9: read the signs received N/8, read server_error
//	                       4C, write c 4C, write signs C/8
//	server, step 8:        read c 4C, write server_error 4C
//	phase 2:               read the signs sent C/8, write those gathered N/8
//	output:                read the signs gathered N/8, write buf 4n
//
// In all 8n + 16N + 16C + 6N/8 + 2C/8: on 4 ranks about 28.8 bytes per
// element (461 MiB for 64 MiB of float32), of which the error buffers take
// 16N + 16C (320 MiB).
func onebitMemBytes(n, w int) int64 {
	if n <= 0 || w < 1 {
		return 0
	}
	bigN := int64(onebit.PaddedLen(n, w))
	c := bigN / int64(w)
	return 8*int64(n) + 16*bigN + 16*c + 6*bigN/8 + 2*c/8
}

// streamBytes is the size of the buffer each rank streams over to
// measure its streaming bandwidth: with every rank doing so at once, far
// larger than the last-level cache. Tests make it smaller.
var streamBytes = 128 << 20

// streamReps is the number of timed passes of a measurement; the fastest
// counts. The machines this runs on share their memory with neighbours
// whose load comes and goes: the best of many short passes is the
// steadiest estimate of what the memory can do.
const streamReps = 10

// streamSweeps is the sweeps over its buffer a rank makes in one pass:
// enough that a pass outlasts the Go scheduler's 10 ms time slice, so
// that goroutine ranks (the local backend) that share a core take turns
// on it and none is left idle for most of a pass (one sweep left the
// local backend's passes at about half the rate of MPI's in some runs).
const streamSweeps = 4

// streamProbe measures the streaming bandwidth of this machine; it holds
// its buffer from one measurement to the next.
type streamProbe struct {
	buf       []uint64
	mine, all []byte
}

// measure returns the streaming bandwidth, in bytes per second, one rank
// of c gets while every rank streams at once. After a barrier each rank
// updates a buffer of streamBytes in place, streamSweeps times (reads and
// writes every word: counted as streamBytes read and streamBytes written
// per sweep, as STREAM counts), the access the call makes most of (its
// error buffers are updated in place); on this project's machines that is
// faster than a copy (no read for ownership of a destination) and than a
// read-only pass. A pass's rate is the bytes of one rank over the time
// from the first rank's start to the last rank's end, on the wall clock
// (ranks on one machine share it): the machine's bandwidth shared out,
// which covers ranks that share a core (4 ranks on 2 cores each get half
// of one, in the pass as in a call). Each rank's own time would not: a
// rank that waits for a core after the barrier starts its clock late.
// That is done streamReps times after one untimed pass (on the first
// measurement), and the fastest pass counts, so that it bounds what a call
// can reach. Every rank returns the same value.
func (sp *streamProbe) measure(ctx context.Context, c comm.Comm) (float64, error) {
	if sp.buf == nil {
		sp.buf = make([]uint64, streamBytes/8)
		for i := range sp.buf { // real values: untouched pages read as one zero page
			sp.buf[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
		}
		sp.mine, sp.all = make([]byte, 16), make([]byte, 16*c.Size())
	}
	best := 0.0
	for range streamReps {
		if err := c.Barrier(ctx); err != nil {
			return 0, err
		}
		start := time.Now().UnixNano()
		for range streamSweeps {
			streamUpdate(sp.buf)
		}
		end := time.Now().UnixNano()
		binary.LittleEndian.PutUint64(sp.mine, uint64(start))
		binary.LittleEndian.PutUint64(sp.mine[8:], uint64(end))
		if err := c.AllGatherBytes(ctx, sp.mine, sp.all); err != nil {
			return 0, err
		}
		first, last := int64(math.MaxInt64), int64(math.MinInt64)
		for j := range c.Size() {
			first = min(first, int64(binary.LittleEndian.Uint64(sp.all[16*j:])))
			last = max(last, int64(binary.LittleEndian.Uint64(sp.all[16*j+8:])))
		}
		if last > first {
			best = max(best, 2*streamSweeps*float64(len(sp.buf)*8)/(float64(last-first)/1e9))
		}
	}
	return best, nil
}

// streamUpdate flips the lowest bit of every word of p, in place, four
// words at a time.
func streamUpdate(p []uint64) {
	i := 0
	for ; i+4 <= len(p); i += 4 {
		q := p[i : i+4 : i+4]
		q[0] ^= 1
		q[1] ^= 1
		q[2] ^= 1
		q[3] ^= 1
	}
	for ; i < len(p); i++ {
		p[i] ^= 1
	}
}

// setMemBound adds to an onebit row the bytes each rank moves in memory,
// the time they take at bw bytes per second, and the share of that bound
// the p50 reached.
func setMemBound(row *benchRow, w int, bw float64) {
	bytes := onebitMemBytes(row.ElementsPerRank, w)
	if bytes == 0 || bw <= 0 {
		return
	}
	bound := float64(bytes) / bw * 1e6
	row.MemBytesPerRank, row.MemBoundUs, row.StreamGBps = &bytes, &bound, new(bw/1e9)
	if row.TimeP50Us > 0 {
		row.MemBoundShare = new(bound / row.TimeP50Us)
	}
}

// memBoundColumns renders the memory bound of a row that has one.
func memBoundColumns(row benchRow) string {
	if row.MemBoundUs == nil {
		return ""
	}
	s := fmt.Sprintf("  [memory bound %.1f us: %s at %.2f GB/s", *row.MemBoundUs,
		size.Format(*row.MemBytesPerRank), *row.StreamGBps)
	if row.MemBoundShare != nil {
		s += fmt.Sprintf(", %.0f%% of it reached", 100**row.MemBoundShare)
	}
	if row.Pieces != nil {
		if *row.Pieces == 1 {
			s += "; chunks whole"
		} else {
			s += fmt.Sprintf("; chunks in %d pieces", *row.Pieces)
		}
	}
	if row.Started != nil && *row.Started {
		s += ", collectives started"
	}
	return s + "]"
}

// boundInConfig reports whether a run has onebit rows with a memory
// bound: onebit on host buffers.
func boundInConfig(cfg *benchConfig) bool {
	return cfg.device == "" && slices.Contains(cfg.collectives, "onebit")
}

// boundCSVHeader names the CSV columns boundCSVFields fills.
var boundCSVHeader = []string{"mem_bytes_per_rank", "stream_gbps", "mem_bound_us", "mem_bound_share", "pieces", "started"}

// boundCSVFields renders row's memory bound and pieces per chunk, empty
// fields where it has none.
func boundCSVFields(row benchRow) []string {
	rec := make([]string, len(boundCSVHeader))
	if row.MemBoundUs != nil {
		rec[0], rec[1], rec[2] = strconv.FormatInt(*row.MemBytesPerRank, 10), csvFloat(*row.StreamGBps), csvFloat(*row.MemBoundUs)
	}
	if row.MemBoundShare != nil {
		rec[3] = csvFloat(*row.MemBoundShare)
	}
	if row.Pieces != nil {
		rec[4] = strconv.Itoa(*row.Pieces)
	}
	if row.Started != nil {
		rec[5] = strconv.FormatBool(*row.Started)
	}
	return rec
}
