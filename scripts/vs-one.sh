#!/usr/bin/env bash
# vs-one.sh: two machines against one, measured (docs/plan.md, "Two
# machines against one, measured"): the MNIST example's examples per
# second on one rank and on two MPI ranks over a shaped link, with Adam
# (exact float32 allreduce) and 1-bit Adam, beside what lowbit plan
# --vs-one predicts from the one-rank step measured in the same run.
#
# One machine: a rank training alone (-backend local -workers 1, -batch
# BATCH), measured while a second one trains alone beside it, so that it
# shares the machine's CPUs as each of the two MPI ranks does (a rank
# with nothing of ours beside it is timed too, and printed for reference). Two
# machines: 2 MPI ranks (-batch 2*BATCH, BATCH per worker) in a network
# namespace whose loopback is shaped to RATE by a token bucket with a small
# burst (BURST, MTU 1500): the two ranks' bytes share it, as lowbit plan
# --sharing shared has it. Adam, then 1-bit Adam from the same seed, with
# -freeze-step FREEZE exact steps first (the prediction counts them).
# Every process runs with GOMAXPROCS=1: a machine is a core. ROUNDS rounds,
# each both cases; the medians are compared.
#
# Settings (environment): RATE (50mbit), BURST (4kb), BATCH (128), EPOCHS
# (40: steps of the two ranks, one a pass over the 500 images of DATA),
# FREEZE (1), ROUNDS (5), DATA (examples/mnist/testdata), GO (go).
# Needs root (the namespace and the qdisc), Open MPI (mpirun and the
# headers: the example is built with -tags mpi), ip and tc. About three
# minutes on a 2-core machine.
set -euo pipefail

RATE=${RATE:-50mbit}
BURST=${BURST:-4kb}
BATCH=${BATCH:-128}
EPOCHS=${EPOCHS:-40}
FREEZE=${FREEZE:-1}
ROUNDS=${ROUNDS:-5}
GO=${GO:-go}

. "$(dirname "$0")/lib/netns.sh"
netns_init vs-one
netns_require_root "it creates a network namespace and a tc qdisc"
netns_require_mpi headers
root=$(cd "$(dirname "$0")/.." && pwd)
DATA=${DATA:-$root/examples/mnist/testdata}

echo "vs-one: building examples/mnist with -tags mpi, and lowbit"
(cd "$root" && "$GO" build -tags mpi -o "$NETNS_TMP/mnist" ./examples/mnist && "$GO" build -o "$NETNS_TMP/lowbit" ./cmd/lowbit)
export GOMAXPROCS=1
common=(-data "$DATA" -epochs "$EPOCHS" -evals 1 -quiet -seed 1)

# own FILE OPT prints OPT's compute and update per step (compute +
# compress, ms: a step without its communication) from the same table.
own() {
	awk -v o="$2" '/^per step and worker/ { t = 1; next }
		t && $1 == o { c = $5; p = $7; gsub(/ms/, "", c); gsub(/ms/, "", p); print c + p; exit }' "$1"
}

# perstep FILE OPT prints OPT's steps and mean step (compute + comm +
# compress, ms) from the example's "per step and worker" table in FILE.
perstep() {
	awk -v o="$2" '/^per step and worker/ { t = 1; next }
		t && $1 == o { c = $5; m = $6; p = $7; gsub(/ms/, "", c); gsub(/ms/, "", m); gsub(/ms/, "", p); print $2, c + m + p; exit }' "$1"
}

netns_new ns vsone
ip -n "$ns" link set dev lo mtu 1500
NETNS_TBF="burst $BURST latency 1s" netns_shape "$ns" lo "$RATE"
echo "vs-one: loopback of $ns shaped: tbf rate $RATE burst $BURST latency 1s, MTU 1500"

for r in $(seq 1 "$ROUNDS"); do
	"$NETNS_TMP/mnist" -backend local -workers 1 -optimizer adam -batch "$BATCH" "${common[@]}" >"$NETNS_TMP/alone-$r.out" 2>&1
	echo "vs-one: round $r: one rank alone: $(perstep "$NETNS_TMP/alone-$r.out" adam | awk '{ printf "%d steps, %.2f ms a step", $1, $2 }')"
	for k in a b; do
		"$NETNS_TMP/mnist" -backend local -workers 1 -optimizer adam -batch "$BATCH" "${common[@]}" >"$NETNS_TMP/one-$r$k.out" 2>&1 &
	done
	wait
	netns_run ip netns exec "$ns" timeout --kill-after=30 600 "${NETNS_MPIRUN[@]}" -np 2 -x GOMAXPROCS "${NETNS_MPI_LO[@]}" \
		"$NETNS_TMP/mnist" -backend mpi -optimizer adam,onebit-adam -freeze-step "$FREEZE" -batch $((2 * BATCH)) "${common[@]}" \
		>"$NETNS_TMP/two-$r.out" 2>&1 || netns_die "round $r: the 2-rank run failed: $(tail -5 "$NETNS_TMP/two-$r.out")"
	for k in a b; do
		echo "vs-one: round $r: one rank ($k): $(perstep "$NETNS_TMP/one-$r$k.out" adam | awk '{ printf "%d steps, %.2f ms a step", $1, $2 }')"
	done
	for o in adam onebit-adam; do
		echo "vs-one: round $r: two ranks, $o: $(perstep "$NETNS_TMP/two-$r.out" $o | awk '{ printf "%d steps, %.2f ms a step", $1, $2 }')"
	done
