package scraper

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func readTestdata(tb testing.TB, name string) []byte {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

func TestParseRecorded(t *testing.T) {
	tests := []struct {
		name  string
		file  string
		model string
		want  Snapshot
	}{
		{
			name: "vLLM V1 two engines are summed, KV usage averaged",
			file: "vllm_v1_two_engines.txt",
			want: Snapshot{Running: 12, Waiting: 4, KVUsage: 0.52, KVReported: true, PrefixHits: 120000, PrefixQueries: 200000,
				GenerationTokens: 75319, BlockSize: 16, NumBlocks: 2 * 27165, StartTime: 1.73210040912e+09, Flavor: FlavorVLLM},
		},
		{
			name:  "vLLM V1 filtered by its own model",
			file:  "vllm_v1_two_engines.txt",
			model: "meta-llama/Llama-3.1-8B-Instruct",
			want: Snapshot{Running: 12, Waiting: 4, KVUsage: 0.52, KVReported: true, PrefixHits: 120000, PrefixQueries: 200000,
				GenerationTokens: 75319, BlockSize: 16, NumBlocks: 2 * 27165, StartTime: 1.73210040912e+09, Flavor: FlavorVLLM},
		},
		{
			name: "legacy vLLM names",
			file: "vllm_legacy.txt",
			want: Snapshot{Running: 4, Waiting: 9, KVUsage: 0.875, KVReported: true, PrefixHits: 12500, PrefixQueries: 50000,
				BlockSize: 16, NumBlocks: 8192, Flavor: FlavorVLLM},
		},
		{
			name: "SGLang two DP ranks",
			file: "sglang.txt",
			want: Snapshot{Running: 22, Waiting: 30, KVUsage: 0.7, KVReported: true, BlockSize: 1, NumBlocks: 308000, Flavor: FlavorSGLang},
		},
		{
			name:  "SGLang filtered by model keeps unlabelled cache info",
			file:  "sglang.txt",
			model: "meta-llama/Llama-3.1-8B-Instruct",
			want:  Snapshot{Running: 22, Waiting: 30, KVUsage: 0.7, KVReported: true, BlockSize: 1, NumBlocks: 308000, Flavor: FlavorSGLang},
		},
		{
			name: "SGLang geometry as gauges",
			file: "sglang_gauges.txt",
			want: Snapshot{Running: 2, Waiting: 0, KVUsage: 0.05, KVReported: true, BlockSize: 64, NumBlocks: 4096, Flavor: FlavorSGLang},
		},
		{
			name: "vLLM with LoRA: the newest info sample of each engine, adapters unioned, slots summed",
			file: "vllm_lora.txt",
			want: Snapshot{Running: 5, Waiting: 1, KVUsage: 0.2, KVReported: true, BlockSize: 16, NumBlocks: 8192, Flavor: FlavorVLLM,
				LoRA: LoRA{Running: "chat-lora,legal-lora,sql-lora", Waiting: "math-lora", MaxLoRA: 4}},
		},
		{
			name:  "two models, filter llama",
			file:  "vllm_two_models.txt",
			model: "llama",
			want:  Snapshot{Running: 2, Waiting: 1, KVUsage: 0.25, KVReported: true, BlockSize: 32, NumBlocks: 1000, Flavor: FlavorVLLM},
		},
		{
			name:  "two models, filter qwen",
			file:  "vllm_two_models.txt",
			model: "qwen",
			want:  Snapshot{Running: 6, Waiting: 8, KVUsage: 0.75, KVReported: true, BlockSize: 32, NumBlocks: 1000, Flavor: FlavorVLLM},
		},
		{
			name: "llama.cpp llama-server: busy slots running, deferred requests waiting",
			file: "llamacpp.txt",
			want: Snapshot{Running: 4, Waiting: 3, PrefilledTokens: 33065, GenerationTokens: 7801, Steps: 7522, Flavor: FlavorLlamaCpp},
		},
		{
			name:  "llama.cpp labels no model: a filter keeps its series",
			file:  "llamacpp.txt",
			model: "qwen2.5-7b-instruct",
			want:  Snapshot{Running: 4, Waiting: 3, PrefilledTokens: 33065, GenerationTokens: 7801, Steps: 7522, Flavor: FlavorLlamaCpp},
		},
		{
			name: "llama.cpp builds with the KV-cache ratio",
			file: "llamacpp_kv.txt",
			want: Snapshot{Running: 1, Waiting: 0, KVUsage: 0.25, KVReported: true, PrefilledTokens: 512, GenerationTokens: 128, Flavor: FlavorLlamaCpp},
		},
		{
			name: "SGLang with only the pool's size in tokens: pages of one token",
			file: "sglang_pool_tokens.txt",
			want: Snapshot{Running: 5, Waiting: 1, KVUsage: 0.12, KVReported: true, BlockSize: 1, NumBlocks: 470528, Flavor: FlavorSGLang},
		},
		{
			name: "TGI: the batch running, its queue waiting, forward passes as steps",
			file: "tgi.txt",
			want: Snapshot{Running: 12, Waiting: 5, GenerationTokens: 190230, Steps: 81554, Flavor: FlavorTGI},
		},
		{
			name:  "TGI labels no model: a filter keeps its series",
			file:  "tgi.txt",
			model: "meta-llama/Llama-3.1-8B-Instruct",
			want:  Snapshot{Running: 12, Waiting: 5, GenerationTokens: 190230, Steps: 81554, Flavor: FlavorTGI},
		},
		{
			name: "NVIDIA NIM: vLLM's names without the prefix",
			file: "nim.txt",
			want: Snapshot{Running: 7, Waiting: 2, KVUsage: 0.31, KVReported: true, GenerationTokens: 204800, Flavor: FlavorNIM},
		},
		{
			name:  "NVIDIA NIM filtered by its model",
			file:  "nim.txt",
			model: "meta/llama-3.1-8b-instruct",
			want:  Snapshot{Running: 7, Waiting: 2, KVUsage: 0.31, KVReported: true, GenerationTokens: 204800, Flavor: FlavorNIM},
		},
		{
			name: "two models, no filter sums both",
			file: "vllm_two_models.txt",
			want: Snapshot{Running: 8, Waiting: 9, KVUsage: 0.5, KVReported: true, BlockSize: 32, NumBlocks: 1000, Flavor: FlavorVLLM},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(bytes.NewReader(readTestdata(t, tt.file)), tt.model)
			if err != nil {
				t.Fatalf("Parse(%s, %q) error: %v", tt.file, tt.model, err)
			}
			if !snapshotsClose(got, tt.want) {
				t.Errorf("Parse(%s, %q) =\n%+v\nwant\n%+v", tt.file, tt.model, got, tt.want)
			}
		})
	}
}

