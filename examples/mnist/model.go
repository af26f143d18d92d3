package main

import (
	"fmt"
	"math"
	"math/rand/v2"

	"gonum.org/v1/gonum/blas"
	"gorgonia.org/tensor"

	"github.com/lowbit-ml/lowbit/optim"
)

// Layer sizes of the model.
const (
	numInputs  = 28 * 28
	numHidden  = 256
	numClasses = 10
)

// mlp is a 784-256-10 perceptron with a ReLU hidden layer and a softmax
// cross-entropy loss. Its parameters are optim.Params (gorgonia dense
// tensors) and every matrix product goes through the BLAS that gorgonia's
// tensor engine uses (tensor.WhichBLAS). Activations live in buffers sized
// for the largest batch, so a training step allocates nothing.
type mlp struct {
	w1, b1, w2, b2 *optim.Param // w1 is in x hidden, w2 hidden x classes (row-major)

	maxBatch int
	x        *tensor.Dense // batch x in: the inputs, standardised
	h        *tensor.Dense // batch x hidden: ReLU outputs
	p        *tensor.Dense // batch x classes: logits, then probabilities, then dLoss/dlogits
	dh       *tensor.Dense // batch x hidden: dLoss/dh
}

// newMLP returns a model with He-initialised weights (normal with variance
// 2/fan_in) drawn from seed and zero biases, with room for batches of up to
// maxBatch examples. The same seed gives the same parameters on every rank.
func newMLP(seed uint64, maxBatch int) *mlp {
	m := &mlp{
		w1: optim.NewParam("w1", numInputs, numHidden),
		b1: optim.NewParam("b1", numHidden),
		w2: optim.NewParam("w2", numHidden, numClasses),
		b2: optim.NewParam("b2", numClasses),
	}
	rng := rand.New(rand.NewPCG(seed, 0x6d6e697374)) // "mnist"
	he := func(p *optim.Param, fanIn int) {
		std := math.Sqrt(2 / float64(fanIn))
		for i := range p.Data() {
			p.Data()[i] = float32(rng.NormFloat64() * std)
		}
	}
	he(m.w1, numInputs)
	he(m.w2, numHidden)
	m.resize(maxBatch)
	return m
}

// resize makes the activation buffers hold batches of n examples.
func (m *mlp) resize(n int) {
	if n <= m.maxBatch {
		return
	}
	m.maxBatch = n
	dense := func(cols int) *tensor.Dense {
		return tensor.New(tensor.WithShape(n, cols), tensor.Of(tensor.Float32))
	}
	m.x, m.h, m.p, m.dh = dense(numInputs), dense(numHidden), dense(numClasses), dense(numHidden)
}

// params returns the parameters in the order the optimizer gets them.
func (m *mlp) params() []*optim.Param { return []*optim.Param{m.w1, m.b1, m.w2, m.b2} }

// f32 returns the backing slice of a float32 dense tensor.
func f32(t *tensor.Dense) []float32 { return t.Data().([]float32) }

// gemm sets c = a*b (+ c when accumulate), with a m x k (or its transpose
// when tA), b k x n (or its transpose when tB), all row-major and packed.
func gemm(tA, tB bool, m, n, k int, a, b, c []float32, accumulate bool) {
	ta, tb := blas.NoTrans, blas.NoTrans
	lda, ldb := k, n
	if tA {
		ta, lda = blas.Trans, m
	}
	if tB {
		tb, ldb = blas.Trans, k
	}
	var beta float32
	if accumulate {
		beta = 1
	}
	tensor.WhichBLAS().Sgemm(ta, tb, m, n, k, 1, a, lda, b, ldb, beta, c, n)
}

// The mean and standard deviation of MNIST's training pixels, scaled to
// [0, 1]: inputs are standardised with them.
const pixelMean, pixelStd = 0.1307, 0.3081

// pixelScale maps a pixel byte to its standardised input value. Every input
// is then non-zero, so every weight of the first layer gets a gradient: a
// weight whose gradient is always exactly zero has a zero second moment,
// which the 1-bit optimizers' frozen-variance stage cannot handle (its
// compressed momentum is not zero).
var pixelScale = func() (t [256]float32) {
	for i := range t {
		t[i] = float32((float64(i)/255 - pixelMean) / pixelStd)
	}
	return t
}()

