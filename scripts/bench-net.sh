#!/usr/bin/env bash
# bench-net.sh: the exact MPI allreduce and the bf16 down-cast one against
# the 1-bit compressed one on a slow network, side by side in the same run
# (make bench-net).
#
# The slow network is a network namespace whose loopback is shaped by a
# token bucket (see the spec page bench.md, "Bandwidth-limited runs"): all
# ranks run inside it and talk over TCP on lo, so the shaping caps their
# total traffic. After the shaped sweep the script always runs the same
# comparison at the largest size without shaping (Open MPI's default
# shared-memory transport), for the unshaped ratio. Every one of these runs
# times the float32 allreduce, the bf16 down-cast allreduce (quant.DownCast)
# and the 1-bit one, and reports the 1-bit call's speedup over each (the
# ratio of p50s of the same run).
#
# Needs root (for the namespace and the qdisc), Open MPI (mpirun, and
# libopenmpi-dev to build with -tags mpi), and ip and tc from iproute2.
# scripts/lib/netns.sh makes the namespace and deletes it on every exit,
# also on failure or interruption.
#
# A second shaped run, at QSIZE only, compares the quantized and down-cast
# collectives of package quant with their float32 baselines in the same
# run: the qgZ reduce-scatter with int4 and int8 codes (qgz4, qgz8) on a
# node-major layout of QRPN ranks per node (2 nodes x 2 ranks with the
# defaults) against the float32 reduce-scatter, and the fp16 and bf16
# down-cast allreduces against the float32 allreduce, each with its
# relative error against the exact mean (--check).
#
# Then the 1-bit allreduce against the exact and bf16 ones at END on a fast link,
# where the call is bound by memory traffic rather than the wire: the
# loopback shaped to FAST (10gbit), and unshaped; each 1-bit row with the
# memory bound lowbit bench prints (the bytes a rank must read and write at
# the streaming bandwidth measured in the same run) and the share of it
# reached, and the way the calls settled on (chunks whole or in pieces;
# lowbit bench warms a 1-bit call up with onebit.TuningCalls calls at
# least). Beside them, a small message unshaped (SMALL, 4Ki): the 1-bit
# call against the exact and bf16 ones, REPS times (each run's speedups and their
# median: one run's ratio of two p50s of some tens of microseconds moves
# with what the 2 cores were doing in it).
#
# Last, unless TWOLEVEL=0, it runs scripts/bench-twolevel.sh at QSIZE: the
# two-level allreduce (and fp16, bf16) against the flat allreduce on 2
# machines of QRPN ranks, each its own namespace, with only the link
# between them shaped to RATE (about a minute more at 64 MiB), with Open
# MPI's TCP eager limit set to EAGER bytes for both collectives (4194304;
# 0 keeps Open MPI's 64 KiB: see that script for why).
#
# Settings (environment): RATE (1gbit), NP (4), BEGIN (1Mi), END (64Mi),
# FACTOR (2), WARMUP (1), ITERS (5) for the shaped sweep (the exact 64 MiB
# allreduce takes about 3.2 s per call at 1 Gbit, bf16 about half that),
# QSIZE (END), QRPN (2) for the quantized and down-cast run (about a minute
# at 64 MiB), ITERS_UNSHAPED (10), FAST (10gbit),
# REPS (3: the FAST, unshaped and small runs, alternately, each with its own
# streaming bandwidth; the memory bound's share is reported per run and as
# the median, because this machine's bandwidth changes with its
# neighbours' load), SMALL (4Ki), GO (go).
set -euo pipefail

RATE=${RATE:-1gbit}
NP=${NP:-4}
BEGIN=${BEGIN:-1Mi}
END=${END:-64Mi}
FACTOR=${FACTOR:-2}
WARMUP=${WARMUP:-1}
ITERS=${ITERS:-5}
ITERS_UNSHAPED=${ITERS_UNSHAPED:-10}
QSIZE=${QSIZE:-$END}
QRPN=${QRPN:-2}
TWOLEVEL=${TWOLEVEL:-1}
FAST=${FAST:-10gbit}
REPS=${REPS:-3}
SMALL=${SMALL:-4Ki}
GO=${GO:-go}

