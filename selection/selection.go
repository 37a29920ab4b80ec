// Package selection chooses an upstream for an LLM request by one cost in seconds: the predicted time to
// the request's first token on each candidate (the wait for a slot, for KV cache space or for the prefill
// queued there, then its own uncached prefill) plus the delay its prefill imposes on the requests waiting
// there for a slot. Each
// candidate's speed is its own Service, learned online by a ServiceModel, so no constant is tied to one
// backend. It imports nothing from Caddy; the Caddy module converts its upstream pool into Candidates, so
// every decision can be tested with exact, injected signals.
//
// Choose is deterministic for a given input and tie-break source, runs in O(n) for n candidates, and does
// not allocate when the caller passes a scratch buffer.
package selection

import (
	"cmp"
	"math"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// Mode is a routing strategy.
type Mode uint8

const (
	// Combined weighs each candidate's wait against the prefill its cache would save (the default).
	Combined Mode = iota
	// LeastTokens chooses by load alone: the least wait plus a full prefill, ignoring caches.
	LeastTokens
	// Prefix chooses the longest predicted cache hit unless waiting there costs more than prefilling the
	// whole prompt elsewhere, and falls back to Combined for prefixes no candidate has seen.
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
	// ReasonGuard: the candidate with the longest cache claim was predicted slower than another (its wait
	// exceeded what the cache saves), so another was chosen: the prefix is being replicated.
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
	// Service is the upstream's estimated speed.
	Service Service
	// Requests is the number of requests the upstream has in flight: this proxy's, plus others' that its
	// metrics show. A new request's prefill delays each of them.
	Requests float64
	// Arrivals is how many requests a second arrive there. Each that arrives while this request's prefill
	// runs waits for it.
	Arrivals float64
	// Queued is how many seconds of prefill the upstream has queued ahead of a new request: the uncached
	// prompt tokens of requests still waiting for their first token, in its own time.
	Queued float64
	// KVCapacity is the upstream's KV cache in tokens (0: unknown) and KVUsed the tokens wanted there now:
	// in use, and wanted by requests waiting for space (so it may exceed KVCapacity). A request whose
	// uncached prompt and output do not fit in what is free waits for requests to end.
	KVCapacity, KVUsed float64
	// TokenScale is how many of the upstream's tokens one of the prompt counts' is (0: the same). The KV
	// figures and prompts are in the prompt counts' tokens; Request.OutputTokens is in the upstream's
	// (max_tokens, usage), and takes OutputTokens/TokenScale of the cache in those terms.
	TokenScale float64
	// CachedTokens is how many of this request's prompt tokens it probably holds in its KV cache.
	CachedTokens int
	// CachedFree is set when no request running there holds the blocks of that cached prefix: vLLM keeps
	// such blocks in its free queue, counted as free space, and a request that reuses them takes them out
	// of it, so it needs free space for its whole prompt, not only the part it prefills (an agent's history,
	// whose previous turn has ended, does not make room for itself). False: the prefix is in use there
	// (a system prompt the requests running there share), and only the uncached part takes new space.
	CachedFree bool
	// HeldTokens is, where CachedFree, how many leading tokens of the cached prefix requests running there
	// still hold (a system prompt they share, ahead of a conversation's own history that waits in the free
	// queue): those blocks are in use, counted once however many requests share them, and take no free
	// space. 0: none known held, the whole cached prefix comes out of the free space.
	HeldTokens int
	// Holding is this proxy's requests in flight on the upstream, in no order (empty: none, or more than
	// MaxHolding): what the slots it holds still have to run (slotFreed).
	Holding []Hold
	// Pinned is true when the request's conversation is pinned to this candidate.
	Pinned bool
	// Availability is the share of new work the upstream should take, relative to what it would take
	// healthy, in (0, 1]; 0 (unset) counts as 1. Choose applies it twice, so that it holds at any load:
	// the candidate takes part only for a share Availability of requests (a threshold on a hash of the
	// request's AvailabilityHash and Key: idle upstreams tie, and a tie would otherwise hand it its full
	// share), and its load counts as if it had only that share of its capacity (Requests and Queued
	// divided by it: a busy fleet would otherwise make up for the exclusion by sending it more of the
	// requests it does see, since it is the least loaded). When every candidate is excluded, none is.
	Availability float64
	// AdapterLoad is how long the upstream would spend loading the request's LoRA adapter before its
	// prefill: 0 when the adapter is resident there or the request names none. Engines load an adapter
	// within a step, so like a prefill it delays every request in flight there too.
	AdapterLoad float64
	// AdapterWait is how long the request would wait for one of the upstream's adapter slots to free
	// before its adapter can load: 0 when a slot is free, the adapter resident, or the request names none.
	AdapterWait float64
	// Home is true for the tenant's home upstream (the head of its fallback chain): among candidates
	// whose costs are equal within the tie tolerance, a home is preferred.
	Home bool
	// Blind is set when the upstream's queue is known only from this proxy's own requests: no fresh
	// scrape of its metrics. Its slot count and how much its batch slows as it grows are then unknown,
	// and its predicted wait is the prefill this proxy queued there (corrected by observed first tokens,
	// where a handler sees them), so a prefix every request shares would pile onto it unseen;
	// Config.LoadBound bounds it.
	Blind bool
}

// Request is what the decision needs to know about the request being routed.
type Request struct {
	// PromptTokens is the number of prompt tokens, and OutputTokens the output expected of each of its
	// Sequences (n, best_of; 0 counts as 1), which take a slot each and the KV cache of their own output
	// (the prompt's they share).
	PromptTokens, OutputTokens int
	Sequences                  int
	// PrefixHash identifies the request's prefix for rendezvous hashing among near-equal candidates, so that
	// independent proxies send the same new prefix to the same upstream. 0 disables it.
	PrefixHash uint64
	// Share is the fraction of recent requests that carried this request's prefix (the one PrefixHash
	// names); 0: unknown. A prefix that fewer than one request in 2*len(candidates) carries needs only
	// one home (see Choose).
	Share float64
	// AvailabilityHash identifies what availability moves together (a tenant, a conversation, a prefix):
	// one hash gives the same draw on every proxy and every turn. 0: drawn by rnd for each request.
	AvailabilityHash uint64
}

// Config tunes the decision.
type Config struct {
	Mode Mode
	// TieTolerance is the fraction of the least cost within which two costs count as equal, plus the
	// noise of any first-token prediction (tolerance); equal candidates are separated by fewer requests
	// in flight per slot, then by rendezvous hashing of the prefix (or by Rand without one). MinTie
	// seconds stand for that noise when the least-cost candidate's decode step is unknown.
	TieTolerance float64
	MinTie       float64
	// LoadBound bounds a blind candidate's requests in flight (Candidate.Blind) to LoadBound times one
	// more than the candidates' mean: one over it takes no new request while another is under it. It is
	// consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018): the cache
	// affinity holds while loads stay near the mean, and a prefix that would pile onto one upstream
	// spills to the next. A request whose prefix fewer than one in 2N requests carry (Request.Share,
	// Hot) is not bounded: it cannot pile up. 0: no bound.
	LoadBound float64
}

// DefaultConfig is the configuration the Caddy module starts from. Nothing in it is tied to one backend:
// every cost is in seconds of the candidate's own estimated service.
func DefaultConfig() Config {
	return Config{Mode: Combined, TieTolerance: 0.02, MinTie: 0.002, LoadBound: 1.25}
}

// Decision is the outcome of Choose.
type Decision struct {
	// Index into the candidates; -1 when there were none.
	Index int
	// Reason the candidate was chosen.
	Reason Reason
	// MatchedTokens is the chosen candidate's predicted cached prompt tokens.
	MatchedTokens int
	// Wait is the chosen candidate's predicted queueing before this request's prefill starts, and TTFT
	// its predicted time to first token (both in seconds).
	Wait, TTFT float64
	// KVTokens is the KV-cache space the request takes there: its uncached prompt and output, or its
	// whole prompt (but what others hold, Candidate.HeldTokens) and output where the cached prefix is free
	// (Candidate.CachedFree).
	KVTokens int
}

// Cost is what sending the request to c costs, in seconds: the predicted time until its first token
// (the wait for a slot, for cache space or for the prefill queued ahead, then its own uncached prefill)
// plus the delay its prefill imposes on the first tokens of others there:
//   - each request waiting for one of the slots of the batch it joins waits as long as the prefill stalls
//     that batch;
//   - each request that arrives there while the prefill runs waits for what is left of it: at Arrivals
//     requests a second, a prefill of p seconds delays arrivals by Arrivals x p^2/2 in all. Small prefills
//     cost others almost nothing, so a hot prefix is replicated as soon as its home queues; a 30k-token
//     history re-prefilled elsewhere stalls that upstream for seconds, and its arrivals with it, so an
//     agentic session stays home unless home is very much slower.
//
// Requests already decoding stall too, but their first token is behind them and, while no one waits for
// their slots, their stall delays no one's first token, so it is not counted: pricing a cache miss at the
// whole batch's stall kept a prefix queued at its home when another upstream would answer it sooner (the
// regime matrix showed cold prefixes waiting a second at their home rather than a quarter of that
// elsewhere).
//
// A cache hit shortens the request's own prefill, so affinity wins while the upstream that holds the
// prefix is not much busier than another; once the wait there exceeds what the cache saves, another
// upstream is cheaper, learns the prefix, and a hot prefix ends up replicated on as many upstreams as
// its load needs, then balanced among them.
//
// A LoRA adapter that is not resident adds its load to the prefill (it stalls the batch the same way)
// and, when every adapter slot is taken, the wait for one to free: an upstream holding the adapter is
// preferred by the load time it saves, and one whose slots are full is avoided by the wait it would add.
// With neither (no adapter, or no upstream reports LoRA), the cost is the same as without the terms.
func Cost(c *Candidate, req Request, cached int) (cost, wait, ttft float64) {
	uncached := req.PromptTokens - min(cached, req.PromptTokens)
	wait = Wait(c, float64(kvTokens(c, req, cached)), req.Sequences) + c.AdapterWait
	prefill := float64(uncached)*c.Service.PrefillSecondsPerToken + c.AdapterLoad
	ttft = wait + c.Service.Overhead + prefill
	waiting := 0.0
	if s := c.Service.Slots; s > 0 {
		waiting = max(c.Requests-s, 0)
	}
	return ttft + prefill*waiting + c.Arrivals*prefill*prefill/2, wait, ttft
}

// kvTokens is the KV-cache space req takes on c with cached of its prompt tokens there.
func kvTokens(c *Candidate, req Request, cached int) int {
	output := OutputKV(req.OutputTokens*max(req.Sequences, 1), c.TokenScale)
	if c.CachedFree {
		return req.PromptTokens - min(c.HeldTokens, cached, req.PromptTokens) + output
	}
	return req.PromptTokens - min(cached, req.PromptTokens) + output
}

// OutputKV is the KV-cache space, in the prompt counts' tokens, of output tokens of an upstream whose
// TokenScale is scale (0: the same).
func OutputKV(output int, scale float64) int {
	if scale > 0 && scale != 1 {
		return int(float64(output)/scale + 0.5)
	}
	return output
}

// Wait is how long a new request of sequences sequences (0 counts as 1) that needs kv tokens of KV cache
// waits on c before its prefill starts: behind the prefill queued there, for slots, or for cache space,
// whichever is longest.
//
// A slot frees every MeanDuration/Slots seconds (MeanDuration is the time a request holds its slot). With
// the request's sequences among n in flight on s slots, it starts at once while n <= s, and otherwise
// waits for the n-s ahead of it to be given a slot: one interval each. (A rho^2/(1-rho) queueing term, rho =
// n/s, once stood here: past full it grew as s x rho^2 intervals, so a backend with 18 requests on 8
// slots was predicted to queue 9.5 s instead of 1.9 s, and every prefix there moved to the one upstream
// whose slots were not yet known.)
//
// Cache space frees as requests end: what is in use, every MeanDuration seconds. A request that does not
// fit in what is free waits until enough has ended. KVUsed may exceed KVCapacity: requests waiting for
// space want it too, and hold up every request behind them, short ones included (engines admit in order),
// while only what is held frees. The cache is counted in tokens, not in requests: a backend full of short
// requests has room for many more of them, and one long request can fill it.
func Wait(c *Candidate, kv float64, sequences int) float64 {
	wait := c.Queued
	if s := c.Service.Slots; s > 0 {
		ahead := c.Requests + float64(max(sequences, 1)) - s
		wait = max(wait, c.Service.MeanDuration/s*max(ahead, 0), slotFreed(c, s, ahead))
	}
	if c.KVCapacity > 0 {
		kv = min(kv, c.KVCapacity)
		if short := kv - (c.KVCapacity - c.KVUsed); short > 0 {
			held := min(c.KVUsed, c.KVCapacity)
			wait = max(wait, c.Service.MeanDuration*short/max(held, kv))
		}
	}
	return wait
}

// Hold is one of this proxy's requests in flight on an upstream, as the wait for a slot reads it.
type Hold struct {
	Age      float64 // seconds since it was sent
	Uncached int     // prompt tokens it prefills
	Output   int     // output tokens it is expected to generate
}

// MaxHolding is the most requests in flight on an upstream whose slots slotFreed reads one by one.
const MaxHolding = 128

// slotFreed is when the ahead-th slot of c frees (0 < ahead <= its slots), from what the requests
// running there still have to run: its predicted prefill and output at c's speed, less their age. The
// oldest requests hold the slots (engines admit in order). One interval per request ahead (Wait) is the
// mean gap between slots freeing in a steady state; a burst that filled the slots at once frees none of
// them for about a request's whole duration (small-batch hot-prefix: 8-12 cache hits in flight on an
// upstream of 8 slots, sent within a tenth of a second, the next predicted its first token in 38-49 ms
// and answered in 190-220). 0 when it cannot tell: requests there that are not this proxy's (its
// metrics show others', or a request runs several sequences), more than MaxHolding in flight, or more
// slots to free than are running.
func slotFreed(c *Candidate, slots, ahead float64) float64 {
	h := c.Holding
	if !(ahead > 0) || len(h) == 0 || len(h) > MaxHolding || float64(len(h)) < c.Requests-0.5 {
		return 0
	}
	running := min(len(h), int(slots))
	k := int(math.Ceil(ahead))
	if k > running {
		return 0
	}
	var held [MaxHolding]Hold
	copy(held[:], h)
	oldest := held[:len(h)]
	slices.SortFunc(oldest, func(a, b Hold) int { return cmp.Compare(b.Age, a.Age) })
	var left [MaxHolding]float64
	for i, r := range oldest[:running] {
		left[i] = max(c.Service.Duration(r.Uncached, r.Output)-r.Age, 0)
	}
	slices.Sort(left[:running])
	return left[k-1]
}

// Hot reports whether a prefix carried by share of the requests (Request.Share) is in more demand than
// half of one of n upstreams can serve: it is to be replicated, not held home.
func Hot(share float64, n int) bool {
	return 2*share*float64(n) >= 1
}

// Choose picks a candidate for req. rnd(n) must return a number in [0, n); it breaks exact ties when the
// request has no prefix hash. scratch, if it has capacity for 2*len(cands) values, avoids allocations.
func Choose(cands []Candidate, req Request, cfg Config, rnd func(n int) int, scratch []float64) Decision {
	switch len(cands) {
	case 0:
		return Decision{Index: -1, Reason: ReasonNone}
	}
	useCache := cfg.Mode != LeastTokens
	costs := scratch[:0]
	for i := range cands {
		cost, _, _ := Priced(&cands[i], req, cfg.Mode)
		costs = append(costs, cost)
	}
	excludeUnavailable(cands, costs, req, rnd)
	limit := math.Inf(1)
	if !(req.Share > 0 && !Hot(req.Share, len(cands))) {
		// A prefix that fewer than one request in 2N carry cannot pile up, and the rule below keeps
		// it where it is cached. Bounded too, a shared-prefix group's home on slow backends spilled
		// to cold upstreams (slow-prefill p50 3.5x, docs/bench/blind-bound).
		limit = boundLoads(cands, costs, cfg.LoadBound)
	}
	decision := func(i int, reason Reason) Decision {
		c := &cands[i]
		_, wait, ttft := Cost(c, req, c.CachedTokens)
		return Decision{Index: i, Reason: reason, MatchedTokens: c.CachedTokens, Wait: wait, TTFT: ttft,
			KVTokens: kvTokens(c, req, c.CachedTokens)}
	}
	if len(cands) == 1 {
		return decision(0, ReasonLoad)
	}

	best := leastCost(cands, costs, req, cfg, rnd)
	if !useCache {
		return decision(best, ReasonLoad)
	}

	// A pinned conversation stays where it is unless another upstream is predicted at least twice as
	// fast even after prefilling what the pinned one has cached. The margin is hysteresis: moving costs the
	// conversation its home for every later turn, and a small predicted difference (estimates of two
	// upstreams that differ by their noise) must not move it.
	withinPinMargin := func(i int) bool {
		return costs[i] <= pinMargin*costs[best]+tolerance(costs[best], &cands[best], cfg)
	}
	for i := range cands {
		if cands[i].Pinned {
			if withinPinMargin(i) {
				return decision(i, ReasonConversation)
			}
			break
		}
	}

	// longest is the candidate with the longest cache claim (-1: none; not one left out by its
	// availability); a claim it lost to its queue, or to the load bound, is reported as the guard's doing.
	longest := -1
	for i := range cands {
		if cands[i].CachedTokens > 0 && (!math.IsInf(costs[i], 1) || overBound(&cands[i], limit)) && (longest < 0 || cands[i].CachedTokens > cands[longest].CachedTokens) {
			longest = i
		}
	}
	if cfg.Mode == Prefix && longest >= 0 && longest != best {
		// Prefix mode: the longest cached prefix, unless waiting there costs more than prefilling the
		// whole prompt on the cheapest upstream.
		full := float64(req.PromptTokens) * cands[best].Service.PrefillSecondsPerToken
		if costs[longest] <= costs[best]+full {
			return decision(longest, ReasonAffinity)
		}
	}
	// A prefix that fewer than one request in 2*len(cands) carries would fill at most half of one
	// upstream even at full load, leaving it room for the rest of its traffic: the queue at its home
	// is the fleet's load, not this prefix's, and moving one of its requests, most of whose prompt is
	// cached there, adds a prefill elsewhere (the cached part) larger than the work it takes off the
	// home (the rest). It stays where it is cached unless another upstream is predicted much faster
	// (the pin's margin). A prefix carried by more (a hot system prompt; the first turns behind one
	// chat system prompt, a fifth of the requests, which alone nearly filled a small-batch home) is
	// replicated by the least cost, and so is a request that brings more work than it finds cached
	// (an agent's first turn behind a shared system prompt). Without this, a shared-prefix group's
	// requests went to cold upstreams whenever its home queued, and pricing that queue more exactly
	// (a slot count learned sooner) sent more of them: hit rate 7-24 points lower, p50 3-4x.
	if req.Share > 0 && !Hot(req.Share, len(cands)) && longest >= 0 && longest != best &&
		cands[longest].CachedTokens > cands[best].CachedTokens && 2*cands[longest].CachedTokens >= req.PromptTokens &&
		withinPinMargin(longest) {
		return decision(longest, ReasonAffinity)
	}
	switch {
	case cands[best].CachedTokens > 0:
		return decision(best, ReasonAffinity)
	case longest >= 0 && cands[longest].CachedTokens > cands[best].CachedTokens:
		return decision(best, ReasonGuard)
	}
	return decision(best, ReasonLoad)
}

// Priced is c's Cost as Choose weighs it in mode: its cached prefix counted unless the mode ignores the
// cache (LeastTokens), its requests in flight and queue scaled up by its availability. Costs it returns
// are before the load bound and the availability draw, which may leave a candidate out.
func Priced(c *Candidate, req Request, mode Mode) (cost, wait, ttft float64) {
	cached := 0
	if mode != LeastTokens {
		cached = c.CachedTokens
	}
	v := *c
	if a := availability(&v); a < 1 {
		v.Requests /= a
		v.Queued /= a
	}
	return Cost(&v, req, cached)
}

// pinMargin is how many times faster another upstream must be predicted before a pinned conversation
// moves there.
const pinMargin = 2

// tolerance is how far above the least cost, least, of candidate c (nil: unknown) another cost still
// counts as equal: the fraction TieTolerance of it, plus the standard deviation of the wait for the step
// c is running when the request arrives. A request joins a running batch at its next step, at a phase
// no proxy knows, so its wait is uniform over one decode step (c's TokenSeconds), whose standard
// deviation is step/sqrt(12): two predictions closer than that are the same prediction. In the
// backend's own time, like every cost: a fixed 2 ms (what this was) was a third of a decode step of the
// benchmark's simulators at time scale 5, two steps at time scale 30, and a fifteenth of a real GPU's
// 30 ms step.
func tolerance(least float64, c *Candidate, cfg Config) float64 {
	if c != nil && c.Service.TokenSeconds > 0 {
		return cfg.TieTolerance*least + c.Service.TokenSeconds/math.Sqrt(12)
	}
	return cfg.TieTolerance*least + cfg.MinTie
}

// availability is c's Availability as Choose applies it: unset (0) and out of range count as 1.
func availability(c *Candidate) float64 {
	if a := c.Availability; a > 0 && a < 1 {
		return a
	}
	return 1
}

// availabilitySalt decorrelates the exclusion draw from the rendezvous tie-break: with one hash for
// both, an upstream kept for the requests where its score is low would then lose every tie among them.
const availabilitySalt = 0x9e3779b97f4a7c15

// excludeUnavailable sets the cost of each candidate left out by its availability to +Inf: candidate i
// takes part in a request when a uniform draw from (AvailabilityHash, Key) is below its Availability, so
// an upstream whose availability falls gives up the same requests on every proxy, and takes them back in
// the same order as it recovers. When every candidate would be left out, none is.
func excludeUnavailable(cands []Candidate, costs []float64, req Request, rnd func(int) int) {
	const scale = 1 << 53
	kept, excluded := false, false
	for i := range cands {
		a := availability(&cands[i])
		if a >= 1 {
			kept = true
			continue
		}
		var u float64
		if req.AvailabilityHash != 0 {
			u = float64(rendezvous(req.AvailabilityHash^availabilitySalt, cands[i].Key)>>11) / scale
		} else {
			u = float64(rnd(scale)) / scale
		}
		if u < a {
			kept = true
			continue
		}
		excluded = true
		costs[i] = -costs[i] - 1 // costs are >= 0: negative marks an exclusion, undone if none is kept
	}
	if !excluded {
		return
	}
	for i, c := range costs {
		switch {
		case c >= 0:
		case kept:
			costs[i] = math.Inf(1)
		default:
			costs[i] = -c - 1
		}
	}
}

// boundLoads excludes (cost +Inf) each blind candidate with more requests in flight than bound times
// one more than the candidates' mean (Config.LoadBound), unless that would leave no candidate. It
// returns the limit it applied (+Inf: none); overBound tells whom it excluded.
func boundLoads(cands []Candidate, costs []float64, bound float64) (limit float64) {
	if !(bound > 0) {
		return math.Inf(1)
	}
	total, blind := 0.0, false
	for i := range cands {
		total += cands[i].Requests
		blind = blind || cands[i].Blind
	}
	if !blind {
		return math.Inf(1)
	}
	limit = bound * (total/float64(len(cands)) + 1)
	open := false
	for i := range cands {
		open = open || !math.IsInf(costs[i], 1) && !overBound(&cands[i], limit)
	}
	if !open {
		return math.Inf(1)
	}
	for i := range cands {
		if overBound(&cands[i], limit) {
			costs[i] = math.Inf(1)
		}
	}
	return limit
}

// overBound reports whether boundLoads, at limit, excludes c.
func overBound(c *Candidate, limit float64) bool { return c.Blind && c.Requests > limit }

// leastCost returns the candidate with the least cost. Costs within the tie tolerance of the least are
// separated by the tenant's home, then more cached tokens (the same first token for less work: the
// GPU time the cache saves serves others, and a conversation stays with its history instead of moving on
// a difference smaller than the estimates' noise), then fewer requests in flight per slot (balance),
// then by rendezvous hashing of the request's prefix (so that independent proxies agree on where a new
// prefix goes), else by rnd.
func leastCost(cands []Candidate, costs []float64, req Request, cfg Config, rnd func(int) int) int {
	least, at := math.Inf(1), -1
	for i, c := range costs {
		if c < least {
			least, at = c, i
		}
	}
	var lc *Candidate
	if at >= 0 {
		lc = &cands[at]
	}
	limit := least + tolerance(least, lc, cfg)
	chosen, ties := -1, 0
	var bestScore uint64
	var bestOccupancy float64
	for i := range cands {
		if costs[i] > limit {
			continue
		}
		occupancy := cands[i].Requests / max(cands[i].Service.Slots, 1) / availability(&cands[i])
		switch better := preferred(&cands[i], cands, chosen, cfg.Mode != LeastTokens); {
		case chosen < 0 || better > 0 || better == 0 && occupancy < bestOccupancy:
			chosen, ties, bestOccupancy = i, 1, occupancy
			bestScore = rendezvous(req.PrefixHash, cands[i].Key)
		case better < 0, occupancy > bestOccupancy:
		case req.PrefixHash != 0:
			if score := rendezvous(req.PrefixHash, cands[i].Key); score > bestScore {
				chosen, bestScore = i, score
			}
		default:
			// reservoir sampling among exact ties, so equal backends share load
			ties++
			if rnd(ties) == 0 {
				chosen = i
			}
		}
	}
	return chosen
}

// preferred compares c with cands[chosen] (none when chosen < 0) on what separates near-equal costs
// before balance: the tenant's home first, then more cached tokens (unless useCache is false). It returns
// 1 when c is preferred, -1 when the chosen one is, 0 when neither.
func preferred(c *Candidate, cands []Candidate, chosen int, useCache bool) int {
	if chosen < 0 {
		return 0
	}
	o := &cands[chosen]
	switch {
	case c.Home != o.Home:
		if c.Home {
			return 1
		}
		return -1
	case !useCache:
	case c.CachedTokens > o.CachedTokens:
		return 1
	case c.CachedTokens < o.CachedTokens:
		return -1
	}
	return 0
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
