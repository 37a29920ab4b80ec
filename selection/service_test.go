package selection

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// backend is a synthetic upstream: first token after overhead + uncached/rate, then output tokens at
// tokenSeconds each, with 5% noise.
type backend struct {
	overhead, perToken, tokenSeconds float64
}

func (b backend) ttft(uncached int, rng *rand.Rand) float64 {
	return (b.overhead + float64(uncached)*b.perToken) * (0.95 + 0.1*rng.Float64())
}

func (b backend) duration(uncached, output int, rng *rand.Rand) float64 {
	return b.ttft(uncached, rng) + float64(output)*b.tokenSeconds*(0.95+0.1*rng.Float64())
}

// firstToken observes a first token on m while none of the proxy's requests ended (sinceEnd = ttft).
func firstToken(m *ServiceModel, uncached, ahead int, queued, ttft float64) bool {
	return m.ObserveFirstToken(uncached, ahead, queued, ttft, ttft)
}

func within(got, want, frac float64) bool { return math.Abs(got-want) <= frac*want }

// TestServiceModelConvergesFromDurations: with only request durations (no observed first tokens), a
// backend 3x slower than the prior is learned within a few dozen requests, well enough to predict a
// request's duration and its prefill within 15%. (Durations give the speed, not the split between
// prefill and decode: first tokens do that, see the next test.)
func TestServiceModelConvergesFromDurations(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	b := backend{overhead: 3 * Prior.Overhead, perToken: 3 * Prior.PrefillSecondsPerToken, tokenSeconds: 3 * Prior.TokenSeconds}
	m := NewServiceModel(Prior)
	for range 40 {
		uncached, output := 100+rng.IntN(4000), 32+rng.IntN(200)
		m.ObserveEnd(uncached, output, 0, b.duration(uncached, output, rng))
	}
	s := m.Service()
	for _, c := range []struct{ uncached, output int }{{3000, 64}, {200, 200}, {1500, 128}} {
		want := b.duration(c.uncached, c.output, rand.New(rand.NewPCG(0, 0)))
		got := s.TTFT(c.uncached) + float64(c.output)*s.TokenSeconds
		if !within(got, want, 0.15) {
			t.Errorf("predicted duration of %d uncached + %d output = %.3fs, want %.3fs (service %+v)", c.uncached, c.output, got, want, s)
		}
	}
	if !within(s.PrefillSecondsPerToken, b.perToken, 0.15) {
		t.Errorf("prefill rate %.0f tokens/s, want about %.0f", 1/s.PrefillSecondsPerToken, 1/b.perToken)
	}
}

// TestServiceModelConvergesFromFirstTokens: observed first tokens pin the prefill rate and overhead,
// the queue ahead of each request taken out.
func TestServiceModelConvergesFromFirstTokens(t *testing.T) {
	rng := rand.New(rand.NewPCG(2, 2))
	b := backend{overhead: 0.05, perToken: 1 / 20000.0, tokenSeconds: 0.03}
	m := NewServiceModel(Prior)
	for range 40 {
		uncached := 50 + rng.IntN(6000)
		queued := rng.Float64() * 0.5
		firstToken(m, uncached, 0, queued, queued+b.ttft(uncached, rng))
	}
	s := m.Service()
	if !within(1/s.PrefillSecondsPerToken, 20000, 0.15) || !within(s.Overhead, 0.05, 0.3) {
		t.Errorf("learned %.0f tokens/s and %.0f ms overhead, want 20000 and 50", 1/s.PrefillSecondsPerToken, 1000*s.Overhead)
	}
}

// TestServiceModelScaleFree: the same backend, timed in another unit (10x faster, with a prior hinted 10x
// faster: the benchmark's time scale, a capacity hint), is learned the same, in that unit. Observations'
// noise was fixed at 50 ms, which held a 10x faster prior 100x more firmly: from these 50 first tokens
// (300-800 uncached tokens each, a conversation's next turn, on a backend prefilling 4x slower than the
// prior, behind up to six steps of others' work) the overhead came out 42% short and the prefill 12% slow
// in the faster unit, against 1983 tokens/s (for 2000) in the prior's. Outliers were clipped at a fixed
// second past ten times their prediction, which clipped nothing in the faster unit: one stalled first
// token left the prefill 8x faster than in the prior's unit, one paused busy interval 7x.
func TestServiceModelScaleFree(t *testing.T) {
	b := backend{overhead: 0.06, perToken: 4 / 8000.0, tokenSeconds: 0.03}
	// learn feeds a model whose prior is hinted scale times faster 50 first tokens and 50 busy intervals of
	// b timed in that unit, from stall on one of each stalled (a connection held 20 s, a process paused
	// 30 s), or none if stall is past them; busyOnly drops the first tokens, so that the prefill is the
	// busy intervals' fit.
	learn := func(scale float64, stall int, busyOnly bool) Service {
		rng := rand.New(rand.NewPCG(4, 4))
		prior := Prior
		prior.Overhead, prior.PrefillSecondsPerToken = prior.Overhead/scale, prior.PrefillSecondsPerToken/scale
		prior.TokenSeconds, prior.MeanDuration = prior.TokenSeconds/scale, prior.MeanDuration/scale
		m := NewServiceModel(prior)
		for i := range 50 {
			uncached := 300 + rng.IntN(500)
			step := rng.Float64() * 6 * b.tokenSeconds // the rest of the step in progress, others prefilled with it
			ttft := b.ttft(uncached, rng) + step
			steps := 20 + rng.Float64()*20
			busy := steps*b.tokenSeconds + float64(uncached)*b.perToken
			if i == stall {
				ttft, busy = 20, 30
			}
			if !busyOnly {
				firstToken(m, uncached, 0, 0, ttft/scale)
			}
			m.ObserveBusy(busy/scale, float64(uncached), steps, 0)
		}
		return m.Service()
	}
	if real := learn(1, -1, false); !within(real.PrefillSecondsPerToken, b.perToken, 0.25) {
		t.Errorf("learned %.0f tokens/s, want about %.0f", 1/real.PrefillSecondsPerToken, 1/b.perToken)
	}
	for _, c := range []struct {
		name     string
		stall    int
		busyOnly bool
	}{{"first tokens", -1, false}, {"first tokens, one stalled", 40, false}, {"busy intervals, one paused", 40, true}} {
		real, fast := learn(1, c.stall, c.busyOnly), learn(10, c.stall, c.busyOnly)
		if !within(fast.PrefillSecondsPerToken*10, real.PrefillSecondsPerToken, 0.05) || !within(fast.Overhead*10, real.Overhead, 0.05) {
			t.Errorf("%s, timed 10x faster: %.0f tokens/s and %.1f ms overhead, want 10x %.0f and a tenth of %.1f", c.name,
				1/fast.PrefillSecondsPerToken, 1000*fast.Overhead, 1/real.PrefillSecondsPerToken, 1000*real.Overhead)
		}
	}
}

// TestServiceModelAdaptsToSlowdown: a backend that becomes 3x slower (a throttled GPU, a noisy neighbour)
// is seen as such within a few dozen requests, and the estimate follows it back when it recovers.
func TestServiceModelAdaptsToSlowdown(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 3))
	fast := backend{overhead: 0.03, perToken: 1 / 8000.0, tokenSeconds: 0.03}
	slow := backend{overhead: 0.09, perToken: 3 / 8000.0, tokenSeconds: 0.09}
	m := NewServiceModel(Prior)
	predict := func() float64 { s := m.Service(); return s.TTFT(2000) + 100*s.TokenSeconds }
	feed := func(b backend, n int) {
		for range n {
			uncached, output := 100+rng.IntN(4000), 50+rng.IntN(150)
			m.ObserveEnd(uncached, output, 0, b.duration(uncached, output, rng))
		}
	}
	feed(fast, 100)
	before := predict()
	feed(slow, 60)
	after := predict()
	want := slow.duration(2000, 100, rand.New(rand.NewPCG(0, 0)))
	if !within(after, want, 0.2) || after < 2*before {
		t.Errorf("after a 3x slowdown predicted %.2fs (was %.2fs), want about %.2fs", after, before, want)
	}
	feed(fast, 60)
	if back := predict(); !within(back, before, 0.2) {
		t.Errorf("after recovery predicted %.2fs, want about %.2fs", back, before)
	}
}

