package optim

import "go.uber.org/zap"

// Options holds the settings every lowbit optimizer takes besides its
// config struct. The zero value is not used directly: ApplyOptions fills in
// the defaults.
type Options struct {
	// Logger receives a warning for every skipped step and an info line for
	// every stage switch and checkpoint load. Default: zap.NewNop().
	Logger *zap.Logger
}

// Option changes one setting of Options.
type Option func(*Options)

// WithLogger sets the logger. A nil logger keeps the default, zap.NewNop().
func WithLogger(l *zap.Logger) Option {
	return func(o *Options) {
		if l != nil {
			o.Logger = l
		}
	}
}

// ApplyOptions returns the defaults changed by opts, in order. Nil options
// are ignored.
func ApplyOptions(opts []Option) Options {
	o := Options{Logger: zap.NewNop()}
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return o
}
