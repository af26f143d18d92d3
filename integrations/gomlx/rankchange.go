package gomlx

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
	"github.com/lowbit-ml/lowbit/outer"
)

// The ways Checkpoint carries the lowbit state of a checkpoint made on
// another number of ranks (RankChange.Path), one per family of optimizers.
const (
	// PathRegroup: the 1-bit optimizers (1-bit Adam in every state mode,
	// 1-bit LAMB, 0/1 Adam, 1-bit Muon): onebit.Regroup of every old
	// rank's state, each worker error (and 1-bit Muon's momentum) the old
	// ranks' mean, the server errors and sharded moments re-cut.
	PathRegroup = "error feedback carried over (onebit.Regroup)"
	// PathConsolidate: zero.Adam: zero.Consolidate of every old rank's
	// shard of the moments, which loads on any number of ranks.
	PathConsolidate = "moments re-sharded (zero.Consolidate)"
	// PathOuter: the outer optimizer: outer.Regroup of every old rank's
	// state (the warning says what it carries with the codec).
	PathOuter = "outer state regrouped (outer.Regroup)"
	// PathCopy: the exact optimizers, whose state is the same on every
	// rank: old rank r % W's state as it is.
	PathCopy = "exact optimizer: copied"
)

// RankChange is what Checkpoint did when every rank resumed from a
// checkpoint that a group of another number of ranks made.
type RankChange struct {
	// Step is the global step resumed from: the newest step that every
	// rank of the old group holds.
	Step int64
	// FromRanks and ToRanks are the old and the new number of ranks.
	FromRanks, ToRanks int
	// Path says how the lowbit state was carried: one of PathRegroup,
	// PathConsolidate, PathOuter (followed by what the codec carries) or
	// PathCopy.
	Path string
	// Checked says what the check of the carried state compared and found
	// (the mean of the carried error feedback and momenta against the
	// saved mean), "" where nothing is carried as a mean.
	Checked string
}

// RankChange returns what Checkpoint did to resume on another number of
// ranks, and false when it resumed on the number that made the checkpoint
// (or started afresh).
func (o *Optimizer) RankChange() (RankChange, bool) {
	if o.change == nil {
		return RankChange{}, false
	}
	return *o.change, true
}

// carried is the lowbit state Checkpoint made for this rank from a group
// of another size, which the first training graph loads in place of the
// state file of step (restoreLocal).
type carried struct {
	step int64
	ck   *optim.Checkpoint
}

// rankPrefix returns dir, cleaned, without the decimal rank at the end of
// its last element ("ck/run-rank-" for "ck/run-rank-3" on rank 3): the
// prefix of every rank's directory when each is the prefix and its rank.
// It returns "" when dir does not end in rank.
func rankPrefix(dir string, rank int) string {
	clean := filepath.Clean(dir)
	p, ok := strings.CutSuffix(clean, strconv.Itoa(rank))
	if !ok || p == "" {
		return ""
	}
	if last := p[len(p)-1]; last >= '0' && last <= '9' {
		return "" // "rank-10" is not rank 0's
	}
	return p
}

// rankPlan is what the ranks tell each other before a resume: every
// rank its directory prefix (rankPrefix), rank 0 the newest complete
// group it found (Step -1 for none) and why the newer ones are not.
type rankPlan struct {
	Prefix string `json:"prefix"`
	// Own is what the rank's own lowbit state of the newest step every
	// rank holds is to this group: ownNone, ownFits or ownForeign.
	Own       int      `json:"own"`
	Step      int64    `json:"step"`
	World     int      `json:"world"`
	Algorithm string   `json:"algorithm"`
	Problems  []string `json:"problems,omitempty"`
}

// dir is the directory of old rank k.
func (p *rankPlan) dir(k int) string { return p.Prefix + strconv.Itoa(k) }

// What a rank's own lowbit state file of a step is to the group
// (rankPlan.Own).
const (
	ownNone    = iota // there is none
	ownFits           // made by this rank of a group of this size, or to load on any (ErrorsReset)
	ownForeign        // made by another rank or group size, or unreadable
)

// ownState says what dir's state file of step is to rank of a group of
// world ranks.
func ownState(dir string, step int64, world, rank int) int {
	if step < 0 {
		return ownNone
	}
	h, err := peekState(filepath.Join(dir, stateFileName(step)))
	switch {
	case err != nil && !fileExists(filepath.Join(dir, stateFileName(step))):
		return ownNone
	case err == nil && (h.reset || h.world == world && h.rank == rank):
		return ownFits
	}
	return ownForeign
}

