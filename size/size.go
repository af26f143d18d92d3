// Package size parses and formats the two kinds of whole number lowbit's
// command-line flags take: sizes in bytes (Parse, Format, Value) and counts
// of things such as parameters, elements or examples (ParseCount,
// FormatCount, CountValue).
//
// Both are a non-negative decimal number, optionally with a fraction or an
// exponent (1.5, 1.3e9), followed by an optional unit:
//
//	unit             as a size (bytes)     as a count
//	k or K           10^3                  10^3
//	M                10^6                  10^6
//	G                10^9                  10^9
//	B                bytes (no multiple)   10^9 (billion)
//	T                10^12                 10^12
//	P                10^15                 10^15
//	Ki Mi Gi Ti Pi   2^10 ... 2^50         2^10 ... 2^50
//	unit then B      bytes: 64MB = 64M     refused: reads as bytes
//	b                refused: bits         10^9, as B
//	unit then b      refused: bits         refused: reads as bits
//
// Unit letters are case-insensitive (64m = 64M, 64mi = 64Mi, 137K = 137k);
// the i of a binary unit must be there, which is the only way to ask for
// powers of two. The value must come out a whole number and fit an int64.
// Spaces around the number are ignored, none inside it.
//
// The one letter that differs is B. In a size it means bytes, as in 64MiB
// or 4096B, and adds no multiple. In a count it means billion, as model
// sizes are written (7B, 1.3B, 70B), and a unit followed by B (64MB,
// 64MiB) is refused rather than read as a count, since it names bytes.
// No input is read one way where the other is meant without a word:
//
//	input    Parse (a size in bytes)         ParseCount (a count)
//	4096     4096                            4096
//	137k     137,000                         137,000
//	340M     340,000,000                     340,000,000
//	1.3G     1,300,000,000                   1,300,000,000
//	1.3e9    1,300,000,000                   1,300,000,000
//	64Mi     67,108,864                      67,108,864
//	1.5Ki    1536                            1536
//	7B       7 (bytes)                       7,000,000,000
//	1.3B     refused: 1.3 bytes              1,300,000,000
//	70B      70 (bytes)                      70,000,000,000
//	4096B    4096 (bytes)                    4,096,000,000,000
//	7b       refused: bits                   7,000,000,000
//	64MB     64,000,000                      refused: a size in bytes
//	64MiB    67,108,864                      refused: a size in bytes
//	64Mb     refused: bits                   refused: a size in bits
//	1.5      refused: not whole              refused: not whole
//	0.1k     100                             100
//	-1       refused: negative               refused: negative
//	1 K      refused                         refused
//
// Format and FormatCount write a number in the shortest form the matching
// parser reads back exactly: Format(25<<20) is 25Mi, FormatCount(7e9) is
// 7B, FormatCount(137000) is 137k.
package size

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"strconv"
	"strings"
)

type unit struct {
	suffix string
	mul    int64
}

// units of sizes, binary first so that "Mi" is not read as "M" followed
// by "i".
var units = []unit{
	{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"Ti", 1 << 40}, {"Pi", 1 << 50},
	{"K", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12}, {"P", 1e15},
}

// countUnits are the units of counts: those of sizes and B for billion.
var countUnits = append(units[:len(units):len(units)], unit{"B", 1e9})

// countFormatUnits are the units FormatCount writes, in the field's
// spelling.
var countFormatUnits = []unit{{"k", 1e3}, {"M", 1e6}, {"B", 1e9}, {"T", 1e12}}

// Example is a line of good sizes, for error messages.
const Example = "340M, 64Mi, 1.5G or 4096"

// CountExample is a line of good counts, for error messages.
const CountExample = "7B, 1.3B, 340M or 137k"

// Parse parses a size in bytes (see the package documentation).
func Parse(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if t == "" {
		return 0, fmt.Errorf("empty size: want a size such as %s", Example)
	}
	if strings.HasSuffix(t, "b") {
		return 0, fmt.Errorf("invalid size %q: b means bits; write B for bytes, or no unit (such as %s)", s, Example)
	}
	num, hasB := strings.CutSuffix(t, "B")
	num, mul := cutUnit(num, units)
	n, err := parseNumber(num, mul)
	if err != nil {
		if errors.Is(err, errNotWhole) && hasB && mul == 1 {
			// 1.3B: billions, as a count is written, where bytes are meant.
			return 0, fmt.Errorf("invalid size %q: B means bytes in a size, and %s bytes is not a whole number (%s billion bytes is %sG)", s, num, num, num)
		}
		return 0, numberError("size", s, err, Example)
	}
	return n, nil
}

