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
}

// describe summarises the settings for reports.
func (s simSettings) describe() string {
	return fmt.Sprintf("%.0f prefill tok/s, decode step %v + %v/seq, max_num_seqs %d, %d KV blocks of %d tokens, time scale %.0fx, %d tokens per SSE chunk",
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
	// PerBackendRPS and ClusterRPS are in requests per simulated second.
	PerBackendRPS, ClusterRPS float64
	// MeanPrompt and MeanUncached are the mean prompt tokens and the mean tokens left to prefill
	// with an ideal cache; MeanOutput the mean output tokens; Batch the decode batch assumed.
	MeanPrompt, MeanUncached, MeanOutput, Batch float64
}

// estimateCapacity returns the cluster's capacity for workload w. The simulator runs steps of
// duration prefill/P + D0 + Dseq*B for a batch of B sequences, so a backend sustains
//
//	rate = 1 / (U/P + out * (D0 + Dseq*B) / B)
//
// requests per second, where U is the mean prompt tokens it must prefill, P the prefill rate, out
// the mean output tokens and B the decode batch at saturation: max_num_seqs, or fewer if the KV
// cache cannot hold that many sequences of mean length (prompt + out) without sharing. U assumes
// an ideal router that prefills every distinct prefix once in the whole cluster (a prefix is
// cached at each message boundary, block-aligned), so the load fraction is relative to what a
// cache-perfect router could sustain: a router that recomputes shared prefixes saturates earlier.
func estimateCapacity(w Workload, sim simSettings, backends int) capacityEstimate {
	seen := map[uint64]bool{}
	var prompt, uncached, output, n float64
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
		maxBlocks := (tokens - 1) / sim.BlockSize
		cached := min(matched/sim.BlockSize, maxBlocks) * sim.BlockSize
		prompt += float64(tokens)
		uncached += float64(tokens - cached)
		output += float64(req.MaxTokens)
		n++
	}
	if n == 0 {
		return capacityEstimate{}
	}
	e := capacityEstimate{MeanPrompt: prompt / n, MeanUncached: uncached / n, MeanOutput: output / n}
	kvSeqs := float64(sim.NumGPUBlocks*sim.BlockSize) / (e.MeanPrompt + e.MeanOutput)
	e.Batch = min(float64(sim.MaxNumSeqs), max(kvSeqs, 1))
	step := sim.DecodeStep.Seconds() + sim.DecodeStepPerSeq.Seconds()*e.Batch
	perRequest := e.MeanUncached/sim.PrefillTokensPerSec + e.MeanOutput*step/e.Batch
	e.PerBackendRPS = 1 / perRequest
	e.ClusterRPS = e.PerBackendRPS * float64(backends)
	return e
}