// TestServiceModelSlots: the running count that requests waiting find pinned at is the slot count; a
// backend seen running more (the ceiling was no limit) or queueing at varying batch sizes (waiting for
// the prefill budget, or for KV cache space) has none known.
func TestServiceModelSlots(t *testing.T) {
	slots := func(m *ServiceModel) float64 { return m.Service().Slots }
	m := NewServiceModel(Prior)
	m.ObserveQueue(5, 0, 0)
	if s := slots(m); s != 0 {
		t.Errorf("slots %v before any queue, want 0 (unknown)", s)
	}
	m.ObserveQueue(6, 1, 0) // a momentary wait for the prefill budget: no limit
	if s := slots(m); s != 0 {
		t.Errorf("slots %v after a momentary wait, want 0 (unknown)", s)
	}
	m.ObserveQueue(8, 3, 0)
	m.ObserveQueue(8, 4, 0)
	m.ObserveQueue(5, 0, 0) // no one waiting: says nothing
	m.ObserveQueue(8, 2, 0) // pinned at 8 with others waiting, three times
	if s := slots(m); s != 8 {
		t.Errorf("slots %v, want 8", s)
	}
	m.ObserveQueue(7, 1, 0) // once below it: still pinned there three times as often
	if s := slots(m); s != 8 {
		t.Errorf("slots %v after one wait below the ceiling, want 8", s)
	}
	m.ObserveQueue(12, 0, 0)
	if s := slots(m); s != 0 {
		t.Errorf("slots %v after running 12, want 0 (8 was no limit; 12 not yet seen pinned)", s)
	}

	// Prefill-bound with chunked prefill: requests wait at whatever batch size the token budget allows.
	budget := NewServiceModel(Prior)
	for _, r := range []float64{4, 5, 5, 3, 13, 12, 9, 13, 11, 15, 17, 14, 17, 22, 19} {
		budget.ObserveQueue(r, 3, 0.4)
		if s := slots(budget); s != 0 {
			t.Fatalf("slots %v while waiting at varying batch sizes (running %v), want 0 (unknown)", s, r)
		}
	}

	// Two long prompts fill the KV cache and the rest wait: that ceiling is the cache's, not the slots'.
	kv := NewServiceModel(Prior)
	for range 5 {
		kv.ObserveQueue(2, 3, 0.97)
	}
	if s := slots(kv); s != 0 {
		t.Errorf("slots %v learned while the KV cache was full, want 0 (unknown)", s)
	}

	// One long session holds 70% of the cache and the next does not fit: the cache's limit too.
	long := NewServiceModel(Prior)
	for range 5 {
		long.ObserveQueue(1, 2, 0.7)
	}
	if s := slots(long); s != 0 {
		t.Errorf("slots %v learned while one request held 70%% of the cache, want 0 (unknown)", s)
	}
}

// TestServiceModelIgnoresOutliers: one stalled request does not teach a 10x slowdown.
func TestServiceModelIgnoresOutliers(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 4))
	b := backend{overhead: 0.03, perToken: 1 / 8000.0, tokenSeconds: 0.03}
	m := NewServiceModel(Prior)
	for range 50 {
		uncached, output := 100+rng.IntN(4000), 50+rng.IntN(150)
		m.ObserveEnd(uncached, output, 0, b.duration(uncached, output, rng))
	}
	before := m.Service()
	m.ObserveEnd(1000, 100, 0, 600)
	after := m.Service()
	if after.TokenSeconds > 3*before.TokenSeconds || after.PrefillSecondsPerToken > 3*before.PrefillSecondsPerToken {
		t.Errorf("one 600 s request moved the service from %+v to %+v", before, after)
	}
}

// TestFleetBlend: an unmeasured upstream takes the measured ones' estimate, a well-measured one keeps its
// own, and one in between mixes them.
func TestFleetBlend(t *testing.T) {
	measured := Service{Overhead: 0.01, PrefillSecondsPerToken: 1e-4, TokenSeconds: 0.01, MeanDuration: 1, Samples: 40}
	var f Fleet
	f.Add(measured, 0)
	f.Add(Prior, 0) // the prior has no samples: it does not count
	if got := f.Blend(Prior, 0); got.PrefillSecondsPerToken != measured.PrefillSecondsPerToken || got.TokenSeconds != measured.TokenSeconds {
		t.Errorf("unmeasured upstream blended to %+v, want the fleet's %+v", got, measured)
	}
	own := Service{Overhead: 0.05, PrefillSecondsPerToken: 5e-4, TokenSeconds: 0.05, MeanDuration: 5, Samples: trustedSamples}
	if got := f.Blend(own, 0); got != own {
		t.Errorf("measured upstream blended to %+v, want its own %+v", got, own)
	}
	half := own
	half.Samples = trustedSamples / 2
	if got := f.Blend(half, 0); !within(got.PrefillSecondsPerToken, 3e-4, 1e-9) {
		t.Errorf("half-measured upstream: prefill %g s/token, want the mean 3e-4", got.PrefillSecondsPerToken)
	}
}

// TestFleetBlendBorrowsNoCongestion: a fleet whose only measured upstream learned from its requests that
// it is 10x slower than the prior (congestion looks like that without metrics) lends that slowness to no
// upstream never measured, which keeps its own estimate; a faster fleet is still borrowed, and a
// measured upstream still blends toward a slower fleet.
func TestFleetBlendBorrowsNoCongestion(t *testing.T) {
	congested := NewServiceModel(Prior)
	for range 40 {
		congested.ObserveEnd(1000, 100, 0, 10*(Prior.TTFT(1000)+100*Prior.TokenSeconds))
	}
	var f Fleet
	f.Add(congested.Service(), 0)
	if got := congested.Service().TokenSeconds / Prior.TokenSeconds; got < 5 {
		t.Fatalf("congested upstream learned %.1fx the prior's time per token, want about 10x", got)
	}
	if got := f.Blend(Prior, 0); got.Overhead != Prior.Overhead || got.PrefillSecondsPerToken != Prior.PrefillSecondsPerToken ||
		got.TokenSeconds != Prior.TokenSeconds || got.MeanDuration != Prior.MeanDuration {
		t.Errorf("unmeasured upstream blended to %+v, want its prior %+v", got, Prior)
	}
	fast := Service{Overhead: Prior.Overhead / 2, PrefillSecondsPerToken: Prior.PrefillSecondsPerToken / 2,
		TokenSeconds: Prior.TokenSeconds / 2, MeanDuration: Prior.MeanDuration / 2, Samples: trustedSamples}
	var g Fleet
	g.Add(fast, 0)
	if got := g.Blend(Prior, 0); got.TokenSeconds != fast.TokenSeconds || got.PrefillSecondsPerToken != fast.PrefillSecondsPerToken {
		t.Errorf("unmeasured upstream in a 2x faster fleet blended to %+v, want the fleet's %+v", got, fast)
	}
	once := Prior
	once.Samples = 1
	if got := f.Blend(once, 0); !(got.TokenSeconds > Prior.TokenSeconds) {
		t.Errorf("upstream with one sample in a slower fleet blended to %g s/token, want slower than its own %g", got.TokenSeconds, Prior.TokenSeconds)
	}
}