. "$(dirname "$0")/lib/netns.sh"
netns_init bench-net
netns_require_root "it creates a network namespace and a tc qdisc (run: sudo make bench-net)"
netns_require_mpi headers

root=$(cd "$(dirname "$0")/.." && pwd)
echo "bench-net: building lowbit with -tags mpi"
(cd "$root" && "$GO" build -tags mpi -o "$NETNS_TMP/lowbit" ./cmd/lowbit)

mpi=("${NETNS_MPIRUN[@]}" -np "$NP")
bench=("$NETNS_TMP/lowbit" bench --backend mpi --ranks "$NP" --collective allreduce,bf16,onebit --csv)

netns_new ns net
echo "bench-net: network namespace $ns, loopback shaped: tbf $(netns_tbf "$RATE")"
netns_shape "$ns" lo "$RATE"

echo "bench-net: $NP ranks over TCP on the shaped loopback, sizes $BEGIN..$END x$FACTOR, $WARMUP warm-up + $ITERS timed iterations"
netns_run ip netns exec "$ns" "${mpi[@]}" "${NETNS_MPI_LO[@]}" \
	"${bench[@]}" --b "$BEGIN" --e "$END" --f "$FACTOR" --w "$WARMUP" --n "$ITERS" >"$NETNS_TMP/shaped.csv"

echo "bench-net: $NP ranks ($QRPN per node) on the shaped loopback, $QSIZE: reducescatter vs qgz4, qgz8; allreduce vs fp16, bf16"
netns_run ip netns exec "$ns" "${mpi[@]}" "${NETNS_MPI_LO[@]}" \
	"$NETNS_TMP/lowbit" bench --backend mpi --ranks "$NP" --ranks-per-node "$QRPN" \
	--collective reducescatter,qgz4,qgz8,allreduce,fp16,bf16 --check --csv \
	--b "$QSIZE" --e "$QSIZE" --w "$WARMUP" --n "$ITERS" >"$NETNS_TMP/quant.csv"

netns_shape "$ns" lo "$FAST"
echo "bench-net: $REPS times, alternately: $NP ranks over TCP on the loopback shaped to $FAST, and unshaped (default transport); $END, $WARMUP warm-up + $ITERS_UNSHAPED timed iterations; then unshaped at $SMALL, 10 warm-up + 1000 timed iterations"
for r in $(seq "$REPS"); do
	netns_run ip netns exec "$ns" "${mpi[@]}" "${NETNS_MPI_LO[@]}" \
		"${bench[@]}" --b "$END" --e "$END" --w "$WARMUP" --n "$ITERS_UNSHAPED" >"$NETNS_TMP/fast$r.csv"
	netns_run "${mpi[@]}" "${bench[@]}" --b "$END" --e "$END" --w "$WARMUP" --n "$ITERS_UNSHAPED" >"$NETNS_TMP/unshaped$r.csv"
	netns_run "${mpi[@]}" "${bench[@]}" --b "$SMALL" --e "$SMALL" --w 10 --n 1000 >"$NETNS_TMP/small$r.csv"
done
netns_del "$ns"

# human X prints X bytes as 64M, 4K, 1G where it divides evenly (awk).
human='function human(x) {
	if (x % 1073741824 == 0) return x / 1073741824 "G"
	if (x % 1048576 == 0) return x / 1048576 "M"
	if (x % 1024 == 0) return x / 1024 "K"
	return x
}'

# median X N returns the median of X[1..N], sorting X in place (awk).
median='function median(x, n,   i, j, y) {
	for (i = 2; i <= n; i++) for (j = i; j > 1 && x[j] < x[j - 1]; j--) { y = x[j]; x[j] = x[j - 1]; x[j - 1] = y }
	return n % 2 ? x[(n + 1) / 2] : (x[n / 2] + x[n / 2 + 1]) / 2
}'

