package selection

import (
	"math"
	"sync"
)

// Service is one upstream's speed as the decision uses it, in seconds. It is estimated per upstream
// from the traffic the proxy relays (ServiceModel) and from the backend's own metrics.
type Service struct {
	// Overhead is the time from admission to the first token that does not depend on the prompt: a
	// scheduling round and the first decode step.
	Overhead float64
	// PrefillSecondsPerToken is the time to prefill one uncached prompt token (1/prefill rate).
	PrefillSecondsPerToken float64
	// TokenSeconds is the time one sequence takes per output token at the batch sizes seen recently.
	TokenSeconds float64
	// SequenceSeconds is how much longer each engine step runs for one more sequence in the batch, from
	// the busy intervals (the generated tokens beside the steps); 0 while they have not taught it. The
	// decision does not use it (docs/bench/busy-batch): it is reported.
	SequenceSeconds float64
	// Slots is the number of sequences the backend runs at once before new requests queue (vLLM's
	// max_num_seqs, or fewer when its KV cache is the limit); 0 when not known.
	Slots float64
	// MeanDuration is the mean time a request holds one of the upstream's slots: from its prefill's start
	// (not its wait for a slot) to its last byte.
	MeanDuration float64
	// Ceiling is the most requests the backend was seen running at once (its metrics); 0 when unknown.
	// A slot count below it is disproved.
	Ceiling float64
	// LikelySlots is Ceiling while the scrapes point to it as the slot count but too few to confirm it
	// (Slots): two or more showed requests waiting, not for cache space, at Ceiling and none below it; 0
	// otherwise (see ObserveQueue).
	LikelySlots float64
	// Free is the most requests this proxy had in flight on the upstream ahead of a first token that came
	// on time (ObserveFirstToken): it ran that many beside a new one without queueing it. While Slots is
	// unknown, a first token behind more than Free may have waited for a slot the decision did not predict.
	Free int
	// Samples is how many observations the estimate rests on (0: it is the prior).
	Samples int
	// FirstTokens is how many of them are observed first tokens (ObserveFirstToken), and BusyIntervals
	// how many are the backend's own counters over an interval it was busy prefilling (ObserveBusy).
	FirstTokens, BusyIntervals int
	// SkippedFirstTokens counts the first tokens observed that taught nothing: predicted to wait longer
	// than their own service, earlier than their predicted wait, or probably waiting for a slot.
	SkippedFirstTokens int

	// scaledPrefill is what PrefillSecondsPerToken is without the busy intervals (the prior at the
	// upstream's speed scale); 0 when first tokens pin it. Once busy intervals set PrefillSecondsPerToken
	// (fromBusy), its ratio to scaledPrefill is how much slower or faster this kind of
	// backend prefills than it decodes, against the prior: Fleet pools that ratio.
	scaledPrefill float64
	// fromBusy is set when the busy intervals' fit set PrefillSecondsPerToken: it had enough intervals
	// and its prefill is not past the fast edge of the plausible band (serviceLocked).
	fromBusy bool
	// steps is how long the backend's work between recent pairs of scrapes took against the prior
	// (ObserveSteps).
	steps stepWork
	// span is the same work for a fit of its step time and prefill speed (ObserveSpan, fitKind).
	span spanWork
}

// stepWork is what a backend did between pairs of consecutive scrapes, over the recent pairs: the time,
// the engine steps and the prompt tokens prefilled, summed (each pair weighing 1-scaleRate less at the
// next: about ten of memory), and per pair the log of its time over what the fixed Prior predicts for
// its work, as a mean and mean square (a running mean over the first ten, then each new one weighing
// scaleRate), with how many pairs (n, up to maxStateCount).
type stepWork struct {
	seconds, steps, uncached float64
	mean, meanSq             float64
	n                        int
}

// spanWork is what a backend did between scrapes, each span from one scrape to the first later one at
// which an engine step had ended (ObserveSpan): the spans' sums of squares and products, each weighing
// 1-scaleRate less at the next, for a least-squares fit of seconds = steps x step time + uncached x
// prefill seconds per token (fitKind), and how many spans (n, up to maxStateCount).
type spanWork struct {
	ss, su, uu, sy, uy, yy float64
	n                      int
}

// plus is w's sums, each times keep, plus o's (n is the caller's).
func (w spanWork) plus(keep float64, o spanWork) spanWork {
	return spanWork{
		ss: keep*w.ss + o.ss, su: keep*w.su + o.su, uu: keep*w.uu + o.uu,
		sy: keep*w.sy + o.sy, uy: keep*w.uy + o.uy, yy: keep*w.yy + o.yy,
		n: w.n,
	}
}

// validWork reports whether a backend's work between two snapshots can be observed: time passed, a step
// ended, no negative or infinite count.
func validWork(seconds, uncached, steps float64) bool {
	return seconds > 0 && steps >= 1 && uncached >= 0 && !math.IsInf(seconds+uncached+steps, 0)
}

// at is the log of how many times t seconds a step and p a prefilled token w's summed work took.
func (w stepWork) at(t, p float64) float64 {
	return math.Log(w.seconds / (w.steps*t + w.uncached*p))
}

// se2 is the squared standard error of a mean over w's pairs: their variance (against the prior, so it
// holds how much their mixes of decode and prefill varied as well) over as many as the mean rests on
// (at most ten independent ones: about the running mean's memory).
func (w stepWork) se2() float64 {
	n := float64(w.n)
	return max(w.meanSq-w.mean*w.mean, 0) * n / (n - 1) / min(n, 1/scaleRate)
}

// busyRatio is s's prefill speed from busy intervals over its speed-scaled prior; 0 when busy intervals
// do not set it.
func (s Service) busyRatio() float64 {
	if s.scaledPrefill == 0 || !s.fromBusy {
		return 0
	}
	return s.PrefillSecondsPerToken / s.scaledPrefill
}

// StepsVsPrior is how many times the prior's time the backend's engine steps took between scrapes, with
// the scrape pairs that say so (ObserveSteps); 0, 0 when none has.
func (s Service) StepsVsPrior() (ratio float64, scrapes int) {
	if s.steps.n == 0 {
		return 0, 0
	}
	return math.Exp(s.steps.at(Prior.TokenSeconds, Prior.PrefillSecondsPerToken)), s.steps.n
}

// TTFT is the time from the start of its prefill to the first token of a request with uncached
// prompt tokens, on an idle upstream.
func (s Service) TTFT(uncached int) float64 {
	return s.Overhead + float64(max(uncached, 0))*s.PrefillSecondsPerToken
}

// Duration is how long a request with uncached prompt tokens and output tokens to generate runs on an
// idle upstream: its time to first token, then its output.
func (s Service) Duration(uncached, output int) float64 {
	return s.TTFT(uncached) + float64(output)*s.TokenSeconds
}

// SlotWait says whether a request sent with ahead others in flight on the upstream may have waited for a
// slot that a prediction from s did not count: the slot count is unknown, and ahead is more than the
// upstream has been seen to run beside a new request without queueing it (Free).
func (s Service) SlotWait(ahead int) bool { return s.Slots == 0 && ahead > s.Free }

// Slower returns s with its times f times as long (its prefill, overhead and time per token).
func (s Service) Slower(f float64) Service {
	s.Overhead *= f
	s.PrefillSecondsPerToken *= f
	s.TokenSeconds *= f
	return s
}

