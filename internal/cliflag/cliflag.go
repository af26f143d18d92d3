// Package cliflag parses the flags of lowbit's commands so that a bad
// command line costs one line: the flag, the value, why, and a good value,
// instead of the flag package's error followed by the whole usage.
package cliflag

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"time"
)

// Error is a command line a command refuses before it does anything: a bad
// flag value, an unknown flag, a stray argument. Commands exit with status
// 2 on it.
type Error struct {
	// Flag is the flag at fault, without dashes ("" when the error is
	// not about one flag's value).
	Flag string
	// Value is the value it was given.
	Value string
	// Reason says what is wrong.
	Reason string
	// Example is a good value (the flag's default when it has one).
	Example string
}

func (e *Error) Error() string {
	if e.Flag == "" {
		return e.Reason
	}
	s := fmt.Sprintf("invalid value %q for --%s: %s", e.Value, e.Flag, e.Reason)
	if e.Example != "" {
		s += fmt.Sprintf(" (e.g. --%s %s)", e.Flag, e.Example)
	}
	return s
}

// IsUsage says whether err is (or wraps) an *Error.
func IsUsage(err error) bool {
	var e *Error
	return errors.As(err, &e)
}

// Bad is the *Error for flag name of fs, refused after parsing (out of
// range, unknown name, ...): the value is the flag's current one.
func Bad(fs *flag.FlagSet, name, format string, args ...any) error {
	e := &Error{Flag: name, Reason: fmt.Sprintf(format, args...)}
	if f := fs.Lookup(name); f != nil {
		e.Value, e.Example = f.Value.String(), example(f)
		if w, ok := f.Value.(interface{ given() (string, bool) }); ok {
			if raw, set := w.given(); set {
				e.Value = raw
			}
		}
	}
	return e
}

// Usagef is an *Error not about one flag's value.
func Usagef(format string, args ...any) error {
	return &Error{Reason: fmt.Sprintf(format, args...)}
}

// Parse parses args with fs. With -h or -help it writes fs.Usage (or the
// defaults) to fs.Output() and returns flag.ErrHelp; any other failure is
// an *Error, and nothing is written. After a successful Parse the flags'
// Values are wrapped (keep reading them through the variables they set),
// so that Bad names the value as it was given.
func Parse(fs *flag.FlagSet, args []string) error {
	usage, out := fs.Usage, fs.Output()
	var bad *flag.Flag
	var badValue string
	var badErr error
	values := map[string]flag.Value{}
	fs.VisitAll(func(f *flag.Flag) {
		values[f.Name] = f.Value
		w := &watched{Value: f.Value, fail: func(v string, err error) { bad, badValue, badErr = f, v, err }}
		if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
			f.Value = watchedBool{w}
		} else {
			f.Value = w
		}
	})
	fs.Usage = func() {}
	fs.SetOutput(io.Discard)
	err := fs.Parse(args)
	fs.Usage = usage
	fs.SetOutput(out)
	switch {
	case err == nil:
		// The values stay watched, for Bad to name what was given.
		return nil
	case errors.Is(err, flag.ErrHelp):
		fs.VisitAll(func(f *flag.Flag) { f.Value = values[f.Name] })
		if fs.Usage != nil {
			fs.Usage()
		} else {
			fs.PrintDefaults()
		}
		return flag.ErrHelp
	case bad != nil:
		return &Error{Flag: bad.Name, Value: badValue, Reason: reason(values[bad.Name], badErr), Example: example(bad)}
	}
	return &Error{Reason: err.Error()}
}

// reason words the error of v's Set: the flag package's own values say
// only "parse error" or "value out of range".
func reason(v flag.Value, err error) string {
	if err.Error() != "parse error" && err.Error() != "value out of range" {
		return err.Error()
	}
	what := "a value of this flag"
	if g, ok := v.(flag.Getter); ok {
		switch g.Get().(type) {
		case int, int64, uint, uint64:
			what = "a whole number"
		case float64:
			what = "a number"
		case bool:
			what = "true or false"
		case time.Duration:
			what = "a duration such as 500ms or 2m"
		}
	}
	if err.Error() == "value out of range" {
		return "out of range for " + what
	}
	return "not " + what
}

// example is a good value of f: its default, unless that is empty or a
// boolean's (which goes without a value).
func example(f *flag.Flag) string {
	if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
		return ""
	}
	return f.DefValue
}

// watched is a flag.Value that keeps what it was given and reports a
// failed Set.
type watched struct {
	flag.Value
	fail func(string, error)
	raw  string
	set  bool
}

func (w *watched) Set(s string) error {
	w.raw, w.set = s, true
	err := w.Value.Set(s)
	if err != nil {
		w.fail(s, err)
	}
	return err
}

func (w *watched) given() (string, bool) { return w.raw, w.set }

// Get is the watched value's, for flag.Getter.
func (w *watched) Get() any {
	if g, ok := w.Value.(flag.Getter); ok {
		return g.Get()
	}
	return nil
}

type watchedBool struct{ *watched }

func (watchedBool) IsBoolFlag() bool { return true }
