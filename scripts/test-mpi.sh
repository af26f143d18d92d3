#!/usr/bin/env bash
# test-mpi.sh: the multi-process tests of comm/mpi (make test-mpi).
#
# Builds the comm/mpi test binary once with the mpi build tag, runs it under
# mpirun on 1, 2, 3 and 4 ranks, then checks that jobs whose rank exits,
# finalizes early or stalls die with a clear message instead of hanging.
# Every run has a timeout, so nothing can hang CI. Exits 0 with one line
# when Open MPI is not installed.
set -u

GO=${GO:-go}
cd "$(dirname "$0")/.." || exit 1

if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1 ||
	! pkg-config --exists ompi-c 2>/dev/null; then
	echo "MPI tests skipped: Open MPI not installed (apt-get install libopenmpi-dev openmpi-bin)"
	exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bin=$tmp/mpi.test

# Containers often forbid the cross-process memory attach vader uses by
# default; copying through shared memory works everywhere.
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
# Open MPI's odls_base_sigkill_timeout (its default is 1 s): when mpirun
# gets SIGTERM, or a rank dies, it waits this long, sends the ranks
# SIGTERM, waits this long again and SIGKILLs them (scripts/lib/netns.sh,
# NETNS_MPI_STOP_S). 3 s leaves the SIGTERM test below a stop of a few
# hundred steps and the early-exit scenarios well within 30 s.
stop_s=${OMPI_MCA_odls_base_sigkill_timeout:-3}
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none --mca odls_base_sigkill_timeout "$stop_s")
# The failure scenarios below abort; they need no time to save.
mpirun_abort=(mpirun --allow-run-as-root --oversubscribe --bind-to none --mca odls_base_sigkill_timeout 1)

start=$(date +%s%N)
if ! "$GO" test -c -tags mpi -o "$bin" ./comm/mpi; then
	echo "MPI tests: building the comm/mpi test binary failed"
	exit 1
fi
echo "MPI tests: built comm/mpi test binary ($(( ($(date +%s%N) - start) / 1000000 )) ms)"

fail=0
passed=0

# run LOG CMD... runs CMD with its output in LOG and sets rc and ms.
run() {
	local log=$1
	shift
	local t0
	t0=$(date +%s%N)
	"$@" >"$log" 2>&1
	rc=$?
	ms=$(( ($(date +%s%N) - t0) / 1000000 ))
}

for n in 1 2 3 4; do
	log=$tmp/np$n.log
	run "$log" timeout -k 10 120 "${mpirun[@]}" -np "$n" "$bin" -test.timeout=100s
	if [ "$rc" -eq 0 ]; then
		echo "MPI tests: np=$n ok (${ms} ms)"
		passed=$((passed + 1))
	else
		echo "MPI tests: np=$n FAILED (exit $rc after ${ms} ms):"
		tail -n 60 "$log"
		fail=$((fail + 1))
	fi
done

# The command-line conformance check on the MPI backend: the vectors of
# world size 4 run on 4 processes, the others are listed as skipped.
lowbit=$tmp/lowbit
if "$GO" build -tags mpi -o "$lowbit" ./cmd/lowbit; then
	log=$tmp/conformance.log
	run "$log" timeout -k 10 120 "${mpirun[@]}" -np 4 "$lowbit" conformance --backend mpi internal/conformance/testdata
	if [ "$rc" -eq 0 ] && grep -q "PASS  onebit     w4" "$log"; then
		echo "MPI tests: lowbit conformance --backend mpi, np=4 ok (${ms} ms): $(tail -n 1 "$log")"
		passed=$((passed + 1))
	else
		echo "MPI tests: lowbit conformance --backend mpi, np=4 FAILED (exit $rc after ${ms} ms):"
		tail -n 40 "$log"
		fail=$((fail + 1))
	fi
	# The qgz vector of 2 nodes x 2 ranks, as 4 processes laid out 2 per node.
	log=$tmp/conformance-qgz.log
	run "$log" timeout -k 10 120 "${mpirun[@]}" -np 4 "$lowbit" conformance --backend mpi --ranks-per-node 2 internal/conformance/testdata
	if [ "$rc" -eq 0 ] && grep -q "PASS  qgz        n2x2_int4" "$log"; then
		echo "MPI tests: lowbit conformance --backend mpi --ranks-per-node 2, np=4 ok (${ms} ms): $(tail -n 1 "$log")"
		passed=$((passed + 1))
	else
		echo "MPI tests: lowbit conformance --backend mpi --ranks-per-node 2, np=4 FAILED (exit $rc after ${ms} ms):"
		tail -n 40 "$log"
		fail=$((fail + 1))
	fi
