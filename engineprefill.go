package caddyllm

import (
	"math"

	"github.com/tokenrouter/caddy-llm/scraper"
)

// enginePrefill is an upstream's prefill speed as its engine measures it: vLLM observes, as each request
// finishes, its time from first being scheduled to its first token and the prompt tokens that prefill
// computed (vllm:request_prefill_time_seconds, vllm:request_prefill_kv_computed_tokens;
// scraper.Snapshot.PrefillSeconds, PrefillComputed), and their sums' growth between scrapes is tokens
// per second of prefill, whatever else the engine ran and whoever sent the requests. A bare lb_policy
// llm learns an upstream's prefill from its busy intervals (counted only while it is seldom idle) or
// its requests' durations (mostly decode): in a pool of two kinds of engine, the kind that decodes
// faster and prefills 2.4x slower was priced at a median 2.2x its prefill speed through a run, its own
// estimate the prior scaled toward faster by its durations (the bench's mixed-pool,
// docs/bench/scale-by-model). A request prefilled in the same steps as others counts their time too,
// so the figure errs slow.
//
// It is reported (/llm/upstreams, the metrics), not priced.
type enginePrefill struct {
	// The counters at the last scrape read, and its time.
	fromRequests, fromSeconds, fromTokens float64
	fromAt                                int64
	// seconds and tokens are the intervals' sums, each decayed by the requests finished since (about
	// prefillMemory of them count); requests is how many they rest on, at most prefillMemory.
	seconds, tokens, requests float64
}

const (
	// prefillMemory is about how many finished requests the speed is measured over.
	prefillMemory = 64
	// minPrefillRequests is how many finished requests it needs before it is reported.
	minPrefillRequests = 8
)

// fromScrape adds what finished since the last scrape read.
func (e *enginePrefill) fromScrape(snap *scraper.Snapshot) {
	at := snap.At.UnixNano()
	if at <= e.fromAt {
		return // not newer than the last one read
	}
	dN, dSec, dTok := snap.PrefillRequests-e.fromRequests, snap.PrefillSeconds-e.fromSeconds, snap.PrefillComputed-e.fromTokens
	first := e.fromAt == 0
	e.fromRequests, e.fromSeconds, e.fromTokens, e.fromAt = snap.PrefillRequests, snap.PrefillSeconds, snap.PrefillComputed, at
	if first || !(dN >= 1) || !(dSec > 0) || !(dTok >= 0) || math.IsInf(dSec+dTok, 0) {
		return // the first scrape, nothing finished since, or counters that went back (a restart)
	}
	w := math.Exp(-dN / prefillMemory)
	e.seconds, e.tokens = e.seconds*w+dSec, e.tokens*w+dTok
	e.requests = min(e.requests+dN, prefillMemory)
}

// tokensPerSecond is the engine's prefill speed in this proxy's tokens (the backend's over scale, the
// upstream's token scale); 0 while fewer than minPrefillRequests have finished.
func (e *enginePrefill) tokensPerSecond(scale float64) float64 {
	if e.requests < minPrefillRequests || !(e.seconds > 0) || !(scale > 0) {
		return 0
	}
	return e.tokens / scale / e.seconds
}
