#!/usr/bin/env bash
# soak.sh: the chaos soak of checkpointed training (make soak).
#
# Trains the MNIST example (examples/mnist) under mpirun on 4 ranks inside a
# network namespace whose loopback is impaired (NETEM, through
# scripts/lib/netns.sh), and interrupts it again and again at random steps
# drawn from SEED: SIGKILL of one random rank ("kill"), SIGTERM of every rank
# as a scheduler preempting the job would ("term"), SIGTERM of mpirun
# ("term-mpirun"); after a term, sometimes a byte of one rank's newest
# checkpoint is flipped ("flip") or the file cut in half ("truncate") before
# the resume. Each time it resumes with -resume, until the run completes,
# and compares the final parameters (the example's fnv64 hash) with an
# uninterrupted run of the same flags: they must be bit-identical. It does
# this for 1-bit Adam, 1-bit Adam with its moments sharded over the ranks
# (onebit-adam-sharded), 0/1 Adam, zero-adam with int4 and the outer
# optimizer (diloco), in rounds, until
# the optimizer's share of SOAK_S is spent, and resumes a run on 3 ranks
# (shrink) and back on 4 (grow), which must end within 1 point of the
# uninterrupted run's test accuracy (bit-identity is not expected there:
# the error feedback is regrouped by onebit.Regroup, the worker errors
# averaged), with the first optimizer of the list and, when listed, with
# onebit-adam-sharded (whose moments are re-sharded).
#
# Every resume is checked against what was saved: before each job started
# with -resume the script reads, from the checkpoint directory, the newest
# step every rank holds (the files it damaged itself excluded). The job must
# continue from exactly that step; a job that refuses to resume although
# such a step exists fails the round (a refusal is a restart from step 0
# only where no step was held by every rank). The first interruption of a
# run from step 0 comes after its first checkpoint is on every rank, so
# that every round resumes at least once; a round without a resume fails.
# 0/1 Adam runs with -freeze-step 50 and -local-step-scaler 16, so that
# its phase B takes local steps and resumes land between two
# synchronizations (the example says so on the resume; the table counts
# them).
#
# It prints a table per optimizer: rounds, resumes (and of them those
# between two synchronizations of 0/1 Adam), interruptions by kind,
# restarts from step 0, steps redone (done before an interruption and done
# again after it), the time from the interruption to the job's exit
# (median and max; the goal is under 10 s), and how many rounds ended with
# the uninterrupted hash. It checks that no rank process and no namespace
# is left behind. It exits non-zero unless every hash matches, every round
# resumed at least once and every resume continued from the newest step
# every rank held, every job ended in time, every SIGTERM-ed job saved its
# checkpoint, and nothing was left behind.
#
# Settings (environment):
#   SOAK_S      duration in seconds (default 600); interruptions stop then
#               (but the first of each round), and the runs under way finish
#   SEED        the fault schedule (default: the time; printed)
#   NETEM       the impairment (default "loss 1% delay 5ms 2ms reorder 10%";
#               a kernel without sch_netem gets the loss only, and a line
#               says so)
#   OPTIMIZERS  default "onebit-adam onebit-adam-sharded zeroone-adam
#               zero-adam diloco" (diloco: the outer optimizer, 1-bit
#               codec, H 20 in 4 fragments with exchanges in flight for 2
#               steps, so that interruptions land mid-period and with an
#               exchange in flight)
#   LOCAL_STEP_SCALER, ZO_FREEZE_STEP  0/1 Adam's -local-step-scaler
#               (default 16) and -freeze-step (its VarFreezeStep, default 50):
#               phase B from step 51, its synchronizations 16 steps apart
#               from step 115, so that most resumes fall between two
#   DATA        MNIST directory (default data/mnist; make mnist-data)
#   EPOCHS      per run (default 1: 468 steps); EVERY: -checkpoint-every (25)
#   BIN         a prebuilt examples/mnist binary with -tags mpi (else built)
#   SOAK_SHORT=1  the short soak of make test: no namespace, no root, the
#               small testdata set, one optimizer, one round of two
#               interruptions (a kill, then a term with a flipped byte)
set -u