# way PIECES STARTED says how 1-bit calls ran, from lowbit bench's CSV
# columns pieces and started (awk).
way='function way(pieces, started) {
	return (pieces == 1 ? "whole" : "in " pieces " pieces") (started == "true" ? ", collectives started" : "")
}'

# summary TITLE FILE prints one line per size of lowbit bench's CSV in FILE: the
# exact (float32), bf16 and 1-bit p50 time, the 1-bit call's speedup over
# each, the bytes each rank sent; then the speedups at the last size, and the
# way the 1-bit calls ran there (rank 0's last call).
summary() {
	awk -F, -v title="$1" "$human$way"'
		NR == 1 {
			for (i = 1; i <= NF; i++) col[$i] = i
			if (!("time_p50_us" in col) || !("wire_bytes_per_rank" in col)) { print "bench-net: unexpected CSV header: " $0 > "/dev/stderr"; exit 1 }
			next
		}
		{
			b = $col["bytes"]
			if (!(b in seen)) { seen[b] = 1; order[++n] = b }
			t[$col["collective"], b] = $col["time_p50_us"]
			w[$col["collective"], b] = $col["wire_bytes_per_rank"]
			if ($col["collective"] == "onebit" && ("pieces" in col)) ran[b] = way($col["pieces"], $col["started"])
		}
			END {
			print title
			printf "%6s %13s %13s %13s %10s %10s %13s %13s %13s %8s\n", "size", "exact p50 ms", "bf16 p50 ms", "1-bit p50 ms",
				"vs exact", "vs bf16", "exact B/rank", "bf16 B/rank", "1-bit B/rank", "B ratio"
			for (i = 1; i <= n; i++) {
				b = order[i]; te = t["allreduce", b]; th = t["bf16", b]; to = t["onebit", b]
				printf "%6s %13.2f %13.2f %13.2f %9.2fx %9.2fx %13d %13d %13d %7.1fx\n", human(b), te / 1000, th / 1000, to / 1000,
					te / to, th / to, w["allreduce", b], w["bf16", b], w["onebit", b], w["allreduce", b] / w["onebit", b]
				last = te / to; lasth = th / to
			}
			printf "speedup at %s: %.2fx over the exact allreduce, %.2fx over bf16", human(order[n]), last, lasth
			if (order[n] in ran) printf " (1-bit chunks %s)", ran[order[n]]
			printf "\n"
		}' "$2"
}

echo
summary "shaped ($RATE loopback, TCP), $NP ranks:" "$NETNS_TMP/shaped.csv"
echo
summary "unshaped (shared memory), $NP ranks (the first of $REPS runs):" "$NETNS_TMP/unshaped1.csv"
echo
summary "unshaped (shared memory), $NP ranks, small messages (the first of $REPS runs):" "$NETNS_TMP/small1.csv"

# speedups TITLE FILE... prints the 1-bit call's speedup over the exact one
# and over bf16 in each file (lowbit bench's CSV, one size), then their
# medians.
speedups() {
	title=$1
	shift
	awk -F, -v title="$title" "$median"'
		function run() {
			x[++n] = t["allreduce"] / t["onebit"]
			y[n] = t["bf16"] / t["onebit"]
			printf "%s, run %d: exact p50 %.1f us, bf16 p50 %.1f us, 1-bit p50 %.1f us: %.2fx over exact, %.2fx over bf16\n",
				title, n, t["allreduce"], t["bf16"], t["onebit"], x[n], y[n]
		}
		FNR == 1 {
			if (NR > 1) run()
			for (i = 1; i <= NF; i++) col[$i] = i
			if (!("time_p50_us" in col)) { print "bench-net: unexpected CSV header: " $0 > "/dev/stderr"; exit 1 }
			next
		}
		{ t[$col["collective"]] = $col["time_p50_us"] }
		END {
			run()
			printf "%s: median speedup over %d runs: %.2fx over exact, %.2fx over bf16\n", title, n, median(x, n), median(y, n)
		}' "$@"
}
speedups "unshaped $SMALL" "$NETNS_TMP"/small[0-9]*.csv

