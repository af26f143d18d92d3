package onebit

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/optim"
)

// Regroup makes the checkpoint that rank of a group of world ranks loads to
// continue the run whose every rank saved one of old (old[r] made by rank
// r of a group of len(old)), keeping the error feedback instead of
// resetting it (optim.Checkpoint.ResetErrors). It carries the checkpoints
// of the 1-bit optimizers (1-bit Adam in every StateMode, 1-bit LAMB, 0/1
// Adam and 1-bit Muon), from and to any number of ranks, one included:
//
//   - on the same number of ranks the result is a copy of old[rank], bit
//     for bit: a resume through Regroup is the resume without it;
//   - otherwise every worker error buffer of the new group is the mean
//     over the old ranks of theirs, element by element (summed in
//     float64, rounded once): what the compressed average still owes the
//     ranks is their mean, and it stays the same to float32 rounding;
//   - the server errors (and the sharded mode's update errors) belong to
//     elements, not ranks: they are cut out of the old ranks' chunks and
//     cut again into the new group's, element for element, unchanged;
//   - the sharded mode's moments (StateSharded) are re-cut the same way,
//     unchanged, from the old ranks' shards or, from one rank (where the
//     mode runs as StateFull), from its whole moments;
//   - 1-bit Muon's momenta, each rank's own, become their mean over the
//     old ranks on every new rank (summed in float64, rounded once): the
//     average of the ranks' averages of their own gradients, which is the
//     momentum of their averaged gradients, exact Muon's;
//   - everything else comes from old[rank % len(old)], as after
//     ResetErrors: in the compression stages every rank holds the same
//     state anyway (0/1 Adam's local steps between synchronizations
//     aside, where a new rank continues from that old rank's parameters).
//
// Padding elements start at zero. A run on one rank has no compression
// and no error buffers: a group grown from it starts its error buffers at
// zero. A group of one rank has none either: the mean owed is dropped
// with them. In the compression stage of 1-bit Adam and 1-bit LAMB
// (StateFull, StateCompact) the momentum was gathered in the old group's
// chunks, which StateCompact cannot pack into the new group's where a new
// chunk spans two old ones: the result says so (IntForeignMomentum), and
// StateCompact then holds the momentum as float32 until its next step has
// used it, taking StateFull's steps, bit for bit, from the same result.
//
// The result is a new checkpoint made, as far as Load can tell, by rank
// of world ranks; old is not changed. Checkpoints of another algorithm
// are refused, the error saying what moves them to another number of
// ranks (nothing for the exact optimizers, whose checkpoints load as they
// are, outer.Regroup for package outer's, zero.Consolidate for zero.Adam's:
// optim.RankChange), as are checkpoints of
// different steps or stages, with their errors already reset, or an old
// set that is not every rank's.
func Regroup(old []*optim.Checkpoint, world, rank int) (*optim.Checkpoint, error) {
	if err := checkRegroup(old, world, rank); err != nil {
		return nil, fmt.Errorf("onebit: Regroup: %w", err)
	}
	if world == len(old) {
		return old[rank].Clone(), nil
	}
	src := old[rank%len(old)]
	out := &optim.Checkpoint{
		Algorithm: src.Algorithm, World: world, Rank: rank, Stage: src.Stage,
		Ints: maps.Clone(src.Ints), Floats: maps.Clone(src.Floats),
	}
	g := newRegrouper(old, world, rank)
	ebs := g.errorBuffers()
	for _, t := range src.Tensors {
		switch {
		case optim.IsErrorBuffer(t.Name):
			// Made below, from every old rank's.
			if !slices.ContainsFunc(ebs, func(b errorBuffer) bool { return b.worker == t.Name || b.server == t.Name }) {
				return nil, fmt.Errorf("onebit: Regroup: %w: error buffer %q names no parameter or bucket of the run", optim.ErrIncompatibleCheckpoint, t.Name)
			}
		case g.sharded && g.isMoment(t.Name):
			// Re-cut below, after the parameters.
		case strings.HasPrefix(t.Name, TrackPrefix), strings.HasPrefix(t.Name, OwnerMeanPrefix), strings.HasPrefix(t.Name, OwnerErrorPrefix):
			// ExchangeOwners' state: made below.
		case src.Algorithm == AlgorithmMuon && strings.HasPrefix(t.Name, optim.MomentumBufferPrefix):
			m, err := g.mean(t.Name, len(t.Data))
			if err != nil {
				return nil, fmt.Errorf("onebit: Regroup: %w", err)
			}
			out.AddTensor(t.Name, t.Shape, m[:len(t.Data)])
		default:
			out.AddTensor(t.Name, t.Shape, t.Data)
		}
	}
	if world > 1 {
		for _, b := range ebs {
			we, se, err := g.errors(b)
			if err != nil {
				return nil, fmt.Errorf("onebit: Regroup: %w", err)
			}
			out.AddTensor(b.worker, []int{len(we)}, we)
			out.AddTensor(b.server, []int{len(se)}, se)
		}
	}
	if world > 1 && src.Algorithm == AlgorithmMuon && isOwners(src) {
		if err := g.owners(out); err != nil {
			return nil, fmt.Errorf("onebit: Regroup: %w", err)
		}
	}
	if g.sharded {
		if err := g.moments(out); err != nil {
			return nil, fmt.Errorf("onebit: Regroup: %w", err)
		}
	}
	if _, ok := out.Ints[IntBuckets]; ok {
		out.Ints[IntBuckets] = 0 // one rank has no buckets
		if world > 1 {
			out.Ints[IntBuckets] = int64(len(g.buckets))
		}
	}
	delete(out.Ints, IntForeignMomentum)
	if world > 1 && !g.sharded && src.Stage == optim.StageCompression && src.Algorithm != optim.AlgorithmZeroOneAdam && src.Algorithm != AlgorithmMuon {
		out.Ints[IntForeignMomentum] = 1
	}
	return out, nil
}

