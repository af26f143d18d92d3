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
# Needs root (namespaces, a veth pair, qdiscs), Open MPI's mpirun, and ip
# and tc from iproute2. The namespaces (and what still runs in them) are
# removed on every exit, also on failure or interruption.
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

die() { echo "bench-twolevel: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root: it creates network namespaces, a veth pair and tc qdiscs (run: sudo scripts/bench-twolevel.sh)"
command -v mpirun >/dev/null || die "mpirun not found: install Open MPI (Debian: apt-get install -y openmpi-bin libopenmpi-dev)"
for tool in ip tc; do
	command -v "$tool" >/dev/null || die "$tool not found: install iproute2 (Debian: apt-get install -y iproute2)"
done

root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/lowbit-bench-twolevel.XXXXXX")
nsa="lowbit-tla-$$-$RANDOM"
nsb="lowbit-tlb-$$-$RANDOM"
ns_made=
cleanup() {
	if [ -n "$ns_made" ]; then
		for ns in "$nsa" "$nsb"; do
			# What still runs in a namespace is this script's (a daemon
			# or rank that outlived an interrupted run).
			pids=$(ip netns pids "$ns" 2>/dev/null || true)
			[ -z "$pids" ] || kill $pids 2>/dev/null || true
			ip netns del "$ns" 2>/dev/null || echo "bench-twolevel: could not delete network namespace $ns" >&2
		done
	fi
	rm -rf "$tmp"
}
# Long runs go to the background so that a signal is handled at once: the
# handler stops the run, and the EXIT trap removes the namespaces.
child=
on_signal() {
	if [ -n "$child" ]; then
		kill -TERM "$child" 2>/dev/null || true
		wait "$child" 2>/dev/null || true
	fi
	exit "$1"
}
run() {
	local rc=0
	"$@" &
	child=$!
	wait "$child" || rc=$?
	child=
	return "$rc"
}
trap cleanup EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

echo "bench-twolevel: building lowbit with -tags mpi"
(cd "$root" && "$GO" build -tags mpi -o "$tmp/lowbit" ./cmd/lowbit)

echo "bench-twolevel: machines A (namespace $nsa, 10.231.1.1) and B ($nsb, 10.231.2.1) joined by a veth pair shaped to $RATE each way (tbf burst 256kb latency 50ms)"
ns_made=1
ip netns add "$nsa"
ip netns add "$nsb"
ip -n "$nsa" link set lo up
ip -n "$nsb" link set lo up
ip -n "$nsa" link add lbtla type veth peer name lbtlb netns "$nsb"
ip -n "$nsa" addr add 10.231.1.1/16 dev lbtla
ip -n "$nsb" addr add 10.231.2.1/16 dev lbtlb
ip -n "$nsa" link set lbtla up
ip -n "$nsb" link set lbtlb up
tc -n "$nsa" qdisc add dev lbtla root tbf rate "$RATE" burst 256kb latency 50ms
tc -n "$nsb" qdisc add dev lbtlb root tbf rate "$RATE" burst 256kb latency 50ms

# The rsh agent: "agent HOST COMMAND..." runs COMMAND in HOST's namespace.
cat >"$tmp/agent" <<AGENT
#!/bin/sh
host=\$1
shift
case "\$host" in
10.231.2.1) ns=$nsb ;;
*) ns=$nsa ;;
esac
exec ip netns exec "\$ns" unshare --uts sh -c "hostname lowbit-\$ns; \$*"
AGENT
chmod +x "$tmp/agent"
printf '10.231.1.1 slots=%d\n10.231.2.1 slots=%d\n' "$RPN" "$RPN" >"$tmp/hosts"

np=$((2 * RPN))
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none --hostfile "$tmp/hosts" --map-by slot -np "$np"
	--mca plm_rsh_agent "$tmp/agent" --mca oob_tcp_if_include 10.231.0.0/16
	--mca pml ob1 --mca btl "${BTL:-vader,tcp,self}" --mca btl_tcp_if_include 10.231.0.0/16 --mca btl_tcp_disable_family 6
	--mca mpi_yield_when_idle 1)
eager="Open MPI's default"
if [ "$EAGER" != 0 ]; then
	eager="$EAGER bytes"
	mpi+=(--mca btl_tcp_eager_limit "$EAGER" --mca btl_tcp_rndv_eager_limit "$EAGER")
fi
if [ "$FLAT_ALG" != 0 ]; then
	mpi+=(--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm "$FLAT_ALG")
fi
bench=("$tmp/lowbit" bench --backend mpi --ranks "$np" --ranks-per-node "$RPN" --collective "$COLLECTIVES"
	--b "$BEGIN" --e "$END" --f "$FACTOR" --w "$WARMUP" --n "$ITERS" --check --csv)

echo "bench-twolevel: 2 machines x $RPN ranks, sizes $BEGIN..$END x$FACTOR, $WARMUP warm-up + $ITERS timed iterations, collectives $COLLECTIVES, TCP eager limit $eager"
run ip netns exec "$nsa" unshare --uts sh -c 'hostname "lowbit-$0"; exec "$@"' "$nsa" "${mpi[@]}" ${MPIEXTRA:-} "${bench[@]}" >"$tmp/shaped.csv"
[ -z "${CSV:-}" ] || cp "$tmp/shaped.csv" "$CSV"
# The shaping really held: bytes through each token bucket.
for end in "$nsa lbtla A->B" "$nsb lbtlb B->A"; do
	read -r ns dev dir <<<"$end"
	tc -n "$ns" -s qdisc show dev "$dev" | awk -v dir="$dir" '/^qdisc tbf/ { q = 1 } /Sent/ && q { print "bench-twolevel: tbf " dir " passed " $2 " bytes"; q = 0 }'
done

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
	}' "$tmp/shaped.csv"
