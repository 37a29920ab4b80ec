package caddyllm

import (
	"cmp"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap/zapcore"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

// decider is the policy's decision without Caddy: a parsed request and the candidate upstreams' dial
// addresses in, a choice out, then commit (learn the prefix, pin the conversation, reserve the work).
// Select and the decision tests both call it.
//
// Each signal fills its part of every candidate; adding one (LoRA residency, availability) is one type
// with a fill method, its test, and a line in newDecider.
type decider struct {
	cfg          selection.Config
	routes       *affinity.Table // nil in least_tokens mode
	loads        *loadTable
	outputTokens int
	signals      []signal
	lora         *loraSignal       // nil: metrics off
	kick         func(dial string) // brings dial's next scrape forward; nil: metrics off
	// capacities weigh the tenant chains (with availability); nil: all 1.
	capacities map[string]float64
	demand     *prefixDemand
	// unlikeNoted is set once the log has said that the pool holds several kinds of engine (noteUnlike).
	unlikeNoted atomic.Bool
}

// query is one decision's input, shared by the signals.
type query struct {
	req          *tokenize.Request
	bounds       []tokenize.Boundary // the boundaries matched and learned (bounded by routeBoundaries)
	conversation string
	// tenant keys the fallback chain ("": none); retry is set when the request already tried an upstream.
	tenant string
	retry  bool
	now    int64
	cached []int     // scratch for the cache signal: the route table's claim on each candidate
	seen   []int64   // and when each claim was last learned (unix nanoseconds)
	cut    []int     // claims older than their upstream's cache horizon, not credited
	avail  []float64 // scratch for the availability signal
	// heldIdx, heldKeys, held and heldSeen are scratch for the cache signal's match of the request's
	// first message on the candidates whose free claim covers it.
	heldIdx  []int
	heldKeys []string
	held     []int
	heldSeen []int64
	// holds is scratch for each candidate's requests in flight (selection.Candidate.Holding).
	holds []selection.Hold
	// overdue is each candidate's overrun of its predicted durations (upstreamView.overdue), and stretch
	// how many times its estimate its times were priced at for it, at least 1 (loadSignal.fill).
	overdue, stretch []float64
	// full is each candidate's running count at which its scrape shows it full (upstreamView.full).
	full []float64
	// open is whether each candidate's scrape leaves its ceiling open (upstreamView.open), and counting
	// whether its fresh scrape may count engine steps (what a span between scrapes needs): it has
	// counted some, or runs nothing yet.
	open, counting []bool
	// settled is each candidate's queue as predicted (upstreamView.settled), in the same speed as its
	// Queued.
	settled []float64
	// own is scratch for each candidate's prefill speed as its own model has it, before the fleet's.
	own []float64
	// entries is scratch for each candidate's load-table entry (upstreamView.load; nil: none), to note
	// the service it was priced at; chosen is the chosen candidate's, noted by commit where its entry
	// is made by the reservation.
	entries []*upstreamLoad
	chosen  selection.Service
	// hot: the request's prefix is in more demand than half of one upstream can serve (prefixDemand),
	// so it is to be replicated, not held home.
	hot bool
	// peerClaim is the longest cache claim's length in tokens when it is known only from peers (routes
	// shared by other instances, affinity.Table.MatchPeers); 0 otherwise.
	peerClaim int
	// headAt is how many of bounds end at or before the end of the request's first message when the last
	// of them ends exactly there (0: no such boundary), set by the cache signal; head is that boundary.
	headAt int
	// adapter is set by the LoRA signal when the request's model is a LoRA adapter on some candidate.
	adapter bool
	// kinds is how many kinds of engine the candidates are by their KV cache geometry (selection.Fleet.Kinds),
	// observed whether any of them has had a first token observed (transport llm) and measured whether
	// any has unlikeAfterSamples observations; set by loadSignal.
	kinds              int
	observed, measured bool
	// priced is the request as choose priced it, for the decision's debug log (pricedCandidates).
	priced selection.Request
}

// reset readies q for a new request, keeping its scratch slices' storage (a decision makes none).
func (q *query) reset(req *tokenize.Request, now int64) {
	clear(q.entries) // no entry kept alive by a pooled query
	*q = query{req: req, now: now, cached: q.cached[:0], seen: q.seen[:0], cut: q.cut[:0], avail: q.avail[:0],
		overdue: q.overdue[:0], stretch: q.stretch[:0], full: q.full[:0], settled: q.settled[:0], open: q.open[:0], heldIdx: q.heldIdx[:0], heldKeys: q.heldKeys[:0], held: q.held[:0],
		heldSeen: q.heldSeen[:0], holds: q.holds[:0], own: q.own[:0], entries: q.entries[:0]}
}

// signal fills its part of each candidate; cands[i] is the upstream keys[i].
type signal interface {
	fill(q *query, keys []string, cands []selection.Candidate)
}

func newDecider(cfg selection.Config, routes *affinity.Table, loads *loadTable, outputTokens int, scrapes *scrapes) *decider {
	d := &decider{cfg: cfg, routes: routes, loads: loads, outputTokens: outputTokens, demand: new(prefixDemand)}
	if scrapes != nil {
		d.kick = scrapes.kick
	}
	d.signals = append(d.signals, loadSignal{loads: loads, scrapes: scrapes})
	if routes != nil {
		d.signals = append(d.signals, cacheSignal{routes: routes, loads: loads})
	}
	return d
}

// withAvailability adds the availability signal (table nil: off).
func (d *decider) withAvailability(table *availabilityTable, preference []string) *decider {
	if table != nil {
		d.signals = append(d.signals, availabilitySignal{table: table, preference: preference})
	}
	return d
}

// withLoRA adds the LoRA adapter signal (it reads the scrapes: nothing without metrics), pricing an
// adapter that is not resident at loadTime.
func (d *decider) withLoRA(scrapes *scrapes, slots *loraSlots, loadTime time.Duration) *decider {
	if scrapes != nil {
		d.lora = &loraSignal{snapshot: scrapes.peek, slots: slots, loadTime: loadTime.Seconds()}
		d.signals = append(d.signals, d.lora)
	}
	return d
}

// choose fills the candidates for keys (cands must have len(keys)) and decides among them.
func (d *decider) choose(q *query, keys []string, cands []selection.Candidate, scratch []float64) selection.Decision {
	dec := d.decide(q, keys, cands, scratch)
	q.chosen = cands[dec.Index].Service
	return dec
}

// decide is choose without noting the chosen candidate's service.
func (d *decider) decide(q *query, keys []string, cands []selection.Candidate, scratch []float64) selection.Decision {
	q.bounds = routeBoundaries(q.req.Boundaries)
	for i := range cands {
		cands[i] = selection.Candidate{Key: keys[i]}
	}
	for _, s := range d.signals {
		s.fill(q, keys, cands)
	}
	prefix := prefixBoundary(q.req)
	req := selection.Request{
		PromptTokens: q.req.PromptTokens,
		OutputTokens: d.outputEstimate(q.req),
		Sequences:    q.req.Sequences,
		PrefixHash:   prefix.Hash,
	}
	req.AvailabilityHash = req.PrefixHash
	if !q.retry { // a retry is counted once, and goes by the cost (its home may be what failed)
		bs := 0 // no routes (least_tokens): no claims either
		if d.routes != nil {
			bs = d.routes.BlockSize()
		}
		// A claim on the whole prefix that only peers have learned: another instance sent it (routes
		// shared through `share`), which this instance's own count cannot know.
		elsewhere := q.peerClaim > 0 && q.peerClaim+bs > prefix.Tokens
		var once bool
		req.Share, once = d.demand.share(req.PrefixHash, elsewhere)
		if once && continuesHome(cands, bs) {
			for i := range cands {
				cands[i].Queued = q.settled[i]
			}
		}
	}
	q.hot = selection.Hot(req.Share, len(cands))
	for i := range cands {
		cands[i].Service = fullNow(cands[i].Service, q.full[i], q.hot)
		if q.hot && q.open[i] && d.kick != nil {
			d.kick(keys[i]) // what fullNow needs: a second scrape at the ceiling
		}
		if q.kinds > 1 && q.counting[i] && cands[i].Requests > 0 && d.kick != nil && selection.FewSpans(cands[i].Service) {
			// Several kinds of engine: each kind's prefill is fitted from its upstreams' spans between
			// scrapes (selection.Fleet.Align), of which a short burst gives few at the interval. Brought
			// forward while the backend counts its steps and this proxy has requests there (what a span
			// needs) and the upstream has few (a backend without a step counter never has any):
			// the bench's mixed-pool hot-prefix (under 4 simulated seconds) went from TTFT p99 1,880 to
			// 1,216 ms over twelve seeds, agentic's from 5,018 to 5,667 (docs/bench/kind-fit).
			d.kick(keys[i])
		}
	}
	q.priced = req
	if q.tenant == "" {
		return selection.Choose(cands, req, d.cfg, randIntN, scratch)
	}
	// The tenant's chain: its next untried upstream is its home on a first attempt (a tie-break), and
	// the only candidate of a retry.
	tenant := xxhash.Sum64String(q.tenant)
	req.AvailabilityHash = tenant
	q.priced = req
	head := chainHead(tenant, cands, d.capacities)
	if q.retry {
		dec := selection.Choose(cands[head:head+1], req, d.cfg, randIntN, scratch)
		dec.Index += head
		return dec
	}
	cands[head].Home = true
	return selection.Choose(cands, req, d.cfg, randIntN, scratch)
}

// noteUnlike reports, once per decider, whether the decision q just made saw several kinds of engine
// (KV cache geometries) among its candidates, one of them measured by unlikeAfterSamples observations
// and no first token observed on any: a pool of unlike engines behind a bare lb_policy llm, which
// prices each by what its own kind measured but sees no first token to learn each one's time to a first
// token from (README: Fleets beyond the matrix).
func (d *decider) noteUnlike(q *query) bool {
	return q.kinds > 1 && q.measured && !q.observed && !d.unlikeNoted.Load() && d.unlikeNoted.CompareAndSwap(false, true)
}

// unlikeAfterSamples is how many observations of an upstream (ended requests, busy intervals, first
// tokens) show that no first token is coming: behind transport llm, each request's first token comes
// before its end, so some of them would be first tokens. Until then a pool whose scrapes came first is
// not yet known to lack them.
const unlikeAfterSamples = 16

// unstretched is the time to first token ttft, predicted for candidate i, without the overrun's stretch
// (loadSignal.fill): what its model predicts, which the first tokens' lateness is measured against
// (firstTokenCheck).
func (q *query) unstretched(i int, ttft float64) float64 {
	if i < len(q.stretch) && q.stretch[i] > 0 {
		return ttft / q.stretch[i]
	}
	return ttft
}

// commit records the choice of dial: the route table learns the request's prefixes there, the
// conversation is pinned there, and the request's work is reserved on it.
func (d *decider) commit(q *query, dial string, dec selection.Decision) *reservation {
	if d.lora != nil {
		d.lora.commit(q, dial)
	}
	var learned int64
	if d.routes != nil {
		learned = d.routes.Learn(q.req.Model, q.bounds, dial)
		if q.conversation != "" {
			d.routes.Pin(q.req.Model, q.conversation, dial)
		}
	}
	matched := min(dec.MatchedTokens, q.req.PromptTokens)
	pred := prediction{prompt: q.req.PromptTokens, predicted: matched}
	if d.routes != nil {
		if i := dec.Index; i < len(q.cached) {
			pred.claimed, pred.cut = q.cached[i], q.cut[i]
			if q.seen[i] > 0 {
				pred.claimAge = q.now - q.seen[i]
			}
		}
	}
	r := d.loads.reserve(dial, work{
		prompt:     q.req.PromptTokens,
		matched:    matched,
		head:       q.head().Hash,
		uncached:   q.req.PromptTokens - matched,
		kv:         dec.KVTokens,
		learned:    learned,
		output:     d.outputEstimate(q.req),
		sequences:  q.req.Sequences,
		waited:     dec.Wait,
		ttft:       q.unstretched(dec.Index, dec.TTFT),
		prediction: pred,
	}, q.now)
	if i := dec.Index; i < len(q.entries) && q.entries[i] == nil {
		r.load.notePriced(q.chosen, q.now) // priced before it had an entry to note it on (loadSignal.fill)
	}
	return r
}

// outputEstimate is the output tokens a request is expected to generate: its max_tokens when lower than
// the configured estimate, else the estimate (none for embeddings). Real outputs are usually far shorter
// than max_tokens, so a generous limit must not inflate the weight; a small one lowers it.
func (d *decider) outputEstimate(req *tokenize.Request) int {
	if req.API == tokenize.APIEmbeddings {
		return 0 // pooled, not generated
	}
	if maxTokens := req.MaxTokens; maxTokens > 0 && maxTokens < d.outputTokens {
		return maxTokens
	}
	return d.outputTokens
}

// loadSignal fills each candidate's service estimate, requests in flight and queued prefill, from this
// proxy's own accounting and, when scraped, the backend's metrics.
type loadSignal struct {
	loads   *loadTable
	scrapes *scrapes // nil: metrics off
}

func (s loadSignal) fill(q *query, keys []string, cands []selection.Candidate) {
	var fleet selection.Fleet
	q.overdue, q.full, q.settled, q.open, q.entries = q.overdue[:0], q.full[:0], q.settled[:0], q.open[:0], q.entries[:0]
	q.counting = q.counting[:0]
	q.stretch = q.stretch[:0]
	for i, key := range keys {
		var snap *scraper.Snapshot
		awaited := false // its first scrape is still to come
		if s.scrapes != nil {
			var sn scraper.Snapshot
			var fresh bool
			sn, fresh, awaited = s.scrapes.loadAwaited(key, q.now)
			s.loads.noteScrape(key, &sn, q.now) // a restart forgets routes before the cache signal reads them
			if fresh {
				snap = &sn
			}
		}
		from := len(q.holds)
		var v upstreamView
		v, q.holds = s.loads.viewInto(key, q.now, snap, q.holds)
		cands[i].Service, cands[i].Requests, cands[i].Queued = v.service, v.requests, v.queued
		cands[i].KVCapacity, cands[i].KVUsed, cands[i].TokenScale = v.kvCapacity, v.kvUsed, v.tokenScale
		cands[i].Arrivals = v.arrivals // -1 (unknown) filled by knownArrivals below
		cands[i].Holding = q.holds[from:len(q.holds):len(q.holds)]
		// Blind: no metrics to come (off, unusable, gone stale). First tokens observed (transport llm)
		// show its speed, not its slot count, and do not end it: ended by them, the bound left
		// transport llm's runs without metrics 1.26x (p50) and 1.34x (p99) slower on nine cells
		// (docs/bench/blind-bound). An upstream whose first scrape is on its way is waited for, not
		// bounded, so that where metrics work the decision is the one the matrix measured.
		cands[i].Blind = snap == nil && !awaited
		q.overdue, q.full, q.settled = append(q.overdue, v.overdue), append(q.full, v.full), append(q.settled, v.settled)
		q.open, q.entries = append(q.open, v.open), append(q.entries, v.load)
		// A backend running requests with no step counted has no step counter (vLLM counts from its first
		// step); an idle one may not have stepped yet.
		q.counting = append(q.counting, snap != nil && (snap.Steps > 0 || snap.Running == 0))
		fleet.Add(v.service, selection.Geometry(&cands[i]))
		q.observed = q.observed || v.service.FirstTokens+v.service.SkippedFirstTokens > 0
		q.measured = q.measured || v.service.Samples >= unlikeAfterSamples
	}
	q.kinds = fleet.Kinds()
	knownArrivals(cands)
	// An upstream whose requests in flight overran their predicted durations by more than the others'
	// did is that much slower than its estimate now (a backend slower than the fleet it borrowed from, or
	// one that slowed down): its times are stretched by the overrun over the fleet's median one, so an
	// overrun they all share (outputs longer than expected everywhere) changes nothing.
	ref := medianOverdue(q.overdue)
	if cap(q.own) < len(cands) {
		q.own = make([]float64, len(cands))
	}
	q.own = q.own[:len(cands)]
	for i := range cands {
		// An upstream the proxy has barely seen borrows what the others have taught: without that, the
		// first upstream to be measured looks faster (or slower) than the prior of all the others, and
		// takes every request (or none) until they are measured too.
		q.own[i] = cands[i].Service.PrefillSecondsPerToken
		cands[i].Service = fleet.Blend(cands[i].Service, selection.Geometry(&cands[i]))
	}
	fleet.Align(cands) // alike backends priced alike (selection.Fleet.Align)
	for i := range cands {
		scale := 1.0 // of the queued prefill (both figures), to the speed priced
		if own := q.own[i]; own > 0 {
			scale = cands[i].Service.PrefillSecondsPerToken / own
		}
		f := max(q.overdue[i]/ref, 1)
		if f > 1 {
			cands[i].Service = cands[i].Service.Slower(f)
			scale *= f
		}
		q.stretch = append(q.stretch, f)
		cands[i].Queued *= scale
		q.settled[i] *= scale
		if e := q.entries[i]; e != nil {
			e.notePriced(cands[i].Service, q.now) // what /llm/upstreams reports as priced
		}
	}
}

// continuesHome reports whether one candidate holds more of the request's prompt than every other by
// more than a block of blockSize tokens: the request continues what it sent there, as a conversation's
// next turn continues the history its home holds, beyond the system prompt others may hold too. Such a
// request, when its prefix has been seen once (a history is its conversation's alone), is priced on
// the queues as predicted, each of this proxy's requests sent since the last scrape counted until its
// predicted first token (settled), and not in full as for every other request. Counted in full, those
// sends are a spreading signal that places new prefixes (new conversations behind one system prompt
// went to the two upstreams that cached it first when they were drained), but no prediction: a
// conversation's next turn moved off its home when that count exceeded the prefill its history saves
// there, 5-12% of later turns, re-prefilling the history elsewhere (multi-turn-think: 98-117 ms against
// 76-88 for the turns that stayed, traced). Where nothing is held, or what is held is held alike on
// several, nothing changes.
func continuesHome(cands []selection.Candidate, blockSize int) bool {
	first, second := 0, 0
	for i := range cands {
		switch c := cands[i].CachedTokens; {
		case c > first:
			first, second = c, first
		case c > second:
			second = c
		}
	}
	return first > second+blockSize
}

// fullNow returns s with full for its slot count when a request whose prefix is to be replicated (hot)
// meets an upstream whose scrapes show it full at that many running (upstreamView.full) before its slot
// count is learned. Early in a run the upstreams holding a hot prefix took bursts of its cache hits,
// each predicted to wait for nothing while the backend, 8 slots without chunked prefill, queued them
// behind running requests (small-batch hot-prefix: 21 hits in a row on one upstream, predicted at
// 9-27 ms, answered in 50-470 ms). Priced for every request, the same count sent shared-prefix groups
// away from their homes (p50 3x, docs/bench/full-now-rejected); a group held home by its demand share
// does not need it, and a hot prefix is to be replicated anyway.
func fullNow(s selection.Service, full float64, hot bool) selection.Service {
	if hot && s.Slots == 0 && full > 0 {
		s.Slots = full
	}
	return s
}

// medianOverdue is the lower median of the candidates' overruns, each at least 1.
func medianOverdue(o []float64) float64 {
	if len(o) == 0 {
		return 1
	}
	var buf [16]float64
	s := buf[:0]
	if len(o) > len(buf) {
		s = make([]float64, 0, len(o))
	}
	for _, v := range o {
		s = append(s, max(v, 1))
	}
	slices.Sort(s)
	return s[(len(s)-1)/2]
}

// cacheSignal fills each candidate's predicted cached prompt tokens from the learned routes, extended over
// the answer the upstream generated there (answeredThere), discounted by the share of its predicted hits
// the backend's own counters confirm, and marks the upstream the conversation is pinned to. A pinned upstream is credited with the conversation's history up to its last
// message even when those routes were evicted: the pin says it was there.
type cacheSignal struct {
	routes *affinity.Table
	loads  *loadTable
}

func (s cacheSignal) fill(q *query, keys []string, cands []selection.Candidate) {
	if cap(q.cached) < len(keys) {
		q.cached = make([]int, len(keys))
	}
	if cap(q.seen) < len(keys) {
		q.seen = make([]int64, len(keys))
	}
	if cap(q.cut) < len(keys) {
		q.cut = make([]int, len(keys))
	}
	// Kept for commit: the route table's own claim on the chosen upstream, its age, and what was cut.
	q.cached, q.seen, q.cut = q.cached[:len(keys)], q.seen[:len(keys)], q.cut[:len(keys)]
	cached := q.cached
	if longest, peers := s.routes.MatchPeers(q.req.Model, q.bounds, keys, cached, q.seen); peers {
		q.peerClaim = longest
	}
	bs := s.routes.BlockSize()
	q.headAt = 0
	if len(q.req.Messages) > 0 {
		if k, ok := slices.BinarySearchFunc(q.bounds, q.req.Messages[0].End, func(b tokenize.Boundary, t int) int { return cmp.Compare(b.Tokens, t) }); ok {
			q.headAt = k + 1
		}
	}
	clear(q.cut)
	for i := range cands {
		cached[i] = answeredThere(q.req.Messages, cached[i], bs)
		cands[i].CachedTokens = cached[i]
		l := s.loads.lookup(keys[i])
		if l == nil || cached[i] == 0 {
			continue
		}
		if h := l.cacheHorizon(); h > 0 && q.now-q.seen[i] > h && !(cands[i].KVCapacity > 0) {
			// Older than the backend has lately kept a prefix: not credited (observe.go). Only where its
			// cache size is not known: with it, what this proxy sent there since says per claim how much
			// is evicted (below), and the horizon, the youngest claim a report denied, cut the intact
			// claims with the evicted ones (agentic: claims of 3-23 simulated seconds denied, sessions whose
			// histories were still cached moved off them; hit rates 59% -> 63%, 61% -> 62% and 59% -> 65% in
			// default, hetero and kv-pressure with the cut left to the eviction estimate,
			// docs/bench/unsettled-claims).
			q.cut[i], cached[i], cands[i].CachedTokens = cached[i], 0, 0
			continue
		}
		if room := cands[i].KVCapacity - float64(cached[i]); cands[i].KVCapacity > 0 && q.seen[i] > 0 {
			// Evicted, in part or whole: since the prefix was last in use there, this proxy alone sent it
			// more than its KV cache holds beside it, and vLLM reuses the least recently used free blocks
			// first (the cache capacity is scraped; see loadSignal). A request's blocks are freed last
			// first, so what goes first is the prefix's end and what is left its head: an agent's 30k-token
			// history in a cache not much larger loses its last turns, not its system prompt and first
			// ones. Not a cut claim: that is one older than the horizon, and a report confirming it would
			// lengthen (or, with none, start) the horizon.
			if over := float64(l.evictedSince(q.seen[i], q.now, q.head())) - room; over > 0 {
				left := (cached[i] - int(math.Ceil(over))) / max(bs, 1) * max(bs, 1)
				if left <= 0 {
					cached[i], cands[i].CachedTokens = 0, 0
					l.observed.evicted.Add(1)
					continue
				}
				cached[i] = left
			}
		}
		cands[i].CachedTokens = int(float64(cached[i]) * l.cacheTrust())
		cands[i].CachedFree = !l.holds(q.seen[i], q.now)
	}
	s.pin(q, cands)
	s.held(q, keys, cands)
}

// pin marks the upstream the request's conversation is pinned to, if any.
func (s cacheSignal) pin(q *query, cands []selection.Candidate) {
	if q.conversation == "" {
		return
	}
	dial, ok := s.routes.Pinned(q.req.Model, q.conversation)
	if !ok {
		return
	}
	for i := range cands {
		if cands[i].Key == dial {
			cands[i].Pinned = true
			if n := len(q.req.Boundaries); n >= 2 && q.req.Boundaries[n-2].Tokens > cands[i].CachedTokens {
				// Credited by the pin beyond the routes' claim: its last turn has ended, so that history
				// waits in the free queue.
				cands[i].CachedTokens, cands[i].CachedFree = q.req.Boundaries[n-2].Tokens, true
			}
		}
	}
}

// held fills HeldTokens where a candidate's cached prefix is free (its last toucher has ended) but the
// request's first message is in use there: a system prompt the requests running there share, ahead of a
// conversation's history that waits in the free queue. Those blocks are held once for all their
// sharers and take no free space; counted as free, every later turn of every conversation behind one
// system prompt wanted it again, and each such request in flight counted it once more in the upstream's
// KV demand (kv-pressure multi-turn-think: an 8k-token cache predicted full at 5-6k of demand, a KV wait
// of 10-57 ms predicted at the home of 12-22% of later turns, which moved and re-prefilled their
// histories elsewhere, while the backends answered those homes' turns in 8-9 ms under header hashing).
// One route lookup more, and only when some candidate's claim is free and longer than that message.
func (s cacheSignal) held(q *query, keys []string, cands []selection.Candidate) {
	if len(q.req.Messages) < 2 || q.headAt == 0 {
		return
	}
	first := q.head().Tokens
	// Only the candidates whose free claim covers the first message: HeldTokens counts nowhere else (a
	// claim in use takes no free space already), and each of these holds the message's route.
	q.heldIdx, q.heldKeys = q.heldIdx[:0], q.heldKeys[:0]
	for i := range cands {
		if cands[i].CachedFree && cands[i].CachedTokens > first {
			q.heldIdx, q.heldKeys = append(q.heldIdx, i), append(q.heldKeys, keys[i])
		}
	}
	n := len(q.heldIdx)
	if n == 0 {
		return
	}
	if cap(q.held) < n {
		q.held, q.heldSeen = make([]int, n), make([]int64, n)
	}
	held, seen := q.held[:n], q.heldSeen[:n]
	s.routes.MatchSeen(q.req.Model, q.bounds[:q.headAt], q.heldKeys, held, seen)
	for j, i := range q.heldIdx {
		// Matches are whole blocks: what is held is the first message's full blocks. Learned by the same
		// request as the whole claim (the same time), it ended with it.
		if held[j] <= 0 || seen[j] == q.seen[i] {
			continue
		}
		if l := s.loads.lookup(keys[i]); l != nil && l.holds(seen[j], q.now) {
			cands[i].HeldTokens = held[j]
		}
	}
}

// head is the boundary at the end of the request's first message (a system prompt, which conversations
// share) when the cache signal found one among q.bounds; zero otherwise.
func (q *query) head() tokenize.Boundary {
	if q.headAt == 0 {
		return tokenize.Boundary{}
	}
	return q.bounds[q.headAt-1]
}

// answeredThere extends a match that ends where a message ends (in the same block of blockSize tokens:
// matches are block-aligned) over the assistant message after it, when a user's message still follows: the
// upstream that holds that prefix is the one that answered it (the route table learns each prompt where it
// is sent), so its cache holds the answer too. The route table itself never sees answers, and without this
// a conversation's next turn would be credited everything but its last answer at home, often the larger
// part of what staying saves.
func answeredThere(msgs []tokenize.Message, matched, blockSize int) int {
	if matched <= 0 || blockSize <= 0 {
		return matched
	}
	k, _ := slices.BinarySearchFunc(msgs, matched, func(m tokenize.Message, t int) int { return cmp.Compare(m.End, t) })
	if k+2 >= len(msgs) || msgs[k].End >= matched+blockSize {
		return matched
	}
	if next := msgs[k+1]; next.Assistant && next.End-next.Tokens == msgs[k].End {
		return max(matched, next.End/blockSize*blockSize)
	}
	return matched
}

// prefixBoundary is the boundary that ends the request's prefix, the longest before its last message
// (the system prompt of a first turn, the history of a later one); zero when it has none. Its hash is
// the request's PrefixHash, for rendezvous hashing among near-equal candidates, so that proxies agree on
// where a shared prefix goes while different conversations behind one system prompt still spread once
// their histories differ, and the demand share's key.
func prefixBoundary(req *tokenize.Request) tokenize.Boundary {
	bounds := req.Boundaries
	switch n := len(bounds); {
	case n == 0:
		return tokenize.Boundary{}
	case len(req.Messages) == 0: // a completion's prompt: all of it but its last step
		return bounds[max(n-2, 0)]
	}
	// The boundaries include steps inside long messages: the last one at or before the last
	// message's start, not the one before the last boundary (a step of the last message when it is
	// longer than tokenize.StepBytes, which made every request's prefix its own).
	last := req.Messages[len(req.Messages)-1]
	i, _ := slices.BinarySearchFunc(bounds, last.End-last.Tokens+1, func(b tokenize.Boundary, t int) int {
		return cmp.Compare(b.Tokens, t)
	})
	return bounds[max(i-1, 0)]
}

// prefixDemand tells what share of recent requests carry each prefix (PrefixHash): counts decayed by
// request, over about demandMemory requests, in a direct-mapped table of demandSlots entries (bounded;
// a collision replaces an entry only once it is down to about one request).
type prefixDemand struct {
	mu    sync.Mutex
	slots [demandSlots]demandEntry
	n     int64   // requests counted
	total float64 // their decayed count
}

type demandEntry struct {
	hash  uint64
	count float64
	n     int64 // prefixDemand.n when count was last updated
}

const (
	demandSlots  = 4096
	demandMemory = 512
	demandKeep   = 1 - 1.0/demandMemory
)

// share counts a request with prefix h and returns the share of recent requests that carried it; 0
// while fewer than minDemand requests have been counted, and for a prefix seen once unless it was
// seen elsewhere (another instance sent it: see choose). Several instances each see a share of a
// prefix's requests: a shared-prefix group's five, over three instances sharing routes, were seen
// about twice by each, too few for the share, and went by the cost at 94.7% of one instance's hit
// rate.
func (p *prefixDemand) share(h uint64, elsewhere bool) (share float64, once bool) {
	if p == nil || h == 0 {
		return 0, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n++
	p.total = p.total*demandKeep + 1
	e := &p.slots[h%demandSlots]
	count := e.count * math.Pow(demandKeep, float64(p.n-e.n)) // the slot's count, decayed to now
	if e.hash != h {
		if count >= 1.5 {
			// The slot holds a prefix still in demand: replaced by a one-off (a conversation's history),
			// a hot prefix would restart from one request and look like one upstream's worth for the
			// next few dozen. This one is not counted; it goes by the cost.
			return 0, false
		}
		*e = demandEntry{hash: h}
		count = 0
	}
	e.count = count + 1
	e.n = p.n
	once = e.count < 1.5 && !elsewhere
	if p.n < minDemand || once {
		return 0, once // too few requests to tell, or a prefix of one request (a conversation's history)
	}
	return e.count / p.total, false
}

// minDemand is how many requests the shares need before they say anything.
const minDemand = 32

var randIntN = rand.IntN

// knownArrivals gives each candidate whose arrival rate is not known yet (Arrivals < 0: it has been sent
// requests, too few to tell a rate) the mean rate of those that have one, or 0 when none has; one never
// sent anything keeps 0 (nothing is homed there). A rate needs minGaps gaps between requests sent there:
// in a pool of 16 each upstream gets a sixteenth of the requests, most had none for most of a run, and
// their 0 priced the requests their sessions would send during a 20k-token prefill there at nothing:
// agent turns moved onto the homes of other sessions, whose next turns waited behind them
// (docs/bench/pool-size).
func knownArrivals(cands []selection.Candidate) {
	sum, n := 0.0, 0
	for i := range cands {
		if cands[i].Arrivals > 0 {
			sum += cands[i].Arrivals
			n++
		}
	}
	mean := 0.0
	if n > 0 {
		mean = sum / float64(n)
	}
	for i := range cands {
		if cands[i].Arrivals < 0 {
			cands[i].Arrivals = mean
		}
	}
}

// pricedCandidates logs every candidate of a decision as it was priced (selection.Priced): why the chosen
// upstream and not another, in the decision's own terms. Built only when the debug log is on.
type pricedCandidates struct {
	cands []selection.Candidate
	req   selection.Request
	mode  selection.Mode
}

func (p pricedCandidates) MarshalLogArray(enc zapcore.ArrayEncoder) error {
	for i := range p.cands {
		c := &p.cands[i]
		cost, wait, ttft := selection.Priced(c, p.req, p.mode)
		err := enc.AppendObject(zapcore.ObjectMarshalerFunc(func(o zapcore.ObjectEncoder) error {
			o.AddString("upstream", c.Key)
			o.AddFloat64("cost_seconds", cost)
			o.AddFloat64("wait_seconds", wait)
			o.AddFloat64("ttft_seconds", ttft)
			o.AddInt("cached_tokens", c.CachedTokens)
			o.AddFloat64("requests", c.Requests)
			if p := c.Service.PrefillSecondsPerToken; p > 0 {
				o.AddFloat64("prefill_tokens_per_sec", 1/p) // as priced: see /llm/upstreams' priced
			}
			if a := c.Availability; a > 0 && a < 1 {
				o.AddFloat64("availability", a)
			}
			if c.Pinned {
				o.AddBool("pinned", true)
			}
			return nil
		}))
		if err != nil {
			return err
		}
	}
	return nil
}
