package vllmsim

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// Config shapes one simulated server. The zero value of every field selects the default named in its
// comment, so Config{} is a valid, vLLM-like single-GPU server.
//
// MaxQueue counts the requests waiting beyond the free sequence slots: with MaxNumSeqs 1 busy and
// MaxQueue 1, one more request waits and the next gets 429. A request whose prompt and output cannot
// fit in the whole KV cache gets 400, like vLLM's max_model_len check. MetricsDelay is wall-clock
// time (not scaled); every engine duration is divided by TimeScale.
type Config struct {
	Model               string        // served model name, default "sim-model"
	MaxNumSeqs          int           // running sequences (continuous batching), default 64
	MaxQueue            int           // waiting-queue limit; a request that would exceed it gets 429; 0 = unlimited
	BlockSize           int           // KV block size in tokens, default 16
	NumGPUBlocks        int           // KV cache capacity in blocks, default 4096
	PrefillTokensPerSec float64       // default 8000
	DecodeStep          time.Duration // decode step time at batch size 1, default 30ms
	DecodeStepPerSeq    time.Duration // added per running sequence, default 0.25ms (step time grows with batch)
	TimeScale           float64       // >1 runs faster than real time: every simulated duration is divided by it; default 1
	TokensPerChunk      int           // output tokens per SSE chunk (default 1 = like vLLM); lets benchmarks save CPU
	Metrics             string        // "vllm" (default), "vllm-legacy" (gpu_cache_usage_perc, gpu_prefix_cache_*), "sglang", "llamacpp", "nim", "tgi"
	ErrorRate           float64       // fraction of requests answered 500 (seeded RNG)
	DropMidStreamRate   float64       // fraction of streams whose connection is dropped mid-stream (panic(http.ErrAbortHandler))
	CutStreamAfter      int           // drop every stream's connection after this many output tokens (if it has more); 0 = never
	MetricsDelay        time.Duration // /metrics handler sleeps this long (slow metrics fault)
	MetricsFail         bool          // /metrics answers 500
	Seed                int64

	// LoRAAdapters are the names of the LoRA adapters served besides Model (vLLM's --lora-modules): a
	// request naming one runs with that adapter, which must be in one of MaxLoRAs GPU slots. Admitting a
	// request whose adapter is not resident loads it into a free slot, or into the slot of the least
	// recently used adapter no running request uses, and the engine step that admits it lasts
	// LoRALoadTime longer (vLLM loads adapters synchronously, stalling the batch). A request whose adapter
	// finds no slot waits and is skipped, as vLLM's scheduler does, until one frees. With adapters,
	// /metrics exports vllm:lora_requests_info. Default: none.
	LoRAAdapters []string
	// MaxLoRAs is the number of adapter slots (vLLM's --max-loras). Default 1 when LoRAAdapters is set.
	MaxLoRAs int
	// LoRALoadTime is the simulated time to load an adapter into a slot. Default 200ms.
	LoRALoadTime time.Duration

	// MaxNumBatchedTokens is the token budget of one engine step (vLLM's max_num_batched_tokens with
	// chunked prefill): decodes take one token each, prefills share the rest, and a long prompt is
	// prefilled over several steps while running sequences keep decoding. Default 8192; -1 = unlimited.
	MaxNumBatchedTokens int

	// AttentionTokens makes prefill cost grow with context, as attention's does on a GPU: a prompt token
	// at position p costs (1 + p/AttentionTokens) times 1/PrefillTokensPerSec, so with 32768 a 32k-token
	// prompt prefilled whole takes 1.5x its linear time and 2k tokens appended behind 30k of cached
	// context 1.9x. A token at position p costs attention about 4·L·D·p FLOPs (L layers of width D) and
	// the rest of the model 2N (N parameters): equal at p = N/(2·L·D), ~30k tokens for an 8B model and
	// ~50k for a 70B one. 0 = off: every prompt token costs the same.
	AttentionTokens int
	// DecodeStepPerKToken is added to a step for every 1,000 tokens of context its decodes read: a decode
	// reads its sequence's whole KV cache, so a memory-bound step slows with the batch's context, not only
	// with its size (an 8B model's 128 KB of KV per token is ~0.25 ms per 1k tokens at the 0.5 TB/s a 30 ms
	// step implies). 0 = off.
	DecodeStepPerKToken time.Duration

	// Schedule orders the waiting queue: "fcfs" (default, vLLM's) admits in arrival order; "lpm"
	// (SGLang's --schedule-policy lpm, longest prefix match, the default of its earlier releases) admits
	// the requests with the longest prefix cached first, arrival order among equals, and falls back to
	// arrival order while more than LPMQueueLimit wait (SGLang does the same: sorting a long queue costs
	// more than it saves).
	Schedule string
	// SeparatePrefill runs prefill steps apart from decode steps, as SGLang does without
	// --enable-mixed-chunk: while a prompt waits to be admitted or a chunked prefill is unfinished, a step
	// prefills only and the running sequences decode nothing. Default false: vLLM's steps mix decodes
	// and prefill chunks.
	SeparatePrefill bool
}