// TestFleetBlendBorrowsSlots: an upstream whose slot count is not known yet takes the largest one the
// fleet has shown, unless its own backend was seen running more than that; a known count is kept.
func TestFleetBlendBorrowsSlots(t *testing.T) {
	learned := NewServiceModel(Prior)
	for range minAtCeiling {
		learned.ObserveQueue(8, 4, 0.3)
	}
	if s := learned.Service(); s.Slots != 8 || s.Ceiling != 8 {
		t.Fatalf("learned slots %v, ceiling %v, want 8 and 8", s.Slots, s.Ceiling)
	}
	var f Fleet
	f.Add(learned.Service(), 0)
	f.Add(Prior, 0)

	burst := NewServiceModel(Prior) // seen running 8 once with others waiting: not yet proof
	burst.ObserveQueue(8, 6, 0.3)
	if got := f.Blend(burst.Service(), 0).Slots; got != 8 {
		t.Errorf("upstream not yet sure of its slots, fleet's 8: blended to %v slots, want 8", got)
	}
	if got := f.Blend(Prior, 0).Slots; got != 8 {
		t.Errorf("upstream never scraped: blended to %v slots, want the fleet's 8", got)
	}
	bigger := NewServiceModel(Prior)
	bigger.ObserveQueue(12, 0, 0.3)
	if got := f.Blend(bigger.Service(), 0).Slots; got != 0 {
		t.Errorf("upstream seen running 12: blended to %v slots, want 0 (8 is disproved there)", got)
	}
	own := Service{Slots: 4, Ceiling: 4}
	if got := f.Blend(own, 0).Slots; got != 4 {
		t.Errorf("upstream that learned 4 slots: blended to %v, want its own 4", got)
	}
	var none Fleet
	none.Add(burst.Service(), 0)
	if got := none.Blend(Prior, 0).Slots; got != 0 {
		t.Errorf("no upstream knows its slots: blended to %v, want 0 (unknown)", got)
	}
}

// observeBusy gives m n busy intervals of varied mixes (20-60 steps, 1,000-4,000 prompt tokens) on a
// backend whose steps take the prior's 30 ms and whose prefill takes perToken seconds a token.
func observeBusy(m *ServiceModel, perToken float64, n int) {
	for i := range n {
		steps := 20 + float64(i%5)*10
		uncached := 1000 + float64(i%3)*1500
		m.ObserveBusy(steps*0.03+uncached*perToken, uncached, steps, 0)
	}
}

// TestFleetPoolsBusyPrefill: one upstream's busy intervals show its kind of backend prefills 4x slower
// than the prior; an upstream with none takes that ratio on its own speed-scaled prior (one 3x slower
// overall ends 12x slower to prefill), and one with trustedBusy intervals of its own keeps its figure.
func TestFleetPoolsBusyPrefill(t *testing.T) {
	const perToken = 4 * 1.0 / 8000
	measured := NewServiceModel(Prior)
	observeBusy(measured, perToken, 8)
	slow := NewServiceModel(Prior)
	for range 30 { // every request takes 3x the prior's time
		slow.ObserveEnd(1000, 100, 0, 3*Prior.TTFT(1000)+3*100*Prior.TokenSeconds)
	}
	var f Fleet
	for _, m := range []*ServiceModel{measured, slow} {
		f.Add(m.Service(), 0)
	}
	ratio := measured.Service().PrefillSecondsPerToken / Prior.PrefillSecondsPerToken
	if !within(ratio, 4, 0.2) {
		t.Fatalf("measured upstream's prefill %.1fx the prior's, want about 4x", ratio)
	}
	s := slow.Service()
	if got, want := f.Blend(s, 0).PrefillSecondsPerToken, s.PrefillSecondsPerToken*ratio; !within(got, want, 0.05) {
		t.Errorf("upstream 3x slower with no busy intervals: prefill %g s/token, want %g (its scaled prior x the fleet's ratio)", got, want)
	}
	own := NewServiceModel(Prior)
	observeBusy(own, perToken, trustedBusy)
	if s := own.Service(); f.Blend(s, 0).PrefillSecondsPerToken != s.PrefillSecondsPerToken {
		t.Errorf("upstream with %d busy intervals blended to %g, want its own %g", trustedBusy, f.Blend(s, 0).PrefillSecondsPerToken, s.PrefillSecondsPerToken)
	}
}

// TestFleetBlendKinds: in a pool of two kinds of engine (KV cache geometries), an upstream borrows the
// busy intervals' prefill ratio, the slot count and the measured estimates of its own kind only, and
// nothing where its kind has none to lend; with one kind, and any number of upstreams of unknown
// geometry, it borrows from the whole pool exactly as without geometries (the matrix's regimes).
func TestFleetBlendKinds(t *testing.T) {
	const small, large = 32768, 262144 // backend tokens: 2048 and 16384 blocks of 16
	busyAt := func(perToken float64) Service {
		m := NewServiceModel(Prior)
		observeBusy(m, perToken, 8)
		return m.Service()
	}
	slotsAt := func(n float64) Service {
		m := NewServiceModel(Prior)
		for range minAtCeiling {
			m.ObserveQueue(n, 4, 0.3)
		}
		return m.Service()
	}
	slowSmall, fastLarge := busyAt(4.0/8000), busyAt(0.5/8000)
	var f Fleet
	f.Add(slowSmall, small)
	f.Add(fastLarge, large)
	f.Add(slotsAt(256), 0.97*large)           // a cache a few percent smaller: the same kind
	fresh := NewServiceModel(Prior).Service() // nothing learned: its speed-scaled prior is the prior
	f.Add(fresh, 3*small)
	for _, c := range []struct {
		name     string
		geometry float64
		slots    float64
		ratio    float64 // of the prefill's to Prior's, about
	}{
		{"small", small, 0, 4}, // its kind's ratio; no slots known in its kind: none borrowed
		{"large", large, 256, 0.5},
		{"unknown geometry", 0, 256, 1.4}, // the whole pool's: the geometric mean of 4 and 0.5
		{"a third kind", 3 * small, 0, 1}, // its kind has nothing to lend: its own
	} {
		got := f.Blend(fresh, c.geometry)
		if r := got.PrefillSecondsPerToken / Prior.PrefillSecondsPerToken; !within(r, c.ratio, 0.1) {
			t.Errorf("%s: prefill %.2fx the prior's, want about %.2fx", c.name, r, c.ratio)
		}
		if got.Slots != c.slots {
			t.Errorf("%s: %v slots, want %v", c.name, got.Slots, c.slots)
		}
	}

	// One kind: the same as no geometries at all.
	var one, none Fleet
	for _, s := range []Service{slowSmall, fastLarge, slotsAt(8)} {
		one.Add(s, large)
		none.Add(s, 0)
	}
	for _, s := range []Service{fresh, busyAt(2.0 / 8000)} { // not scraped yet
		one.Add(s, 0)
		none.Add(s, 0)
	}
	for _, s := range []Service{fresh, slowSmall, slotsAt(8)} {
		for _, g := range []float64{large, 0} {
			if a, b := one.Blend(s, g), none.Blend(s, 0); a != b {
				t.Errorf("one kind, geometry %v: blended to %+v, want %+v as without geometries", g, a, b)
			}
		}
	}
}

// TestServiceModelSetPrior: a new prior (a capacity hint) forgets what was learned and starts from it;
// the same prior again keeps what was learned. Regression: SetPrior overwrote the whole model, its held
// lock included, and the deferred unlock panicked.
func TestServiceModelSetPrior(t *testing.T) {
	m := NewServiceModel(Prior)
	for range 20 {
		m.ObserveEnd(1000, 100, 0, 30)
	}
	m.SetPrior(Prior)
	if s := m.Service(); s.Samples == 0 {
		t.Error("the same prior forgot what was learned")
	}
	faster := Prior
	faster.PrefillSecondsPerToken /= 2
	m.SetPrior(faster)
	if s := m.Service(); s.Samples != 0 || s.PrefillSecondsPerToken != faster.PrefillSecondsPerToken {
		t.Errorf("after a new prior: %+v, want that prior with no samples", s)
	}
}

