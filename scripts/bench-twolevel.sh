#!/usr/bin/env bash
# bench-twolevel.sh: the two-level allreduce (quant.TwoLevel) against the
# flat MPI allreduce on 2 "machines" of 2 ranks where only the link
# between the machines is slow, side by side in the same run.
#
# Everything runs in a network namespace of its own. Each machine is an
# interface there (lbtla, addresses 10.231.1.0/24, and lbtlb,
# 10.231.2.0/24), and each rank's TCP transport is restricted to its
# machine's interface (OMPI_MCA_btl_tcp_if_include per app context: ranks
# 0..RPN-1 on A, RPN..2*RPN-1 on B, node-major), so that Open MPI binds its
# sockets to that machine's address. All of it travels over the
# namespace's loopback, whose root qdisc sends packets from one machine's
# subnet to the other's through a token bucket (RATE, one per direction,
# as on the two ends of a shaped veth pair) and everything else, traffic
# inside a machine, unshaped. Open MPI's shared-memory transport is off
# (btl tcp,self), or it would bypass the shaping.
#
# Why not two namespaces joined by a veth pair: the ranks must reach
# mpirun's PMIx server, which listens on the loopback of mpirun's own
# namespace, so every rank has to run in that one namespace (ranks started
# in another one fail in MPI_Init with "OPAL ERROR: Unreachable").
#
# The flat baseline is Open MPI's ring allreduce (coll_tuned algorithm 4,
# FLAT_ALG; 0 leaves the choice to Open MPI). Per size it prints both p50
# times, the speedup, and the bytes each rank sent across machines.
#
# Needs root (namespace, dummy devices, qdiscs), Open MPI's mpirun, and ip
# and tc from iproute2. The namespace (and with it everything in it) is
# deleted on every exit, also on failure or interruption.
#
# Settings (environment): RATE (1gbit), RPN (2, ranks per machine),
# BEGIN (4M), END (64M), FACTOR (4), WARMUP (1), ITERS (5),
# COLLECTIVES (allreduce,twolevel; fp16 and bf16 may be added), FLAT_ALG
# (4), GO (go). At 1 Gbit the flat 64 MiB allreduce takes about 0.8 s per
# call: the default sweep runs in about a minute.
set -euo pipefail

RATE=${RATE:-1gbit}
RPN=${RPN:-2}
BEGIN=${BEGIN:-4M}
END=${END:-64M}
FACTOR=${FACTOR:-4}
WARMUP=${WARMUP:-1}
ITERS=${ITERS:-5}
COLLECTIVES=${COLLECTIVES:-allreduce,twolevel}
FLAT_ALG=${FLAT_ALG:-4}
GO=${GO:-go}

die() { echo "bench-twolevel: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root: it creates network namespaces, a veth pair and tc qdiscs (run: sudo scripts/bench-twolevel.sh)"
command -v mpirun >/dev/null || die "mpirun not found: install Open MPI (Debian: apt-get install -y openmpi-bin libopenmpi-dev)"
for tool in ip tc; do
	command -v "$tool" >/dev/null || die "$tool not found: install iproute2 (Debian: apt-get install -y iproute2)"
done

root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/lowbit-bench-twolevel.XXXXXX")
ns="lowbit-tl-$$-$RANDOM"
ns_made=
cleanup() {
	if [ -n "$ns_made" ]; then
		ip netns del "$ns" 2>/dev/null || echo "bench-twolevel: could not delete network namespace $ns" >&2
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

echo "bench-twolevel: network namespace $ns, machines lbtla (10.231.1.1) and lbtlb (10.231.2.1), the link between them shaped to $RATE each way (tbf burst 256kb latency 50ms)"
ip netns add "$ns"
ns_made=1
nsx=(ip netns exec "$ns")
"${nsx[@]}" ip link set lo up
# The two ends of a veth pair serve as the machines' interfaces (dummy
# devices would do, but not every kernel has them); addresses on them are
# local, so the traffic between them never crosses the pair: it is
# delivered over lo.
"${nsx[@]}" ip link add lbtla type veth peer name lbtlb
"${nsx[@]}" ip addr add 10.231.1.1/16 dev lbtla
"${nsx[@]}" ip addr add 10.231.2.1/16 dev lbtlb
"${nsx[@]}" ip link set lbtla up
"${nsx[@]}" ip link set lbtlb up
# An htb root whose unclassified traffic (default 0) goes straight out,
# unshaped; the u32 filters send A->B to class 1:10 and B->A to 1:20, each
# with a token bucket as leaf (the htb classes themselves do not limit).
"${nsx[@]}" tc qdisc add dev lo root handle 1: htb default 0
for c in 10 20; do
	"${nsx[@]}" tc class add dev lo parent 1: classid "1:$c" htb rate 100gbit quantum 200000
	"${nsx[@]}" tc qdisc add dev lo parent "1:$c" handle "$c:" tbf rate "$RATE" burst 256kb latency 50ms
done
"${nsx[@]}" tc filter add dev lo parent 1: protocol ip prio 1 u32 \
	match ip src 10.231.1.0/24 match ip dst 10.231.2.0/24 flowid 1:10
"${nsx[@]}" tc filter add dev lo parent 1: protocol ip prio 1 u32 \
	match ip src 10.231.2.0/24 match ip dst 10.231.1.0/24 flowid 1:20

np=$((2 * RPN))
mpi=(mpirun --allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1
	--mca pml ob1 --mca btl tcp,self --mca oob_tcp_if_include lo)
if [ "$FLAT_ALG" != 0 ]; then
	mpi+=(--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm "$FLAT_ALG")
fi
bench=("$tmp/lowbit" bench --backend mpi --ranks "$np" --ranks-per-node "$RPN" --collective "$COLLECTIVES"
	--b "$BEGIN" --e "$END" --f "$FACTOR" --w "$WARMUP" --n "$ITERS" --check --csv)

echo "bench-twolevel: 2 machines x $RPN ranks, sizes $BEGIN..$END x$FACTOR, $WARMUP warm-up + $ITERS timed iterations, collectives $COLLECTIVES"
run "${nsx[@]}" "${mpi[@]}" \
	-np "$RPN" env OMPI_MCA_btl_tcp_if_include=lbtla "${bench[@]}" : \
	-np "$RPN" env OMPI_MCA_btl_tcp_if_include=lbtlb "${bench[@]}" >"$tmp/shaped.csv"
# The shaping really held: bytes through each token bucket.
"${nsx[@]}" tc -s qdisc show dev lo | awk '/^qdisc tbf/ { q = $3 } /Sent/ && q { print "bench-twolevel: tbf " q " (" (q == "10:" ? "A->B" : "B->A") ") passed " $2 " bytes"; q = "" }'

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
