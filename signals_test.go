package caddyllm

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
)

// simBackend serves a simulated vLLM engine on 127.0.0.1.
func simBackend(t *testing.T, cfg vllmsim.Config) (*vllmsim.Server, string) {
	t.Helper()
	sim, srv := simServer(t, cfg, false, nil)
	return sim, srv.Listener.Addr().String()
}

// simServer serves a simulated vLLM engine on 127.0.0.1, over TLS when withTLS, through the handler
// front makes of it (the engine itself when front is nil); both stop when the test ends.
func simServer(t *testing.T, cfg vllmsim.Config, withTLS bool, front func(*vllmsim.Server) http.Handler) (*vllmsim.Server, *httptest.Server) {
	t.Helper()
	sim, err := vllmsim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var h http.Handler = sim
	if front != nil {
		h = front(sim)
	}
	srv := httptest.NewUnstartedServer(h)
	if withTLS {
		srv.StartTLS()
	} else {
		srv.Start()
	}
	freshUpstream(srv.Listener.Addr().String())
	t.Cleanup(func() {
		srv.CloseClientConnections()
		sim.Close()
		srv.Close()
	})
	return sim, srv
}

// freshUpstream forgets what the process-wide load table kept of dial, for a test's new server there:
// the kernel may give it the port of an earlier test's server, whose requests, learned service model
// and scrape baselines would be taken for this one's (a likely cause of a wait for exactly n observed
// usages that timed out in CI). Every test server constructor calls it before any config routes there.
// The token scales learned per model go too: every simulator serves "sim-model", and a new upstream
// takes the scale an earlier test's upstream learned for it (TestTokenScaleLearnedThroughCaddy read
// 1.58 before its first request, when another test had run before it).
func freshUpstream(dial string) {
	loads.forget(dial, time.Now().UnixNano())
	loads.scales.clear()
}

// adminUpstreams reads GET /llm/upstreams of the in-process Caddy.
func adminUpstreams(t *testing.T) map[string]upstreamStatus {
	t.Helper()
	return adminUpstreamsAt(t, adminURL)
}

// adminUpstreamsAt reads GET /llm/upstreams from the admin API at admin.
func adminUpstreamsAt(t *testing.T, admin string) map[string]upstreamStatus {
	t.Helper()
	res, err := http.Get(admin + "/llm/upstreams")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var report struct {
		Upstreams []upstreamStatus `json:"upstreams"`
		Routes    routesReport     `json:"routes"`
	}
	if err := json.NewDecoder(res.Body).Decode(&report); err != nil {
		t.Fatalf("decoding /llm/upstreams: %v", err)
	}
	out := make(map[string]upstreamStatus)
	for _, u := range report.Upstreams {
		out[u.Upstream] = u
	}
	return out
}

// waitFor polls cond (boundedly) until it holds.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// sendCounting sends a chat request through the proxy and returns which sim answered (by the sims'
// request counters before and after).
func sendCounting(t *testing.T, client *http.Client, body string, sims map[string]*vllmsim.Server, headers ...string) string {
	t.Helper()
	before := make(map[string]int64)
	for dial, s := range sims {
		before[dial] = s.State().Requests
	}
	res, got := post(t, client, "/v1/chat/completions", body, headers...)
	if res.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", res.StatusCode, got)
	}
	for dial, s := range sims {
		if s.State().Requests > before[dial] {
			return dial
		}
	}
	t.Fatal("no simulated backend counted the request")
	return ""
}

// fastAndSlow starts two simulated backends: a, fast, and b, with one slot and a decode step of step in
// real time.
func fastAndSlow(t *testing.T, step time.Duration) (a, b string, sims map[string]*vllmsim.Server) {
	return fastAndSlowServing(t, step, vllmsim.MetricsVLLM)
}

// fastAndSlowServing is fastAndSlow with both backends' metrics in the given flavour.
func fastAndSlowServing(t *testing.T, step time.Duration, metrics string) (a, b string, sims map[string]*vllmsim.Server) {
	simA, a := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 1, Metrics: metrics})
	simB, b := simBackend(t, vllmsim.Config{TimeScale: 1, MaxNumSeqs: 1, DecodeStep: step, Seed: 2, Metrics: metrics})
	return a, b, map[string]*vllmsim.Server{a: simA, b: simB}
}

// loadDirectly sends n requests straight to the simulated backend at dial, not through Caddy (another
// client), each generating 1,000 tokens; they are cancelled when the test ends.
func loadDirectly(t *testing.T, dial string, n int) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+dial+"/v1/chat/completions",
				strings.NewReader(`{"model":"sim-model","max_tokens":1000,"messages":[{"role":"user","content":"hold"}]}`))
			if res, err := http.DefaultClient.Do(req); err == nil {
				io.Copy(io.Discard, res.Body)
				res.Body.Close()
			}
		}()
	}
}

// sendAllTo sends n chat requests through the proxy and fails unless every one went to want.
func sendAllTo(t *testing.T, client *http.Client, sims map[string]*vllmsim.Server, want string, n int) {
	t.Helper()
	for i := range n {
		if got := sendCounting(t, client, chatBody("sim-model", 10+i, false), sims); got != want {
			t.Fatalf("request %d went to %s, not %s", i, got, want)
		}
	}
}