// fileExists reports whether path is there.
func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// agreeRankPlan gives every rank rank 0's plan when every rank's
// directory is its prefix and its rank, with one prefix for all, and
// whether the state files of common, the newest step every rank holds,
// are every rank's own (fits): all made by this group's ranks (or to load
// on any), or none there. The plan is nil where the directories are not
// so named (a resume on another number of ranks is then not looked for).
func (o *Optimizer) agreeRankPlan(dir string, common int64) (plan *rankPlan, fits bool, err error) {
	mine := rankPlan{Prefix: rankPrefix(dir, o.rank()), Step: -1, Own: ownState(dir, common, o.size(), o.rank())}
	if o.rank() == 0 && mine.Prefix != "" {
		mine.Step, mine.World, mine.Algorithm, mine.Problems = findGroup(mine.Prefix, o.size())
	}
	b, err := json.Marshal(mine)
	if err != nil {
		return nil, false, fmt.Errorf("lbgomlx: Checkpoint: %w", err)
	}
	recv, err := o.allGatherVar(b, false)
	if err != nil {
		return nil, false, fmt.Errorf("lbgomlx: Checkpoint: exchanging the checkpoint directories: %w", err)
	}
	named := true
	owns := map[int]bool{}
	for r, b := range recv {
		var p rankPlan
		if err := json.Unmarshal(b, &p); err != nil {
			return nil, false, fmt.Errorf("lbgomlx: Checkpoint: rank %d's directory: %w", r, err)
		}
		owns[p.Own] = true
		named = named && p.Prefix != "" && (plan == nil || p.Prefix == plan.Prefix)
		if r == 0 {
			plan = &p
		}
	}
	fits = len(owns) == 1 && !owns[ownForeign]
	if !named {
		return nil, fits, nil
	}
	return plan, fits, nil
}

// findGroup returns the newest global step of which every rank of the
// group that made it holds a whole GoMLX checkpoint and its lowbit state
// file, in directories prefix+"0", prefix+"1", ...: the step, the group's
// size and the lowbit algorithm, or step -1. problems names, for each
// newer step of rank 0's, what is missing or foreign. Rank 0's state file
// of a step says the group's size (optim.Checkpoint.World), and every
// other rank's must say the same size, its own rank and the same
// algorithm: files of another group, or of another run, make no group.
// The state files of a group of another size than size, which the
// caller regroups, must also load whole (optim.LoadFile checks their
// checksums).
func findGroup(prefix string, size int) (step int64, world int, algorithm string, problems []string) {
	lists := map[int][]int64{}
	whole := func(k int) []int64 {
		if s, ok := lists[k]; ok {
			return s
		}
		held, err := listCheckpoints(prefix + strconv.Itoa(k))
		if err != nil {
			problems = append(problems, err.Error())
		}
		lists[k] = heldSteps(held)
		return lists[k]
	}
	steps := whole(0)
	for i := len(steps) - 1; i >= 0; i-- {
		s := steps[i]
		path := filepath.Join(prefix+"0", stateFileName(s))
		h, err := peekState(path)
		if err != nil {
			problems = append(problems, fmt.Sprintf("step %d: %v", s, err))
			continue
		}
		if h.reset {
			continue // made to load on any number of ranks (ResetErrors, outer.Regroup)
		}
		if h.rank != 0 {
			problems = append(problems, fmt.Sprintf("step %d: %s was made by rank %d of %d, not rank 0", s, path, h.rank, h.world))
			continue
		}
		ok := true
		for k := 1; k < h.world && ok; k++ {
			dir := prefix + strconv.Itoa(k)
			if _, found := slices.BinarySearch(whole(k), s); !found {
				problems = append(problems, fmt.Sprintf("step %d (made on %d ranks): %s holds no whole GoMLX checkpoint of it", s, h.world, dir))
				ok = false
				break
			}
			p := filepath.Join(dir, stateFileName(s))
			hk, err := peekState(p)
			switch {
			case err != nil:
				problems = append(problems, fmt.Sprintf("step %d (made on %d ranks): %v", s, h.world, err))
				ok = false
			case hk.world != h.world || hk.rank != k || hk.algorithm != h.algorithm:
				problems = append(problems, fmt.Sprintf("step %d: %s is rank %d of %d ranks' (%s), %s rank 0 of %d's (%s): not one group's",
					s, p, hk.rank, hk.world, hk.algorithm, path, h.world, h.algorithm))
				ok = false
			}
		}
		// A group of another size is to be regrouped: its files must
		// load whole (their checksums), or an older step is taken.
		for k := 0; k < h.world && ok && h.world != size; k++ {
			p := filepath.Join(prefix+strconv.Itoa(k), stateFileName(s))
			if _, err := optim.LoadFile(p); err != nil {
				problems = append(problems, fmt.Sprintf("step %d (made on %d ranks): %v", s, h.world, err))
				ok = false
			}
		}
		if ok {
			return s, h.world, h.algorithm, problems
		}
	}
	return -1, 0, "", problems
}

