# lowbit: make demo runs the main job, make test runs every test this machine can run.
GO      ?= go
FUZZTIME ?= 10s

.PHONY: gpu-check all build test test-unit test-race test-mpi test-integrations conformance bench bench-net bench-mpi-allreduce lint fuzz demo demo-net demo-gpt demo-gpt-net demo-gpt-rates plan-vs-one plot-bytes mnist-data ptx soak soak-elastic cluster-hostfile

all: build

build:
	$(GO) build ./...

## test: lint (gofmt, go vet, a 32-bit build of the library: 32-bit
## ints and the portable kernels, staticcheck), unit tests, race tests of the concurrent
## packages, the conformance check through the CLI, and the multi-process
## MPI tests.
test: lint test-unit test-race conformance test-mpi test-integrations

test-unit:
	$(GO) test -count=1 -timeout 10m ./...

## test-race runs with -short: the race detector is there for the
## concurrent code, and the long single-threaded cases (kernels on
## millions of elements, the convergence runs, the largest pipelined
## buffers) have run in test-unit without it.
test-race:
	$(GO) test -race -short -count=1 -timeout 10m ./comm/... ./onebit/... ./optim/... ./errorfeedback/... ./signpack/... ./quant/...

conformance:
	$(GO) run ./cmd/lowbit conformance internal/conformance/testdata

test-mpi:
	./scripts/test-mpi.sh

## test-integrations: the GoMLX and Gorgonia integrations, modules of their
## own under integrations/ (see scripts/test-integrations.sh).
test-integrations:
	./scripts/test-integrations.sh

bench:
	$(GO) test -run '^$$' -bench . -benchmem -timeout 30m ./signpack ./errorfeedback ./onebit ./optim ./optim/zero ./quant

bench-net:
	./scripts/bench-net.sh

bench-mpi-allreduce:
	./scripts/mpi-allreduce-bench.sh

## lint: gofmt, go vet, a 32-bit build of the library (32-bit ints and the
## portable kernels) and staticcheck, pinned to STATICCHECK_VERSION, over
## the root module in each build configuration and the integration modules
## (scripts/staticcheck.sh; go install fetches it through the module proxy
## where it is missing).
STATICCHECK_VERSION ?= v0.8.2

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	GOARCH=386 CGO_ENABLED=0 $(GO) build ./signpack ./errorfeedback ./quant ./onebit ./outer ./optim/... ./comm/... ./accel/...
	GO=$(GO) STATICCHECK_VERSION=$(STATICCHECK_VERSION) ./scripts/staticcheck.sh

fuzz:
	./scripts/fuzz.sh $(FUZZTIME)

## demo: data-parallel MNIST on 4 in-process workers, Adam vs 1-bit Adam,
## plot in out/mnist.png. Fetches the data first if it is missing.
demo: mnist-data
	$(GO) run ./examples/mnist -compare -optimizer onebit-adam -workers 4 -plot out/mnist.png

## demo-net: the MNIST comparison (Adam vs 1-bit Adam, 4 MPI ranks) on a
## loopback shaped to 1 Gbit in a network namespace; prints time to 97% and
## wall time of both. Needs root and Open MPI.
demo-net: mnist-data
	./scripts/demo-net.sh

## cluster-hostfile: the Open MPI hostfile recipe of docs/cluster.md on two
## "machines" (network namespaces joined by a veth pair): the MNIST example
## on its test set across both, then machine B lost, then the job resumed
## on machine A alone. Needs root and Open MPI; about 15 s.
cluster-hostfile:
	./scripts/cluster-hostfile.sh

## demo-gpt: the GoMLX GPT example's convergence table (integrations/gomlx/
## examples/gpt): Adam, 1-bit Adam in its state modes (compact, sharded,
## sharded bf16), 0/1 Adam, LAMB, 1-bit LAMB (and compact), zero-adam int8
## and int4, Adam with fp16 and bf16 averaging, the outer optimizer with fp32,
## int8, 1-bit and sparse pseudo-gradients, 4 in-process ranks, same seed and tokens;
## out/gpt.md (the table), out/gpt.json, out/gpt.svg.
demo-gpt:
	cd integrations/gomlx && GOMLX_BACKEND=go $(GO) run ./examples/gpt \
	  -optimizer adam,onebit-adam,onebit-adam-compact,onebit-adam-sharded,onebit-adam-sharded-bf16,zeroone-adam,lamb,onebit-lamb,onebit-lamb-compact,zero-adam:int8,zero-adam:int4,adam:fp16,adam:bf16,diloco:fp32,diloco:int8,diloco:1bit,diloco:sparse \
	  -json ../../out/gpt.json -plot ../../out/gpt.svg -markdown ../../out/gpt.md

