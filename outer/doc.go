// Package outer is a DiLoCo-style outer optimizer for slow links: each
// rank runs an inner optimizer (AdamW: NewAdam; Muon with its auxiliary
// AdamW, MuLoCo's setting: NewMuon; any local optimizer: New) on its own
// gradients for H steps
// without communicating, then the ranks average their pseudo-gradients
// Δ_i = θ_g - θ_i and take one outer step, Nesterov momentum SGD (lr 0.7,
// momentum 0.9 by default), which gives the new global parameters θ_g
// every rank continues from. The spec page is docs/outer.md.
//
// The pseudo-gradients travel with a codec chosen in Config.Codec: exact
// float32, bfloat16, symmetric int8 with one scale per 256 elements, or
// lowbit's error-compensated 1-bit allreduce. The 1-bit codec compresses
// the outer momentum, as 1-bit Adam does, not the raw pseudo-gradient:
// each rank compresses x_i = μ·u + Δ_i (error feedback on both sides,
// buffers kept across outer steps), the average ū is the new momentum,
// identical on every rank, and the averaged pseudo-gradient it implies,
// Δ̄ = ū - μ·u, gives the Nesterov step θ_g -= lr·(Δ̄ + μ·ū). Compressing
// the raw pseudo-gradient diverged under the Nesterov step in a
// simulation; compressing the momentum was stable.
//
// Streaming (Config.Fragments, Config.Delay): the flat concatenation of
// the parameters is cut into F fragments that exchange at staggered
// calls, fragment f at the calls t = f·H/F (mod H); with Delay τ > 0 a
// fragment's exchange runs on a goroutine of its own, on a communicator
// split off the group, while the next τ inner steps compute, and is
// merged τ calls after its launch keeping the local progress made
// meanwhile: θ_i = θ_g + (θ_i - θ_i at launch).
//
// Optimizer implements optim.Optimizer: Step (once per training step on
// every rank; only the exchange calls communicate), Stats, State and Load
// (bit-identical resume, with an exchange in flight too), Close; and
// optim.LRSetter (the inner optimizer's learning rate) and
// optim.FlagCarrier (flags carried by CarryFlags cost one small agreement
// per Step, which a loop that carries none does not pay;
// CarryFlagsAtExchanges carries them in the exchanges' agreements only, so
// that no Step between exchanges communicates: each rank decides its own
// inner steps, and the ranks agree at the exchanges). Between exchanges the
// ranks' parameters differ: Global holds the parameters every rank agrees
// on, the ones to evaluate. Errors reach every rank: a rank whose Step
// fails tells the others, as a failure, at their next agreement, whose
// Step then fails on every rank naming it; from there every rank is failed
// alike and every later Step fails at once, without communicating, until
// Load (see Step, which also says which context governs what).
// OuterStats reports the exchanges and the compute utilization.
package outer
