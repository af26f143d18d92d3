package main

// The units lowbit plan reads and writes: durations in seconds, sizes,
// rates and byte counts.

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/lowbit-ml/lowbit/size"
)

// optionalSize is a size flag without a default: unset (0) it prints
// nothing, so that neither -h nor an error offers 0 as a value.
type optionalSize struct{ size.Value[int64] }

func (v *optionalSize) String() string {
	if v.P == nil || *v.P == 0 {
		return ""
	}
	return v.Value.String()
}

// optionalCount is a count flag without a default (--tokens-per-step):
// unset (0) it prints nothing, so that neither -h nor an error offers 0 as
// a value.
type optionalCount struct{ size.CountValue[int64] }

func (v *optionalCount) String() string {
	if v.P == nil || *v.P == 0 {
		return ""
	}
	return v.CountValue.String()
}

// seconds is a flag of a time kept in seconds (a float64 field of
// costmodel.Job) that takes a duration, as flag.Duration does (10us,
// 300ms), or a bare number of seconds (10e-6), as --alpha took before it
// took durations. Unset (0) it prints nothing, so that neither -h nor an
// error offers 0 as a value.
type seconds struct{ p *float64 }

func (s *seconds) Set(v string) error {
	if d, err := time.ParseDuration(v); err == nil {
		*s.p = d.Seconds()
		return nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil {
		return errors.New("not a duration such as 10us or 1.5ms (or a number of seconds)")
	}
	*s.p = f
	return nil
}

func (s *seconds) String() string {
	if s.p == nil {
		return ""
	}
	d := time.Duration(math.Round(*s.p * float64(time.Second)))
	return (&optionalDuration{&d}).String()
}

// optionalDuration is a duration flag without a default (--rtt): unset
// (0) it prints nothing, as seconds does, so that neither -h nor an error
// offers 0s as a value.
type optionalDuration struct{ p *time.Duration }

func (d *optionalDuration) Set(v string) error {
	t, err := time.ParseDuration(v)
	if err != nil {
		return errors.New("not a duration such as 40ms or 1.5ms")
	}
	*d.p = t
	return nil
}

func (d *optionalDuration) String() string {
	if d.p == nil || *d.p == 0 {
		return ""
	}
	return d.p.String()
}

// formatSeconds writes a duration in seconds with three significant
// digits and a readable unit.
func formatSeconds(s float64) string {
	switch {
	case s == 0:
		return "0"
	case s < 1e-3:
		return strconv.FormatFloat(s*1e6, 'f', 0, 64) + "µs"
	case s < 1:
		ms := s * 1e3
		prec := 2
		if ms >= 100 {
			prec = 0
		} else if ms >= 10 {
			prec = 1
		}
		return strconv.FormatFloat(ms, 'f', prec, 64) + "ms"
	}
	return strconv.FormatFloat(s, 'f', 2, 64) + "s"
}

// bytesDecimal writes a byte count with a decimal unit.
func bytesDecimal(b float64) string {
	switch {
	case b >= 1e12:
		return fmt.Sprintf("%.2f TB", b/1e12)
	case b >= 1e9:
		return fmt.Sprintf("%.2f GB", b/1e9)
	case b >= 1e6:
		return fmt.Sprintf("%.1f MB", b/1e6)
	case b >= 1e3:
		return fmt.Sprintf("%.1f kB", b/1e3)
	}
	return fmt.Sprintf("%.0f B", b)
}