// IntForeignMomentum is 1 in a checkpoint of 1-bit Adam or 1-bit LAMB
// whose momentum another group gathered than the one it is made for:
// Regroup's onto another number of ranks in the compression stage, and a
// StateCompact rank's that still holds such a momentum. StateFull takes
// any momentum. StateCompact keeps it as the bits and scales of its own
// group's chunks: it takes a momentum with the flag that it cannot pack as
// float32 (4 bytes per parameter more) until its next compression step
// has used it, and refuses one without.
const IntForeignMomentum = "foreign_momentum"

// outerPrefix starts the algorithm names of package outer's checkpoints
// (outer.AlgorithmPrefix; outer imports onebit).
const outerPrefix = "outer-"

// zeroAlgorithm is the algorithm name of zero.Adam's checkpoints.
const zeroAlgorithm = "zero-adam"

// checkRegroup refuses what Regroup cannot do.
func checkRegroup(old []*optim.Checkpoint, world, rank int) error {
	if len(old) == 0 {
		return fmt.Errorf("no checkpoints")
	}
	if world < 1 || rank < 0 || rank >= world {
		return fmt.Errorf("rank %d of %d ranks", rank, world)
	}
	a := old[0]
	if a == nil {
		return fmt.Errorf("checkpoint 0 is nil")
	}
	switch {
	case a.Algorithm == optim.AlgorithmOnebitAdam, a.Algorithm == optim.AlgorithmOnebitLamb, a.Algorithm == optim.AlgorithmZeroOneAdam,
		a.Algorithm == AlgorithmMuon:
	case strings.HasPrefix(a.Algorithm, outerPrefix):
		return fmt.Errorf("%w: algorithm %q is the outer optimizer's (package outer), which Regroup does not carry: "+
			"outer.Regroup does (a copy on the same number of ranks; on another, old[r %% %d]'s state with the error feedback carried; docs/outer.md)",
			optim.ErrIncompatibleCheckpoint, a.Algorithm, len(old))
	case a.Algorithm == zeroAlgorithm:
		return fmt.Errorf("%w: algorithm %q has no error feedback to regroup: zero.Consolidate joins its shards into a checkpoint that loads on any group size",
			optim.ErrIncompatibleCheckpoint, a.Algorithm)
	default:
		return fmt.Errorf("%w: algorithm %q has no error feedback to regroup: %s",
			optim.ErrIncompatibleCheckpoint, a.Algorithm, optim.RankChange(a.Algorithm))
	}
	for r, ck := range old {
		switch {
		case ck == nil:
			return fmt.Errorf("checkpoint %d is nil", r)
		case ck.ErrorsReset:
			return fmt.Errorf("%w: checkpoint %d has its error buffers reset already: load it as it is", optim.ErrIncompatibleCheckpoint, r)
		case ck.World != len(old) || ck.Rank != r:
			return fmt.Errorf("%w: checkpoint %d was made by rank %d of %d; Regroup needs every rank's, in rank order (%d given)",
				optim.ErrIncompatibleCheckpoint, r, ck.Rank, ck.World, len(old))
		case ck.Algorithm != a.Algorithm:
			return fmt.Errorf("%w: checkpoint %d is of algorithm %q, checkpoint 0 of %q", optim.ErrIncompatibleCheckpoint, r, ck.Algorithm, a.Algorithm)
		case ck.Ints[optim.IntStep] != a.Ints[optim.IntStep] || ck.Stage != a.Stage:
			return fmt.Errorf("%w: checkpoint %d is at step %d (%s), checkpoint 0 at step %d (%s): not one run's",
				optim.ErrIncompatibleCheckpoint, r, ck.Ints[optim.IntStep], ck.Stage, a.Ints[optim.IntStep], a.Stage)
		case modeOf(ck) != modeOf(a):
			return fmt.Errorf("%w: checkpoint %d was made with StateMode %v, checkpoint 0 with %v", optim.ErrIncompatibleCheckpoint, r, modeOf(ck), modeOf(a))
		}
	}
	return nil
}