// load copies the images idx[i] of set into the input buffer and returns
// the batch size.
func (m *mlp) load(set *dataset, idx []int) int {
	n := len(idx)
	m.resize(n)
	x := f32(m.x)
	for r, i := range idx {
		row := x[r*numInputs : (r+1)*numInputs]
		for j, px := range set.image(i) {
			row[j] = pixelScale[px]
		}
	}
	return n
}

// forward computes the logits of the n loaded examples into m.p.
func (m *mlp) forward(n int) {
	x, h, p := f32(m.x), f32(m.h), f32(m.p)
	b1, b2 := m.b1.Data(), m.b2.Data()
	for r := range n {
		copy(h[r*numHidden:(r+1)*numHidden], b1)
		copy(p[r*numClasses:(r+1)*numClasses], b2)
	}
	gemm(false, false, n, numHidden, numInputs, x, m.w1.Data(), h, true)
	for i, v := range h[:n*numHidden] {
		if v < 0 {
			h[i] = 0
		}
	}
	gemm(false, false, n, numClasses, numHidden, h, m.w2.Data(), p, true)
}

// lossGrad runs forward and backward on the n loaded examples with the
// given labels. It writes into the parameters' Grad tensors the gradient of
// scale * (sum of the examples' losses) and returns the sum of the losses.
func (m *mlp) lossGrad(n int, labels []byte, scale float32) float64 {
	m.forward(n)
	p := f32(m.p)
	var loss float64
	for r := range n {
		row := p[r*numClasses : (r+1)*numClasses]
		y := int(labels[r])
		loss += crossEntropy(row, y)
		row[y] -= 1
		for i := range row {
			row[i] *= scale
		}
	}
	x, h, dh := f32(m.x), f32(m.h), f32(m.dh)
	// Output layer: dW2 = h^T dz, db2 = sum of dz's rows, dh = dz W2^T.
	gemm(true, false, numHidden, numClasses, n, h, p, m.w2.GradData(), false)
	colSums(m.b2.GradData(), p, n, numClasses)
	gemm(false, true, n, numHidden, numClasses, p, m.w2.Data(), dh, false)
	// ReLU: the gradient passes where the unit was active.
	for i, v := range h[:n*numHidden] {
		if v <= 0 {
			dh[i] = 0
		}
	}
	// Hidden layer: dW1 = x^T dh, db1 = sum of dh's rows.
	gemm(true, false, numInputs, numHidden, n, x, dh, m.w1.GradData(), false)
	colSums(m.b1.GradData(), dh, n, numHidden)
	return loss
}

// crossEntropy turns the logits in row into probabilities in place and
// returns -log p[label].
func crossEntropy(row []float32, label int) float64 {
	mx := row[0]
	for _, v := range row[1:] {
		mx = max(mx, v)
	}
	var sum float64
	for i, v := range row {
		e := math.Exp(float64(v - mx))
		row[i] = float32(e)
		sum += e
	}
	logit := float64(row[label])
	inv := 1 / sum
	for i := range row {
		row[i] = float32(float64(row[i]) * inv)
	}
	return math.Log(sum) - math.Log(logit)
}

// colSums sets dst[j] to the sum over the n rows of the cols-wide matrix a
// of column j.
func colSums(dst, a []float32, n, cols int) {
	clear(dst)
	for r := range n {
		for j, v := range a[r*cols : (r+1)*cols] {
			dst[j] += v
		}
	}
}

// evaluate runs the model over examples [lo, hi) of set in chunks of the
// buffer size and returns the number classified correctly and the sum of
// their losses.
func (m *mlp) evaluate(set *dataset, lo, hi int, idx []int) (correct int, loss float64) {
	for start := lo; start < hi; start += len(idx) {
		n := min(len(idx), hi-start)
		for i := range n {
			idx[i] = start + i
		}
		m.load(set, idx[:n])
		m.forward(n)
		p := f32(m.p)
		for r := range n {
			row := p[r*numClasses : (r+1)*numClasses]
			best := 0
			for j, v := range row {
				if v > row[best] {
					best = j
				}
			}
			y := int(set.labels[start+r])
			if best == y {
				correct++
			}
			loss += crossEntropy(row, y)
		}
	}
	return correct, loss
}

// checkParams reports an error when a parameter holds a NaN or Inf.
func (m *mlp) checkParams() error {
	for _, p := range m.params() {
		for _, v := range p.Data() {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				return fmt.Errorf("parameter %s is not finite; lower -lr", p.Name)
			}
		}
	}
	return nil
}