func snapshotsClose(a, b Snapshot) bool {
	near := func(x, y float64) bool { return math.Abs(x-y) < 1e-9 }
	return near(a.Running, b.Running) && near(a.Waiting, b.Waiting) && near(a.KVUsage, b.KVUsage) &&
		a.KVReported == b.KVReported &&
		near(a.PrefixHits, b.PrefixHits) && near(a.PrefixQueries, b.PrefixQueries) &&
		near(a.GenerationTokens, b.GenerationTokens) && near(a.Steps, b.Steps) && near(a.PrefilledTokens, b.PrefilledTokens) &&
		a.BlockSize == b.BlockSize && a.NumBlocks == b.NumBlocks && a.Flavor == b.Flavor && a.At.Equal(b.At) &&
		a.LoRA == b.LoRA &&
		near(a.StartTime, b.StartTime)
}

// TestParseWork: the counters of the work done (generated tokens, and engine steps as the count of the
// per-step token histogram) are summed over engines, for vLLM and SGLang.
func TestParseWork(t *testing.T) {
	vllm := `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 4
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1000
vllm:generation_tokens_total{engine="1",model_name="m"} 500
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",model_name="m",le="1.0"} 10
vllm:iteration_tokens_total_bucket{engine="0",model_name="m",le="+Inf"} 300
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 90000
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 300
vllm:iteration_tokens_total_bucket{engine="1",model_name="m",le="+Inf"} 200
vllm:iteration_tokens_total_sum{engine="1",model_name="m"} 40000
vllm:iteration_tokens_total_count{engine="1",model_name="m"} 200
`
	got, err := Parse(strings.NewReader(vllm), "m")
	if err != nil || got.GenerationTokens != 1500 || got.Steps != 500 || got.Running != 7 {
		t.Errorf("vLLM: Parse() = %+v, %v; want 1500 generated tokens, 500 steps, 7 running", got, err)
	}
	sglang := "sglang:num_running_reqs{model_name=\"m\"} 2\nsglang:generation_tokens_total{model_name=\"m\"} 42\n"
	got, err = Parse(strings.NewReader(sglang), "")
	if err != nil || got.GenerationTokens != 42 || got.Steps != 0 {
		t.Errorf("SGLang: Parse() = %+v, %v; want 42 generated tokens, steps unknown", got, err)
	}
}