// regrouper knows the element counts of a run's buffers.
type regrouper struct {
	old         []*optim.Checkpoint
	world, rank int
	algorithm   string
	sharded     bool
	names       []string // the parameters, in order
	sizes       []int    // their element counts
	shapes      [][]int
	muon        []bool // per parameter: 1-bit Muon's Muon group (it has a momentum buffer)
	n           int    // every parameter's elements
	buckets     []int  // every bucket's elements (flat order): every parameter's when perParam
	perParam    bool   // error buffers per parameter (optim.PerParameter, or made before buckets)
}

func newRegrouper(old []*optim.Checkpoint, world, rank int) *regrouper {
	g := &regrouper{old: old, world: world, rank: rank, algorithm: old[0].Algorithm, sharded: modeOf(old[0]) == StateSharded}
	prefix := optim.ParamTensorName("")
	owners := isOwners(old[0])
	bucketed := []int{} // the elements of the parameters in the buckets
	for _, t := range old[0].Tensors {
		if name, ok := strings.CutPrefix(t.Name, prefix); ok {
			muon := old[0].Tensor(optim.MomentumBufferPrefix+name) != nil
			g.names = append(g.names, name)
			g.sizes = append(g.sizes, len(t.Data))
			g.shapes = append(g.shapes, t.Shape)
			g.muon = append(g.muon, muon)
			g.n += len(t.Data)
			if !owners || !muon {
				bucketed = append(bucketed, len(t.Data)) // ExchangeOwners' buckets: the AdamW group's
			}
		}
	}
	bytes, ok := old[0].Ints[IntBucketBytes]
	switch {
	case !ok || bytes == optim.PerParameter:
		g.perParam = true
		g.buckets = bucketed
	default:
		if bytes == 0 { // 0/1 Adam on one rank recorded none before Regroup took one rank
			bytes = optim.DefaultBucketBytes
		}
		bounds := bucketBounds(sum(bucketed), max(int(bytes)/4, 1), int(old[0].Ints[IntBucketCut]))
		for k := range len(bounds) - 1 {
			g.buckets = append(g.buckets, bounds[k+1]-bounds[k])
		}
	}
	return g
}

// errorBuffer is a pair of error buffers of a tensor of n elements: the
// fused buffer of every parameter (1-bit LAMB), a bucket or a parameter.
type errorBuffer struct {
	worker, server string
	n              int
}

// errorBuffers are the run's error buffers on more than one rank.
func (g *regrouper) errorBuffers() []errorBuffer {
	if g.algorithm == optim.AlgorithmOnebitLamb {
		return []errorBuffer{{FusedWorkerError, FusedServerError, g.n}}
	}
	out := make([]errorBuffer, len(g.buckets))
	for k, n := range g.buckets {
		out[k] = errorBuffer{BucketWorkerErrorName(k), BucketServerErrorName(k), n}
		if g.perParam {
			out[k] = errorBuffer{WorkerErrorPrefix + g.names[k], ServerErrorPrefix + g.names[k], n}
		}
	}
	return out
}

// errors are the new rank's buffers of b: zero from one rank; otherwise
// the old ranks' mean worker error and the server errors re-cut.
func (g *regrouper) errors(b errorBuffer) (we, se []float32, err error) {
	workers, servers := make([][]float32, len(g.old)), make([][]float32, len(g.old))
	if len(g.old) > 1 {
		c := PaddedLen(b.n, len(g.old)) / len(g.old)
		for r := range g.old {
			if workers[r], err = g.tensor(r, b.worker, b.n); err != nil {
				return nil, nil, err
			}
			if r*c >= b.n {
				continue // a chunk of padding only
			}
			if servers[r], err = g.tensor(r, b.server, min(c, b.n-r*c)); err != nil {
				return nil, nil, err
			}
		}
	}
	return RegroupErrors(workers, servers, b.n, g.world, g.rank)
}

