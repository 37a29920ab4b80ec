package caddyllm

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
	"github.com/tokenrouter/caddy-llm/scraper"
)

// TestTokenScaleSamples: the scale is 1 until enough prompt tokens were seen, then the ratio of the
// samples' sums; a sample no tokenizer explains is ignored, and a new ratio takes over as samples of it
// outweigh the old ones.
func TestTokenScaleSamples(t *testing.T) {
	var s tokenScale
	s.add(1330, 1000)
	if got := s.value(); got != 1 {
		t.Errorf("scale after %v policy tokens = %v, want 1 (too few to use)", s.policy, got)
	}
	for range 9 {
		s.add(1330, 1000)
	}
	if got := s.value(); math.Abs(got-1.33) > 1e-9 {
		t.Errorf("scale = %v, want 1.33", got)
	}
	for _, bad := range [][2]float64{{100000, 1000}, {10, 1000}, {0, 1000}, {1000, 0}, {math.Inf(1), 1}, {math.NaN(), 1}} {
		s.add(bad[0], bad[1])
		if got := s.value(); math.Abs(got-1.33) > 1e-9 {
			t.Errorf("after the sample %v: scale %v, want 1.33 kept", bad, got)
		}
	}
	for range 1000 { // 1M tokens of a backend now counting like this proxy
		s.add(1000, 1000)
	}
	if got := s.value(); got > 1.05 {
		t.Errorf("scale after 1M tokens at 1:1 = %v, want near 1", got)
	}
}

// TestTokenScaleFromScrapes follows an upstream's completed requests and its vllm:request_prompt_tokens
// through scrapes: an interval where both counted the same requests teaches the ratio of their prompts;
// one where another client's request finished there too (more finished than this proxy completed), a
// restart (counters back), or an interval the ring of ends no longer covers teaches nothing. The learned
// scale divides the scraped KV capacity and the busy interval's prefill.
func TestTokenScaleFromScrapes(t *testing.T) {
	const dial = "10.0.0.1:8000"
	lt := newTestLoads()
	now := time.Now().UnixNano()
	finished, finishedPrompt := 0.0, 0.0
	// run completes n requests of 1000 tokens by this proxy's count, the backend counting each as
	// backendTokens, and foreign more requests of other clients' finishing there.
	run := func(n, foreign int, backendTokens float64) {
		for range n {
			now += int64(time.Millisecond)
			r := lt.reserve(dial, work{uncached: 1000, prompt: 1000, prediction: prediction{prompt: 1000}}, now)
			now += int64(time.Millisecond)
			r.release(now, true)
			finished++
			finishedPrompt += backendTokens
		}
		finished += float64(foreign)
		finishedPrompt += float64(foreign) * 5000
	}
	snap := func() *scraper.Snapshot {
		now += int64(time.Millisecond)
		return &scraper.Snapshot{At: time.Unix(0, now), FinishedRequests: finished, FinishedPrompt: finishedPrompt,
			BlockSize: 16, NumBlocks: 1000, Running: 1}
	}
	scale := func() float64 {
		l := lt.lookup(dial)
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.tokenScaleLocked()
	}
	viewOf := func(s *scraper.Snapshot) upstreamView { now += int64(time.Millisecond); return lt.view(dial, now, s) }
	view := func() upstreamView { return viewOf(snap()) }

	view() // the first scrape: a baseline
	run(10, 2, 1330)
	view() // another client's requests finished too: skipped
	if got := scale(); got != 1 {
		t.Fatalf("scale after an interval with foreign requests = %v, want 1", got)
	}
	run(10, 0, 1330)
	v := view()
	if got := scale(); math.Abs(got-1.33) > 1e-9 {
		t.Fatalf("scale = %v, want 1.33", got)
	}
	if want := 16000 / 1.33; math.Abs(v.kvCapacity-want) > 1e-6 {
		t.Errorf("KV capacity %v, want %v (16,000 of the backend's tokens)", v.kvCapacity, want)
	}

	finished, finishedPrompt = 0, 0 // the backend restarted: its counters start again
	run(10, 0, 2000)
	view()
	run(10, 0, 2000)
	taken := snap()
	run(100, 0, 2000) // more ends after the scrape than the ring remembers, before a decision reads it
	viewOf(taken)
	if got := scale(); math.Abs(got-1.33) > 1e-9 {
		t.Errorf("scale after a restart and an interval the ring does not cover = %v, want 1.33 kept", got)
	}
	view() // a baseline again
	run(10, 0, 2000)
	view()
	if got := scale(); got <= 1.33 {
		t.Errorf("scale after an interval at 2.0 = %v, want it moved up", got)
	}
}

