#!/usr/bin/env bash
# mpi-allreduce-bench.sh: does lowbit bench's busBW for the exact allreduce
# agree with Open MPI's own measurement of the same call? (make
# bench-mpi-allreduce)
#
# "lowbit bench --backend mpi --collective allreduce --op sum" is
# MPI_Allreduce (MPI_IN_PLACE, float, MPI_SUM) on a duplicate of the world
# communicator, preceded by comm/mpi's agreement (a few integers; see
# comm/mpi's doc); with --op mean (comm.Mean, the default) the division by
# W follows it in the same cgo call. scripts/mpi-allreduce-bench.c times
# the bare MPI_Allreduce, built with mpicc -O3, the nccl-tests way (calls
# back to back, the mean over ranks of the time per call) and the lowbit
# bench way (a barrier before each call, the p50 over all ranks' calls),
# and the latter with comm.Mean's division by W after each call, divided
# as comm/mpi divides, on a page-aligned buffer as lowbit bench's Go slice
# is, and the lowbit bench way once more on a buffer where malloc would put
# it (16 bytes past a page boundary), which shows what the alignment alone
# changes. This script runs the three programs on NP ranks on
# this machine (Open MPI's default transport, shared memory), alternately
# REPS times at the sizes BEGIN..END (xFACTOR), and prints per size the
# median over the runs of each busbw (and their range), and lowbit bench's
# medians over the C program's that time the same operation: sum against
# the bare call (both ways), mean against the call with the division. On a
# machine shared with other work the ranges say how far to trust them.
#
# Needs Open MPI (mpirun, mpicc, and libopenmpi-dev to build with -tags
# mpi); not root.
#
# Settings (environment): NP (the cores, 2 to 4: a rank that waits for a
# core costs every rank the call, and the two programs are not equally
# exposed to it; docs/measured.md), BEGIN (1Mi), END (64Mi), FACTOR (8),
# WARMUP (2), ITERS (20, at most 50), REPS (3), GO (go).
set -euo pipefail

cores=$(nproc 2>/dev/null || echo 4)
NP=${NP:-$((cores < 2 ? 2 : cores > 4 ? 4 : cores))}
BEGIN=${BEGIN:-1Mi}
END=${END:-64Mi}
FACTOR=${FACTOR:-8}
WARMUP=${WARMUP:-2}
ITERS=${ITERS:-20}
REPS=${REPS:-3}
GO=${GO:-go}

. "$(dirname "$0")/lib/netns.sh"
netns_init mpi-allreduce-bench
netns_require_mpi headers
command -v mpicc >/dev/null || netns_die "cannot run: mpicc not found; install libopenmpi-dev"

root=$(cd "$(dirname "$0")/.." && pwd)
echo "mpi-allreduce-bench: building lowbit with -tags mpi and scripts/mpi-allreduce-bench.c with mpicc"
(cd "$root" && "$GO" build -tags mpi -o "$NETNS_TMP/lowbit" ./cmd/lowbit)
mpicc -O3 -o "$NETNS_TMP/mpi-allreduce-bench" "$root/scripts/mpi-allreduce-bench.c"

mpi=("${NETNS_MPIRUN[@]}" -np "$NP")
echo "mpi-allreduce-bench: $NP ranks, shared memory, $BEGIN..$END x$FACTOR, $WARMUP warm-up + $ITERS timed calls, $REPS runs of each, alternately"
for r in $(seq "$REPS"); do
	for op in sum mean; do
		netns_run "${mpi[@]}" "$NETNS_TMP/lowbit" bench --backend mpi --ranks "$NP" --collective allreduce --op "$op" --bf16=false --csv \
			--b "$BEGIN" --e "$END" --f "$FACTOR" --w "$WARMUP" --n "$ITERS" >"$NETNS_TMP/lowbit-$op$r.csv"
	done
	# The sizes in bytes, as lowbit bench read them.
	mapfile -t sizes < <(awk -F, 'NR > 1 { print $2 }' "$NETNS_TMP/lowbit-sum$r.csv")
	netns_run "${mpi[@]}" "$NETNS_TMP/mpi-allreduce-bench" "$WARMUP" "$ITERS" "${sizes[@]}" >"$NETNS_TMP/mpi$r.csv"
done