// Prior is the service assumed for an upstream nothing is known about yet: a mid-range vLLM
// deployment (8k prefill tokens/s, 30 ms decode steps). It only has to be right within a few times:
// ServiceModel replaces it within a few dozen requests.
var Prior = Service{
	Overhead:               0.030,
	PrefillSecondsPerToken: 1.0 / 8000,
	TokenSeconds:           0.030,
	MeanDuration:           2,
}

// ServiceModel learns one upstream's Service online from what passes through the proxy:
//   - every first token's delay against the prefill queued ahead of it, when the response is observed
//     (the llm_resume handler sees it): recursive least squares with forgetting on
//     delay = overhead + seconds per token x uncached tokens, which pins the prefill rate;
//   - every finished request's duration against what the current estimate predicts for it: a speed
//     scale (an exponentially weighted mean of log(observed/predicted)) that scales the prior, or only the
//     decode part when first tokens pin the prefill. One scale is robust where a regression on durations
//     is not: a request's duration is mostly decoding and queueing, and says little about prefill alone;
//   - the backend's own running and waiting counts (when its metrics are scraped): a backend with
//     requests waiting runs as many as it can, so the most it runs then is its slot count.
//
// Estimates start from the prior, converge within a few dozen requests and follow a backend that slows
// down or speeds up; observations are clipped so one stalled connection cannot move them far.
//
// A ServiceModel is safe for concurrent use; every method is O(1) and takes one short lock.
type ServiceModel struct {
	mu        sync.Mutex
	prior     Service
	ttft      rls2    // first-token delay = overhead + prefill seconds per 1000 tokens x uncached/1000
	ttftN     int     // first tokens observed that taught it
	skippedN  int     // first tokens observed that taught nothing (ObserveFirstToken)
	busy      rls3    // a busy interval's seconds = step time x steps + seconds per 1000 sequence-steps x generated/1000 + prefill seconds per 1000 tokens x uncached/1000
	busyN     int     // busy intervals observed
	busyGenN  int     // of them, those that counted generated tokens (taught the time per sequence)
	logScale  float64 // log of observed/predicted durations (EWMA)
	durN      int
	steps     stepWork // how long its work between recent scrapes took against the prior (ObserveSteps)
	span      spanWork // its work between scrapes, step by step (ObserveSpan)
	meanDur   float64
	slots     float64 // the most it runs, once seen pinned at that ceiling with others waiting; 0: unknown
	ceiling   float64 // the most it was seen running
	reported  float64 // the slot count the backend reports itself (ReportSlots); 0: none
	atCeil    int     // scrapes with requests waiting (and cache room) running at the ceiling
	belowCeil int     // and running below it
	free      int     // the most requests this proxy had in flight ahead of a first token on time (ObserveFirstToken)
}

// forgetting is the weight the information along an observation's direction keeps when the observation
// arrives (rls2): about 20 observations of memory there, so a slowdown shows within a few dozen requests.
const forgetting = 0.95

// scaleRate is the weight of each new duration in the speed scale (about 10 requests of memory).
const scaleRate = 0.1

// NewServiceModel returns a model that starts from prior.
func NewServiceModel(prior Service) *ServiceModel {
	m := new(ServiceModel)
	m.resetLocked(prior)
	return m
}

// SetPrior replaces the prior (a capacity hint changed) and forgets what was learned.
func (m *ServiceModel) SetPrior(prior Service) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.prior != prior {
		m.resetLocked(prior)
	}
}

// Prior returns the prior the model starts from (SetPrior's, else NewServiceModel's).
func (m *ServiceModel) Prior() Service {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.prior
}

// resetLocked starts the model afresh from prior, keeping its lock (the caller holds it, or nobody
// else can see the model yet).
func (m *ServiceModel) resetLocked(prior Service) {
	m.prior, m.meanDur = prior, prior.MeanDuration
	m.ttft, m.ttftN, m.skippedN = newRLS2(prior.Overhead, prior.PrefillSecondsPerToken*1000, priorNoise(prior)), 0, 0
	m.busy, m.busyN, m.busyGenN = newBusyFit(prior), 0, 0
	m.logScale, m.durN = 0, 0
	m.steps, m.span = stepWork{}, spanWork{}
	m.forgetSlotsLocked()
}

// ObserveFirstToken records a first token that came ttft seconds after the request was sent, where
// the upstream had queued seconds of prefill ahead of it (as predicted when it was sent), the request
// had uncached prompt tokens to prefill, this proxy had ahead other requests in flight there, and the
// last of them to end while it waited ended sinceEnd seconds before it (ttft if none did). It reports
// whether the first token probably waited for a slot the prediction did not count: while the slot
// count is unknown, later than twice its predicted service, behind more of this proxy's requests than
// any first token came on time behind (SlotWait).
//
// Only a first token whose wait the decision predicted teaches the model: the wait is a prediction,
// and where it dominates, its error (a queue the proxy did not see) would be learned as overhead or
// prefill speed, and the upstreams that were busiest would look slowest. So a first token teaches
// nothing when it was predicted to wait longer than its own service, nor when it probably waited for a
// slot, which the decision does not predict while the slot count is unknown. A first token on time
// behind more requests than Free raises Free to them: the upstream ran that many beside a new one
// without queueing it.
//
// A slot frees when a request ends, so a request that waited for one started no later than the last
// end before its first token: its service took at least sinceEnd. When even that is late, no slot wait
// explains it, and the first token teaches that least service (and is still reported as a probable
// slot wait: its lateness does not move the predicted prefill queue). Before, an upstream priced faster than
// it was had every first token late and each one skipped as a slot wait (Free grows only with first
// tokens on time), so it learned nothing: traced behind transport llm (slow-prefill multi-turn-think),
// one kept the prior's speed for 2.7 s of a 4.7 s run, 56 of its first 64 first tokens skipped.
func (m *ServiceModel) ObserveFirstToken(uncached, ahead int, queued, ttft, sinceEnd float64) (slotWait bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	y := ttft - queued
	if !(y > 0) || math.IsInf(y, 0) {
		m.skippedN = counted(m.skippedN)
		return false
	}
	s := m.serviceLocked()
	pred := s.TTFT(uncached)
	late := y > onTime*pred
	slotWait = late && s.SlotWait(ahead)
	if slotWait && min(y, sinceEnd) > onTime*pred && queued <= pred {
		y = min(y, sinceEnd) // late even after the last slot freed: taught as its least service
	} else if queued > pred || slotWait {
		m.skippedN = counted(m.skippedN)
		return slotWait
	}
	if !late && ahead > m.free {
		m.free = min(ahead, maxStateCount)
	}
	y = m.clipStallLocked(y, pred) // a stalled connection must not teach a 10x slowdown at once
	m.ttft.update(float64(uncached)/1000, y)
	m.ttftN = counted(m.ttftN)
	return slotWait
}

// onTime is how far past its predicted service a first token may come and still show that the
// requests ahead of it left it a slot (ObserveFirstToken): a wait for a slot is a whole request's
// remaining decode, many steps, while a batch that grows by one slows a first token by a fraction.
const onTime = 2