// TestParseFirstTokens: vLLM's and SGLang's time-to-first-token histograms give the first tokens sampled
// and their times summed (count and sum), over engines, in recorded texts of each; a text without the
// histogram gives neither.
func TestParseFirstTokens(t *testing.T) {
	for _, tt := range []struct {
		file         string
		count, total float64
	}{
		{"vllm_v1_two_engines.txt", 314 + 313, 45.25 + 52.5},
		{"vllm_legacy.txt", 100, 21.5},
		{"sglang.txt", 320, 150.5},
		{"llamacpp.txt", 0, 0},
	} {
		got, err := Parse(strings.NewReader(string(readTestdata(t, tt.file))), "")
		if err != nil || got.FirstTokens != tt.count || math.Abs(got.FirstTokenSeconds-tt.total) > 1e-9 {
			t.Errorf("%s: %v first tokens in %v s, %v; want %v in %v", tt.file, got.FirstTokens, got.FirstTokenSeconds, err, tt.count, tt.total)
		}
	}
}

// TestParsePrefillTimes: vLLM's prefill-time and computed-tokens histograms give the finished requests,
// their prefill times and the prompt tokens they computed (counts and sums), summed over engines, for
// the model asked for only; a text without them (an older vLLM, SGLang), or whose two counts differ,
// gives none.
func TestParsePrefillTimes(t *testing.T) {
	// Two engines of model m and one of another model, each histogram's count and sum per engine.
	text := "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1\n"
	for _, h := range []struct {
		name         string
		sums, counts [3]float64
	}{
		{"vllm:request_prefill_time_seconds", [3]float64{12.5, 14.25, 99}, [3]float64{300, 301, 7}},
		{"vllm:request_prefill_kv_computed_tokens", [3]float64{512000, 498000, 70000}, [3]float64{300, 301, 7}},
	} {
		text += "# TYPE " + h.name + " histogram\n"
		for i, labels := range []string{`engine="0",model_name="m"`, `engine="1",model_name="m"`, `engine="0",model_name="other"`} {
			text += fmt.Sprintf("%s_bucket{%s,le=\"+Inf\"} %v\n%s_count{%s} %v\n%s_sum{%s} %v\n",
				h.name, labels, h.counts[i], h.name, labels, h.counts[i], h.name, labels, h.sums[i])
		}
	}
	got, err := Parse(strings.NewReader(text), "m")
	if err != nil || got.PrefillRequests != 601 || math.Abs(got.PrefillSeconds-26.75) > 1e-9 || got.PrefillComputed != 1010000 {
		t.Errorf("model m: %v requests, %v s, %v tokens, %v; want 601, 26.75 s, 1010000", got.PrefillRequests, got.PrefillSeconds, got.PrefillComputed, err)
	}
	mismatched := strings.Replace(text, `vllm:request_prefill_kv_computed_tokens_count{engine="1",model_name="m"} 301`,
		`vllm:request_prefill_kv_computed_tokens_count{engine="1",model_name="m"} 309`, 1)
	if mismatched == text {
		t.Fatal("the count to change is not in the text")
	}
	if got, err := Parse(strings.NewReader(mismatched), "m"); err != nil || got.PrefillRequests != 0 || got.PrefillComputed != 0 {
		t.Errorf("counts that differ: %v requests, %v tokens, %v; want none", got.PrefillRequests, got.PrefillComputed, err)
	}
	for _, file := range []string{"vllm_v1_two_engines.txt", "vllm_legacy.txt", "sglang.txt"} {
		got, err := Parse(strings.NewReader(string(readTestdata(t, file))), "")
		if err != nil || got.PrefillRequests != 0 || got.PrefillSeconds != 0 || got.PrefillComputed != 0 {
			t.Errorf("%s: %v requests, %v s, %v tokens, %v; want none", file, got.PrefillRequests, got.PrefillSeconds, got.PrefillComputed, err)
		}
	}
}

