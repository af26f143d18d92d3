#!/usr/bin/env bash
# test-integrations.sh: the tests of the framework integrations (make
# test-integrations), each a Go module of its own under integrations/:
# gofmt, go vet and go test in integrations/gomlx (GoMLX, pure-Go backend)
# and integrations/gorgonia (a Gorgonia Solver). When Open MPI is installed,
# it also runs the GoMLX MNIST and GPT examples under mpirun on 2 ranks.
#
# GoMLX runs on its pure-Go backend only: the tests import
# github.com/gomlx/compute/gobackend directly and never load XLA, so nothing
# is downloaded at run time. Every run has a timeout.
set -u

GO=${GO:-go}
cd "$(dirname "$0")/.." || exit 1
root=$PWD
export GOMLX_BACKEND=go

fail=0
passed=0
start=$(date +%s%N)

for mod in integrations/gomlx integrations/gorgonia; do
	t0=$(date +%s%N)
	cd "$root/$mod" || exit 1
	out=$(gofmt -l . 2>&1)
	if [ -n "$out" ]; then
		echo "integrations: $mod: gofmt needed:"
		echo "$out"
		fail=$((fail + 1))
	elif ! "$GO" vet ./...; then
		echo "integrations: $mod: go vet FAILED"
		fail=$((fail + 1))
	elif ! timeout -k 10 600 "$GO" test -count=1 -timeout 5m ./...; then
		echo "integrations: $mod: go test FAILED"
		fail=$((fail + 1))
	else
		echo "integrations: $mod ok ($(( ($(date +%s%N) - t0) / 1000000 )) ms, build included)"
		passed=$((passed + 1))
	fi
done
cd "$root" || exit 1

# The GoMLX example under mpirun: it must train both optimizers and print
# its comparison line.
if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1 &&
	pkg-config --exists ompi-c 2>/dev/null; then
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
	# How long mpirun waits before it passes a SIGTERM (or a rank's death) on
	# to the ranks, and again before SIGKILL, as in scripts/lib/netns.sh.
	export OMPI_MCA_odls_base_sigkill_timeout=${OMPI_MCA_odls_base_sigkill_timeout:-3}
	if (cd integrations/gomlx && "$GO" build -tags mpi -o "$tmp/mnist-gomlx" ./examples/mnist); then
		t0=$(date +%s%N)
		timeout -k 10 120 mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 \
			"$tmp/mnist-gomlx" -backend mpi -data examples/mnist/testdata -steps 20 -batch 48 \
			-freeze-step 8 -lr 2e-3 >"$tmp/mpi.log" 2>&1
		rc=$?
		if [ "$rc" -eq 0 ] && grep -q "onebit-adam vs adam" "$tmp/mpi.log"; then
			echo "integrations: GoMLX mnist example under mpirun -np 2 ok ($(( ($(date +%s%N) - t0) / 1000000 )) ms)"
			passed=$((passed + 1))
		else
			echo "integrations: GoMLX mnist example under mpirun -np 2 FAILED (exit $rc):"
			tail -n 30 "$tmp/mpi.log"
			fail=$((fail + 1))
		fi
	else
		echo "integrations: building the GoMLX mnist example with -tags mpi failed"
		fail=$((fail + 1))
	fi
	# The GPT example: a tiny model, Adam then 1-bit Adam, 2 ranks.
	if (cd integrations/gomlx && "$GO" build -tags mpi -o "$tmp/gpt" ./examples/gpt); then
		t0=$(date +%s%N)
		GOROOT=$("$GO" env GOROOT) timeout -k 10 120 mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 \
			"$tmp/gpt" -backend mpi -compare -optimizer onebit-adam -steps 20 -d-model 32 -heads 2 -ffn 64 \
			-context 32 -batch 8 -max-bytes 1Mi -quiet -json "$tmp/gpt.json" >"$tmp/gpt.log" 2>&1
		rc=$?
		if [ "$rc" -eq 0 ] && grep -q "onebit-adam vs adam" "$tmp/gpt.log" && [ "$(grep -c '"optimizer"' "$tmp/gpt.json")" = 2 ]; then
			echo "integrations: GoMLX gpt example under mpirun -np 2 ok ($(( ($(date +%s%N) - t0) / 1000000 )) ms)"
			passed=$((passed + 1))
		else
			echo "integrations: GoMLX gpt example under mpirun -np 2 FAILED (exit $rc):"
			tail -n 30 "$tmp/gpt.log"
			fail=$((fail + 1))
		fi
	else
		echo "integrations: building the GoMLX gpt example with -tags mpi failed"
		fail=$((fail + 1))
	fi
else
	echo "integrations: GoMLX example under mpirun skipped: Open MPI not installed"
fi

echo "integration tests took $(( ($(date +%s%N) - start) / 1000000000 )) s"
echo "integrations: $passed passed, $fail failed"
[ "$fail" -eq 0 ]
