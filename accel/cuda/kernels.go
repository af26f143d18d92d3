package cuda

// The kernels of a Device (device.go), from the embedded PTX of
// kernels/lowbit.cu: compress, carry, sum and unpack, launched on the
// device's stream.

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/lowbit-ml/lowbit/accel"
)

// launch starts fn on grid blocks of blockSize threads with the first
// nargs parameters in d.args.vals.
func (d *Device) launch(name string, fn uintptr, grid int) error {
	d.args.sys = [11]uintptr{fn, uintptr(grid), 1, 1, blockSize, 1, 1, 0, d.stream, uintptr(unsafe.Pointer(&d.args.ptrs[0])), 0}
	if err := d.sys("cuLaunchKernel", d.drv.cuLaunchKernel, 11); err != nil {
		return fmt.Errorf("cuda: launching %s: %w", name, err)
	}
	return nil
}

// gridFor is the number of blocks for work items of blockSize-thread
// blocks, at most perSM blocks per multiprocessor (the kernels loop).
func (d *Device) gridFor(items int, perSM int) int {
	g := (items + blockSize - 1) / blockSize
	return max(1, min(g, perSM*d.info.SMs))
}

// Compress runs the compensate-and-norm kernel, then the pack-with-residual
// kernel (which sums the norm's partial sums itself), and waits for the
// scale.
func (d *Device) Compress(packed, residual, input accel.Span) (float32, error) {
	err := d.enter()
	if err != nil {
		return 0, err
	}
	defer d.leave()
	r, err := d.ptrOf("compress residual", residual, true)
	if err != nil {
		return 0, err
	}
	in, err := d.ptrOf("compress input", input, true)
	if err != nil {
		return 0, err
	}
	p, err := d.ptrOf("compress packed", packed, false)
	if err != nil {
		return 0, err
	}
	n, nIn := residual.Len/4, input.Len/4
	if nIn > n {
		return 0, fmt.Errorf("cuda: compress: input of %d elements is longer than the residual (%d)", nIn, n)
	}
	if err := accel.CheckKernel("compress", packed.Len, n); err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, nil
	}
	parts := min(d.gridFor(n, 8), maxParts)
	a := &d.args.vals
	a[0], a[1], a[2], a[3], a[4] = r, in, uint64(nIn), uint64(n), d.scratch
	if err := d.launch("lowbit_compensate_norm", d.fnNorm, parts); err != nil {
		return 0, err
	}
	groups := (n + 1023) / 1024
	warpsPerBlock := blockSize / 32
	packGrid := max(1, min((groups+warpsPerBlock-1)/warpsPerBlock, 4*d.info.SMs))
	a[0], a[1], a[2], a[3], a[4], a[5] = p, r, uint64(n), d.scratch, uint64(parts), d.scratch+d.scaleOffset
	if err := d.launch("lowbit_pack_residual", d.fnPack, packGrid); err != nil {
		return 0, err
	}
	sa := &d.args.sys
	sa[0], sa[1], sa[2], sa[3] = uintptr(unsafe.Pointer(&d.args.scale)), uintptr(d.scratch+d.scaleOffset), 4, d.stream
	if err := d.sys("cuMemcpyDtoHAsync_v2", d.drv.cuMemcpyDtoHAsync, 4); err != nil {
		return 0, fmt.Errorf("cuda: %w", err)
	}
	if err := d.sync(); err != nil {
		return 0, err
	}
	return d.args.scale, nil
}

// CompressCarried runs the one-pass carry-and-pack kernel, then the
// one-block kernel that sums its partial norms, and waits for the scale.
func (d *Device) CompressCarried(packed, carried accel.Span, prevScale float32, input accel.Span) (float32, error) {
	err := d.enter()
	if err != nil {
		return 0, err
	}
	defer d.leave()
	x, p, err := d.kernelArgs("compress-carried", "compress-carried x", "compress-carried packed", carried, packed)
	if err != nil {
		return 0, err
	}
	in, err := d.ptrOf("compress-carried input", input, true)
	if err != nil {
		return 0, err
	}
	n, nIn := carried.Len/4, input.Len/4
	if nIn > n {
		return 0, fmt.Errorf("cuda: compress-carried: input of %d elements is longer than x (%d)", nIn, n)
	}
	if n == 0 {
		return 0, nil
	}
	a := &d.args.vals
	a[0], a[1], a[2], a[3], a[4], a[5] = p, x, uint64(n), uint64(math.Float32bits(prevScale)), in, uint64(nIn)
	return d.carry("lowbit_carry_pack", d.fnCarry, d.carryPerSM, n, 6)
}

