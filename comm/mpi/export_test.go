//go:build mpi

package mpi

// SetYield is cSetYield, for the tests.
var SetYield = cSetYield