else
	echo "MPI tests: building lowbit with -tags mpi failed"
	fail=$((fail + 1))
fi

# Checkpointed MNIST training under mpirun (examples/mnist), built once for
# the soaks and the SIGTERM test below. (A run killed after a checkpoint
# and resumed, ending bit-identical to an uninterrupted run, is the short
# soak's first fault.)
mnist=$tmp/mnist
margs=(-backend mpi -data examples/mnist/testdata -optimizer onebit-adam -epochs 2 -batch 50
	-freeze-step 4 -lr 2e-3 -evals 2 -checkpoint-every 4 -quiet)
hashes() { grep -E '^[a-z-]+ final parameters: fnv64 [0-9a-f]{16}$' "$1"; }
if ! "$GO" build -tags mpi -o "$mnist" ./examples/mnist; then
	echo "MPI tests: building examples/mnist with -tags mpi failed"
	fail=$((fail + 1))
fi

# The short chaos soak (scripts/soak.sh; make soak is the long one): the
# MNIST run above under mpirun -np 4, killed (SIGKILL of one rank), then
# preempted (SIGTERM of every rank: it saves and exits 0) with a byte of a
# rank's newest checkpoint flipped, resumed each time; it must end with the
# uninterrupted run's final parameters, bit for bit. Open MPI's stop time
# is 1 s here (no SIGTERM goes through mpirun): at 3 s the kill alone took
# 6 s.
if [ -x "$mnist" ]; then
	run "$tmp/soak.log" timeout -k 10 120 env SOAK_SHORT=1 SEED=7 BIN="$mnist" GO="$GO" \
		OMPI_MCA_odls_base_sigkill_timeout=1 ./scripts/soak.sh
	if [ "$rc" -eq 0 ]; then
		echo "MPI tests: short soak (kill, term + flipped byte, -resume), np=4 ok (${ms} ms): $(grep '^onebit-adam ' "$tmp/soak.log" | tail -n 1)"
		passed=$((passed + 1))
	else
		echo "MPI tests: short soak FAILED (exit $rc after ${ms} ms):"
		tail -n 30 "$tmp/soak.log"
		fail=$((fail + 1))
	fi
fi

# The short elastic soak (scripts/soak-elastic.sh; make soak-elastic is
# the long one): 1-bit Adam and the outer optimizer (1-bit codec) under
# mpirun, preempted with a flipped byte, killed and preempted again, each
# time resumed on another number of ranks (2 -> 3 -> 2 -> 4): every resume
# must continue from the newest step every old rank held, name its path
# and pass the example's check of the carried state.
if [ -x "$mnist" ]; then
	run "$tmp/soak-elastic.log" timeout -k 10 180 env SOAK_SHORT=1 SEED=7 BIN="$mnist" GO="$GO" ./scripts/soak-elastic.sh
	if [ "$rc" -eq 0 ]; then
		echo "MPI tests: short elastic soak (2 -> 3 -> 2 -> 4 ranks, onebit-adam, diloco-1bit) ok (${ms} ms)"
		passed=$((passed + 1))
	else
		echo "MPI tests: short elastic soak FAILED (exit $rc after ${ms} ms):"
		tail -n 30 "$tmp/soak-elastic.log"
		fail=$((fail + 1))
	fi
fi

