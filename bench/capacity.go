package main

import (
	"fmt"
	"time"

	"github.com/cespare/xxhash/v2"
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
	TimeScale           float64       `json:"time_scale"`
	TokensPerChunk      int           `json:"tokens_per_chunk"`
	// ErrorRate and DropMidStreamRate are the simulator's faults (-faults): the fraction of requests
	// answered 500 and of streams whose connection drops mid-way.
	ErrorRate         float64 `json:"error_rate,omitempty"`
	DropMidStreamRate float64 `json:"drop_mid_stream_rate,omitempty"`
}

// describe summarises the settings for reports.
func (s simSettings) describe() string {
	return fmt.Sprintf("%.0f prefill tok/s, decode step %v + %v/seq, max_num_seqs %d, %d KV blocks of %d tokens, time scale %gx, %d tokens per SSE chunk",
		s.PrefillTokensPerSec, s.DecodeStep, s.DecodeStepPerSeq, s.MaxNumSeqs, s.NumGPUBlocks, s.BlockSize, s.TimeScale, s.TokensPerChunk)
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
func estimateCapacity(w Workload, sims []simSettings) capacityEstimate {
	if len(sims) == 0 {
		return capacityEstimate{}
	}
	var e capacityEstimate
	for i, sim := range sims {
		prompt, uncached, output := meanTokens(w, sim.BlockSize)
		if i == 0 {
			e.MeanPrompt, e.MeanUncached, e.MeanOutput = prompt, uncached, output
		}
		if prompt == 0 {
			return capacityEstimate{}
		}
		kvSeqs := float64(sim.NumGPUBlocks*sim.BlockSize) / (prompt + output)
		batch := min(float64(sim.MaxNumSeqs), max(kvSeqs, 1))
		if i == 0 {
			e.Batch = batch
		}
		step := sim.DecodeStep.Seconds() + sim.DecodeStepPerSeq.Seconds()*batch
		perRequest := uncached/sim.PrefillTokensPerSec + output*step/batch
		e.BackendRPS = append(e.BackendRPS, 1/perRequest)
		e.ClusterRPS += 1 / perRequest
	}
	e.PerBackendRPS = e.ClusterRPS / float64(len(sims))
	return e
}

// meanTokens returns w's mean prompt tokens, mean tokens left to prefill under an ideal
// cluster-wide prefix cache of blockSize-token blocks, and mean output tokens.
func meanTokens(w Workload, blockSize int) (prompt, uncached, output float64) {
	seen := map[uint64]bool{}
	n := 0.0
	for _, req := range w.Requests() {
		tokens := templatedTokens(req.Messages)
		// longest earlier prefix ending at a message boundary (not the whole prompt)
		h := xxhash.New()
		matched := 0
		for i, m := range req.Messages {
			_, _ = h.WriteString(m.Role)
			_, _ = h.WriteString("\x00")
			_, _ = h.WriteString(m.Content)
			_, _ = h.WriteString("\x00")
			key := h.Sum64()
			if i < len(req.Messages)-1 && seen[key] {
				matched = templatedTokens(req.Messages[:i+1])
			}
			seen[key] = true
		}
		maxBlocks := (tokens - 1) / blockSize
		cached := min(matched/blockSize, maxBlocks) * blockSize
		prompt += float64(tokens)
		uncached += float64(tokens - cached)
		output += float64(req.MaxTokens)
		n++
	}
	if n == 0 {
		return 0, 0, 0
	}
	return prompt / n, uncached / n, output / n
}
