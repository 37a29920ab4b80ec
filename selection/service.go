package selection

import (
	"math"
	"sync"
	"time"
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
	// Slots is the number of sequences the backend runs at once before new requests queue (vLLM's
	// max_num_seqs, or fewer when its KV cache is the limit); 0 when not known.
	Slots float64
	// MeanDuration is the mean time a request spends on the upstream, admission to last byte.
	MeanDuration float64
	// Samples is how many observations the estimate rests on (0: it is the prior).
	Samples int
}

// TTFT is the time from the start of its prefill to the first token of a request with uncached
// prompt tokens, on an idle upstream.
func (s Service) TTFT(uncached int) float64 {
	return s.Overhead + float64(max(uncached, 0))*s.PrefillSecondsPerToken
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
//   - every finished request's duration against its uncached prompt and output tokens (always),
//   - every first token's delay against the prefill queued ahead of it (when the response is observed),
//   - the backend's running and waiting counts (when its metrics are scraped): the concurrency at which
//     it queues.
//
// Durations and first-token delays are fitted by recursive least squares with exponential forgetting,
// starting from the prior (scaled by a capacity hint), so estimates converge within a few dozen
// requests and follow a backend that slows down or speeds up. Observations are clipped, so one outlier
// (a stalled connection) cannot move an estimate far.
//
// A ServiceModel is safe for concurrent use; every method is O(1) and takes one short lock.
type ServiceModel struct {
	mu       sync.Mutex
	prior    Service
	ttft     rls2 // first-token delay = overhead + prefill seconds per token x uncached
	duration rls3 // duration = overhead + prefill x uncached + token seconds x output
	ttftN    int  // first tokens observed (weighted by forgetting)
	durN     int
	meanDur  float64
	slots    float64
	slotsAt  time.Time
}

// forgetting is the weight each older observation keeps when a new one arrives: about 20 requests of
// memory, so a slowdown shows within a few dozen requests.
const forgetting = 0.95

// NewServiceModel returns a model that starts from prior.
func NewServiceModel(prior Service) *ServiceModel {
	m := &ServiceModel{prior: prior, meanDur: prior.MeanDuration}
	m.reset()
	return m
}

func (m *ServiceModel) reset() {
	p := m.prior
	m.ttft = newRLS2(p.Overhead, p.PrefillSecondsPerToken*1000)
	m.duration = newRLS3(p.Overhead, p.PrefillSecondsPerToken*1000, p.TokenSeconds*100)
}

// SetPrior replaces the prior (a capacity hint changed) and forgets what was learned.
func (m *ServiceModel) SetPrior(prior Service) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.prior == prior {
		return
	}
	m.prior = prior
	m.meanDur = prior.MeanDuration
	m.ttftN, m.durN = 0, 0
	m.reset()
}

