package comm

import (
	"context"
	"errors"
	"fmt"
)

// Wrapper is implemented by a communicator that wraps another one (to
// time, trace or inject faults into its calls) and forwards every
// collective to it, one call for one call. Unwrap returns the wrapped
// communicator.
//
// The optional capabilities of a communicator (CheckSkipper, NodeSplitter,
// and any a backend adds) are found through As, which looks through
// wrappers: a wrapper keeps the fast paths of what it wraps by implementing
// Unwrap, and need not forward each capability by hand. A wrapper that
// implements a capability itself is found first, before the communicator it
// wraps.
//
// Two capabilities depend on the wrapper itself, and the functions that
// use them (not As, which finds every capability alike) hand them through
// a wrapper only in a form that is safe for it:
//
//   - NodeSplitter makes communicators. SplitNode, finding it through a
//     wrapper that does not implement SplitNode, learns the node from the
//     wrapped communicator and then makes the node's communicator with the
//     wrapper's own Split, so the wrapper sees the node's traffic as it
//     sees that of any communicator split off it. A wrapper that must see
//     every split-off communicator's calls therefore implements Split
//     (wrapping what the wrapped Split returns); one that embeds the
//     wrapped communicator and forwards Split gets unwrapped communicators
//     back from both. A wrapper may also implement SplitNode itself, which
//     can return errors.ErrUnsupported where the wrapped communicator has
//     no NodeSplitter (see NodeSplitter).
//   - Concurrent promises that the wrapper's own state (counters, logs,
//     fault plans shared with the communicators split off it) is safe for
//     collectives that overlap from several goroutines. CanOverlap never
//     takes it from a wrapped communicator: a wrapper that is
//     goroutine-safe says so by implementing Concurrent, typically as
//     CanOverlap(wrapped), and otherwise its collectives do not overlap.
//
// A wrapper whose calls are not one to one with the wrapped communicator's
// (one that adds collectives of its own, say) must not implement Unwrap:
// CheckSkipper's promise counts the wrapped communicator's calls.
type Wrapper interface {
	// Unwrap returns the wrapped communicator.
	Unwrap() Comm
}

// As looks for a T in c and the communicators it wraps (see Wrapper),
// outermost first, and returns the first it finds. T is an interface type,
// one of the optional capabilities such as CheckSkipper.
//
// As finds every capability alike. Two are used through functions that
// apply their rule for wrappers (see Wrapper): split off a node with
// SplitNode rather than through the NodeSplitter As finds, and ask
// CanOverlap, not the Concurrent As finds, whether collectives may
// overlap.
func As[T any](c Comm) (T, bool) {
	var zero T
	for c != nil {
		if t, ok := c.(T); ok {
			return t, true
		}
		w, ok := c.(Wrapper)
		if !ok {
			break
		}
		c = w.Unwrap()
	}
	return zero, false
}

// SplitNode splits off the ranks that share this rank's node, through the
// NodeSplitter As finds in c, and returns errors.ErrUnsupported (wrapped)
// where there is none. Found on c itself, it is c's SplitNode. Found
// through a wrapper, the node communicator is made with c's Split: SplitNode
// calls the wrapped SplitNode, agrees on the node's smallest rank in one
// AllReduce on the node communicator that returns, closes that
// communicator and splits c by it; these calls on the wrapped
// communicators are not seen by the wrappers in between.
func SplitNode(ctx context.Context, c Comm) (Comm, error) {
	ns, ok := As[NodeSplitter](c)
	if !ok {
		return nil, fmt.Errorf("comm: node split: %w", errors.ErrUnsupported)
	}
	if _, own := c.(NodeSplitter); !own {
		ns = splitVia{outer: c, inner: ns}
	}
	return ns.SplitNode(ctx)
}

// splitVia is the NodeSplitter SplitNode uses for a wrapper that does not
// implement one: inner tells which ranks share a node, outer's Split makes
// their communicator.
type splitVia struct {
	outer Comm
	inner NodeSplitter
}

// SplitNode splits off the ranks that share this rank's node through
// outer.Split, ordered by their rank in outer.
func (s splitVia) SplitNode(ctx context.Context) (Comm, error) {
	node, err := s.inner.SplitNode(ctx)
	if err != nil {
		return nil, err
	}
	if node == nil {
		return nil, errors.New("comm: node split: the wrapped communicator returned no node communicator")
	}
	// The node's smallest rank names it: Max of the negated ranks.
	// float32 holds every rank below 2^24 exactly.
	first := []float32{-float32(s.outer.Rank())}
	err = node.AllReduce(ctx, first, Max)
	if cerr := node.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("comm: node split: agreeing on the node: %w", err)
	}
	c, err := s.outer.Split(ctx, int(-first[0]), s.outer.Rank())
	if err != nil {
		return nil, fmt.Errorf("comm: node split: %w", err)
	}
	return c, nil
}
