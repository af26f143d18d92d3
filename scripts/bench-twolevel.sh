#!/usr/bin/env bash
# bench-twolevel.sh: the two-level allreduce (quant.TwoLevel) against the
# flat MPI allreduce on 2 "machines" of 2 ranks where only the link
# between the machines is slow, side by side in the same run.
#
# Each machine is a network namespace of its own (A and B), joined by a
# veth pair (lbtla in A, 10.231.1.1; lbtlb in B, 10.231.2.1) whose two ends
# each send through a token bucket of RATE: the link between the machines
# is shaped both ways, traffic inside a machine (over its own loopback) is
# not. mpirun runs in A and starts the ranks of A itself; it starts the
# Open MPI daemon of B, which starts B's ranks, through an rsh agent that
# runs the daemon's command in namespace B instead of over ssh (the
# hostfile names the machines by their addresses). Ranks 0..RPN-1 are on A
# and RPN..2*RPN-1 on B (node-major). Each machine also has a host name of
# its own (a UTS namespace), so Open MPI sees two hosts: ranks of one
# machine talk over shared memory (btl vader), ranks of different machines
# over TCP through the shaped link.
#
# Open MPI's TCP transport sends a message of more than its eager limit
# (64 KiB by default) by rendezvous: the sender waits a round trip for the
# receiver's acknowledgement before the bulk of the data goes. On the
# shaped link (tbf latency up to 50 ms) that stall recurs for every piece
# the two-level allreduce pipelines, and the link idles meanwhile: at
# 64 MiB the two-level allreduce took 690-770 ms with the default and
# 580-610 ms with EAGER=4194304, while the flat ring allreduce was the same
# within noise either way (910-1010 ms). EAGER (4194304 bytes) sets
# btl_tcp_eager_limit and btl_tcp_rndv_eager_limit for both collectives
# alike; EAGER=0 keeps Open MPI's default.
#
# The flat baseline is Open MPI's ring allreduce (coll_tuned algorithm 4,
# FLAT_ALG; 0 leaves the choice to Open MPI). Per size it prints both p50
# times, the speedup, and the bytes each rank sent across machines.
#
# Needs root (namespaces, a veth pair, qdiscs), Open MPI (mpirun, and
# libopenmpi-dev to build with -tags mpi), ip and tc from iproute2 and
# unshare. scripts/lib/netns.sh makes the namespaces and removes them (and
# what still runs in them) on every exit, also on failure or interruption.
#
# Settings (environment): RATE (1gbit), RPN (2, ranks per machine),
# BEGIN (4Mi), END (64Mi), FACTOR (4), WARMUP (1), ITERS (5),
# COLLECTIVES (allreduce,twolevel; fp16 and bf16 may be added), FLAT_ALG
# (4), EAGER (4194304; 0: Open MPI's default), BTL (vader,tcp,self),
# MPIEXTRA (more mpirun arguments, split on spaces), CSV (a path to copy
# the benchmark's CSV to), GO (go). At 1 Gbit the flat 64 MiB allreduce
# takes about 1 s per call: the default sweep runs in about a minute.
set -euo pipefail

RATE=${RATE:-1gbit}
RPN=${RPN:-2}
BEGIN=${BEGIN:-4Mi}
END=${END:-64Mi}
FACTOR=${FACTOR:-4}
WARMUP=${WARMUP:-1}
ITERS=${ITERS:-5}
COLLECTIVES=${COLLECTIVES:-allreduce,twolevel}
FLAT_ALG=${FLAT_ALG:-4}
EAGER=${EAGER:-4194304}
GO=${GO:-go}

. "$(dirname "$0")/lib/netns.sh"
netns_init bench-twolevel
netns_require_root "it creates network namespaces, a veth pair and tc qdiscs (run: sudo scripts/bench-twolevel.sh)"
netns_require_mpi headers

root=$(cd "$(dirname "$0")/.." && pwd)
echo "bench-twolevel: building lowbit with -tags mpi"
(cd "$root" && "$GO" build -tags mpi -o "$NETNS_TMP/lowbit" ./cmd/lowbit)

netns_new nsa tla
netns_new nsb tlb
echo "bench-twolevel: machines A (namespace $nsa, 10.231.1.1) and B ($nsb, 10.231.2.1) joined by a veth pair shaped each way: tbf $(netns_tbf "$RATE")"
netns_join "$nsa" lbtla 10.231.1.1/16 "$nsb" lbtlb 10.231.2.1/16
netns_shape "$nsa" lbtla "$RATE"
netns_shape "$nsb" lbtlb "$RATE"
netns_rsh_agent "$NETNS_TMP/agent" "$nsa" 10.231.2.1 "$nsb"
printf '10.231.1.1 slots=%d\n10.231.2.1 slots=%d\n' "$RPN" "$RPN" >"$NETNS_TMP/hosts"