// TestServiceModelSkipsQueuedFirstTokens: first tokens that waited mostly in a predicted queue teach
// nothing (their wait's error would be learned as service); those served at once do.
func TestServiceModelSkipsQueuedFirstTokens(t *testing.T) {
	m := NewServiceModel(Prior)
	before := m.Service()
	for range 20 {
		firstToken(m, 1000, 0, 2, 2+5) // 2 s predicted queue, then 5 s: the queue was longer than thought
	}
	firstToken(m, 1000, 0, 2, 1) // came before its predicted queue ended
	if got := m.Service(); got.Overhead != before.Overhead || got.PrefillSecondsPerToken != before.PrefillSecondsPerToken {
		t.Errorf("queued first tokens moved the model: %+v, want %+v", got, before)
	}
	for range 20 {
		firstToken(m, 1000, 0, 0, 0.030+1000.0/2000) // idle, 2k tokens/s
	}
	s := m.Service()
	if got := 1 / s.PrefillSecondsPerToken; !within(got, 2000, 0.2) {
		t.Errorf("prefill %.0f tokens/s after first tokens served at once, want about 2000", got)
	}
	if s.FirstTokens != 20 || s.SkippedFirstTokens != 21 {
		t.Errorf("counted %d first tokens that taught and %d skipped, want 20 and 21", s.FirstTokens, s.SkippedFirstTokens)
	}
}

// TestServiceModelSkipsSlotWaits: a backend of 8 slots, seen without its slot count, serves first tokens
// on time behind up to 7 of the proxy's requests and after a wait for a slot (0.5-1.5 s) behind 8 or
// more. The waits teach the model nothing (its overhead and prefill speed stay the backend's) and Free
// is what it ran beside a new request without queueing, 7. Control: told a slot count of 64 (the
// decision would have predicted any wait for a slot), the same first tokens are learned, waits and all.
func TestServiceModelSkipsSlotWaits(t *testing.T) {
	b := backend{overhead: 0.03, perToken: 1 / 8000.0, tokenSeconds: 0.03}
	feed := func(m *ServiceModel) {
		rng := rand.New(rand.NewPCG(12, 12))
		for range 80 {
			uncached, ahead := 200+rng.IntN(1800), rng.IntN(16)
			service := b.ttft(uncached, rng)
			ttft := service
			if ahead >= 8 {
				ttft += 0.5 + rng.Float64()
			}
			m.ObserveFirstToken(uncached, ahead, 0, ttft, service) // a slot freed as its service began
		}
	}
	m := NewServiceModel(Prior)
	feed(m)
	s := m.Service()
	if !within(s.Overhead, b.overhead, 0.3) || !within(s.PrefillSecondsPerToken, b.perToken, 0.15) || s.FirstTokens < minFirstTokens {
		t.Errorf("learned %.0f ms overhead and %.0f tokens/s from %d first tokens, want 30 and 8000 (the waits for a slot skipped)",
			1000*s.Overhead, 1/s.PrefillSecondsPerToken, s.FirstTokens)
	}
	if s.Free != 7 {
		t.Errorf("Free = %d, want 7 (first tokens on time behind up to 7)", s.Free)
	}
	if !s.SlotWait(8) || s.SlotWait(7) {
		t.Errorf("SlotWait(8), SlotWait(7) = %v, %v; want true, false", s.SlotWait(8), s.SlotWait(7))
	}
	m.ForgetSlots()
	if got := m.Service().Free; got != 0 {
		t.Errorf("after ForgetSlots (a restarted backend): Free = %d, want 0", got)
	}

	told := NewServiceModel(Prior)
	told.ReportSlots(64)
	feed(told)
	if got := told.Service(); got.Overhead < 5*b.overhead || got.SlotWait(15) {
		t.Errorf("with a slot count of 64: %.0f ms overhead, SlotWait(15) %v; want the waits learned (over 150 ms) and no slot wait",
			1000*got.Overhead, got.SlotWait(15))
	}
}

// TestServiceModelLateWithoutSlotWait: a backend that prefills 4x slower than the prior, always behind 1-6
// of the proxy's requests, never waiting for a slot. Every first token is late against the prior's
// prediction, behind more requests than any came on time behind, so each looked like a wait for a slot
// and taught nothing: the model kept the prior's 8k tokens/s. A slot frees only when a request ends, and
// the service after the last end is at least what the first token shows; late even so, it teaches.
func TestServiceModelLateWithoutSlotWait(t *testing.T) {
	b := backend{overhead: 0.03, perToken: 4 / 8000.0, tokenSeconds: 0.03}
	rng := rand.New(rand.NewPCG(13, 13))
	m := NewServiceModel(Prior)
	for i := range 60 {
		uncached, ahead := 500+rng.IntN(1500), 1+rng.IntN(6)
		ttft := b.ttft(uncached, rng)
		sinceEnd := ttft
		if i%2 == 1 { // one of the requests ahead ended partway through
			sinceEnd *= 0.5 + 0.5*rng.Float64()
		}
		m.ObserveFirstToken(uncached, ahead, 0, ttft, sinceEnd)
	}
	s := m.Service()
	if !within(s.PrefillSecondsPerToken, b.perToken, 0.25) || s.FirstTokens < 30 {
		t.Errorf("learned %.0f tokens/s from %d first tokens (%d skipped), want about %.0f",
			1/s.PrefillSecondsPerToken, s.FirstTokens, s.SkippedFirstTokens, 1/b.perToken)
	}
}

// TestServiceModelBusy: busy intervals of a backend 4x slower to prefill than the prior and 1.7x faster
// to decode pin its prefill speed within a few intervals, from the prior's 8k tokens/s; invalid
// intervals teach nothing; observed first tokens, when there are enough, take precedence.
func TestServiceModelBusy(t *testing.T) {
	const step, perToken = 0.018, 1.0 / 2000
	rng := rand.New(rand.NewPCG(9, 9))
	m := NewServiceModel(Prior)
	m.ObserveBusy(1, 1000, 0, 0)   // no step ended
	m.ObserveBusy(-1, 1000, 10, 0) // no time
	if n := m.Service().BusyIntervals; n != 0 {
		t.Fatalf("%d busy intervals from invalid ones, want 0", n)
	}
	for i := range 6 {
		steps := 5 + rng.Float64()*40
		uncached := rng.Float64() * 3000
		noise := 1 + 0.05*(rng.Float64()-0.5)
		m.ObserveBusy((steps*step+uncached*perToken)*noise, uncached, steps, 0)
		if got := m.Service().PrefillSecondsPerToken; i >= 3 && math.Abs(got-perToken) > 0.2*perToken {
			t.Errorf("after %d busy intervals: %.0f prefill tokens/s, want about %.0f", i+1, 1/got, 1/perToken)
		}
	}
	for range 2 * minFirstTokens {
		uncached := 200 + rng.IntN(4000)
		firstToken(m, uncached, 0, 0, 0.030+float64(uncached)/20000)
	}
	if got := m.Service().PrefillSecondsPerToken; got > 2.0/20000 {
		t.Errorf("with %d first tokens at 20k tokens/s: %.0f tokens/s, want the first tokens' estimate", 2*minFirstTokens, 1/got)
	}
}

