package cuda

// The memory of a Device (device.go): device and page-locked host
// buffers, and the copies between them and host memory.

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/lowbit-ml/lowbit/accel"
)

// memcpy2D is the driver's CUDA_MEMCPY2D (cuda.h, 64-bit layout).
type memcpy2D struct {
	srcXInBytes, srcY uint64
	srcMemoryType     uint32
	_                 uint32
	srcHost           uintptr
	srcDevice         uint64
	srcArray          uintptr
	srcPitch          uint64
	dstXInBytes, dstY uint64
	dstMemoryType     uint32
	_                 uint32
	dstHost           uintptr
	dstDevice         uint64
	dstArray          uintptr
	dstPitch          uint64
	widthInBytes      uint64
	height            uint64
}

// CUmemorytype values.
const (
	memoryHost   = 1
	memoryDevice = 2
)

// buffer is device memory from cuMemAlloc.
type buffer struct {
	dev *Device
	ptr uint64
	n   int
}

func (b *buffer) Len() int { return b.n }

// Free releases the memory; a second Free is a no-op.
func (b *buffer) Free() error {
	d := b.dev
	if d == nil {
		return nil
	}
	err := d.enter()
	if err != nil {
		b.dev = nil // the device is closed and has freed it
		return nil
	}
	defer d.leave()
	delete(d.bufs, b)
	b.dev = nil
	if b.ptr == 0 {
		return nil
	}
	ptr := b.ptr
	b.ptr = 0
	if err := call("cuMemFree_v2", d.drv.cuMemFree, uintptr(ptr)); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// Alloc returns n zeroed bytes of device memory. Running out of device
// memory is an error that gives the free and total memory.
func (d *Device) Alloc(n int) (accel.Buffer, error) {
	if n < 0 {
		return nil, fmt.Errorf("cuda: alloc of %d bytes", n)
	}
	err := d.enter()
	if err != nil {
		return nil, err
	}
	defer d.leave()
	b := &buffer{dev: d, n: n}
	if n > 0 {
		if err := call("cuMemAlloc_v2", d.drv.cuMemAlloc, uintptr(unsafe.Pointer(&d.args.out)), uintptr(n)); err != nil {
			var ce *Error
			if errors.As(err, &ce) && ce.IsOutOfMemory() {
				free, total, _ := d.memGetInfo()
				return nil, fmt.Errorf("cuda: out of device memory allocating %d bytes on %s (%d of %d bytes free): %w",
					n, d.Name(), free, total, err)
			}
			return nil, fmt.Errorf("cuda: allocating %d bytes: %w", n, err)
		}
		b.ptr = d.args.out
		if err := call("cuMemsetD8Async", d.drv.cuMemsetD8Async, uintptr(b.ptr), 0, uintptr(n), d.stream); err != nil {
			call("cuMemFree_v2", d.drv.cuMemFree, uintptr(b.ptr))
			return nil, fmt.Errorf("cuda: %w", err)
		}
	}
	d.bufs[b] = struct{}{}
	return b, nil
}

// hostBuffer is page-locked host memory from cuMemAllocHost.
type hostBuffer struct {
	dev   *Device
	bytes []byte
}

func (h *hostBuffer) Bytes() []byte { return h.bytes }

// Free releases the memory; a second Free is a no-op.
func (h *hostBuffer) Free() error {
	d := h.dev
	if d == nil {
		return nil
	}
	err := d.enter()
	if err != nil {
		h.dev, h.bytes = nil, nil // the device is closed and has freed it
		return nil
	}
	defer d.leave()
	delete(d.host, h)
	p := unsafe.SliceData(h.bytes)
	h.dev, h.bytes = nil, nil
	if p == nil {
		return nil
	}
	if err := call("cuMemFreeHost", d.drv.cuMemFreeHost, uintptr(unsafe.Pointer(p))); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// AllocHost returns n zeroed bytes of page-locked host memory
// (cuMemAllocHost), which CopyIn and CopyOut move by DMA. Close frees it
// if Free has not.
func (d *Device) AllocHost(n int) (accel.HostBuffer, error) {
	if n < 0 {
		return nil, fmt.Errorf("cuda: host alloc of %d bytes", n)
	}
	err := d.enter()
	if err != nil {
		return nil, err
	}
	defer d.leave()
	h := &hostBuffer{dev: d}
	if n > 0 {
		var p unsafe.Pointer
		if err := call("cuMemAllocHost_v2", d.drv.cuMemAllocHost, uintptr(unsafe.Pointer(&p)), uintptr(n)); err != nil {
			return nil, fmt.Errorf("cuda: allocating %d bytes of page-locked host memory: %w", n, err)
		}
		h.bytes = unsafe.Slice((*byte)(p), n)
		clear(h.bytes)
	}
	d.host[h] = struct{}{}
	return h, nil
}

// ptrOf checks s and returns the device address of its first byte.
func (d *Device) ptrOf(what string, s accel.Span, floats bool) (uint64, error) {
	b, ok := s.Buf.(*buffer)
	if !ok || b == nil {
		return 0, fmt.Errorf("cuda: %s: span of a %T, not of a cuda buffer", what, s.Buf)
	}
	if b.dev == nil {
		return 0, fmt.Errorf("cuda: %s: %w", what, accel.ErrFreed)
	}
	if b.dev != d {
		return 0, fmt.Errorf("cuda: %s: buffer of another device", what)
	}
	check := accel.CheckSpan
	if floats {
		check = accel.CheckFloats
	}
	if err := check(what, s, b.n); err != nil {
		return 0, err
	}
	return b.ptr + uint64(s.Off), nil
}

// CopyIn copies src into dst and waits for the copy, except from
// page-locked memory of AllocHost, which the copy reads by DMA after
// CopyIn has returned (see accel.HostAllocator).
func (d *Device) CopyIn(dst accel.Span, src []byte) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	p, err := d.ptrOf("copy-in destination", dst, false)
	if err != nil {
		return err
	}
	if len(src) != dst.Len {
		return fmt.Errorf("cuda: copy-in of %d bytes into a %d-byte span", len(src), dst.Len)
	}
	if len(src) == 0 {
		return nil
	}
	a := &d.args.sys
	a[0], a[1], a[2], a[3] = uintptr(p), d.hostAddr(src), uintptr(len(src)), d.stream
	err = d.sys("cuMemcpyHtoDAsync_v2", d.drv.cuMemcpyHtoDAsync, 4)
	if err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	if d.pageLocked(src) {
		return nil
	}
	return d.sync()
}

// pageLocked reports whether b lies in page-locked memory of AllocHost;
// the caller holds the lock.
func (d *Device) pageLocked(b []byte) bool {
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	for h := range d.host {
		p := uintptr(unsafe.Pointer(unsafe.SliceData(h.bytes)))
		if lo >= p && lo+uintptr(len(b)) <= p+uintptr(len(h.bytes)) {
			return true
		}
	}
	return false
}

// CopyOut copies src into dst and waits for the copy.
func (d *Device) CopyOut(dst []byte, src accel.Span) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	p, err := d.ptrOf("copy-out source", src, false)
	if err != nil {
		return err
	}
	if len(dst) != src.Len {
		return fmt.Errorf("cuda: copy-out of a %d-byte span into %d bytes", src.Len, len(dst))
	}
	if len(dst) == 0 {
		return nil
	}
	a := &d.args.sys
	a[0], a[1], a[2], a[3] = d.hostAddr(dst), uintptr(p), uintptr(len(dst)), d.stream
	if err = d.sys("cuMemcpyDtoHAsync_v2", d.drv.cuMemcpyDtoHAsync, 4); err != nil {
		err = fmt.Errorf("cuda: %w", err)
	} else {
		err = d.sync()
	}
	return err
}