# bound TITLE FILE... prints each 1-bit row's memory bound and the share of
# it reached, one line per file (lowbit bench's CSV), then the median share.
bound() {
	title=$1
	shift
	awk -F, -v title="$title" "$human$median$way"'
		FNR == 1 {
			for (i = 1; i <= NF; i++) col[$i] = i
			if (!("mem_bound_share" in col) || !("pieces" in col)) { print "bench-net: unexpected CSV header: " $0 > "/dev/stderr"; exit 1 }
			next
		}
		$col["collective"] == "onebit" {
			printf "%s %s: 1-bit p50 %.2f ms, memory bound %.2f ms (%.1f MiB per rank at %.2f GB/s): %.0f%% of it reached; chunks %s\n",
				title, human($col["bytes"]), $col["time_p50_us"] / 1000, $col["mem_bound_us"] / 1000,
				$col["mem_bytes_per_rank"] / 1048576, $col["stream_gbps"], 100 * $col["mem_bound_share"],
				way($col["pieces"], $col["started"])
			share[++n] = 100 * $col["mem_bound_share"]
		}
		END {
			printf "%s: median share of the memory bound over %d runs: %.0f%%\n", title, n, median(share, n)
		}' "$@"
}
echo
summary "shaped ($FAST loopback, TCP), $NP ranks (the first of $REPS runs):" "$NETNS_TMP/fast1.csv"
echo
bound "$FAST" "$NETNS_TMP"/fast[0-9]*.csv
bound "unshaped" "$NETNS_TMP"/unshaped[0-9]*.csv

# The quantized and down-cast rows: each against its float32 baseline of
# the same run.
echo
awk -F, -v title="shaped ($RATE loopback, TCP), $NP ranks, $QRPN per node:" "$human"'
	NR == 1 {
		for (i = 1; i <= NF; i++) col[$i] = i
		if (!("time_p50_us" in col) || !("rel_error" in col) || !("convert_us" in col) || !("cross_node_bytes_per_rank" in col)) {
			print "bench-net: unexpected CSV header: " $0 > "/dev/stderr"; exit 1
		}
		next
	}
	{
		c = $col["collective"]; b = $col["bytes"]
		t[c] = $col["time_p50_us"]; w[c] = $col["wire_bytes_per_rank"]; e[c] = $col["rel_error"]
		x[c] = $col["cross_node_bytes_per_rank"]; cv[c] = $col["convert_us"]; cm[c] = $col["comm_us"]
	}
	function line(c, base, extra) {
		if (t[c] == "" || t[base] == "") return
		printf "%-6s %-13s %6s %12.2f %12.2f %8.2fx %12d %9.2e  %s\n", c, base, human(b), t[c] / 1000, t[base] / 1000,
			t[base] / t[c], w[c], e[c], extra
	}
	END {
		print title
		printf "%-6s %-13s %6s %12s %12s %9s %12s %9s\n", "what", "baseline", "size", "p50 ms", "base p50 ms", "speedup", "B/rank", "rel.err"
		line("qgz4", "reducescatter", "cross-node " x["qgz4"] " B/rank")
		line("qgz8", "reducescatter", "cross-node " x["qgz8"] " B/rank")
		line("fp16", "allreduce", sprintf("convert %.1f ms + comm %.1f ms per call (rank 0)", cv["fp16"] / 1000, cm["fp16"] / 1000))
		line("bf16", "allreduce", sprintf("convert %.1f ms + comm %.1f ms per call (rank 0)", cv["bf16"] / 1000, cm["bf16"] / 1000))
	}' "$NETNS_TMP/quant.csv"

if [ "$TWOLEVEL" != 0 ]; then
	echo
	netns_run env RATE="$RATE" EAGER="${EAGER:-}" RPN="$QRPN" BEGIN="$QSIZE" END="$QSIZE" WARMUP="$WARMUP" ITERS="$ITERS" GO="$GO" \
		COLLECTIVES=allreduce,twolevel,fp16,bf16 "$root/scripts/bench-twolevel.sh"
fi
