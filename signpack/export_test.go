package signpack

// Kernels is one set of the internal kernels, so that the tests can run
// every case against each set.
type Kernels struct {
	Name           string
	Pack           func(dst []byte, src []float32)
	PackResidual   func(dst []byte, x []float32, scale float32)
	UnpackScale    func(dst []float32, src []byte, scale float32)
	UnpackScaleAdd func(acc []float32, src []byte, scale float32)
	// UnpackScaleStream is UnpackScale with non-temporal stores where the
	// path has them.
	UnpackScaleStream func(dst []float32, src []byte, scale float32)
}

// Generic is the portable path; Fast is what the exported functions use on
// this machine (the AVX2 path on amd64 CPUs that have it).
var (
	Generic = Kernels{"generic", packGeneric, packResidualGeneric, unpackScaleGeneric, unpackScaleAddGeneric, unpackScaleGeneric}
	Fast    = Kernels{"fast", pack, packResidual, unpackScale, unpackScaleAdd, unpackScaleStream}
)

// FastPath names the kernels behind Fast.
var FastPath = fastPath

// ReadBaseline is the streaming read the benchmarks compare against.
var ReadBaseline = readBaseline

// Streams reports whether UnpackScaleStream writes dst with non-temporal
// stores on this machine.
var Streams = streams
