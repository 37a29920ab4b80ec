package caddyllm

import (
	"math"
	"sync"

	"github.com/tokenrouter/caddy-llm/scraper"
)

// tokenScale learns how many of an upstream's own tokens one token of this proxy's count is. The
// policy counts a prompt with its tokenizer (tokenize/: tiktoken's cl100k unless configured); the
// backend counts it with its model's, and speaks in those in its metrics: the KV cache's size
// (block_size x num_gpu_blocks) and usage, and the prefix-cache queries a busy interval prefilled.
// Compared as they were, every KV figure was off by the two tokenizers' ratio: in the benchmark one
// prompt is 1,208 tokens here and 1,609 to the simulator, so a cache was believed to hold a third more
// of this proxy's tokens than it does, and the prefill speed learned from the backend's counters priced
// each of this proxy's tokens at three quarters of its time.
//
// Two sources teach it, both exact counts of the same prompts: the usage.prompt_tokens of a response
// whose usage the proxy reads (transport llm or llm_resume; observeCached), and, from the backend's
// metrics, vLLM's vllm:request_prompt_tokens histogram or SGLang's sglang:num_requests_total and
// sglang:prompt_tokens_total counters (each finished request and its prompt) against the requests of
// this proxy that completed there between two scrapes, when both counted the same number of requests:
// another client's request finishing in the interval, or one of this proxy's that did not complete,
// makes the counts differ and the interval is skipped, so other clients' prompts never enter it.
// Without either (metrics off or without those series, and no usage), the scale stays 1: the units as
// they were. Behind several instances sending one backend, an interval counts only if no other
// instance's request finished in it; usage reports are exact whatever else is sent there. SGLang
// counts a request with n > 1 choices, or a completions request with several prompts, as several
// finished requests: such intervals are skipped too. It is not persisted: a new process learns it
// again within its first few thousand tokens.
type tokenScale struct {
	backend, policy float64 // the samples' token counts, each decayed by the policy tokens seen since
	// The baselines of the next comparison: the backend's finished requests and their prompt tokens at
	// the last scrape compared, and this proxy's completed requests there and theirs as of that scrape.
	fromFinished, fromFinishedPrompt float64
	fromEnded, fromEndedPrompt       int64
	fromValid                        bool
	fromObserved                     int64 // observed.prompt then: usage reports, when they come, teach it instead
	// prior is the scale another upstream serving the same model learned (shareScaleLocked), value's
	// until this one's samples make it known; 0: none.
	prior float64
}

const (
	// scaleWindow is how many of this proxy's prompt tokens a sample weighs for: one that many tokens
	// old counts e^-1 as much as a new one (a backend redeployed with another model changes its ratio).
	scaleWindow = 500_000
	// minScaleTokens is how many prompt tokens of samples the scale needs before it is used.
	minScaleTokens = 4000
	// maxTokenScale bounds the ratio a sample may show: two tokenizers of real models differ by well
	// under 2x on the same text; a sample further off is not a tokenizer's difference.
	maxTokenScale = 4
)

// add records a sample: backend tokens counted by the backend for prompts of policy tokens here.
func (s *tokenScale) add(backend, policy float64) {
	if !(backend > 0) || !(policy > 0) || math.IsInf(backend+policy, 0) {
		return
	}
	if r := backend / policy; r > maxTokenScale || r < 1.0/maxTokenScale {
		return
	}
	w := math.Exp(-policy / scaleWindow)
	s.backend = s.backend*w + backend
	s.policy = s.policy*w + policy
}

// known reports whether minScaleTokens of samples have been seen: value is learned, not the 1 it starts at.
func (s *tokenScale) known() bool { return s.policy >= minScaleTokens }

// value is the backend's tokens per token of this proxy's count: until minScaleTokens are seen, the
// prior, or 1 without one.
func (s *tokenScale) value() float64 {
	if !s.known() {
		if s.prior > 0 {
			return s.prior
		}
		return 1
	}
	return s.backend / s.policy
}

// fromScrape compares snap's finished requests with this proxy's completed there as of the scrape
// (ended of endedPrompt tokens; ok false when they are not known for the scrape's time), and sets the
// baselines of the next comparison. observed is observed.prompt: while responses report usage, those
// exact per-request figures teach the scale and the scrapes only keep their baselines current.
func (s *tokenScale) fromScrape(snap *scraper.Snapshot, ended, endedPrompt int64, ok bool, observed int64) {
	dReq, dPrompt := snap.FinishedRequests-s.fromFinished, snap.FinishedPrompt-s.fromFinishedPrompt
	dEnded, dEndedPrompt := ended-s.fromEnded, endedPrompt-s.fromEndedPrompt
	valid := s.fromValid && ok && observed == s.fromObserved
	s.fromFinished, s.fromFinishedPrompt = snap.FinishedRequests, snap.FinishedPrompt
	s.fromEnded, s.fromEndedPrompt = ended, endedPrompt
	// A scrape before the backend finished anything is a baseline like any other (no finished
	// requests, and none of this proxy's ended): taken for none, it threw away the interval of every
	// upstream's first ends, and a young upstream kept the scale of 1 a scrape longer.
	s.fromValid, s.fromObserved = ok, observed
	if valid && dReq > 0 && dReq == float64(dEnded) {
		s.add(dPrompt, float64(dEndedPrompt))
	}
}

// completedAsOfLocked returns this proxy's requests that completed there up to at (unix nanoseconds)
// and their prompt tokens, and false when the ring of recent ends no longer reaches back to at. The
// caller holds l.mu.
func (l *upstreamLoad) completedAsOfLocked(at int64) (n, prompt int64, ok bool) {
	n, prompt = l.completed, l.completedPrompt
	for i, end := range l.endedAt {
		if end > at && l.endedPrompt[i] >= 0 {
			n--
			prompt -= l.endedPrompt[i]
		}
	}
	oldest := l.endedAt[l.endNext] // the next slot written is the oldest end kept
	return n, prompt, oldest == 0 || oldest <= at
}

// tokenScaleLocked returns the upstream's backend tokens per token of this proxy's count. The caller
// holds l.mu.
func (l *upstreamLoad) tokenScaleLocked() float64 { return l.scale.value() }

// shareScaleLocked notes the model the upstream serves (a scrape's model_name; "" when it has none):
// a scale it has learned is the model's for others to use, and until it has one it takes the model's
// as its prior. One model has one tokenizer, and it is the scale that makes the backend's counters
// this proxy's tokens: at 1 while the backend counts 1.35 of them, a young upstream's counters told a
// prefilling 4k-token prompt decoding (markDecodingLocked) and its prefill stopped counting, for the
// third of a mixed-pool run its small engines took to learn their own scale
// (docs/bench/decoding-before-scale). The caller holds l.mu.
func (l *upstreamLoad) shareScaleLocked(model string) {
	if model == "" {
		l.scale.prior = 0
		return
	}
	if l.scale.known() {
		l.scales.set(model, l.scale.value())
		return
	}
	l.scale.prior = l.scales.get(model)
}

// modelScales holds the token scale last learned for each model, by its name in the backends'
// metrics, for maxModelScales models at most.
type modelScales struct {
	mu sync.Mutex
	m  map[string]float64
}

// maxModelScales bounds the models whose scale is kept: a name beyond it is not kept.
const maxModelScales = 256

func (m *modelScales) get(model string) float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.m[model]
}

func (m *modelScales) clear() {
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.m)
}

func (m *modelScales) set(model string, v float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.m[model]; !ok && len(m.m) >= maxModelScales {
		return
	}
	if m.m == nil {
		m.m = make(map[string]float64)
	}
	m.m[model] = v
}