GO=${GO:-go}
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=scripts/lib/netns.sh
. scripts/lib/netns.sh
# shellcheck source=scripts/lib/soak.sh
. scripts/lib/soak.sh
netns_init soak

SHORT=${SOAK_SHORT:-0}
SOAK_S=${SOAK_S:-600}
SEED=${SEED:-$(date +%s)}
NETEM=${NETEM:-loss 1% delay 5ms 2ms reorder 10%}
NP=4
RANDOM=$SEED
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}

if [ "$SHORT" = 1 ]; then
	if ! command -v mpirun >/dev/null 2>&1 || ! pkg-config --exists ompi-c 2>/dev/null; then
		echo "soak: skipped: Open MPI not installed"
		exit 0
	fi
	OPTIMIZERS=${OPTIMIZERS:-onebit-adam}
	DATA=${DATA:-examples/mnist/testdata}
	EPOCHS=${EPOCHS:-30}
	EVERY=${EVERY:-20}
	common=(-batch 50 -lr 2e-3 -freeze-step 20)
	JOB_TIMEOUT=60
else
	netns_require_root "it creates a network namespace and impairs its loopback"
	netns_require_mpi headers
	OPTIMIZERS=${OPTIMIZERS:-onebit-adam onebit-adam-sharded zeroone-adam zero-adam diloco}
	DATA=${DATA:-data/mnist}
	EPOCHS=${EPOCHS:-1}
	EVERY=${EVERY:-25}
	common=(-freeze-step 100)
	JOB_TIMEOUT=300
fi
soak_check_optimizers soak $mnist_optimizers
[ -e "$DATA/train-images-idx3-ubyte.gz" ] || [ -e "$DATA/train-images-idx3-ubyte" ] ||
	netns_die "cannot run: no MNIST files in $DATA (make mnist-data)"
common+=(-backend mpi -data "$DATA" -epochs "$EPOCHS" -checkpoint-every "$EVERY" -evals 1 -quiet)
soak_setup

t_start=$(date +%s)

fail=0
stepf=$NETNS_TMP/step
seen_pids=()

# optargs NAME: the flags of optimizer NAME.
optargs() {
	case $1 in
	zero-adam) echo "-optimizer zero-adam -reduce int4" ;;
	zeroone-adam) echo "-optimizer zeroone-adam -freeze-step ${ZO_FREEZE_STEP:-50} -local-step-scaler ${LOCAL_STEP_SCALER:-16}" ;;
	diloco) echo "-optimizer diloco -outer-codec 1bit -outer-h 20 -outer-fragments 4 -outer-delay 2" ;;
	*) echo "-optimizer $1" ;;
	esac
}


# held_step DIR OPT NP: the newest step of which every one of NP ranks
# holds a whole checkpoint file made on NP ranks (of the same generation),
# empty when there is none: where -resume on NP ranks must continue.
held_step() {
	local dir=$1 opt=$2 np=$3 r f keys common="" kept k
	for ((r = 0; r < np; r++)); do
		keys=""
		for f in "$dir/$opt.rank$r.0.ckpt" "$dir/$opt.rank$r.1.ckpt"; do
			[ -f "$f" ] && ! is_damaged "$f" || continue
			[ "$(ckpt_int "$f" mnist/flag-workers)" = "$np" ] || continue
			keys+=" $(ckpt_int "$f" mnist/step):$(ckpt_int "$f" mnist/generation)"
		done
		if [ "$r" = 0 ]; then
			common=$keys
			continue
		fi
		kept=""
		for k in $common; do
			case " $keys " in *" $k "*) kept+=" $k" ;; esac
		done
		common=$kept
	done
	for k in $common; do echo "${k%%:*}"; done | sort -n | tail -n 1
}

# check_resume LOG: after a job started with -resume (held: the newest
# step every rank held before it started): counts its resume, and fails
# the round if it continued from another step than held (in the shrink
# round, where other worlds' files compete: an older one).
check_resume() {
	local f
	f=$(resumed_of "$1")
	[ -n "$f" ] || return 0
	resumes=$((resumes + 1))
	round_resumes=$((round_resumes + 1))
	if grep -q "^mnist: -resume: $opt continues between two synchronizations" "$1"; then
		between=$((between + 1))
	fi
	if [ -n "$held" ] && { [ "$f" -lt "$held" ] || { [ "$round" != shrink ] && [ "$f" != "$held" ]; }; }; then
		echo "soak: FAILED: $opt round $round: -resume continued from step $f, but every rank held step $held" >&2
		fail=1
	fi
}








