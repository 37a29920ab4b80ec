package vllmsim

import (
	"github.com/tokenrouter/caddy-llm/scraper"

	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

func TestBadRequests(t *testing.T) {
	_, ts := newTestServer(t, Config{NumGPUBlocks: 64})
	tests := []struct {
		name, path, method, body string
		want                     int
	}{
		{"bad json", "/v1/chat/completions", "POST", `{"messages":`, 400},
		{"missing messages", "/v1/chat/completions", "POST", `{"model":"sim-model"}`, 400},
		{"empty messages", "/v1/chat/completions", "POST", `{"messages":[]}`, 400},
		{"missing role", "/v1/chat/completions", "POST", `{"messages":[{"content":"hi"}]}`, 400},
		{"numeric content", "/v1/chat/completions", "POST", `{"messages":[{"role":"user","content":5}]}`, 400},
		{"zero max_tokens", "/v1/chat/completions", "POST", `{"messages":[{"role":"user","content":"x"}],"max_tokens":0}`, 400},
		{"zero n", "/v1/chat/completions", "POST", `{"messages":[{"role":"user","content":"x"}],"n":0}`, 400},
		{"n too large", "/v1/completions", "POST", `{"prompt":"x","n":129}`, 400},
		{"n not a number", "/v1/chat/completions", "POST", `{"messages":[{"role":"user","content":"x"}],"n":"2"}`, 400},
		{"missing prompt", "/v1/completions", "POST", `{"model":"sim-model"}`, 400},
		{"object prompt", "/v1/completions", "POST", `{"prompt":{"a":1}}`, 400},
		{"too long", "/v1/completions", "POST", `{"prompt":"x","max_tokens":5000}`, 400},
		{"unknown model", "/v1/chat/completions", "POST", `{"model":"gpt-x","messages":[{"role":"user","content":"x"}]}`, 404},
		{"GET completions", "/v1/completions", "GET", ``, 405},
		{"POST models", "/v1/models", "POST", ``, 405},
		{"unknown path", "/v2/nothing", "GET", ``, 404},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, _ := http.NewRequest(tt.method, ts.URL+tt.path, strings.NewReader(tt.body))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tt.want {
				t.Fatalf("status = %d, want %d (%s)", resp.StatusCode, tt.want, raw)
			}
			if strings.HasPrefix(tt.path, "/v1/") && tt.want != 405 {
				var e struct {
					Error struct {
						Message string `json:"message"`
						Code    int    `json:"code"`
					} `json:"error"`
				}
				if err := json.Unmarshal(raw, &e); err != nil || e.Error.Message == "" || e.Error.Code != tt.want {
					t.Errorf("error body %s is not an OpenAI error (%v)", raw, err)
				}
			}
		})
	}
}

func TestModelsAndHealth(t *testing.T) {
	_, ts := newTestServer(t, Config{Model: "org/model-7b"})
	resp, err := http.Get(ts.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var models struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	err = json.NewDecoder(resp.Body).Decode(&models)
	resp.Body.Close()
	if err != nil || len(models.Data) != 1 || models.Data[0].ID != "org/model-7b" {
		t.Errorf("models = %+v, %v", models, err)
	}
	resp, err = http.Get(ts.URL + "/health")
	if err != nil || resp.StatusCode != 200 {
		t.Errorf("health: %v %v", resp, err)
	}
	resp.Body.Close()
}

func TestCachedTokensRiseOverHTTP(t *testing.T) {
	s, ts := newTestServer(t, Config{})
	system := longText("You are a helpful assistant. ", 2000)
	first := chat(t, ts, chatBodyJSON(t, system, "question one", 3, false))
	second := chat(t, ts, chatBodyJSON(t, system, "question two", 3, false))
	if first.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Errorf("first cached_tokens = %d, want 0", first.Usage.PromptTokensDetails.CachedTokens)
	}
	if got := second.Usage.PromptTokensDetails.CachedTokens; got < 2000/bytesPerToken-16 {
		t.Errorf("second cached_tokens = %d, want about the system prompt (%d)", got, 2000/bytesPerToken)
	}
	prompt, cached, err := s.Cached(chatBodyJSON(t, system, "question three", 3, false))
	if err != nil || prompt != first.Usage.PromptTokens+1 && prompt != first.Usage.PromptTokens || cached != second.Usage.PromptTokensDetails.CachedTokens {
		t.Errorf("Cached() = %d, %d, %v; responses said %d prompt, %d cached", prompt, cached, err,
			first.Usage.PromptTokens, second.Usage.PromptTokensDetails.CachedTokens)
	}
}

