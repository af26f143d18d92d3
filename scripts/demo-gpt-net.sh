#!/usr/bin/env bash
# demo-gpt-net.sh: the GoMLX GPT example (integrations/gomlx/examples/gpt)
# on NP MPI ranks that talk over a slow link (make demo-gpt-net): Adam,
# 1-bit Adam, 1-bit Adam with its moments sharded over the ranks
# (onebit-adam-sharded: the same wire bytes, less optimizer state), 0/1
# Adam, Muon (exact, its gradients averaged in fp32) and 1-bit Muon from
# the same seed, each to the same number of steps; it prints each one's
# time to the TARGET validation loss, Adam's share of its step spent in
# communication, and the speedups (1-bit Adam against Adam, 1-bit Muon
# against Muon and beside 1-bit Adam, and each against the 16-bit exact
# baseline: Adam and Muon with the bf16 down-cast allreduce). Every optimizer runs at the
# example's default learning rates (-lr 2e-3 for Adam and Muon's AdamW
# group, -muon-lr for Muon's matrices).
#
# The slow link is a network namespace whose loopback is shaped by a token
# bucket (scripts/lib/netns.sh, as make demo-net does for MNIST): every rank
# runs inside it and talks over TCP on lo, so the qdisc caps the traffic of
# all ranks together at RATE. RATE is chosen so that Adam spends at least
# three quarters of its step in communication (the line "adam: ...% of the
# training time in collectives" says what it was).
#
# Needs root (the namespace and the qdisc), Open MPI (mpirun and the headers
# of libopenmpi-dev: the example is built with -tags mpi), ip and tc.
#
# Settings (environment): OPTIMIZERS (the eight above:
# adam,adam:bf16,onebit-adam,onebit-adam-sharded,zeroone-adam,muon,muon:bf16,onebit-muon;
# adam is required), RATE (40mbit), NP (4), TARGET (validation loss in
# nats per byte, 2.75), GPT_FLAGS (flags for the example; default "-steps
# 450 -freeze-step 60": the target is reached near step 330, and the 1-bit
# optimizers' exact warm-up runs at Adam's speed, so a warm-up of a fifth
# of 600 steps caps the speedup near 330/120; 1-bit Muon's warm-up is its
# AdamW group's only, the hidden matrices 1-bit from the first step:
# -muon-warmup all makes it exact Muon's), TIMEOUT (3600 s), GO (go).
# It takes about 25 minutes on a 2-core machine, Adam's and Muon's runs most
# of it.
set -euo pipefail

OPTIMIZERS=${OPTIMIZERS:-adam,adam:bf16,onebit-adam,onebit-adam-sharded,zeroone-adam,muon,muon:bf16,onebit-muon}
RATE=${RATE:-40mbit}
NP=${NP:-4}
TARGET=${TARGET:-2.75}
GPT_FLAGS=${GPT_FLAGS:--steps 450 -freeze-step 60}
TIMEOUT=${TIMEOUT:-3600}
GO=${GO:-go}

. "$(dirname "$0")/lib/netns.sh"
netns_init demo-gpt-net
netns_require_root "it creates a network namespace and a tc qdisc (run: sudo make demo-gpt-net)"
netns_require_mpi headers
command -v timeout >/dev/null || netns_die "cannot run: timeout not found (coreutils)"

root=$(cd "$(dirname "$0")/.." && pwd)
echo "demo-gpt-net: building integrations/gomlx/examples/gpt with -tags mpi"
(cd "$root/integrations/gomlx" && "$GO" build -tags mpi -o "$NETNS_TMP/gpt" ./examples/gpt)
# The default corpus is $GOROOT/src: found here, so the ranks need no go
# command.
GOROOT=$("$GO" env GOROOT)
export GOROOT

netns_new ns gpt
echo "demo-gpt-net: network namespace $ns, loopback shaped: tbf $(netns_tbf "$RATE")"
netns_shape "$ns" lo "$RATE"

echo "demo-gpt-net: $NP MPI ranks over TCP on the shaped loopback, from the same seed: $OPTIMIZERS"
rc=0
# shellcheck disable=SC2086 # GPT_FLAGS is a list of flags
netns_run ip netns exec "$ns" timeout --kill-after=30 "$TIMEOUT" "${NETNS_MPIRUN[@]}" -np "$NP" "${NETNS_MPI_LO[@]}" \
	"$NETNS_TMP/gpt" -backend mpi -optimizer "$OPTIMIZERS" -target "$TARGET" \
	-json "$NETNS_TMP/gpt.json" $GPT_FLAGS >"$NETNS_TMP/gpt.out" 2>&1 || rc=$?