// TestServiceModelFirstBusyIntervalCounts: the first busy interval already moves the prefill speed (the
// fleet pools it; see Blend): a backend 4x slower to prefill than the prior is priced slower after one.
// Waiting for a second one left the backends of the matrix's slow-prefill regime (steps of 30 ms, an
// interval of 64 or more) at the prior for most of a run.
func TestServiceModelFirstBusyIntervalCounts(t *testing.T) {
	const steps, uncached = 64.0, 4000.0
	m := NewServiceModel(Prior)
	m.ObserveBusy(steps*Prior.TokenSeconds+uncached*4*Prior.PrefillSecondsPerToken, uncached, steps, 0)
	s := m.Service()
	if s.BusyIntervals != 1 || s.PrefillSecondsPerToken < 1.1*Prior.PrefillSecondsPerToken {
		t.Errorf("after one busy interval at a quarter of the prior's prefill speed: %d intervals, %.0f tokens/s, want slower than the prior's %.0f",
			s.BusyIntervals, 1/s.PrefillSecondsPerToken, 1/Prior.PrefillSecondsPerToken)
	}
	var f Fleet
	f.Add(s, 0)
	if got := f.Blend(NewServiceModel(Prior).Service(), 0).PrefillSecondsPerToken; got < 1.1*Prior.PrefillSecondsPerToken {
		t.Errorf("an unmeasured upstream beside it: %.0f tokens/s, want the fleet's slower speed", 1/got)
	}
}

// TestFleetBlendScalesBySteps: an upstream that has not measured itself borrows the fleet's estimate,
// scaled by how much longer than the others' its work between scrapes took, priced at the fleet's
// estimate. Three backends have measured themselves (responses ended, busy intervals); the fourth, none
// of whose responses has ended, has eight scrape pairs (noisy ones: a prompt scheduled at an interval's
// edge is counted in one, its time spent in the next). 3x slower than the others, it is priced about 3x
// slower, where it borrowed their speed whole; alike, it is priced alike, also where prefill is 4x slower
// than the prior's split says and it ran mostly prefill while the others ran mostly decode: its work is
// priced at the split the others' busy intervals taught them. (Where nothing has taught the split yet, such
// a difference of mixes looks like one of speed, 1.5-2x here: a limit, not a property.)
func TestFleetBlendScalesBySteps(t *testing.T) {
	m := NewServiceModel(Prior)
	m.ObserveSteps(0, 1000, 10)  // no time
	m.ObserveSteps(0.2, 1000, 0) // no step ended
	if s := m.Service(); s.steps.n != 0 {
		t.Fatalf("%d scrape pairs counted from invalid ones, want 0", s.steps.n)
	}
	for _, c := range []struct {
		name           string
		step, perToken float64 // the fleet's
		slowest        float64 // the fourth backend's times over the others'
		mine, theirs   float64 // the prompt tokens a second of work the fourth and the others prefill
	}{
		{"3x slower, 5x faster than the prior", 0.006, 1.0 / 40000, 3, 2000, 2000},
		{"alike, slow prefill, unlike mixes", 0.030, 1.0 / 2000, 1, 1500, 100},
	} {
		rng := rand.New(rand.NewPCG(3, 3))
		scrapes := func(m *ServiceModel, f, perSecond float64) {
			carry := 0.0
			for range 8 {
				uncached := perSecond * 0.2 * 2 * rng.Float64()
				shift := rng.Float64() * uncached / 2 // counted here, prefilled in the next interval
				seconds := 0.2
				steps := max((seconds-(uncached-shift+carry)*c.perToken*f)/(c.step*f), 1)
				m.ObserveSteps(seconds, uncached, steps)
				carry = shift
			}
		}
		models := make([]*ServiceModel, 4)
		for i := range models {
			models[i] = NewServiceModel(Prior)
			if i == 3 {
				scrapes(models[i], c.slowest, c.mine)
				continue
			}
			for range 6 {
				models[i].ObserveEnd(500, 64, 0, 64*c.step+500*c.perToken)
				steps, uncached := 64.0, 1000+rng.Float64()*2000
				models[i].ObserveBusy(steps*c.step+uncached*c.perToken, uncached, steps, 0)
			}
			scrapes(models[i], 1, c.theirs)
		}
		var fl Fleet
		for _, m := range models {
			fl.Add(m.Service(), 0)
		}
		fast, slow := fl.Blend(models[0].Service(), 0), fl.Blend(models[3].Service(), 0)
		if r := slow.TTFT(1000) / fast.TTFT(1000); math.Abs(r/c.slowest-1) > 0.25 {
			t.Errorf("%s: the fourth's first token priced %.2fx the others', want about %gx", c.name, r, c.slowest)
		}
		if r := slow.TokenSeconds / fast.TokenSeconds; math.Abs(r/c.slowest-1) > 0.25 {
			t.Errorf("%s: the fourth's steps priced %.2fx the others', want about %gx", c.name, r, c.slowest)
		}
	}
}

// isCovariance reports whether p is what boundCovariance2 keeps: symmetric, variances at least
// minVariance, the covariance within what they allow (up to rounding).
func isCovariance(p [2][2]float64) bool {
	return p[0][1] == p[1][0] && p[0][0] >= minVariance && p[1][1] >= minVariance && p[0][1]*p[0][1] <= p[0][0]*p[1][1]*(1+1e-9)
}

// TestRLSWindupStaysCovariance: fed the same x over and over (nothing tells the intercept from the
// slope), an estimator that forgot in every direction wound its covariance up to the bound, where
// clamping each entry alone left it indefinite (from update 262 of these 2,000 on), and an indefinite
// matrix turns a variance negative. Forgetting only along the observations' direction, the covariance
// of the direction they never excite stays as it was; either way it must stay a covariance matrix, and
// the model's state one Restore accepts.
func TestRLSWindupStaysCovariance(t *testing.T) {
	r := newRLS2(0.03, 0.125, noiseSeconds)
	for i := range 2000 {
		r.update(1.5, 0.35+0.001*float64(i%3))
		p := r.p
		if !isCovariance(p) {
			t.Fatalf("update %d: P = %v is no covariance matrix", i, p)
		}
	}
	st := ModelState{Prior: priorOf(Prior), TTFT: RLSState{Theta: r.theta, P: r.p}}
	if err := st.check(); err != nil {
		t.Errorf("the wound-up state is refused: %v", err)
	}
}

// TestRLSParametersStayRestorable: an update holds the fitted parameters within the bound Restore checks,
// however far one observation pulls them (FuzzRestore's restored step time of 7 s, one busy interval
// later, had a time per sequence of -21,010), and an observation that is not a number moves nothing.
func TestRLSParametersStayRestorable(t *testing.T) {
	r := newRLS2(0.03, 0.125, noiseSeconds)
	r.p = [2][2]float64{{maxCovariance, 0}, {0, maxCovariance}}
	r.update(1000, 1e9)
	for _, v := range r.theta {
		if math.Abs(v) > maxTheta {
			t.Fatalf("after a far observation theta = %v, beyond ±%v", r.theta, maxTheta)
		}
	}
	before := r.theta
	r.update(2, math.NaN())
	if r.theta != before {
		t.Errorf("an observation that is not a number moved theta from %v to %v", before, r.theta)
	}
	b := newBusyFit(Prior)
	b.p = [3][3]float64{{maxCovariance, 0, 0}, {0, maxCovariance, 0}, {0, 0, maxCovariance}}
	b.updatePhi([3]float64{100, 7000, 4}, -1e9)
	before3 := b.theta
	b.updatePhi([3]float64{1, 1, 1}, math.Inf(1))
	for i, v := range b.theta {
		if math.Abs(v) > maxTheta || math.IsNaN(v) || math.Abs(before3[i]) > maxTheta {
			t.Fatalf("busy fit theta %v (before the infinite observation %v), want within ±%v", b.theta, before3, maxTheta)
		}
	}
}

