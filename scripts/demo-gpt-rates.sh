#!/usr/bin/env bash
# demo-gpt-rates.sh: time to a target validation loss of the GoMLX GPT
# example (integrations/gomlx/examples/gpt) on NP MPI ranks over links of
# several rates (make demo-gpt-rates): Adam, Adam with bf16 gradients, 1-bit
# Adam, 0/1 Adam and the outer optimizer (diloco) with fp32, int8, 1-bit and
# sparse pseudo-gradients (each codec at its defaults: outer.DefaultConfigFor),
# all from the same seed on the same tokens. For every
# rate and optimizer it prints the time to TARGET, the speedups against
# Adam and 1-bit Adam, the validation loss and the bytes sent per rank at
# STEPS steps (equal tokens), the compute utilization, and the mean step
# time measured beside the one lowbit plan predicts (its step comm, with the
# run's own compute time per step as --step-compute).
#
# RATES go from the slowest to the fastest. The runs at the fastest rate
# train all STEPS steps: their validation losses and bytes are the
# equal-token figures (the arithmetic does not depend on the link: the same
# seed gives the same losses at every rate). At the other rates each run
# stops at its first validation at or below TARGET (-stop-at-target), so
# that Adam on the slowest link does not spend its whole run. The slowest
# rate is run SLOW_RUNS times.
#
# At the rates in OUTER_ONLY_RATES (a home uplink, 1 Mbit/s) only the
# outer optimizer's rows run (the per-step optimizers would take hours:
# lowbit plan gives their step time there), each for all STEPS steps.
# Every run that trains all STEPS steps also gets its time to a tighter
# target (from its loss curve): TIGHT, by default the validation loss
# (curve) Adam reaches at 80% of STEPS in the fastest rate's first run, so
# that time to target measures quality as well as speed.
#
# Each link is a network namespace whose loopback is shaped by a token
# bucket (scripts/lib/netns.sh): every rank runs inside it and talks over
# TCP on lo, so the qdisc caps the traffic of all ranks together at the
# rate (lowbit plan --sharing shared).
#
# Needs root (the namespace and the qdisc), Open MPI (mpirun and the headers
# of libopenmpi-dev: the example is built with -tags mpi), ip and tc.
#
# Settings (environment): RATES ("1mbit 10mbit 100mbit 1gbit"),
# OUTER_ONLY_RATES ("1mbit"), NP (4), TARGET (3.0 nats per byte), TIGHT
# (Adam's, above; required when OPTIMIZERS has no adam), STEPS (300), OUTER (the outer optimizer's flags, empty by default:
# each codec's defaults, H 25; "-outer-fragments 5 -outer-delay 5" streams;
# "-outer-inner muon" puts Muon inside, the only setting measured to reach
# TIGHT: docs/outer.md, "The tighter target"),
# GPT_FLAGS (more flags for the example: "-freeze-step 60 -eval-every 10"),
# OPTIMIZERS (the eight above), SLOW_RUNS
# (2), OUT (out/gpt-rates: the JSON of every run, the loss curves of the
# fastest rate as SVG, the table), TIMEOUT (per mpirun, 3600 s), GO (go);
# TABLE_ONLY=1 prints the table again from the JSON files in OUT; PARAMS
# (the parameter count for lowbit plan; default: from Adam's bytes per
# step, so OPTIMIZERS without adam need it).
# About an hour and a half on a 2-core machine, mostly Adam and Adam bf16 on
# 10 Mbit and the fp32 codec on 1 Mbit.
set -euo pipefail

RATES=${RATES:-1mbit 10mbit 100mbit 1gbit}
OUTER_ONLY_RATES=${OUTER_ONLY_RATES:-1mbit}
TIGHT=${TIGHT:-}
NP=${NP:-4}
TARGET=${TARGET:-3.0}
STEPS=${STEPS:-300}
OUTER=${OUTER:-}
GPT_FLAGS=${GPT_FLAGS:--freeze-step 60 -eval-every 10}
OPTIMIZERS=${OPTIMIZERS:-adam,adam:bf16,onebit-adam,zeroone-adam,diloco:fp32,diloco:int8,diloco:1bit,diloco:sparse}
SLOW_RUNS=${SLOW_RUNS:-2}
TIMEOUT=${TIMEOUT:-3600}
GO=${GO:-go}

. "$(dirname "$0")/lib/netns.sh"
netns_init demo-gpt-rates
netns_require_root "it creates network namespaces and tc qdiscs (run: sudo make demo-gpt-rates)"
netns_require_mpi headers
command -v timeout >/dev/null || netns_die "cannot run: timeout not found (coreutils)"
read -r -a rates <<<"$RATES"
[ "${#rates[@]}" -ge 1 ] || netns_die "RATES is empty"