# median X N returns the median of X[1..N], sorting X in place (awk).
median='function median(x, n,   i, j, y) {
	for (i = 2; i <= n; i++) for (j = i; j > 1 && x[j] < x[j - 1]; j--) { y = x[j]; x[j] = x[j - 1]; x[j - 1] = y }
	return n % 2 ? x[(n + 1) / 2] : (x[n / 2] + x[n / 2 + 1]) / 2
}'

files=()
for r in $(seq "$REPS"); do
	files+=("$NETNS_TMP/lowbit-sum$r.csv" "$NETNS_TMP/lowbit-mean$r.csv" "$NETNS_TMP/mpi$r.csv")
done
echo
awk -F, -v np="$NP" -v reps="$REPS" "$median"'
	FNR == 1 {
		delete col
		for (i = 1; i <= NF; i++) col[$i] = i
		# lowbit bench'"'"'s files are lowbit-sumN.csv and lowbit-meanN.csv.
		way = ""
		if (FILENAME ~ /lowbit-sum[0-9]+\.csv$/) way = "lowbit-sum"
		if (FILENAME ~ /lowbit-mean[0-9]+\.csv$/) way = "lowbit-mean"
		if (!("busbw_gbps" in col) || way == "" && !("way" in col)) { print "mpi-allreduce-bench: unexpected CSV header: " $0 > "/dev/stderr"; exit 1 }
		next
	}
	{
		b = $col["bytes"]
		if (!(b in seen)) { seen[b] = 1; order[++n] = b }
		k = (way != "" ? way : $col["way"]) SUBSEP b
		bw[k, ++cnt[k]] = $col["busbw_gbps"]
		all[k] = all[k] (cnt[k] > 1 ? " " : "") sprintf("%.3f", $col["busbw_gbps"])
	}
	# stat K returns the median busbw of K over the runs and their range,
	# and keeps the median in m[K].
	function stat(k,   x, i, lo, hi) {
		lo = hi = bw[k, 1]
		for (i = 1; i <= cnt[k]; i++) {
			x[i] = bw[k, i]
			if (x[i] < lo) lo = x[i]
			if (x[i] > hi) hi = x[i]
		}
		m[k] = median(x, cnt[k])
		return sprintf("%7.3f [%5.3f-%5.3f]", m[k], lo, hi)
	}
	END {
		printf "busbw of MPI_Allreduce, float32, %d ranks, GB/s: the median of %d runs [their range]\n", np, reps
		printf "%9s %21s %21s %21s %21s %21s %21s %8s %8s %8s %8s\n", "bytes", "lowbit --op sum", "MPI, barrier + p50",
			"MPI, nccl-tests way", "lowbit --op mean", "MPI + divide, p50", "MPI, malloc, barrier",
			"sum/bar", "sum/nccl", "mean/div", "mal/bar"
		for (i = 1; i <= n; i++) {
			b = order[i]
			s = stat("lowbit-sum" SUBSEP b); r = stat("barrier" SUBSEP b); c = stat("nccl" SUBSEP b)
			l = stat("lowbit-mean" SUBSEP b); d = stat("mean" SUBSEP b); u = stat("barrier16" SUBSEP b)
			printf "%9d %21s %21s %21s %21s %21s %21s %8.3f %8.3f %8.3f %8.3f\n", b, s, r, c, l, d, u,
				m["lowbit-sum" SUBSEP b] / m["barrier" SUBSEP b], m["lowbit-sum" SUBSEP b] / m["nccl" SUBSEP b],
				m["lowbit-mean" SUBSEP b] / m["mean" SUBSEP b], m["barrier16" SUBSEP b] / m["barrier" SUBSEP b]
		}
		print "(sum/bar, sum/nccl, mean/div: lowbit bench'"'"'s median busbw over the C program'"'"'s for the same operation on a"
		print " page-aligned buffer, as lowbit bench'"'"'s: --op sum over the bare call timed its way and the nccl-tests way,"
		print " --op mean over the call with the division; mal/bar: the bare call on malloc'"'"'s buffer over a page-aligned one)"
		print "every run, in run order:"
		for (i = 1; i <= n; i++) {
			b = order[i]
			printf "%9d  lowbit sum %s | barrier %s | nccl %s | lowbit mean %s | divide %s | malloc %s\n", b,
				all["lowbit-sum" SUBSEP b], all["barrier" SUBSEP b], all["nccl" SUBSEP b], all["lowbit-mean" SUBSEP b],
				all["mean" SUBSEP b], all["barrier16" SUBSEP b]
		}
	}' "${files[@]}"
