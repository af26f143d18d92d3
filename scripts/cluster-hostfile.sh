#!/usr/bin/env bash
# cluster-hostfile.sh: the Open MPI hostfile recipe of docs/cluster.md, run
# for real on one machine. Two "machines", A and B, are network namespaces
# of their own, each with a host name of its own (a UTS namespace), joined
# by a veth pair (lbcla in A, 10.233.1.1; lbclb in B, 10.233.2.1). A
# hostfile names them by address. mpirun runs in A; it starts Open MPI's
# daemon on B through an rsh agent (plm_rsh_agent) that runs the daemon's
# command in namespace B where a cluster would use ssh. Ranks of one
# machine talk over shared memory, ranks of different machines over TCP
# through the veth pair: btl_tcp_if_include and oob_tcp_if_include name
# its network, 10.233.0.0/16, as they would name a cluster's interface.
#
# The job is the MNIST example (examples/mnist, built with -tags mpi) on
# its small test set (examples/mnist/testdata: no download), 1-bit Adam:
#
#  1. the whole job on 2 machines x 2 ranks: it must finish, and the veth
#     pair must have carried its cross-machine traffic;
#  2. the same job with checkpoints every CKPT_EVERY steps into a
#     directory both machines see (one file system here; a shared one on a
#     cluster), until machine B is lost: once every rank has saved twice,
#     every process in B (its Open MPI daemon and ranks) is killed and its
#     end of the link taken down; mpirun must end the job with an error
#     instead of hanging;
#  3. the job resumed with -resume on the machine left, A, with 2 ranks
#     and a hostfile naming A only: it must continue from the newest
#     checkpoint every old rank saved, the 1-bit optimizer's error feedback
#     carried from 4 ranks to 2 (onebit.Regroup), and finish.
#
# Needs root (namespaces, a veth pair), Open MPI (mpirun, and
# libopenmpi-dev to build with -tags mpi), ip from iproute2 and unshare.
# scripts/lib/netns.sh makes the namespaces and removes them (and what
# still runs in them) on every exit, also on failure or interruption. All
# traffic stays on this machine. It takes well under a minute.
#
# Settings (environment): EPOCHS (60: the job of steps 2 and 3, 7 steps per
# epoch), CKPT_EVERY (10), RPN (2, ranks per machine), TIMEOUT (180 s per
# mpirun), MNIST_FLAGS (more flags of the example), GO (go).
set -euo pipefail

EPOCHS=${EPOCHS:-60}
CKPT_EVERY=${CKPT_EVERY:-10}
RPN=${RPN:-2}
TIMEOUT=${TIMEOUT:-180}
MNIST_FLAGS=${MNIST_FLAGS:-}
GO=${GO:-go}

. "$(dirname "$0")/lib/netns.sh"
netns_init cluster-hostfile
netns_require_root "it creates network namespaces and a veth pair (run: sudo scripts/cluster-hostfile.sh)"
netns_require_mpi headers
command -v unshare >/dev/null || netns_die "cannot run: unshare not found (util-linux)"

root=$(cd "$(dirname "$0")/.." && pwd)
echo "cluster-hostfile: building examples/mnist with -tags mpi"
(cd "$root" && "$GO" build -tags mpi -o "$NETNS_TMP/mnist" ./examples/mnist)

netns_new nsa cla
netns_new nsb clb
netns_join "$nsa" lbcla 10.233.1.1/16 "$nsb" lbclb 10.233.2.1/16
echo "cluster-hostfile: machines A (namespace $nsa, 10.233.1.1) and B ($nsb, 10.233.2.1) joined by a veth pair"
netns_rsh_agent "$NETNS_TMP/agent" "$nsa" 10.233.2.1 "$nsb"
printf '10.233.1.1 slots=%d\n10.233.2.1 slots=%d\n' "$RPN" "$RPN" >"$NETNS_TMP/hosts"
printf '10.233.1.1 slots=%d\n' "$RPN" >"$NETNS_TMP/hosts-a"
echo "cluster-hostfile: hostfile:"
sed 's/^/    /' "$NETNS_TMP/hosts"

# mpirun as a cluster's would run: the hostfile, the launcher (here the
# agent instead of ssh), the interface of the machines' network for both
# Open MPI's own traffic (oob) and the ranks' (btl), ranks placed machine
# by machine (node-major).
mpi=("${NETNS_MPIRUN[@]}" --map-by slot --mca plm_rsh_agent "$NETNS_TMP/agent"
	--mca oob_tcp_if_include 10.233.0.0/16 --mca pml ob1 --mca btl vader,tcp,self
	--mca btl_tcp_if_include 10.233.0.0/16 --mca btl_tcp_disable_family 6
	--mca btl_vader_single_copy_mechanism none)
