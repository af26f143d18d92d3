// Package conformance loads the JSON conformance vectors produced by the
// independent reference implementation of the lowbit spec, and runs the
// kinds lowbit implements against the implementation. It also replays
// optimizer step files (KindOptimizer: a recorded data-parallel run of
// Muon with an auxiliary Adam, RunOptimizerRank).
//
// The vectors the project tests against live in this package's testdata
// folder; Dir returns its path for tests.
package conformance

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
)

// Float is a float32 that also decodes the strings "nan", "inf" and "-inf".
type Float float32

// UnmarshalJSON decodes a number or one of the special strings.
func (f *Float) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		switch s {
		case "nan":
			*f = Float(math.NaN())
		case "inf":
			*f = Float(math.Inf(1))
		case "-inf":
			*f = Float(math.Inf(-1))
		default:
			return fmt.Errorf("conformance: unknown float string %q", s)
		}
		return nil
	}
	var v float64
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*f = Float(float32(v))
	return nil
}

// Floats converts a decoded slice to []float32.
func Floats(fs []Float) []float32 {
	out := make([]float32, len(fs))
	for i, f := range fs {
		out[i] = float32(f)
	}
	return out
}

// Case is one conformance file. Fields not used by a kind are zero.
type Case struct {
	Path string `json:"-"`
	Kind string `json:"kind"`
	Name string `json:"name"`

	// signpack
	Input  []Float `json:"input"`
	Packed []int   `json:"packed"`

	// Optimizer names the optimizer of an optimizer step file, which has
	// no kind of its own: LoadFile gives it KindOptimizer.
	Optimizer string `json:"optimizer"`

	// onebit
	World  int          `json:"world"`
	Numel  int          `json:"numel"`
	Padded int          `json:"padded"`
	Steps  []OnebitStep `json:"steps"`

	// Raw is the whole file. The quant, qgz and rsc kinds decode their
	// fields from it (Case.Quant, Case.QGZ, Case.RSC), since their
	// "inputs" and "outputs" have other shapes than onebit's.
	Raw json.RawMessage `json:"-"`
}

// OnebitStep is one call of the compressed allreduce in a trace.
type OnebitStep struct {
	Inputs      [][]Float `json:"inputs"`
	Output      []Float   `json:"output"`
	WorkerError [][]Float `json:"worker_error"`
	ServerError [][]Float `json:"server_error"`
}

// Load reads the conformance file at path, or every *.json file in the
// folder at path, in name order.
func Load(path string) ([]*Case, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("conformance: %w", err)
	}
	if !fi.IsDir() {
		c, err := LoadFile(path)
		if err != nil {
			return nil, err
		}
		return []*Case{c}, nil
	}
	dir := path
	paths, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	if len(paths) == 0 {
		return nil, fmt.Errorf("conformance: no *.json files in %s", dir)
	}
	slices.Sort(paths)
	cases := make([]*Case, 0, len(paths))
	for _, p := range paths {
		c, err := LoadFile(p)
		if err != nil {
			return nil, err
		}
		cases = append(cases, c)
	}
	return cases, nil
}

// LoadFile reads one conformance file.
func LoadFile(path string) (*Case, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("conformance: %w", err)
	}
	c := &Case{Path: path, Raw: b}
	if err := json.Unmarshal(b, c); err != nil {
		return nil, fmt.Errorf("conformance: %s: %w", path, err)
	}
	if c.Kind == "" && c.Optimizer != "" {
		c.Kind = KindOptimizer
	}
	if c.Kind == "" {
		return nil, fmt.Errorf("conformance: %s: no kind (nor optimizer)", path)
	}
	if c.Name == "" {
		c.Name = strings.TrimSuffix(filepath.Base(path), ".json")
	}
	return c, nil
}

// Dir is the folder of the vectors shipped with lowbit.
func Dir() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		panic("conformance: cannot locate the package folder")
	}
	return filepath.Join(filepath.Dir(file), "testdata")
}

// Close reports whether got is within the spec's tolerance of want:
// |got - want| <= 1e-5 * max(1, |want|). NaN matches NaN only.
func Close(got, want float32) bool {
	if math.IsNaN(float64(want)) || math.IsNaN(float64(got)) {
		return math.IsNaN(float64(want)) && math.IsNaN(float64(got))
	}
	d := math.Abs(float64(got) - float64(want))
	return d <= 1e-5*math.Max(1, math.Abs(float64(want)))
}

// CompareFloats returns an error naming the first element of got that is not
// Close to want.
func CompareFloats(what string, got []float32, want []Float) error {
	if len(got) != len(want) {
		return fmt.Errorf("%s: length %d, want %d", what, len(got), len(want))
	}
	for i := range got {
		if !Close(got[i], float32(want[i])) {
			return fmt.Errorf("%s[%d] = %g, want %g", what, i, got[i], float32(want[i]))
		}
	}
	return nil
}

// ErrNotImplemented is returned for kinds lowbit does not implement.
var ErrNotImplemented = errors.New("kind not implemented")
