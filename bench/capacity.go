package main

import (
	"fmt"
	"math"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

// simSettings are the simulated backends' engine parameters (a subset of vllmsim.Config) that the
// benchmark chooses and the capacity estimate reads.
type simSettings struct {
	MaxNumSeqs          int           `json:"max_num_seqs"`
	MaxNumBatchedTokens int           `json:"max_num_batched_tokens"`
	BlockSize           int           `json:"block_size"`
	NumGPUBlocks        int           `json:"num_gpu_blocks"`
	PrefillTokensPerSec float64       `json:"prefill_tokens_per_sec"`
	DecodeStep          time.Duration `json:"decode_step_ns"`
	DecodeStepPerSeq    time.Duration `json:"decode_step_per_seq_ns"`
	// AttentionTokens and DecodeStepPerKToken make prefill and decode cost grow with context (the
	// simulator's fields of those names); 0: off.
	AttentionTokens     int           `json:"attention_tokens,omitempty"`
	DecodeStepPerKToken time.Duration `json:"decode_step_per_ktoken_ns,omitempty"`
	// Schedule and SeparatePrefill are the simulator's scheduler (its fields of those names): "" or
	// "fcfs" and mixed steps are vLLM's, "lpm" and separate prefill steps SGLang's.
	Schedule        string  `json:"schedule,omitempty"`
	SeparatePrefill bool    `json:"separate_prefill,omitempty"`
	TimeScale       float64 `json:"time_scale"`
	TokensPerChunk  int     `json:"tokens_per_chunk"`
	// ErrorRate and DropMidStreamRate are the simulator's faults (-faults): the fraction of requests
	// answered 500 and of streams whose connection drops mid-way.
	ErrorRate         float64 `json:"error_rate,omitempty"`
	DropMidStreamRate float64 `json:"drop_mid_stream_rate,omitempty"`
	// Metrics is the dialect of the simulators' /metrics (-metrics): vllm (""), sglang, llamacpp or nim.
	Metrics string `json:"metrics,omitempty"`
}

// describe summarises the settings for reports.
func (s simSettings) describe() string {
	if s.Metrics != "" && s.Metrics != vllmsim.MetricsVLLM {
		c := s
		c.Metrics = ""
		return c.describe() + ", /metrics as " + s.Metrics
	}
	engine := ""
	if s.AttentionTokens > 0 || s.DecodeStepPerKToken > 0 {
		engine = fmt.Sprintf(", attention doubling a prefill token's cost at position %d, decode %v per 1k tokens of context", s.AttentionTokens, s.DecodeStepPerKToken)
	}
	if s.Schedule == vllmsim.ScheduleLPM {
		engine += ", longest-prefix-match admission"
	}
	if s.SeparatePrefill {
		engine += ", prefill steps apart from decode steps"
	}
	return fmt.Sprintf("%.0f prefill tok/s, decode step %v + %v/seq%s, max_num_seqs %d, %d KV blocks of %d tokens, time scale %gx, %d tokens per SSE chunk",
		s.PrefillTokensPerSec, s.DecodeStep, s.DecodeStepPerSeq, engine, s.MaxNumSeqs, s.NumGPUBlocks, s.BlockSize, s.TimeScale, s.TokensPerChunk)
}

// simBytesPerToken is the simulator's tokenizer: 4 bytes of templated prompt per token.
const simBytesPerToken = 4

// templatedTokens is the simulator's token count of messages: each message is rendered
// "<|role|>\n" + content + "\n".
func templatedTokens(msgs []Message) int {
	n := 0
	for _, m := range msgs {
		n += len("<||>\n\n") + len(m.Role) + len(m.Content)
	}
	return (n + simBytesPerToken - 1) / simBytesPerToken
}

// capacityEstimate is the estimated sustainable request rate of the cluster and what it rests on.
type capacityEstimate struct {
	// PerBackendRPS and ClusterRPS are in requests per simulated second; PerBackendRPS is the mean
	// over backends, BackendRPS each backend's own.
	PerBackendRPS, ClusterRPS float64
	BackendRPS                []float64
	// MeanPrompt and MeanUncached are the mean prompt tokens and the mean tokens left to prefill
	// with an ideal cache; MeanOutput the mean output tokens; Batch the decode batch assumed (of
	// the first backend).
	MeanPrompt, MeanUncached, MeanOutput, Batch float64
	// CachedSessions is the fraction of the sessions in flight whose context the KV caches can hold
	// between turns, when it is below 1 (zero otherwise).
	CachedSessions float64
}

// estimateCapacity returns the capacity for workload w of a cluster of backends with the given
// settings (one entry per backend, so heterogeneous clusters add up their members). The simulator
// runs steps of duration prefill/P + D0 + Dseq*B for a batch of B sequences, so a backend sustains
//
//	rate = 1 / (U/P + out * (D0 + Dseq*B) / B)
//
// requests per second, where U is the mean prompt tokens it must prefill, P the prefill rate, out
// the mean output tokens and B the decode batch at saturation: max_num_seqs, or fewer if the KV
// cache cannot hold that many sequences of mean length (prompt + out) without sharing. U assumes
// an ideal router that prefills every distinct prefix once in the whole cluster (a prefix is
// cached at each message boundary, block-aligned), so the load fraction is relative to what a
// cache-perfect router could sustain: a router that recomputes shared prefixes saturates earlier.
//
// Unless the caches cannot hold it: a session between turns (thinking, running a tool) keeps its
// context cached only if the cluster's KV caches hold the context of every session in flight. By
// Little's law, at r requests a second N = r/turns x (think + turns x latency) sessions are in flight
// (latency is a request's unloaded time on the backend); the caches hold K/S of them (K tokens of KV
// cache, S a session's mean context; whole sessions only), so an ideal router keeps a fraction
// h = min(1, K/S/N) of them and re-prefills the others' own history at each turn (what other sessions
// share stays cached). The capacity is then the rate r at which the backends sustain r with that h:
// without this, agentic's 20-40k-token contexts in 50k-token caches were offered 0.75 of a rate that
// only a cache holding every session could sustain, and every policy queued for tens of seconds (hit
// rates 21-49%). Blocks are counted in the first backend's block size (the regimes share one).
func estimateCapacity(w Workload, sims []simSettings) capacityEstimate {
	if len(sims) == 0 {
		return capacityEstimate{}
	}
	m := measureWorkload(w, sims[0].BlockSize)
	if m.prompt == 0 {
		return capacityEstimate{}
	}
	batch := func(sim simSettings) float64 {
		kvSeqs := float64(sim.NumGPUBlocks*sim.BlockSize) / m.context
		return min(float64(sim.MaxNumSeqs), max(kvSeqs, 1))
	}
	// perRequest is a backend's time a request at saturation, latency one request's own time alone
	// (its prefill, then its output at the batch's step), for a mean U tokens to prefill.
	perRequest := func(sim simSettings, u float64) (perRequest, latency float64) {
		b := batch(sim)
		step := sim.DecodeStep.Seconds() + sim.DecodeStepPerSeq.Seconds()*b + sim.DecodeStepPerKToken.Seconds()*b*m.context/1000
		prefill := u / sim.PrefillTokensPerSec
		if sim.AttentionTokens > 0 { // the uncached tokens are the prompt's last: at mean position prompt - u/2
			prefill *= 1 + max(m.prompt-u/2, 0)/float64(sim.AttentionTokens)
		}
		return prefill + m.output*step/b, prefill + m.output*step
	}
	// at returns the estimate when a fraction h of the sessions in flight keep their context cached,
	// and how many sessions are in flight at the rate it sustains.
	at := func(h float64) (capacityEstimate, float64) {
		e := capacityEstimate{MeanPrompt: m.prompt, MeanOutput: m.output, Batch: batch(sims[0])}
		e.MeanUncached = h*m.uncached + (1-h)*m.uncachedAlone
		latency := 0.0
		for _, sim := range sims {
			t, l := perRequest(sim, e.MeanUncached)
			e.BackendRPS = append(e.BackendRPS, 1/t)
			e.ClusterRPS += 1 / t
			latency += l / float64(len(sims))
		}
		e.PerBackendRPS = e.ClusterRPS / float64(len(sims))
		return e, e.ClusterRPS / m.turns * (m.think + m.turns*latency)
	}
	e, inFlight := at(1)
	held := 0.0 // sessions whose contexts the caches hold
	for _, sim := range sims {
		held += math.Floor(float64(sim.NumGPUBlocks*sim.BlockSize) / m.context) // a session's context is not split
	}
	if m.turns <= 1 || inFlight <= held {
		return e
	}
	// More sessions in flight than the caches hold: the fixed point h = held/inFlight(h), by bisection
	// (fewer hits sustain a lower rate, which keeps fewer sessions in flight).
	lo, hi := 0.0, 1.0
	for range 40 {
		h := (lo + hi) / 2
		if _, n := at(h); held/n >= h {
			lo = h
		} else {
			hi = h
		}
	}
	e, _ = at(lo)
	e.CachedSessions = lo
	return e
}

// workloadShape is what the capacity estimate reads of a workload: mean tokens a request (its prompt,
// what is left to prefill under an ideal cluster-wide prefix cache of blocks, what is left when its own
// session's earlier turns are not cached, its output), and of a session (requests, total think time,
// the context it holds in cache: its requests' mean prompt and output).
type workloadShape struct {
	prompt, uncached, uncachedAlone, output float64
	turns, think, context                   float64
}

// measureWorkload returns w's shape (workloadShape) with a prefix cache of blockSize-token blocks.
func measureWorkload(w Workload, blockSize int) workloadShape {
	var m workloadShape
	seen := map[uint64]int{} // prefix hash: the first session that sent it, plus one
	n := 0.0
	for si, s := range w.Sessions {
		for _, req := range s.Requests {
			tokens := templatedTokens(req.Messages)
			// longest earlier prefix ending at a message boundary (not the whole prompt), and the
			// longest one another session sent first
			h := xxhash.New()
			matched, shared := 0, 0
			for i, msg := range req.Messages {
				_, _ = h.WriteString(msg.Role)
				_, _ = h.WriteString("\x00")
				_, _ = h.WriteString(msg.Content)
				_, _ = h.WriteString("\x00")
				key := h.Sum64()
				switch first, ok := seen[key]; {
				case !ok:
					seen[key] = si + 1
				case i < len(req.Messages)-1:
					matched = templatedTokens(req.Messages[:i+1])
					if first != si+1 {
						shared = matched
					}
				}
			}
			maxBlocks := (tokens - 1) / blockSize
			cached := min(matched/blockSize, maxBlocks) * blockSize
			cachedShared := min(shared/blockSize, maxBlocks) * blockSize
			m.prompt += float64(tokens)
			m.uncached += float64(tokens - cached)
			m.uncachedAlone += float64(tokens - cachedShared)
			m.output += float64(req.MaxTokens)
			m.think += req.Think.Seconds()
			n++
		}
	}
	if n == 0 {
		return workloadShape{}
	}
	sessions := float64(len(w.Sessions))
	m.turns, m.think = n/sessions, m.think/sessions
	m.prompt, m.uncached, m.uncachedAlone, m.output = m.prompt/n, m.uncached/n, m.uncachedAlone/n, m.output/n
	m.context = m.prompt + m.output
	return m
}