// TestScrapedQueueSteersRequests: a backend loaded from outside Caddy (as if by another proxy) shows a
// long waiting queue in its /metrics; with metrics scraping on, new requests go to the other backend.
func TestScrapedQueueSteersRequests(t *testing.T) {
	a, b, sims := fastAndSlow(t, time.Second)

	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy %s %s {
		lb_policy llm {
			mode least_tokens
			metrics {
				interval 200ms
				# A scrape slower than the interval fails; on a loaded machine (-race, the whole package
				# at once) a few in a row made B's snapshot stale within the default 1s, its queue was
				# no longer counted, and a request went there to wait behind it.
				stale_after 30s
			}
		}
	}
}
`, site, a, b), "caddyfile")

	// The first request starts scraping both upstreams (one output token: it may land on the slow one).
	sendCounting(t, tester.Client, strings.Replace(chatBody("sim-model", 10, false), `"max_tokens":16`, `"max_tokens":1`, 1), sims)
	waitFor(t, "both upstreams scraped", func() bool {
		ups := adminUpstreams(t)
		t.Logf("A %+v B %+v", ups[a].Metrics, ups[b].Metrics)
		return ups[a].Metrics != nil && ups[a].Metrics.Fresh && ups[b].Metrics != nil && ups[b].Metrics.Fresh
	})

	// Another client loads B directly: one request running, four waiting.
	loadDirectly(t, b, 5)
	waitFor(t, "the scraped queue on B", func() bool {
		m := adminUpstreams(t)[b].Metrics
		return m != nil && m.Fresh && m.Waiting >= 4
	})

	sendAllTo(t, tester.Client, sims, a, 10)
}

// TestOpenCeilingBringsScrapeForward: a scrape that shows requests waiting at the most an upstream has
// been seen running, its slot count not yet likely, has the decisions of a hot prefix (which would price
// a likely slot count, fullNow) bring the next scrape forward (a fifth of the interval) rather than
// wait a whole interval to confirm it. B runs one request with four waiting, loaded by another client
// before Caddy starts; the interval is 10s, every request carries one system prompt, and the second
// scrape of B comes within 6s.
func TestOpenCeilingBringsScrapeForward(t *testing.T) {
	a, b, sims := fastAndSlow(t, 300*time.Millisecond)
	loadDirectly(t, b, 5)
	waitFor(t, "B loaded", func() bool { s := sims[b].State(); return s.Running == 1 && s.Waiting == 4 })

	tester := scrapedPair(t, a, b, "interval 10s", "stale_after 60s")

	var first time.Time // when B's first scrape was seen, about its age ago
	waitFor(t, "B's first scrape", func() bool {
		m := adminUpstreams(t)[b].Metrics
		if m == nil || !m.Fresh || m.Waiting != 4 {
			return false
		}
		first = time.Now().Add(-time.Duration(m.AgeSeconds * float64(time.Second)))
		return true
	})
	deadline := first.Add(6 * time.Second) // the interval's tick comes at 10s
	system := strings.TrimSpace(strings.Repeat("You answer briefly and in English. ", 40))
	for i := 0; ; i++ {
		body := fmt.Sprintf(`{"model":"sim-model","max_tokens":1,"messages":[{"role":"system","content":%q},{"role":"user","content":"question %d"}]}`, system, i)
		sendCounting(t, tester.Client, body, sims) // a decision reads B's scrape
		m := adminUpstreams(t)[b].Metrics
		scraped := time.Now().Add(-time.Duration(m.AgeSeconds * float64(time.Second)))
		if scraped.Sub(first) > 500*time.Millisecond {
			if n := m.BroughtForward; n == 0 {
				t.Errorf("B scraped again %v after its first, but brought_forward = 0", scraped.Sub(first))
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no second scrape of B within 6s of its first, with an interval of 10s and its ceiling open")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestScrapesTeachWhileIdle: every scrape teaches the service model as it arrives, not only the ones a
// decision happens to read. Another client keeps backend B full (one slot, four waiting) while this
// proxy routes nothing; B's slot count is learned from its metrics alone, and the first requests, in the
// default mode (where a cache claim could otherwise draw one to B, its wait not yet priced), all go to A.
// So for every kind of server the scraper reads: vLLM, SGLang, llama.cpp's llama-server (busy slots and
// deferred requests), NVIDIA NIM (which reports its slot count outright) and TGI (its batch and queue).
func TestScrapesTeachWhileIdle(t *testing.T) {
	for _, flavour := range []string{vllmsim.MetricsVLLM, vllmsim.MetricsSGLang, vllmsim.MetricsLlamaCpp, vllmsim.MetricsNIM, vllmsim.MetricsTGI} {
		t.Run(flavour, func(t *testing.T) {
			a, b, sims := fastAndSlowServing(t, 300*time.Millisecond, flavour)

			tester := scrapedPair(t, a, b, "interval 100ms", "stale_after 30s")

			loadDirectly(t, b, 5)
			waitFor(t, "B's queue scraped and its slot count learned from its scrapes alone", func() bool {
				// The queue too: NIM reports its slot count from the first scrape, before one shows it.
				u := adminUpstreams(t)[b]
				return u.Metrics != nil && u.Metrics.Flavor == flavour && u.Metrics.Waiting == 4 &&
					u.Model != nil && u.Model.Slots == 1
			})
			if n := sims[a].State().Requests + sims[b].State().Requests; n != 5 {
				t.Fatalf("the backends saw %d requests before any was sent through the proxy, want the other client's 5", n)
			}
			noKV := flavour == vllmsim.MetricsLlamaCpp || flavour == vllmsim.MetricsTGI
			if kv := adminUpstreams(t)[b].Metrics.KVUsage; (kv == nil) != noKV {
				t.Errorf("kv_cache_usage %v: want it absent exactly where the server reports none (llama.cpp, TGI)", kv)
			}
			sendAllTo(t, tester.Client, sims, a, 10)
		})
	}
}

// TestAdminEndpointAndMetrics: GET /llm/upstreams shows in-flight work and learned routes, DELETE
// /llm/upstreams forgets what was learned of upstreams with nothing in flight, DELETE /llm/routes
// clears the routes, and the Prometheus metrics are on Caddy's /metrics.
func TestAdminEndpointAndMetrics(t *testing.T) {
	a, b := newBackend(t), newBackend(t)
	hold := make(chan struct{})
	a.hold, b.hold = hold, hold
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm", "", a, b), "caddyfile")

	done := make(chan struct{})
	go func() {
		defer close(done)
		post(t, tester.Client, "/v1/chat/completions", chatBody("m", 500, false))
	}()
	dial := <-a.arrivedOrB(b)
	ups := adminUpstreams(t)
	if got := ups[dial]; got.InflightRequests != 1 || got.InflightTokens < 500 {
		t.Errorf("/llm/upstreams for %s = %+v, want 1 request of >= 500 tokens in flight", dial, got)
	}
	if got := ups[dial].Routes; got == nil || *got == 0 {
		t.Errorf("/llm/upstreams shows no learned routes for %s", dial)
	}
	// The request's body is held in a pooled buffer while it is in flight, and released after.
	body := len(chatBody("m", 500, false))
	heldInFlight := metricValue(t, "caddy_llm_request_body_bytes_held")
	if heldInFlight < float64(body) {
		t.Errorf("caddy_llm_request_body_bytes_held = %v while a %d-byte body is in flight", heldInFlight, body)
	}
	// DELETE /llm/upstreams forgets nothing of an upstream with a request in flight: its reservation is
	// released where it was counted.
	if res, got := doRequest(t, http.MethodDelete, adminURL+"/llm/upstreams"); res.StatusCode != http.StatusOK || !strings.Contains(got, `"kept_in_flight": `) || strings.Contains(got, `"kept_in_flight": 0`) {
		t.Errorf("DELETE /llm/upstreams with a request in flight = %d %s, want 200 keeping it", res.StatusCode, got)
	}
	if got := adminUpstreams(t)[dial]; got.InflightRequests != 1 {
		t.Errorf("after DELETE /llm/upstreams: %+v, want its request still in flight", got)
	}
	close(hold)
	<-done
	waitInflightZero(t, a.dial, b.dial)
	// The request's end taught its mean duration; forgotten, the upstream is back at its prior's.
	learned := *adminUpstreams(t)[dial].Model
	// The decision priced it: reported beside the learned model, and as gauges.
	if p := adminUpstreams(t)[dial].Priced; p == nil || !(p.PrefillTokensPerSecond > 0) {
		t.Errorf("after a decision weighed %s: priced %+v, want its priced speeds", dial, p)
	}
	if _, metrics := doRequest(t, http.MethodGet, adminURL+"/metrics"); !strings.Contains(metrics, fmt.Sprintf(`caddy_llm_upstream_priced_prefill_tokens_per_second{upstream=%q} `, dial)) {
		t.Errorf("/metrics lacks caddy_llm_upstream_priced_prefill_tokens_per_second for %s", dial)
	}
	other := a.dial
	if other == dial {
		other = b.dial
	}
	// ?upstream= forgets that upstream only. The other one took no request: it has state only if a
	// scrape of it arrived (404 otherwise); either way dial keeps what it learned.
	if res, got := doRequest(t, http.MethodDelete, adminURL+"/llm/upstreams?upstream="+other); res.StatusCode != http.StatusOK && res.StatusCode != http.StatusNotFound {
		t.Errorf("DELETE /llm/upstreams?upstream=%s = %d %s", other, res.StatusCode, got)
	}
	if got := adminUpstreams(t)[dial].Model; got == nil || got.MeanDurationSeconds != learned.MeanDurationSeconds {
		t.Errorf("forgetting %s changed %s's model: %+v, was %+v", other, dial, got, learned)
	}
	if res, got := doRequest(t, http.MethodDelete, adminURL+"/llm/upstreams?upstream="+dial); res.StatusCode != http.StatusOK || !strings.Contains(got, `"forgotten": 1,`) {
		t.Errorf("DELETE /llm/upstreams?upstream=%s = %d %s, want 200 with it forgotten", dial, res.StatusCode, got)
	}
	// An address the plugin keeps nothing of is a 404 naming it, not a 200 that forgot nothing.
	if res, got := doRequest(t, http.MethodDelete, adminURL+"/llm/upstreams?upstream=127.0.0.1:1"); res.StatusCode != http.StatusNotFound || !strings.Contains(got, "127.0.0.1:1") {
		t.Errorf("DELETE /llm/upstreams?upstream=127.0.0.1:1 (never used) = %d %s, want 404 naming it", res.StatusCode, got)
	}
	prior := reportService(&upstreamInflight{Service: selection.Prior, Overrun: 1}).MeanDurationSeconds
	if got := adminUpstreams(t)[dial].Model; got == nil || learned.MeanDurationSeconds == prior || got.MeanDurationSeconds != prior {
		t.Errorf("mean request seconds %v learned, %+v after DELETE /llm/upstreams; want the prior's %v again", learned.MeanDurationSeconds, got, prior)
	}
	if p := adminUpstreams(t)[dial].Priced; p != nil {
		t.Errorf("after DELETE /llm/upstreams: priced %+v kept, want it forgotten with the model until a decision prices it again", *p)
	}
	deadline := time.Now().Add(5 * time.Second)
	for metricValue(t, "caddy_llm_request_body_bytes_held") > heldInFlight-float64(body) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := metricValue(t, "caddy_llm_request_body_bytes_held"); got > heldInFlight-float64(body) {
		t.Errorf("caddy_llm_request_body_bytes_held = %v after the request ended, want at most %v", got, heldInFlight-float64(body))
	}
	if got := metricValue(t, "caddy_llm_request_bodies_total"); got < 1 {
		t.Errorf("caddy_llm_request_bodies_total = %v after a request, want at least 1", got)
	}

	res, got := doRequest(t, http.MethodDelete, adminURL+"/llm/routes")
	if res.StatusCode != http.StatusOK || !strings.Contains(got, `"routes": 0`) {
		t.Errorf("DELETE /llm/routes = %d %s, want 200 with no routes left", res.StatusCode, got)
	}
	if res, _ := doRequest(t, http.MethodPost, adminURL+"/llm/upstreams"); res.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /llm/upstreams = %d, want 405", res.StatusCode)
	}

	_, metrics := doRequest(t, http.MethodGet, adminURL+"/metrics")
	for _, want := range []string{
		`caddy_llm_decisions_total{reason="`,
		`caddy_llm_prompt_tokens_bucket`,
		`caddy_llm_tokenize_seconds_bucket`,
		fmt.Sprintf(`caddy_llm_upstream_inflight_tokens{upstream=%q} 0`, dial),
		`caddy_llm_routes 0`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// metricValue is the value of an unlabelled metric on Caddy's /metrics (the test fails when it is absent).
func metricValue(t *testing.T, name string) float64 {
	t.Helper()
	_, metrics := doRequest(t, http.MethodGet, adminURL+"/metrics")
	for _, line := range strings.Split(metrics, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("/metrics: %s", line)
			}
			return f
		}
	}
	t.Fatalf("/metrics lacks %s", name)
	return 0
}

