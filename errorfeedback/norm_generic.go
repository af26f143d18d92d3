package errorfeedback

// The portable norm kernels. They are the reference the fast path is tested
// against, and the only path on architectures without one.

// addSumSquaresGeneric sets x[i] += in[i] and returns the float64 sum of
// the new x[i] squared. Four independent accumulators keep the loop
// pipelined. in must be at least as long as x.
func addSumSquaresGeneric(x, in []float32) float64 {
	in = in[:len(x)]
	var s0, s1, s2, s3 float64
	i := 0
	for ; i+4 <= len(x); i += 4 {
		a := x[i] + in[i]
		b := x[i+1] + in[i+1]
		c := x[i+2] + in[i+2]
		d := x[i+3] + in[i+3]
		x[i], x[i+1], x[i+2], x[i+3] = a, b, c, d
		s0 += float64(a) * float64(a)
		s1 += float64(b) * float64(b)
		s2 += float64(c) * float64(c)
		s3 += float64(d) * float64(d)
	}
	for ; i < len(x); i++ {
		a := x[i] + in[i]
		x[i] = a
		s0 += float64(a) * float64(a)
	}
	return (s0 + s1) + (s2 + s3)
}

// sumSquaresGeneric returns the float64 sum of x[i] squared.
func sumSquaresGeneric(x []float32) float64 {
	var s0, s1, s2, s3 float64
	i := 0
	for ; i+4 <= len(x); i += 4 {
		s0 += float64(x[i]) * float64(x[i])
		s1 += float64(x[i+1]) * float64(x[i+1])
		s2 += float64(x[i+2]) * float64(x[i+2])
		s3 += float64(x[i+3]) * float64(x[i+3])
	}
	for ; i < len(x); i++ {
		s0 += float64(x[i]) * float64(x[i])
	}
	return (s0 + s1) + (s2 + s3)
}
