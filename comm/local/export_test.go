package local

import "github.com/lowbit-ml/lowbit/comm"

// NumSplits is the length of c's list of the communicators split off it
// that it keeps.
func NumSplits(c comm.Comm) int {
	l := c.(*Comm)
	l.fam.Lock()
	defer l.fam.Unlock()
	return len(l.splits)
}