func doRequest(t *testing.T, method, url string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, nil)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	return res, string(body)
}

// TestRoutesSurviveReload: prefixes learned before a config reload (POST /load) send the same prompts to
// the same upstreams after it.
func TestRoutesSurviveReload(t *testing.T) {
	sims := make(map[string]*vllmsim.Server)
	var dials []string
	for i := range 3 {
		sim, dial := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: int64(i)})
		sims[dial] = sim
		dials = append(dials, dial)
	}
	config := func(mode string) string {
		return globalOptions + fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy llm {
			mode %s
		}
	}
}
`, site, strings.Join(dials, " "), mode)
	}
	tester := caddytest.NewTester(t)
	tester.InitServer(config("prefix"), "caddyfile")

	// Twelve conversations, each with its own long system prompt.
	prompt := func(i, turn int) string {
		system := fmt.Sprintf("conversation %d. %s", i, strings.Repeat(fmt.Sprintf("rule %d applies. ", i), 150))
		return fmt.Sprintf(`{"model":"sim-model","max_tokens":4,"messages":[{"role":"system","content":%q},{"role":"user","content":"turn %d"}]}`, system, turn)
	}
	first := make([]string, 12)
	for i := range first {
		first[i] = sendCounting(t, tester.Client, prompt(i, 0), sims)
	}
	spread := map[string]bool{}
	for _, d := range first {
		spread[d] = true
	}
	if len(spread) < 2 {
		t.Fatalf("12 new prefixes all went to one upstream: %v", first)
	}

	tester.InitServer(config("combined"), "caddyfile")
	// The reload closed the old server's keep-alive connections; Go does not retry a POST on one.
	tester.Client.Transport.(*http.Transport).CloseIdleConnections()
	for i := range first {
		if got := sendCounting(t, tester.Client, prompt(i, 1), sims); got != first[i] {
			t.Errorf("conversation %d went to %s before the reload and %s after", i, first[i], got)
		}
	}
}

// TestSaturatedUpstreamIsAvoided: an upstream that answers 429 is retried elsewhere and then avoided for
// the backoff, while its learned routes stay.
func TestSaturatedUpstreamIsAvoided(t *testing.T) {
	a, b := newBackend(t), newBackend(t)
	// Saturation is process-global by dial address, and a port can be reused by a later test run.
	for _, d := range []string{a.dial, b.dial} {
		loads.saturate(d, time.Time{})
	}
	a.handle = func(w http.ResponseWriter, r *http.Request, _ []byte) {
		http.Error(w, `{"error":{"message":"queue full"}}`, http.StatusTooManyRequests)
	}
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm {\n\t\t\tmode least_tokens\n\t\t\tsaturation_backoff 1m\n\t\t}",
		"lb_retries 1\n\t\tlb_retry_match {\n\t\t\texpression `{rp.status_code} == 429`\n\t\t}", a, b), "caddyfile")

	send := func(i int) {
		res, got := post(t, tester.Client, "/v1/chat/completions", chatBody("m", 20+i, false))
		if res.StatusCode != http.StatusOK {
			t.Fatalf("request %d: status %d %s (the 429 was not retried on the other upstream)", i, res.StatusCode, got)
		}
	}
	// Idle upstreams tie, and ties are broken at random: send until A has been tried once.
	for i := 0; a.requests.Load() == 0; i++ {
		if i == 60 {
			t.Fatal("60 requests and none tried the first upstream")
		}
		send(i)
	}
	if !adminUpstreams(t)[a.dial].Saturated {
		t.Errorf("/llm/upstreams does not show %s saturated after its 429", a.dial)
	}
	for i := range 20 {
		send(100 + i)
	}
	if n := a.requests.Load(); n != 1 {
		t.Errorf("the saturated upstream got %d requests, want only the first", n)
	}
	waitInflightZero(t, a.dial, b.dial)
}

// TestHangingMetricsDoNotBlockRouting: a backend whose /metrics never answers does not hold up routing.
// The scrape's timeout (30 s) outlasts the test, so every request below is routed while the first
// scrape of that backend is still pending: Select reads the last snapshot and never waits for I/O.
func TestHangingMetricsDoNotBlockRouting(t *testing.T) {
	release := make(chan struct{})
	hanging := newBackend(t)
	hanging.handle = nil
	metricsServer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			select {
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		hanging.serve(w, r)
	}))
	defer metricsServer.Close()
	defer close(release) // before Close, which waits for the hanging scrape
	dial := strings.TrimPrefix(metricsServer.URL, "http://")
	other := newBackend(t)

	tester := scrapedPair(t, dial, other.dial, "interval 30s", "timeout 30s")

	for i := range 20 {
		res, got := post(t, tester.Client, "/v1/chat/completions", chatBody("m", 10+i, false))
		if res.StatusCode != http.StatusOK {
			t.Fatalf("request %d: status %d %s", i, res.StatusCode, got)
		}
	}
	if hanging.requests.Load() == 0 {
		t.Errorf("no request reached the backend whose metrics hang: it should be routed by local counters")
	}
	m := adminUpstreams(t)[dial].Metrics
	if m == nil || m.AgeSeconds != -1 || m.Errors != 0 {
		t.Errorf("metrics of the hanging backend = %+v, want a scrape still pending (no good scrape, no error yet)", m)
	}
	tester.Client.Transport.(*http.Transport).CloseIdleConnections()
}

// TestBarePolicyScrapesFromProvision: a bare `lb_policy llm` scrapes every configured upstream from the
// moment it is provisioned (before any request) and reports it in /llm/upstreams with its metrics; an
// upstream without usable metrics (a generic OpenAI-compatible server: /metrics is 404) is dropped from
// scraping, logged once, and still routed to. Issue 13 item 5; issue 9 item 4.
func TestBarePolicyScrapesFromProvision(t *testing.T) {
	_, a := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 1})
	plain := newBackend(t) // answers /metrics with 404
	tester := scrapedPair(t, a, plain.dial, "interval 50ms")

	waitFor(t, "the simulator scraped before any request", func() bool {
		m := adminUpstreams(t)[a].Metrics
		return m != nil && m.Fresh && m.Flavor == "vllm"
	})
	waitFor(t, "the upstream without metrics dropped from scraping", func() bool {
		u, listed := adminUpstreams(t)[plain.dial]
		return listed && u.Metrics == nil
	})
	if n := plain.requests.Load(); n != 0 {
		t.Errorf("the plain backend counted %d requests before any was sent", n)
	}
	// Both are still routed to: the plain one on this proxy's own signals.
	seen := map[bool]bool{}
	for i := range 40 {
		res, body := post(t, tester.Client, "/v1/chat/completions", chatBody("sim-model", 20+i, false))
		if res.StatusCode != http.StatusOK {
			t.Fatalf("request %d: status %d: %s", i, res.StatusCode, body)
		}
		seen[strings.Contains(body, plain.dial)] = true
	}
	if !seen[true] || !seen[false] {
		t.Errorf("40 requests used only one of the two upstreams (plain backend used: %v)", seen)
	}
}

// TestMetricsOff: `metrics off` scrapes nothing.
func TestMetricsOff(t *testing.T) {
	metricsHits := make(chan struct{}, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			metricsHits <- struct{}{}
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","object":"chat.completion"}`)
	}))
	t.Cleanup(srv.Close)
	dial := strings.TrimPrefix(srv.URL, "http://")
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy llm {
			metrics off
		}
	}
}
`, site, dial), "caddyfile")
	res, body := post(t, tester.Client, "/v1/chat/completions", chatBody("m", 10, false))
	if res.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", res.StatusCode, body)
	}
	if u := adminUpstreams(t)[dial]; u.Metrics != nil {
		t.Errorf("metrics off, yet /llm/upstreams shows scraped metrics: %+v", u.Metrics)
	}
	select {
	case <-metricsHits:
		t.Error("metrics off, yet /metrics was requested")
	default:
	}
}

// TestFallbackCounted: requests to an LLM endpoint that the policy cannot read are routed by the
// fallback and counted in caddy_llm_decisions_total{reason="fallback"}: a form-encoded body that is no
// OpenAI request (curl -d), and malformed JSON. Issue 13 item 10 (the form-encoded one was not counted).
func TestFallbackCounted(t *testing.T) {
	a := newBackend(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm", "", a), "caddyfile")
	for _, tc := range []struct{ name, contentType, body string }{
		{"form-encoded text", "application/x-www-form-urlencoded", "hello there"},
		{"malformed JSON", "application/json", `{"model":"m","messages":[`},
	} {
		before := testutil.ToFloat64(fallbackDecisions)
		req, _ := http.NewRequest(http.MethodPost, "http://localhost"+site+"/v1/chat/completions", strings.NewReader(tc.body))
		req.Header.Set("Content-Type", tc.contentType)
		res, err := doReloadSafe(tester.Client, req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, res.Body)
		res.Body.Close()
		if got := testutil.ToFloat64(fallbackDecisions) - before; got != 1 {
			t.Errorf("%s: fallback decisions counted %v, want 1", tc.name, got)
		}
	}
}

// TestScrapeErrorAgeInAdmin: /llm/upstreams gives the time since an upstream's last failed scrape, so an
// operator tells a failure that is over (the backend answers its metrics again; the error is older than
// the snapshot) from one that is not.
func TestScrapeErrorAgeInAdmin(t *testing.T) {
	// The metrics answer first: an upstream whose metrics never answered is taken after a few failed
	// scrapes for one without usable metrics and no longer scraped (checkUsable), and on a busy machine
	// the failures below could outnumber the admin polls that see them.
	sim, dial := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 1})
	tester := caddytest.NewTester(t)
	tester.InitServer(fastScrapeConfig(dial, ""), "caddyfile")
	post(t, tester.Client, "/v1/chat/completions", chatBody("sim-model", 10, false)) // starts the scrapes
	waitFor(t, "a good scrape", func() bool {
		m := adminUpstreams(t)[dial].Metrics
		return m != nil && m.Fresh
	})
	sim.SetFaults(vllmsim.Faults{MetricsFail: true})
	waitFor(t, "a failed scrape", func() bool {
		m := adminUpstreams(t)[dial].Metrics
		return m != nil && m.Errors > 0 && m.LastError != "" && m.LastErrorAgeSeconds != nil
	})
	sim.SetFaults(vllmsim.Faults{}) // the metrics answer again
	waitFor(t, "a good scrape after the failure", func() bool {
		m := adminUpstreams(t)[dial].Metrics
		return m != nil && m.Fresh && m.AgeSeconds >= 0 && m.LastErrorAgeSeconds != nil && *m.LastErrorAgeSeconds > m.AgeSeconds
	})
}

// fastScrapeConfig is a site proxying to dial with a bare lb_policy llm that scrapes every 20 ms, and
// extra lines (directives) inside reverse_proxy.
func fastScrapeConfig(dial, extra string) string {
	return globalOptions + fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy llm {
			metrics {
				interval 20ms
			}
		}
		%s
	}
}
`, site, dial, extra)
}