// stateHeader is the start of a lowbit state file: who made it.
type stateHeader struct {
	algorithm   string
	world, rank int
	reset       bool // ErrorsReset: made to load on any number of ranks
}

// peekState reads the algorithm, world size and rank at the start of the
// lowbit state file path (the format of optim.Checkpoint.MarshalBinary:
// magic, version, length, checksum, then the payload's algorithm, world
// and rank), without reading the rest or checking its checksum: a
// damaged file is found when it is loaded.
func peekState(path string) (stateHeader, error) {
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return stateHeader{}, fmt.Errorf("%s is missing", path)
		}
		return stateHeader{}, err
	}
	defer f.Close()
	const headerLen, maxAlgorithm = 8 + 4 + 8 + 4, 1 << 10
	b := make([]byte, headerLen+4)
	bad := func(why string) (stateHeader, error) {
		return stateHeader{}, fmt.Errorf("%s: %s: %w", path, why, optim.ErrCorruptCheckpoint)
	}
	if _, err := io.ReadFull(f, b); err != nil {
		return bad("too short")
	}
	if string(b[:8]) != "LOWBITCK" {
		return bad("not a lowbit state file")
	}
	version := binary.LittleEndian.Uint32(b[8:])
	if version != 1 && version != 2 {
		return bad(fmt.Sprintf("format version %d", version))
	}
	n := binary.LittleEndian.Uint32(b[headerLen:])
	if n > maxAlgorithm {
		return bad("algorithm name too long")
	}
	rest := make([]byte, int(n)+16+4)
	if _, err := io.ReadFull(f, rest); err != nil {
		return bad("too short")
	}
	world := int64(binary.LittleEndian.Uint64(rest[n:]))
	rank := int64(binary.LittleEndian.Uint64(rest[n+8:]))
	if world < 1 || world > math.MaxInt32 || rank < 0 || rank >= world {
		return bad(fmt.Sprintf("rank %d of %d ranks", rank, world))
	}
	h := stateHeader{algorithm: string(rest[:n]), world: int(world), rank: int(rank)}
	if version == 2 {
		// The stage, then the flags, whose bit 0 is ErrorsReset.
		stage := binary.LittleEndian.Uint32(rest[n+16:])
		if stage > maxAlgorithm {
			return bad("stage name too long")
		}
		flags := make([]byte, int(stage)+4)
		if _, err := io.ReadFull(f, flags); err != nil {
			return bad("too short")
		}
		h.reset = binary.LittleEndian.Uint32(flags[stage:])&1 != 0
	}
	return h, nil
}