# trajectory OPT DIR NPS...: one interrupted run of OPT, from scratch in
# DIR, until it completes; the job k runs on NPS[k] ranks (the last for the
# rest). Adds to the counters; sets last_log.
trajectory() {
	local opt=$1 dir=$2
	shift 2
	local nps=("$@") k=0 log resumeflag=() target kind last=0 from=0
	# shellcheck disable=SC2206
	local oargs=($(optargs "$opt"))
	rm -rf "$dir"
	damaged=()
	round_resumes=0
	local interrupted=0
	while :; do
		cur_np=${nps[$((k < ${#nps[@]} ? k : ${#nps[@]} - 1))]}
		log=$NETNS_TMP/$opt.$round.$k.log
		held=""
		if [ ${#resumeflag[@]} -gt 0 ]; then
			held=$(held_step "$dir" "$opt" "$cur_np")
		fi
		start "$cur_np" "$dir" "$log" "${oargs[@]}" "${resumeflag[@]}"
		if [ "$k" -gt 0 ]; then
			# Steps redone: where the last job stopped, less where this
			# one continues.
			from=""
			while kill -0 "$jobpid" 2>/dev/null && [ -z "$from" ]; do
				sleep 0.02
				from=$(resumed_of "$log")
			done
			[ -n "$from" ] || from=$(resumed_of "$log")
			if [ -n "$from" ] && [ "$last" -gt "$from" ]; then
				redone=$((redone + last - from))
			fi
		fi
		kind=none
		# The first interruption of a round comes even when SOAK_S is
		# spent: every round resumes.
		if [ "$interrupts_left" -gt 0 ] && { [ -n "${force:-}" ] || [ "$interrupted" = 0 ] || [ "$(date +%s)" -lt "$deadline" ]; }; then
			# A random step ahead of where the run resumes; in a run from
			# step 0, after its first checkpoint is on every rank (rank 0
			# writes step S+1 to the step file once every rank has entered
			# step S+1, so after every rank's save of step S), so that the
			# round resumes at least once.
			rnd $((total / 6))
			if [ ${#resumeflag[@]} -eq 0 ]; then
				target=$((EVERY + 1 + R))
			else
				target=$((${from:-0} + 1 + R))
			fi
			while kill -0 "$jobpid" 2>/dev/null && [ "$(step_now)" -lt "$target" ]; do sleep 0.01; done
			if kill -0 "$jobpid" 2>/dev/null; then
				if [ -n "${kinds_fixed:-}" ]; then
					kind=${kinds_fixed%% *}
					kinds_fixed=${kinds_fixed#* }
				else
					rnd 4
					case $R in 0 | 1) kind=kill ;; 2) kind=term ;; 3) kind=term-mpirun ;; esac
				fi
				interrupt "$kind"
				interrupted=$((interrupted + 1))
				[ ${#resumeflag[@]} -eq 0 ] || check_resume "$log"
				count[$kind]=$((count[$kind] + 1))
				interrupts_left=$((interrupts_left - 1))
				times+=("$dt")
				last=$(step_now)
				echo "soak:   $opt round $round: $kind at step $last on $cur_np ranks; job exited $rc after ${dt} ms"
				if [ "$kind" != kill ] && ! grep -q "preempted at step $last of" "$log"; then
					if [ -n "$(hash_of "$log")" ]; then
						# The signal came after the last step: the job had
						# finished training and printed its final hash; there
						# was no step boundary left to stop at.
						echo "soak:   $opt round $round: the $kind came after the last step; the run had completed"
						last_log=$log
						break
					fi
					echo "soak: FAILED: $kind at step $last: no checkpoint saved (want 'preempted at step $last'):" >&2
					tail -n 5 "$log" >&2
					fail=1
				fi
				if [ "$kind" = term ] && [ "$rc" -ne 0 ]; then
					echo "soak: FAILED: SIGTERM to every rank: mpirun exited $rc, want 0" >&2
					fail=1
				fi
				# Corruption only after a term: every rank then holds the
				# stop step and the grid step before it, so a damaged
				# newest file leaves a common step to fall back to.
				rnd 3
				if [ "$kind" = term ] && [ -z "${no_corrupt:-}" ] && { [ -n "${corrupt_next:-}" ] || [ "$R" = 0 ]; }; then
					local ck=flip
					rnd 2
					[ "$R" = 0 ] || ck=truncate
					[ -z "${corrupt_next:-}" ] || ck=$corrupt_next
					corrupt_next=
					corrupt "$ck" "$dir" "$opt" && count[$ck]=$((count[$ck] + 1))
				fi
				resumeflag=(-resume)
				k=$((k + 1))
				continue
			fi
		fi
		finish
		[ ${#resumeflag[@]} -eq 0 ] || check_resume "$log"
		if [ "$rc" -ne 0 ] && [ "$k" -gt 0 ] && grep -q "^mnist: .*-resume: no checkpoint of $opt in .* that every rank holds" "$log"; then
			# -resume refuses where no step is held by every rank (a damaged
			# file was the only one of its rank, say), as it must: start
			# again from scratch. Where every rank held one, the refusal is
			# the resume's failure.
			if [ -n "$held" ]; then
				echo "soak: FAILED: $opt round $round: -resume found no step every rank holds, but every rank held step $held: $(grep -m1 '^mnist: .*no checkpoint' "$log" | cut -c1-200)" >&2
				fail=1
			fi
			echo "soak:   $opt round $round: no checkpoint step every rank holds; restarting from step 0 ($(grep -m1 '^mnist: ' "$log" | cut -c1-200))"
			restarts=$((restarts + 1))
			redone=$((redone + last))
			rm -rf "$dir"
			resumeflag=()
			last=0
			k=$((k + 1))
			continue
		fi
		if [ "$rc" -ne 0 ] || [ -z "$(hash_of "$log")" ]; then
			echo "soak: FAILED: $opt round $round: the last job exited $rc without a final hash:" >&2
			grep '^mnist' "$log" | tail -n 8 >&2
			tail -n 8 "$log" >&2
			fail=1
		fi
		last_log=$log
		break
	done
}


read -ra opts <<<"$OPTIMIZERS"
total=$(($( [ "$SHORT" = 1 ] && echo 10 || echo 468) * EPOCHS))
echo "soak: seed $SEED, $NP ranks, $total steps per run, checkpoint every $EVERY; impairment: $impaired; ${SOAK_S}s; optimizers: ${opts[*]}"
rows=()
hangs=0
shrink_lines=()
declare -A count
for i in "${!opts[@]}"; do
	opt=${opts[$i]}
	# shellcheck disable=SC2207
	oargs=($(optargs "$opt"))
	for kk in kill term term-mpirun flip truncate; do count[$kk]=0; done
	times=()
	redone=0
	restarts=0
	resumes=0
	between=0
	rounds=0
	matched=0
	# The uninterrupted reference.
	cur_np=$NP
	start "$NP" "$NETNS_TMP/ref-$opt" "$NETNS_TMP/ref-$opt.log" "${oargs[@]}"
	finish
	want=$(hash_of "$NETNS_TMP/ref-$opt.log")
	want_acc=$(acc_of "$NETNS_TMP/ref-$opt.log" "$opt")
	if [ "$rc" -ne 0 ] || [ -z "$want" ]; then
		echo "soak: FAILED: the uninterrupted $opt run exited $rc:" >&2
		tail -n 8 "$NETNS_TMP/ref-$opt.log" >&2
		fail=1
		continue
	fi
	echo "soak: $opt uninterrupted: fnv64 $want, test acc $want_acc%"
	# The optimizer's share of the time left: an earlier optimizer's
	# shrink round or slow reference run does not eat into it.
	deadline=$(($(date +%s) + (t_start + SOAK_S - $(date +%s)) / (${#opts[@]} - i)))
	round=0
	while :; do
		if [ "$SHORT" = 1 ]; then
			interrupts_left=2
			force=1
			kinds_fixed="kill term "
			corrupt_next=flip
		else
			rnd 8
			interrupts_left=$((4 + R))
		fi
		trajectory "$opt" "$NETNS_TMP/ck-$opt-$round" "$NP"
		rounds=$((rounds + 1))
		if [ "$round_resumes" -eq 0 ]; then
			echo "soak: FAILED: $opt round $round resumed not once" >&2
			fail=1
		fi
		got=$(hash_of "$last_log")
		if [ "$got" = "$want" ]; then
			matched=$((matched + 1))
		else
			echo "soak: FAILED: $opt round $round ended with fnv64 ${got:-none}, the uninterrupted run with $want" >&2
			fail=1
		fi
		round=$((round + 1))
		[ "$SHORT" = 1 ] && break
		[ "$(date +%s)" -lt "$deadline" ] || break
	done
	rows+=("$(printf '%-19s %6d %7d %13d %5d %5d %12d %5d %9d %9d %13s %14s %6s %7s' "$opt" "$rounds" "$resumes" "$between" "${count[kill]}" "${count[term]}" \
		"${count[term-mpirun]}" "${count[flip]}" "${count[truncate]}" "$restarts" "$redone" \
		"$(median_max "${times[@]}" | awk '{ print $1 }')" "$(median_max "${times[@]}" | awk '{ print $2 }')" "$matched/$rounds")")

	# Shrink 4 -> 3 and grow 3 -> 4: with the first optimizer of the list,
	# and with onebit-adam-sharded, whose moments and update errors are cut
	# by rank and re-cut by onebit.Regroup.
	if [ "$SHORT" != 1 ] && { [ ${#shrink_lines[@]} -eq 0 ] || [ "$opt" = onebit-adam-sharded ]; }; then
		round=shrink
		interrupts_left=2
		kinds_fixed="term term "
		no_corrupt=1
		force=1
		trajectory "$opt" "$NETNS_TMP/ck-$opt-shrink" "$NP" $((NP - 1)) "$NP"
		kinds_fixed=""
		no_corrupt=""
		force=""
		acc=$(acc_of "$last_log" "$opt")
		ok=no
		# How the example says it carried the state over (its carriedBy).
		carried="error feedback carried over (onebit.Regroup)"
		[ "$opt" = zero-adam ] && carried="moments re-sharded (zero.Consolidate)"
		if grep -qF "resumed on 4 ranks from a checkpoint of 3 ranks: $carried" "$last_log" &&
			grep -qF "was made on 4 ranks, this run has 3: continuing, $carried" "$NETNS_TMP/$opt.shrink.1.log" &&
			awk -v a="$acc" -v b="$want_acc" 'BEGIN { d = a - b; exit !(a != "" && d <= 1 && d >= -1) }'; then
			ok=yes
		else
			fail=1
		fi
		shrink_lines+=("shrink 4->3 and grow 3->4 ($opt): test acc ${acc:-none}% vs ${want_acc}% uninterrupted: within 1 point: $ok")
	fi
done

# Nothing left behind: no rank process, no namespace.
left=""
for p in "${seen_pids[@]}"; do
	if kill -0 "$p" 2>/dev/null && tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q "$bin"; then
		left+=" $p"
	fi
done
nsleft=0
if [ "$SHORT" != 1 ]; then
	netns_del "$ns"
	nsleft=$(ip netns list | grep -c "^lowbit-soak-$$-" || true)
fi

echo
echo "soak: seed $SEED; impairment: $impaired; $(($(date +%s) - t_start)) s"
printf '%-19s %6s %7s %13s %5s %5s %12s %5s %9s %9s %13s %14s %6s %7s\n' optimizer rounds resumes "between syncs" kill term term-mpirun flip truncate restarts "steps redone" "exit (median)" max "hash ok"
for r in "${rows[@]}"; do echo "$r"; done
for line in "${shrink_lines[@]}"; do echo "$line"; done
echo "hangs: $hangs; rank processes left: ${left:-none}; namespaces left: $nsleft"
if [ -n "$left" ] || [ "$nsleft" != 0 ]; then
	fail=1
fi
if [ "$fail" -ne 0 ]; then
	echo "soak: FAILED"
	exit 1
fi
echo "soak: ok"