// TestScrapesUseUpstreamTLS: behind a reverse_proxy whose transport speaks TLS to its upstreams (here
// with a private CA in its trust pool), the metrics are scraped over https with the same settings; with
// the scheme left to its default, plain http met a TLS server and the upstream was taken for one
// without usable metrics.
func TestScrapesUseUpstreamTLS(t *testing.T) {
	for _, transport := range []string{"http", "llm"} {
		t.Run(transport, func(t *testing.T) {
			_, srv := simServer(t, vllmsim.Config{TimeScale: 1000, Seed: 1}, true, nil)
			dial := srv.Listener.Addr().String()
			ca := filepath.Join(t.TempDir(), "ca.pem")
			if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
				t.Fatal(err)
			}

			tester := caddytest.NewTester(t)
			tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy https://%s {
		transport %s {
			tls_trust_pool file %s
		}
		lb_policy llm {
			metrics {
				interval 20ms
			}
		}
	}
}
`, site, dial, transport, ca), "caddyfile")

			postAndAwaitScrape(t, tester.Client, dial, "over https")
		})
	}
}

// TestScrapesSendHeaders: a /metrics behind authentication (here a bearer token, given through an
// environment placeholder) is scraped with the configured headers; the proxied requests are not given
// them.
func TestScrapesSendHeaders(t *testing.T) {
	t.Setenv("CADDY_LLM_TEST_METRICS_TOKEN", "s3cret")
	var leaked atomic.Bool
	_, srv := simServer(t, vllmsim.Config{TimeScale: 1000, Seed: 1}, false, func(sim *vllmsim.Server) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			auth := r.Header.Get("Authorization")
			if r.URL.Path != "/metrics" {
				leaked.Store(leaked.Load() || auth != "")
			} else if auth != "Bearer s3cret" {
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			sim.ServeHTTP(w, r)
		})
	})
	dial := srv.Listener.Addr().String()

	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy llm {
			metrics {
				interval 20ms
				header Authorization "Bearer {env.CADDY_LLM_TEST_METRICS_TOKEN}"
			}
		}
	}
}
`, site, dial), "caddyfile")

	if res, body := post(t, tester.Client, "/v1/chat/completions", chatBody("sim-model", 10, false)); res.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", res.StatusCode, body)
	}
	waitFor(t, "a good scrape with the token", func() bool {
		m := adminUpstreams(t)[dial].Metrics
		return m != nil && m.Fresh && m.Flavor == "vllm"
	})
	if leaked.Load() {
		t.Error("a proxied request carried the scrapes' Authorization header")
	}
}

