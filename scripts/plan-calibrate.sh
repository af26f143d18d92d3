#!/usr/bin/env bash
# plan-calibrate.sh [OUT]: record the measurements that "lowbit plan" is
# calibrated from and that its unit test checks it against (default OUT:
# costmodel/measured.json).
#
# For each shaped link rate (RATES, default "1gbit 250mbit") and each rank
# count (RANKS, default "2 3 4") it runs "lowbit bench --backend mpi --json"
# (exact allreduce and the 1-bit allreduce, sizes BEGIN..END x FACTOR; only
# the COLLECTIVES, --bf16=false, so that each point follows the same cases
# as in the recorded runs) with
# every rank inside a network namespace whose loopback is shaped by a token
# bucket (see the spec page bench.md, "Bandwidth-limited runs"), REPEATS
# times, the repeat loop outermost so that load drifting on a shared machine
# hits every setting alike. Then it times the 1-bit allreduce without a
# network (the local backend: compression, and the ranks' contention for
# the CPUs), COMPUTE_REPEATS times: on 1 rank up to COMPUTE_END (the size
# of lowbit plan's fused buckets, 25 MiB by default, must lie inside this
# curve: compression slows down once the buffers leave the caches), and on
# each rank count up to END.
#
# The output is one JSON object: {"machine": ..., "link_sharing": "shared",
# "burst_bytes": ..., "runs": [{"rate", "ranks", "repeat", "bench": <lowbit
# bench --json>}...],
# "compute": [<lowbit bench --json>...]}. "lowbit plan fit OUT" fits the
# model to it and prints each point's prediction error.
#
# Needs root, Open MPI (mpirun, and libopenmpi-dev to build with -tags mpi),
# ip and tc. scripts/lib/netns.sh makes the namespace and deletes it on
# every exit, also on failure or interruption. About 6 minutes with the defaults on a 2-core machine; the
# largest messages take 0.75 s each (4 MiB allreduce on 4 ranks at 250mbit).
#
# Settings (environment): RATES, RANKS, REPEATS (7), BURST_KB (256: the tbf
# burst in KiB, recorded because the model runs the token bucket), BEGIN
# (4Ki), END (4Mi), FACTOR (4), WARMUP (2), ITERS (10), COMPUTE_REPEATS (5),
# COMPUTE_END (64Mi), COLLECTIVES (allreduce,onebit), GO (go).
set -euo pipefail

RATES=${RATES:-1gbit 250mbit}
RANKS=${RANKS:-2 3 4}
REPEATS=${REPEATS:-7}
BURST_KB=${BURST_KB:-256}
BEGIN=${BEGIN:-4Ki}
END=${END:-4Mi}
FACTOR=${FACTOR:-4}
WARMUP=${WARMUP:-2}
ITERS=${ITERS:-10}
COMPUTE_REPEATS=${COMPUTE_REPEATS:-5}
COMPUTE_END=${COMPUTE_END:-64Mi}
COLLECTIVES=${COLLECTIVES:-allreduce,onebit}
GO=${GO:-go}

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/costmodel/measured.json}

. "$(dirname "$0")/lib/netns.sh"
netns_init plan-calibrate
netns_require_root "it creates a network namespace and a tc qdisc (run: sudo $0)"
netns_require_mpi headers
NETNS_TBF="burst ${BURST_KB}kb latency 50ms"

echo "plan-calibrate: building lowbit with -tags mpi"
(cd "$root" && "$GO" build -tags mpi -o "$NETNS_TMP/lowbit" ./cmd/lowbit)

netns_new ns plan
mpi=("${NETNS_MPIRUN[@]}" "${NETNS_MPI_LO[@]}")
bench=("$NETNS_TMP/lowbit" bench --backend mpi --collective "$COLLECTIVES" --bf16=false --json
	--b "$BEGIN" --e "$END" --f "$FACTOR" --w "$WARMUP" --n "$ITERS")

runs="$NETNS_TMP/runs.jsonl"
: >"$runs"
start=$(date +%s)
for rep in $(seq 1 "$REPEATS"); do
	for rate in $RATES; do
		netns_shape "$ns" lo "$rate"
		for np in $RANKS; do
			echo "plan-calibrate: repeat $rep/$REPEATS, $rate, $np ranks ($(($(date +%s) - start)) s so far)"
			netns_run ip netns exec "$ns" "${mpi[@]}" -np "$np" "${bench[@]}" --ranks "$np" >"$NETNS_TMP/bench.json"
			{
				printf '{"rate": "%s", "ranks": %d, "repeat": %d, "bench": ' "$rate" "$np" "$rep"
				cat "$NETNS_TMP/bench.json"
				printf '}\n'
			} >>"$runs"
		done
	done
done
netns_del "$ns"

comp="$NETNS_TMP/compute.jsonl"
: >"$comp"
echo "plan-calibrate: 1-bit allreduce without network (local backend, 1 $RANKS ranks), $COMPUTE_REPEATS repeats"
for rep in $(seq 1 "$COMPUTE_REPEATS"); do
	for np in 1 $RANKS; do
		end=$END
		[ "$np" -eq 1 ] && end=$COMPUTE_END
		netns_run "$NETNS_TMP/lowbit" bench --backend local --ranks "$np" --collective onebit --bf16=false --json \
			--b "$BEGIN" --e "$end" --f "$FACTOR" --w "$WARMUP" --n "$ITERS" >>"$comp"
	done
done

# join FILE: the JSON values in FILE as the elements of an array.
join() { awk 'BEGIN { printf "[" } /^[{]/ && NR > 1 { printf "," } { print } END { print "]" }' "$1"; }

mkdir -p "$(dirname "$out")"
{
	printf '{"machine": {"cpus": %d, "model": "%s", "recorded": "%s"},\n' "$(nproc)" \
		"$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1 | tr -d '"\\')" "$(date -u +%Y-%m-%dT%H:%MZ)"
	printf '"link_sharing": "shared",\n"burst_bytes": %d,\n"runs": ' "$((BURST_KB * 1024))"
	join "$runs"
	printf ',\n"compute": '
	join "$comp"
	printf '}\n'
} >"$out.tmp"
mv "$out.tmp" "$out"
echo "plan-calibrate: wrote $out ($(($(date +%s) - start)) s)"
