package outer

// The agreements: the constructor's (settings and refusals), and every
// exchange's and, with carried flags, every Step's (a status word and the
// flags per rank), through which failures, refusals and non-finite
// pseudo-gradients reach every rank.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

const (
	statusOK        = 0
	statusNonFinite = 1 // this rank's pseudo-gradient holds a NaN or Inf
	statusRefused   = 2 // this rank's StepFlags.Refuse is set: the call stops, the run may go on
	// statusFailed + d: this rank's Step failed d calls before the
	// agreement's call; every rank is broken from this agreement on.
	statusFailed = 3
	// maxFailedAgo bounds d so that statusFailed + d is exact in a float32.
	maxFailedAgo = 1<<24 - statusFailed
)

// verdict is what an agreement decided.
type verdict struct {
	failed    int   // the first rank whose Step failed, -1 none
	failedAt  int64 // the call at which it failed
	refused   int   // the first rank whose StepFlags.Refuse is set, -1 none
	nonFinite bool  // some rank's pseudo-gradient holds a NaN or Inf
}

// agreeConfig is the constructor's agreement: every rank's refusal flag
// and settings, all-gathered; the first rank that refused or whose
// settings differ from rank 0's is named on every other rank, with both
// values as the settings print them.
func (o *Optimizer) agreeConfig(ctx context.Context, local error) error {
	cfg := o.cfg
	settings := []struct {
		name   string
		v      int64
		format func(int64) string
	}{
		{"", 0, nil},
		{"H", int64(cfg.H), formatInt},
		{"Fragments", int64(cfg.Fragments), formatInt},
		{"Delay", int64(cfg.Delay), formatInt},
		{"Codec", int64(cfg.Codec), func(v int64) string { return Codec(v).String() }},
		{"parameter elements", int64(o.n), formatInt},
		{"BucketBytes", int64(cfg.BucketBytes), formatInt},
		{"Nesterov", int64(optim.HyperBool(cfg.Nesterov)), func(v int64) string { return strconv.FormatBool(v != 0) }},
		{"LR", int64(math.Float32bits(cfg.LR)), formatFloat32Bits},
		{"Momentum", int64(math.Float32bits(cfg.Momentum)), formatFloat32Bits},
		{"Scale", int64(cfg.Scale), formatScale},
		{"Density", 0, formatFloat32Bits},
		{"SparseChunk", 0, formatInt},
		{"SparseBits", 0, formatInt},
		{"Decay", 0, formatFloat32Bits},
		{"SparseExchange", 0, func(v int64) string { return SparseExchange(v).String() }},
		{"SparseServerDensity", 0, formatFloat32Bits},
		{"AccumulatorBF16", 0, func(v int64) string { return strconv.FormatBool(v != 0) }},
	}
	if cfg.Codec == CodecSparse { // the other codecs ignore them
		settings[11].v, settings[12].v = int64(math.Float32bits(cfg.Density)), int64(cfg.SparseChunk)
		settings[13].v, settings[14].v = int64(cfg.SparseBits), int64(math.Float32bits(cfg.Decay))
		settings[15].v = int64(cfg.SparseExchange)
		settings[17].v = int64(optim.HyperBool(cfg.AccumulatorBF16))
		if cfg.SparseExchange == SparseTwoPhase {
			settings[16].v = int64(math.Float32bits(cfg.serverDensity()))
		}
	}
	if local != nil {
		settings[0].v = 1
	}
	if o.world == 1 {
		return local
	}
	send := make([]byte, 8*len(settings))
	for i, s := range settings {
		binary.LittleEndian.PutUint64(send[8*i:], uint64(s.v))
	}
	recv := make([]byte, len(send)*o.world)
	if err := o.c.AllGatherBytes(ctx, send, recv); err != nil {
		if local != nil {
			return errors.Join(local, fmt.Errorf("outer: New: telling the other ranks: %w", err))
		}
		return fmt.Errorf("outer: New: agreeing on the settings: %w", err)
	}
	if local != nil {
		return local
	}
	get := func(r, i int) int64 { return int64(binary.LittleEndian.Uint64(recv[len(send)*r+8*i:])) }
	for r := range o.world {
		if get(r, 0) != 0 {
			return fmt.Errorf("outer: New: rank %d refused (its error says why)", r)
		}
	}
	for r := 1; r < o.world; r++ {
		for i := 1; i < len(settings); i++ {
			if s := settings[i]; get(r, i) != get(0, i) {
				return fmt.Errorf("outer: New: rank %d has %s %s, rank 0 has %s: every rank must use the same settings and parameters",
					r, s.name, s.format(get(r, i)), s.format(get(0, i)))
			}
		}
	}
	return nil
}

func formatInt(v int64) string { return strconv.FormatInt(v, 10) }

// formatFloat32Bits prints the float32 whose bits are v, as
// strconv.FormatFloat does (the shortest decimal that reads back to it).
func formatFloat32Bits(v int64) string {
	return strconv.FormatFloat(float64(math.Float32frombits(uint32(v))), 'g', -1, 32)
}

