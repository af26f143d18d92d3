package quant

// StateBytes returns the bytes of the buffers d keeps between calls
// (allocated by the first call at a size): the narrowed chunks sent and
// received, this rank's narrowed mean, every rank's, and the sum block.
// A nil d holds nothing.
func (d *DownCast) StateBytes() int64 {
	if d == nil {
		return 0
	}
	return 2*int64(cap(d.send)+cap(d.recv)+cap(d.gsend)+cap(d.grecv)) + 4*int64(cap(d.acc))
}

// StateBytes returns the bytes of the buffers q keeps: the byte codes sent
// and received at both levels, the partial sums, the scales, the padded
// partition and, with error feedback, both residuals. A nil q holds
// nothing.
func (q *QGZ) StateBytes() int64 {
	if q == nil {
		return 0
	}
	n := int64(cap(q.intraSend) + cap(q.intraRecv) + cap(q.interSend) + cap(q.interRecv))
	for _, b := range [][]float32{q.partial, q.scales, q.negScales, q.tmp, q.res1, q.res2} {
		n += 4 * int64(cap(b))
	}
	return n
}