// ObserveFirstToken records a first token that came ttft seconds after the request was sent, where
// the upstream had queued seconds of prefill ahead of it (as predicted when it was sent) and the request
// had uncached prompt tokens to prefill.
func (m *ServiceModel) ObserveFirstToken(uncached int, queued, ttft float64) {
	y := ttft - queued
	if !(y > 0) || math.IsInf(y, 0) {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	pred := m.serviceLocked().TTFT(uncached)
	y = min(y, 10*pred+1) // clip outliers: a stalled connection must not teach a 10x slowdown at once
	m.ttft.update(float64(uncached)/1000, y)
	m.ttftN++
}

// ObserveEnd records a request that finished duration seconds after it was sent, having waited about
// waited seconds (as predicted) before its prefill could start.
func (m *ServiceModel) ObserveEnd(uncached, output int, waited, duration float64) {
	if !(duration > 0) || math.IsInf(duration, 0) {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.meanDur += (1 - forgetting) * 2 * (duration - m.meanDur)
	y := duration - waited
	if !(y > 0) {
		return
	}
	s := m.serviceLocked()
	pred := s.TTFT(uncached) + float64(output)*s.TokenSeconds
	y = min(y, 10*pred+1)
	m.duration.update(float64(uncached)/1000, float64(output)/100, y)
	m.durN++
}

// ObserveQueue records the backend's own count of running and waiting requests (from its metrics): a
// backend with requests waiting runs as many as it can, so its running count is its slot count then.
func (m *ServiceModel) ObserveQueue(running, waiting float64, at time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case waiting >= 1 && running >= 1:
		if m.slots == 0 {
			m.slots = running
		} else {
			m.slots += 0.3 * (running - m.slots)
		}
		m.slotsAt = at
	case running > m.slots && m.slots > 0:
		// It runs more than we thought it could: the limit we saw was a transient one (KV cache).
		m.slots = running
	}
}

// Service returns the current estimate.
func (m *ServiceModel) Service() Service {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.serviceLocked()
}

// minFirstTokens is how many observed first tokens the model needs before it prefers them over what
// durations say about prefill.
const minFirstTokens = 8

func (m *ServiceModel) serviceLocked() Service {
	p := m.prior
	s := Service{Slots: m.slots, MeanDuration: max(m.meanDur, 1e-3), Samples: m.durN + m.ttftN}
	o, per1k, per100 := m.duration.theta[0], m.duration.theta[1], m.duration.theta[2]
	if m.ttftN >= minFirstTokens {
		o, per1k = m.ttft.theta[0], m.ttft.theta[1]
	}
	// Keep estimates within a plausible band around the prior: least squares on collinear features
	// (all requests of one length, say) can wander, and no GPU is 100x faster than another.
	s.Overhead = clamp(o, 0, max(p.Overhead, 1e-3)*50)
	s.PrefillSecondsPerToken = clamp(per1k/1000, p.PrefillSecondsPerToken/20, p.PrefillSecondsPerToken*50)
	s.TokenSeconds = clamp(per100/100, p.TokenSeconds/20, p.TokenSeconds*50)
	return s
}

func clamp(v, lo, hi float64) float64 {
	if math.IsNaN(v) {
		return lo
	}
	return min(max(v, lo), hi)
}

// rls2 is recursive least squares for y = a + b x with forgetting.
type rls2 struct {
	theta [2]float64
	p     [2][2]float64
}

// priorVariance sets how strongly the prior holds: the prior's variance is priorVariance x the squared
// parameter, against observations whose noise is about noiseSeconds, so a parameter can move several
// times its prior value within a few observations.
const (
	priorVariance = 4
	noiseSeconds  = 0.05
)

func priorP(theta float64) float64 {
	return priorVariance * max(theta*theta, 1e-6) / (noiseSeconds * noiseSeconds)
}

func newRLS2(a, b float64) rls2 {
	r := rls2{theta: [2]float64{a, b}}
	r.p[0][0] = priorP(a)
	r.p[1][1] = priorP(b)
	return r
}

func (r *rls2) update(x, y float64) {
	phi := [2]float64{1, x}
	var pphi [2]float64
	for i := range 2 {
		pphi[i] = r.p[i][0]*phi[0] + r.p[i][1]*phi[1]
	}
	denom := forgetting + phi[0]*pphi[0] + phi[1]*pphi[1]
	err := y - (r.theta[0]*phi[0] + r.theta[1]*phi[1])
	for i := range 2 {
		r.theta[i] += pphi[i] / denom * err
	}
	for i := range 2 {
		for j := range 2 {
			r.p[i][j] = (r.p[i][j] - pphi[i]*pphi[j]/denom) / forgetting
		}
	}
	r.p = boundCovariance2(r.p)
}

// rls3 is recursive least squares for y = a + b x1 + c x2 with forgetting.
type rls3 struct {
	theta [3]float64
	p     [3][3]float64
}

func newRLS3(a, b, c float64) rls3 {
	r := rls3{theta: [3]float64{a, b, c}}
	r.p[0][0] = priorP(a)
	r.p[1][1] = priorP(b)
	r.p[2][2] = priorP(c)
	return r
}

func (r *rls3) update(x1, x2, y float64) {
	phi := [3]float64{1, x1, x2}
	var pphi [3]float64
	for i := range 3 {
		for j := range 3 {
			pphi[i] += r.p[i][j] * phi[j]
		}
	}
	denom := forgetting
	pred := 0.0
	for i := range 3 {
		denom += phi[i] * pphi[i]
		pred += r.theta[i] * phi[i]
	}
	err := y - pred
	for i := range 3 {
		r.theta[i] += pphi[i] / denom * err
	}
	for i := range 3 {
		for j := range 3 {
			r.p[i][j] = (r.p[i][j] - pphi[i]*pphi[j]/denom) / forgetting
		}
	}
	// Forgetting inflates the covariance of directions no observation excites (an output length that
	// never varies): bound it so that one unusual request cannot swing the estimate.
	for i := range 3 {
		for j := range 3 {
			r.p[i][j] = clamp(r.p[i][j], -maxCovariance, maxCovariance)
		}
	}
}

const maxCovariance = 1e6

func boundCovariance2(p [2][2]float64) [2][2]float64 {
	for i := range 2 {
		for j := range 2 {
			p[i][j] = clamp(p[i][j], -maxCovariance, maxCovariance)
		}
	}
	return p
}

// Fleet pools what several upstreams' models have learned, so that an upstream the proxy has barely
// measured borrows the others' estimate instead of the fixed prior: otherwise the first upstream to be
// measured looks faster (or slower) than all the unmeasured ones, which then get no traffic (or all of
// it) until they are measured too. The zero value is empty and ready to use.
type Fleet struct {
	weight                                 float64
	overhead, prefill, token, meanDuration float64
}

// trustedSamples is how many observations make an upstream's own estimate fully trusted.
const trustedSamples = 16

// Add counts s into the fleet's estimate, weighted by its samples.
func (f *Fleet) Add(s Service) {
	w := float64(min(s.Samples, trustedSamples))
	if w == 0 {
		return
	}
	f.weight += w
	f.overhead += w * s.Overhead
	f.prefill += w * s.PrefillSecondsPerToken
	f.token += w * s.TokenSeconds
	f.meanDuration += w * s.MeanDuration
}

// Blend returns s, with as much of the fleet's estimate mixed in as s lacks samples.
func (f *Fleet) Blend(s Service) Service {
	if f.weight == 0 || s.Samples >= trustedSamples {
		return s
	}
	own := float64(s.Samples) / trustedSamples
	fleet := 1 - own
	s.Overhead = own*s.Overhead + fleet*f.overhead/f.weight
	s.PrefillSecondsPerToken = own*s.PrefillSecondsPerToken + fleet*f.prefill/f.weight
	s.TokenSeconds = own*s.TokenSeconds + fleet*f.token/f.weight
	s.MeanDuration = own*s.MeanDuration + fleet*f.meanDuration/f.weight
	return s
}