// ParseCount parses a count of things, such as model parameters (see the
// package documentation): 7B is seven billion, 137k is 137,000.
func ParseCount(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if t == "" {
		return 0, fmt.Errorf("empty count: want a count such as %s", CountExample)
	}
	// A unit followed by B or b names bytes or bits: 64MB, 64MiB, 64Mb.
	if last := t[len(t)-1]; last == 'B' || last == 'b' {
		if rest, mul := cutUnit(t[:len(t)-1], units); mul != 1 && isNumber(strings.TrimPrefix(rest, "-")) {
			what := "bytes"
			if last == 'b' {
				what = "bits"
			}
			u := t[len(rest):]
			return 0, fmt.Errorf("invalid count %q: %s is a size in %s, and a count is meant here (B alone is billion: %s)", s, u, what, CountExample)
		}
	}
	num, mul := cutUnit(t, countUnits)
	n, err := parseNumber(num, mul)
	if err != nil {
		return 0, numberError("count", s, err, CountExample)
	}
	return n, nil
}

// cutUnit cuts a unit of us off the end of t (case-insensitive) and
// returns the rest and the unit's multiple, or t and 1.
func cutUnit(t string, us []unit) (string, int64) {
	for _, u := range us {
		if len(t) > len(u.suffix) && strings.EqualFold(t[len(t)-len(u.suffix):], u.suffix) {
			return t[:len(t)-len(u.suffix)], u.mul
		}
	}
	return t, 1
}

// Errors of parseNumber, worded by numberError.
var (
	errSyntax   = errors.New("not a number")
	errNegative = errors.New("must not be negative")
	errNotWhole = errors.New("not a whole number")
	errTooLarge = fmt.Errorf("too large (at most %d)", int64(math.MaxInt64))
)

// numberError words err of parseNumber for s, a "size" or a "count" (what),
// with a line of good ones.
func numberError(what, s string, err error, example string) error {
	if errors.Is(err, errSyntax) {
		return fmt.Errorf("invalid %s %q: want a %s such as %s", what, s, what, example)
	}
	return fmt.Errorf("invalid %s %q: %w", what, s, err)
}

// parseNumber returns the decimal number t times mul, which must be a
// non-negative whole int64.
func parseNumber(t string, mul int64) (int64, error) {
	// Only a decimal number is a size (big.Rat would also read 1/2 and
	// hexadecimal).
	if len(t) > 64 || !isNumber(strings.TrimPrefix(t, "-")) {
		return 0, errSyntax
	}
	if strings.HasPrefix(t, "-") {
		return 0, errNegative
	}
	r, ok := new(big.Rat).SetString(t)
	if !ok {
		return 0, errSyntax
	}
	r.Mul(r, new(big.Rat).SetInt64(mul))
	if !r.IsInt() {
		return 0, errNotWhole
	}
	n := r.Num()
	if !n.IsInt64() {
		return 0, errTooLarge
	}
	return n.Int64(), nil
}

// isNumber says whether t is digits with at most one point and an
// optional exponent: 12, 1.5, .5, 1e9, 1.3E+9.
func isNumber(t string) bool {
	mant, exp, hasExp := strings.Cut(strings.ToLower(t), "e")
	if hasExp {
		exp = strings.TrimPrefix(strings.TrimPrefix(exp, "+"), "-")
		if exp == "" || len(exp) > 4 || strings.Trim(exp, "0123456789") != "" {
			return false
		}
	}
	whole, frac, _ := strings.Cut(mant, ".")
	return whole+frac != "" && strings.Trim(whole+frac, "0123456789") == ""
}