// TestServiceModelSteadyMix: busy intervals that mix decode steps and prefill in nearly the same
// proportion, hour after hour, tell the step time from the prefill speed only by the mix's jitter. After
// 20 varied intervals and 1,000 steady ones (5% noise on the seconds), the prefill speed stays within
// 1.5x of the truth on four kinds of backend; with forgetting in every direction, what the varied
// intervals had taught was forgotten and the estimate wandered to the 30x clamps.
func TestServiceModelSteadyMix(t *testing.T) {
	for _, b := range []struct{ step, prefill float64 }{{0.030, 1.0 / 8000}, {0.030, 1.0 / 2000}, {0.090, 1.0 / 2666}, {0.018, 1.0 / 20000}} {
		for _, jitter := range []float64{0.02, 0.1, 0.3} {
			worst := 1.0
			for seed := range int64(10) {
				r := rand.New(rand.NewPCG(uint64(seed), 0x5eed))
				m := NewServiceModel(Prior)
				busy := func(steps, uncached float64) {
					m.ObserveBusy((steps*b.step+uncached*b.prefill)*(1+0.05*r.NormFloat64()), uncached, steps, 0)
				}
				for range 20 {
					busy(20+40*r.Float64(), 20000*r.Float64())
				}
				for i := range 1000 {
					steps := 30 + 10*r.Float64()
					busy(steps, 100*steps*(1+jitter*(2*r.Float64()-1)))
					if i >= 100 {
						off := m.Service().PrefillSecondsPerToken / b.prefill
						worst = max(worst, off, 1/off)
					}
				}
			}
			if worst > 1.5 {
				t.Errorf("step %v, prefill %.0f tokens/s, mix ±%.0f%%: the prefill estimate strayed %.2fx from the truth",
					b.step, 1/b.prefill, 100*jitter, worst)
			}
		}
	}
}

// TestServiceModelBusyFitOutsideBand: busy intervals whose fit puts the prefill past the fast edge of
// the plausible band (here below nothing: a long first interval made the steps look slow, and later
// intervals heavy with prefill took less time than those steps alone would) set no prefill speed: the
// upstream keeps its speed-scaled prior and the fleet pools only the others' ratios. Clamped to the
// band, it priced that upstream's prefill at 30x the prior's speed and, pooled, everyone's. A fit past
// the slow edge is still used, clamped.
func TestServiceModelBusyFitOutsideBand(t *testing.T) {
	bad := NewServiceModel(Prior)
	bad.ObserveBusy(0.8, 1000, 270, 0) // 3 ms a step where the backend steps in 2
	for range 6 {
		bad.ObserveBusy(0.40, 2500, 140, 0) // 2,500 tokens prefilled and 140 steps in less than 140 such steps
	}
	if th := bad.busy.theta[2]; th >= Prior.PrefillSecondsPerToken*1000/maxScale {
		t.Fatalf("the fit's prefill is %v s per 1k tokens: the intervals did not take it out of the band", th)
	}
	s := bad.Service()
	if s.PrefillSecondsPerToken != Prior.PrefillSecondsPerToken {
		t.Errorf("prefill %v s/token from a fit outside the band, want the prior's %v", s.PrefillSecondsPerToken, Prior.PrefillSecondsPerToken)
	}
	if r := s.busyRatio(); r != 0 {
		t.Errorf("busyRatio() = %v from a fit outside the band, want 0 (nothing to pool)", r)
	}
	if s.BusyIntervals != 7 {
		t.Errorf("BusyIntervals = %d, want the 7 observed", s.BusyIntervals)
	}

	// Past the slow edge (100x slower than the prior) the fit still counts, clamped to the edge.
	slow := NewServiceModel(Prior)
	for i := range 30 {
		uncached := float64(500 + 1500*(i%3))
		slow.ObserveBusy(40*0.030+uncached*100*Prior.PrefillSecondsPerToken, uncached, 40, 0)
	}
	if s := slow.Service(); s.PrefillSecondsPerToken != Prior.PrefillSecondsPerToken*maxScale || s.busyRatio() <= 0 {
		t.Errorf("a fit 100x slower than the prior: prefill %v s/token (ratio %v), want the edge %v, pooled",
			s.PrefillSecondsPerToken, s.busyRatio(), Prior.PrefillSecondsPerToken*maxScale)
	}

	// A fleet of it and one upstream whose intervals show the prefill 2x slower than the prior: only
	// the latter's ratio is pooled, and the bad one borrows it.
	good := NewServiceModel(Prior)
	for range 16 {
		good.ObserveBusy(40*0.030+2000*2*Prior.PrefillSecondsPerToken, 2000, 40, 0)
		good.ObserveBusy(60*0.030+500*2*Prior.PrefillSecondsPerToken, 500, 60, 0)
	}
	var f Fleet
	f.Add(s, 0)
	f.Add(good.Service(), 0)
	if got, want := math.Exp(f.logRatio/f.ratioWeight), good.Service().busyRatio(); math.Abs(got/want-1) > 1e-9 {
		t.Errorf("the fleet pools a ratio of %v, want the good upstream's alone, %v", got, want)
	}
	if got := f.Blend(s, 0).PrefillSecondsPerToken; got <= Prior.PrefillSecondsPerToken {
		t.Errorf("the bad upstream blended to %v s/token, want slower than the prior's %v, as the good one shows", got, Prior.PrefillSecondsPerToken)
	}
}

// TestServiceModelReportedSlots: a slot count the backend reports itself (NVIDIA NIM's num_request_max)
// is the model's from the first scrape, over what the queue taught, and goes with ForgetSlots (a restart)
// until reported again; a count below one says nothing.
func TestServiceModelReportedSlots(t *testing.T) {
	m := NewServiceModel(Prior)
	m.ReportSlots(0)
	m.ReportSlots(math.NaN())
	if s := m.Service(); s.Slots != 0 {
		t.Fatalf("slots %v after reports of none, want 0 (unknown)", s.Slots)
	}
	m.ReportSlots(256)
	if s := m.Service(); s.Slots != 256 || s.LikelySlots != 0 {
		t.Errorf("slots %v (likely %v) as reported, want 256", s.Slots, s.LikelySlots)
	}
	for range 5 { // requests waiting for the KV cache's room at 40: no slot count of 40
		m.ObserveQueue(40, 3, 0.5)
	}
	if s := m.Service().Slots; s != 256 {
		t.Errorf("slots %v after the queue pointed at 40, want the reported 256", s)
	}
	m.ForgetSlots()
	if s := m.Service().Slots; s != 0 {
		t.Errorf("slots %v after ForgetSlots, want 0 until reported again", s)
	}
}

// TestServiceModelBusyBatch: a backend whose decode steps grow with the batch (30 ms and 0.25 ms a
// sequence, as vLLM's) and whose prefill per interval grows with it too (more requests running, more
// arriving) prefills at 20k tokens/s. Fitted on steps and prefilled tokens alone, the step time that the
// batch adds is taken for prefill, and the speed comes out several times too slow (the matrix's
// fast-prefill backends were priced at 61k wall tokens/s for 200k); with the generated tokens (a
// sequence-step each) beside the steps, it is within a fifth of the truth, and the time per sequence is
// learned.
func TestServiceModelBusyBatch(t *testing.T) {
	const step, perSeq, perToken = 0.030, 0.00025, 1.0 / 20000
	fit := func(withGenerated bool) Service {
		rng := rand.New(rand.NewPCG(3, 3))
		m := NewServiceModel(Prior)
		for range 30 {
			steps := 64 + rng.Float64()*136
			batch := 4 + rng.Float64()*36
			uncached := steps * batch * 2 * (0.5 + rng.Float64())
			seconds := (steps*(step+perSeq*batch) + uncached*perToken) * (1 + 0.02*rng.NormFloat64())
			generated := 0.0
			if withGenerated {
				generated = steps * batch
			}
			m.ObserveBusy(seconds, uncached, steps, generated)
		}
		return m.Service()
	}
	without, with := fit(false), fit(true)
	if got := without.PrefillSecondsPerToken / perToken; got < 1.5 {
		t.Errorf("without the generated tokens: prefill %.0f tokens/s, want the batch's time taken for prefill (slower than %.0f)",
			1/without.PrefillSecondsPerToken, 1/perToken/1.5)
	}
	if got := with.PrefillSecondsPerToken / perToken; got < 0.8 || got > 1.25 {
		t.Errorf("with the generated tokens: prefill %.0f tokens/s, want %.0f within a fifth", 1/with.PrefillSecondsPerToken, 1/perToken)
	}
}