// TestTokenScaleFromFirstEnds: a scrape taken before the backend finished any request is the baseline
// of the interval its first requests finish in, which teaches the scale at the next scrape.
func TestTokenScaleFromFirstEnds(t *testing.T) {
	const dial = "10.0.0.1:8000"
	lt := newTestLoads()
	now := time.Now().UnixNano()
	view := func(finished, prompt float64) {
		now += int64(time.Millisecond)
		lt.view(dial, now, &scraper.Snapshot{At: time.Unix(0, now), FinishedRequests: finished, FinishedPrompt: prompt,
			BlockSize: 16, NumBlocks: 1000, Running: 1})
	}
	view(0, 0) // a young backend: nothing finished yet
	for range 5 {
		now += int64(time.Millisecond)
		r := lt.reserve(dial, work{uncached: 1000, prompt: 1000, prediction: prediction{prompt: 1000}}, now)
		now += int64(time.Millisecond)
		r.release(now, true)
	}
	view(5, 6700)
	l := lt.lookup(dial)
	l.mu.Lock()
	got := l.tokenScaleLocked()
	l.mu.Unlock()
	if math.Abs(got-1.34) > 1e-9 {
		t.Fatalf("scale after the first requests finished = %v, want 1.34", got)
	}
}

// TestTokenScaleSharedByModel: an upstream that has not learned its own scale takes the one another
// upstream serving the same model learned (the model_name of its metrics), in its KV capacity among the
// rest; one serving another model or none keeps 1, its own scale once learned wins, and forgetting every
// upstream forgets the models' scales too.
func TestTokenScaleSharedByModel(t *testing.T) {
	lt := newTestLoads()
	now := time.Now().UnixNano()
	view := func(dial, model string, finished, prompt float64) upstreamView {
		now += int64(time.Millisecond)
		return lt.view(dial, now, &scraper.Snapshot{At: time.Unix(0, now), FinishedRequests: finished, FinishedPrompt: prompt,
			BlockSize: 16, NumBlocks: 1000, Running: 1, Model: model})
	}
	complete := func(dial string, n int) {
		for range n {
			now += int64(time.Millisecond)
			r := lt.reserve(dial, work{uncached: 1000, prompt: 1000, prediction: prediction{prompt: 1000}}, now)
			now += int64(time.Millisecond)
			r.release(now, true)
		}
	}
	const a, b, c, d = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"
	if v := view(b, "m", 0, 0); v.tokenScale != 1 {
		t.Fatalf("scale with nothing learned anywhere = %v, want 1", v.tokenScale)
	}
	view(a, "m", 0, 0)
	complete(a, 5)
	if v := view(a, "m", 5, 6700); math.Abs(v.tokenScale-1.34) > 1e-9 {
		t.Fatalf("a's own scale = %v, want 1.34", v.tokenScale)
	}
	v := view(b, "m", 0, 0)
	if math.Abs(v.tokenScale-1.34) > 1e-9 || math.Abs(v.kvCapacity-16000/1.34) > 1e-6 {
		t.Errorf("b, serving a's model, learned nothing: scale %v, KV capacity %v; want a's 1.34 and %v", v.tokenScale, v.kvCapacity, 16000/1.34)
	}
	for _, other := range []struct{ dial, model string }{{c, "other"}, {d, ""}} {
		if v := view(other.dial, other.model, 0, 0); v.tokenScale != 1 {
			t.Errorf("upstream serving model %q: scale %v, want 1 (nothing learned for it)", other.model, v.tokenScale)
		}
	}
	complete(b, 5)
	if v := view(b, "m", 5, 5000); math.Abs(v.tokenScale-1) > 1e-9 {
		t.Errorf("b's scale once it learned its own 1.0 = %v, want its own", v.tokenScale)
	}
	if forgot, _ := lt.forget("", now); forgot != 4 {
		t.Fatalf("forgot %d upstreams, want 4", forgot)
	}
	if v := view(c, "m", 0, 0); v.tokenScale != 1 {
		t.Errorf("after forgetting every upstream: scale %v, want 1 (the model's forgotten)", v.tokenScale)
	}
}