# SIGTERM to mpirun while MNIST trains (the termAtEnv hook: rank 0 sends it
# to its parent, mpirun, after step 6; Open MPI passes it on to every rank
# stop_s later and SIGKILLs them stop_s after that): every rank stops at
# the same step with its checkpoint saved, and -resume ends bit-identical
# to the uninterrupted run. The run's 1000 steps must outlast stop_s.
if [ -x "$mnist" ]; then
	# No checkpoint but the preemption's: periodic ones were 10 s of the
	# uninterrupted run's 22.
	pargs=("${margs[@]}" -epochs 100 -checkpoint-every 1000)
	run "$tmp/mnist-pwhole.log" timeout -k 10 120 "${mpirun[@]}" -np 2 "$mnist" "${pargs[@]}" -checkpoint "$tmp/ck-pwhole"
	rc_whole=$rc
	run "$tmp/mnist-term.log" timeout -k 10 120 env LOWBIT_MNIST_TERM_AT=6:parent "${mpirun[@]}" -np 2 "$mnist" "${pargs[@]}" -checkpoint "$tmp/ck-term"
	rc_term=$rc
	run "$tmp/mnist-tresume.log" timeout -k 10 120 "${mpirun[@]}" -np 2 "$mnist" "${pargs[@]}" -checkpoint "$tmp/ck-term" -resume
	stop=$(sed -n 's/^onebit-adam preempted at step \([0-9]*\) of 1000: checkpoint saved in .*/\1/p' "$tmp/mnist-term.log")
	if [ "$rc_whole" -eq 0 ] && [ "$rc_term" -ne 124 ] && [ -n "$stop" ] && [ "$rc" -eq 0 ] &&
		grep -q "^onebit-adam resumed from step $stop of 1000$" "$tmp/mnist-tresume.log" &&
		[ -n "$(hashes "$tmp/mnist-pwhole.log")" ] &&
		[ "$(hashes "$tmp/mnist-pwhole.log")" = "$(hashes "$tmp/mnist-tresume.log")" ]; then
		echo "MPI tests: mnist SIGTERM to mpirun and -resume, np=2 ok: preempted at step $stop, $(hashes "$tmp/mnist-tresume.log")"
		passed=$((passed + 1))
	else
		echo "MPI tests: mnist SIGTERM to mpirun FAILED (exits: whole $rc_whole, terminated $rc_term, resumed $rc; stop step '${stop}'):"
		if [ -z "$stop" ] && [ -n "$(hashes "$tmp/mnist-term.log")" ]; then
			echo "  the run completed before the SIGTERM reached its ranks ${stop_s} s after mpirun got it (odls_base_sigkill_timeout): lower it or raise -epochs"
		fi
		tail -n 20 "$tmp/mnist-pwhole.log" "$tmp/mnist-term.log" "$tmp/mnist-tresume.log"
		fail=$((fail + 1))
	fi
fi

# Failure scenarios (see comm/mpi/scenario_test.go). Each must end with a
# non-zero status, not by the timeout, well within it, and say why: the
# watchdog names the ranks that had not reached the collective (rank 2).
# In skip, a rank runs one allreduce fewer under context.Background(), and
# the others' 2 s collective timeout (mpi.WithCollectiveTimeout) must end
# the job within 15 s (2 s, the 1 s roll call, the stagger, mpirun's exit).
# In started, the 2 s deadline is that of a collective started beside
# another, which the watchdog guards with the first.
watchdog='lowbit/mpi: rank [0-9]+: context deadline exceeded during allreduce; aborting the MPI job because MPI cannot cancel a collective'
missing='ranks that had not reached it: \[2\]; ranks waiting in it: \[0 1\]'
timeout='lowbit/mpi: rank [01]: collective timeout of 2s \(mpi\.WithCollectiveTimeout\) exceeded during allreduce; aborting the MPI job because MPI cannot cancel a collective: rank [01] waited [23](\.[0-9]+)?s in allreduce #3 of its communicator of 3 ranks; '$missing'$'
started='lowbit/mpi: rank [01]: context deadline exceeded during alltoall; aborting the MPI job because MPI cannot cancel a collective: rank [01] waited [0-9.]+m?s in alltoall #2 of its communicator of 3 ranks; '$missing'$'
for s in exit close stall skip started; do
	limit=30000
	case $s in
	exit) want="exiting improperly|$watchdog" ;;
	skip) want=$timeout limit=15000 ;;
	started) want=$started ;;
	*) want="$watchdog: .*; $missing\$" ;;
	esac
	log=$tmp/scenario-$s.log
	# Nothing here saves a checkpoint: Open MPI's own 1 s stop time.
	run "$log" timeout -k 10 60 env LOWBIT_MPI_SCENARIO=$s "${mpirun_abort[@]}" -np 3 "$bin"
	if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && [ "$ms" -lt "$limit" ] && grep -Eq "$want" "$log"; then
		echo "MPI tests: early-$s check ok (job ended with exit $rc after ${ms} ms): $(grep -Eo "$want.*" "$log" | head -n 1)"
		passed=$((passed + 1))
	else
		echo "MPI tests: early-$s check FAILED (exit $rc after ${ms} ms; want a non-zero exit within $((limit / 1000)) s and /$want/):"
		tail -n 40 "$log"
		fail=$((fail + 1))
	fi