// changeRanks is Checkpoint's resume from plan, the checkpoint of a group
// of plan.World ranks, on this group of another size. Every rank makes its
// own lowbit state from the old ranks' (carryState), makes sure its
// directory holds the GoMLX checkpoint of the step (a copy of old rank
// 0's where it holds none: its variables are the same on every rank),
// sets aside its newer checkpoints and loads the step. Nothing of the old
// group's is changed or removed: until the first Save of a later step,
// a rerun finds the same group and does the same again. A failure on one
// rank is an error on every rank.
func (o *Optimizer) changeRanks(cfg *checkpoint.Config, dir string, held []heldCheckpoint, plan *rankPlan) (*checkpoint.Handler, error) {
	var localErr error
	ck, path, checked, err := carryState(plan, o.size(), o.rank())
	localErr = err
	var moved []string
	if localErr == nil {
		moved, localErr = prepareDir(dir, held, plan)
	}
	h, err := o.loadAll(cfg, dir, plan.Step, localErr, func(by int) error {
		return fmt.Errorf("lbgomlx: Checkpoint: rank %d failed to resume from the checkpoint of global step %d made on %d ranks (its error says why)",
			by, plan.Step, plan.World)
	})
	if err != nil {
		return nil, err
	}
	o.carry = &carried{step: plan.Step, ck: ck}
	o.change = &RankChange{Step: plan.Step, FromRanks: plan.World, ToRanks: o.size(), Path: path, Checked: checked}
	if o.rank() == 0 {
		line := fmt.Sprintf("resumed on %d ranks from the checkpoint of global step %d made on %d ranks (%s0 to %s%d): %s",
			o.size(), plan.Step, plan.World, plan.Prefix, plan.Prefix, plan.World-1, path)
		if checked != "" {
			line += "; " + checked
		}
		o.warn(line, zap.Int64("global_step", plan.Step), zap.Int("from_ranks", plan.World), zap.Int("to_ranks", o.size()), zap.String("path", path))
		if len(plan.Problems) > 0 {
			o.warn(fmt.Sprintf("resuming from global step %d, the newest step every rank of the group that made it holds; newer checkpoints are not whole: %s",
				plan.Step, strings.Join(plan.Problems, "; ")), zap.Int64("global_step", plan.Step), zap.Strings("problems", plan.Problems))
		}
	}
	if len(moved) > 0 {
		to := filepath.Join(dir, SetAsideDir)
		o.warn(fmt.Sprintf("rank %d moved its checkpoints newer than global step %d, the newest step every rank of the group that made it holds, into %s: %s",
			o.rank(), plan.Step, to, strings.Join(moved, ", ")),
			zap.Int("rank", o.rank()), zap.Int64("global_step", plan.Step), zap.String("to", to), zap.Strings("files", moved))
	}
	o.loadedDir, o.loadedStep = dir, plan.Step
	return h, nil
}

// carryState makes rank's lowbit state of a group of world ranks from the
// old group's of plan, by the way of its algorithm, and checks what it
// carries (checkCarried). It returns the state, the way (RankChange.Path)
// and what the check found.
func carryState(plan *rankPlan, world, rank int) (*optim.Checkpoint, string, string, error) {
	name := stateFileName(plan.Step)
	load := func(k int) (*optim.Checkpoint, error) {
		path := filepath.Join(plan.dir(k), name)
		ck, err := optim.LoadFile(path)
		if err != nil {
			return nil, fmt.Errorf("lbgomlx: reading old rank %d's lowbit state: %w", k, err)
		}
		if ck.World != plan.World || ck.Rank != k || ck.Algorithm != plan.Algorithm {
			return nil, fmt.Errorf("lbgomlx: %s was made by rank %d of %d ranks (%s), not rank %d of %d (%s): %w",
				path, ck.Rank, ck.World, ck.Algorithm, k, plan.World, plan.Algorithm, optim.ErrIncompatibleCheckpoint)
		}
		return ck, nil
	}
	alg := plan.Algorithm
	if optim.Replicated(alg) {
		ck, err := load(rank % plan.World)
		return ck, PathCopy, "", err
	}
	old := make([]*optim.Checkpoint, plan.World)
	for k := range old {
		var err error
		if old[k], err = load(k); err != nil {
			return nil, "", "", err
		}
	}
	if err := sameRun(old, plan); err != nil {
		return nil, "", "", err
	}
	var ck *optim.Checkpoint
	var path string
	var err error
	switch {
	case alg == optim.AlgorithmOnebitAdam, alg == optim.AlgorithmOnebitLamb, alg == optim.AlgorithmZeroOneAdam, alg == onebit.AlgorithmMuon:
		ck, err = onebit.Regroup(old, world, rank)
		path = PathRegroup
	case alg == zero.Algorithm:
		ck, err = zero.Consolidate(old)
		path = PathConsolidate
	case strings.HasPrefix(alg, outer.AlgorithmPrefix):
		ck, err = outer.Regroup(old, world, rank)
		path = PathOuter + ": θ_g and u carried, each new rank r continuing old rank r % " + strconv.Itoa(plan.World) +
			"'s inner optimizer, local parameters and any exchange in flight"
		switch codec := old[0].Floats[optim.HyperPrefix+"outer_codec"]; {
		case old[0].Tensor(outer.AccumulatorName) != nil:
			path += ", the sparse accumulators' mean carried"
		case codec == float64(outer.CodecOneBit) && err == nil && !ck.ErrorsReset:
			path += ", the 1-bit codec's error feedback carried (each worker error the old ranks' mean, the server errors re-cut)"
		case codec == float64(outer.CodecOneBit):
			path += ", the 1-bit codec's error feedback starting from zero (a group of one rank keeps none)"
		}
	default:
		return nil, "", "", fmt.Errorf("lbgomlx: the lowbit state of global step %d (%s, made on %d ranks) has no way to another number of ranks: %s: %w",
			plan.Step, alg, plan.World, optim.RankChange(alg), optim.ErrIncompatibleCheckpoint)
	}
	if err != nil {
		return nil, "", "", fmt.Errorf("lbgomlx: resuming the checkpoint of global step %d made on %d ranks on %d: %w", plan.Step, plan.World, world, err)
	}
	checked, err := checkCarried(old, ck, world)
	if err != nil {
		return nil, "", "", fmt.Errorf("lbgomlx: the lowbit state of global step %d regrouped from %d ranks to %d: %w", plan.Step, plan.World, world, err)
	}
	return ck, path, checked, nil
}

