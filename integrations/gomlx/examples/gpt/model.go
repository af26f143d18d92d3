package main

import (
	"fmt"

	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/layers/attention/pos"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ml/zoo/transformer"
)

// vocab is the number of byte values: the model reads and predicts bytes.
const vocab = 256

// modelConfig is the size of the transformer (the model size flags).
type modelConfig struct {
	dModel  int // embedding width
	layers  int // transformer blocks
	heads   int // attention heads per block; dModel/heads is the head width
	ffn     int // hidden width of the feed-forward part of a block
	context int // tokens (bytes) per sequence
}

func (m modelConfig) String() string {
	return fmt.Sprintf("d_model %d, %d blocks, %d heads, ffn %d, context %d", m.dModel, m.layers, m.heads, m.ffn, m.context)
}

// gpt is the decoder-only transformer of GoMLX's model zoo: byte
// embeddings plus learned position embeddings, m.layers blocks of causal
// multi-head self-attention and a GELU feed-forward part, each with a
// residual connection and layer normalization, a final layer norm and a
// dense projection to the 256 byte logits.
func gpt(scope *model.Scope, m modelConfig) *transformer.Model {
	return transformer.New(scope).
		WithVocabSize(vocab).
		WithEmbedDim(m.dModel).
		WithNumLayers(m.layers).
		WithNumHeads(m.heads).
		WithHeadDim(m.dModel / m.heads).
		WithFFNDim(m.ffn).
		WithMaxPosEmbed(m.context).
		WithPositionalEncoder(pos.NewLearned(scope, m.context, m.dModel)).
		WithCausalMask(true).
		WithNormalization(layers.NormalizationLayerNorm).
		WithFinalNormalization(layers.NormalizationLayerNorm)
}

// logitsFn returns the model function of train.NewTrainer: x are the
// input bytes [batch, context] (int32), the result the logits of the next
// byte at every position [batch, context, 256]. The Trainer's loss is
// loss.SparseCategoricalCrossEntropyLogits against the next bytes
// [batch, context, 1], averaged over every position: nats per byte.
func logitsFn(m modelConfig) func(scope *model.Scope, x *graph.Node) *graph.Node {
	return func(scope *model.Scope, x *graph.Node) *graph.Node {
		return gpt(scope, m).Logits(x, transformer.CallOptions{})
	}
}

// sumLossFn is the training loss summed instead of averaged: the validation graph
// returns the total, so that ranks with different numbers of windows can
// add theirs.
func sumLossFn(m modelConfig) func(scope *model.Scope, x, y *graph.Node) *graph.Node {
	return func(scope *model.Scope, x, y *graph.Node) *graph.Node {
		logits := gpt(scope, m).Logits(x, transformer.CallOptions{})
		// The loss function returns the mean over every position.
		mean := loss.SparseCategoricalCrossEntropyLogits([]*graph.Node{y}, []*graph.Node{logits})
		return graph.MulScalar(mean, float64(x.Shape().Size()))
	}
}
