package main

// lowbit bench --device: the onebit collective with its tensor and error
// state on a device (onebit.AllReduceDevice) instead of in host memory.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"unsafe"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/accel/cuda"
	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
)

// benchDevices are the values of --device: cuda is a GPU (the one of the
// process's local rank); cpu runs the same device code path on host memory
// through accel.CPU.
var benchDevices = []string{"cuda", "cpu"}

const deviceFlagHelp = "run onebit with device-resident buffers (onebit.AllReduceDevice): cuda or cpu (default: host buffers, onebit.AllReduce); the other collectives stay in host memory"

// checkDeviceFlag validates --device against the collectives.
func checkDeviceFlag(cfg *benchConfig) error {
	if cfg.device == "" {
		return nil
	}
	if !slices.Contains(benchDevices, cfg.device) {
		return fmt.Errorf("unknown --device %q (want cuda or cpu)", cfg.device)
	}
	if !slices.Contains(cfg.collectives, "onebit") {
		return fmt.Errorf("--device %s applies to the onebit collective, which --collective does not include", cfg.device)
	}
	return nil
}

// openBenchDevice opens the device named by --device.
func openBenchDevice(name string) (accel.Device, error) {
	switch name {
	case "cuda":
		d, err := cuda.Open()
		if err != nil {
			return nil, fmt.Errorf("--device cuda: %w", err)
		}
		return d, nil
	case "cpu":
		return accel.NewCPU(), nil
	}
	return nil, fmt.Errorf("unknown device %q", name)
}

// newDeviceBenchCase is the onebit case on a device: the input and the
// tensor live on the device, prepare restores the tensor with a
// device-to-device copy, and only the packed signs and scales cross to
// the host.
func newDeviceBenchCase(device string, c comm.Comm, elems int) (bc *benchCase, err error) {
	w, rank := c.Size(), c.Rank()
	dev, err := openBenchDevice(device)
	if err != nil {
		return nil, err
	}
	var bufs []accel.Buffer
	var st *onebit.DeviceState
	release := func() error {
		var errs []error
		if st != nil {
			errs = append(errs, st.Close())
		}
		for _, b := range bufs {
			errs = append(errs, b.Free())
		}
		return errors.Join(append(errs, dev.Close())...)
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, release())
		}
	}()
	alloc := func() (accel.Span, error) {
		b, err := dev.Alloc(4 * elems)
		if err != nil {
			return accel.Span{}, err
		}
		bufs = append(bufs, b)
		return accel.Whole(b), nil
	}
	input, err := alloc()
	if err != nil {
		return nil, err
	}
	buf, err := alloc()
	if err != nil {
		return nil, err
	}
	host := make([]float32, elems)
	fillInput(host, rank, 0)
	if err := dev.CopyIn(input, hostBytes(host)); err != nil {
		return nil, err
	}
	st, err = onebit.NewDeviceState(dev, elems, w)
	if err != nil {
		return nil, err
	}
	var prepErr error // prepare cannot fail; its error comes out of the next run
	restore := func() error {
		if err := dev.Copy(buf, input); err != nil {
			return err
		}
		return dev.Synchronize()
	}
	bc = &benchCase{
		elems:   elems,
		prepare: func() { prepErr = restore() },
		run: func(ctx context.Context) error {
			if prepErr != nil {
				return prepErr
			}
			return onebit.AllReduceDevice(ctx, c, buf, st)
		},
		// As the host case: the mean of onebitCheckCalls calls from zeroed
		// error buffers.
		checkRun: func(ctx context.Context) error {
			if err := st.Reset(); err != nil {
				return err
			}
			sum := make([]float32, elems)
			for range onebitCheckCalls {
				if err := restore(); err != nil {
					return err
				}
				if err := onebit.AllReduceDevice(ctx, c, buf, st); err != nil {
					return err
				}
				if err := dev.CopyOut(hostBytes(host), buf); err != nil {
					return err
				}
				addTo(sum, host)
			}
			meanOf(host, sum, onebitCheckCalls)
			return nil
		},
		check: func() (float64, float64) {
			return sqDist(host, func(i int) float64 { return meanInput(w, i) })
		},
		close: release,
	}
	return bc, nil
}

// hostBytes is the memory of p as bytes.
func hostBytes(p []float32) []byte {
	if len(p) == 0 {
		return []byte{}
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&p[0])), 4*len(p))
}