// TestParseFinishedPrompts: vllm:request_prompt_tokens gives the finished requests and their prompt
// tokens (its count and sum), summed over engines, for the model asked for only; a sum that is not a
// finite count gives neither. vllm:prompt_tokens_total gives the prompt tokens prefilled (counted at a
// request's first token), summed the same way; SGLang's counter of that name is counted at a request's
// end, and gives the finished prompts instead.
func TestParseFinishedPrompts(t *testing.T) {
	text := `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{engine="0",model_name="m",le="+Inf"} 10
vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 16000
vllm:request_prompt_tokens_count{engine="0",model_name="m"} 10
vllm:request_prompt_tokens_bucket{engine="1",model_name="m",le="+Inf"} 5
vllm:request_prompt_tokens_sum{engine="1",model_name="m"} 4000
vllm:request_prompt_tokens_count{engine="1",model_name="m"} 5
vllm:request_prompt_tokens_bucket{engine="0",model_name="other",le="+Inf"} 99
vllm:request_prompt_tokens_sum{engine="0",model_name="other"} 99000
vllm:request_prompt_tokens_count{engine="0",model_name="other"} 99
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 19000
vllm:prompt_tokens_total{engine="1",model_name="m"} 5000
vllm:prompt_tokens_total{engine="0",model_name="other"} 99000
`
	got, err := Parse(strings.NewReader(text), "m")
	if err != nil || got.FinishedRequests != 15 || got.FinishedPrompt != 20000 || got.PrefilledPrompt != 24000 {
		t.Errorf("Parse() = %+v, %v; want 15 finished requests of 20000 prompt tokens, 24000 prefilled", got, err)
	}
	bad := strings.Replace(text, "} 4000", "} NaN", 1)
	if got, err := Parse(strings.NewReader(bad), "m"); err != nil || got.FinishedRequests != 0 || got.FinishedPrompt != 0 {
		t.Errorf("Parse() with a NaN sum = %+v, %v; want neither figure", got, err)
	}
	if got, _ := Parse(strings.NewReader(string(readTestdata(t, "vllm_v1_two_engines.txt"))), ""); got.FinishedRequests != 0 {
		t.Errorf("a text without the histogram: %+v, want no finished requests", got)
	}
	if got, err := Parse(strings.NewReader(string(readTestdata(t, "nim.txt"))), ""); err != nil || got.FinishedRequests != 800 || got.FinishedPrompt != 912345 || got.MaxRunning != 256 {
		t.Errorf("NVIDIA NIM: %+v, %v; want 800 finished requests of 912345 prompt tokens and 256 slots reported", got, err)
	}
	if got, _ := Parse(strings.NewReader(string(readTestdata(t, "vllm_v1_two_engines.txt"))), ""); got.MaxRunning != 0 {
		t.Errorf("vLLM reports no slot count, got %v", got.MaxRunning)
	}
}

