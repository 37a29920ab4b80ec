package main

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

// regime is a named backend configuration of the matrix: the engine parameters of every backend
// of a cluster, so that a cluster can mix backends (hetero).
type regime struct {
	Name string
	// Description says what the regime stands for, for the reports.
	Description string
	// backend returns the engine parameters of backend i (of n). TimeScale and TokensPerChunk are
	// the run's (how fast the simulation runs, not what it simulates) and are set by build.
	backend func(i, n int) simSettings
}

// build returns the settings of n backends under the regime, running at base's time scale and
// SSE chunking, with base's /metrics dialect unless the regime names its engine's own.
func (r regime) build(n int, base simSettings) []simSettings {
	out := make([]simSettings, n)
	for i := range out {
		s := r.backend(i, n)
		s.TimeScale, s.TokensPerChunk = base.TimeScale, base.TokensPerChunk
		if s.Metrics == "" { // a regime of another engine keeps that engine's /metrics
			s.Metrics = base.Metrics
		}
		out[i] = s
	}
	return out
}

// uniform is a regime whose backends are all alike.
func uniform(s simSettings) func(i, n int) simSettings {
	return func(int, int) simSettings { return s }
}

// slowerSim is defaultSim f times slower in everything: prefill, decode steps and what each sequence
// adds to a step (a slower GPU running the same engine).
func slowerSim(f float64) simSettings {
	return withSim(func(s *simSettings) {
		s.PrefillTokensPerSec /= f
		s.DecodeStep = time.Duration(float64(s.DecodeStep) * f)
		s.DecodeStepPerSeq = time.Duration(float64(s.DecodeStepPerSeq) * f)
	})
}

// withSim returns defaultSim changed by f.
func withSim(f func(*simSettings)) simSettings {
	s := defaultSim
	f(&s)
	return s
}

// regimes are the backend configurations of the matrix, in report order. Each differs from
// default in one respect, except small-batch, which is a different engine altogether: the one a
// new user tried the policy on (issue 9).
var regimes = []regime{
	{
		Name:        "small-batch",
		Description: "max_num_seqs 8, no chunked prefill (a prompt is prefilled in one step that stalls decodes), 3.3k prefill tok/s (300 µs/token), decode step 18 ms",
		backend: uniform(withSim(func(s *simSettings) {
			s.MaxNumSeqs, s.MaxNumBatchedTokens = 8, -1
			s.PrefillTokensPerSec, s.DecodeStep = 3300, 18*time.Millisecond
		})),
	},
	{
		Name:        "default",
		Description: "the bench's usual simulator: max_num_seqs 64, chunked prefill 8192 tokens, 8k prefill tok/s, decode step 30 ms + 0.25 ms/seq, 32k-token KV cache",
		backend:     uniform(defaultSim),
	},
	{
		Name:        "large-batch",
		Description: "max_num_seqs 256, 256k-token KV cache (16384 blocks)",
		backend: uniform(withSim(func(s *simSettings) {
			s.MaxNumSeqs, s.NumGPUBlocks = 256, 16384
		})),
	},
	{
		Name:        "hetero",
		Description: "default, but the last backend is 3x slower (2.7k prefill tok/s, decode step 90 ms + 0.75 ms/seq)",
		backend: func(i, n int) simSettings {
			if i < n-1 {
				return defaultSim
			}
			return slowerSim(3)
		},
	},
	{
		Name:        "kv-pressure",
		Description: "default with an 8k-token KV cache (512 blocks): far smaller than every workload's working set",
		backend: uniform(withSim(func(s *simSettings) {
			s.NumGPUBlocks = 512
		})),
	},
	{
		Name:        "fast-prefill",
		Description: "default with 20k prefill tok/s",
		backend: uniform(withSim(func(s *simSettings) {
			s.PrefillTokensPerSec = 20000
		})),
	},
	{
		Name:        "slow-prefill",
		Description: "default with 2k prefill tok/s",
		backend: uniform(withSim(func(s *simSettings) {
			s.PrefillTokensPerSec = 2000
		})),
	},
}