root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$root/out/gpt-rates}
mkdir -p "$OUT"
echo "demo-gpt-rates: building integrations/gomlx/examples/gpt with -tags mpi, and lowbit"
[ -n "${TABLE_ONLY:-}" ] || (cd "$root/integrations/gomlx" && "$GO" build -tags mpi -o "$NETNS_TMP/gpt" ./examples/gpt)
(cd "$root" && "$GO" build -o "$NETNS_TMP/lowbit" ./cmd/lowbit)
GOROOT=$("$GO" env GOROOT) # the default corpus: the ranks need no go command
export GOROOT

# outer_only RATE: whether only the outer optimizer's rows run at RATE.
outer_only() {
	local r
	for r in $OUTER_ONLY_RATES; do [ "$r" != "$1" ] || return 0; done
	return 1
}

# optimizers RATE: the runs at RATE (OPTIMIZERS, or its diloco rows).
optimizers() {
	if outer_only "$1"; then
		tr , '\n' <<<"$OPTIMIZERS" | grep '^diloco' | paste -sd, - || true
	else
		echo "$OPTIMIZERS"
	fi
}

# run RATE TAG FLAGS...: the GPT runs at RATE into $OUT/TAG.json.
run() {
	local rate=$1 tag=$2 rc=0 opts
	shift 2
	opts=$(optimizers "$rate")
	[ -n "$opts" ] || netns_die "OPTIMIZERS has no diloco row to run at $rate (OUTER_ONLY_RATES)"
	netns_new ns gptr
	netns_shape "$ns" lo "$rate"
	echo "demo-gpt-rates: $tag: $NP MPI ranks, loopback shaped: tbf $(netns_tbf "$rate"): $opts"
	# shellcheck disable=SC2086 # OUTER and GPT_FLAGS are lists of flags
	netns_run ip netns exec "$ns" timeout --kill-after=30 "$TIMEOUT" "${NETNS_MPIRUN[@]}" -np "$NP" "${NETNS_MPI_LO[@]}" \
		"$NETNS_TMP/gpt" -backend mpi -optimizer "$opts" -steps "$STEPS" -target "$TARGET" $OUTER $GPT_FLAGS \
		-json "$OUT/$tag.json" "$@" >"$OUT/$tag.out" 2>&1 || rc=$?
	netns_del "$ns"
	cat "$OUT/$tag.out"
	[ "$rc" -ne 124 ] || netns_die "$tag took more than TIMEOUT=$TIMEOUT s and was stopped"
	[ "$rc" -eq 0 ] || netns_die "$tag failed (exit $rc)"
}

