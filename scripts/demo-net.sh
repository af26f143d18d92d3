#!/usr/bin/env bash
# demo-net.sh: the MNIST comparison, Adam against 1-bit Adam, on NP MPI
# ranks that talk over a slow network (make demo-net). It prints each
# optimizer's time to TARGET test accuracy and training wall time, and the
# speedups of 1-bit Adam: on a slow link, time to accuracy is what
# compression buys.
#
# The slow network is a network namespace whose loopback is shaped by a
# token bucket (the spec page bench.md, "Bandwidth-limited runs"): every rank
# runs inside it and talks over TCP on lo, so the qdisc caps the total
# traffic of all ranks at RATE. scripts/lib/netns.sh makes the namespace
# (lowbit-demo-PID-N: no collision with another script's) and deletes it on
# every exit, also on failure or interruption.
#
# Needs root (for the namespace and the qdisc), Open MPI (mpirun, and the
# headers of libopenmpi-dev: the example is built with -tags mpi), ip and tc
# from iproute2, and the MNIST files in DATA (make mnist-data fetches them;
# make demo-net does that first).
#
# Settings (environment): RATE (1gbit), NP (4), DATA (data/mnist), TARGET
# (0.97), MNIST_FLAGS (extra flags for examples/mnist, e.g. "-epochs 3"),
# TIMEOUT (1200: seconds before a stuck run is stopped), BF16 (1: a third
# run, Adam with the bf16 down-cast allreduce, the 16-bit exact baseline
# beside the float32 one; 0 leaves it out), GO (go). The whole
# run takes about 4 minutes on a loaded 2-core machine: Adam's exact
# allreduces dominate.
set -euo pipefail

RATE=${RATE:-1gbit}
NP=${NP:-4}
DATA=${DATA:-data/mnist}
TARGET=${TARGET:-0.97}
MNIST_FLAGS=${MNIST_FLAGS:-}
BF16=${BF16:-1}
TIMEOUT=${TIMEOUT:-1200}
GO=${GO:-go}

. "$(dirname "$0")/lib/netns.sh"
netns_init demo-net
netns_require_root "it creates a network namespace and a tc qdisc (run: sudo make demo-net)"
netns_require_mpi headers
command -v timeout >/dev/null || netns_die "cannot run: timeout not found (coreutils)"

