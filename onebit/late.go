package onebit

import "github.com/lowbit-ml/lowbit/optim"

// The rule for elements whose v carries no information (see the package
// doc): the ratio m_hat/(sqrt(v_hat)+eps) of every compression-stage
// update is bounded by ratioBound's optim.RatioBound.
const (
	// CapFactor times optim.AdamRatioBound (7.27 at betas 0.9 and 0.999)
	// is the largest ratio any element's update may take: no element steps
	// more than CapFactor times farther than exact Adam ever could. The
	// compressed momentum is an estimate, and the frozen v an old one:
	// ordinary elements go beyond exact Adam's bound, up to 8 times it in
	// the spec's reference runs (random gradients, four warm-up steps,
	// betas 0.9 and 0.99), 7.6 times in ExampleNewLamb (elements whose
	// averaged gradient was nearly zero in the warm-up) and 3.6 times in
	// DeepSpeed's own 0/1 Adam run (a local step; TestDeepSpeedRuns). Clipping them
	// costs accuracy (the clipped part of a step is never made up, so the
	// error feedback no longer cancels in the parameters): 10 leaves them
	// untouched.
	CapFactor = 10
	// KneeRatio is the ratio beyond which v counts as carrying no
	// information about the element's scale: a v_hat a million times
	// below the square of the momentum the compression hands it (whose
	// magnitude is the scale of its chunk). Beyond it the bound falls
	// towards 1, the ratio exact Adam takes under a steady gradient, which
	// an element with v zero (first given gradient after the warm-up)
	// takes.
	KneeRatio = 1000
)

// ratioBound is the bound of the compression-stage updates: a cap of
// CapFactor*optim.AdamRatioBound (KneeRatio where that is infinite or
// larger) and the knee KneeRatio.
func ratioBound(beta1, beta2 float32) optim.RatioBound {
	c := min(CapFactor*optim.AdamRatioBound(beta1, beta2), KneeRatio)
	return optim.RatioBound{Cap: c, Knee: KneeRatio}
}
