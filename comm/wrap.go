package comm

// Wrapper is implemented by a communicator that wraps another one (to
// time, trace or inject faults into its calls) and forwards every
// collective to it, one call for one call. Unwrap returns the wrapped
// communicator.
//
// The optional capabilities of a communicator (CheckSkipper, Concurrent,
// NodeSplitter, and any a backend adds) are found through As, which looks
// through wrappers: a wrapper keeps the fast paths of what it wraps by
// implementing Unwrap, and need not forward each capability by hand. A
// wrapper that implements a capability itself is found first, before the
// communicator it wraps; that is how a wrapper wraps the communicators a
// capability makes (see NodeSplitter: a SplitNode of its own can return
// errors.ErrUnsupported where the wrapped communicator has none).
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
func As[T any](c Comm) (T, bool) {
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
	var zero T
	return zero, false
}
