// Package size parses and formats counts of bytes or elements written
// with SI or binary suffixes, the one syntax every lowbit command-line
// flag that takes such a count accepts.
//
// A size is a non-negative decimal number, optionally with a fraction or
// an exponent (1.5, 1.3e9), followed by an optional unit:
//
//	k or K  10^3     Ki  2^10
//	M       10^6     Mi  2^20
//	G       10^9     Gi  2^30
//	T       10^12    Ti  2^40
//	P       10^15    Pi  2^50
//
// so 340M is 340,000,000 and 64Mi is 67,108,864. The unit letter is
// case-insensitive (64m = 64M, 64mi = 64Mi); the i of a binary unit must
// be there, which is the only way to ask for powers of two. An upper-case
// B may follow the unit or the number (64MB = 64M, 64MiB = 64Mi, 4096B);
// a lower-case b is refused, since it reads as bits. The value must come
// out a whole number (1.5Ki = 1536, 0.1k = 100; 1.5 and 1.0001k are refused) and fit an
// int64. Spaces around the size are ignored, none inside it.
package size

import (
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

// units, binary first so that "Mi" is not read as "M" followed by "i".
var units = []unit{
	{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"Ti", 1 << 40}, {"Pi", 1 << 50},
	{"K", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12}, {"P", 1e15},
}

// Example is a line of good sizes, for error messages.
const Example = "340M, 64Mi, 1.5G or 4096"

// Parse parses a size (see the package documentation).
func Parse(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if t == "" {
		return 0, fmt.Errorf("empty size: want a count such as %s", Example)
	}
	if strings.HasSuffix(t, "b") {
		return 0, fmt.Errorf("invalid size %q: b means bits; write B for bytes, or no unit (such as %s)", s, Example)
	}
	t = strings.TrimSuffix(t, "B")
	mul := int64(1)
	for _, u := range units {
		if len(t) > len(u.suffix) && strings.EqualFold(t[len(t)-len(u.suffix):], u.suffix) {
			mul, t = u.mul, t[:len(t)-len(u.suffix)]
			break
		}
	}
	// Only a decimal number is a size (big.Rat would also read 1/2 and
	// hexadecimal).
	if len(t) > 64 || !isNumber(strings.TrimPrefix(t, "-")) {
		return 0, fmt.Errorf("invalid size %q: want a count such as %s", s, Example)
	}
	if strings.HasPrefix(t, "-") {
		return 0, fmt.Errorf("invalid size %q: must not be negative", s)
	}
	r, ok := new(big.Rat).SetString(t)
	if !ok {
		return 0, fmt.Errorf("invalid size %q: want a count such as %s", s, Example)
	}
	r.Mul(r, new(big.Rat).SetInt64(mul))
	if !r.IsInt() {
		return 0, fmt.Errorf("invalid size %q: not a whole number", s)
	}
	n := r.Num()
	if !n.IsInt64() {
		return 0, fmt.Errorf("invalid size %q: too large (at most %d)", s, int64(math.MaxInt64))
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

// Format writes n in the shortest form Parse reads back exactly: plain
// digits, a decimal unit with up to three decimals (1.3G) or a whole
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
			if u.mul >= 1000 && n%(u.mul/1000) != 0 {
				continue
			}
			s = strings.TrimSuffix(strings.TrimRight(strconv.FormatFloat(float64(n)/float64(u.mul), 'f', 3, 64), "0"), ".") + u.suffix
			if v, err := Parse(s); err != nil || v != n {
				continue
			}
		}
		if len(s) < len(best) {
			best = s
		}
	}
	return best
}

// Number is the integer types a Value may hold.
type Number interface{ ~int | ~int64 }

// Value is a flag.Value that sets *P to a size in [Min, Max] (no upper
// bound when Max is 0):
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
	if T(n) < v.Min || int64(T(n)) != n || v.Max > 0 && T(n) > v.Max {
		if v.Max > 0 {
			return fmt.Errorf("%s is out of range [%s, %s]", strings.TrimSpace(s), Format(int64(v.Min)), Format(int64(v.Max)))
		}
		return fmt.Errorf("%s is below the least value %s", strings.TrimSpace(s), Format(int64(v.Min)))
	}
	*v.P = T(n)
	return nil
}