// CopyOutRows copies rows of width bytes from the device span src (row r
// at byte r*srcPitch) to dst (at r*dstPitch) in one cuMemcpy2DAsync, and
// waits for it.
func (d *Device) CopyOutRows(dst []byte, dstPitch int, src accel.Span, srcPitch, width, rows int) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	p, err := d.ptrOf("copy-out-rows source", src, false)
	if err != nil {
		return err
	}
	if err := accel.CheckRows("copy-out-rows", len(dst), dstPitch, src.Len, srcPitch, width, rows); err != nil {
		return err
	}
	if rows == 0 || width == 0 {
		return nil
	}
	d.args.rows = memcpy2D{srcMemoryType: memoryDevice, srcDevice: p, srcPitch: uint64(srcPitch),
		dstMemoryType: memoryHost, dstHost: d.hostAddr(dst), dstPitch: uint64(dstPitch),
		widthInBytes: uint64(width), height: uint64(rows)}
	d.args.sys[0], d.args.sys[1] = uintptr(unsafe.Pointer(&d.args.rows)), d.stream
	err = d.sys("cuMemcpy2DAsync_v2", d.drv.cuMemcpy2DAsync, 2)
	if err == nil {
		err = d.sync()
	}
	if err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// CopyInRows copies rows of width bytes from src (row r at byte
