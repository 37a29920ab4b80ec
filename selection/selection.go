// Package selection chooses an upstream for an LLM request from signals about each candidate: the tokens
// it has in flight, the prompt tokens it probably has cached, a conversation pin, and what its own metrics
// say about its queue and KV cache. It imports nothing from Caddy; the Caddy module converts its upstream
// pool into Candidates, so every decision can be tested with exact, injected signals.
//
// Choose is deterministic for a given input and tie-break source, runs in O(n log n) for n candidates
// (a median), and does not allocate when the caller passes a scratch buffer.
package selection

import (
	"math"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// Mode is a routing strategy.
type Mode uint8

const (
	// Combined weighs each candidate's load against the prefill work its cache would save (the default).
	Combined Mode = iota
	// LeastTokens chooses by load alone: the fewest in-flight tokens.
	LeastTokens
	// Prefix chooses the longest predicted cache hit, subject to the hot-spot guard, and falls back to
	// load for prefixes no candidate has seen.
	Prefix
)

var modeNames = [...]string{Combined: "combined", LeastTokens: "least_tokens", Prefix: "prefix"}

// String returns the mode's configuration name.
func (m Mode) String() string {
	if int(m) < len(modeNames) {
		return modeNames[m]
	}
	return "unknown"
}

// ParseMode returns the Mode named s ("combined", "least_tokens" or "prefix").
func ParseMode(s string) (Mode, bool) {
	for m, name := range modeNames {
		if name == s {
			return Mode(m), true
		}
	}
	return 0, false
}

// Reason says why a candidate was chosen.
type Reason uint8

const (
	// ReasonNone: no candidate was available.
	ReasonNone Reason = iota
	// ReasonLoad: chosen for its load; no usable cache prediction decided it.
	ReasonLoad
	// ReasonAffinity: chosen because its predicted cached prefix made it the cheapest.
	ReasonAffinity
	// ReasonConversation: chosen because the conversation is pinned to it.
	ReasonConversation
	// ReasonGuard: the candidate with the best cache claim was over the hot-spot threshold, so another was chosen.
	ReasonGuard
)

var reasonNames = [...]string{"none", "load", "affinity", "conversation", "guard"}

func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return "unknown"
}

// Candidate is one available upstream as the decision sees it.
type Candidate struct {
	// Key identifies the upstream (its dial address); rendezvous hashing of new prefixes uses it, so it must
	// be the same string on every proxy instance.
	Key string
	// InflightTokens is the weight of the requests this proxy has in flight to it.
	InflightTokens int64
	// InflightRequests is the number of those requests.
	InflightRequests int64
	// CachedTokens is how many of this request's prompt tokens it probably holds in its KV cache.
	CachedTokens int
	// Pinned is true when the request's conversation is pinned to this candidate.
	Pinned bool
	// ExtraLoad is load this proxy cannot see itself, in tokens (e.g. derived from the backend's scraped
	// queue and KV usage); 0 when unknown.
	ExtraLoad int64
	// Capacity, when positive, normalises load across unequal backends: load is divided by Capacity.
	Capacity float64
}

// Request is what the decision needs to know about the request being routed.
type Request struct {
	// PromptTokens is the number of prompt tokens.
	PromptTokens int
	// PrefixHash identifies the request's prefix for rendezvous hashing among near-equal candidates, so that
	// independent proxies send the same new prefix to the same upstream. 0 disables it.
	PrefixHash uint64
}

// Config tunes the decision. The zero value is not useful; start from DefaultConfig.
type Config struct {
	Mode Mode
	// GuardFactor and GuardSlack define the hot-spot guard: a candidate whose load exceeds
	// GuardFactor*median(load) + GuardSlack loses its cache and conversation claims. So does one whose
	// in-flight requests exceed GuardFactor*median(requests) + GuardRequestSlack: requests behind a
	// cached prefix weigh little in tokens yet fill the decode batch, so a hot prefix shows in counts.
	GuardFactor       float64
	GuardSlack        int64
	GuardRequestSlack int64
	// TieTolerance is the fraction of the request's prompt tokens within which two costs count as equal;
	// equal candidates are separated by rendezvous hashing of the prefix (or by Rand without one).
	TieTolerance float64
	// PrefillWeight scales the prompt tokens a candidate would have to prefill against its load.
	PrefillWeight float64
}