// Waiting-queue orders accepted in Config.Schedule.
const (
	ScheduleFCFS = "fcfs"
	ScheduleLPM  = "lpm"
)

// LPMQueueLimit is the longest waiting queue Schedule "lpm" sorts (SGLang's
// _schedule_policy cut-off, 128): beyond it, arrival order.
const LPMQueueLimit = 128

// Faults are the failure knobs that can change while a server runs (see Server.SetFaults).
type Faults struct {
	ErrorRate, DropMidStreamRate float64
	CutStreamAfter               int
	MetricsDelay                 time.Duration
	MetricsFail                  bool
}

// Metrics flavours accepted in Config.Metrics.
const (
	MetricsVLLM       = "vllm"
	MetricsVLLMLegacy = "vllm-legacy"
	MetricsSGLang     = "sglang"
	// MetricsLlamaCpp is llama.cpp's llama-server with --metrics: busy slots, deferred requests, token
	// and decode counters, no model label, no prefix-cache counters.
	MetricsLlamaCpp = "llamacpp"
	// MetricsNIM is NVIDIA NIM for LLMs (served at /metrics here, /v1/metrics by NIM): vLLM's names
	// without the prefix, and num_request_max, the slot count.
	MetricsNIM = "nim"
	// MetricsTGI is Hugging Face's text-generation-inference: the batch running, the queue, forward
	// passes per method, per-request histograms; no model label, no KV-cache or prefix-cache figures.
	MetricsTGI = "tgi"
)

// MetricsFlavours lists every flavour Config.Metrics accepts.
var MetricsFlavours = []string{MetricsVLLM, MetricsVLLMLegacy, MetricsSGLang, MetricsLlamaCpp, MetricsNIM, MetricsTGI}

// defaultMaxTokens is the output length of a request that names neither max_tokens nor
// max_completion_tokens.
const defaultMaxTokens = 64