// ObserveEnd records a request that finished duration seconds after it was sent, having waited about
// waited seconds (as predicted) before its prefill could start, with uncached prompt tokens and output
// tokens (observed, or the estimate).
func (m *ServiceModel) ObserveEnd(uncached, output int, waited, duration float64) {
	if !(duration > 0) || math.IsInf(duration, 0) {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	// MeanDuration is the time a request holds its slot: what it waited for one is not part of it (a
	// queue would otherwise lengthen the predicted interval between slots freeing, and so the queue).
	m.meanDur += scaleRate * (max(duration-waited, duration/10) - m.meanDur)
	s := m.serviceLocked()
	pred := waited + s.Duration(uncached, output)
	if !(pred > 0) {
		return
	}
	ratio := clamp(duration/pred, 1.0/maxScale, maxScale) // one outlier moves the scale by at most ~1.4x
	m.logScale = clamp(m.logScale+scaleRate*math.Log(ratio), -math.Log(maxScale), math.Log(maxScale))
	m.durN = counted(m.durN)
}

// ObserveBusy records what the backend did between two of its metrics snapshots seconds apart, during
// which it was running requests throughout: it ran steps engine steps, generated tokens (one a sequence
// a step; 0: not known) and prefilled uncached prompt tokens. An engine that has requests runs steps
// back to back, each a decode step for the batch, longer for every sequence in it, plus the prefill it
// carries, so
//
//	seconds = steps x step time + generated x seconds a sequence adds to a step + uncached x prefill seconds per token,
//
// fitted by recursive least squares on the three slopes: the prefill speed comes from the backend's own
// counters and clock, no proxy-side guess in it. It pins the prefill speed for a proxy that sees no
// first tokens (a bare lb_policy llm sees only when responses end, and a request's duration is mostly
// decoding: one speed scale fitted to durations took a backend that prefills at 2k tokens/s and decodes
// at 30 ms a step for the 8k-tokens/s prior, and priced its cache misses at a quarter of their cost).
// Without the generated tokens, the time a growing batch added to the steps was taken for prefill (more
// requests running, more arriving to prefill): backends prefilling 20k tokens/s with 30 ms steps and
// 0.25 ms a sequence were fitted at 6k (the matrix's fast-prefill, docs/bench/busy-batch; 8.7k in
// TestServiceModelBusyBatch).
func (m *ServiceModel) ObserveBusy(seconds, uncached, steps, generated float64) {
	if !validWork(seconds, uncached, steps) || !(generated >= 0) || math.IsInf(seconds+uncached+steps+generated, 0) {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	phi := [3]float64{steps, generated / 1000, uncached / 1000}
	pred := m.busy.predict(phi)
	// A stall (a preempted batch, a paused process) must not teach a 10x slowdown.
	y := m.clipStallLocked(seconds, max(pred, 1e-3*priorUnit(m.prior)))
	m.busy.updatePhi(phi, y)
	if generated > 0 {
		m.busyGenN = counted(m.busyGenN)
	}
	if uncached > 0 {
		m.busyN = counted(m.busyN) // an interval without prefill teaches the step time only
	}
}

// ObserveSteps records what the backend did between two consecutive metrics snapshots seconds apart,
// while it was running requests at both: steps engine steps and uncached prompt tokens prefilled. The
// log of that time over what the fixed Prior predicts for the work is kept apart from what the model
// learns otherwise (stepWork), to compare upstreams: what one borrows from the fleet while it has few
// observations of its own is scaled by how much longer than the others' its work took, as far as that
// stands out of the pairs' noise (Fleet.Blend). Borrowed as it was, a backend 3x slower than the others
// was priced as fast as they were until its own responses ended, after all their output (hetero: the two
// slowest first tokens of every run were on it, 14 of 18 sent before its first response ended, cold
// prefills and hits queued behind them predicted at a fifth to a third of their time).
func (m *ServiceModel) ObserveSteps(seconds, uncached, steps float64) {
	if !validWork(seconds, uncached, steps) {
		return
	}
	x := stepWork{seconds: seconds, steps: steps, uncached: uncached}.at(Prior.TokenSeconds, Prior.PrefillSecondsPerToken)
	m.mu.Lock()
	defer m.mu.Unlock()
	w := &m.steps
	keep := 1 - scaleRate
	w.seconds, w.steps, w.uncached = keep*w.seconds+seconds, keep*w.steps+steps, keep*w.uncached+uncached
	w.n = counted(w.n)
	rate := max(1/float64(w.n), scaleRate)
	w.mean += rate * (x - w.mean)
	w.meanSq += rate * (x*x - w.meanSq)
}

// ObserveSpan records what the backend did from one metrics snapshot to the first later one at which an
// engine step had ended, seconds apart, while it was running requests at both: steps engine steps and
// uncached prompt tokens prefilled, counted when their requests were scheduled. It is kept for fitKind,
// which prices each kind of engine in a pool of several. A span runs on through the snapshots that find
// the same step still running (a prompt prefilled whole, without chunked prefill, for longer than a scrape
// interval), so that a step's time stays with the tokens it prefilled: split at every scrape as
// ObserveSteps's pairs are, such a step's tokens fell in a pair without a step (skipped) and its time in
// the next, one step without tokens, and a fit of the bench's mixed-pool agentic priced its small
// engines' prefill at 9x their speed.
func (m *ServiceModel) ObserveSpan(seconds, uncached, steps float64) {
	if !validWork(seconds, uncached, steps) {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.span = m.span.plus(1-scaleRate, spanWork{
		ss: steps * steps, su: steps * uncached, uu: uncached * uncached,
		sy: steps * seconds, uy: uncached * seconds, yy: seconds * seconds,
	})
	m.span.n = counted(m.span.n)
}

// minBusy is how many busy intervals the model needs before it prefers them over the scaled prior for
// the prefill. One: an interval spans at least minBusySteps engine steps, and what one interval says is
// weighed as one of trustedBusy in the upstream's own estimate, the rest pooled over the fleet (Blend).
// With two, a backend whose steps take 30 ms had its first say after about 4 s of busy time: in the
// matrix's shared-prefix runs (7 simulated seconds), backends that prefill 2k tokens/s had one busy
// interval each by the end and were priced at 1.8-4x that speed throughout, their cache misses with
// them. One interval moves the estimate only part of the way (its error is shared with the step
// time, in proportion to each term's part of the interval), so trusting it early is cheap.
const minBusy = 1

// maxScale bounds how far from the prior the speed scale goes, and one observation's pull on it.
const maxScale = 30

// ObserveQueue records the backend's own count of running and waiting requests and its KV-cache usage
// (0-1; 0 when unknown), from its metrics. The slot count is the ceiling the running count is pinned at
// while requests wait: of the scrapes with requests waiting and room in the KV cache, at least
// minAtCeiling at the most it was seen running, and three times as many there as below it. A backend
// limited by something else queues at varying batch sizes: with chunked prefill, requests wait for the
// token budget at any batch size (slow prefill: 4, 5, 13, 17, 22 running with requests waiting, on 64
// slots), and a full KV cache holds as many requests as their lengths allow (a ceiling it caused, two
// 4k-token prompts in an 8k-token cache, is no slot count; the decision counts the cache in tokens, see
// Wait). Running more than the ceiling proves it was no limit: the count starts again.
func (m *ServiceModel) ObserveQueue(running, waiting, kvUsage float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if running > m.ceiling {
		m.ceiling, m.atCeil, m.belowCeil, m.slots = running, 0, 0, 0
	}
	if !SlotBound(running, waiting, kvUsage) {
		return
	}
	if running >= m.ceiling {
		m.atCeil++
	} else {
		m.belowCeil++
	}
	if m.atCeil+m.belowCeil > 64 { // a bounded memory: recent scrapes count as much as old ones
		m.atCeil, m.belowCeil = (m.atCeil+1)/2, m.belowCeil/2
	}
	m.slots = 0
	if m.atCeil >= minAtCeiling && m.atCeil >= 3*m.belowCeil {
		m.slots = m.ceiling
	}
}

// ForgetSlots forgets what the model learned of the backend's slots (its running ceiling and the scrapes
// at it, the requests it ran without queueing), keeping its speed: a backend that restarted may run with
// another max_num_seqs.
func (m *ServiceModel) ForgetSlots() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.forgetSlotsLocked()
}

// forgetSlotsLocked drops what is known of the slot count, learned (from scrapes or first tokens) and
// reported. m.mu must be held.
func (m *ServiceModel) forgetSlotsLocked() {
	m.slots, m.ceiling, m.atCeil, m.belowCeil, m.reported, m.free = 0, 0, 0, 0, 0, 0
}

// ReportSlots records the slot count the backend reports itself (NVIDIA NIM's num_request_max): it is the
// model's Slots from then on, over what the scrapes taught, until ForgetSlots. Not kept in State: the next
// scrape reports it again. A count below one is ignored.
func (m *ServiceModel) ReportSlots(n float64) {
	if !(n >= 1) || math.IsInf(n, 0) {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.reported = n
}

// SlotBound reports whether a backend's own counts, running and waiting requests at KV-cache usage
// kvUsage (0-1; 0 when unknown), show requests waiting for something other than cache space: a slot, or
// with chunked prefill the step's token budget.
func SlotBound(running, waiting, kvUsage float64) bool {
	return waiting >= 1 && running >= 1 && kvUsage < min(kvFull, running/(running+1))
}

// minAtCeiling is how many scrapes must show requests waiting at the running ceiling before it is
// taken for the slot count.
const minAtCeiling = 3

// kvFull is the KV-cache usage from which requests waiting are explained by the cache, not by the slots.
// A batch of a few long requests is limited by the cache well before that: with r running, one more
// of their mean size does not fit once the usage exceeds r/(r+1) (one 30k-token agentic session in a
// 44k-token cache, at 0.7, with the next one waiting: three backends learned 1 slot, and the decision
// sent every new session to the fourth).
const kvFull = 0.9

// Service returns the current estimate.
func (m *ServiceModel) Service() Service {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.serviceLocked()
}

// minFirstTokens is how many observed first tokens the model needs before it prefers them over the
// scaled prior for the prefill.
const minFirstTokens = 8

func (m *ServiceModel) serviceLocked() Service {
	p := m.prior
	scale := math.Exp(m.logScale)
	s := Service{
		Overhead:               p.Overhead * scale,
		PrefillSecondsPerToken: p.PrefillSecondsPerToken * scale,
		TokenSeconds:           p.TokenSeconds * scale,
		Slots:                  m.slots,
		Ceiling:                m.ceiling,
		MeanDuration:           max(m.meanDur, 1e-3),
		Samples:                m.durN + m.ttftN + m.busyN,
		BusyIntervals:          m.busyN,
		FirstTokens:            m.ttftN,
		SkippedFirstTokens:     m.skippedN,
		Free:                   m.free,
		steps:                  m.steps,
		span:                   m.span,
	}
	if m.atCeil >= 2 && m.belowCeil == 0 {
		s.LikelySlots = m.ceiling
	}
	if m.reported > 0 {
		s.Slots, s.LikelySlots = m.reported, 0
	}
	if seq := m.busy.theta[1] / 1000; m.busyGenN >= minBusy && seq > 0 {
		s.SequenceSeconds = min(seq, s.TokenSeconds)
	}
	// Keep estimates within a plausible band: no GPU is 50x faster or slower than the prior.
	if m.ttftN >= minFirstTokens {
		s.Overhead = clamp(m.ttft.theta[0], 0, max(p.Overhead, 1e-3)*maxScale)
		s.PrefillSecondsPerToken = clamp(m.ttft.theta[1]/1000, p.PrefillSecondsPerToken/maxScale, p.PrefillSecondsPerToken*maxScale)
		return s
	}
	s.scaledPrefill = s.PrefillSecondsPerToken
	// A busy fit whose prefill is at or past the band's fast edge (30x the prior's speed) is no
	// estimate, not one at that edge: the step time took more than its share of the intervals and the
	// prefill the rest, down to nothing or below (traced, small-batch multi-turn-think: an upstream's
	// first interval took 0.8 s for what its steps and prefill explain in 0.6, its step time stayed
	// 1.35x too long, and its prefill was negative from its third interval). Clamped, such a fit priced
	// that upstream's prefill at 30x the prior's speed and, pooled (Fleet), the other upstreams' at
	// 2.5-3.5x what their own fits said: in one run that upstream took 128 of 322 requests, its turns
	// predicted at 50-90 simulated ms and answered in 1.1-1.4 s behind 12 in flight while the others
	// held 1-3. It keeps the speed-scaled prior instead, borrows the fleet's ratio, and lends none. A
	// fit past the slow edge still counts, clamped there: it says the backend prefills far slower than
	// expected, the cautious reading (taken for no estimate as well, hetero mixed's p99 went 1.22x over
	// twelve seeds, ten worse; docs/bench/busy-band).
	if v := m.busy.theta[2] / 1000; m.busyN >= minBusy && v > p.PrefillSecondsPerToken/maxScale {
		s.PrefillSecondsPerToken, s.fromBusy = min(v, p.PrefillSecondsPerToken*maxScale), true
	}
	return s
}

// counted returns an observation count one higher, at most maxStateCount: a model that has counted more
// (a billion requests to one upstream, months at 100 a second) would save a state Restore refuses, and
// lose everything it learned at the next restart. Every threshold that reads a count is far below it.
func counted(n int) int { return min(n+1, maxStateCount) }

func clamp(v, lo, hi float64) float64 {
	if math.IsNaN(v) {
		return lo
	}
	return min(max(v, lo), hi)
}

// rls2 is recursive least squares for y = a + b x (or two slopes) with directional forgetting: an
// observation discounts what was learned only in its own direction (the information along phi keeps the
// forgetting factor's share, Kulhavý's rule), not in every direction. With plain forgetting, a steady mix
// of decode steps and prefill in every busy interval, which tells step time from prefill speed only by the
// mix's jitter, discounted what earlier, varied intervals had told apart, and the split then wandered with
// the noise: prefill estimates 6-120x off (often at the clamps) within 1,000 intervals of a ±2-10% mix,
// within 1.15x now (TestServiceModelSteadyMix). A change in what the backend does still shows within a few
// dozen observations along the directions the traffic excites.
type rls2 struct {
	theta [2]float64
	p     [2][2]float64
}

// priorVariance sets how strongly the prior holds: the prior's variance is priorVariance x the squared
// parameter, against observations whose noise is about noiseSeconds for Prior, so a parameter can move
// several times its prior value within a few observations.
const (
	priorVariance = 4
	noiseSeconds  = 0.05
)

// priorNoise is the observations' noise a model starting from prior weighs it against: noiseSeconds for
// Prior, and as many times less as prior's times are shorter (a capacity hint). A noise fixed in seconds
// held a faster prior that many times more firmly, squared: behind the benchmark's simulators, hinted 10x
// faster as their time scale, a prior 100x firmer than a real deployment's kept the first-token fit of
// backends prefilling 4x slower than it 1.6-1.8x faster than a least-squares fit of the same 36-57 first
// tokens (slow-prefill multi-turn-think: 28-31k tokens/s of wall time against 17-18k), and their queues
// were predicted that much shorter (TestServiceModelScaleFree).
func priorNoise(prior Service) float64 { return noiseSeconds * priorUnit(prior) }

// stallSeconds is, for Prior, how far past ten times its prediction an observation is clipped (a stalled
// connection, a paused process): one observation must not teach a 10x slowdown at once.
const stallSeconds = 1

// clipStallLocked returns the observation y, predicted at pred, clipped at ten times pred plus
// stallSeconds in the prior's unit. The caller holds m.mu.
func (m *ServiceModel) clipStallLocked(y, pred float64) float64 {
	return min(y, 10*pred+stallSeconds*priorUnit(m.prior))
}

// priorUnit is how many times longer prior's times are than Prior's: the unit of the seconds a model
// starting from prior reasons in (its noise, its clips). A fixed second clipped nothing of a prior hinted
// 30x faster, where an observation 10x its prediction is a third of a second: behind a stall, the model
// learned a slowdown several times what the same stall taught in Prior's unit (TestServiceModelScaleFree).
func priorUnit(prior Service) float64 { return prior.TTFT(1000) / Prior.TTFT(1000) }

// priorP is the prior variance of a parameter whose prior value is theta, against observations of noise
// seconds.
func priorP(theta, noise float64) float64 {
	return priorVariance * max(theta*theta, 1e-6) / (noise * noise)
}

func newRLS2(a, b, noise float64) rls2 {
	r := rls2{theta: [2]float64{a, b}}
	r.p[0][0] = priorP(a, noise)
	r.p[1][1] = priorP(b, noise)
	return r
}

func (r *rls2) update(x, y float64) { r.updatePhi([2]float64{1, x}, y) }

// updatePhi fits y = theta . phi: the intercept form with phi = (1, x), or two slopes. The information
// matrix gains (1 - (1-forgetting)/r) phi phiT, r = phiT P phi: the observation's own information, less
// the forgetting factor's share of what was known along phi (negative when that was much: P grows along
// phi, and only there). 1 + w r = forgetting + r > 0, so the update is defined for every P.
func (r *rls2) updatePhi(phi [2]float64, y float64) {
	var pphi [2]float64
	for i := range 2 {
		pphi[i] = r.p[i][0]*phi[0] + r.p[i][1]*phi[1]
	}
	rr := phi[0]*pphi[0] + phi[1]*pphi[1]
	w := 1.0 // nothing known along phi: nothing to forget
	if rr > 1e-12 {
		w = 1 - (1-forgetting)/rr
	}
	err := y - (r.theta[0]*phi[0] + r.theta[1]*phi[1])
	for i := range 2 {
		for j := range 2 {
			r.p[i][j] = r.p[i][j] - w*pphi[i]*pphi[j]/(1+w*rr)
		}
	}
	r.p = boundCovariance2(r.p)
	var k [2]float64
	for i := range 2 {
		k[i] = r.p[i][0]*phi[0] + r.p[i][1]*phi[1]
	}
	for i := range 2 {
		r.theta[i] = moveTheta(r.theta[i], k[i]*err)
	}
}

// moveTheta returns a fitted parameter theta moved by step, held within maxTheta, the bound Restore
// checks (so that what a model saves, it restores); a step that is not a number leaves it where it was.
func moveTheta(theta, step float64) float64 {
	if math.IsNaN(step) {
		return theta
	}
	return clamp(theta+step, -maxTheta, maxTheta)
}

// seqShare is the prior's share of a decode step that one more sequence in the batch adds (vLLM's
// decode steps grow about 0.25 ms a sequence on a 30 ms step).
const seqShare = 1.0 / 120

// rls3 is rls2 for three slopes (the busy intervals' step time, time per sequence-step and prefill).
type rls3 struct {
	theta [3]float64
	p     [3][3]float64
}

// newBusyFit is the busy-interval fit of a model starting from prior: its step time, the prior's share of
// it for each sequence, and its prefill, held against prior's noise.
func newBusyFit(prior Service) rls3 {
	return newRLS3([3]float64{prior.TokenSeconds, prior.TokenSeconds * seqShare * 1000, prior.PrefillSecondsPerToken * 1000}, priorNoise(prior))
}

func newRLS3(theta [3]float64, noise float64) rls3 {
	r := rls3{theta: theta}
	for i := range 3 {
		r.p[i][i] = priorP(theta[i], noise)
	}
	return r
}

func (r *rls3) predict(phi [3]float64) float64 {
	return r.theta[0]*phi[0] + r.theta[1]*phi[1] + r.theta[2]*phi[2]
}

// updatePhi fits y = theta . phi as rls2.updatePhi does.
func (r *rls3) updatePhi(phi [3]float64, y float64) {
	var pphi [3]float64
	for i := range 3 {
		pphi[i] = r.p[i][0]*phi[0] + r.p[i][1]*phi[1] + r.p[i][2]*phi[2]
	}
	rr := phi[0]*pphi[0] + phi[1]*pphi[1] + phi[2]*pphi[2]
	w := 1.0
	if rr > 1e-12 {
		w = 1 - (1-forgetting)/rr
	}
	err := y - r.predict(phi)
	for i := range 3 {
		for j := range 3 {
			r.p[i][j] -= w * pphi[i] * pphi[j] / (1 + w*rr)
		}
	}
	r.p = boundCovariance3(r.p)
	for i := range 3 {
		r.theta[i] = moveTheta(r.theta[i], (r.p[i][0]*phi[0]+r.p[i][1]*phi[1]+r.p[i][2]*phi[2])*err)
	}
}

// boundCovariance3 keeps p a bounded covariance matrix as boundCovariance2 does, and positive
// semi-definite: bounding each covariance by its variances does not ensure it for three, so a matrix
// whose Cholesky factorisation fails keeps only its variances.
func boundCovariance3(p [3][3]float64) [3][3]float64 {
	for i := range 3 {
		if math.IsNaN(p[i][i]) {
			p[i][i] = maxCovariance
		}
		p[i][i] = clamp(p[i][i], minVariance, maxCovariance)
	}
	for i := range 3 {
		for j := i + 1; j < 3; j++ {
			c := (p[i][j] + p[j][i]) / 2
			if math.IsNaN(c) {
				c = 0
			}
			lim := math.Sqrt(p[i][i]) * math.Sqrt(p[j][j])
			c = clamp(c, -lim, lim)
			p[i][j], p[j][i] = c, c
		}
	}
	if !positiveDefinite3(p) {
		for i := range 3 {
			for j := range 3 {
				if i != j {
					p[i][j] = 0
				}
			}
		}
	}
	return p
}

// positiveDefinite3 reports whether the symmetric p has a Cholesky factorisation.
func positiveDefinite3(p [3][3]float64) bool {
	var l [3][3]float64
	for i := range 3 {
		for j := 0; j <= i; j++ {
			sum := p[i][j]
			for k := range j {
				sum -= l[i][k] * l[j][k]
			}
			if i == j {
				if !(sum > 0) {
					return false
				}
				l[i][i] = math.Sqrt(sum)
			} else {
				l[i][j] = sum / l[j][j]
			}
		}
	}
	return true
}

// maxCovariance bounds the estimator's variances (it winds up to it in a direction the data do not
// excite); minVariance keeps one from reaching 0, where it would stay.
const (
	maxCovariance = 1e6
	minVariance   = 1e-12
)

// boundCovariance2 keeps p a bounded covariance matrix: variances in [minVariance, maxCovariance], and
// one covariance, the mean of the two off-diagonal entries, within what the variances allow
// (|p01| <= sqrt(p00) sqrt(p11)). Clamping each entry alone could leave the matrix indefinite (a
// variance cut to the bound and the covariance not: the estimator winds up so when one x is fed over
// and over), and an indefinite P turns a variance negative within a few updates: FuzzRestore found a
// restored asymmetric one that did. A variance is kept above minVariance, since one at 0 never grows
// again, and one that is not a number is reset to the bound (nothing is known), a covariance to 0.
func boundCovariance2(p [2][2]float64) [2][2]float64 {
	for i := range 2 {
		if math.IsNaN(p[i][i]) {
			p[i][i] = maxCovariance
		}
		p[i][i] = clamp(p[i][i], minVariance, maxCovariance)
	}
	c := (p[0][1] + p[1][0]) / 2
	if math.IsNaN(c) {
		c = 0
	}
	lim := math.Sqrt(p[0][0]) * math.Sqrt(p[1][1])
	c = clamp(c, -lim, lim)
	p[0][1], p[1][0] = c, c
	return p
}

// Fleet pools what several upstreams' models have learned, so that an upstream the proxy has barely
// measured borrows the others' estimate instead of the fixed prior: otherwise the first upstream to be
// measured looks faster (or slower) than all the unmeasured ones, which then get no traffic (or all of
// it) until they are measured too. The zero value is empty and ready to use.
type Fleet struct {
	pool // every upstream's
	// kinds pools the same per kind of engine: the upstreams of one KV cache geometry (Geometry), the
	// first maxKinds geometries met; nKinds is how many. An upstream borrows from its own kind where the
	// pool holds more than one (Blend).
	kinds  [maxKinds]kindPool
	nKinds int
	// steps holds the work between scrapes (Service.steps) of the upstreams with minStepPairs pairs or
	// more, with their samples (the first len of them: a pool's upstreams), nSteps how many; stepT and
	// stepP price it, stepRef is their mean and stepTau2 the variance of their true differences (see
	// stepFactor), once stepReady.
	steps [16]struct {
		work    stepWork
		samples int
	}
	nSteps                          int
	stepReady                       bool
	stepT, stepP, stepRef, stepTau2 float64
}

// pool is what a set of upstreams' models have learned, as Fleet.Blend borrows it.
type pool struct {
	weight                                 float64
	overhead, prefill, token, meanDuration float64
	// ratioWeight and logRatio pool the busy intervals' prefill over the speed-scaled prior (busyRatio),
	// weighted by busy intervals, as a geometric mean.
	ratioWeight, logRatio float64
	// slots is the largest slot count any upstream has shown (0: none has).
	slots float64
}

// kindPool is the pool of the upstreams of one geometry.
type kindPool struct {
	geometry float64
	pool
}

// maxKinds is how many kinds of engine a Fleet tells apart; the upstreams of any further geometry
// borrow from the whole pool and are not aligned.
const maxKinds = 16

// add counts s into p, weighted by its samples.
func (p *pool) add(s Service) {
	p.slots = max(p.slots, s.Slots)
	if r := s.busyRatio(); r > 0 {
		w := float64(min(s.BusyIntervals, trustedBusy))
		p.ratioWeight += w
		p.logRatio += w * math.Log(r)
	}
	w := float64(min(s.Samples, trustedSamples))
	if w == 0 {
		return
	}
	p.weight += w
	p.overhead += w * s.Overhead
	p.prefill += w * s.PrefillSecondsPerToken
	p.token += w * s.TokenSeconds
	p.meanDuration += w * s.MeanDuration
}

// kind returns the pool of geometry's upstreams, where the fleet holds more than one kind; nil otherwise,
// for an unknown geometry (0) and for one past maxKinds.
func (f *Fleet) kind(geometry float64) *pool {
	if i := f.findKind(geometry); i >= 0 && f.nKinds >= 2 {
		return &f.kinds[i].pool
	}
	return nil
}

// Kinds is how many kinds of engine (KV cache geometries, Geometry) the upstreams added are, of those
// whose geometry is known; at most maxKinds.
func (f *Fleet) Kinds() int { return f.nKinds }

// findKind returns the index in f.kinds of geometry's kind; -1 when there is none.
func (f *Fleet) findKind(geometry float64) int {
	if geometry > 0 {
		for i := range f.kinds[:f.nKinds] {
			if sameGeometry(f.kinds[i].geometry, geometry) {
				return i
			}
		}
	}
	return -1
}

// minStepPairs is how many scrape pairs an upstream's work needs to be compared: its noise is measured
// from their spread.
const minStepPairs = 3

// stepFactor is how many times the fleet's times s's own work between scrapes says its times are: the
// log of that work's time priced at the fleet's split between step time and prefill (the prior's while
// no upstream has measured itself), against the fleet's mean, shrunk toward none by how much of it the
// pairs' noise explains (empirical Bayes: the upstreams' true differences have the variance their logs
// spread by beyond their standard errors, and each is weighed against its own error). On alike backends
// the logs spread no more than their noise and nothing is scaled: the pairs of one slow-prefill backend
// vary 1.5-1.9x with the prompts each happened to prefill, and four alike ones looked up to 1.5x apart;
// in hetero the slow backend stands 2.7x apart with errors of 2-3%.
func (f *Fleet) stepFactor(s Service) float64 {
	if s.steps.n < minStepPairs {
		return 1
	}
	if !f.stepReady {
		f.stepReady = true
		f.stepT, f.stepP = Prior.TokenSeconds, Prior.PrefillSecondsPerToken
		if f.weight > 0 {
			f.stepT, f.stepP = f.token/f.weight, f.prefill/f.weight
		}
		k, sum, sumSq, se2 := 0.0, 0.0, 0.0, 0.0
		refW, ref := 0.0, 0.0
		for _, e := range f.steps[:f.nSteps] {
			x := e.work.at(f.stepT, f.stepP)
			k, sum, sumSq, se2 = k+1, sum+x, sumSq+x*x, se2+e.work.se2()
			w := float64(min(e.samples, trustedSamples)) // as the borrowed estimate weighs them
			refW, ref = refW+w, ref+w*x
		}
		if k >= 2 {
			mean := sum / k
			f.stepTau2 = max((sumSq-k*mean*mean)/(k-1)-se2/k, 0)
			f.stepRef = mean
			if refW > 0 {
				f.stepRef = ref / refW
			}
		}
	}
	if !(f.stepTau2 > 0) {
		return 1
	}
	own, se2 := s.steps.at(f.stepT, f.stepP), s.steps.se2()
	return math.Exp((own - f.stepRef) * f.stepTau2 / (f.stepTau2 + se2))
}

// trustedBusy is how many busy intervals make an upstream's own prefill speed fully trusted over the
// fleet's. One interval's estimate is noisy (counters move when steps end): on four identical backends,
// a few intervals each put their prefill speeds 1.5-3x apart, and the one that looked fastest drew the
// long prompts (mixed workload: 1.5x its share, TTFT p99 1.5x least_conn's).
const trustedBusy = 16

// trustedSamples is how many observations make an upstream's own estimate fully trusted.
const trustedSamples = 16

// Add counts s, an upstream of the given KV cache geometry (Geometry; 0: unknown), into the fleet's
// estimate and its kind's, weighted by its samples.
func (f *Fleet) Add(s Service, geometry float64) {
	if s.steps.n >= minStepPairs && f.nSteps < len(f.steps) {
		f.steps[f.nSteps].work, f.steps[f.nSteps].samples = s.steps, s.Samples
		f.nSteps++
		f.stepReady = false
	}
	f.pool.add(s)
	i := f.findKind(geometry)
	if i < 0 && geometry > 0 && f.nKinds < maxKinds {
		i, f.nKinds = f.nKinds, f.nKinds+1
		f.kinds[i] = kindPool{geometry: geometry}
	}
	if i >= 0 {
		f.kinds[i].add(s)
	}
}

// Align prices alike backends alike. The prefill speeds, decode step times and overheads of the
// candidates whose work between scrapes has been measured (steps: at least minStepPairs scrape pairs
// with requests running) become their geometric means over those candidates, each scaled by how much
// slower than the fleet that candidate's work ran, as far as that stands out of the pairs' noise
// (stepFactor, normalised over them): the estimators of each upstream (its durations' scale, its busy
// intervals, its first tokens) set the fleet's level, and the one measure whose noise is estimated sets
// the differences between upstreams. Each estimator alone is noisy: four identical backends each
// learned from 3-6 busy intervals had prefill speeds 1.3-2.3 us a token apart (their true speed 1.9),
// and while none had one, the durations' scales put them 10-25% apart; every new agent session then went
// to whichever looked fastest, the first sessions of a run piled onto one upstream while others idled,
// and their histories evicted each other there (fast-prefill agentic: llm's p99 1.2-1.4x least_conn's on
// one seed in six, docs/bench/align). A backend that is slower stands out of the noise within a few
// scrapes (hetero's 3x slower one: 2.7x with errors of 2-3%) and stays that much slower.
//
// Alike means the same KV cache geometry (blocks x block size, in the backend's own tokens, as scraped;
// within geometryTolerance): the same hardware and engine settings, which may still differ in speed (a
// GPU that is slower in everything, which the one factor carries). Backends of another geometry are
// another kind of engine, whose prefill and decode may differ in opposite directions, which one factor
// cannot carry: in a pool of small engines (max_num_seqs 16, no chunked prefill, 3.3k prefill tokens/s,
// 18 ms decode steps) and large ones (256, chunked, 8k tokens/s, 30 ms), aligned together, the small
// ones' faster steps priced their prefill faster than the large ones' (the bench's mixed-pool, beyond
// the matrix: own estimates 23-39k against 69-110k tokens/s, priced 45-58k against 34-44k;
// multi-turn-think p99 1.6x header's). Each kind is aligned within itself: the kinds the fleet holds
// (Add), which Blend borrows by too. Where the fleet holds several kinds, a kind's prefill is what its
// own spans between scrapes say (fitKind), where they tell it from the step time: both kinds start at
// the prior's, and their busy intervals come once or twice per upstream in a short run (mixed-pool: the
// small engines priced at 2.4x their prefill speed; with the fit TTFT p99 0.77x over twelve seeds,
// docs/bench/kind-fit).
//
// Candidates without that measure (not scraped yet, metrics off, a backend without vLLM's counters), with
// no fresh cache geometry, of a geometry the fleet holds no kind for, or alone of their kind keep their
// own estimates: nothing else compares them
// beyond their noise, and without it a backend measured 3x slower by its responses would be priced like
// the others. Each candidate's MeanDuration (what its requests hold a slot for, set by their output
// lengths as much as by its speed) is its own.
func (f *Fleet) Align(cands []Candidate) {
	var buf [16]float64
	var kbuf [16]int
	// factors is each candidate's stepFactor, 0 where it is not aligned or is aligned already; kinds its
	// kind's index in f.kinds (findKind).
	factors, kinds := buf[:0], kbuf[:0]
	if len(cands) > len(buf) {
		factors, kinds = make([]float64, 0, len(cands)), make([]int, 0, len(cands))
	}
	for i := range cands {
		k, factor := f.findKind(Geometry(&cands[i])), 0.0
		if k >= 0 && alignable(&cands[i]) {
			factor = f.stepFactor(cands[i].Service)
		}
		factors, kinds = append(factors, factor), append(kinds, k)
	}
	for i := range cands {
		if factors[i] == 0 {
			continue
		}
		kind := func(j int) bool { return factors[j] != 0 && kinds[j] == kinds[i] } // i's kind, not aligned yet
		var prefill, token, overhead, rel, n float64
		for j := i; j < len(cands); j++ {
			if !kind(j) {
				continue
			}
			s := &cands[j].Service
			prefill += math.Log(s.PrefillSecondsPerToken)
			token += math.Log(s.TokenSeconds)
			overhead += math.Log(max(s.Overhead, minOverhead))
			rel += math.Log(factors[j])
			n++
		}
		if n < 2 {
			continue // alone of its kind
		}
		prefill, token, overhead, rel = math.Exp(prefill/n), math.Exp(token/n), math.Exp(overhead/n), math.Exp(rel/n)
		if f.nKinds >= 2 {
			// Several kinds of engine: each kind's prefill is what its own work between scrapes says,
			// where that tells it from the step time (fitKind).
			var wbuf [16]spanWork
			works := wbuf[:0]
			for j := i; j < len(cands); j++ {
				if kind(j) {
					works = append(works, cands[j].Service.span)
				}
			}
			if p, ok := fitKind(works); ok {
				prefill = p
			}
		}
		for j := i; j < len(cands); j++ {
			if !kind(j) {
				continue
			}
			s := &cands[j].Service
			r := factors[j] / rel
			s.PrefillSecondsPerToken, s.TokenSeconds, s.Overhead = prefill*r, token*r, overhead*r
			if s.SequenceSeconds > 0 {
				s.SequenceSeconds = min(s.SequenceSeconds, s.TokenSeconds)
			}
			factors[j] = 0
		}
	}
}

// fitKind fits the spans between scrapes of one kind's upstreams (ObserveSpan), pooled, by least squares:
// seconds = steps x step time + uncached x prefill seconds per token. It returns the prefill's, and ok
// when the spans tell it from the step time: at least two spans more than the fit's two slopes, both
// slopes positive, and the prefill's standard error under half of it. Unlike engines differ in prefill
// and step time in opposite directions (16 slots without chunked prefill prefill 2.4x slower and step
// 0.6x the time of 256 chunked ones), which one factor cannot carry, and their own estimators learn the
// prefill late: a short run ends with one busy interval per upstream, where the spans number 4-8.
func fitKind(works []spanWork) (prefill float64, ok bool) {
	var w spanWork
	n := 0.0
	for _, x := range works {
		w = w.plus(1, x)
		n += min(float64(x.n), 1/scaleRate) // the sums' memory
	}
	det := w.ss*w.uu - w.su*w.su
	if n < 4 || !(det > 0) {
		return 0, false
	}
	t := (w.uu*w.sy - w.su*w.uy) / det
	p := (w.ss*w.uy - w.su*w.sy) / det
	if !(t > 0) || !(p > 0) {
		return 0, false
	}
	rss := max(w.yy-2*(t*w.sy+p*w.uy)+t*t*w.ss+2*t*p*w.su+p*p*w.uu, 0)
	se := math.Sqrt(rss / (n - 2) * w.ss / det)
	return p, se < p/2
}

// alignable reports whether Align compares c with the others: its work between scrapes is measured, it
// has estimates to align and a fresh scrape tells its cache geometry.
func alignable(c *Candidate) bool {
	s := &c.Service
	return s.steps.n >= minStepPairs && s.PrefillSecondsPerToken > 0 && s.TokenSeconds > 0 && c.KVCapacity > 0
}

// Geometry is c's KV cache in the backend's own tokens (blocks x block size, as scraped; 0: unknown):
// KVCapacity is in the prompt counts' tokens, divided by the token scale each upstream learns with its
// own noise. Upstreams of one geometry are one kind of engine (Fleet.Align, Fleet.Blend).
func Geometry(c *Candidate) float64 {
	if c.TokenScale > 0 {
		return c.KVCapacity * c.TokenScale
	}
	return c.KVCapacity
}

// sameGeometry reports whether two geometries are one kind of engine's: within geometryTolerance of each
// other.
func sameGeometry(a, b float64) bool {
	return math.Abs(a-b) <= geometryTolerance*max(a, b)
}

// geometryTolerance is how far apart two KV caches may be and still be one kind of engine. Alike GPUs
// with alike settings report the same block count, or nearly: vLLM sizes the cache from the memory free
// when it profiles, and gpu_memory_utilization 0.90 against 0.92 moves it a few percent. Told apart
// exactly, four such backends with four block counts were four kinds, each alone of its kind, aligned
// with none and borrowing from none. Another kind of engine differs by far more (mixed-pool: 8x).
const geometryTolerance = 0.1

// minOverhead stands for an overhead of nothing in Align's geometric mean.
const minOverhead = 1e-6

// Blend returns s, with as much of the fleet's estimate mixed in as s lacks samples. Its prefill speed,
// unless first tokens pinned it, also takes as much of the fleet's busy-interval ratio (applied to s's own
// speed-scaled prior, so a backend 3x slower than the others stays 3x slower) as s lacks busy intervals,
// all of it while its own fit sets no speed (past the band's fast edge, serviceLocked).
//
// An upstream never measured borrows only what is faster than its own estimate: learned from durations,
// the fleet's slowness may be congestion (waits for slots or cache the model did not see), which a
// backend that has had none of the requests does not have. Borrowed, it kept the one upstream that had
// cached a hot prefix first looking no busier than the idle ones, which took its congested estimate:
// without metrics, one upstream took 476 of 476 multi-turn requests (TTFT p50 3.2 s against least_conn's
// 0.1 s). A backend that really is slower shows it in its first requests. Once measured at all, an
// upstream blends both ways: kept optimistic until 16 samples, a barely measured one drew conversations
// off their homes (TestRoutesSurviveReload, 1 run in 16).
//
// What an upstream borrows is scaled by how much slower than the fleet's its work between scrapes ran,
// as far as that stands out of their noise (stepFactor), an own measure with no congestion in it: a
// backend 3x slower than the others, none of whose responses has ended, is priced about that much slower
// within a few scrapes instead of at their speed.
//
// An upstream whose slot count is not known yet takes the largest one another upstream has shown, unless
// it has been seen running more requests than that: a backend learns its own only after several scrapes
// with requests waiting at the same batch size, and until then its slots were taken as unlimited. A burst
// on the upstream holding a hot prefix was then predicted to wait nothing behind a full batch (small
// batch regime, 8 slots: 20 requests in flight, first tokens predicted in 0.1 s, answered in 1.5-4 s),
// while another upstream had already learned that these backends run 8 at once. Backends of one kind
// may still run different slot counts, and one may borrow a count too small for it; the first scrape
// showing it running more than that disproves it there.
//
// In a pool of more than one kind of engine (KV cache geometries, Geometry; 0: unknown, which borrows
// from all), an upstream borrows from its own kind only, nothing where its kind has nothing to lend,
// and unscaled: the fleet's steps compare unlike engines, whose prefill and decode may differ in opposite
// directions. Pooled over both kinds, the busy intervals' ratio of the large engines (8k prefill tokens/s
// against 30 ms steps) priced the small ones' prefill (3.3k against 18 ms) at 1.7-1.8x its speed (the
// bench's mixed-pool, multi-turn-think: 41-44k tokens/s of wall time against 25k, their own fits 29-35k
// from 8 intervals each); by their kind alone, 26k.
func (f *Fleet) Blend(s Service, geometry float64) Service {
	p, rel := &f.pool, 0.0 // rel 0: stepFactor's, once needed
	if k := f.kind(geometry); k != nil {
		p, rel = k, 1 // its kind's, as they are: the fleet's steps compare unlike engines
	}
	if s.Slots == 0 && p.slots > 0 && s.Ceiling <= p.slots {
		s.Slots = p.slots
	}
	if p.ratioWeight > 0 && s.scaledPrefill > 0 && (s.BusyIntervals < trustedBusy || !s.fromBusy) {
		own := 0.0
		if s.fromBusy {
			own = float64(s.BusyIntervals) / trustedBusy
		}
		pooled := s.scaledPrefill * math.Exp(p.logRatio/p.ratioWeight)
		s.PrefillSecondsPerToken = own*s.PrefillSecondsPerToken + (1-own)*pooled
	}
	if s.Samples >= trustedSamples {
		return s
	}
	if rel == 0 {
		rel = f.stepFactor(s) // how much slower than the fleet its steps ran, as far as that stands out
	}
	if p.weight == 0 {
		if s.Samples == 0 { // the prior, or what is pooled of busy intervals: nobody has measured more
			s = s.Slower(rel)
			s.MeanDuration *= rel
		}
		return s
	}
	own := float64(s.Samples) / trustedSamples
	fleet := 1 - own
	fo, fp, ft, fm := p.overhead/p.weight, p.prefill/p.weight, p.token/p.weight, p.meanDuration/p.weight
	if s.Samples == 0 {
		fo, fp, ft, fm = min(fo, s.Overhead), min(fp, s.PrefillSecondsPerToken), min(ft, s.TokenSeconds), min(fm, s.MeanDuration)
	}
	fo, fp, ft, fm = fo*rel, fp*rel, ft*rel, fm*rel // its own measure, no congestion borrowed
	s.Overhead = own*s.Overhead + fleet*fo
	s.PrefillSecondsPerToken = own*s.PrefillSecondsPerToken + fleet*fp
	s.TokenSeconds = own*s.TokenSeconds + fleet*ft
	s.MeanDuration = own*s.MeanDuration + fleet*fm
	return s
}

// FitSpans is fitKind over one upstream's spans (ObserveSpan): its prefill seconds per token, and whether
// the spans tell it from the step time. For tests.
func FitSpans(s Service) (prefill float64, ok bool) { return fitKind([]spanWork{s.span}) }

// minKindSpans is how many spans an upstream in a pool of several kinds is scraped for sooner than the
// interval: about the spans' memory (1/scaleRate).
const minKindSpans = 10

// FewSpans reports whether s has fewer than minKindSpans spans (ObserveSpan) for its kind's fit.
func FewSpans(s Service) bool { return s.span.n < minKindSpans }