// TestMetricsSchemeDefault: the scrapes default to https where the proxied requests use TLS on the same
// port, and to http elsewhere (a separate metrics port, a plain transport); a scheme set is kept.
func TestMetricsSchemeDefault(t *testing.T) {
	upstreamTLS := &tls.Config{MinVersion: tls.VersionTLS12}
	for _, tc := range []struct {
		name string
		cfg  MetricsConfig
		want string
	}{
		{"plain transport", MetricsConfig{}, "http"},
		{"TLS transport, the upstreams' port", MetricsConfig{upstreamTLS: upstreamTLS}, "https"},
		{"TLS transport, a metrics port of its own", MetricsConfig{upstreamTLS: upstreamTLS, Port: "9100"}, "http"},
		{"scheme set", MetricsConfig{upstreamTLS: upstreamTLS, Scheme: "http"}, "http"},
		{"https set on a plain transport", MetricsConfig{Scheme: "https"}, "https"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.provision()
			if cfg.Scheme != tc.want {
				t.Errorf("scheme %q, want %q", cfg.Scheme, tc.want)
			}
		})
	}
}

// TestNIMReportedSlots: NVIDIA NIM says how many requests it runs at once (num_request_max); that count
// is the slot count from the first scrape, with no queue seen at it yet.
func TestNIMReportedSlots(t *testing.T) {
	_, dial := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 1, MaxNumSeqs: 48, Metrics: vllmsim.MetricsNIM})
	tester := caddytest.NewTester(t)
	tester.InitServer(fastScrapeConfig(dial, ""), "caddyfile")
	waitFor(t, "the slot count NIM reports", func() bool {
		u := adminUpstreams(t)[dial]
		return u.Metrics != nil && u.Metrics.Flavor == "nim" && u.Model != nil && u.Model.Slots == 48
	})
	if res, body := post(t, tester.Client, "/v1/chat/completions", chatBody("sim-model", 10, false)); res.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", res.StatusCode, body)
	}
}