// TestParseSGLangFinishedPrompts: SGLang counts each finished request and its prompt tokens in two counters,
// summed over data-parallel ranks and filtered by model like the rest; both are needed, and a series that
// is not a number spoils the pair.
func TestParseSGLangFinishedPrompts(t *testing.T) {
	text := `# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="m"} 1
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{dp_rank="0",model_name="m"} 10
sglang:num_requests_total{dp_rank="1",model_name="m"} 5
sglang:num_requests_total{dp_rank="0",model_name="other"} 99
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{dp_rank="0",model_name="m"} 16000
sglang:prompt_tokens_total{dp_rank="1",model_name="m"} 4000
sglang:prompt_tokens_total{dp_rank="0",model_name="other"} 99000
`
	tests := []struct {
		name, text, model string
		requests, prompt  float64
	}{
		{"both counters", text, "m", 15, 20000},
		{"no request counter", strings.ReplaceAll(text, "sglang:num_requests_total", "sglang:other_total"), "m", 0, 0},
		{"a NaN prompt total", strings.Replace(text, "} 4000", "} NaN", 1), "m", 0, 0},
		{"a negative request count", strings.Replace(text, "} 5\n", "} -5\n", 1), "m", 0, 0},
		{"no request counter in a recorded SGLang text", string(readTestdata(t, "sglang.txt")), "", 0, 0},
	}
	for _, tt := range tests {
		got, err := Parse(strings.NewReader(tt.text), tt.model)
		if err != nil || got.Flavor != FlavorSGLang || got.FinishedRequests != tt.requests || got.FinishedPrompt != tt.prompt ||
			got.PrefilledPrompt != 0 {
			t.Errorf("%s: Parse() = %+v, %v; want an SGLang snapshot of %v finished requests of %v prompt tokens, none counted prefilled",
				tt.name, got, err, tt.requests, tt.prompt)
		}
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name      string
		text      string
		model     string
		noMetrics bool // the error must wrap ErrNoMetrics
	}{
		{name: "html garbage", text: string(readTestdata(t, "garbage.txt"))},
		{name: "json", text: `{"error":"not found"}`},
		{name: "binary", text: "\x00\x01\x02\xff\xfe"},
		{name: "truncated label set", text: "vllm:num_requests_running{engine=\"0\",model_name=\"m"},
		{name: "bad value", text: "vllm:num_requests_running 1.2.3\n"},
		{name: "empty", text: "", noMetrics: true},
		{name: "comments only", text: "# HELP x y\n# just a comment\n", noMetrics: true},
		{name: "unrelated metrics", text: "process_open_fds 93\ngo_goroutines 12\n", noMetrics: true},
		{name: "cache info alone is not load", text: "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"10\"} 1\n", noMetrics: true},
		{name: "model filtered out", text: string(readTestdata(t, "vllm_two_models.txt")), model: "mistral", noMetrics: true},
		{name: "only NaN samples", text: "vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n", noMetrics: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(strings.NewReader(tt.text), tt.model)
			if err == nil {
				t.Fatalf("Parse() = %+v, want an error", got)
			}
			if gotNoMetrics := errors.Is(err, ErrNoMetrics); gotNoMetrics != tt.noMetrics {
				t.Errorf("Parse() error = %v; errors.Is(err, ErrNoMetrics) = %v, want %v", err, gotNoMetrics, tt.noMetrics)
			}
		})
	}
}

func TestParseSanitizesValues(t *testing.T) {
	text := `vllm:num_requests_running{engine="0"} -3
vllm:num_requests_running{engine="1"} NaN
vllm:num_requests_waiting 1e308
vllm:num_requests_waiting{engine="1"} 1e308
vllm:kv_cache_usage_perc 1.7
vllm:cache_config_info{block_size="None",num_gpu_blocks="-5"} 1
`
	got, err := Parse(strings.NewReader(text), "")
	if err != nil {
		t.Fatal(err)
	}
	want := Snapshot{Running: 0, Waiting: math.MaxFloat64, KVUsage: 1, KVReported: true, Flavor: FlavorVLLM}
	if got != want {
		t.Errorf("Parse() = %+v, want %+v", got, want)
	}
}

func TestParseUntypedAndBothFlavors(t *testing.T) {
	// No TYPE lines at all, and SGLang series next to vLLM ones: vLLM wins.
	text := "vllm:num_requests_waiting 5\nsglang:num_queue_reqs 7\n"
	got, err := Parse(strings.NewReader(text), "")
	if err != nil {
		t.Fatal(err)
	}
	if got.Flavor != FlavorVLLM || got.Waiting != 5 {
		t.Errorf("Parse() = %+v, want vllm flavor with 5 waiting", got)
	}
}