// TestBoundCovariance3: three covariances each within what their variances allow can still make an
// indefinite matrix (all -0.9 on unit variances: an eigenvalue of -0.8), on which recursive least squares
// turns a variance negative; such a matrix keeps only its variances. A positive definite one is kept.
func TestBoundCovariance3(t *testing.T) {
	bad := [3][3]float64{{1, -0.9, -0.9}, {-0.9, 1, -0.9}, {-0.9, -0.9, 1}}
	if positiveDefinite3(bad) {
		t.Fatal("the test matrix is positive definite")
	}
	got := boundCovariance3(bad)
	if !positiveDefinite3(got) || got[0][0] != 1 || got[1][1] != 1 || got[2][2] != 1 {
		t.Errorf("bounded %v: want positive definite, the variances kept", got)
	}
	good := [3][3]float64{{2, 0.5, -0.3}, {0.5, 1, 0.2}, {-0.3, 0.2, 3}}
	if got := boundCovariance3(good); got != good {
		t.Errorf("a positive definite matrix became %v", got)
	}
}

// TestFleetAlign: four backends, each with its own noisy estimates (busy intervals and durations drawn
// with noise), are priced alike when alike, and the one 3x slower stays about 3x slower, by the one
// measure whose noise the fleet estimates (their work between scrapes). Before Align the alike ones'
// first-token prices differ by the noise of their own estimates.
func TestFleetAlign(t *testing.T) {
	for _, c := range []struct {
		name    string
		slowest float64 // the fourth backend's times over the others'
	}{
		{"alike", 1},
		{"one 3x slower", 3},
	} {
		rng := rand.New(rand.NewPCG(7, 7))
		step, perToken := 0.030, 1.0/20000
		models := make([]*ServiceModel, 4)
		for i := range models {
			f := 1.0
			if i == 3 {
				f = c.slowest
			}
			models[i] = NewServiceModel(Prior)
			for range 3 + i { // few observations each, noisy ones
				noise := 0.7 + 0.6*rng.Float64()
				models[i].ObserveEnd(500, 64, 0, noise*f*(64*step+500*perToken))
				steps, uncached := 64.0, 1000+rng.Float64()*2000
				models[i].ObserveBusy(noise*f*(steps*step+uncached*perToken), uncached, steps, 0)
			}
			for range 8 {
				uncached := 2000 * 0.2 * 2 * rng.Float64()
				steps := max((0.2-uncached*perToken*f)/(step*f), 1)
				models[i].ObserveSteps(0.2, uncached, steps)
			}
		}
		const geometry = 32768 // one cache geometry: alike hardware, the fourth maybe slower
		var fl Fleet
		for _, m := range models {
			fl.Add(m.Service(), geometry)
		}
		cands := make([]Candidate, 4)
		for i, m := range models {
			cands[i].Service = fl.Blend(m.Service(), geometry)
			cands[i].KVCapacity = geometry
		}
		spread := func(n int) float64 { // the widest ratio of first-token prices among the first n
			lo, hi := math.Inf(1), 0.0
			for i := range n {
				v := cands[i].Service.TTFT(1000)
				lo, hi = min(lo, v), max(hi, v)
			}
			return hi / lo
		}
		alike := 4
		if c.slowest != 1 {
			alike = 3
		}
		before := spread(alike)
		fl.Align(cands)
		after := spread(alike)
		t.Logf("%s: alike backends' first-token prices %.3fx apart before Align, %.3fx after", c.name, before, after)
		if c.slowest == 1 && (before < 1.1 || after > 1+(before-1)/2) {
			t.Errorf("%s: alike backends priced %.3fx apart before Align and %.3fx after, want the noise (over 1.1x) at least halved", c.name, before, after)
		}
		if c.slowest == 1 {
			continue
		}
		// The slower one stays slower than each of the others, by about what its work between scrapes
		// shows (1.7-2.1x with these eight noisy pairs, priced at the fleet's split; where one backend
		// stands out, the fleet's spread is wide and the alike ones' own measures are not pulled together).
		for i := range 3 {
			if r := cands[3].Service.TTFT(1000) / cands[i].Service.TTFT(1000); r < 1.5 || r > 3.75 {
				t.Errorf("%s: the fourth's first token priced %.2fx backend %d's, want 1.5-3.75x", c.name, r, i)
			}
			if r := cands[3].Service.TokenSeconds / cands[i].Service.TokenSeconds; r < 1.5 || r > 3.75 {
				t.Errorf("%s: the fourth's steps priced %.2fx backend %d's, want 1.5-3.75x", c.name, r, i)
			}
		}
	}
	// Candidates whose work between scrapes is not measured (metrics off: no scrape pairs) keep their
	// own estimates, a backend measured 3x slower by its responses included; so does a lone measured one.
	unscraped := func(f float64) Service {
		m := NewServiceModel(Prior)
		for range 16 {
			m.ObserveEnd(500, 64, 0, f*(64*0.03+500/8000.0))
		}
		return m.Service()
	}
	var fl Fleet
	cands := []Candidate{{Service: unscraped(1)}, {Service: unscraped(1)}, {Service: unscraped(3)}}
	for _, c := range cands {
		fl.Add(c.Service, 0)
	}
	want := []Service{cands[0].Service, cands[1].Service, cands[2].Service}
	fl.Align(cands)
	for i := range cands {
		if cands[i].Service.PrefillSecondsPerToken != want[i].PrefillSecondsPerToken || cands[i].Service.TokenSeconds != want[i].TokenSeconds {
			t.Errorf("unscraped candidate %d aligned: %+v, want its own %+v", i, cands[i].Service, want[i])
		}
	}
	if r := cands[2].Service.TokenSeconds / cands[0].Service.TokenSeconds; r < 2 {
		t.Errorf("the backend measured 3x slower priced %.2fx the others' after Align, want over 2x (its own estimate, 2.45x after 16 responses)", r)
	}
}