// Format writes the size n in the shortest form Parse reads back exactly:
// plain digits, a decimal unit with up to three decimals (1.3G) or a whole
// number of a binary unit (25Mi). Negative n is written in plain digits.
func Format(n int64) string {
	best := strconv.FormatInt(n, 10)
	if n <= 0 {
		return best
	}
	for _, u := range units {
		var s string
		switch {
		case n < u.mul:
			continue
		case strings.HasSuffix(u.suffix, "i"):
			if n%u.mul != 0 {
				continue
			}
			s = strconv.FormatInt(n/u.mul, 10) + u.suffix
		default:
			if n%(u.mul/1000) != 0 {
				continue
			}
			s = decimal(n, u)
		}
		if len(s) < len(best) {
			best = s
		}
	}
	return best
}

// FormatCount writes the count n as the field writes model sizes, in a
// form ParseCount reads back exactly: in the largest of k, M, B and T that
// takes it with up to three decimals (7B, 1.3B, 6.738B, 340M, 137k), or in
// plain digits where those are as short (1500, 1234567). Every count
// lowbit prints goes through it. Negative n is written in plain digits.
func FormatCount(n int64) string {
	plain := strconv.FormatInt(n, 10)
	for i := len(countFormatUnits) - 1; i >= 0; i-- {
		u := countFormatUnits[i]
		if n < u.mul || n%(u.mul/1000) != 0 {
			continue
		}
		if s := decimal(n, u); len(s) < len(plain) {
			return s
		}
		break
	}
	return plain
}

// decimal writes n in the decimal unit u with up to three decimals: n must
// be a multiple of u.mul/1000.
func decimal(n int64, u unit) string {
	whole, frac := n/u.mul, n%u.mul/(u.mul/1000)
	s := strconv.FormatInt(whole, 10)
	if frac != 0 {
		s += strings.TrimRight(fmt.Sprintf(".%03d", frac), "0")
	}
	return s + u.suffix
}

// Number is the integer types a Value or CountValue may hold.
type Number interface{ ~int | ~int64 }

// Value is a flag.Value that sets *P to a size in bytes in [Min, Max] (no
// upper bound when Max is 0):
//
//	fs.Var(&size.Value[int64]{P: &bucket, Min: 4}, "bucket", "bucket `size` in bytes")
type Value[T Number] struct {
	P        *T
	Min, Max T
}

// String writes the current value with Format.
func (v *Value[T]) String() string {
	if v == nil || v.P == nil {
		return ""
	}
	return Format(int64(*v.P))
}

// Set parses s with Parse and checks the bounds.
func (v *Value[T]) Set(s string) error {
	n, err := Parse(s)
	if err != nil {
		return err
	}
	return set(v.P, n, v.Min, v.Max, s, Format, "")
}

// CountValue is a flag.Value that sets *P to a count in [Min, Max] (no
// upper bound when Max is 0). Its help text names the value `count`, which
// tells a count flag from a size flag in the usage:
//
//	fs.Var(&size.CountValue[int64]{P: &params, Min: 1}, "params", "model parameters (`count`: 7B, 340M)")
type CountValue[T Number] struct {
	P        *T
	Min, Max T
}

// String writes the current value with FormatCount.
func (v *CountValue[T]) String() string {
	if v == nil || v.P == nil {
		return ""
	}
	return FormatCount(int64(*v.P))
}

// Set parses s with ParseCount and checks the bounds.
func (v *CountValue[T]) Set(s string) error {
	n, err := ParseCount(s)
	if err != nil {
		return err
	}
	note := ""
	if t := strings.TrimSpace(s); strings.HasSuffix(t, "B") || strings.HasSuffix(t, "b") {
		note = " (B is billion in a count)"
	}
	return set(v.P, n, v.Min, v.Max, s, FormatCount, note)
}

// set sets *p to n, the value of s, if it is in [lo, hi] (no upper bound
// when hi is 0); the error writes the bounds with format and ends in note.
func set[T Number](p *T, n int64, lo, hi T, s string, format func(int64) string, note string) error {
	if T(n) < lo || int64(T(n)) != n || hi > 0 && T(n) > hi {
		if hi > 0 {
			return fmt.Errorf("%s is out of range [%s, %s]%s", strings.TrimSpace(s), format(int64(lo)), format(int64(hi)), note)
		}
		return fmt.Errorf("%s is below the least value %s%s", strings.TrimSpace(s), format(int64(lo)), note)
	}
	*p = T(n)
	return nil
}