// TestTokenScaleFromUsage: a response's usage.prompt_tokens teaches the scale, and a report without it
// teaches nothing; while reports come, scrapes do not count the same requests again.
func TestTokenScaleFromUsage(t *testing.T) {
	const dial = "10.0.0.1:8000"
	lt := newTestLoads()
	now := time.Now().UnixNano()
	for range 10 {
		r := lt.reserve(dial, work{uncached: 1000, prompt: 1000, prediction: prediction{prompt: 1000}}, now)
		r.observeCached(0, 0) // no prompt_tokens in the usage
		r.release(now, true)
	}
	l := lt.lookup(dial)
	if l.scale.policy != 0 {
		t.Fatalf("reports without prompt_tokens taught %v tokens", l.scale.policy)
	}
	for range 10 {
		r := lt.reserve(dial, work{uncached: 1000, prompt: 1000, prediction: prediction{prompt: 1000}}, now)
		r.observeCached(1200, 0)
		r.release(now, true)
	}
	if got := l.scale.value(); math.Abs(got-1.2) > 1e-9 {
		t.Errorf("scale from usage = %v, want 1.2", got)
	}
	observed := l.observed.prompt.Load()
	l.scale.fromScrape(&scraper.Snapshot{FinishedRequests: 20, FinishedPrompt: 22000}, 20, 20000, true, observed-1)
	l.scale.fromScrape(&scraper.Snapshot{FinishedRequests: 40, FinishedPrompt: 80000}, 40, 40000, true, observed)
	if got := l.scale.value(); math.Abs(got-1.2) > 1e-9 {
		t.Errorf("scale after scrapes spanning usage reports = %v, want 1.2 (the reports' alone)", got)
	}
}

// TestTokenScaleLearnedThroughCaddy: behind a real Caddy, a bare lb_policy llm in front of a simulated
// vLLM or SGLang (which counts a prompt in 4-byte pieces, not as cl100k does) learns the simulator's
// tokens per policy token from its finished requests' prompt tokens (vLLM's vllm:request_prompt_tokens,
// SGLang's sglang:num_requests_total and sglang:prompt_tokens_total), and reports it in /llm/upstreams
// and as a gauge.
func TestTokenScaleLearnedThroughCaddy(t *testing.T) {
	for _, flavour := range []string{vllmsim.MetricsVLLM, vllmsim.MetricsSGLang} {
		t.Run(flavour, func(t *testing.T) { tokenScaleLearnedThroughCaddy(t, flavour) })
	}
}

func tokenScaleLearnedThroughCaddy(t *testing.T, flavour string) {
	sim, dial := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 1, Metrics: flavour})
	tester := caddytest.NewTester(t)
	tester.InitServer(fastScrapeConfig(dial, "header_down X-Prompt-Tokens {http.llm.prompt_tokens}"), "caddyfile")
	if got := adminUpstreams(t)[dial].Model; got != nil && got.TokenScale != 1 {
		t.Fatalf("token scale before any request = %v, want 1", got.TokenScale)
	}
	var simTokens, policyTokens int
	for i := range 12 {
		body := chatBody("sim-model", 1000+10*i, false)
		res, got := post(t, tester.Client, "/v1/chat/completions", body)
		if res.StatusCode != http.StatusOK {
			t.Fatalf("request %d: status %d: %s", i, res.StatusCode, got)
		}
		n, err := strconv.Atoi(res.Header.Get("X-Prompt-Tokens"))
		p, _, err2 := sim.Cached([]byte(body))
		if err != nil || err2 != nil || n == 0 {
			t.Fatalf("prompt tokens: policy %q (%v), simulator %d (%v)", res.Header.Get("X-Prompt-Tokens"), err, p, err2)
		}
		policyTokens += n
		simTokens += p
		time.Sleep(30 * time.Millisecond) // a scrape between requests: each interval counts them exactly
	}
	want := float64(simTokens) / float64(policyTokens)
	if math.Abs(want-1) < 0.1 {
		t.Fatalf("the simulator counts like the policy (%v): the test shows nothing", want)
	}
	var scale float64
	waitFor(t, "the token scale learned", func() bool {
		if m := adminUpstreams(t)[dial].Model; m != nil {
			scale = m.TokenScale
		}
		return math.Abs(scale-want) < 0.02*want
	})
	_, metrics := doRequest(t, http.MethodGet, adminURL+"/metrics")
	if line := fmt.Sprintf("caddy_llm_upstream_token_scale{upstream=%q} ", dial); !strings.Contains(metrics, line) {
		t.Errorf("/metrics lacks %s", line)
	}
}