## plot-bytes: loss against the bytes each rank sent, every optimizer at
## its defaults, 4 in-process ranks, one curve per optimizer and codec:
## the GPT example's validation loss (demo-gpt's runs, Muon and 1-bit
## Muon) in $(PLOT_BYTES_OUT)/gpt-bytes.svg, beside gpt.svg (against
## tokens), gpt.json and gpt.md (the bytes at each evaluation), and the
## MNIST example's test loss and accuracy (every optimizer) in
## $(PLOT_BYTES_OUT)/mnist-bytes.png, beside mnist.png. Fetches the MNIST
## data first if it is missing. Long: the GPT runs take minutes each.
## GPT_BYTES_RUNS and MNIST_BYTES_RUNS pick the runs, GPT_BYTES_FLAGS and
## MNIST_BYTES_FLAGS add flags (docs/measured.md, "Loss against bytes
## sent", has a short run).
PLOT_BYTES_OUT    ?= out/bytes
GPT_BYTES_RUNS    ?= adam,onebit-adam,onebit-adam-compact,onebit-adam-sharded,onebit-adam-sharded-bf16,zeroone-adam,lamb,onebit-lamb,onebit-lamb-compact,zero-adam:int8,zero-adam:int4,adam:fp16,adam:bf16,diloco:fp32,diloco:int8,diloco:1bit,diloco:sparse,muon,onebit-muon
MNIST_BYTES_RUNS  ?= adam,onebit-adam,onebit-adam-compact,onebit-adam-sharded,onebit-adam-sharded-bf16,zeroone-adam,zero-adam,lamb,onebit-lamb,onebit-lamb-compact,diloco,muon,onebit-muon
GPT_BYTES_FLAGS   ?=
MNIST_BYTES_FLAGS ?=
plot-bytes: mnist-data
	$(GO) run ./examples/mnist -optimizer $(MNIST_BYTES_RUNS) -workers 4 -quiet \
	  -plot $(PLOT_BYTES_OUT)/mnist.png $(MNIST_BYTES_FLAGS)
	cd integrations/gomlx && GOMLX_BACKEND=go $(GO) run ./examples/gpt -optimizer $(GPT_BYTES_RUNS) -quiet \
	  -json $(abspath $(PLOT_BYTES_OUT))/gpt.json -plot $(abspath $(PLOT_BYTES_OUT))/gpt.svg \
	  -markdown $(abspath $(PLOT_BYTES_OUT))/gpt.md $(GPT_BYTES_FLAGS)

## demo-gpt-net: the GPT example on 4 MPI ranks over a loopback shaped to
## RATE (40mbit): time to the target validation loss of Adam, 1-bit Adam
## (also sharded), 0/1 Adam, Muon and 1-bit Muon (OPTIMIZERS picks). Needs
## root and Open MPI; about 20 minutes.
demo-gpt-net:
	./scripts/demo-gpt-net.sh

mnist-data:
	./scripts/mnist-data.sh

## soak: the chaos soak (scripts/soak.sh): MNIST under mpirun on 4 ranks in
## a network namespace with an impaired loopback, killed, preempted and its
## checkpoints damaged at random steps from SEED, resumed until done; every
## final hash must match an uninterrupted run's. SOAK_S (600), SEED, NETEM.
## Needs root and Open MPI. (make test runs its short form, test-mpi.)
soak: mnist-data
	./scripts/soak.sh

## soak-elastic: the elastic soak (scripts/soak-elastic.sh): MNIST under
## mpirun in the impaired namespace, killed, preempted and its checkpoints
## damaged at random steps from SEED, each time resumed on a number of
## ranks drawn from SEED (2 to 6), for every optimizer and mode with a
## checkpoint (1-bit Adam's modes, 1-bit LAMB, 0/1 Adam, zero-adam, 1-bit
## Muon's modes, the outer optimizer with the 1-bit and sparse codecs,
## AdamW and Muon inside); each resume must continue from the newest step
## every old rank held, name its path and pass the example's carried-state
## check; a table of faults, sizes, steps redone, seconds per fault,
## goodput and final accuracy against uninterrupted runs. SOAK_S (600),
## SEED, OPTIMIZERS, INTERRUPTS (22). Needs root and Open MPI. (make test
## runs its short form, test-mpi.)
soak-elastic: mnist-data
	./scripts/soak-elastic.sh

## demo-gpt-rates: time to target of the GPT example on 4 MPI ranks over
## loopbacks shaped to 1 Mbit/s (the outer optimizer's rows only), 10 Mbit/s,
## 100 Mbit/s and 1 Gbit/s: Adam, Adam bf16, 1-bit Adam, 0/1 Adam and the
## outer optimizer with fp32, int8, 1-bit and sparse pseudo-gradients (each
## codec at its defaults), with lowbit plan's step time beside the measured
## one (root, Open MPI; about an hour and a half).
demo-gpt-rates:
	./scripts/demo-gpt-rates.sh

## plan-vs-one: two machines against one, measured: the MNIST example on one
## rank and on 2 MPI ranks over a loopback shaped to 50 Mbit/s, Adam and
## 1-bit Adam, beside lowbit plan --vs-one (docs/plan.md; root, Open MPI;
## about three minutes).
plan-vs-one:
	./scripts/vs-one.sh

## gpu-check: everything that needs an NVIDIA GPU (tests, benchmarks against
## the device copy, lowbit bench --device cuda, compute-sanitizer), with a
## report in gpu-report.txt; one line and exit 0 without a GPU.
gpu-check:
	scripts/gpu-check.sh all

## ptx: rebuild the committed PTX of the CUDA kernels (accel/cuda) from
## their .cu sources with Debian's clang (apt-get install clang-14); no
## CUDA toolkit needed. The PTX is embedded in the Go package.
CLANG_CUDA ?= clang-14
CUDA_ARCH  ?= sm_80
ptx: accel/cuda/lowbit.ptx

accel/cuda/lowbit.ptx: accel/cuda/kernels/lowbit.cu
	$(CLANG_CUDA) --cuda-device-only -nocudainc -nocudalib --cuda-gpu-arch=$(CUDA_ARCH) \
	  -Xclang -target-feature -Xclang +ptx70 -S -O3 -o $@ $<
