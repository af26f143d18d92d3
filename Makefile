# lowbit: make demo runs the main job, make test runs every test this machine can run.
GO      ?= go
FUZZTIME ?= 10s

.PHONY: all build test test-unit test-race test-mpi conformance bench bench-net lint fuzz demo mnist-data

all: build

build:
	$(GO) build ./...

## test: lint, unit tests, race tests of the concurrent packages, the
## conformance check through the CLI, and the multi-process MPI tests.
test: lint test-unit test-race conformance test-mpi

test-unit:
	$(GO) test -count=1 -timeout 10m ./...

test-race:
	$(GO) test -race -count=1 -timeout 10m ./comm/... ./onebit/... ./optim/... ./errorfeedback/... ./signpack/...

conformance:
	$(GO) run ./cmd/lowbit conformance internal/conformance/testdata

test-mpi:
	./scripts/test-mpi.sh

bench:
	$(GO) test -run '^$$' -bench . -benchmem -timeout 30m ./signpack ./errorfeedback ./onebit ./optim

bench-net:
	./scripts/bench-net.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

fuzz:
	./scripts/fuzz.sh $(FUZZTIME)

## demo: data-parallel MNIST on 4 in-process workers, Adam vs 1-bit Adam,
## plot in out/mnist.png. Fetches the data first if it is missing.
demo: mnist-data
	$(GO) run ./examples/mnist -compare -optimizer onebit-adam -workers 4 -plot out/mnist.png

mnist-data:
	./scripts/mnist-data.sh