netns_del "$ns"
cat "$NETNS_TMP/gpt.out"
[ "$rc" -ne 124 ] || netns_die "the GPT run took more than TIMEOUT=$TIMEOUT s and was stopped"
[ "$rc" -eq 0 ] || netns_die "the GPT run failed (exit $rc)"

# The -json file: one object per run, its fields one per line at an indent
# of four spaces (the curve's points are deeper).
awk -v rate="$RATE" -v np="$NP" -v target="$TARGET" '
	function val(line) { sub(/^ *"[a-z_]+": */, "", line); sub(/,$/, "", line); gsub(/"/, "", line); return line }
	/^    "optimizer":/ { n = val($0); names[++count] = n }
	/^    "wall_s":/ { wall[n] = val($0) + 0 }
	/^    "comm_s":/ { comm[n] = val($0) + 0 }
	/^    "val_loss":/ { vl[n] = val($0) + 0 }
	/^    "time_to_target_s":/ { tt[n] = val($0) }
	/^    "steps_to_target":/ { st[n] = val($0) }
	/^    "bytes_sent_per_rank":/ { sent[n] = val($0) / 1e6 }
	END {
		if (!("adam" in wall)) {
			print "demo-gpt-net: could not read the -json file (or OPTIMIZERS has no adam)" > "/dev/stderr"; exit 1
		}
		printf "\ndemo-gpt-net: GPT, %d MPI ranks, loopback shaped to %s (all ranks share it); target validation loss %s\n", np, rate, target
		printf "%-19s %9s %11s %7s %15s %12s %14s\n", "optimizer", "val loss", "train time", "comm", "to target", "step", "sent/rank"
		for (k = 1; k <= count; k++) {
			m = names[k]
			t = tt[m] == "null" ? "not reached" : sprintf("%.1fs", tt[m])
			step = st[m] == "null" ? "-" : st[m]
			printf "%-19s %9.4f %10.1fs %6.0f%% %15s %12s %11.1f MB\n", m, vl[m], wall[m], 100 * comm[m] / wall[m], t, step, sent[m]
		}
		share = comm["adam"] / wall["adam"]
		ok = share >= 0.75 ? "yes" : "NO, lower RATE"
		printf "adam: %.0f%% of the training time in collectives (want at least 75%%: %s)\n", 100 * share, ok
		# The ratios: A against B with its goal (0: none, >1 wanted).
		ratio("onebit-adam", "adam", "1-bit Adam vs Adam", 2.5)
		ratio("zeroone-adam", "onebit-adam", "0/1 Adam vs 1-bit Adam", 1)
		# The sharded mode sends the bytes of 1-bit Adam: the same goal
		# against Adam, and its time against that of 1-bit Adam.
		ratio("onebit-adam-sharded", "adam", "1-bit Adam sharded vs Adam", 2.5)
		ratio("onebit-adam-sharded", "onebit-adam", "1-bit Adam sharded vs 1-bit Adam (the same bytes on the wire)", 0)
		ratio("onebit-muon", "muon", "1-bit Muon vs Muon", 2.5)
		# The 16-bit exact baselines (Adam and Muon with the bf16
		# down-cast allreduce), beside the float32 ones above.
		ratio("adam bf16", "adam", "Adam bf16 vs Adam (a measurement, not a goal)", 0)
		ratio("onebit-adam", "adam bf16", "1-bit Adam vs Adam bf16", 0)
		ratio("zeroone-adam", "adam bf16", "0/1 Adam vs Adam bf16", 0)
		ratio("onebit-muon", "muon bf16", "1-bit Muon vs Muon bf16", 0)
		ratio("onebit-muon", "onebit-adam", "1-bit Muon vs 1-bit Adam (a measurement, not a goal)", 0)
		ratio("muon", "adam", "Muon vs Adam (a measurement, not a goal)", 0)
	}
	# ratio prints how many times sooner run a reached the target than run
	# b, and whether that meets goal (0: no goal; 1: sooner).
	function ratio(a, b, what, goal,   s, v) {
		if (!(a in wall) || !(b in wall)) return
		if (tt[a] == "null" || tt[b] == "null") {
			printf "%s: not reached by both runs, no ratio (raise -steps in GPT_FLAGS or TARGET)\n", what
			return
		}
		s = tt[b] / tt[a]
		v = goal == 0 ? "" : goal == 1 ? sprintf(" (goal: sooner, %s)", s > 1 ? "met" : "MISSED") : sprintf(" (goal %gx: %s)", goal, s >= goal ? "met" : "MISSED")
		printf "%s: time to target %.2fx sooner%s\n", what, s, v
	}' "$NETNS_TMP/gpt.json"
