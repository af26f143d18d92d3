package gomlx

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// fences returns the contents of the README's fenced code blocks that
// open with the line "```"+lang.
func fences(t *testing.T, readme, lang string) []string {
	t.Helper()
	var out []string
	var block *strings.Builder
	open := false
	for line := range strings.Lines(readme) {
		fence, isFence := strings.CutPrefix(strings.TrimSuffix(line, "\n"), "```")
		switch {
		case isFence && !open:
			open, block = true, nil
			if fence == lang {
				block = new(strings.Builder)
			}
		case isFence:
			open = false
			if block != nil {
				out = append(out, block.String())
			}
		case open && block != nil:
			block.WriteString(line)
		}
	}
	require.False(t, open, "an unclosed code block")
	return out
}

// TestREADMEMinimalProgram: the README shows examples/minimal/main.go as
// it is (which this module builds and tests: examples/minimal), and the
// README's go.mod requires the versions this module builds it with, with
// replace directives for a checkout beside it. With LOWBIT_README_BUILD=1
// it also builds the program as a module of its own outside this
// repository from that go.mod (go mod tidy, then go build; this may
// download modules from the proxy, so it is off by default: a test never
// reaches for a download unasked).
func TestREADMEMinimalProgram(t *testing.T) {
	b, err := os.ReadFile("README.md")
	require.NoError(t, err)
	readme := string(b)
	program, err := os.ReadFile(filepath.Join("examples", "minimal", "main.go"))
	require.NoError(t, err)
	var shown string
	for _, f := range fences(t, readme, "go") {
		if strings.HasPrefix(f, "// Command minimal") {
			shown = f
		}
	}
	require.NotEmpty(t, shown, "the README shows no program starting // Command minimal")
	assert.Equal(t, string(program), shown, "the README's program differs from examples/minimal/main.go")

	var gomod string
	for _, f := range fences(t, readme, "") {
		if strings.HasPrefix(f, "module ") {
			gomod = f
		}
	}
	require.NotEmpty(t, gomod, "the README shows no go.mod")
	require.Contains(t, gomod, "=> ../lowbit\n")
	own, err := os.ReadFile("go.mod")
	require.NoError(t, err)
	versions := requires(string(own))
	for path, v := range requires(gomod) {
		if strings.HasPrefix(path, "github.com/lowbit-ml/lowbit") {
			continue // replaced by the checkout
		}
		require.Contains(t, versions, path, "the README's go.mod requires %s, which this module does not", path)
		assert.Equal(t, versions[path], v, "the README's go.mod requires %s at another version than this module", path)
	}
	if os.Getenv("LOWBIT_README_BUILD") != "1" {
		return
	}
	goBin, err := exec.LookPath("go")
	require.NoError(t, err)
	root, err := filepath.Abs(filepath.Join("..", ".."))
	require.NoError(t, err)
	gomod = strings.ReplaceAll(gomod, "=> ../lowbit", "=> "+root)
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.mod"), []byte(gomod), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "main.go"), program, 0o600))
	sum, err := os.ReadFile("go.sum")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o600))
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	for _, args := range [][]string{{"mod", "tidy"}, {"build", "-o", filepath.Join(dir, "trainer"), "."}} {
		cmd := exec.CommandContext(ctx, goBin, args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off", "GOTOOLCHAIN=local")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "go %s:\n%s", strings.Join(args, " "), out)
	}
}

// requires returns the module versions a go.mod's require directives
// name (single lines and blocks; "// indirect" comments dropped).
func requires(gomod string) map[string]string {
	out := map[string]string{}
	block := false
	for _, line := range strings.Split(gomod, "\n") {
		line = strings.TrimSpace(line)
		if i := strings.Index(line, "//"); i >= 0 {
			line = strings.TrimSpace(line[:i])
		}
		switch {
		case line == "require (":
			block = true
			continue
		case block && line == ")":
			block = false
			continue
		case strings.HasPrefix(line, "require "):
			line = strings.TrimPrefix(line, "require ")
		case !block:
			continue
		}
		if f := strings.Fields(line); len(f) == 2 {
			out[f[0]] = f[1]
		}
	}
	return out
}

// TestREADMENewRefusesLR: the learning rate the README says New refuses
// (in "New checks the optimizer's config at once: `LR = x` fails here")
// is refused by New, with the config's error, and the learning rate 0 it
// says is one is accepted.
func TestREADMENewRefusesLR(t *testing.T) {
	b, err := os.ReadFile("README.md")
	require.NoError(t, err)
	readme := strings.Join(strings.Fields(string(b)), " ")
	m := regexp.MustCompile("New checks the optimizer's config at once: `LR = ([^`]*)` fails here").FindStringSubmatch(readme)
	require.NotNil(t, m, "the README says no more which LR New refuses")
	lr, err := strconv.ParseFloat(m[1], 32)
	require.NoError(t, err)
	adamAt := func(lr float32) Builder {
		return func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			cfg := optim.DefaultAdamConfig()
			cfg.LR = lr
			return optim.NewAdam(ctx, c, p, cfg)
		}
	}
	_, err = New(context.Background(), nil, adamAt(float32(lr)))
	var ce *optim.ConfigError
	assert.ErrorAs(t, err, &ce, "the README says New refuses LR = %s", m[1])

	require.True(t, strings.Contains(readme, "(`LR = 0` is a learning rate"), "the README says no more that LR = 0 is accepted")
	opt, err := New(context.Background(), nil, adamAt(0))
	require.NoError(t, err)
	require.NoError(t, opt.Close())
}
