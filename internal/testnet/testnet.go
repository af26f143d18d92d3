// Package testnet is a tiny two-layer classifier and a generated data set
// for the tests of the optimizers (onebit, optim/zero): a task with real
// structure that runs in milliseconds on one core and gives bit-for-bit
// repeatable gradients.
//
// The network is in -> hidden (tanh) -> out with a softmax cross-entropy
// loss; forward and backward passes are written by hand on the []float32
// backing slices of optim.Param values. The data are Gaussian inputs
// labelled by a random teacher network of the same shape, so that the
// classes are separable by the student but not linearly.
package testnet

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/lowbit-ml/lowbit/optim"
)

// Data is a labelled classification set of N samples: sample i is
// X[i*In:(i+1)*In] with label Y[i] in [0, Classes).
type Data struct {
	X       []float32
	Y       []int
	N       int
	In      int
	Classes int
}

// Shard returns samples [lo, hi) as a Data sharing memory with d.
func (d Data) Shard(lo, hi int) Data {
	return Data{X: d.X[lo*d.In : hi*d.In], Y: d.Y[lo:hi], N: hi - lo, In: d.In, Classes: d.Classes}
}

// Generate returns n samples of in features labelled with classes classes
// by a random teacher network (in -> 2*in tanh -> classes) drawn from seed.
// Inputs are standard normal; the same seed gives the same set.
func Generate(seed uint64, n, in, classes int) Data {
	return GenerateNoisy(seed, n, in, classes, 0)
}

// GenerateNoisy is Generate with a fraction flip of the labels (drawn
// from seed) replaced by uniformly random ones, so that no network fits
// the set perfectly and the training loss levels off well above zero.
func GenerateNoisy(seed uint64, n, in, classes int, flip float64) Data {
	rng := rand.New(rand.NewPCG(seed, 0x7e57))
	teacher := newNet(rng, in, 2*in, classes, 1.5)
	d := Data{X: make([]float32, n*in), Y: make([]int, n), N: n, In: in, Classes: classes}
	for i := range d.X {
		d.X[i] = float32(rng.NormFloat64())
	}
	logits := make([]float32, classes)
	for i := 0; i < n; i++ {
		teacher.forward(d.X[i*in:(i+1)*in], logits)
		d.Y[i] = argmax(logits)
	}
	if flip > 0 {
		noise := rand.New(rand.NewPCG(seed, 0xf11b))
		for i := range d.Y {
			if noise.Float64() < flip {
				d.Y[i] = noise.IntN(classes)
			}
		}
	}
	return d
}

// Net is a two-layer network in -> hidden (tanh) -> out. Its parameters
// are, in order, "fc1.weight" [hidden, in], "fc1.bias" [hidden],
// "fc2.weight" [out, hidden] and "fc2.bias" [out].
type Net struct {
	In, Hidden, Out int
	params          []*optim.Param

	h, dh, logits, dlogits []float32 // per-sample scratch
}

// New returns a network whose weights are drawn from seed (uniform in
// ±1/sqrt(fan_in), biases zero); the same seed gives the same network.
func New(seed uint64, in, hidden, out int) *Net {
	return newNet(rand.New(rand.NewPCG(seed, 0x4e37)), in, hidden, out, 1)
}

func newNet(rng *rand.Rand, in, hidden, out int, gain float64) *Net {
	n := &Net{
		In: in, Hidden: hidden, Out: out,
		params: []*optim.Param{
			optim.NewParam("fc1.weight", hidden, in),
			optim.NewParam("fc1.bias", hidden),
			optim.NewParam("fc2.weight", out, hidden),
			optim.NewParam("fc2.bias", out),
		},
		h: make([]float32, hidden), dh: make([]float32, hidden),
		logits: make([]float32, out), dlogits: make([]float32, out),
	}
	fill := func(p *optim.Param, fanIn int) {
		a := gain / math.Sqrt(float64(fanIn))
		for i := range p.Data() {
			p.Data()[i] = float32(a * (2*rng.Float64() - 1))
		}
	}
	fill(n.params[0], in)
	fill(n.params[2], hidden)
	return n
}

// Params returns the parameters, in the order documented on Net.
func (n *Net) Params() []*optim.Param { return n.params }

// NumParams is the total number of elements over the parameters.
func (n *Net) NumParams() int {
	t := 0
	for _, p := range n.params {
		t += p.Numel()
	}
	return t
}

func (n *Net) forward(x, logits []float32) {
	w1, b1 := n.params[0].Data(), n.params[1].Data()
	w2, b2 := n.params[2].Data(), n.params[3].Data()
	for j := 0; j < n.Hidden; j++ {
		s := b1[j]
		row := w1[j*n.In : (j+1)*n.In]
		for k, v := range x {
			s += row[k] * v
		}
		n.h[j] = float32(math.Tanh(float64(s)))
	}
	for o := 0; o < n.Out; o++ {
		s := b2[o]
		row := w2[o*n.Hidden : (o+1)*n.Hidden]
		for j, v := range n.h {
			s += row[j] * v
		}
		logits[o] = s
	}
}

// softmaxCE turns logits into probabilities in place and returns the
// cross-entropy of label y.
func softmaxCE(logits []float32, y int) float64 {
	mx := logits[0]
	for _, v := range logits {
		mx = max(mx, v)
	}
	var z float64
	for i, v := range logits {
		e := math.Exp(float64(v - mx))
		logits[i] = float32(e)
		z += e
	}
	loss := -(math.Log(float64(logits[y])) - math.Log(z))
	for i := range logits {
		logits[i] = float32(float64(logits[i]) / z)
	}
	return loss
}