last=$((${#rates[@]} - 1))
files=()
for i in "${!rates[@]}"; do
	rate=${rates[$i]}
	n=1
	[ "$i" -ne 0 ] || n=$SLOW_RUNS
	for k in $(seq 1 "$n"); do
		tag="$rate-run$k"
		if [ -n "${TABLE_ONLY:-}" ]; then
			[ -f "$OUT/$tag.json" ] || netns_die "TABLE_ONLY: $OUT/$tag.json is missing"
		elif [ "$i" -eq "$last" ]; then
			run "$rate" "$tag" -plot "$OUT/curves.svg"
		elif outer_only "$rate"; then
			run "$rate" "$tag"
		else
			run "$rate" "$tag" -stop-at-target
		fi
		files+=("$rate $OUT/$tag.json")
	done
done

# The tighter target: Adam's curve at 80% of STEPS, in the fastest rate's
# first run (its curve points' fields at an indent of eight).
if [ -z "$TIGHT" ]; then
	TIGHT=$(awk -v at=$((STEPS * 8 / 10)) '
		function val(line) { sub(/^ *"[a-z_]+": */, "", line); sub(/,$/, "", line); gsub(/"/, "", line); return line }
		/^    "optimizer":/ { o = val($0) }
		/^    "reduce":/ { r = val($0) }
		/^        "step":/ { s = val($0) + 0 }
		/^        "val_loss":/ { if (o == "adam" && r == "fp32" && s >= at && t == "") t = val($0) }
		END { if (t != "") printf "%.4f\n", t }' "$OUT/${rates[$last]}-run1.json")
	[ -n "$TIGHT" ] || netns_die "no adam run at ${rates[$last]} to take the tighter target from: set TIGHT"
	echo "demo-gpt-rates: tighter target $TIGHT, Adam's validation loss (curve) at step $((STEPS * 8 / 10)) of $STEPS at ${rates[$last]}"
fi

# The cells, one line per run: rate, run, optimizer, validation loss,
# steps, training time, time in collectives, time to target, steps to
# target, bytes sent per rank, compute utilization, last step's bytes,
# time to TIGHT (from the loss curve: its points' fields at an indent of
# eight).
# Every -json file: one object per run, its fields one per line at an
# indent of four spaces (the outer optimizer's at six).
for f in "${files[@]}"; do
	read -r rate path <<<"$f"
	awk -v rate="$rate" -v run="$(basename "$path" .json)" -v tight="$TIGHT" '
		function val(line) { sub(/^ *"[a-z_]+": */, "", line); sub(/,$/, "", line); gsub(/"/, "", line); return line }
		function flush() { if (name != "") print rate, run, name, vl, st, wall, comm, tt, stt, sent, (util == "" ? 1 - comm / wall : util), last, (t2 == "" ? "null" : t2) }
		/^    "optimizer":/ { flush(); o = val($0); name = ""; util = ""; t2 = "" }
		/^        "train_s":/ { ts = val($0) }
		/^        "val_loss":/ { if (t2 == "" && val($0) + 0 <= tight + 0) t2 = ts }
		/^    "reduce":/ { r = val($0); name = (o == "diloco" || r != "fp32") ? o ":" r : o }
		/^    "val_loss":/ { vl = val($0) }
		/^    "steps":/ { st = val($0) }
		/^    "wall_s":/ { wall = val($0) }
		/^    "comm_s":/ { comm = val($0) }
		/^    "time_to_target_s":/ { tt = val($0) }
		/^    "steps_to_target":/ { stt = val($0) }
		/^    "bytes_sent_per_rank":/ { sent = val($0) }
		/^    "last_step_bytes":/ { last = val($0) }
		/^      "utilization":/ { util = val($0) }
		END { flush() }' "$path"
done >"$OUT/cells.txt"
# The parameter count, from the bytes of one exact ring allreduce step:
# 4 bytes x 2(W-1)/W per parameter.
params=${PARAMS:-$(awk -v w="$NP" '$3 == "adam" { printf "%d\n", $12 * w / (8 * (w - 1)) + 0.5; exit }' "$OUT/cells.txt")}
[ -n "$params" ] || netns_die "no adam run in the results: set PARAMS (the model's parameter count) for lowbit plan"

# plan_step RATE NAME STEPS COMPUTE_S: lowbit plan's predicted mean step
# time and its communication alone (seconds, its "comm" column: what
# compute does not hide) of optimizer NAME over STEPS steps with COMPUTE_S
# of compute per step; "-" where plan has no model of it (0/1 Adam).
plan_step() {
	local rate=$1 name=$2 steps=$3 compute=$4 freeze h frag delay coll
	freeze=$(sed -n 's/.*-freeze-step[ =]\([0-9]*\).*/\1/p' <<<"$GPT_FLAGS")
	h=$(sed -n 's/.*-outer-h[ =]\([0-9]*\).*/\1/p' <<<"$OUTER")
	h=${h:-25} # the example's -outer-h default
	frag=$(sed -n 's/.*-outer-fragments[ =]\([0-9]*\).*/\1/p' <<<"$OUTER")
	delay=$(sed -n 's/.*-outer-delay[ =]\([0-9]*\).*/\1/p' <<<"$OUTER")
	case $name in
	adam) coll=allreduce ;;
	adam:bf16) coll=fp16 ;;
	onebit-adam) coll=allreduce,onebit ;;
	diloco:fp32 | diloco:int8 | diloco:1bit | diloco:sparse) coll=outer-${name#diloco:} ;;
	*) echo "-"; return ;;
	esac
	"$NETNS_TMP/lowbit" plan --params "$params" --ranks "$NP" --link "$rate" --sharing shared \
		--step-compute "${compute}s" --collective "$coll" ${h:+--outer-h "$h"} ${frag:+--outer-fragments "$frag"} \
		${delay:+--outer-delay "$delay"} 2>/dev/null |
		awk -v name="$name" -v coll="$coll" -v steps="$steps" -v freeze="${freeze:-0}" '
			function secs(s) { if (s ~ /µs$/) return s / 1e6; if (s ~ /ms$/) return s / 1e3; return s + 0 }
			# The time table'"'"'s rows (the first with each name: the state
			# table below it names the outer rows too).
			$1 ~ /^(allreduce|fp16\*?|onebit|outer-[a-z0-9]+\*?)$/ { c = $1; sub(/\*$/, "", c); if (!(c in t)) { t[c] = secs($(NF - 1)); k[c] = secs($(NF - 2)) } }
			END {
				if (name == "onebit-adam") {
					f = freeze < steps ? freeze : steps
					printf "%.4f %.4f\n", (f * t["allreduce"] + (steps - f) * t["onebit"]) / steps, (f * k["allreduce"] + (steps - f) * k["onebit"]) / steps
				} else if (coll in t) printf "%.4f %.4f\n", t[coll], k[coll]
			}'
}

# ratio RATE A NAME: the first run at RATE's time to target of optimizer A
# over NAME's ("-" where either did not reach it).
ratio() {
	awk -v r="$1" -v a="$2" -v n="$3" '$1 == r && $2 ~ /run1$/ && $3 == a { ta = $8 } $1 == r && $2 ~ /run1$/ && $3 == n { tn = $8 }
		END { if (ta == "" || tn == "" || ta == "null" || tn == "null") print "-"; else printf "%.2fx\n", ta / tn }' "$OUT/cells.txt"
}

{
	printf "\ndemo-gpt-rates: GPT (%s parameters), %d MPI ranks, one shaped loopback per rate shared by all ranks; target validation loss %s; %s steps; outer: %s\n" \
		"$params" "$NP" "$TARGET" "$STEPS" "$OUTER"
	printf "%-8s %-13s %27s %8s %9s %15s %9s %12s %6s %10s %10s %10s %10s\n" "rate" "optimizer" "time to target (step)" "vs adam" "vs 1-bit" "to $TIGHT" "val loss" "sent/rank" "util" "step" "plan step" "comm" "plan comm"
	full=${rates[$last]}
	for i in "${!rates[@]}"; do
		rate=${rates[$i]}
		IFS=, read -r -a opts <<<"$OPTIMIZERS"
		for name in "${opts[@]}"; do
			# Every run of this rate, then the full run's loss and bytes.
			times="" steps="" util="" stepm="" plan="" tights="" commm="" pcomm=""
			while read -r r run n vl st wall comm tt stt sent u _ t2; do
				[ "$r" = "$rate" ] && [ "$n" = "$name" ] || continue
				t=$([ "$tt" = "null" ] && echo "n/r" || printf "%.1fs" "$tt")
				times="${times:+$times / }$t"
				tights="${tights:+$tights / }$([ "$t2" = "null" ] && echo - || printf "%.1fs" "$t2")"
				steps="${steps:+$steps/}$([ "$stt" = "null" ] && echo - || echo "$stt")"
				util=$(printf "%.2f" "$u")
				stepm=$(awk -v w="$wall" -v s="$st" 'BEGIN { printf "%.3fs", w / s }')
				# The communication per step the run did not hide:
				# training time times (1 - utilization), per step.
				commm=$(awk -v w="$wall" -v u="$u" -v s="$st" 'BEGIN { printf "%.3fs", w * (1 - u) / s }')
				# The run's compute per step: training time times its
				# compute utilization (1 - collectives / training time, or
				# the outer optimizer's own, whose exchanges in flight
				# overlap compute).
				read -r plan pcomm < <(plan_step "$rate" "$name" "$st" "$(awk -v w="$wall" -v u="$u" -v s="$st" 'BEGIN { printf "%.4f", w * u / s }')" || true) || true
				case $plan in "" | "-") plan="-" pcomm="-" ;; *) plan="${plan}s" pcomm="${pcomm}s" ;; esac
			done <"$OUT/cells.txt"
			[ -n "$times" ] || continue
			read -r fvl fsent < <(awk -v r="$full" -v n="$name" '$1 == r && $3 == n && $2 ~ /run1$/ { printf "%.4f %s\n", $4, ($10 >= 1e6 ? sprintf("%.1fMB", $10 / 1e6) : sprintf("%.1fkB", $10 / 1e3)) }' "$OUT/cells.txt")
			printf "%-8s %-13s %27s %8s %9s %15s %9s %12s %6s %10s %10s %10s %10s\n" "$rate" "$name" "$times ($steps)" \
				"$(ratio "$rate" adam "$name")" "$(ratio "$rate" onebit-adam "$name")" "$tights" "$fvl" "$fsent" "$util" "$stepm" "$plan" "$commm" "$pcomm"
		done
	done
	echo "time to target: training time (validation excluded) to the first validation at or below the target, every run of the rate; vs adam, vs 1-bit: the first run's time of adam or onebit-adam over this one's (n/r: not reached); to $TIGHT: the same to the tighter target, from the loss curve of a run that trained all $STEPS steps (-: not reached, or the run stopped at the target)."
	echo "val loss, sent/rank: at $STEPS steps (equal tokens), from the run at $full; util: compute utilization (diloco: its own; the others: 1 - time in collectives / training time); step: the run's training time per step; plan step: lowbit plan's step comm at that link (--sharing shared) with the run's compute per step (training time times its utilization, per step), for 1-bit Adam the mean over its exact warm-up and compressed steps; 0/1 Adam has no plan model. comm: the run's communication per step that compute did not hide (training time times 1 - util, per step); plan comm: lowbit plan's for the same (its comm column), the part of the comparison the run's own compute does not decide."
} | tee "$OUT/table.txt"