// extraRegimes are fleets beyond the matrix's seven, run only when named (-regimes extra, or by name):
// the spread of real fleets the policy was not built on (max_num_seqs 16 to 1024, chunked prefill on or
// off, GPUs 5x apart, mixed pools), each unlike any of the seven in one more respect. No default of the
// policy was chosen on them.
var extraRegimes = []regime{
	{
		Name: "mixed-pool",
		Description: "two kinds of engine in one pool: backends 0 and 2 as small-batch but max_num_seqs 16 " +
			"(no chunked prefill, 3.3k prefill tok/s, decode step 18 ms), 1 and 3 as large-batch (max_num_seqs 256, chunked, 8k tok/s, 256k-token KV cache)",
		backend: func(i, n int) simSettings {
			if i%2 == 0 {
				return withSim(func(s *simSettings) {
					s.MaxNumSeqs, s.MaxNumBatchedTokens = 16, -1
					s.PrefillTokensPerSec, s.DecodeStep = 3300, 18*time.Millisecond
				})
			}
			return withSim(func(s *simSettings) {
				s.MaxNumSeqs, s.NumGPUBlocks = 256, 16384
			})
		},
	},
	{
		Name:        "hetero-5x",
		Description: "default, but the last two backends 5x slower (1.6k prefill tok/s, decode step 150 ms + 1.25 ms/seq)",
		backend: func(i, n int) simSettings {
			if i < n/2 {
				return defaultSim
			}
			return slowerSim(5)
		},
	},
	{
		Name: "long-context",
		Description: "default, with costs that grow with context as a GPU's do: a prefill token at position p costs " +
			"1 + p/32768 times the linear one (an 8B model's attention), and a decode step takes 0.25 ms more per 1k tokens of context it reads",
		backend: uniform(withSim(func(s *simSettings) {
			s.AttentionTokens, s.DecodeStepPerKToken = 32768, 250*time.Microsecond
		})),
	},
	{
		Name: "sglang",
		Description: "default's speed and cache on SGLang's scheduler: the waiting queue admitted longest cached prefix first " +
			"(schedule lpm), prefill steps apart from decode steps (no mixed chunks), /metrics as SGLang's",
		backend: uniform(withSim(func(s *simSettings) {
			s.Schedule, s.SeparatePrefill, s.Metrics = vllmsim.ScheduleLPM, true, vllmsim.MetricsSGLang
		})),
	},
	{
		Name:        "huge-batch",
		Description: "max_num_seqs 1024, 256k-token KV cache, decode step 30 ms + 0.1 ms/seq",
		backend: uniform(withSim(func(s *simSettings) {
			s.MaxNumSeqs, s.NumGPUBlocks, s.DecodeStepPerSeq = 1024, 16384, 100*time.Microsecond
		})),
	},
}

// regimeNames lists the regimes in report order.
func regimeNames() []string {
	names := make([]string, len(regimes))
	for i, r := range regimes {
		names[i] = r.Name
	}
	return names
}

// extraRegimeNames lists extraRegimes.
func extraRegimeNames() []string {
	names := make([]string, len(extraRegimes))
	for i, r := range extraRegimes {
		names[i] = r.Name
	}
	return names
}

// findRegime returns the named regime, of the matrix's or extraRegimes.
func findRegime(name string) (regime, error) {
	for _, r := range slices.Concat(regimes, extraRegimes) {
		if r.Name == name {
			return r, nil
		}
	}
	return regime{}, fmt.Errorf("unknown regime %q (known: %s; beyond the matrix: %s)", name, strings.Join(regimeNames(), ","), strings.Join(extraRegimeNames(), ","))
}

// uniformCluster returns n copies of s.
func uniformCluster(n int, s simSettings) []simSettings {
	out := make([]simSettings, n)
	for i := range out {
		out[i] = s
	}
	return out
}

// kvHeadroom is how much larger than a workload's largest request (prompt + output) fitKV makes
// a backend's KV cache: the request itself, the simulator's 1% watermark, and room for a few
// short requests beside it.
const kvHeadroom = 1.25

// fitKV grows the KV cache of every backend that cannot hold w's largest request with
// kvHeadroom to spare (the simulator would answer 400, like vLLM's max_model_len check) and
// returns the settings and a note for each change. Only agentic's 20-40k-token contexts need it.
func fitKV(sims []simSettings, w Workload) ([]simSettings, []string) {
	largest := 0
	for _, req := range w.Requests() {
		largest = max(largest, templatedTokens(req.Messages)+req.MaxTokens)
	}
	out := make([]simSettings, len(sims))
	var notes []string
	for i, s := range sims {
		need := int(float64(largest)*kvHeadroom)/s.BlockSize + 1
		if s.NumGPUBlocks < need {
			notes = append(notes, fmt.Sprintf("backend %d: KV cache raised from %d to %d blocks to hold the largest request (%d tokens)", i, s.NumGPUBlocks, need, largest))
			s.NumGPUBlocks = need
		}
		out[i] = s
	}
	return out, notes
}