// withDefaults returns cfg with defaults filled in, or an error for values out of range.
func (cfg Config) withDefaults() (Config, error) {
	if cfg.Model == "" {
		cfg.Model = "sim-model"
	}
	setInt := func(v *int, def int) {
		if *v == 0 {
			*v = def
		}
	}
	setInt(&cfg.MaxNumSeqs, 64)
	setInt(&cfg.BlockSize, 16)
	setInt(&cfg.NumGPUBlocks, 4096)
	setInt(&cfg.TokensPerChunk, 1)
	setInt(&cfg.MaxNumBatchedTokens, 8192)
	if cfg.PrefillTokensPerSec == 0 {
		cfg.PrefillTokensPerSec = 8000
	}
	if cfg.DecodeStep == 0 {
		cfg.DecodeStep = 30 * time.Millisecond
	}
	if cfg.DecodeStepPerSeq == 0 {
		cfg.DecodeStepPerSeq = 250 * time.Microsecond
	}
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1
	}
	if cfg.Metrics == "" {
		cfg.Metrics = MetricsVLLM
	}
	if cfg.Schedule == "" {
		cfg.Schedule = ScheduleFCFS
	}
	if len(cfg.LoRAAdapters) > 0 {
		setInt(&cfg.MaxLoRAs, 1)
		if cfg.LoRALoadTime == 0 {
			cfg.LoRALoadTime = 200 * time.Millisecond
		}
	}

	var errs []error
	positive := func(name string, v int) {
		if v < 0 {
			errs = append(errs, fmt.Errorf("%s must not be negative, got %d", name, v))
		}
	}
	positive("max_num_seqs", cfg.MaxNumSeqs)
	positive("max_queue", cfg.MaxQueue)
	positive("block_size", cfg.BlockSize)
	positive("num_gpu_blocks", cfg.NumGPUBlocks)
	positive("tokens_per_chunk", cfg.TokensPerChunk)
	positive("cut_stream_after", cfg.CutStreamAfter)
	positive("max_loras", cfg.MaxLoRAs)
	positive("attention_tokens", cfg.AttentionTokens)
	if cfg.Schedule != ScheduleFCFS && cfg.Schedule != ScheduleLPM {
		errs = append(errs, fmt.Errorf("schedule must be %s or %s, got %q", ScheduleFCFS, ScheduleLPM, cfg.Schedule))
	}
	if cfg.DecodeStepPerKToken < 0 {
		errs = append(errs, errors.New("decode_step_per_ktoken must not be negative"))
	}
	if cfg.LoRALoadTime < 0 {
		errs = append(errs, errors.New("lora_load_time must not be negative"))
	}
	for i, name := range cfg.LoRAAdapters {
		switch {
		case name == "" || strings.ContainsAny(name, ",\"\\\n"):
			errs = append(errs, fmt.Errorf("lora adapter name %q: must be non-empty, without commas, quotes, backslashes or newlines", name))
		case name == cfg.Model || slices.Contains(cfg.LoRAAdapters[:i], name):
			errs = append(errs, fmt.Errorf("lora adapter name %q given twice (or equal to the model)", name))
		}
	}
	if cfg.MaxNumBatchedTokens < -1 {
		errs = append(errs, fmt.Errorf("max_num_batched_tokens must be positive or -1, got %d", cfg.MaxNumBatchedTokens))
	}
	if cfg.BlockSize > 4096 {
		errs = append(errs, fmt.Errorf("block_size must be at most 4096, got %d", cfg.BlockSize))
	}
	if cfg.NumGPUBlocks > math.MaxInt32 {
		errs = append(errs, fmt.Errorf("num_gpu_blocks too large: %d", cfg.NumGPUBlocks))
	}
	if !(cfg.PrefillTokensPerSec > 0) || math.IsInf(cfg.PrefillTokensPerSec, 0) {
		errs = append(errs, fmt.Errorf("prefill_tokens_per_sec must be positive, got %v", cfg.PrefillTokensPerSec))
	}
	if cfg.DecodeStep < 0 || cfg.DecodeStepPerSeq < 0 || cfg.MetricsDelay < 0 {
		errs = append(errs, errors.New("durations must not be negative"))
	}
	if !(cfg.TimeScale > 0) || math.IsInf(cfg.TimeScale, 0) {
		errs = append(errs, fmt.Errorf("time_scale must be positive, got %v", cfg.TimeScale))
	}
	if !slices.Contains(MetricsFlavours, cfg.Metrics) {
		errs = append(errs, fmt.Errorf("unknown metrics flavour %q (want one of %s)", cfg.Metrics, strings.Join(MetricsFlavours, ", ")))
	}
	if err := validRate("error_rate", cfg.ErrorRate); err != nil {
		errs = append(errs, err)
	}
	if err := validRate("drop_mid_stream_rate", cfg.DropMidStreamRate); err != nil {
		errs = append(errs, err)
	}
	return cfg, errors.Join(errs...)
}

func validRate(name string, v float64) error {
	if !(v >= 0 && v <= 1) {
		return fmt.Errorf("%s must be in [0, 1], got %v", name, v)
	}
	return nil
}
