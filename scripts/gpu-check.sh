#!/usr/bin/env bash
# gpu-check.sh: everything in lowbit that needs an NVIDIA GPU, in one
# command, with a report.
#
#   scripts/gpu-check.sh [build|run|all] [REPORT]
#
#   build  (where Go is) builds what the check runs into gpubin/: the
#          accel/cuda test binary cross-compiled with CGO_ENABLED=0, the
#          same with cgo (so that NVML's device listing runs too) and the
#          lowbit command. Run it from the repository's root.
#   run    (on the GPU machine, which needs no Go) runs them from the
#          repository's root and writes the report to REPORT (default
#          gpu-report.txt) as well as to standard output: the GPU and its
#          driver, every GPU test of accel/cuda (kernels against the CPU
#          device, the device allreduce against the host one for 1, 3 and 4
#          ranks, the onebit conformance vectors through
#          onebit.AllReduceDevice, out of device memory, NVML's listing),
#          the benchmarks CompressVsCopy, KernelsVsCopy, StepDeviceVsCopy and
#          StagingVsCopy
#          (each against a device-to-device copy timed in the same run), and
#          lowbit bench's 1-bit allreduce on 4 ranks with --device cuda,
#          --device cpu and host buffers in one table each, run one after the
#          other; then compute-sanitizer's memcheck and racecheck over the
#          kernel tests where the tool is there.
#   all    (the default) builds where Go is, then runs.
#
# Without a GPU (no nvidia-smi, or it lists none) it says so in one line
# and exits 0. Otherwise it exits non-zero when a test failed; the report
# says which. GPU_CHECK_BENCHTIME (default 20x) sets -test.benchtime.
set -uo pipefail

mode=${1:-all}
report=${2:-gpu-report.txt}
bin=gpubin
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1

build() {
	command -v go >/dev/null || { echo "gpu-check: no Go toolchain here; build gpubin/ where Go is (scripts/gpu-check.sh build)" >&2; return 1; }
	mkdir -p "$bin"
	CGO_ENABLED=0 go test -c -ldflags=-s -o "$bin/cuda.test" ./accel/cuda &&
		CGO_ENABLED=1 go test -c -ldflags=-s -o "$bin/cuda-cgo.test" ./accel/cuda &&
		CGO_ENABLED=0 go build -ldflags=-s -o "$bin/lowbit" ./cmd/lowbit &&
		echo "$(git describe --always --dirty 2>/dev/null || echo unknown) built $(date -u +%FT%TZ)" >"$bin/VERSION"
}

run() {
	if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
		echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none); nothing to check"
		return 0
	fi
	for f in cuda.test cuda-cgo.test lowbit; do
		[ -x "$bin/$f" ] || { echo "gpu-check: $bin/$f is missing: run scripts/gpu-check.sh build where Go is" >&2; return 1; }
	done
	local fail=0 bt=${GPU_CHECK_BENCHTIME:-20x} abs
	# The driver library may sit outside the loader's default path.
	[ -d /usr/local/nvidia/lib64 ] && export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/nvidia/lib64
	abs=$(pwd)/$bin
	exec > >(tee "$report") 2>&1
	echo "== gpu-check $(date -u +%FT%TZ), binaries of $(cat "$bin/VERSION" 2>/dev/null || echo 'an unknown build')"
	nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm,clocks.max.mem --format=csv
	echo "== tests: accel/cuda without cgo"
	# The tests read the conformance vectors relative to accel/cuda.
	(cd accel/cuda && "$abs/cuda.test" -test.v -test.count 1 -test.run 'GPU|EmbeddedPTX|OpenNoDriver') || fail=1
	echo "== tests: accel/cuda with cgo (NVML)"
	(cd accel/cuda && "$abs/cuda-cgo.test" -test.v -test.count 1 -test.run 'Devices|GPUOutOfMemory') || fail=1
	echo "== benchmarks (each against a device-to-device copy in the same run)"
	(cd accel/cuda && "$abs/cuda.test" -test.run '^$' -test.bench 'CompressVsCopy|KernelsVsCopy|StepDeviceVsCopy|StagingVsCopy' -test.benchtime "$bt") || fail=1
	echo "== lowbit bench: 1-bit allreduce, 4 local ranks, 64 MiB per rank: device buffers (cuda), the device path on host memory (cpu), host buffers"
	for dev in cuda cpu ""; do
		echo "-- --device ${dev:-(host buffers)}"
		"$abs/lowbit" bench --ranks 4 --collective allreduce,onebit --b 64Mi --e 64Mi --w 3 --n 20 ${dev:+--device $dev} || fail=1
	done
	if command -v compute-sanitizer >/dev/null; then
		for tool in memcheck racecheck; do
			echo "== compute-sanitizer --tool $tool: TestGPUKernels"
			(cd accel/cuda && timeout 90 compute-sanitizer --tool "$tool" --error-exitcode 3 "$abs/cuda.test" -test.count 1 -test.run 'GPUKernels') | tail -n 15 || fail=1
		done
	fi
	if [ "$fail" = 0 ]; then echo "== gpu-check: passed"; else echo "== gpu-check: FAILED (see above)"; fi
	return $fail
}

case $mode in
build) build ;;
run) run ;;
all)
	if command -v go >/dev/null; then build || exit 1; fi
	run
	;;
*)
	echo "usage: scripts/gpu-check.sh [build|run|all] [REPORT]" >&2
	exit 2
	;;
esac