func TestForcedStatus(t *testing.T) {
	s, ts := newTestServer(t, Config{})
	for _, code := range []int{503, 429, 500} {
		resp := post(t, context.Background(), ts.URL+"/v1/chat/completions", chatBodyJSON(t, "s", "u", 2, true),
			map[string]string{"X-Sim-Status": strconv.Itoa(code)})
		resp.Body.Close()
		if resp.StatusCode != code {
			t.Errorf("X-Sim-Status %d: got %d", code, resp.StatusCode)
		}
	}
	if st := s.State(); st.Failed429 != 1 || st.Failed5xx != 2 || st.Requests != 3 {
		t.Errorf("counters %+v, want 1 429, 2 5xx, 3 requests", st)
	}
}

func TestErrorRateFault(t *testing.T) {
	s, ts := newTestServer(t, Config{ErrorRate: 1})
	resp := post(t, context.Background(), ts.URL+"/v1/chat/completions", chatBodyJSON(t, "s", "u", 2, false), nil)
	resp.Body.Close()
	if resp.StatusCode != 500 {
		t.Errorf("status = %d with ErrorRate 1, want 500", resp.StatusCode)
	}
	s.SetFaults(Faults{})
	chat(t, ts, chatBodyJSON(t, "s", "u", 2, false))
}

// readStream reads a whole SSE response and reports whether it ended cleanly.
func readStream(t *testing.T, resp *http.Response) (events []string, readErr error) {
	t.Helper()
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	return sseEvents(t, bytes.NewReader(raw)), err
}

func TestMidStreamDrop(t *testing.T) {
	s, ts := newTestServer(t, Config{})
	check := func(name string, hdr map[string]string) {
		resp := post(t, context.Background(), ts.URL+"/v1/chat/completions", chatBodyJSON(t, "s", "u", 20, true), hdr)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: status %d", name, resp.StatusCode)
		}
		events, err := readStream(t, resp)
		if err == nil {
			t.Errorf("%s: stream ended cleanly, want a dropped connection", name)
		}
		if len(events) == 0 || events[len(events)-1] == "[DONE]" {
			t.Errorf("%s: events %q, want some output and no [DONE]", name, events)
		}
		// The handler aborts the request before dropping the connection.
		if st := s.State(); st.UsedBlocks != 0 || st.Running != 0 {
			t.Errorf("%s: after drop: %+v", name, st)
		}
	}
	check("header", map[string]string{"X-Sim-Drop": "mid-stream"})
	s.SetFaults(Faults{DropMidStreamRate: 1})
	check("rate", nil)
}

func TestQueueFull429OverHTTP(t *testing.T) {
	// Real time (TimeScale 1): the running request lasts seconds, far longer than the test.
	s, ts := newTestServer(t, Config{MaxNumSeqs: 1, MaxQueue: 1, TimeScale: 1})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	a := post(t, ctx, ts.URL+"/v1/chat/completions", chatBodyJSON(t, "s", "a", 500, true), nil)
	defer a.Body.Close()
	firstEvent(t, a)
	b := post(t, ctx, ts.URL+"/v1/chat/completions", chatBodyJSON(t, "s", "b", 5, true), nil)
	defer b.Body.Close()
	if b.StatusCode != 200 {
		t.Fatalf("queued request: status %d", b.StatusCode)
	}
	c := post(t, ctx, ts.URL+"/v1/chat/completions", chatBodyJSON(t, "s", "c", 5, true), nil)
	c.Body.Close()
	if c.StatusCode != http.StatusTooManyRequests {
		t.Errorf("request beyond the queue: status %d, want 429", c.StatusCode)
	}
	if st := s.State(); st.Running != 1 || st.Waiting != 1 || st.Failed429 != 1 {
		t.Errorf("state %+v", st)
	}
	cancel()
	waitFor(t, "aborted requests to release their blocks", func() bool {
		st := s.State()
		return st.Running == 0 && st.Waiting == 0 && st.UsedBlocks == 0
	})
}

