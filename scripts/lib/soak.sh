# shellcheck shell=bash
# scripts/lib/soak.sh: the pieces the chaos soaks share (scripts/soak.sh,
# make soak; scripts/soak-elastic.sh, make soak-elastic): starting the
# MNIST example under mpirun with its step file, waiting for it with a
# timeout, interrupting it (SIGKILL of a rank, SIGTERM of every rank or of
# mpirun), damaging a rank's newest checkpoint, reading a checkpoint's
# header and the example's lines.
#
# The caller sources it after scripts/lib/netns.sh and sets: bin (the
# example), common (its flags), prefix and mpirun (the command prefix: the
# namespace, mpirun), stepf (the step file), JOB_TIMEOUT, RANDOM (seeded);
# and keeps the counters these functions add to: fail, hangs, seen_pids,
# cur_np (the running job's ranks). start sets jobpid; finish rc;
# interrupt t_int and dt.

now_ms() { echo $(($(date +%s%N) / 1000000)); }

# rnd N sets R to 0..N-1, the next number of SEED's sequence (in this
# shell: a $(...) subshell would not advance it).
rnd() { R=$((RANDOM % $1)); }

# ckpt_int FILE NAME: the int64 entry NAME of the optim checkpoint FILE
# (in its header: the name, then the value in 8 bytes, little-endian);
# empty when FILE does not record it.
ckpt_int() {
	local off
	off=$(head -c 65536 "$1" 2>/dev/null | grep -obaF "$2" | head -n 1 | cut -d: -f1)
	[ -n "$off" ] && od -An -td8 -j $((off + ${#2})) -N8 "$1" | tr -d ' '
}

# damaged: "FILE|MTIME" of every file corrupt damaged in this trajectory;
# a file rewritten since (another mtime) is whole again.
damaged=()
is_damaged() {
	local d
	for d in "${damaged[@]}"; do
		[ "${d%%|*}" = "$1" ] && [ "${d#*|}" = "$(stat -c %y "$1" 2>/dev/null)" ] && return 0
	done
	return 1
}

# start NP DIR LOG ARGS...: starts a job in the background (jobpid).
start() {
	local np=$1 dir=$2 log=$3
	shift 3
	printf '%10d\n' 0 >"$stepf"
	"${prefix[@]}" env LOWBIT_MNIST_STEP_FILE="$stepf" "${mpirun[@]}" -np "$np" "$bin" "${common[@]}" -checkpoint "$dir" "$@" >"$log" 2>&1 &
	jobpid=$!
}

step_now() {
	local s
	read -r s <"$stepf" 2>/dev/null
	echo "${s:-0}"
}

# ranks: "RANK PID" of the job's rank processes.
ranks() {
	local p r
	for p in $(pgrep -P "$jobpid" 2>/dev/null); do
		r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
		[ -n "$r" ] && echo "$r $p"
	done
}

# finish: waits for the job, JOB_TIMEOUT at most (a hang is killed and
# counted); sets rc.
finish() {
	local deadline=$(($(date +%s) + JOB_TIMEOUT)) p
	while kill -0 "$jobpid" 2>/dev/null; do
		if [ "$(date +%s)" -ge "$deadline" ]; then
			echo "soak: HANG: job $jobpid still running after ${JOB_TIMEOUT}s; killing it" >&2
			for p in $(pgrep -P "$jobpid"); do kill -KILL "$p" 2>/dev/null; done
			kill -KILL "$jobpid" 2>/dev/null
			hangs=$((hangs + 1))
			fail=1
			break
		fi
		sleep 0.02
	done
	wait "$jobpid"
	rc=$?
}

hash_of() { sed -n 's/^[a-z0-9-]* final parameters: fnv64 \([0-9a-f]\{16\}\)$/\1/p' "$1"; }
acc_of() { awk -v o="$2" '$1 == o && $2 ~ /%$/ { sub("%", "", $2); print $2; exit }' "$1"; }
resumed_of() { sed -n 's/^mnist: -resume: [a-z0-9-]* continues from step \([0-9]*\) of .*/\1/p' "$1" | head -n 1; }

# interrupt KIND: interrupts the running job; sets t_int (when, in ms
# since the epoch) and dt (ms to its exit).
interrupt() {
	local kind=$1 t0 r p list
	list=$(ranks)
	for p in $(echo "$list" | awk '{ print $2 }'); do seen_pids+=("$p"); done
	t0=$(now_ms)
	case $kind in
	kill)
		rnd "$cur_np"
		r=$R
		p=$(echo "$list" | awk -v r="$r" '$1 == r { print $2 }')
		[ -n "$p" ] && kill -KILL "$p"
		;;
	term) for p in $(echo "$list" | awk '{ print $2 }'); do kill -TERM "$p"; done ;;
	term-mpirun) kill -TERM "$jobpid" ;;
	esac
	t_int=$t0
	finish
	dt=$(($(now_ms) - t0))
}

