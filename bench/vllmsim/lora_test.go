package vllmsim

import (
	"context"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/scraper"
)

// submitLoRA enqueues a text completion that runs with adapter ("" for the base model).
func submitLoRA(t *testing.T, s *Server, adapter, prompt string, maxTokens int) *request {
	t.Helper()
	p, err := parseRequest(textBody(prompt, maxTokens), false)
	if err != nil {
		t.Fatal(err)
	}
	r := s.newRequest(p)
	r.adapter = adapter
	if err := s.enqueue(r); err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	return r
}

func TestLoRALoadDelaysTheStepThatAdmitsIt(t *testing.T) {
	const load = 500 * time.Millisecond
	s := manualServer(t, Config{LoRAAdapters: []string{"a", "b"}, MaxLoRAs: 2, LoRALoadTime: load})
	submitLoRA(t, s, "", "base", 1)
	base, _ := step(s)
	drain(t, s, 10)

	submitLoRA(t, s, "a", "base", 1)
	cold, _ := step(s)
	if got := cold - base; got < load-time.Millisecond || got > load+time.Millisecond {
		t.Errorf("a step loading an adapter lasts %v more than without, want %v", got, load)
	}
	drain(t, s, 10)

	submitLoRA(t, s, "a", "base", 1)
	warm, _ := step(s)
	if warm >= base+load/2 {
		t.Errorf("a step with the adapter resident lasts %v, want no load (base %v)", warm, base)
	}
	if got := s.State().LoRALoads; got != 1 {
		t.Errorf("LoRALoads = %d, want 1", got)
	}
}

func TestLoRAEvictsTheLeastRecentlyUsedIdleAdapter(t *testing.T) {
	s := manualServer(t, Config{LoRAAdapters: []string{"a", "b", "c"}, MaxLoRAs: 2})
	for _, a := range []string{"a", "b", "a"} { // b is now the least recently used
		submitLoRA(t, s, a, "p", 1)
		drain(t, s, 10)
	}
	submitLoRA(t, s, "c", "p", 1)
	drain(t, s, 10)
	if got, want := s.ResidentLoRAs(), []string{"a", "c"}; !slices.Equal(got, want) {
		t.Errorf("resident adapters = %v, want %v (b evicted)", got, want)
	}
	if got := s.State().LoRALoads; got != 3 {
		t.Errorf("LoRALoads = %d, want 3", got)
	}
}

// A request whose adapter finds every slot used by running requests waits, and the requests behind it
// that can run do (vLLM skips it rather than blocking the queue).
func TestLoRAFullSlotsSkipTheRequest(t *testing.T) {
	s := manualServer(t, Config{LoRAAdapters: []string{"a", "b"}, MaxLoRAs: 1})
	long := submitLoRA(t, s, "a", "p", 50)
	step(s)
	blocked := submitLoRA(t, s, "b", "p", 1)
	base := submitLoRA(t, s, "", "p", 5)
	sameAdapter := submitLoRA(t, s, "a", "q", 5)
	step(s)
	s.mu.Lock()
	states := []int{blocked.state, base.state, sameAdapter.state}
	running, waiting := s.loraListsLocked()
	s.mu.Unlock()
	if want := []int{stateWaiting, stateRunning, stateRunning}; !slices.Equal(states, want) {
		t.Errorf("states of (b, base, a) = %v, want %v", states, want)
	}
	if running != "a" || waiting != "b" {
		t.Errorf("lora lists = running %q waiting %q, want a and b", running, waiting)
	}
	drain(t, s, 200)
	for _, r := range []*request{long, blocked, base, sameAdapter} {
		if r.state != stateDone || r.err != nil || int(r.generated.Load()) != r.maxTokens {
			t.Errorf("request %+v did not finish", r)
		}
	}
	if got := s.ResidentLoRAs(); !slices.Equal(got, []string{"b"}) {
		t.Errorf("resident adapters = %v, want [b]", got)
	}
}

func TestLoRAAbortAndPreemptReleaseTheSlot(t *testing.T) {
	s := manualServer(t, Config{LoRAAdapters: []string{"a", "b"}, MaxLoRAs: 1})
	r := submitLoRA(t, s, "a", "p", 50)
	step(s)
	s.abort(r)
	submitLoRA(t, s, "b", "p", 1)
	drain(t, s, 10)
	if got := s.ResidentLoRAs(); !slices.Equal(got, []string{"b"}) {
		t.Errorf("resident adapters after an abort = %v, want [b]", got)
	}
	s.mu.Lock()
	refs := s.loras[0].refs
	s.mu.Unlock()
	if refs != 0 {
		t.Errorf("idle slot refs = %d, want 0", refs)
	}
}

func TestLoRAConfigErrors(t *testing.T) {
	for name, cfg := range map[string]Config{
		"comma":        {LoRAAdapters: []string{"a,b"}},
		"empty":        {LoRAAdapters: []string{""}},
		"duplicate":    {LoRAAdapters: []string{"a", "a"}},
		"base model":   {LoRAAdapters: []string{"sim-model"}},
		"slots":        {LoRAAdapters: []string{"a"}, MaxLoRAs: -1},
		"load time":    {LoRAAdapters: []string{"a"}, LoRALoadTime: -time.Second},
		"quote in one": {LoRAAdapters: []string{`a"b`}},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: New() = nil error, want one", name)
		}
	}
}

// The HTTP surface: adapters are served under their own model names (unknown ones 404), /v1/models
// lists them, and /metrics exports vllm:lora_requests_info as vLLM does, readable by the scraper.
func TestLoRAOverHTTP(t *testing.T) {
	s, ts := newTestServer(t, Config{LoRAAdapters: []string{"fin", "legal"}, MaxLoRAs: 2, TimeScale: 1})
	body := func(model string, maxTokens int, stream bool) []byte {
		return []byte(strings.ReplaceAll(string(chatBodyJSON(t, "s", "u", maxTokens, stream)), `{"max_tokens"`, `{"model":"`+model+`","max_tokens"`))
	}
	if got := chat(t, ts, body("fin", 2, false)); got.Model != "fin" {
		t.Errorf("response model = %q, want fin", got.Model)
	}
	resp := post(t, context.Background(), ts.URL+"/v1/chat/completions", body("nope", 2, false), nil)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("unknown adapter: status %d, want 404", resp.StatusCode)
	}

	models, err := http.Get(ts.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(models.Body)
	models.Body.Close()
	if !strings.Contains(string(raw), `"id":"legal"`) || !strings.Contains(string(raw), `"parent":"sim-model"`) {
		t.Errorf("/v1/models = %s, want the adapters listed with their parent", raw)
	}

	// A long stream keeps "legal" running while /metrics is read.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream := post(t, ctx, ts.URL+"/v1/chat/completions", body("legal", 1000, true), nil)
	defer stream.Body.Close()
	waitFor(t, "legal to run", func() bool { return s.State().Running == 1 })
	snap := scrapeMetrics(t, ts)
	if want := (scraper.LoRA{Running: "legal", MaxLoRA: 2}); snap.LoRA != want {
		t.Errorf("scraped LoRA = %+v, want %+v", snap.LoRA, want)
	}
	if snap.Model != "sim-model" {
		t.Errorf("scraped model = %q, want sim-model", snap.Model)
	}
}

func TestNoLoRAMetricWithoutAdapters(t *testing.T) {
	s := manualServer(t, Config{})
	if strings.Contains(string(s.metricsText()), "lora") {
		t.Error("/metrics mentions lora on a server without adapters")
	}
}