// DefaultConfig is the configuration the Caddy module starts from. PrefillWeight 4, GuardSlack 2048 and
// GuardRequestSlack 8 were chosen by sweeps of the benchmark harness (shared-prefix and hot-prefix,
// several seeds): a token to prefill delays the first token more than a token already in flight, which
// is mostly decoding; and without the request guard one hot prefix piled into one decode batch in half
// the runs (hot-prefix TTFT p99 ~700 ms against least_conn's ~360).
func DefaultConfig() Config {
	return Config{
		Mode:              Combined,
		GuardFactor:       2,
		GuardSlack:        2048,
		GuardRequestSlack: 8,
		TieTolerance:      0.05,
		PrefillWeight:     4,
	}
}

// Decision is the outcome of Choose.
type Decision struct {
	// Index into the candidates; -1 when there were none.
	Index int
	// Reason the candidate was chosen.
	Reason Reason
	// MatchedTokens is the chosen candidate's predicted cached prompt tokens.
	MatchedTokens int
}

// Choose picks a candidate for req. rnd(n) must return a number in [0, n); it breaks exact ties when the
// request has no prefix hash. scratch, if it has capacity for 3*len(cands) values, avoids allocations.
func Choose(cands []Candidate, req Request, cfg Config, rnd func(n int) int, scratch []float64) Decision {
	switch len(cands) {
	case 0:
		return Decision{Index: -1, Reason: ReasonNone}
	case 1:
		return Decision{Index: 0, Reason: ReasonLoad, MatchedTokens: cands[0].CachedTokens}
	}

	loads := scratch[:0]
	for i := range cands {
		loads = append(loads, load(&cands[i]))
	}
	if cfg.Mode == LeastTokens {
		return decide(cands, loads, req, cfg, rnd, func(i int) float64 { return loads[i] }, false)
	}

	threshold := guardThreshold(loads, cfg, float64(cfg.GuardSlack))
	requestThreshold := math.Inf(1)
	if cfg.GuardRequestSlack > 0 {
		requests := loads[len(loads):len(loads)]
		for i := range cands {
			requests = append(requests, float64(cands[i].InflightRequests))
		}
		requestThreshold = guardThreshold(requests, cfg, float64(cfg.GuardRequestSlack))
	}
	claims := func(i int) bool {
		return loads[i] <= threshold && float64(cands[i].InflightRequests) <= requestThreshold
	}
	// A hot spot takes no new work while another candidate is under the thresholds (with a request
	// guard it may have the least tokens in flight, so load alone would not keep it out).
	anyClaims := false
	for i := range cands {
		anyClaims = anyClaims || claims(i)
	}
	loadCost := func(i int) float64 {
		if anyClaims && !claims(i) {
			return math.Inf(1)
		}
		return loads[i]
	}

	// A pinned conversation stays where it is unless that upstream is a hot spot.
	for i := range cands {
		if cands[i].Pinned {
			if claims(i) {
				return Decision{Index: i, Reason: ReasonConversation, MatchedTokens: cands[i].CachedTokens}
			}
			break
		}
	}

	best, guarded := -1, false
	for i := range cands {
		if cands[i].CachedTokens <= 0 {
			continue
		}
		if !claims(i) {
			guarded = true
			continue
		}
		if best < 0 || cands[i].CachedTokens > cands[best].CachedTokens ||
			cands[i].CachedTokens == cands[best].CachedTokens && loads[i] < loads[best] {
			best = i
		}
	}
	// guarded only matters if the hot spot's claim was at least as good as the best remaining one.
	guarded = guarded && hotSpotWins(cands, claims, best)

	var d Decision
	switch cfg.Mode {
	case Prefix:
		if best >= 0 {
			d = Decision{Index: best, Reason: ReasonAffinity}
		} else {
			d = decide(cands, loads, req, cfg, rnd, loadCost, true)
		}
	default: // Combined
		prompt := float64(req.PromptTokens)
		d = decide(cands, loads, req, cfg, rnd, func(i int) float64 {
			cached := 0
			if claims(i) {
				cached = min(cands[i].CachedTokens, req.PromptTokens)
			}
			return loadCost(i) + cfg.PrefillWeight*(prompt-float64(cached))
		}, true)
		if d.Reason == ReasonLoad && cands[d.Index].CachedTokens > 0 && claims(d.Index) {
			d.Reason = ReasonAffinity
		}
	}
	if guarded && d.Reason == ReasonLoad {
		d.Reason = ReasonGuard
	}
	d.MatchedTokens = cands[d.Index].CachedTokens
	return d
}

