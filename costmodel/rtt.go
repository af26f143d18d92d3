package costmodel

import "fmt"

// A wide-area link: the calibration's alpha (17-20 µs a round) is a
// loopback's latency, which a link between sites does not have. Job.RTT
// gives the link's round trip instead.

// wideAreaBelow is the link rate, in bytes per second (1 Gbit/s), below
// which a plan that keeps the calibration's alpha says so
// (Assumptions.AlphaNote): links that slow are often wide-area ones, whose
// round trips are milliseconds.
const wideAreaBelow = 125e6

// maxRTT is the longest Job.RTT that Plan accepts: its half is Job.Alpha's
// limit, a second a round.
const maxRTT = 2.0

// roundTrip applies j.RTT to the plan's assumptions and setup: every
// latency-bound round of every collective (the ring allreduce's 2(W-1),
// the all-gathers' and all-to-alls' W-1 each, the outer optimizer's
// agreement) is one hop, in which each rank sends one message and
// receives one that was sent at the start of the round, so that it costs
// a one-way latency, half the round trip. The round is not scaled by
// oversubscription (alphaFor): that scaling is a loopback's wait for a
// rank to be scheduled, not a network's.
func (j Job) roundTrip(a *Assumptions, s *setup) {
	if j.RTT <= 0 {
		return
	}
	a.Alpha = j.RTT.Seconds() / 2
	a.AlphaFrom = fmt.Sprintf("%s %s / 2: a round is a one-way hop", j.fieldName("RTT"), j.RTT)
	s.NetworkAlpha = true
}

// alphaNote is Assumptions.AlphaNote for j: on a link slower than
// wideAreaBelow whose latency neither RTT nor Alpha gives, that the plan
// assumes the calibration loopback's.
func (j Job) alphaNote() string {
	if j.RTT > 0 || j.Alpha > 0 || j.Link >= wideAreaBelow {
		return ""
	}
	return fmt.Sprintf("the latency is the calibration loopback's (alpha above); a link below 1 Gbit/s is often a wide-area one, "+
		"whose round trip of milliseconds costs every round far more: give it with %s (e.g. %[1]s 40ms)", j.fieldName("RTT"))
}