done

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
one=$(for f in "$NETNS_TMP"/one-*.out; do perstep "$f" adam | awk '{ print $2 }'; done | median)
alone=$(for f in "$NETNS_TMP"/alone-*.out; do perstep "$f" adam | awk '{ print $2 }'; done | median)
steps=$(perstep "$NETNS_TMP/two-1.out" adam | awk '{ print $1 }')
two_adam=$(for f in "$NETNS_TMP"/two-*.out; do perstep "$f" adam | awk '{ print $2 }'; done | median)
two_onebit=$(for f in "$NETNS_TMP"/two-*.out; do perstep "$f" onebit-adam | awk '{ print $2 }'; done | median)
own_adam=$(for f in "$NETNS_TMP"/two-*.out; do own "$f" adam; done | median)
own_onebit=$(for f in "$NETNS_TMP"/two-*.out; do own "$f" onebit-adam; done | median)

params=$((784 * 256 + 256 + 256 * 10 + 10))
plan=(--params "$params" --ranks 2 --link "$RATE" --sharing shared --collective allreduce,onebit
	--vs-one --tokens-per-step "$BATCH" --step-compute "${one}ms")
echo
echo "vs-one: lowbit plan ${plan[*]}"
"$NETNS_TMP/lowbit" plan "${plan[@]}" | sed -n '1,/^pick:/p'
# The plan's step of each row (ms), from its JSON.
planstep() {
	"$NETNS_TMP/lowbit" plan "${plan[@]}" --json | awk -v c="$1" '
		/"vs_one"/ { v = 1 }
		v && /"collective":/ { n = $2; gsub(/[",]/, "", n) }
		v && n == c && /"step_s":/ { s = $2; gsub(/,/, "", s); printf "%.4f\n", s * 1000; exit }'
}
plan_adam=$(planstep allreduce)
plan_onebit1=$(planstep onebit)
# The plan's comm of each row: its step less the one-rank step.
comm_adam=$(awk -v a="$plan_adam" -v o="$one" 'BEGIN { print a - o }')
comm_onebit=$(awk -v a="$plan_onebit1" -v o="$one" 'BEGIN { print a - o }')
# 1-bit Adam's run: FREEZE exact steps, then the 1-bit ones.
plan_onebit=$(awk -v f="$FREEZE" -v s="$steps" -v o="$one" -v e="$comm_adam" -v c="$comm_onebit" 'BEGIN { printf "%.4f\n", o + (f * e + (s - f) * c) / s }')
# The same at the two-rank run's own compute and update per step (the
# plan's comm alone against the measured one).
planown_adam=$(awk -v o="$own_adam" -v e="$comm_adam" 'BEGIN { print o + e }')
planown_onebit=$(awk -v f="$FREEZE" -v s="$steps" -v o="$own_onebit" -v e="$comm_adam" -v c="$comm_onebit" 'BEGIN { printf "%.4f\n", o + (f * e + (s - f) * c) / s }')

echo
echo "vs-one: measured (median of $ROUNDS rounds; $steps steps of the two ranks, $BATCH examples per worker per step) against lowbit plan --vs-one, $RATE shared:"
echo "  plan: at the one-rank step measured beside another; plan (own): at the two-rank run's own compute and update per step"
awk -v one="$one" -v alone="$alone" -v b="$BATCH" -v ma="$two_adam" -v mo="$two_onebit" -v pa="$plan_adam" -v po="$plan_onebit" \
	-v qa="$planown_adam" -v qo="$planown_onebit" -v oa="$own_adam" -v oo="$own_onebit" -v f="$FREEZE" -v s="$steps" 'BEGIN {
	printf "%-12s %12s %12s %12s %8s %8s %8s %11s %8s\n", "optimizer", "1 rank ex/s", "2 ranks ex/s", "plan ex/s", "measured", "plan", "error", "plan (own)", "error"
	r1 = b / one * 1000
	row("adam", ma, pa, qa); row("onebit-adam", mo, po, qo)
	printf "one rank: %.2f ms a step (%d examples) beside another (%.2f ms alone); two ranks: %.2f ms (adam), %.2f ms (onebit-adam) of compute and update a step; onebit-adam: %d of its %d steps exact (-freeze-step), in the plan too\n", one, b, alone, oa, oo, f, s
}
function row(name, m, p, q,   rm, rp, rq) {
	rm = 2 * b / m * 1000; rp = 2 * b / p * 1000; rq = 2 * b / q * 1000
	printf "%-12s %12.0f %12.0f %12.0f %7.2fx %7.2fx %+7.1f%% %10.0f %+7.1f%%\n", name, r1, rm, rp, rm / r1, rp / r1, 100 * (rm / rp - 1), rq, 100 * (rm / rq - 1)
}'