// firstEvent reads up to the first SSE data line.
func firstEvent(t *testing.T, resp *http.Response) string {
	t.Helper()
	buf := make([]byte, 0, 4096)
	tmp := make([]byte, 4096)
	for !bytes.Contains(buf, []byte("\n\n")) {
		n, err := resp.Body.Read(tmp)
		buf = append(buf, tmp[:n]...)
		if err != nil {
			t.Fatalf("reading first event: %v (got %q)", err, buf)
		}
	}
	return string(buf)
}

func TestWaitingForBlocksOverHTTP(t *testing.T) {
	s, ts := newTestServer(t, Config{NumGPUBlocks: 24, TimeScale: 1})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	x := post(t, ctx, ts.URL+"/v1/completions", []byte(`{"prompt":"`+blocksText("x", 16)+`","max_tokens":100,"stream":true}`), nil)
	defer x.Body.Close()
	firstEvent(t, x)
	// y (9 blocks) cannot fit beside x (17 blocks and growing): its stream opens once it is queued.
	y := post(t, context.Background(), ts.URL+"/v1/completions",
		[]byte(`{"prompt":"`+blocksText("y", 8)+`","max_tokens":2,"stream":true}`), nil)
	defer y.Body.Close()
	if st := s.State(); st.Running != 1 || st.Waiting != 1 {
		t.Fatalf("running %d waiting %d, want 1 and 1", st.Running, st.Waiting)
	}
	cancel() // x ends; y gets its blocks
	events, err := readStream(t, y)
	if err != nil || len(events) == 0 || events[len(events)-1] != "[DONE]" {
		t.Errorf("waiting request: events %q, err %v; want a complete stream", events, err)
	}
}

func TestClientCancelReleasesBlocks(t *testing.T) {
	s, ts := newTestServer(t, Config{TimeScale: 1})
	ctx, cancel := context.WithCancel(context.Background())
	resp := post(t, ctx, ts.URL+"/v1/chat/completions", chatBodyJSON(t, longText("sys ", 4000), "u", 1000, true), nil)
	firstEvent(t, resp)
	if st := s.State(); st.Running != 1 || st.UsedBlocks == 0 {
		t.Fatalf("while streaming: %+v", st)
	}
	cancel()
	resp.Body.Close()
	waitFor(t, "the cancelled request to release its blocks", func() bool {
		st := s.State()
		return st.Running == 0 && st.UsedBlocks == 0
	})
	if st := s.State(); st.CachedBlocks == 0 {
		t.Errorf("prompt blocks of the cancelled request were not kept cached: %+v", st)
	}
}

func TestCloseStopsEverything(t *testing.T) {
	before := runtime.NumGoroutine()
	s, err := New(Config{TimeScale: 1})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s)
	resp := post(t, context.Background(), ts.URL+"/v1/chat/completions", chatBodyJSON(t, "s", "u", 1000, true), nil)
	firstEvent(t, resp)
	s.Close()
	s.Close() // idempotent
	events, _ := readStream(t, resp)
	if len(events) < 2 || !strings.Contains(events[len(events)-2], `"error"`) {
		t.Errorf("in-flight stream after Close: %q, want an error event", events)
	}
	after := post(t, context.Background(), ts.URL+"/v1/chat/completions", chatBodyJSON(t, "s", "u", 1, false), nil)
	after.Body.Close()
	if after.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("request after Close: status %d, want 503", after.StatusCode)
	}
	ts.Close()
	http.DefaultClient.CloseIdleConnections()
	waitFor(t, "goroutines to exit", func() bool { return runtime.NumGoroutine() <= before })
}

func parseMetrics(t *testing.T, text []byte) map[string]*dto.MetricFamily {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(text))
	if err != nil {
		t.Fatalf("parsing metrics: %v\n%s", err, text)
	}
	return fams
}

