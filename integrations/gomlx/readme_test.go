package gomlx

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
// it is, and that program, with the README's go.mod, builds as a module of
// its own outside this repository (its replace directives pointed at this
// checkout; the module cache only, GOPROXY=off: nothing is downloaded).
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
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command to build the program with")
	}
	root, err := filepath.Abs(filepath.Join("..", ".."))
	require.NoError(t, err)
	require.Contains(t, gomod, "=> ../lowbit\n")
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
		cmd.Env = append(os.Environ(), "GOPROXY=off", "GOFLAGS=-mod=mod", "GOSUMDB=off", "GOWORK=off", "GOTOOLCHAIN=local")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "go %s:\n%s", strings.Join(args, " "), out)
	}
}