// r*srcPitch) to the device span dst (at r*dstPitch) in one
// cuMemcpy2DAsync, and waits for it unless src is page-locked memory of
// AllocHost (see CopyIn).
func (d *Device) CopyInRows(dst accel.Span, dstPitch int, src []byte, srcPitch, width, rows int) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	p, err := d.ptrOf("copy-in-rows destination", dst, false)
	if err != nil {
		return err
	}
	if err := accel.CheckRows("copy-in-rows", dst.Len, dstPitch, len(src), srcPitch, width, rows); err != nil {
		return err
	}
	if rows == 0 || width == 0 {
		return nil
	}
	d.args.rows = memcpy2D{srcMemoryType: memoryHost, srcHost: d.hostAddr(src), srcPitch: uint64(srcPitch),
		dstMemoryType: memoryDevice, dstDevice: p, dstPitch: uint64(dstPitch),
		widthInBytes: uint64(width), height: uint64(rows)}
	d.args.sys[0], d.args.sys[1] = uintptr(unsafe.Pointer(&d.args.rows)), d.stream
	err = d.sys("cuMemcpy2DAsync_v2", d.drv.cuMemcpy2DAsync, 2)
	if err == nil && !d.pageLocked(src[:(rows-1)*srcPitch+width]) {
		err = d.sync()
	}
	if err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// Copy copies src into dst on the device.
func (d *Device) Copy(dst, src accel.Span) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	q, err := d.ptrOf("copy destination", dst, false)
	if err != nil {
		return err
	}
	p, err := d.ptrOf("copy source", src, false)
	if err != nil {
		return err
	}
	if dst.Len != src.Len {
		return fmt.Errorf("cuda: copy of a %d-byte span into a %d-byte span", src.Len, dst.Len)
	}
	if dst.Len == 0 {
		return nil
	}
	a := &d.args.sys
	a[0], a[1], a[2], a[3] = uintptr(q), uintptr(p), uintptr(dst.Len), d.stream
	if err := d.sys("cuMemcpyDtoDAsync_v2", d.drv.cuMemcpyDtoDAsync, 4); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// Zero clears dst.
func (d *Device) Zero(dst accel.Span) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	p, err := d.ptrOf("zero", dst, false)
	if err != nil {
		return err
	}
	if dst.Len == 0 {
		return nil
	}
	a := &d.args.sys
	a[0], a[1], a[2], a[3] = uintptr(p), 0, uintptr(dst.Len), d.stream
	if err := d.sys("cuMemsetD8Async", d.drv.cuMemsetD8Async, 4); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}