// formatScale names a 1-bit scale as Config.Scale's doc does.
func formatScale(v int64) string {
	switch onebit.Scale(v) {
	case onebit.ScaleRMS:
		return "onebit.ScaleRMS"
	case onebit.ScaleMeanAbs:
		return "onebit.ScaleMeanAbs"
	}
	return fmt.Sprintf("onebit.Scale(%d)", v)
}

// agreeFlags is the per-step agreement of the carried flags, before
// anything of call t changes: a rank that cannot take the call (closed,
// resized) fails it on every rank; otherwise a rank's Refuse, then the
// Veto, stop the call on every rank with nothing changed. It also hears of
// a rank whose inner step failed at call t-1.
func (o *Optimizer) agreeFlags(ctx context.Context, t int64) error {
	sf := o.flags
	failure := o.check(t)
	status := float32(statusOK)
	switch {
	case failure != nil:
		o.settle()
		o.broken = failure
		status = statusFailed
	case sf.Refuse != nil:
		status = statusRefused
	}
	start := time.Now()
	v, err := o.agree(ctx, status, t)
	o.tExch += time.Since(start)
	mine := failure
	if mine == nil {
		mine = sf.Refuse
	}
	switch {
	case err != nil && mine != nil:
		return errors.Join(mine, fmt.Errorf("outer: step %d: telling the other ranks: %w", t, err))
	case err != nil:
		return fmt.Errorf("outer: step %d: %w", t, err)
	case failure != nil:
		return failure
	case v.failed >= 0:
		o.broken = v.failure()
		return fmt.Errorf("outer: step %d: %w; every later Step fails until Load", t, o.broken)
	case sf.Refuse != nil:
		return sf.Refuse
	case v.refused >= 0:
		return fmt.Errorf("outer: step %d: rank %d refused it (its error says why); nothing changed", t, v.refused)
	case sf.Veto != nil:
		return sf.Veto(sf.Agreed)
	}
	return nil
}

// failure is the error of a rank that heard of another's failure.
func (v verdict) failure() error {
	return fmt.Errorf("rank %d failed at step %d (its error says why)", v.failed, v.failedAt)
}

// tellFailure tells the other ranks at their next agreement that this rank
// failed at call t, and returns failure. That agreement is, with carried
// flags, the exchange agreement of call t if an exchange launches at t,
// otherwise the flags agreement at the start of call t+1; without, the
// agreement of the next exchange. This rank's call count becomes the
// others' once they hear of it, so that every rank is failed with the
// same count.
func (o *Optimizer) tellFailure(ctx context.Context, t int64, failure error) error {
	o.settle()
	o.broken = failure
	at := o.nextLaunch(t)
	calls := at // the others take calls t..at, then the exchange's agreement
	if o.flags != nil && !o.quiet && at != t {
		at, calls = t+1, t // the flags agreement, before call t+1 counts
	}
	o.calls = calls
	if _, err := o.agree(ctx, statusFailed+float32(min(at-t, maxFailedAgo)), at); err != nil {
		return errors.Join(failure, fmt.Errorf("outer: telling the other ranks at the agreement of step %d: %w", at, err))
	}
	return failure
}

// agree all-gathers every rank's status word and carried flags (see
// CarryFlags) at the agreement of call at, and writes the flags' maximum
// over the ranks into Agreed.
func (o *Optimizer) agree(ctx context.Context, status float32, at int64) (verdict, error) {
	v := verdict{failed: -1, refused: -1}
	sf := o.flags
	if o.world == 1 {
		if sf != nil {
			copy(sf.Agreed, sf.Local)
		}
		v.nonFinite = status == statusNonFinite
		return v, nil
	}
	o.status[0] = status
	if sf != nil {
		copy(o.status[1:], sf.Local)
	}
	// On c, not xc: no exchange is in flight at an agreement, and c is
	// the one communicator Close never closes, so that a Step after
	// Close still reaches the other ranks.
	if err := o.c.AllGather(ctx, o.status, o.statuses); err != nil {
		return v, fmt.Errorf("agreement: %w", err)
	}
	n := len(o.status)
	if sf != nil {
		for i := range sf.Agreed {
			m := o.statuses[1+i]
			for r := 1; r < o.world; r++ {
				m = max(m, o.statuses[r*n+1+i])
			}
			sf.Agreed[i] = m
		}
	}
	for r := range o.world {
		switch w := o.statuses[r*n]; {
		case w == statusOK:
		case w == statusNonFinite:
			v.nonFinite = true
		case w == statusRefused:
			if v.refused < 0 {
				v.refused = r
			}
		case v.failed < 0:
			v.failed, v.failedAt = r, at
			if w >= statusFailed && w <= statusFailed+maxFailedAgo {
				v.failedAt = at - int64(w-statusFailed)
			}
		}
	}
	return v, nil
}
