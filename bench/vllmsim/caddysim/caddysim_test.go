package caddysim

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func TestUnmarshalCaddyfile(t *testing.T) {
	tests := []struct {
		name  string
		input string
		want  Handler
	}{
		{name: "bare", input: `vllm_sim`, want: Handler{}},
		{name: "model argument", input: `vllm_sim llama-3`, want: Handler{Model: "llama-3"}},
		{
			name: "every option",
			input: `vllm_sim {
				model m
				max_num_seqs 32
				max_queue 100
				block_size 32
				num_gpu_blocks 2048
				max_num_batched_tokens 4096
				prefill_tokens_per_sec 12000.5
				decode_step 25ms
				decode_step_per_seq 500us
				attention_tokens 32768
				decode_step_per_ktoken 250us
				schedule lpm
				separate_prefill
				time_scale 10
				tokens_per_chunk 4
				metrics sglang
				error_rate 0.01
				drop_mid_stream_rate 0.02
				cut_stream_after 7
				metrics_delay 2s
				metrics_fail
				seed 42
				lora_adapters fin legal
				max_loras 2
				lora_load_time 1s
			}`,
			want: Handler{
				Model: "m", MaxNumSeqs: 32, MaxQueue: 100, BlockSize: 32, NumGPUBlocks: 2048,
				MaxNumBatchedTokens: 4096, PrefillTokensPerSec: 12000.5,
				DecodeStep: caddy.Duration(25 * time.Millisecond), DecodeStepPerSeq: caddy.Duration(500 * time.Microsecond),
				AttentionTokens: 32768, DecodeStepPerKToken: caddy.Duration(250 * time.Microsecond),
				Schedule: "lpm", SeparatePrefill: true,
				TimeScale: 10, TokensPerChunk: 4, Metrics: "sglang", ErrorRate: 0.01, DropMidStreamRate: 0.02,
				CutStreamAfter: 7, MetricsDelay: caddy.Duration(2 * time.Second), MetricsFail: true, Seed: 42,
				LoRAAdapters: []string{"fin", "legal"}, MaxLoRAs: 2, LoRALoadTime: caddy.Duration(time.Second),
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var h Handler
			if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tt.input)); err != nil {
				t.Fatalf("UnmarshalCaddyfile() error = %v", err)
			}
			if !reflect.DeepEqual(h, tt.want) {
				t.Errorf("UnmarshalCaddyfile() = %+v, want %+v", h, tt.want)
			}
		})
	}
}

func TestUnmarshalCaddyfileErrors(t *testing.T) {
	bad := map[string]string{
		"unknown option":    `vllm_sim { nonsense 1 }`,
		"two arguments":     `vllm_sim a b`,
		"missing value":     `vllm_sim { max_num_seqs }`,
		"extra value":       `vllm_sim { max_num_seqs 1 2 }`,
		"not an integer":    `vllm_sim { num_gpu_blocks many }`,
		"not a number":      `vllm_sim { time_scale fast }`,
		"bad duration":      `vllm_sim { decode_step soon }`,
		"bad seed":          `vllm_sim { seed x }`,
		"bad cut":           `vllm_sim { cut_stream_after 1.5 }`,
		"flag with value":   `vllm_sim { metrics_fail yes }`,
		"flag with a value": `vllm_sim { separate_prefill yes }`,
		"repeated option": `vllm_sim { max_queue 1
			max_queue 2 }`,
		"model twice":       `vllm_sim a { model b }`,
		"no adapters":       "vllm_sim {\n lora_adapters\n}",
		"bad lora duration": `vllm_sim { lora_load_time soon }`,
	}
	for name, input := range bad {
		t.Run(name, func(t *testing.T) {
			var h Handler
			if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(input)); err == nil {
				t.Errorf("UnmarshalCaddyfile(%q) = nil error, want one", input)
			}
		})
	}
}

func TestCaddyfileAdapt(t *testing.T) {
	input := `:8001 {
		vllm_sim sim-a {
			time_scale 100
		}
	}`
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
	if err != nil {
		t.Fatalf("adapting: %v", err)
	}
	if !strings.Contains(string(out), `"handler":"vllm_sim","model":"sim-a","time_scale":100`) {
		t.Errorf("adapted JSON lacks the handler: %s", out)
	}
}

func TestProvisionValidation(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for name, h := range map[string]*Handler{
		"negative seqs":  {MaxNumSeqs: -1},
		"bad metrics":    {Metrics: "prometheus"},
		"error rate > 1": {ErrorRate: 2},
		"negative scale": {TimeScale: -1},
	} {
		if err := h.Provision(ctx); err == nil {
			h.Cleanup()
			t.Errorf("%s: Provision() = nil error, want one", name)
		}
	}
}

func TestProvisionServeCleanup(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	h := &Handler{Model: "m", TimeScale: 1000}
	if err := h.Provision(ctx); err != nil {
		t.Fatalf("Provision() error = %v", err)
	}
	defer h.Cleanup()

	body := `{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":3}`
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
	if err := h.ServeHTTP(rec, req, nil); err != nil {
		t.Fatalf("ServeHTTP() error = %v", err)
	}
	if rec.Code != http.StatusOK {
		t.Fatalf("status = %d, body %s", rec.Code, rec.Body)
	}
	var resp struct {
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil || resp.Usage.CompletionTokens != 3 {
		t.Errorf("response %s: %v", rec.Body, err)
	}
	if st := h.Server().State(); st.Requests != 1 || st.Running != 0 {
		t.Errorf("state %+v", st)
	}

	rec = httptest.NewRecorder()
	if err := h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil), nil); err != nil {
		t.Fatal(err)
	}
	if raw, _ := io.ReadAll(rec.Body); !strings.Contains(string(raw), `vllm:num_requests_running{engine="0",model_name="m"} 0`) {
		t.Errorf("metrics:\n%s", raw)
	}

	if err := h.Cleanup(); err != nil {
		t.Fatal(err)
	}
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)), nil)
	if rec.Code != http.StatusServiceUnavailable {
		t.Errorf("after Cleanup: status %d, want 503", rec.Code)
	}
}