done

# Package quant under mpirun (quant/*_mpi_test.go): qgZ, the down-cast and
# two-level allreduces bit-identical to the in-process backend, bad calls
# failing on every rank, and the qgz and rsc conformance vectors, on 2x2,
# 3x2 and (vectors only) 2x4 layouts given explicitly; then lowbit bench
# --check of the same collectives on 3x2.
qbin=$tmp/quant.test
t0=$(date +%s%N)
if "$GO" test -c -tags mpi -o "$qbin" ./quant; then
	echo "MPI tests: built quant test binary ($(( ($(date +%s%N) - t0) / 1000000 )) ms)"
	for lay in "4 2 MPI" "6 2 MPI" "8 4 MPIConformance"; do
		read -r np rpn tests <<<"$lay"
		log=$tmp/quant-np$np.log
		run "$log" timeout -k 10 120 "${mpirun[@]}" -np "$np" "$qbin" \
			-test.run "$tests" -test.timeout=100s -ranks-per-node "$rpn"
		if [ "$rc" -eq 0 ]; then
			echo "MPI tests: quant $tests, $((np / rpn)) nodes x $rpn ranks ok (${ms} ms)"
			passed=$((passed + 1))
		else
			echo "MPI tests: quant $tests, $((np / rpn)) nodes x $rpn ranks FAILED (exit $rc after ${ms} ms):"
			tail -n 60 "$log"
			fail=$((fail + 1))
		fi
	done
else
	echo "MPI tests: building the quant test binary with -tags mpi failed"
	fail=$((fail + 1))
fi
if [ -x "$lowbit" ]; then
	log=$tmp/bench-quant.log
	run "$log" timeout -k 10 120 "${mpirun[@]}" -np 6 "$lowbit" bench --backend mpi --ranks 6 --ranks-per-node 2 \
		--collective qgz4,qgz8,rsc,fp16,bf16,twolevel -b 64Ki -e 64Ki -w 1 -n 2 --check
	if [ "$rc" -eq 0 ] && [ "$(grep -cE '^(qgz4|qgz8|rsc|fp16|bf16|twolevel) ' "$log")" -eq 6 ]; then
		echo "MPI tests: lowbit bench --check qgz4,qgz8,rsc,fp16,bf16,twolevel, 3 nodes x 2 ranks ok (${ms} ms)"
		passed=$((passed + 1))
	else
		echo "MPI tests: lowbit bench --check qgz4,qgz8,rsc,fp16,bf16,twolevel, 3 nodes x 2 ranks FAILED (exit $rc after ${ms} ms):"
		tail -n 40 "$log"
		fail=$((fail + 1))
	fi
fi

# The hang matrix under mpirun (internal/hangmatrix): every public
# collective and optimizer step with one rank given bad input, under
# context.Background(); every rank must return an error within a second.
hbin=$tmp/hangmatrix.test
if "$GO" test -c -tags mpi -o "$hbin" ./internal/hangmatrix; then
	for np in 2 4; do
		log=$tmp/hangmatrix-np$np.log
		run "$log" timeout -k 10 120 "${mpirun[@]}" -np "$np" "$hbin" -test.run MPI -test.v -test.timeout=100s
		if [ "$rc" -eq 0 ]; then
			echo "MPI tests: hang matrix, np=$np ok (${ms} ms)"
			grep -E 'matrix \|' "$log" | sed 's/^ *hangmatrix_mpi_test.go:[0-9]*: /  /'
			passed=$((passed + 1))
		else
			echo "MPI tests: hang matrix, np=$np FAILED (exit $rc after ${ms} ms):"
			tail -n 60 "$log"
			fail=$((fail + 1))
		fi
	done
else
	echo "MPI tests: building the hangmatrix test binary with -tags mpi failed"
	fail=$((fail + 1))
fi

echo "MPI tests took $(( ($(date +%s%N) - start) / 1000 / 1000000 )) s"
# The closing line, in the form CI counts.
echo "mpi: $passed passed, $fail failed"
[ "$fail" -eq 0 ]