// sameRun refuses old, the old ranks' states of one step, unless what
// every rank of one run holds the same is the same, bit for bit: the
// parameters of the 1-bit optimizers (0/1 Adam's local steps aside) and of
// zero.Adam, the outer optimizer's θ_g and u. States of two runs that
// reached the same step on as many ranks differ there.
func sameRun(old []*optim.Checkpoint, plan *rankPlan) error {
	alg := old[0].Algorithm
	same := func(name string) bool { return strings.HasPrefix(name, optim.ParamTensorName("")) }
	switch {
	case strings.HasPrefix(alg, outer.AlgorithmPrefix):
		same = func(name string) bool { return name == outer.TensorGlobal || name == outer.TensorMomentum }
	case alg == optim.AlgorithmZeroOneAdam:
		return nil
	}
	for _, t := range old[0].Tensors {
		if !same(t.Name) {
			continue
		}
		for k, o := range old[1:] {
			u := o.Tensor(t.Name)
			if u == nil || !slices.Equal(u.Shape, t.Shape) || !slices.EqualFunc(u.Data, t.Data, func(a, b float32) bool { return math.Float32bits(a) == math.Float32bits(b) }) {
				return fmt.Errorf("lbgomlx: the lowbit states of global step %d of old ranks 0 and %d (%s, %s) differ in %s, the same on every rank of one run: "+
					"states of two runs? Move the other run's files away: %w",
					plan.Step, k+1, filepath.Join(plan.dir(0), stateFileName(plan.Step)), filepath.Join(plan.dir(k+1), stateFileName(plan.Step)), t.Name, optim.ErrIncompatibleCheckpoint)
			}
		}
	}
	return nil
}

// carryTol is the largest relative difference checkCarried accepts
// between a carried buffer's mean and the saved one: float32 rounding of
// each element once (2^-24), with a margin of 2.
const carryTol = 1.0 / (1 << 23)