// TestScrapesUnixSocketUpstream: a backend served on a unix socket (vLLM's --uds, llama-server on a
// .sock), proxied as `unix//path`, is scraped over that socket, with the policy's own client and with
// the one it builds for metrics headers.
func TestScrapesUnixSocketUpstream(t *testing.T) {
	for _, withHeader := range []bool{false, true} {
		t.Run(fmt.Sprintf("header=%v", withHeader), func(t *testing.T) {
			sim, err := vllmsim.New(vllmsim.Config{TimeScale: 1000, Seed: 1})
			if err != nil {
				t.Fatal(err)
			}
			dir, err := os.MkdirTemp("", "llm-uds") // short: a socket path is limited to ~100 bytes
			if err != nil {
				t.Fatal(err)
			}
			socket := filepath.Join(dir, "vllm.sock")
			ln, err := net.Listen("unix", socket)
			if err != nil {
				t.Fatal(err)
			}
			var headerSeen atomic.Bool
			srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/metrics" && r.Header.Get("X-Metrics-Key") == "k" {
					headerSeen.Store(true)
				}
				sim.ServeHTTP(w, r)
			})}
			go func() { _ = srv.Serve(ln) }()
			t.Cleanup(func() {
				_ = srv.Close()
				sim.Close()
				_ = os.RemoveAll(dir)
			})
			extra, transport := "", ""
			if withHeader {
				extra, transport = "header X-Metrics-Key k", "transport llm" // which observes the responses too
			}

			tester := caddytest.NewTester(t)
			tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy unix/%s {
		%s
		lb_policy llm {
			metrics {
				interval 20ms
				%s
			}
		}
	}
}
`, site, socket, transport, extra), "caddyfile")

			dial := "unix/" + socket
			postAndAwaitScrape(t, tester.Client, dial, "over the socket")
			if withHeader && !headerSeen.Load() {
				t.Error("the scrapes over the socket did not send the configured header")
			}
			if model := adminUpstreams(t)[dial].Model; withHeader && (model == nil || model.FirstTokens != 1) {
				t.Errorf("transport llm over the socket: model %+v, want one first token observed", model)
			}
		})
	}
}

// TestMetricsTarget: where an upstream's metrics are fetched from, by its dial address.
func TestMetricsTarget(t *testing.T) {
	t.Setenv("CADDY_LLM_TEST_HOST", "10.1.2.3")
	for _, tc := range []struct {
		dial    string
		cfg     MetricsConfig
		want    scraper.Target
		wantErr bool
	}{
		{dial: "10.0.0.1:8000", want: scraper.Target{URL: "http://10.0.0.1:8000/metrics"}},
		{dial: "[::1]:8000", cfg: MetricsConfig{Port: "9100", Model: "m"}, want: scraper.Target{URL: "http://[::1]:9100/metrics", Model: "m"}},
		{dial: "unix//run/vllm.sock", want: scraper.Target{URL: "http://localhost/metrics", Socket: "/run/vllm.sock"}},
		{dial: "unix//run/nim.sock", cfg: MetricsConfig{Path: "/v1/metrics"}, want: scraper.Target{URL: "http://localhost/v1/metrics", Socket: "/run/nim.sock"}},
		{dial: "unix//run/vllm.sock", cfg: MetricsConfig{Port: "9100"}, wantErr: true},
		{dial: "no-port", wantErr: true},
		{dial: "{env.CADDY_LLM_TEST_HOST}:8000", want: scraper.Target{URL: "http://10.1.2.3:8000/metrics"}},
		{dial: "{http.request.host}:8000", wantErr: true},
	} {
		t.Run(tc.dial, func(t *testing.T) {
			cfg := tc.cfg
			cfg.provision()
			got, err := cfg.target(tc.dial)
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Errorf("target(%q) = %+v, %v; want %+v (error %v)", tc.dial, got, err, tc.want, tc.wantErr)
			}
		})
	}
}

// TestScrapesPlaceholderUpstream: an upstream written with a global placeholder ({env.*}), which
// Caddy resolves when it dials, is scraped at the address it resolves to.
func TestScrapesPlaceholderUpstream(t *testing.T) {
	_, addr := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 1})
	_, port, _ := net.SplitHostPort(addr)
	t.Setenv("CADDY_LLM_TEST_UPSTREAM_HOST", "127.0.0.1")
	dial := "{env.CADDY_LLM_TEST_UPSTREAM_HOST}:" + port

	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy llm {
			metrics {
				interval 20ms
			}
		}
	}
}
`, site, dial), "caddyfile")

	postAndAwaitScrape(t, tester.Client, dial, "of "+addr)
}