func labels(m *dto.Metric) map[string]string {
	out := map[string]string{}
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

func TestMetricsFlavours(t *testing.T) {
	tests := []struct {
		flavour string
		want    []string
		absent  []string
		info    string
		infoLbl []string
	}{
		{MetricsVLLM, []string{"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
			"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"}, []string{"vllm:gpu_cache_usage_perc"},
			"vllm:cache_config_info", []string{"block_size", "num_gpu_blocks"}},
		{MetricsVLLMLegacy, []string{"vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total",
			"vllm:gpu_prefix_cache_hits_total", "vllm:num_requests_waiting"}, []string{"vllm:kv_cache_usage_perc"},
			"vllm:cache_config_info", []string{"block_size", "num_gpu_blocks"}},
		{MetricsSGLang, []string{"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
			"sglang:prompt_tokens_total", "sglang:num_requests_total"},
			[]string{"vllm:num_requests_running"}, "sglang:cache_config_info", []string{"page_size", "num_pages"}},
	}
	for _, tt := range tests {
		t.Run(tt.flavour, func(t *testing.T) {
			s, ts := newTestServer(t, Config{Metrics: tt.flavour, Model: `m"x`, NumGPUBlocks: 100})
			chat(t, ts, chatBodyJSON(t, longText("s", 500), "u", 2, false))
			chat(t, ts, chatBodyJSON(t, longText("s", 500), "u", 2, false))
			fams := parseMetrics(t, getMetrics(t, ts))
			for _, name := range tt.want {
				f, ok := fams[name]
				if !ok {
					t.Errorf("missing %s", name)
					continue
				}
				if got := labels(f.GetMetric()[0])["model_name"]; got != `m"x` {
					t.Errorf("%s model_name = %q", name, got)
				}
			}
			for _, name := range tt.absent {
				if _, ok := fams[name]; ok {
					t.Errorf("unexpected %s", name)
				}
			}
			info := fams[tt.info]
			if info == nil {
				t.Fatalf("missing %s", tt.info)
			}
			l := labels(info.GetMetric()[0])
			if l[tt.infoLbl[0]] != "16" || l[tt.infoLbl[1]] != "100" {
				t.Errorf("%s labels = %v", tt.info, l)
			}
			if tt.flavour == MetricsVLLM {
				hits := fams["vllm:prefix_cache_hits_total"].GetMetric()[0].GetCounter().GetValue()
				queries := fams["vllm:prefix_cache_queries_total"].GetMetric()[0].GetCounter().GetValue()
				st := s.State()
				if hits != float64(st.PrefixHits) || queries != float64(st.PrefixQueries) || hits == 0 {
					t.Errorf("hits/queries = %v/%v, state %d/%d", hits, queries, st.PrefixHits, st.PrefixQueries)
				}
				prompt, _, err := s.Cached(chatBodyJSON(t, longText("s", 500), "u", 2, false))
				h := fams["vllm:request_prompt_tokens"].GetMetric()[0].GetHistogram()
				if err != nil || h.GetSampleCount() != 2 || h.GetSampleSum() != float64(2*prompt) {
					t.Errorf("request_prompt_tokens count/sum = %d/%v, want 2 requests of %d tokens (%v)", h.GetSampleCount(), h.GetSampleSum(), prompt, err)
				}
			}
			if tt.flavour == MetricsSGLang {
				prompt, _, err := s.Cached(chatBodyJSON(t, longText("s", 500), "u", 2, false))
				reqsF, tokensF := fams["sglang:num_requests_total"], fams["sglang:prompt_tokens_total"]
				if reqsF == nil || tokensF == nil || len(reqsF.GetMetric()) == 0 || len(tokensF.GetMetric()) == 0 {
					t.Fatalf("missing sglang:num_requests_total or sglang:prompt_tokens_total")
				}
				reqs, tokens := reqsF.GetMetric()[0].GetCounter().GetValue(), tokensF.GetMetric()[0].GetCounter().GetValue()
				if err != nil || reqs != 2 || tokens != float64(2*prompt) {
					t.Errorf("num_requests_total/prompt_tokens_total = %v/%v, want 2 requests of %d tokens (%v)", reqs, tokens, prompt, err)
				}
			}
		})
	}
}

func TestMetricsFaults(t *testing.T) {
	s, ts := newTestServer(t, Config{MetricsFail: true})
	resp, err := http.Get(ts.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 500 {
		t.Errorf("MetricsFail: status %d", resp.StatusCode)
	}
	s.SetFaults(Faults{MetricsDelay: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, ts.URL+"/metrics", nil)
	if resp, err := http.DefaultClient.Do(req); !errors.Is(err, context.DeadlineExceeded) {
		if resp != nil {
			resp.Body.Close()
		}
		t.Errorf("slow metrics: err = %v, want a client timeout", err)
	}
}

// TestResponseIDsDifferAcrossServers pins issue 13's "different simulated backends return the
// same response id": servers with the same Seed (the vllm_sim default) drew their ID prefix from
// the same seeded RNG.
func TestResponseIDsDifferAcrossServers(t *testing.T) {
	seen := map[string]int{}
	for i := range 3 {
		_, ts := newTestServer(t, Config{Seed: 7})
		for range 2 {
			id := chat(t, ts, chatBodyJSON(t, "system", "question", 2, false)).ID
			if id == "" {
				t.Fatalf("server %d: empty response id", i)
			}
			if j, ok := seen[id]; ok {
				t.Errorf("server %d returned id %s, already returned by server %d", i, id, j)
			}
			seen[id] = i
		}
	}
}

// TestMetricsFlavoursScrape: each flavour's text is read by the policy's scraper as that kind of server,
// with the engine's own figures: the llama.cpp and TGI ones with their decode calls as steps and no model
// label, the NIM one with its slot count (max_num_seqs).
func TestMetricsFlavoursScrape(t *testing.T) {
	for _, tt := range []struct{ flavour, want string }{
		{MetricsVLLM, scraper.FlavorVLLM},
		{MetricsVLLMLegacy, scraper.FlavorVLLM},
		{MetricsSGLang, scraper.FlavorSGLang},
		{MetricsLlamaCpp, scraper.FlavorLlamaCpp},
		{MetricsNIM, scraper.FlavorNIM},
		{MetricsTGI, scraper.FlavorTGI},
	} {
		t.Run(tt.flavour, func(t *testing.T) {
			s, ts := newTestServer(t, Config{Metrics: tt.flavour, MaxNumSeqs: 12})
			chat(t, ts, chatBodyJSON(t, longText("s", 500), "u", 2, false))
			snap := scrapeMetrics(t, ts)
			st := s.State()
			if snap.Flavor != tt.want || snap.Running != float64(st.Running) || snap.Waiting != float64(st.Waiting) {
				t.Errorf("scraped %s: running %v waiting %v; want %s, %d, %d", snap.Flavor, snap.Running, snap.Waiting, tt.want, st.Running, st.Waiting)
			}
			if snap.GenerationTokens != 2 {
				t.Errorf("generated tokens %v, want the one request's 2", snap.GenerationTokens)
			}
			noKV := tt.flavour == MetricsLlamaCpp || tt.flavour == MetricsTGI
			if snap.KVReported == noKV {
				t.Errorf("KV usage reported %v; llama.cpp's recent builds and TGI report none, the others do", snap.KVReported)
			}
			if (tt.flavour == MetricsLlamaCpp || tt.flavour == MetricsTGI) && (snap.Steps != float64(st.Steps) || snap.Steps == 0) {
				t.Errorf("decode calls %v, want the engine's %d steps", snap.Steps, st.Steps)
			}
			if tt.flavour == MetricsLlamaCpp && (snap.PrefilledTokens != float64(st.PrefixQueries-st.PrefixHits) || snap.PrefilledTokens == 0) {
				t.Errorf("llama.cpp prompt tokens evaluated %v, want the engine's uncached %d", snap.PrefilledTokens, st.PrefixQueries-st.PrefixHits)
			}
			if want := map[string]float64{MetricsNIM: 12}[tt.flavour]; snap.MaxRunning != want {
				t.Errorf("reported slots %v, want %v", snap.MaxRunning, want)
			}
		})
	}
}