root=$(cd "$(dirname "$0")/.." && pwd)
case $DATA in /*) ;; *) DATA=$root/$DATA ;; esac
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
	[ -f "$DATA/$f" ] || netns_die "cannot run: $DATA/$f missing; fetch MNIST first (make mnist-data)"
done

echo "demo-net: building examples/mnist with -tags mpi"
(cd "$root" && "$GO" build -tags mpi -o "$NETNS_TMP/mnist" ./examples/mnist)

netns_new ns demo
echo "demo-net: network namespace $ns, loopback shaped: tbf $(netns_tbf "$RATE")"
netns_shape "$ns" lo "$RATE"

echo "demo-net: $NP MPI ranks over TCP on the shaped loopback: Adam, then 1-bit Adam from the same seed"
rc=0
# shellcheck disable=SC2086 # MNIST_FLAGS is a list of flags
netns_run ip netns exec "$ns" timeout --kill-after=30 "$TIMEOUT" "${NETNS_MPIRUN[@]}" -np "$NP" "${NETNS_MPI_LO[@]}" \
	"$NETNS_TMP/mnist" -backend mpi -compare -optimizer onebit-adam -data "$DATA" -target "$TARGET" -quiet $MNIST_FLAGS \
	>"$NETNS_TMP/mnist.out" 2>&1 || rc=$?
: >"$NETNS_TMP/mnist-bf16.out"
if [ "$rc" -eq 0 ] && [ "$BF16" = 1 ]; then
	echo "demo-net: the same ranks and link: Adam with the bf16 down-cast allreduce (-reduce bf16), the 16-bit exact baseline"
	# shellcheck disable=SC2086 # MNIST_FLAGS is a list of flags
	netns_run ip netns exec "$ns" timeout --kill-after=30 "$TIMEOUT" "${NETNS_MPIRUN[@]}" -np "$NP" "${NETNS_MPI_LO[@]}" \
		"$NETNS_TMP/mnist" -backend mpi -optimizer adam -reduce bf16 -data "$DATA" -target "$TARGET" -quiet $MNIST_FLAGS \
		>"$NETNS_TMP/mnist-bf16.out" 2>&1 || rc=$?
fi
netns_del "$ns"
cat "$NETNS_TMP/mnist.out" "$NETNS_TMP/mnist-bf16.out"
[ "$rc" -ne 124 ] || netns_die "the MNIST run took more than TIMEOUT=$TIMEOUT s and was stopped"
[ "$rc" -eq 0 ] || netns_die "the MNIST run failed (exit $rc)"

# The example's table: "optimizer test-acc loss TT (step S) wall compute comm
# compress sent", where TT is "-" when the target was not reached.
awk -v rate="$RATE" -v np="$NP" -v target="$TARGET" '
	function sec(s) { sub(/s$/, "", s); return s + 0 }
	/^ *optimizer +test acc/ { table = 1; next }
	table && NF == 0 { table = 0 }
	FNR == 1 { table = 0 }
	table && ($1 == "adam" || $1 == "onebit-adam") {
		name = FILENAME ~ /-bf16\.out$/ ? "adam-bf16" : $1
		if ($4 == "-") { tt[name] = -1; i = 5 } else { tt[name] = sec($4); step[name] = $6; sub(/\)$/, "", step[name]); i = 7 }
		wall[name] = sec($i); comm[name] = sec($(i + 2)); sent[name] = $(i + 4) " " $(i + 5)
		acc[name] = $2
	}
	END {
		if (!("adam" in wall) || !("onebit-adam" in wall)) { print "demo-net: could not read the results table" > "/dev/stderr"; exit 1 }
		printf "\ndemo-net: MNIST, %d MPI ranks, loopback shaped to %s (all ranks share it)\n", np, rate
		printf "%-12s %10s %8s %13s %9s %9s %12s\n", "optimizer", "test acc", "step", "to " 100 * target "%", "wall", "comm", "sent/worker"
		for (k = 1; k <= 3; k++) {
			n = k == 1 ? "adam" : k == 2 ? "adam-bf16" : "onebit-adam"
			if (!(n in wall)) continue
			t = tt[n] < 0 ? "not reached" : sprintf("%.1fs", tt[n])
			st = tt[n] < 0 ? "-" : step[n]
			printf "%-12s %10s %8s %13s %8.1fs %8.1fs %12s\n", n, acc[n], st, t, wall[n], comm[n], sent[n]
		}
		printf "1-bit Adam vs Adam: wall time %.2fx faster", wall["adam"] / wall["onebit-adam"]
		if (tt["adam"] > 0 && tt["onebit-adam"] > 0) {
			s = tt["adam"] / tt["onebit-adam"]
			verdict = s >= 2.5 ? "met" : "MISSED"
			printf ", time to %g%% %.2fx faster (goal: 2.5x, %s)\n", 100 * target, s, verdict
		} else {
			printf "; time to %g%%: not reached by both, no ratio\n", 100 * target
		}
		if ("adam-bf16" in wall) {
			printf "1-bit Adam vs Adam bf16 (the 16-bit exact baseline): wall time %.2fx faster", wall["adam-bf16"] / wall["onebit-adam"]
			if (tt["adam-bf16"] > 0 && tt["onebit-adam"] > 0) printf ", time to %g%% %.2fx faster\n", 100 * target, tt["adam-bf16"] / tt["onebit-adam"]
			else printf "; time to %g%%: not reached by both, no ratio\n", 100 * target
		}
	}' "$NETNS_TMP/mnist.out" "$NETNS_TMP/mnist-bf16.out"