// postAndAwaitScrape sends one chat request through the proxy to dial, the one upstream, and waits for
// a good, fresh vLLM scrape of it (how says how it is reached, for the messages).
func postAndAwaitScrape(t *testing.T, client *http.Client, dial, how string) {
	t.Helper()
	if res, body := post(t, client, "/v1/chat/completions", chatBody("sim-model", 10, false)); res.StatusCode != http.StatusOK {
		t.Fatalf("status %d through %s: %s", res.StatusCode, dial, body)
	}
	waitFor(t, "a good scrape "+how, func() bool {
		m := adminUpstreams(t)[dial].Metrics
		return m != nil && m.Fresh && m.Flavor == "vllm"
	})
}

// TestBlindUpstreamsBounded: where the policy cannot see the backends' queues (metrics off, or metrics
// found unusable), a burst of requests that share one long system prompt does not pile onto the
// backend that cached it first: no upstream holds more than 1.25x one more than the mean in flight
// while another holds less. The backends hold every request until the burst is in, so each decision
// sees all the earlier ones in flight.
func TestBlindUpstreamsBounded(t *testing.T) {
	for _, tc := range []struct{ name, metrics string }{
		{"metrics off", "metrics off"},
		{"metrics unusable", "metrics {\n\t\t\t\tinterval 20ms\n\t\t\t}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var hold atomic.Bool
			release := make(chan struct{})
			received := make([]atomic.Int64, 3)
			dials := make([]string, 3)
			for i := range dials {
				srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if r.URL.Path == "/metrics" {
						http.NotFound(w, r) // a generic OpenAI-compatible server
						return
					}
					_, _ = io.Copy(io.Discard, r.Body)
					if hold.Load() {
						received[i].Add(1)
						<-release
					}
					w.Header().Set("Content-Type", "application/json")
					io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":900,"completion_tokens":1,"total_tokens":901}}`)
				}))
				t.Cleanup(srv.Close)
				dials[i] = strings.TrimPrefix(srv.URL, "http://")
			}
			var once sync.Once
			t.Cleanup(func() { once.Do(func() { close(release) }) })

			tester := caddytest.NewTester(t)
			tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy llm {
			%s
		}
	}
}
`, site, strings.Join(dials, " "), tc.metrics), "caddyfile")
			if tc.metrics != "metrics off" {
				// Until its metrics are found unusable, an upstream's first scrape is awaited, not bounded.
				waitFor(t, "every upstream's metrics found unusable", func() bool {
					post(t, tester.Client, "/v1/chat/completions", chatBody("m", 5, false))
					ups := adminUpstreams(t)
					for _, d := range dials {
						if u, ok := ups[d]; !ok || u.Metrics != nil {
							return false
						}
					}
					return true
				})
			}

			hold.Store(true)
			system := strings.Repeat("You are the support desk of a hardware shop; cite the manual. ", 60)
			const n = 12
			var wg sync.WaitGroup
			for i := range n {
				body := fmt.Sprintf(`{"model":"m","max_tokens":8,"messages":[{"role":"system","content":%q},{"role":"user","content":"question %d"}]}`, system, i)
				wg.Add(1)
				go func() {
					defer wg.Done()
					post(t, tester.Client, "/v1/chat/completions", body)
				}()
				waitFor(t, fmt.Sprintf("request %d at a backend", i), func() bool {
					sum := int64(0)
					for j := range received {
						sum += received[j].Load()
					}
					return sum == int64(i+1)
				})
			}
			counts := make([]int64, len(received))
			for j := range received {
				counts[j] = received[j].Load()
			}
			once.Do(func() { close(release) })
			wg.Wait()
			// 12 in flight over 3: the home takes at most 1.25 x (11/3 + 1) = 5.8, so 6 with the one
			// that reached it at the bound's edge.
			if m := slices.Max(counts); m > 6 {
				t.Errorf("requests per backend %v: one holds %d of %d, over the bound", counts, m, n)
			}
		})
	}
}

// scrapedPair starts Caddy proxying to a and b with a bare lb_policy llm whose metrics block holds the
// given directives, one a line.
func scrapedPair(t *testing.T, a, b string, metrics ...string) *caddytest.Tester {
	t.Helper()
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy %s %s {
		lb_policy llm {
			metrics {
				%s
			}
		}
	}
}
`, site, a, b, strings.Join(metrics, "\n\t\t\t\t")), "caddyfile")
	return tester
}

