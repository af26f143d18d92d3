# shellcheck shell=bash
# scripts/lib/netns.sh: the shaped-network harness every script of lowbit
# that needs a slow or lossy network sources (bench-net, bench-twolevel,
# demo-net, plan-calibrate, soak). It creates network namespaces (one, or
# two joined by a veth pair), shapes or impairs their links with tc (a tbf
# token bucket, netem), runs commands inside them in the background so that
# a signal is handled at once, and always cleans up: on every exit, also on
# failure or interruption, it kills what still runs in its namespaces,
# deletes them and removes its temporary directory.
#
# Use:
#
#	. "$(dirname "$0")/lib/netns.sh"
#	netns_init demo-net                  # message prefix; traps; $NETNS_TMP
#	netns_require_root "it creates a network namespace and a tc qdisc"
#	netns_require_mpi headers            # mpirun (and libopenmpi-dev)
#	netns_new ns demo                    # ns=lowbit-demo-PID-N, lo up
#	netns_shape "$ns" lo 1gbit           # tbf rate 1gbit burst 256kb latency 50ms (netns_tbf)
#	netns_run ip netns exec "$ns" "${NETNS_MPIRUN[@]}" -np 4 "${NETNS_MPI_LO[@]}" prog
#	netns_del "$ns"                      # or leave it to the exit trap
#
# Two machines: netns_new twice, netns_join them with a veth pair,
# netns_shape each end; mpirun runs in one as its own host (netns_host) and starts the
# other's ranks through netns_rsh_agent (scripts/bench-twolevel.sh).
#
# Every function reports a failure as "PREFIX: message" on stderr; the
# netns_require_* functions and netns_new exit 1 on failure. Needs bash,
# ip and tc from iproute2 (two machines: unshare from util-linux).

# NETNS_MPI_STOP_S is Open MPI's odls_base_sigkill_timeout, in seconds
# (default: $OMPI_MCA_odls_base_sigkill_timeout, else 3; Open MPI's own
# default is 1). When mpirun gets SIGTERM or SIGINT, or a rank dies, it
# waits this long, sends SIGTERM to the ranks (it cannot forward SIGTERM at
# once), waits this long again and SIGKILLs them. So it is both how late
# the ranks hear of a SIGTERM sent to mpirun and how long they then have to
# stop at a step boundary, save and exit; and a job whose rank died ends
# within twice this. 3 s covers the MNIST example's stop (0.15 s) on a
# loaded machine, and keeps the soak's interrupted jobs ending within its
# 10 s goal; a model whose step plus save takes longer needs more (see
# docs/mnist.md, Preemption).
NETNS_MPI_STOP_S=${OMPI_MCA_odls_base_sigkill_timeout:-3}

# NETNS_MPIRUN is mpirun as every script starts it: as root, more ranks
# than cores, not bound to cores, waiting ranks yielding the CPU
# (mpi_yield_when_idle), since spinning ranks would otherwise steal it from
# computing ones on a small machine, and NETNS_MPI_STOP_S to stop.
NETNS_MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1
	--mca odls_base_sigkill_timeout "$NETNS_MPI_STOP_S")

# NETNS_MPI_LO makes Open MPI's ranks talk over TCP on the loopback only,
# so that a qdisc on lo sees (and shapes) all of their traffic.
NETNS_MPI_LO=(--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)

# NETNS_TBF, when set, is the token bucket's burst and latency for every
# rate (netns_shape adds the rate). Unset, netns_tbf chooses them: bench.md's
# "burst 256kb latency 50ms" ("Bandwidth-limited runs") from 20 Mbit/s up,
# where 256 kB is at most 100 ms of traffic; below that, where a 256 kB
# burst would let an exchange of tens of kB pass at loopback speed (2 s of
# traffic at 1 Mbit/s), a burst of 20 ms of traffic (at least 4 kB), a
# 1500-byte MTU on the shaped device (netns_shape sets it: the loopback's
# 64 kB packets would not fit the burst) and a deep queue (latency 1s, a
# home router's buffer rather than drops).
NETNS_TBF=${NETNS_TBF:-}

_netns_prefix=lowbit
_netns_list=()
_netns_child=
_netns_seq=0
NETNS_TMP=

# netns_die MESSAGE prints "PREFIX: MESSAGE" on stderr and exits 1.
netns_die() {
	echo "$_netns_prefix: $*" >&2
	exit 1
}

# netns_init PREFIX sets the message prefix, makes the temporary directory
# NETNS_TMP and installs the traps: EXIT cleans up; INT and TERM stop the
# running child (netns_run) and exit 130 and 143.
netns_init() {
	_netns_prefix=$1
	NETNS_TMP=$(mktemp -d "${TMPDIR:-/tmp}/lowbit-$1.XXXXXX")
	trap netns_cleanup EXIT
	trap '_netns_signal 130' INT
	trap '_netns_signal 143' TERM
}