func TestHitRate(t *testing.T) {
	t0 := time.Unix(1000, 0)
	t1 := t0.Add(time.Second)
	tests := []struct {
		name      string
		prev, cur Snapshot
		want      float64
		wantOK    bool
	}{
		{"half", Snapshot{PrefixHits: 10, PrefixQueries: 100, At: t0}, Snapshot{PrefixHits: 60, PrefixQueries: 200, At: t1}, 0.5, true},
		{"no queries", Snapshot{PrefixHits: 10, PrefixQueries: 100, At: t0}, Snapshot{PrefixHits: 10, PrefixQueries: 100, At: t1}, 0, false},
		{"counter reset", Snapshot{PrefixHits: 10, PrefixQueries: 100, At: t0}, Snapshot{PrefixHits: 1, PrefixQueries: 5, At: t1}, 0, false},
		{"not newer", Snapshot{PrefixHits: 10, PrefixQueries: 100, At: t1}, Snapshot{PrefixHits: 60, PrefixQueries: 200, At: t1}, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := HitRate(tt.prev, tt.cur)
			if got != tt.want || ok != tt.wantOK {
				t.Errorf("HitRate() = %v, %v, want %v, %v", got, ok, tt.want, tt.wantOK)
			}
		})
	}
}

func FuzzParse(f *testing.F) {
	for _, name := range []string{"vllm_v1_two_engines.txt", "vllm_legacy.txt", "sglang.txt", "sglang_gauges.txt", "vllm_two_models.txt", "vllm_lora.txt", "llamacpp.txt", "llamacpp_kv.txt", "nim.txt", "tgi.txt", "sglang_pool_tokens.txt", "garbage.txt"} {
		f.Add(readTestdata(f, name), "")
	}
	f.Fuzz(func(t *testing.T, text []byte, model string) {
		samePage(t, text, model) // the filter changes nothing that parses whole
		s, err := Parse(bytes.NewReader(text), model)
		if err != nil {
			return
		}
		if !slices.Contains([]string{FlavorVLLM, FlavorSGLang, FlavorLlamaCpp, FlavorNIM, FlavorTGI}, s.Flavor) {
			t.Errorf("Flavor = %q", s.Flavor)
		}
		for name, v := range map[string]float64{"Running": s.Running, "Waiting": s.Waiting, "PrefixHits": s.PrefixHits, "PrefixQueries": s.PrefixQueries} {
			if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
				t.Errorf("%s = %v, want finite and non-negative", name, v)
			}
		}
		if !(s.KVUsage >= 0 && s.KVUsage <= 1) {
			t.Errorf("KVUsage = %v, want in [0, 1]", s.KVUsage)
		}
		if s.LoRA.MaxLoRA < 0 || s.LoRA.MaxLoRA > maxBlocks || !s.LoRA.Reported() && s.LoRA != (LoRA{}) {
			t.Errorf("LoRA = %+v out of range", s.LoRA)
		}
		for _, list := range []string{s.LoRA.Running, s.LoRA.Waiting} {
			names := strings.Split(list, ",")
			if list != "" && (len(names) > maxAdapters || !slices.IsSorted(names) || len(slices.Compact(slices.Clone(names))) != len(names) || slices.Contains(names, "")) {
				t.Errorf("adapter list %q is not a sorted list of at most %d distinct names", list, maxAdapters)
			}
		}
		if s.BlockSize < 0 || s.NumBlocks < 0 || s.BlockSize > maxBlocks || s.NumBlocks > maxBlocks {
			t.Errorf("geometry = %d x %d out of range", s.BlockSize, s.NumBlocks)
		}
	})
}

func BenchmarkParseVLLM(b *testing.B) {
	text := readTestdata(b, "vllm_v1_two_engines.txt")
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Parse(bytes.NewReader(text), "meta-llama/Llama-3.1-8B-Instruct"); err != nil {
			b.Fatal(err)
		}
	}
}