// SumCompressCarried runs the one-pass kernel that sums the chunks, carries
// and packs, then the one-block norm kernel, and waits for the scale.
func (d *Device) SumCompressCarried(packed, carried accel.Span, prevScale float32, chunks, scales accel.Span) (float32, error) {
	err := d.enter()
	if err != nil {
		return 0, err
	}
	defer d.leave()
	x, p, err := d.kernelArgs("sum-compress-carried", "sum-compress-carried x", "sum-compress-carried packed", carried, packed)
	if err != nil {
		return 0, err
	}
	c, err := d.ptrOf("sum-compress-carried chunks", chunks, false)
	if err != nil {
		return 0, err
	}
	sc, err := d.ptrOf("sum-compress-carried scales", scales, true)
	if err != nil {
		return 0, err
	}
	n, w := carried.Len/4, scales.Len/4
	if err := accel.CheckSum("sum-compress-carried", chunks.Len, w, n); err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, nil
	}
	a := &d.args.vals
	a[0], a[1], a[2], a[3] = p, x, uint64(n), uint64(math.Float32bits(prevScale))
	a[4], a[5], a[6], a[7] = c, uint64(accel.PackedLen(n)), sc, uint64(w)
	return d.carry("lowbit_sum_carry_pack", d.fnSumCarry, d.sumCarryPerSM, n, 8)
}

// kernelArgs checks a kernel's float32 span and the packed signs of its
// elements and returns their device addresses.
func (d *Device) kernelArgs(op, xName, packedName string, x, packed accel.Span) (xp, pp uint64, err error) {
	if xp, err = d.ptrOf(xName, x, true); err != nil {
		return 0, 0, err
	}
	if pp, err = d.ptrOf(packedName, packed, false); err != nil {
		return 0, 0, err
	}
	return xp, pp, accel.CheckKernel(op, packed.Len, x.Len/4)
}

// carry launches a carry-and-pack kernel over n elements, whose
// parameters are in d.args.vals up to the partial sums (parameter
// partials, which carry sets), then lowbit_scale, and waits for the
// scale. The grid is at most one wave of resident blocks (perSM on each
// multiprocessor), so that no block of the grid-stride loop starts late.
// The caller holds the lock.
func (d *Device) carry(kernel string, fn uintptr, perSM, n, partials int) (float32, error) {
	groups := (n + 1023) / 1024
	warpsPerBlock := blockSize / 32
	grid := max(1, min((groups+warpsPerBlock-1)/warpsPerBlock, perSM*d.info.SMs, maxParts))
	a := &d.args.vals
	a[partials] = d.scratch
	if err := d.launch(kernel, fn, grid); err != nil {
		return 0, err
	}
	a[0], a[1], a[2], a[3] = d.scratch, uint64(grid), uint64(n), d.scratch+d.scaleOffset
	if err := d.launch("lowbit_scale", d.fnScale, 1); err != nil {
		return 0, err
	}
	sa := &d.args.sys
	sa[0], sa[1], sa[2], sa[3] = uintptr(unsafe.Pointer(&d.args.scale)), uintptr(d.scratch+d.scaleOffset), 4, d.stream
	if err := d.sys("cuMemcpyDtoHAsync_v2", d.drv.cuMemcpyDtoHAsync, 4); err != nil {
		return 0, fmt.Errorf("cuda: %w", err)
	}
	if err := d.sync(); err != nil {
		return 0, err
	}
	return d.args.scale, nil
}

// UnpackScale writes ±scale into dst from the packed signs.
func (d *Device) UnpackScale(dst, packed accel.Span, scale float32) error {
	return d.unpack("lowbit_unpack_scale", d.fnUnpack, "unpack-scale destination", "unpack-scale packed", dst, packed, scale)
}

// UnpackScaleAdd adds ±scale into acc from the packed signs.
func (d *Device) UnpackScaleAdd(acc, packed accel.Span, scale float32) error {
	return d.unpack("lowbit_unpack_scale_add", d.fnUnpackAdd, "unpack-scale-add accumulator", "unpack-scale-add packed", acc, packed, scale)
}

func (d *Device) unpack(kernel string, fn uintptr, dstName, packedName string, dst, packed accel.Span, scale float32) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	x, p, err := d.kernelArgs(kernel, dstName, packedName, dst, packed)
	if err != nil {
		return err
	}
	n := dst.Len / 4
	if n == 0 {
		return nil
	}
	a := &d.args.vals
	a[0], a[1], a[2], a[3] = x, p, uint64(n), uint64(math.Float32bits(scale))
	return d.launch(kernel, fn, d.gridFor(n, 8))
}

// UnpackScaleChunks writes ±scales[j] into chunk j of dst from the packed
// signs, in one launch: blocks per chunk, chunk after chunk, each reading
// its chunk's scale from device memory.
func (d *Device) UnpackScaleChunks(dst, packed accel.Span, chunk int, scales accel.Span) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	const op = "unpack-scale-chunks"
	x, p, err := d.kernelArgs(op, "unpack-scale-chunks destination", "unpack-scale-chunks packed", dst, packed)
	if err != nil {
		return err
	}
	sc, err := d.ptrOf("unpack-scale-chunks scales", scales, true)
	if err != nil {
		return err
	}
	n := dst.Len / 4
	if err := accel.CheckChunks(op, packed.Len, n, chunk, scales.Len/4); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	chunks := (n + chunk - 1) / chunk
	per := max(1, (d.gridFor(n, 8)+chunks-1)/chunks)
	if chunks > math.MaxInt32/per {
		return fmt.Errorf("cuda: %s: %d chunks", op, chunks)
	}
	a := &d.args.vals
	a[0], a[1], a[2], a[3], a[4], a[5] = x, p, uint64(n), uint64(chunk), sc, uint64(per)
	return d.launch("lowbit_unpack_chunks", d.fnUnpackChunks, per*chunks)
}