// checkCarried checks that ck, made from old for a group of world ranks,
// carries what old saved: each buffer ck holds as the old ranks' mean
// (the worker errors and 1-bit Muon's momenta of onebit.Regroup, the
// 1-bit codec's worker errors and the sparse accumulators' mean of
// outer.Regroup) has the mean of the old
// ranks' over the elements it holds (padding aside) to float32 rounding,
// and each of zero.Consolidate's moments the sum of the old shards'. It
// returns what it compared, "" for nothing.
func checkCarried(old []*optim.Checkpoint, ck *optim.Checkpoint, world int) (string, error) {
	if len(old) == world && ck.Algorithm != zero.Algorithm {
		return "", nil // the same number of ranks: a copy
	}
	// onebit.PaddedLen pads to a multiple of unit(w): a buffer of l
	// elements padded for w ranks holds more than l-unit(w) real ones.
	unit := func(w int) int { return onebit.PaddedLen(1, w) }
	var n, elems int
	var worst float64
	var kinds []string
	kind := func(k string) {
		if !slices.Contains(kinds, k) {
			kinds = append(kinds, k)
		}
	}
	for _, t := range ck.Tensors {
		var src string
		var sum bool // zero.Consolidate: the old shards' sum
		switch {
		case strings.HasPrefix(t.Name, optim.WorkerErrorName):
			src = t.Name
			kind("worker errors")
		case ck.Algorithm == onebit.AlgorithmMuon && strings.HasPrefix(t.Name, optim.MomentumBufferPrefix):
			src = t.Name
			kind("momenta")
		case t.Name == outer.TensorRegroupedAccumulator && old[0].Tensor(outer.ServerAccumulatorName) == nil:
			src = outer.AccumulatorName
			kind("sparse accumulators")
		case ck.Algorithm == zero.Algorithm && (strings.HasPrefix(t.Name, optim.ExpAvgPrefix) || strings.HasPrefix(t.Name, optim.ExpAvgSqPrefix)):
			src, sum = t.Name, true
			kind("moments")
		default:
			continue
		}
		var got, want, scale float64
		if sum {
			for _, x := range t.Data {
				got += float64(x)
			}
			for _, o := range old {
				ot := o.Tensor(src)
				if ot == nil {
					return "", fmt.Errorf("old rank %d holds no %s: %w", o.Rank, src, optim.ErrIncompatibleCheckpoint)
				}
				for _, x := range ot.Data {
					want += float64(x)
					scale += math.Abs(float64(x))
				}
			}
			elems += len(t.Data)
		} else {
			l := len(t.Data)
			for _, o := range old {
				ot := o.Tensor(src)
				if ot == nil {
					return "", fmt.Errorf("old rank %d holds no %s: %w", o.Rank, src, optim.ErrIncompatibleCheckpoint)
				}
				l = min(l, len(ot.Data))
			}
			// The new padding is zero; the old may not be.
			end := l
			for end > 0 && t.Data[end-1] == 0 {
				end--
			}
			mean := make([]float64, end)
			for _, o := range old {
				for i, x := range o.Tensor(src).Data[:end] {
					mean[i] += float64(x)
				}
			}
			for i := range mean {
				mean[i] /= float64(len(old))
				got += float64(t.Data[i])
				want += mean[i]
				scale += math.Abs(mean[i])
			}
			// Below the padding, the elements ck holds as zero must be
			// zero in the old ranks' too.
			sure := max(len(t.Data)-unit(world), l-unit(len(old))) + 1
			if src == outer.AccumulatorName || strings.HasPrefix(t.Name, optim.MomentumBufferPrefix) {
				sure = l // not padded
			}
			if end < sure {
				for _, o := range old {
					for i, x := range o.Tensor(src).Data[end:sure] {
						if x != 0 {
							return "", fmt.Errorf("%s: element %d is zero, old rank %d's is %g: %w", t.Name, end+i, o.Rank, x, optim.ErrIncompatibleCheckpoint)
						}
					}
				}
			}
			got, want = got/float64(max(end, 1)), want/float64(max(end, 1))
			scale /= float64(max(end, 1))
			elems += end
		}
		n++
		d := math.Abs(got - want)
		if d > carryTol*scale+math.SmallestNonzeroFloat32 {
			return "", fmt.Errorf("%s: the carried mean is %g, the saved mean %g: %w", t.Name, got, want, optim.ErrIncompatibleCheckpoint)
		}
		if scale > 0 {
			worst = max(worst, d/scale)
		}
	}
	if n == 0 {
		return "", nil
	}
	what := "mean"
	if ck.Algorithm == zero.Algorithm {
		what = "sum"
	}
	buffers := "buffers"
	if n == 1 {
		buffers = "buffer"
	}
	return fmt.Sprintf("carried state checked: the %s of %d %s (%s, %d elements) equals the saved %s to float32 rounding (largest difference %.2g of the mean magnitude)",
		what, n, buffers, strings.Join(kinds, ", "), elems, what, worst), nil
}

// prepareDir makes dir hold the GoMLX checkpoint of plan.Step as the one
// GoMLX loads: a copy of old rank 0's where dir holds no whole one (each
// file copied atomically, the .json last, so that a copy cut short is no
// checkpoint), and dir's newer checkpoints set aside (setAside). It
// returns the names of the files set aside.
func prepareDir(dir string, held []heldCheckpoint, plan *rankPlan) ([]string, error) {
	if !slices.ContainsFunc(held, func(c heldCheckpoint) bool { return c.whole && c.step == plan.Step }) {
		src, err := listCheckpoints(plan.dir(0))
		if err != nil {
			return nil, err
		}
		i := slices.IndexFunc(src, func(c heldCheckpoint) bool { return c.whole && c.step == plan.Step })
		if i < 0 {
			return nil, fmt.Errorf("lbgomlx: %s no longer holds the checkpoint of global step %d", plan.dir(0), plan.Step)
		}
		for _, suffix := range []string{gomlxBin, gomlxJSON} {
			name := src[i].base + suffix
			if err := copyFile(filepath.Join(plan.dir(0), name), filepath.Join(dir, name)); err != nil {
				return nil, fmt.Errorf("lbgomlx: copying old rank 0's checkpoint of global step %d to %s: %w", plan.Step, dir, err)
			}
		}
		if held, err = listCheckpoints(dir); err != nil {
			return nil, err
		}
	}
	return setAside(dir, held, plan.Step)
}
