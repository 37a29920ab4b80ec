// Package caddysim registers the simulated vLLM server (package vllmsim) as the Caddy HTTP handler
// http.handlers.vllm_sim, so a Caddyfile can stand up simulated backends next to the balancer in one
// process (the demo and the benchmark). Only this repository's cmd/caddy imports it: production builds
// of the plugin do not get it.
package caddysim

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

func init() {
	caddy.RegisterModule(Handler{})
	httpcaddyfile.RegisterHandlerDirective("vllm_sim", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("vllm_sim", httpcaddyfile.Before, "respond")
}

// engines holds the simulators of every provisioned Handler, keyed by engineKey, so that a reload
// keeps a backend that did not change: its KV cache, counters and in-flight streams live on, as a real
// vLLM server's would when only the proxy in front of it reloads. Each Provision takes one reference
// (LoadOrNew) and its Cleanup drops exactly that one (Delete); the last Delete closes the engine.
var engines = caddy.NewUsagePool()

// engine is a pooled simulator; the pool closes it when its last user is cleaned up.
type engine struct{ *vllmsim.Server }

// Destruct stops the engine goroutine, ending whatever requests still run on it.
func (e engine) Destruct() error {
	e.Close()
	return nil
}

// Handler answers every request it gets with a simulated vLLM server: the OpenAI API under /v1/,
// /health and /metrics. It is terminal (it never calls the next handler).
//
// A simulator's identity is the server it is configured in (its listener addresses) plus a hash of
// its settings. A reload that keeps both keeps the same running simulator, with its cache and its
// in-flight streams; changing either starts a fresh one and closes the old one once the old config is
// cleaned up (its in-flight requests then end with an error). Two vllm_sim handlers with identical
// settings in one server are one simulator; give one a different seed to keep them apart. A handler
// provisioned outside an HTTP server (a unit test) gets a simulator of its own.
//
// Safe for concurrent use; memory is bounded as documented on vllmsim.Server.
type Handler struct {
	// Model is the served model name. Default: "sim-model".
	Model string `json:"model,omitempty"`
	// MaxNumSeqs is how many sequences run at once (continuous batching). Default: 64.
	MaxNumSeqs int `json:"max_num_seqs,omitempty"`
	// MaxQueue limits the waiting queue; requests beyond it get 429. Default: 0, unlimited.
	MaxQueue int `json:"max_queue,omitempty"`
	// BlockSize is the KV cache block size in tokens. Default: 16.
	BlockSize int `json:"block_size,omitempty"`
	// NumGPUBlocks is the KV cache capacity in blocks. Default: 4096.
	NumGPUBlocks int `json:"num_gpu_blocks,omitempty"`
	// MaxNumBatchedTokens is the token budget of one engine step (chunked prefill). Default: 8192;
	// -1 is unlimited.
	MaxNumBatchedTokens int `json:"max_num_batched_tokens,omitempty"`
	// PrefillTokensPerSec is the prefill speed for uncached prompt tokens. Default: 8000.
	PrefillTokensPerSec float64 `json:"prefill_tokens_per_sec,omitempty"`
	// DecodeStep is the decode step time with one running sequence. Default: 30ms.
	DecodeStep caddy.Duration `json:"decode_step,omitempty"`
	// DecodeStepPerSeq is added to the step time per running sequence. Default: 250µs.
	DecodeStepPerSeq caddy.Duration `json:"decode_step_per_seq,omitempty"`
	// AttentionTokens makes a prefill token's cost grow with its position p, 1 + p/AttentionTokens times
	// the linear one, as attention's does (~30000 for an 8B model). Default: 0, off.
	AttentionTokens int `json:"attention_tokens,omitempty"`
	// DecodeStepPerKToken is added to a step for every 1,000 tokens of context its decodes read.
	// Default: 0, off.
	DecodeStepPerKToken caddy.Duration `json:"decode_step_per_ktoken,omitempty"`
	// Schedule orders the waiting queue: "fcfs" (vLLM's) or "lpm" (SGLang's longest prefix match).
	// Default: fcfs.
	Schedule string `json:"schedule,omitempty"`
	// SeparatePrefill runs prefill steps apart from decode steps, as SGLang does without mixed chunks.
	SeparatePrefill bool `json:"separate_prefill,omitempty"`
	// TimeScale divides every simulated duration: 10 runs ten times faster than real time. Default: 1.
	TimeScale float64 `json:"time_scale,omitempty"`
	// TokensPerChunk is the number of output tokens per streamed chunk. Default: 1, like vLLM.
	TokensPerChunk int `json:"tokens_per_chunk,omitempty"`
	// Metrics selects the /metrics names: "vllm" (default), "vllm-legacy", "sglang", "llamacpp", "nim" or "tgi".
	Metrics string `json:"metrics,omitempty"`
	// ErrorRate is the fraction of completion requests answered 500. Default: 0.
	ErrorRate float64 `json:"error_rate,omitempty"`
	// DropMidStreamRate is the fraction of streams whose connection drops mid-stream. Default: 0.
	DropMidStreamRate float64 `json:"drop_mid_stream_rate,omitempty"`
	// CutStreamAfter drops every stream's connection after this many output tokens (streams no longer
	// than that are untouched). A request's "X-Sim-Cut-After: <n>" header does the same for it. Default:
	// 0, never.
	CutStreamAfter int `json:"cut_stream_after,omitempty"`
	// MetricsDelay makes /metrics wait this long (wall clock) before answering. Default: 0.
	MetricsDelay caddy.Duration `json:"metrics_delay,omitempty"`
	// MetricsFail makes /metrics answer 500.
	MetricsFail bool `json:"metrics_fail,omitempty"`
	// Seed seeds the fault RNG. Default: 0.
	Seed int64 `json:"seed,omitempty"`
	// LoRAAdapters are the LoRA adapters served besides Model, each under its own model name. A request
	// for an adapter that is not in one of MaxLoRAs slots loads it (LoRALoadTime, stalling the batch),
	// evicting the least recently used idle one. Default: none (no vllm:lora_requests_info metric).
	LoRAAdapters []string `json:"lora_adapters,omitempty"`
	// MaxLoRAs is the number of adapter slots. Default: 1 with adapters.
	MaxLoRAs int `json:"max_loras,omitempty"`
	// LoRALoadTime is the simulated time to load an adapter. Default: 200ms with adapters.
	LoRALoadTime caddy.Duration `json:"lora_load_time,omitempty"`

	server  *vllmsim.Server
	poolKey string // engineKey when the simulator is pooled; Cleanup deletes it
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.vllm_sim",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Config converts the handler's fields to a vllmsim.Config.
func (h *Handler) Config() vllmsim.Config {
	return vllmsim.Config{
		Model:               h.Model,
		MaxNumSeqs:          h.MaxNumSeqs,
		MaxQueue:            h.MaxQueue,
		BlockSize:           h.BlockSize,
		NumGPUBlocks:        h.NumGPUBlocks,
		MaxNumBatchedTokens: h.MaxNumBatchedTokens,
		PrefillTokensPerSec: h.PrefillTokensPerSec,
		DecodeStep:          time.Duration(h.DecodeStep),
		DecodeStepPerSeq:    time.Duration(h.DecodeStepPerSeq),
		AttentionTokens:     h.AttentionTokens,
		DecodeStepPerKToken: time.Duration(h.DecodeStepPerKToken),
		Schedule:            h.Schedule,
		SeparatePrefill:     h.SeparatePrefill,
		TimeScale:           h.TimeScale,
		TokensPerChunk:      h.TokensPerChunk,
		Metrics:             h.Metrics,
		ErrorRate:           h.ErrorRate,
		DropMidStreamRate:   h.DropMidStreamRate,
		CutStreamAfter:      h.CutStreamAfter,
		MetricsDelay:        time.Duration(h.MetricsDelay),
		MetricsFail:         h.MetricsFail,
		Seed:                h.Seed,
		LoRAAdapters:        h.LoRAAdapters,
		MaxLoRAs:            h.MaxLoRAs,
		LoRALoadTime:        time.Duration(h.LoRALoadTime),
	}
}

// Provision finds the simulator this handler's server and settings already run, or starts one (its
// engine goroutine; the last Cleanup stops it). Configuration errors are returned, never panicked.
func (h *Handler) Provision(ctx caddy.Context) error {
	srv, _ := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if srv == nil {
		s, err := vllmsim.New(h.Config())
		if err != nil {
			return fmt.Errorf("provisioning vllm_sim: %w", err)
		}
		h.server = s
		return nil
	}
	key, err := h.engineKey(srv.Listen)
	if err != nil {
		return fmt.Errorf("provisioning vllm_sim: %w", err)
	}
	v, _, err := engines.LoadOrNew(key, func() (caddy.Destructor, error) {
		s, err := vllmsim.New(h.Config())
		if err != nil {
			return nil, err
		}
		return engine{s}, nil
	})
	if err != nil {
		return fmt.Errorf("provisioning vllm_sim: %w", err)
	}
	h.server, h.poolKey = v.(engine).Server, key
	return nil
}

// engineKey names a simulator by the listener addresses of its server and a hash of the handler's
// settings (its JSON).
func (h *Handler) engineKey(listen []string) (string, error) {
	settings, err := json.Marshal(h)
	if err != nil {
		return "", fmt.Errorf("hashing settings: %w", err)
	}
	sum := sha256.Sum256(settings)
	addrs := slices.Sorted(slices.Values(listen))
	return strings.Join(addrs, ",") + "/" + hex.EncodeToString(sum[:16]), nil
}

// Cleanup releases this handler's use of its simulator; the last user's Cleanup stops it.
func (h *Handler) Cleanup() error {
	if h.poolKey != "" {
		key := h.poolKey
		h.poolKey = ""
		_, err := engines.Delete(key)
		return err
	}
	if h.server != nil {
		h.server.Close()
	}
	return nil
}

// Server returns the simulator, for tests and introspection; nil before Provision.
func (h *Handler) Server() *vllmsim.Server { return h.server }

// ServeHTTP answers the request with the simulator; it never calls next.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	h.server.ServeHTTP(w, r)
	return nil
}

func parseCaddyfile(helper httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	h := new(Handler)
	err := h.UnmarshalCaddyfile(helper.Dispenser)
	return h, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	vllm_sim [<model>] {
//		model                  <name>
//		max_num_seqs           <n>
//		max_queue              <n>
//		block_size             <tokens>
//		num_gpu_blocks         <n>
//		max_num_batched_tokens <n>
//		prefill_tokens_per_sec <tokens/s>
//		decode_step            <duration>
//		decode_step_per_seq    <duration>
//		attention_tokens       <tokens>
//		decode_step_per_ktoken <duration>
//		schedule               fcfs|lpm
//		separate_prefill
//		time_scale             <factor>
//		tokens_per_chunk       <n>
//		metrics                vllm|vllm-legacy|sglang|llamacpp|nim|tgi
//		error_rate             <0..1>
//		drop_mid_stream_rate   <0..1>
//		cut_stream_after       <tokens>
//		metrics_delay          <duration>
//		metrics_fail
//		seed                   <n>
//		lora_adapters          <name...>
//		max_loras              <n>
//		lora_load_time         <duration>
//	}
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	if d.NextArg() {
		h.Model = d.Val()
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := map[string]bool{}
	for d.NextBlock(0) {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("%s already specified", opt)
		}
		seen[opt] = true
		if flag := map[string]*bool{"metrics_fail": &h.MetricsFail, "separate_prefill": &h.SeparatePrefill}[opt]; flag != nil {
			if d.NextArg() {
				return d.ArgErr()
			}
			*flag = true
			continue
		}
		if opt == "lora_adapters" {
			h.LoRAAdapters = d.RemainingArgs()
			if len(h.LoRAAdapters) == 0 {
				return d.ArgErr()
			}
			continue
		}
		var arg string
		if !d.Args(&arg) {
			return d.ArgErr()
		}
		if d.NextArg() {
			return d.ArgErr()
		}
		intArg := func(dst *int) error {
			n, err := strconv.Atoi(arg)
			if err != nil {
				return d.Errf("%s: invalid integer %q", opt, arg)
			}
			*dst = n
			return nil
		}
		floatArg := func(dst *float64) error {
			f, err := strconv.ParseFloat(arg, 64)
			if err != nil {
				return d.Errf("%s: invalid number %q", opt, arg)
			}
			*dst = f
			return nil
		}
		durationArg := func(dst *caddy.Duration) error {
			v, err := caddy.ParseDuration(arg)
			if err != nil {
				return d.Errf("%s: invalid duration %q: %v", opt, arg, err)
			}
			*dst = caddy.Duration(v)
			return nil
		}
		var err error
		switch opt {
		case "model":
			if h.Model != "" {
				return d.Err("model already specified")
			}
			h.Model = arg
		case "max_num_seqs":
			err = intArg(&h.MaxNumSeqs)
		case "max_queue":
			err = intArg(&h.MaxQueue)
		case "block_size":
			err = intArg(&h.BlockSize)
		case "num_gpu_blocks":
			err = intArg(&h.NumGPUBlocks)
		case "max_num_batched_tokens":
			err = intArg(&h.MaxNumBatchedTokens)
		case "prefill_tokens_per_sec":
			err = floatArg(&h.PrefillTokensPerSec)
		case "decode_step":
			err = durationArg(&h.DecodeStep)
		case "decode_step_per_seq":
			err = durationArg(&h.DecodeStepPerSeq)
		case "attention_tokens":
			err = intArg(&h.AttentionTokens)
		case "decode_step_per_ktoken":
			err = durationArg(&h.DecodeStepPerKToken)
		case "schedule":
			h.Schedule = arg
		case "time_scale":
			err = floatArg(&h.TimeScale)
		case "tokens_per_chunk":
			err = intArg(&h.TokensPerChunk)
		case "metrics":
			h.Metrics = arg
		case "error_rate":
			err = floatArg(&h.ErrorRate)
		case "drop_mid_stream_rate":
			err = floatArg(&h.DropMidStreamRate)
		case "cut_stream_after":
			err = intArg(&h.CutStreamAfter)
		case "metrics_delay":
			err = durationArg(&h.MetricsDelay)
		case "max_loras":
			err = intArg(&h.MaxLoRAs)
		case "lora_load_time":
			err = durationArg(&h.LoRALoadTime)
		case "seed":
			n, perr := strconv.ParseInt(arg, 10, 64)
			if perr != nil {
				return d.Errf("seed: invalid integer %q", arg)
			}
			h.Seed = n
		default:
			return d.Errf("unrecognized option '%s'", opt)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
	_ caddyfile.Unmarshaler       = (*Handler)(nil)
)