// TestUnlikeEnginesNoted: a pool whose scraped KV caches say it holds two kinds of engine, measured by
// ended requests with no first token observed on any (a bare lb_policy llm), is said once in the log at
// info level, with the number of kinds and where to look; not before anything is measured, not where a
// first token was seen, and not for a pool of one kind, its caches a few percent apart.
func TestUnlikeEnginesNoted(t *testing.T) {
	for _, c := range []struct {
		name        string
		blocks      [2]int
		firstTokens bool // seen, as behind transport llm
		noted       int
	}{
		{"two kinds", [2]int{2048, 16384}, false, 1},
		{"two kinds, first tokens seen", [2]int{2048, 16384}, true, 0},
		{"one kind", [2]int{16384, 16000}, false, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			pool := make(reverseproxy.UpstreamPool, 2)
			for i, blocks := range c.blocks {
				_, dial := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: int64(i + 1), NumGPUBlocks: blocks})
				pool[i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: dial}
			}
			s := &LLMSelection{Metrics: &MetricsConfig{Interval: caddy.Duration(20 * time.Millisecond)}}
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			t.Cleanup(cancel)
			if err := s.Provision(ctx); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = s.Cleanup() })
			core, logs := observer.New(zap.InfoLevel)
			s.logger = zap.New(core)
			s.scrapes.logger, s.scrapes.opts.Logger = zap.NewNop(), zap.NewNop()
			awaitScrapes(t, s, pool)
			r, cancel := newProxyRequest(chatRequest20(899))
			s.Select(pool, r, nil) // priced before anything is measured: too early to tell
			cancel()
			waitInflightZero(t, pool[0].Dial, pool[1].Dial)
			if n := logs.FilterMessageSnippet("several kinds of engine").Len(); n != 0 {
				t.Fatalf("noted %d times before any upstream was measured, want 0 (first tokens may be on their way)", n)
			}
			for _, up := range pool { // ended requests, no first token: a bare lb_policy llm
				m := loads.entry(up.Dial, time.Now().UnixNano()).model
				for range unlikeAfterSamples {
					m.ObserveEnd(1000, 100, 0, 0.5)
				}
				if c.firstTokens {
					m.ObserveFirstToken(1000, 0, 0, 0.2, 0)
				}
			}
			for i := range 5 {
				r, cancel := newProxyRequest(chatRequest20(900 + i))
				if s.Select(pool, r, nil) == nil {
					t.Fatal("Select returned no upstream")
				}
				cancel()
			}
			waitInflightZero(t, pool[0].Dial, pool[1].Dial)
			noted := logs.FilterMessageSnippet("several kinds of engine").AllUntimed()
			if len(noted) != c.noted {
				t.Fatalf("caches of %v blocks: %d notes of several kinds of engine, want %d", c.blocks, len(noted), c.noted)
			}
			for _, e := range noted {
				if k := e.ContextMap()["kinds"]; k != int64(2) {
					t.Errorf("kinds = %v, want 2", k)
				}
				if h, _ := e.ContextMap()["hint"].(string); !strings.Contains(h, "transport llm") {
					t.Errorf("hint %q does not point to transport llm", h)
				}
			}
		})
	}
}

// TestUnlikeEnginesBringScrapesForward: in a pool of two kinds of engine (KV caches 8x apart), an
// upstream whose backend counts its steps, that this proxy has requests on and that has few spans between
// scrapes has its next scrape brought forward (a fifth of the interval), so that its kind's prefill fit
// (selection.Fleet.Align) has spans within a short burst; in a pool of one kind, nothing is brought
// forward.
func TestUnlikeEnginesBringScrapesForward(t *testing.T) {
	for _, c := range []struct {
		name   string
		blocks [2]int
		kicked bool
	}{
		{"two kinds", [2]int{2048, 16384}, true},
		{"one kind", [2]int{16384, 16000}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			pool := make(reverseproxy.UpstreamPool, 2)
			for i, blocks := range c.blocks {
				_, dial := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: int64(i + 1), NumGPUBlocks: blocks})
				pool[i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: dial}
				// It has run engine steps: its metrics count them, as a span needs (vLLM's per-step
				// histogram counts from its first step).
				res, err := http.Post("http://"+dial+"/v1/chat/completions", "application/json",
					strings.NewReader(`{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`))
				if err != nil {
					t.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, res.Body)
				res.Body.Close()
			}
			s := &LLMSelection{Metrics: &MetricsConfig{Interval: caddy.Duration(5 * time.Second), StaleAfter: caddy.Duration(time.Minute)}}
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			t.Cleanup(cancel)
			if err := s.Provision(ctx); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = s.Cleanup() })
			awaitScrapes(t, s, pool)
			for i := range 3 { // requests held in flight, as a burst's are
				r, cancel := newProxyRequest(chatRequest20(700 + i))
				t.Cleanup(cancel)
				if s.Select(pool, r, nil) == nil {
					t.Fatal("Select returned no upstream")
				}
			}
			forward := func() (n uint64) {
				for _, up := range pool {
					if st, ok := s.scrapes.status(up.Dial); ok {
						n += st.BroughtForward
					}
				}
				return n
			}
			if c.kicked {
				waitFor(t, "a scrape brought forward", func() bool { return forward() > 0 })
				return
			}
			time.Sleep(2500 * time.Millisecond) // past a fifth of the interval, short of the interval
			if n := forward(); n != 0 {
				t.Errorf("one kind of engine: %d scrapes brought forward, want 0", n)
			}
		})
	}
}
