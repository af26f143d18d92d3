package onebit_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// 1-bit Muon refuses exact Muon's Split with a ConfigError that says why.
func TestMuonRefusesSplit(t *testing.T) {
	cfg := onebit.DefaultMuonConfig()
	cfg.Split = true
	err := cfg.Validate()
	var ce *optim.ConfigError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, "Split", ce.Field)
	assert.EqualError(t, err, "onebit: MuonConfig.Split = true: want false (1-bit Muon orthogonalizes each rank's own momentum: Split does not apply)")
	p := optim.NewParam("w", 4, 4)
	_, nerr := onebit.NewMuon(context.Background(), nil, []*optim.Param{p}, cfg)
	assert.EqualError(t, nerr, err.Error(), "NewMuon returns Validate's error")
}