netns_host host_a "$nsa"
ckdir=$NETNS_TMP/checkpoints
# shellcheck disable=SC2206 # MNIST_FLAGS is a list of flags
job=("$NETNS_TMP/mnist" -backend mpi -data "$root/examples/mnist/testdata" -optimizer onebit-adam
	-batch 64 -freeze-step 10 -evals 1 -quiet $MNIST_FLAGS)
np=$((2 * RPN))

# sent NS DEV prints the bytes DEV in NS has sent.
sent() { ip netns exec "$1" cat "/sys/class/net/$2/statistics/tx_bytes"; }

echo
echo "cluster-hostfile: 1. the whole job, 2 machines x $RPN ranks (mpirun -np $np --hostfile hosts)"
rc=0
netns_run "${host_a[@]}" timeout --kill-after=10 "$TIMEOUT" "${mpi[@]}" --hostfile "$NETNS_TMP/hosts" -np "$np" \
	"${job[@]}" -epochs 4 >"$NETNS_TMP/whole.out" 2>&1 || rc=$?
sed 's/^/    /' "$NETNS_TMP/whole.out"
[ "$rc" -eq 0 ] || netns_die "the job on 2 machines failed (exit $rc)"
ab=$(sent "$nsa" lbcla)
ba=$(sent "$nsb" lbclb)
echo "cluster-hostfile: the veth pair carried $ab bytes A->B and $ba bytes B->A"
[ "$ab" -gt 1000000 ] && [ "$ba" -gt 1000000 ] ||
	netns_die "the ranks did not talk across the machines (less than 1 MB each way)"

echo
echo "cluster-hostfile: 2. the job with checkpoints every $CKPT_EVERY steps into $ckdir, until machine B is lost"
netns_run "${host_a[@]}" timeout --kill-after=10 "$TIMEOUT" "${mpi[@]}" --hostfile "$NETNS_TMP/hosts" -np "$np" \
	"${job[@]}" -epochs "$EPOCHS" -checkpoint "$ckdir" -checkpoint-every "$CKPT_EVERY" >"$NETNS_TMP/lost.out" 2>&1 &
job_pid=$!
_netns_child=$job_pid # netns.sh's signal handler stops it
# saved_twice reports whether every rank has written both of its
# checkpoint slots.
saved_twice() {
	local r
	for r in $(seq 0 $((np - 1))); do
		[ -f "$ckdir/onebit-adam.rank$r.0.ckpt" ] && [ -f "$ckdir/onebit-adam.rank$r.1.ckpt" ] || return 1
	done
}
for _ in $(seq 1 1200); do
	saved_twice && break
	kill -0 "$job_pid" 2>/dev/null || break
	sleep 0.05
done
saved_twice || netns_die "the job ended or stalled before every rank saved twice: $(tail -3 "$NETNS_TMP/lost.out")"
pids=$(ip netns pids "$nsb")
echo "cluster-hostfile: every rank saved twice; machine B is lost: its $(echo "$pids" | wc -w) processes killed, its link down"
# shellcheck disable=SC2086 # a list of pids
kill -KILL $pids
ip -n "$nsb" link set lbclb down
rc=0
wait "$job_pid" || rc=$?
_netns_child=
sed "s/^/    /" "$NETNS_TMP/lost.out"
[ "$rc" -ne 0 ] || netns_die "the job finished before machine B was lost (raise EPOCHS)"
[ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || netns_die "mpirun hung after machine B was lost (stopped after $TIMEOUT s)"
echo "cluster-hostfile: the job ended with exit $rc; checkpoints left:"
ls "$ckdir" | sed 's/^/    /'

echo
echo "cluster-hostfile: 3. the job resumed on machine A alone, $RPN ranks (mpirun -np $RPN --hostfile hosts-a, -resume)"
rc=0
netns_run "${host_a[@]}" timeout --kill-after=10 "$TIMEOUT" "${mpi[@]}" --hostfile "$NETNS_TMP/hosts-a" -np "$RPN" \
	"${job[@]}" -epochs "$EPOCHS" -checkpoint "$ckdir" -checkpoint-every "$CKPT_EVERY" -resume >"$NETNS_TMP/resumed.out" 2>&1 || rc=$?
sed 's/^/    /' "$NETNS_TMP/resumed.out"
[ "$rc" -eq 0 ] || netns_die "the resumed job failed (exit $rc)"
grep -q "onebit-adam resumed on $RPN ranks from a checkpoint of $np ranks: error feedback carried over (onebit.Regroup)" "$NETNS_TMP/resumed.out" ||
	netns_die "the resumed job does not say that it continued the $np-rank checkpoint on $RPN ranks"
echo
echo "cluster-hostfile: ok: the job ran across 2 machines from a hostfile, ended when machine B was lost, and resumed on machine A from its checkpoints"