// RegroupErrors returns the error buffers that rank rank of a group of
// world ranks takes over from an old group's, for one compressed
// allreduce (AllReduce with a State) of n elements, as Regroup does for
// the 1-bit optimizers' buffers: the worker error, PaddedLen(n, world)
// elements, is the mean of the old ranks' workers[r] over the first n
// elements (summed in float64, rounded once); the server error, this
// rank's chunk PaddedLen(n, world)/world, is cut from the old ranks'
// chunks servers[r] put back together, element for element, unchanged.
// Padding starts at zero. From one rank (len(workers) 1, whose run kept
// no error buffers) both start at zero. workers[r] needs at least n
// elements and servers[r] at least old rank r's chunk of the n (as a
// State's WorkerError and ServerError have); shorter ones are refused with
// an error wrapping optim.ErrIncompatibleCheckpoint. Package outer's
// Regroup carries its 1-bit codec's buffers with it.
func RegroupErrors(workers, servers [][]float32, n, world, rank int) (worker, server []float32, err error) {
	w := len(workers)
	switch {
	case n < 1 || world < 1 || rank < 0 || rank >= world:
		return nil, nil, fmt.Errorf("onebit: RegroupErrors: rank %d of %d ranks, %d elements", rank, world, n)
	case w == 0 || len(servers) != w:
		return nil, nil, fmt.Errorf("onebit: RegroupErrors: %w: %d worker and %d server errors", optim.ErrIncompatibleCheckpoint, w, len(servers))
	}
	padded := PaddedLen(n, world)
	server = make([]float32, padded/world)
	if w == 1 {
		return make([]float32, padded), server, nil
	}
	c := PaddedLen(n, w) / w
	for r := range w {
		if len(workers[r]) < n {
			return nil, nil, fmt.Errorf("onebit: RegroupErrors: %w: old rank %d's worker error has %d elements, want %d", optim.ErrIncompatibleCheckpoint, r, len(workers[r]), n)
		}
		if want := min(c, max(n-r*c, 0)); len(servers[r]) < want {
			return nil, nil, fmt.Errorf("onebit: RegroupErrors: %w: old rank %d's server error has %d elements, want %d", optim.ErrIncompatibleCheckpoint, r, len(servers[r]), want)
		}
	}
	worker = meanOf(workers, n, padded)
	// The new chunk [lo, hi) of the n elements, from the old chunks.
	nc := padded / world
	lo, hi := rank*nc, min(rank*nc+nc, n)
	for i := lo; i < hi; i++ {
		server[i-lo] = servers[i/c][i%c]
	}
	return worker, server, nil
}

// isMoment says whether the tensor called name is one of the sharded
// mode's moments: a shard, or a whole one (made on one rank).
func (g *regrouper) isMoment(name string) bool {
	for _, pre := range [...]string{ExpAvgShardPrefix, ExpAvgSqShardPrefix, optim.ExpAvgPrefix, optim.ExpAvgSqPrefix} {
		if strings.HasPrefix(name, pre) {
			return true
		}
	}
	return false
}

// tensor is rank r's tensor called name, with at least n elements.
func (g *regrouper) tensor(r int, name string, n int) ([]float32, error) {
	t := g.old[r].Tensor(name)
	if t == nil || len(t.Data) < n {
		return nil, fmt.Errorf("%w: checkpoint %d has no tensor %q of %d elements", optim.ErrIncompatibleCheckpoint, r, name, n)
	}
	return t.Data, nil
}

// mean is the new worker error buffer called name of a tensor of n
// elements: the old ranks' mean, padded for the new group.
func (g *regrouper) mean(name string, n int) ([]float32, error) {
	xs := make([][]float32, len(g.old))
	for r := range g.old {
		x, err := g.tensor(r, name, n)
		if err != nil {
			return nil, err
		}
		xs[r] = x
	}
	return meanOf(xs, n, PaddedLen(n, g.world)), nil
}

// meanOf is the element-wise mean of the first n elements of xs (each
// at least n long), summed in float64 and rounded once, in a buffer of
// padded elements whose padding is zero.
func meanOf(xs [][]float32, n, padded int) []float32 {
	sum := make([]float64, n)
	for _, x := range xs {
		for i, v := range x[:n] {
			sum[i] += float64(v)
		}
	}
	out := make([]float32, padded)
	for i, s := range sum {
		out[i] = float32(s / float64(len(xs)))
	}
	return out
}