# corrupt KIND DIR OPT: flips a byte in, or truncates, a random rank's
# newest checkpoint file.
corrupt() {
	local kind=$1 dir=$2 opt=$3 r f size off b
	rnd "$cur_np"
	r=$R
	f=$(ls -t "$dir/$opt.rank$r".*.ckpt 2>/dev/null | head -n 1)
	[ -n "$f" ] || return 1
	size=$(stat -c %s "$f")
	if [ "$kind" = flip ]; then
		off=$(((RANDOM * 32768 + RANDOM) % size))
		b=$(od -An -tu1 -j "$off" -N1 "$f" | tr -d ' ')
		printf "$(printf '\\%03o' $(((b ^ 0x5a) & 255)))" | dd of="$f" bs=1 seek="$off" conv=notrunc status=none
	else
		truncate -s $((size / 2)) "$f"
	fi
	damaged+=("$f|$(stat -c %y "$f")")
	echo "soak:   $kind $(basename "$f") (rank $r)"
}

median_max() {
	if [ $# -eq 0 ]; then
		echo "- -"
		return
	fi
	printf '%s\n' "$@" | sort -n | awk '{ a[NR] = $1 } END { printf "%.2fs %.2fs\n", a[int((NR + 1) / 2)] / 1000, a[NR] / 1000 }'
}

# soak_setup: the job's binary (BIN, else examples/mnist built with -tags
# mpi), and unless SHORT=1 a namespace whose loopback NETEM impairs; sets
# bin, prefix (the command that runs mpirun in the namespace), mpirun and
# impaired (the impairment applied, "none" in the short form).
# soak_check_optimizers NAME KNOWN...: exits 2 with one line unless every
# word of $OPTIMIZERS is one of KNOWN (the soak's variants and the MNIST
# example's -optimizer names), before anything is built or started: a name
# the soak does not know, or a comma-separated list, would otherwise fail
# every job of every trajectory until SOAK_S runs out.
soak_check_optimizers() {
	local name=$1 o
	shift
	local known=" $* "
	for o in $OPTIMIZERS; do
		case $known in
		*" $o "*) ;;
		*)
			echo "$name: OPTIMIZERS: unknown \"$o\" (want space-separated names of: $*)" >&2
			exit 2
			;;
		esac
	done
	if [ -z "${OPTIMIZERS// /}" ]; then
		echo "$name: OPTIMIZERS is empty (want space-separated names of: $*)" >&2
		exit 2
	fi
}

# mnist_optimizers are the MNIST example's -optimizer names.
mnist_optimizers="adam lamb onebit-adam onebit-adam-compact onebit-adam-sharded onebit-adam-sharded-bf16 onebit-lamb onebit-lamb-compact zeroone-adam zero-adam diloco muon onebit-muon"

soak_setup() {
	bin=${BIN:-}
	if [ -z "$bin" ]; then
		bin=$NETNS_TMP/mnist
		"$GO" build -tags mpi -o "$bin" ./examples/mnist || netns_die "building examples/mnist with -tags mpi failed"
	fi
	prefix=()
	mpirun=("${NETNS_MPIRUN[@]}")
	impaired="none"
	if [ "$SHORT" != 1 ]; then
		netns_new ns soak
		netns_impair "$ns" lo $NETEM
		impaired=$NETNS_IMPAIRED
		prefix=(ip netns exec "$ns")
		mpirun+=("${NETNS_MPI_LO[@]}")
	fi
}
