package caddyllm

import (
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
	"github.com/tokenrouter/caddy-llm/scraper"
)

// TestEnginePrefill follows an engine's prefill-time and computed-tokens histograms through scrapes:
// the first scrape is a baseline; an interval with requests finished adds its tokens and seconds, one
// without, or whose counters went back (a restart), adds nothing; the speed is reported once eight
// requests are counted, in this proxy's tokens, and older intervals weigh less as requests finish.
func TestEnginePrefill(t *testing.T) {
	var e enginePrefill
	at := time.Now()
	scrape := func(n, secs, tokens float64) {
		at = at.Add(100 * time.Millisecond)
		e.fromScrape(&scraper.Snapshot{At: at, PrefillRequests: n, PrefillSeconds: secs, PrefillComputed: tokens})
	}
	scrape(100, 50, 1e6) // a backend that has run a while: its history is no sample
	scrape(104, 51, 1e6+2000)
	if got := e.tokensPerSecond(1); got != 0 {
		t.Errorf("speed from 4 requests = %v, want 0 (too few)", got)
	}
	scrape(104, 51, 1e6+2000) // nothing finished
	scrape(108, 52, 1e6+4000)
	if got := e.tokensPerSecond(1); math.Abs(got-2000) > 1e-6 {
		t.Errorf("speed = %v, want 2000", got)
	}
	if got := e.tokensPerSecond(1.25); math.Abs(got-1600) > 1e-6 {
		t.Errorf("speed at scale 1.25 = %v, want 1600 of this proxy's tokens", got)
	}
	scrape(3, 1, 500) // restarted: counters back, a baseline again
	if got := e.tokensPerSecond(1); math.Abs(got-2000) > 1e-6 {
		t.Errorf("speed after a restart = %v, want 2000 kept", got)
	}
	for range 50 { // the engine slowed down to 500 tokens/s
		n := e.fromRequests
		scrape(n+4, e.fromSeconds+4, e.fromTokens+2000)
	}
	if got := e.tokensPerSecond(1); got > 600 {
		t.Errorf("speed after 200 requests at 500 tokens/s = %v, want near 500", got)
	}
}

// TestEnginePrefillReported: through Caddy, a vLLM backend's own prefill histograms, scraped, give
// /llm/upstreams its prefill speed: distinct prompts sent one after another (no two prefilling in one
// step, none cached) on a simulator prefilling 4,000 tokens a second report at most that, and not far
// below it (each prefill also takes a step's fixed time); the same figure is a gauge in /metrics.
func TestEnginePrefillReported(t *testing.T) {
	_, b := simBackend(t, vllmsim.Config{TimeScale: 1, PrefillTokensPerSec: 4000, Seed: 3, Metrics: vllmsim.MetricsVLLM})
	tester := scrapedPair(t, b, "", "interval 100ms", "stale_after 30s")
	for i := range 10 {
		body := fmt.Sprintf(`{"model":"sim-model","max_tokens":2,"messages":[{"role":"user","content":"%d %s"}]}`, i, strings.Repeat("hello ", 400))
		res, _ := post(t, tester.Client, "/v1/chat/completions", body) // resent if the previous config's server reset it
		if res.StatusCode != http.StatusOK {
			t.Fatalf("status %d", res.StatusCode)
		}
	}
	var m *serviceModel
	waitFor(t, "the backend's prefill speed reported", func() bool {
		m = adminUpstreams(t)[b].Model
		return m != nil && m.EnginePrefillTokensPerSecond > 0
	})
	if got := m.EnginePrefillTokensPerSecond * m.TokenScale; got > 4000*1.01 || got < 4000*0.6 {
		t.Errorf("engine prefill %v of the backend's tokens a second (%v of the proxy's at scale %v), want 2,400-4,000",
			got, m.EnginePrefillTokensPerSecond, m.TokenScale)
	}
	if _, metrics := doRequest(t, http.MethodGet, adminURL+"/metrics"); !strings.Contains(metrics, fmt.Sprintf(`caddy_llm_upstream_engine_prefill_tokens_per_second{upstream=%q} `, b)) {
		t.Errorf("/metrics lacks caddy_llm_upstream_engine_prefill_tokens_per_second for %s", b)
	}
}