// load is a candidate's load in tokens, normalised by its capacity when it has one.
func load(c *Candidate) float64 {
	l := float64(c.InflightTokens + c.ExtraLoad)
	if c.Capacity > 0 {
		l /= c.Capacity
	}
	return l
}

// guardThreshold returns the load above which a candidate loses its affinity claims. It sorts a copy of
// loads, kept after them in the same backing array when there is room (else it allocates).
func guardThreshold(loads []float64, cfg Config, slack float64) float64 {
	if cfg.GuardFactor <= 0 {
		return math.Inf(1)
	}
	sorted := append(loads[len(loads):len(loads)], loads...)
	slices.Sort(sorted)
	n := len(sorted)
	median := sorted[n/2]
	if n%2 == 0 {
		median = (sorted[n/2-1] + sorted[n/2]) / 2
	}
	return cfg.GuardFactor*median + slack
}

// hotSpotWins reports whether some candidate over the threshold had a longer cache claim than best.
func hotSpotWins(cands []Candidate, claims func(int) bool, best int) bool {
	for i := range cands {
		if !claims(i) && cands[i].CachedTokens > 0 &&
			(best < 0 || cands[i].CachedTokens > cands[best].CachedTokens) {
			return true
		}
	}
	return false
}

// decide returns the candidate with the least cost. Costs within the tie tolerance of the least are
// separated, when useHash is set, by rendezvous hashing of the request's prefix (so that independent
// proxies agree on where a new prefix goes); otherwise by fewer in-flight requests, then by rnd.
func decide(cands []Candidate, loads []float64, req Request, cfg Config, rnd func(int) int, cost func(int) float64, useHash bool) Decision {
	least := math.Inf(1)
	for i := range cands {
		least = min(least, cost(i))
	}
	tolerance := cfg.TieTolerance * float64(max(req.PromptTokens, 1))
	chosen, ties := -1, 0
	var bestScore uint64
	for i := range cands {
		if cost(i) > least+tolerance {
			continue
		}
		switch {
		case useHash && req.PrefixHash != 0:
			score := rendezvous(req.PrefixHash, cands[i].Key)
			if chosen < 0 || score > bestScore {
				chosen, bestScore = i, score
			}
		case chosen < 0 || cands[i].InflightRequests < cands[chosen].InflightRequests:
			chosen, ties = i, 1
		case cands[i].InflightRequests == cands[chosen].InflightRequests:
			// reservoir sampling among exact ties, so equal backends share load
			ties++
			if rnd(ties) == 0 {
				chosen = i
			}
		}
	}
	return Decision{Index: chosen, Reason: ReasonLoad}
}

// rendezvous is the highest-random-weight score of key for a prefix.
func rendezvous(prefix uint64, key string) uint64 {
	var d xxhash.Digest
	d.Reset()
	var b [8]byte
	for i := range b {
		b[i] = byte(prefix >> (8 * i))
	}
	_, _ = d.Write(b[:])
	_, _ = d.WriteString(key)
	return d.Sum64()
}