# netns_require_root WHY exits unless the script runs as root.
netns_require_root() {
	[ "$(id -u)" -eq 0 ] || netns_die "cannot run: needs root: $1 (run it with sudo)"
	local tool
	for tool in ip tc timeout; do
		command -v "$tool" >/dev/null ||
			netns_die "cannot run: $tool not found; install iproute2 and coreutils (Debian: apt-get install -y iproute2)"
	done
}

# netns_require_mpi [headers] exits unless mpirun is installed and, with
# the argument headers, the Open MPI headers a -tags mpi build needs.
netns_require_mpi() {
	command -v mpirun >/dev/null ||
		netns_die "cannot run: mpirun not found; install Open MPI (Debian: apt-get install -y openmpi-bin libopenmpi-dev)"
	if [ "${1:-}" = headers ]; then
		pkg-config --exists ompi-c 2>/dev/null ||
			netns_die "cannot run: Open MPI headers not found (pkg-config ompi-c), needed to build with -tags mpi; install libopenmpi-dev"
	fi
}

# netns_new VAR TAG creates the namespace lowbit-TAG-PID-N, brings its
# loopback up, registers it for clean-up and stores its name in VAR.
netns_new() {
	local var=$1 tag=$2 name
	_netns_seq=$((_netns_seq + 1))
	name="lowbit-$tag-$$-$_netns_seq"
	# Registered first, so that a signal between the two lines still
	# removes it.
	_netns_list+=("$name")
	ip netns add "$name" || netns_die "cannot run: could not create network namespace $name (ip netns add needs CAP_SYS_ADMIN)"
	ip -n "$name" link set lo up
	printf -v "$var" '%s' "$name"
}

# netns_bits RATE prints RATE (tc's units: 1gbit, 100mbit, 500kbit, 2mbps)
# in bits per second, or exits non-zero for a rate it cannot read.
netns_bits() {
	awk -v r="$1" 'BEGIN {
		if (match(r, /^[0-9.]+/) == 0) exit 1
		n = substr(r, 1, RLENGTH); u = tolower(substr(r, RLENGTH + 1))
		m["bit"] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9; m["tbit"] = 1e12
		m["bps"] = 8; m["kbps"] = 8e3; m["mbps"] = 8e6; m["gbps"] = 8e9
		if (!(u in m)) exit 1
		printf "%.0f\n", n * m[u]
	}'
}

# netns_small_burst RATE succeeds where netns_tbf shapes RATE with the
# small burst and MTU (below 20 Mbit/s, NETNS_TBF unset).
netns_small_burst() {
	local bits
	[ -z "$NETNS_TBF" ] && bits=$(netns_bits "$1") && [ "$bits" -lt 20000000 ]
}

# netns_tbf RATE prints the tbf options netns_shape uses for RATE: "rate
# RATE" and NETNS_TBF, or the burst and latency chosen for it (above).
netns_tbf() {
	if [ -n "$NETNS_TBF" ]; then
		echo "rate $1 $NETNS_TBF"
	elif netns_small_burst "$1"; then
		local burst=$(($(netns_bits "$1") / 8 / 50))
		[ "$burst" -ge 4096 ] || burst=4096
		echo "rate $1 burst ${burst}b latency 1s, mtu 1500"
	else
		echo "rate $1 burst 256kb latency 50ms"
	fi
}

# netns_shape NS DEV RATE puts a token bucket of RATE (tc's units: 1gbit,
# 100mbit) on DEV's egress in NS, replacing its root qdisc, with netns_tbf's
# options (and, below 20 Mbit/s, DEV's MTU at 1500 bytes).
netns_shape() {
	local opts
	opts=$(netns_tbf "$3")
	if [[ $opts == *", mtu 1500" ]]; then
		opts=${opts%, mtu 1500}
		ip -n "$1" link set dev "$2" mtu 1500 ||
			netns_die "cannot run: could not set the MTU of $2 in $1 to 1500"
	fi
	# shellcheck disable=SC2086 # opts is a list of tc words
	tc -n "$1" qdisc replace dev "$2" root tbf $opts ||
		netns_die "cannot run: tc could not shape $2 to $3 in $1 (tc's message above; a kernel without sch_tbf fails here too)"
}

# netns_impair NS DEV NETEM... puts netem with the given impairment (e.g.
# loss 1% delay 5ms 2ms reorder 10%) on DEV's egress in NS, replacing its
# root qdisc. netem's own rate option shapes too: "rate 1gbit loss 1%".
#
# A kernel built without sch_netem (some cloud and VM kernels) cannot
# delay or reorder. There the loss alone is applied, by iptables dropping
# that share of the packets DEV receives (the statistic match), and a line
# on stderr says what was left out; NETNS_IMPAIRED tells the caller what
# was applied ("netem ..." or "iptables loss X%").
NETNS_IMPAIRED=
netns_impair() {
	local ns=$1 dev=$2
	shift 2
	if tc -n "$ns" qdisc replace dev "$dev" root netem "$@" 2>/dev/null; then
		NETNS_IMPAIRED="netem $*"
		return 0
	fi
	local loss="" prev=""
	local a
	for a in "$@"; do
		[ "$prev" != loss ] || loss=${a%\%}
		prev=$a
	done
	if [ -z "$loss" ]; then
		netns_die "cannot run: tc could not apply netem $* on $dev in $ns: this kernel has no sch_netem, and the impairment has no loss to apply another way"
	fi
	command -v iptables >/dev/null ||
		netns_die "cannot run: this kernel has no sch_netem; the loss fallback needs iptables (Debian: apt-get install -y iptables)"
	local p
	p=$(awk -v l="$loss" 'BEGIN { printf "%.6f", l / 100 }')
	ip netns exec "$ns" iptables -A INPUT -i "$dev" -m statistic --mode random --probability "$p" -j DROP ||
		netns_die "cannot run: iptables could not drop $loss% of the packets on $dev in $ns (its message above)"
	NETNS_IMPAIRED="iptables loss $loss%"
	echo "$_netns_prefix: this kernel has no sch_netem: applying only the loss ($loss% of packets dropped on $dev by iptables); not applied: netem $*" >&2
}