// provisionIn provisions h as if it were a handler of an HTTP server listening on listen.
func provisionIn(t *testing.T, ctx caddy.Context, h *Handler, listen ...string) {
	t.Helper()
	ctx.Context = context.WithValue(ctx.Context, caddyhttp.ServerCtxKey, &caddyhttp.Server{Listen: listen})
	if err := h.Provision(ctx); err != nil {
		t.Fatalf("Provision() error = %v", err)
	}
}

// TestEngineSurvivesReload pins issue 13 item 1 (a reload cut open streams in the demo): a handler
// provisioned again with the same server and settings gets the same simulator, and cleaning up the
// old config leaves it running; changed settings or another listener get a fresh one.
func TestEngineSurvivesReload(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()

	old := &Handler{Model: "m", TimeScale: 1000}
	provisionIn(t, ctx, old, ":8001")
	same := &Handler{Model: "m", TimeScale: 1000}
	provisionIn(t, ctx, same, ":8001") // the reloaded config provisions before the old one cleans up
	changed := &Handler{Model: "m", TimeScale: 1000, Seed: 7}
	provisionIn(t, ctx, changed, ":8001")
	elsewhere := &Handler{Model: "m", TimeScale: 1000}
	provisionIn(t, ctx, elsewhere, ":8002")
	defer changed.Cleanup()
	defer elsewhere.Cleanup()

	if same.Server() != old.Server() {
		t.Errorf("same listener and settings: a new simulator, want the running one")
	}
	if changed.Server() == old.Server() {
		t.Errorf("changed settings: the old simulator, want a new one")
	}
	if elsewhere.Server() == old.Server() {
		t.Errorf("another listener: the same simulator, want its own")
	}

	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	body := `{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":3}`
	serve := func() int {
		rec := httptest.NewRecorder()
		same.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)), nil)
		return rec.Code
	}
	if code := serve(); code != http.StatusOK {
		t.Errorf("after the old config's Cleanup: status %d, want 200", code)
	}
	if err := same.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if code := serve(); code != http.StatusServiceUnavailable {
		t.Errorf("after the last Cleanup: status %d, want 503 (the simulator is closed)", code)
	}
}

// TestEnginePoolFailedProvision: a handler whose settings are invalid takes no pool reference, so
// its Cleanup (which Caddy calls after a failed Provision) deletes nothing.
func TestEnginePoolFailedProvision(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	ctx.Context = context.WithValue(ctx.Context, caddyhttp.ServerCtxKey, &caddyhttp.Server{Listen: []string{":8001"}})
	bad := &Handler{Metrics: "prometheus"}
	if err := bad.Provision(ctx); err == nil {
		t.Fatal("Provision() = nil error, want one")
	}
	if err := bad.Cleanup(); err != nil {
		t.Errorf("Cleanup() after a failed Provision = %v", err)
	}
	key, err := bad.engineKey([]string{":8001"})
	if err != nil {
		t.Fatal(err)
	}
	if refs, ok := engines.References(key); ok {
		t.Errorf("pool holds the failed engine with %d references, want none", refs)
	}
}

// TestEnginePoolStress provisions and cleans up handlers of one engine from several goroutines, as
// overlapping reloads would, while a long-lived handler keeps it: the engine must stay open until
// that last user's Cleanup. Run with -race.
func TestEnginePoolStress(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	holder := &Handler{Model: "m", TimeScale: 1000}
	provisionIn(t, ctx, holder, ":9001")

	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 50 {
				h := &Handler{Model: "m", TimeScale: 1000}
				provisionIn(t, ctx, h, ":9001")
				if h.Server() != holder.Server() {
					t.Error("a new engine while the holder keeps the old one")
				}
				h.Cleanup()
			}
		})
	}
	wg.Wait()

	body := `{"model":"m","prompt":"hi","max_tokens":1}`
	serve := func() int {
		rec := httptest.NewRecorder()
		holder.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader(body)), nil)
		return rec.Code
	}
	if code := serve(); code != http.StatusOK {
		t.Errorf("while held: status %d, want 200", code)
	}
	key, _ := holder.engineKey([]string{":9001"})
	if refs, _ := engines.References(key); refs != 1 {
		t.Errorf("engine references = %d, want 1 (the holder's)", refs)
	}
	holder.Cleanup()
	if code := serve(); code != http.StatusServiceUnavailable {
		t.Errorf("after the last Cleanup: status %d, want 503", code)
	}
}

// TestConfigCarriesFaults: the fault options reach the simulator's configuration.
func TestConfigCarriesFaults(t *testing.T) {
	h := Handler{ErrorRate: 0.03, DropMidStreamRate: 0.1, CutStreamAfter: 7, MetricsFail: true}
	got := h.Config()
	if got.ErrorRate != 0.03 || got.DropMidStreamRate != 0.1 || got.CutStreamAfter != 7 || !got.MetricsFail {
		t.Errorf("Config() = %+v, want the handler's faults", got)
	}
}