// TestFleetAlignKinds: two kinds of engine in one pool, told apart by their cache geometry, each aligned
// within its kind: small engines that prefill 2.4x slower but step 0.6x the time of the large ones are
// priced slower to prefill and faster to step than the large ones, as their own estimates have them.
// Aligned together (one geometry), the one factor their work between scrapes gives put the small ones'
// prefill faster than the large ones'. A measured candidate without a fresh geometry keeps its own.
func TestFleetAlignKinds(t *testing.T) {
	const small, large = 16 * 2048, 16 * 16384 // KV cache tokens
	build := func(geometry [4]float64) (aligned, own []Candidate) {
		rng := rand.New(rand.NewPCG(3, 3))
		var fl Fleet
		models := make([]*ServiceModel, 4)
		for i := range models {
			step, perToken := 0.030, 1.0/8000
			if i%2 == 0 { // a small engine
				step, perToken = 0.018, 1.0/3300
			}
			models[i] = NewServiceModel(Prior)
			for range 12 {
				noise := 0.9 + 0.2*rng.Float64()
				steps, uncached := 64.0, 1000+rng.Float64()*2000
				models[i].ObserveBusy(noise*(steps*step+uncached*perToken), uncached, steps, 0)
				models[i].ObserveEnd(500, 64, 0, noise*(64*step+500*perToken))
			}
			for range 8 {
				uncached := 400 * rng.Float64()
				models[i].ObserveSteps(uncached*perToken+16*step, uncached, 16)
			}
			fl.Add(models[i].Service(), geometry[i])
		}
		cands := make([]Candidate, 4)
		for i, m := range models {
			cands[i] = Candidate{Service: fl.Blend(m.Service(), geometry[i]), KVCapacity: geometry[i], TokenScale: 1 + 0.01*float64(i)}
			cands[i].KVCapacity /= cands[i].TokenScale // in the prompt counts' tokens, as the scrape divides it
		}
		own = slices.Clone(cands)
		if own[0].Service.PrefillSecondsPerToken < 1.5*own[1].Service.PrefillSecondsPerToken || own[0].Service.TokenSeconds > own[1].Service.TokenSeconds {
			t.Fatalf("own estimates: small %+v, large %+v; want the small one slower to prefill and faster to step", own[0].Service, own[1].Service)
		}
		fl.Align(cands)
		return cands, own
	}
	cands, _ := build([4]float64{small, large, small, large})
	for _, i := range []int{0, 2} {
		for _, j := range []int{1, 3} {
			if r := cands[i].Service.PrefillSecondsPerToken / cands[j].Service.PrefillSecondsPerToken; r < 1.5 {
				t.Errorf("small engine %d priced to prefill %.2fx the time of large engine %d, want over 1.5x (2.4x true)", i, r, j)
			}
			if r := cands[i].Service.TokenSeconds / cands[j].Service.TokenSeconds; r > 0.8 {
				t.Errorf("small engine %d priced to step %.2fx the time of large engine %d, want under 0.8x (0.6x true)", i, r, j)
			}
		}
	}
	for _, pair := range [][2]int{{0, 2}, {1, 3}} { // alike within a kind
		a, b := cands[pair[0]].Service.PrefillSecondsPerToken, cands[pair[1]].Service.PrefillSecondsPerToken
		if r := max(a, b) / min(a, b); r > 1.05 {
			t.Errorf("engines %v of one kind priced %.3fx apart to prefill, want alike", pair, r)
		}
	}
	// Caches a few percent apart (gpu_memory_utilization 0.90 against 0.92) are one kind: aligned alike.
	near, _ := build([4]float64{small, large, 1.03 * small, 0.97 * large})
	for _, pair := range [][2]int{{0, 2}, {1, 3}} {
		a, b := near[pair[0]].Service, near[pair[1]].Service
		if a.PrefillSecondsPerToken/b.PrefillSecondsPerToken != cands[pair[0]].Service.PrefillSecondsPerToken/cands[pair[1]].Service.PrefillSecondsPerToken {
			t.Errorf("engines %v, caches 3%% apart: priced %+v and %+v, want aligned as with one cache size", pair, a, b)
		}
	}
	// Without a fresh geometry, candidate 3 keeps its own estimate; 1 is then alone of its kind too.
	geo := [4]float64{small, large, small, 0}
	unaligned, own := build(geo)
	for _, i := range []int{1, 3} {
		if unaligned[i].Service != own[i].Service {
			t.Errorf("candidate %d (geometry %v) aligned: %+v, want its own %+v", i, geo[i], unaligned[i].Service, own[i].Service)
		}
	}
}

// TestFitKind: the pooled work between scrapes of one kind's upstreams tells their prefill from their step
// time when the pairs' mixes of steps and prompt tokens vary, and says nothing when they do not (a
// prefill in proportion to the steps), when too few pairs are pooled, or when the noise swamps it.
func TestFitKind(t *testing.T) {
	const step, perToken = 0.018, 1.0 / 3300 // 16 slots without chunked prefill
	pairs := func(seed uint64, n int, noise float64, vary bool) spanWork {
		rng := rand.New(rand.NewPCG(seed, 7))
		m := NewServiceModel(Prior)
		for range n {
			steps := 10 + 40*rng.Float64()
			uncached := 2000 * rng.Float64()
			if !vary {
				uncached = 30 * steps
			}
			m.ObserveSpan((steps*step+uncached*perToken)*(1+noise*(2*rng.Float64()-1)), uncached, steps)
		}
		return m.Service().span
	}
	p, ok := fitKind([]spanWork{pairs(1, 4, 0.1, true), pairs(2, 5, 0.1, true)})
	if !ok || p < perToken/1.2 || p > perToken*1.2 {
		t.Errorf("varied mixes, 10%% noise: prefill %.0f tokens/s (ok %v), want 3,300 within 20%%", 1/p, ok)
	}
	if p, ok := fitKind([]spanWork{pairs(3, 6, 0.05, false), pairs(4, 6, 0.05, false)}); ok {
		t.Errorf("prefill in proportion to the steps: fitted %.0f tokens/s, want no fit", 1/p)
	}
	if p, ok := fitKind([]spanWork{pairs(5, 3, 0, true)}); ok {
		t.Errorf("three pairs: fitted %.0f tokens/s, want no fit (two slopes need more)", 1/p)
	}
	if p, ok := fitKind([]spanWork{pairs(6, 4, 1.5, true), pairs(7, 4, 1.5, true)}); ok && (p < perToken/2 || p > perToken*2) {
		t.Errorf("noise 1.5x the work: fitted %.0f tokens/s, want no fit or one within 2x", 1/p)
	}
}

// TestFleetAlignKindsFit: two kinds of engine known only by their work between scrapes (no busy interval,
// no response ended: a short run's first seconds) are priced at the prefill speeds that work says, each
// kind its own, where their own estimates are still the prior's.
func TestFleetAlignKindsFit(t *testing.T) {
	const small, large = 16 * 2048, 16 * 16384 // KV cache tokens
	rng := rand.New(rand.NewPCG(9, 9))
	var fl Fleet
	models := make([]*ServiceModel, 4)
	truth := [4]float64{1.0 / 3300, 1.0 / 8000, 1.0 / 3300, 1.0 / 8000}
	geometry := [4]float64{small, large, small, large}
	for i := range models {
		step := 0.030
		if i%2 == 0 {
			step = 0.018
		}
		models[i] = NewServiceModel(Prior)
		for range 6 {
			steps, uncached := 10+40*rng.Float64(), 3000*rng.Float64()
			seconds := (steps*step + uncached*truth[i]) * (0.95 + 0.1*rng.Float64())
			models[i].ObserveSteps(seconds, uncached, steps)
			models[i].ObserveSpan(seconds, uncached, steps)
		}
		fl.Add(models[i].Service(), geometry[i])
	}
	cands := make([]Candidate, 4)
	for i, m := range models {
		cands[i] = Candidate{Service: fl.Blend(m.Service(), geometry[i]), KVCapacity: geometry[i]}
		if got := cands[i].Service.PrefillSecondsPerToken; got != Prior.PrefillSecondsPerToken {
			t.Fatalf("candidate %d's own prefill before Align %.0f tokens/s, want the prior's", i, 1/got)
		}
	}
	fl.Align(cands)
	for i := range cands {
		if r := cands[i].Service.PrefillSecondsPerToken / truth[i]; r < 1/1.3 || r > 1.3 {
			t.Errorf("candidate %d priced to prefill %.0f tokens/s, want %.0f within 30%%", i, 1/cands[i].Service.PrefillSecondsPerToken, 1/truth[i])
		}
	}
	// One kind (every regime of the matrix): the fit is not used, the prior stays.
	var one Fleet
	for i := range models {
		one.Add(models[i].Service(), large)
	}
	same := make([]Candidate, 4)
	for i, m := range models {
		same[i] = Candidate{Service: one.Blend(m.Service(), large), KVCapacity: large}
	}
	one.Align(same)
	for i := range same {
		if r := same[i].Service.PrefillSecondsPerToken / Prior.PrefillSecondsPerToken; r < 0.5 || r > 2 {
			t.Errorf("one kind: candidate %d priced %.2fx the prior's prefill time, want the step factor's scaling only", i, r)
		}
	}
}