# netns_join NSA DEVA ADDRA NSB DEVB ADDRB joins two namespaces with a
# veth pair: DEVA in NSA with address ADDRA (CIDR), DEVB in NSB with ADDRB.
netns_join() {
	ip -n "$1" link add "$2" type veth peer name "$5" netns "$4" ||
		netns_die "cannot run: could not create the veth pair $2/$5"
	ip -n "$1" addr add "$3" dev "$2"
	ip -n "$4" addr add "$6" dev "$5"
	ip -n "$1" link set "$2" up
	ip -n "$4" link set "$5" up
}

# netns_host VAR NS stores in the array VAR the command prefix that runs a
# command in NS under a host name of its own (lowbit-NS, in a UTS
# namespace), so that Open MPI takes NS for a machine of its own: its ranks
# talk over shared memory inside it and over the network to other
# machines. Every stage execs the next, so that netns_run's signal reaches
# the command itself: netns_run "${VAR[@]}" mpirun ...
netns_host() {
	local -n _netns_host_var=$1
	# shellcheck disable=SC2016 # $0 and $@ are the inner shell's
	_netns_host_var=(ip netns exec "$2" unshare --uts sh -c 'hostname "lowbit-$0"; exec "$@"' "$2")
}

# netns_rsh_agent FILE NS [ADDR NSADDR]... writes to FILE an rsh agent for
# mpirun (--mca plm_rsh_agent FILE), used in place of ssh to start Open
# MPI's daemon of a host: "FILE HOST COMMAND..." runs COMMAND in the
# namespace NSADDR listed for the address HOST (NS for a host not listed),
# as a host of its own like netns_host.
netns_rsh_agent() {
	local file=$1 ns=$2 cases=""
	shift 2
	while [ $# -ge 2 ]; do
		cases+="$1) ns=$2 ;;"$'\n'
		shift 2
	done
	cat >"$file" <<AGENT
#!/bin/sh
host=\$1
shift
case "\$host" in
${cases}*) ns=$ns ;;
esac
exec ip netns exec "\$ns" unshare --uts sh -c "hostname lowbit-\$ns; \$*"
AGENT
	chmod +x "$file"
}

# netns_sent NS DEV prints the bytes DEV's root qdisc in NS has passed.
netns_sent() {
	tc -n "$1" -s qdisc show dev "$2" | awk '/^qdisc/ { q = NR == 1 } /Sent/ && q { print $2; exit }'
}

# netns_run CMD... runs CMD in the background and waits for it, so that
# INT and TERM are handled at once (the handler stops CMD); it returns
# CMD's exit status.
netns_run() {
	local rc=0
	"$@" &
	_netns_child=$!
	wait "$_netns_child" || rc=$?
	_netns_child=
	return "$rc"
}

# netns_del NS kills what still runs in NS (a rank or daemon that outlived
# an interrupted run), deletes NS and forgets it. Deleting one already gone
# is not an error.
netns_del() {
	local ns=$1 pids i
	if [ -e "/run/netns/$ns" ]; then
		pids=$(ip netns pids "$ns" 2>/dev/null || true)
		if [ -n "$pids" ]; then
			# shellcheck disable=SC2086 # a list of pids
			kill -KILL $pids 2>/dev/null || true
		fi
		ip netns del "$ns" 2>/dev/null ||
			echo "$_netns_prefix: could not delete network namespace $ns (ip netns del $ns)" >&2
	fi
	for i in "${!_netns_list[@]}"; do
		[ "${_netns_list[$i]}" != "$ns" ] || unset '_netns_list[i]'
	done
}

# netns_cleanup deletes every namespace netns_new made and the temporary
# directory; the EXIT trap calls it.
netns_cleanup() {
	local ns
	for ns in "${_netns_list[@]}"; do
		netns_del "$ns"
	done
	[ -z "$NETNS_TMP" ] || rm -rf "$NETNS_TMP"
}

_netns_signal() {
	echo "$_netns_prefix: interrupted; stopping the run and removing the namespaces" >&2
	if [ -n "$_netns_child" ]; then
		kill -TERM "$_netns_child" 2>/dev/null || true
		wait "$_netns_child" 2>/dev/null || true
	fi
	exit "$1"
}
