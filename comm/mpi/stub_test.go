//go:build !mpi

package mpi_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm/mpi"
)

func TestOpenWithoutMPI(t *testing.T) {
	assert.False(t, mpi.Built)
	c, err := mpi.Open(mpi.WithLogger(nil), mpi.WithOrderedReduce(), mpi.WithCollectiveTimeout(time.Minute))
	require.ErrorIs(t, err, mpi.ErrNotBuilt)
	assert.Nil(t, c)
	assert.Contains(t, err.Error(), "go build -tags mpi")
}