np=$((2 * RPN))
mpi=("${NETNS_MPIRUN[@]}" --hostfile "$NETNS_TMP/hosts" --map-by slot -np "$np"
	--mca plm_rsh_agent "$NETNS_TMP/agent" --mca oob_tcp_if_include 10.231.0.0/16
	--mca pml ob1 --mca btl "${BTL:-vader,tcp,self}" --mca btl_tcp_if_include 10.231.0.0/16 --mca btl_tcp_disable_family 6)
eager="Open MPI's default"
if [ "$EAGER" != 0 ]; then
	eager="$EAGER bytes"
	mpi+=(--mca btl_tcp_eager_limit "$EAGER" --mca btl_tcp_rndv_eager_limit "$EAGER")
fi
if [ "$FLAT_ALG" != 0 ]; then
	mpi+=(--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm "$FLAT_ALG")
fi
bench=("$NETNS_TMP/lowbit" bench --backend mpi --ranks "$np" --ranks-per-node "$RPN" --collective "$COLLECTIVES"
	--b "$BEGIN" --e "$END" --f "$FACTOR" --w "$WARMUP" --n "$ITERS" --check --csv)

echo "bench-twolevel: 2 machines x $RPN ranks, sizes $BEGIN..$END x$FACTOR, $WARMUP warm-up + $ITERS timed iterations, collectives $COLLECTIVES, TCP eager limit $eager"
netns_host host_a "$nsa"
# shellcheck disable=SC2086 # MPIEXTRA is a list of arguments
netns_run "${host_a[@]}" "${mpi[@]}" ${MPIEXTRA:-} "${bench[@]}" >"$NETNS_TMP/shaped.csv"
[ -z "${CSV:-}" ] || cp "$NETNS_TMP/shaped.csv" "$CSV"
# The shaping really held: bytes through each token bucket.
echo "bench-twolevel: tbf A->B passed $(netns_sent "$nsa" lbtla) bytes"
echo "bench-twolevel: tbf B->A passed $(netns_sent "$nsb" lbtlb) bytes"

echo
awk -F, -v title="shaped cross-machine link ($RATE), 2 machines x $RPN ranks:" '
	NR == 1 {
		for (i = 1; i <= NF; i++) col[$i] = i
		if (!("time_p50_us" in col) || !("cross_node_bytes_per_rank" in col)) { print "bench-twolevel: unexpected CSV header: " $0 > "/dev/stderr"; exit 1 }
		next
	}
	{
		b = $col["bytes"]
		if (!(b in seen)) { seen[b] = 1; order[++n] = b }
		t[$col["collective"], b] = $col["time_p50_us"]
		x[$col["collective"], b] = $col["cross_node_bytes_per_rank"]
		if ($col["collective"] != "allreduce" && $col["collective"] != "twolevel") other[$col["collective"]] = 1
	}
	function human(v) {
		if (v % 1073741824 == 0) return v / 1073741824 "G"
		if (v % 1048576 == 0) return v / 1048576 "M"
		if (v % 1024 == 0) return v / 1024 "K"
		return v
	}
	END {
		print title
		printf "%6s %14s %14s %9s %18s\n", "size", "flat p50 ms", "2-level p50 ms", "speedup", "2-level cross B/rank"
		for (i = 1; i <= n; i++) {
			b = order[i]; tf = t["allreduce", b]; tt = t["twolevel", b]
			if (tf == "" || tt == "") continue
			printf "%6s %14.2f %14.2f %8.2fx %18d\n", human(b), tf / 1000, tt / 1000, tf / tt, x["twolevel", b]
			last = sprintf("speedup of twolevel over the flat allreduce at %s: %.2fx", human(b), tf / tt)
		}
		for (c in other) for (i = 1; i <= n; i++) {
			b = order[i]
			if (t[c, b] != "" && t["allreduce", b] != "")
				printf "%s at %s: %.2f ms, %.2fx the flat allreduce\n", c, human(b), t[c, b] / 1000, t["allreduce", b] / t[c, b]
		}
		if (last != "") print last
	}' "$NETNS_TMP/shaped.csv"