// LossGrad overwrites the parameters' gradients with the gradient of the
// mean cross-entropy over d and returns that mean loss.
func (n *Net) LossGrad(d Data) (float64, error) {
	if d.In != n.In || d.Classes != n.Out {
		return 0, fmt.Errorf("testnet: data of %d features and %d classes for a %d-%d-%d network", d.In, d.Classes, n.In, n.Hidden, n.Out)
	}
	for _, p := range n.params {
		clear(p.GradData())
	}
	gw1, gb1 := n.params[0].GradData(), n.params[1].GradData()
	gw2, gb2 := n.params[2].GradData(), n.params[3].GradData()
	w2 := n.params[2].Data()
	inv := 1 / float32(d.N)
	var total float64
	for i := 0; i < d.N; i++ {
		x := d.X[i*d.In : (i+1)*d.In]
		n.forward(x, n.logits)
		total += softmaxCE(n.logits, d.Y[i])
		// dL/dlogits = (softmax - onehot) / N.
		for o := range n.dlogits {
			n.dlogits[o] = n.logits[o] * inv
		}
		n.dlogits[d.Y[i]] -= inv
		clear(n.dh)
		for o, g := range n.dlogits {
			gb2[o] += g
			row := w2[o*n.Hidden : (o+1)*n.Hidden]
			grow := gw2[o*n.Hidden : (o+1)*n.Hidden]
			for j, hv := range n.h {
				grow[j] += g * hv
				n.dh[j] += g * row[j]
			}
		}
		for j, g := range n.dh {
			g *= 1 - n.h[j]*n.h[j] // tanh'
			gb1[j] += g
			grow := gw1[j*n.In : (j+1)*n.In]
			for k, v := range x {
				grow[k] += g * v
			}
		}
	}
	return total / float64(d.N), nil
}

// Evaluate returns the mean cross-entropy and the accuracy (in [0, 1]) of
// the network on d. It does not touch the gradients.
func (n *Net) Evaluate(d Data) (loss, acc float64) {
	correct := 0
	for i := 0; i < d.N; i++ {
		n.forward(d.X[i*d.In:(i+1)*d.In], n.logits)
		if argmax(n.logits) == d.Y[i] {
			correct++
		}
		loss += softmaxCE(n.logits, d.Y[i])
	}
	return loss / float64(d.N), float64(correct) / float64(d.N)
}

func argmax(v []float32) int {
	best := 0
	for i, x := range v {
		if x > v[best] {
			best = i
		}
	}
	return best
}

// Batch returns the t-th minibatch (t counted from 1) of batch samples of
// d, cycling through d in order; d.N must be a multiple of batch.
func (d Data) Batch(t int64, batch int) Data {
	lo := int((t - 1) * int64(batch) % int64(d.N))
	return d.Shard(lo, lo+batch)
}

// Train runs steps from..to (inclusive, counted from 1) of data-parallel
// training on this rank: at step t it writes the network's gradient on
// the t-th batch of shard into the parameters, calls before(t) (when not
// nil; it may change the gradients), then opt.Step. Every rank of the
// optimizer's group must call it with the same steps.
func Train(ctx context.Context, opt optim.Optimizer, net *Net, shard Data, batch int, from, to int64, before func(t int64)) error {
	if batch < 1 || shard.N%batch != 0 {
		return fmt.Errorf("testnet: shard of %d samples is not a whole number of batches of %d", shard.N, batch)
	}
	for t := from; t <= to; t++ {
		if _, err := net.LossGrad(shard.Batch(t, batch)); err != nil {
			return err
		}
		if before != nil {
			before(t)
		}
		if err := opt.Step(ctx); err != nil {
			return fmt.Errorf("testnet: step %d: %w", t, err)
		}
	}
	return nil
}

// Skewed deals the samples of d, in order, into w shards of n samples
// each whose label mixes differ: a sample goes, with probability skew, to
// shard label % w, and otherwise to shard i % w (i its index), or to the
// next shard with room when that one is full. With skew 0 the shards are
// alike; with skew near 1 shard r holds mostly class r. It fails when d
// has fewer than w*n samples.
func Skewed(d Data, w, n int, skew float64, seed uint64) ([]Data, error) {
	if d.N < w*n {
		return nil, fmt.Errorf("testnet: %d samples cannot fill %d shards of %d", d.N, w, n)
	}
	rng := rand.New(rand.NewPCG(seed, 0x5ced))
	shards := make([]Data, w)
	for r := range shards {
		shards[r] = Data{X: make([]float32, 0, n*d.In), Y: make([]int, 0, n), In: d.In, Classes: d.Classes}
	}
	for i := 0; i < d.N; i++ {
		r := i % w
		if rng.Float64() < skew {
			r = d.Y[i] % w
		}
		for k := 0; k < w && shards[r].N == n; k++ {
			r = (r + 1) % w
		}
		if shards[r].N == n {
			return shards, nil
		}
		s := &shards[r]
		s.X = append(s.X, d.X[i*d.In:(i+1)*d.In]...)
		s.Y = append(s.Y, d.Y[i])
		s.N++
	}
	return shards, nil
}

// Concat returns the samples of every shard, one shard after the other.
func Concat(shards []Data) Data {
	out := Data{In: shards[0].In, Classes: shards[0].Classes}
	for _, s := range shards {
		out.X = append(out.X, s.X...)
		out.Y = append(out.Y, s.Y...)
		out.N += s.N
	}
	return out
}