// flat is the buffer called name of a tensor of n elements whose old
// ranks each hold their chunk, put back together.
func (g *regrouper) flat(name string, n int) ([]float32, error) {
	w := len(g.old)
	c := PaddedLen(n, w) / w
	out := make([]float32, n)
	for r := range w {
		lo := r * c
		if lo >= n {
			break
		}
		x, err := g.tensor(r, name, min(c, n-lo))
		if err != nil {
			return nil, err
		}
		copy(out[lo:min(lo+c, n)], x)
	}
	return out, nil
}

// chunk is this rank's chunk of flat, padded for the new group.
func (g *regrouper) chunk(flat []float32) []float32 {
	c := PaddedLen(len(flat), g.world) / g.world
	out := make([]float32, c)
	if lo := g.rank * c; lo < len(flat) {
		copy(out, flat[lo:min(lo+c, len(flat))])
	}
	return out
}

// moments writes the sharded mode's moments for the new group into out:
// shards of every bucket, or, on one rank (where the sharded mode runs as
// StateFull), every parameter's moments whole. They come from the old
// ranks' shards, or whole from a run on one rank.
func (g *regrouper) moments(out *optim.Checkpoint) error {
	for _, pre := range [...]struct{ shard, whole string }{
		{ExpAvgShardPrefix, optim.ExpAvgPrefix}, {ExpAvgSqShardPrefix, optim.ExpAvgSqPrefix},
	} {
		all := make([]float32, 0, g.n) // the moment of every element, flat
		if len(g.old) == 1 {
			for i, name := range g.names {
				x, err := g.tensor(0, pre.whole+name, g.sizes[i])
				if err != nil {
					return err
				}
				all = append(all, x[:g.sizes[i]]...)
			}
		} else {
			for k, n := range g.buckets {
				f, err := g.flat(bucketShardName(pre.shard, k), n)
				if err != nil {
					return err
				}
				all = append(all, f...)
			}
		}
		if len(all) != g.n {
			return fmt.Errorf("%w: the moments hold %d elements, the parameters %d", optim.ErrIncompatibleCheckpoint, len(all), g.n)
		}
		if g.world == 1 {
			for i, name := range g.names {
				out.AddTensor(pre.whole+name, g.shapes[i], all[:g.sizes[i]])
				all = all[g.sizes[i]:]
			}
			continue
		}
		for k, n := range g.buckets {
			sh := g.chunk(all[:n])
			out.AddTensor(bucketShardName(pre.shard, k), []int{len(sh)}, sh)
			all = all[n:]
		}
	}
	return nil
}

// owners makes ExchangeOwners' state of the new rank (1-bit Muon on more
// than one rank): every rank's tracking estimate of each Muon matrix is
// the old ranks' mean (their momenta's, from one old rank, where there
// were none), the owner's mean estimate is that same mean (the mean of
// the new ranks' estimates, as the exchange keeps it), and the owner's
// error feedback moves from the old owner unchanged (zero from one rank).
// The owners are dealt out again as NewMuon deals them.
func (g *regrouper) owners(out *optim.Checkpoint) error {
	var names []string
	var sizes []int
	var shapes [][]int
	for k, name := range g.names {
		if g.muon[k] {
			names, sizes, shapes = append(names, name), append(sizes, g.sizes[k]), append(shapes, g.shapes[k])
		}
	}
	owner := ownersOf(sizes, g.world)
	for k, name := range names {
		from := TrackPrefix + name
		if len(g.old) == 1 {
			from = optim.MomentumBufferPrefix + name
		}
		h, err := g.mean(from, sizes[k])
		if err != nil {
			return err
		}
		h = h[:sizes[k]]
		out.AddTensor(TrackPrefix+name, shapes[k], h)
		if owner[k] != g.rank {
			continue
		}
		out.AddTensor(OwnerMeanPrefix+name, shapes[k], h)
		e := make([]float32, sizes[k])
		for r := range g.old {
			if t := g.old[r].Tensor(OwnerErrorPrefix + name); t != nil {
				if len(t.Data) != sizes[k] {
					return fmt.Errorf("%w: checkpoint %d's %q has %d elements, want %d", optim.ErrIncompatibleCheckpoint, r, t.Name, len(t.Data), sizes[k])
				}
				copy(e, t.Data)
			}
		}
		out.AddTensor(OwnerErrorPrefix+name, shapes[k], e)
	}
	return nil
}
