package caddyllm

import (
	"context"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

// upstreamLoad is the work this process has in flight to one upstream, split by phase, and the service
// model learned from it. It is process-global, keyed by the upstream's dial address, so it survives config
// reloads: a request that started under an old config releases into the same counters the new config reads.
//
// A request is prefilling until its first token and decoding after. The first token is observed when the
// response is (the llm_resume handler sees it); otherwise it is predicted: each upstream keeps a virtual
// prefill queue, prefillUntil, the time at which the prefill this proxy sent there is predicted done in the
// upstream's own estimated time. A request sent now starts its prefill when that queue drains and moves
// the queue on by its own uncached prompt; a request that ends or is observed early takes its remaining
// share back out.
type upstreamLoad struct {
	model *selection.ServiceModel

	tokens   atomic.Int64 // uncached prompt + expected output of the requests in flight (reports; KV demand in viewInto)
	requests atomic.Int64
	// sequences is what the requests in flight run on the backend: one each, or its n (best_of). The
	// decision counts them against the backend's slots, as the backend's own running count does.
	sequences atomic.Int64
	lastUsed  atomic.Int64 // unix nanoseconds of the last reserve or release

	// prefillUntil (unix nanoseconds) is when this proxy's queued prefill there is predicted done.
	prefillUntil atomic.Int64

	// saturatedUntil (unix nanoseconds) is set when the upstream answers 429 (vLLM's queue is full): until
	// then it is chosen only if nothing else is available. Its learned routes are kept.
	saturatedUntil atomic.Int64

	mu       sync.Mutex
	inflight []*reservation // this proxy's requests in flight, in no order
	kv       int64          // the KV-cache space they take (their reservation.kv added up)
	ended    [endRing]int64 // start times of recently ended requests, by end time (ring), for scrapes
	endedAt  [endRing]int64
	// endedLearned is when the route table learned each one's prefixes there (reservation.learned).
	endedLearned [endRing]int64
	// endedSequences is each one's sequences (reservation.seqs).
	endedSequences [endRing]int64
	endNext        int
	// endedPrompt is each recent end's prompt tokens if it completed, -1 if not; completed and
	// completedPrompt count every completed request there and their prompt tokens (tokenScale).
	endedPrompt                [endRing]int64
	completed, completedPrompt int64
	scale                      tokenScale      // the backend's tokens per token of this proxy's count
	scales                     *modelScales    // the table's scales learned per model
	firstTokens                firstTokenCheck // how late its first tokens come, by its own count
	prefill                    enginePrefill   // its prefill speed, by its own count
	// foreign is the requests its last scrape showed beyond this proxy's own, computed once per scrape.
	foreignAt    int64
	foreign      float64
	meanUncached float64 // uncached prompt tokens of this proxy's recent requests there (EWMA)
	// allocAt and allocCum are a ring of this proxy's recent requests there: when each was sent and the
	// KV-cache tokens (uncached prompt + expected output) sent there up to and including it; allocNext
	// is the next slot, allocN the slots filled, allocTotal the running sum (allocatedSince).
	allocAt  [allocRing]int64
	allocCum [allocRing]int64
	// allocReused and allocClaimed are, for the same requests, the prompt tokens each was predicted to
	// find cached there and when that prefix was last sent there before it (0: no claim): a cached prefix
	// reused moves to the back of the backend's LRU queue, past every prefix freed since (evictedSince).
	// allocHead is the hash of each one's first message (its system prompt; 0: none), which other
	// requests there share.
	allocReused  [allocRing]int32
	allocClaimed [allocRing]int64
	allocHead    [allocRing]uint64
	allocNext    int
	allocN       int
	allocTotal   int64
	// held is how long this proxy's requests there lately took, sent to ended (seconds, EWMA): a prefix
	// sent with a request is referenced, so not evictable, until about then (evictedSince).
	held float64
	// priced is the service as the last decision that weighed the upstream priced it (notePriced).
	priced   pricedService
	gap      float64 // seconds between this proxy's requests sent there (EWMA)
	gaps     int     // gaps observed, up to minGaps
	lastSent int64   // unix nanoseconds of the last one
	// pendingOurs are this proxy's requests without a first token at its last scrape, newest first: the
	// first waitingOurs of them the scrape counted as waiting, the rest as running (prefilling: chunked
	// prefill admits a long prompt into the batch and prefills it over several steps). foreignWaiting is
	// the waiting requests beyond them (other clients'). Computed once per scrape.
	pendingOurs    []*reservation
	waitingOurs    int
	foreignWaiting float64
	// backendUncached is the backend's own mean uncached prompt per request, in this proxy's tokens, from
	// the counters of its last scrape (backendMeanUncached): the size of other clients' waiting requests
	// where this proxy has sent none of its own to size them by. 0: not reported.
	backendUncached float64
	// decodingKnown is whether the last scrape's counters told which of this proxy's requests running there
	// were decoding (reservation.decoding; markDecodingLocked), and decodingBase the counters' difference
	// that stands for none of them (their drift).
	decodingKnown bool
	decodingBase  float64

	// Cache trust: the share of its predicted cache hits the backend's own prefix-cache counters confirm.
	// predicted and prompt add up what this proxy predicted cached and sent there; at each scrape their
	// growth since the last one is compared with the backend's hits and queries.
	predicted, prompt   atomic.Int64
	lastPredicted       int64
	lastPrompt          int64
	lastHits, lastQuery float64
	trust               float64 // 0-1; starts at 1
	// lastObserved is observed.prompt at the last scrape comparison: while the backend reports cached
	// tokens per request, those figures (exact, and this proxy's own) move trust instead of the scrape's.
	lastObserved int64
	startTime    float64 // the backend's process_start_time_seconds at the last scrape; 0: unknown
	// seenHits and seenQueries are the counters of the last snapshot checked for a restart (checkedAt);
	// the last* ones are those at the last trust comparison.
	seenHits, seenQueries float64
	checkedAt             int64
	// busyFrom is the snapshot the next busy interval is measured from (ObserveBusy); its At is zero
	// before the first. busyIdle is idleAtLocked at its time, and busyForeign whether a scrape since
	// (its own included) showed other clients' requests there.
	busyFrom    scraper.Snapshot
	busyIdle    int64
	busyForeign bool
	// stepFrom is the last snapshot observed and stepIdle idleAtLocked at its time: the start of the
	// next scrape-to-scrape interval (ObserveSteps).
	stepFrom scraper.Snapshot
	stepIdle int64
	// spanFrom and spanIdle are the same for the span in progress (ObserveSpan), which runs on through the
	// snapshots at which no engine step had ended.
	spanFrom scraper.Snapshot
	spanIdle int64
	// idleTotal is how long (nanoseconds) this proxy has had nothing in flight on the upstream, up to
	// idleSince, when it last had nothing in flight again (0 while something is): see idleAtLocked.
	idleTotal, idleSince int64
	// queueGen and queueSteps are the generation-token and step counters of the last snapshot whose
	// running and waiting counts taught the service model (ObserveQueue).
	queueGen, queueSteps float64

	observed cacheCounters // what the backend reported cached, against the predictions (observe.go)
	// horizon (nanoseconds) is how long the backend has lately kept a prefix, learned from its reports:
	// older claims are not credited. 0: not known (only route_ttl applies).
	horizon int64
}

// endRing is how many recent ends an upstream remembers to tell its scraped counts from this proxy's.
const endRing = 64

// loadTable maps dial addresses to their loads. Entries are created on first use and removed only when
// idle (nothing in flight) for idleAfter once the table holds more than sweepAbove of them, so memory is
// bounded by the number of upstreams in recent use however many dynamic upstreams come and go.
//
// Reserving holds the read lock while it adds, and sweeping holds the write lock while it checks and
// deletes, so an entry is never deleted between being looked up and being reserved.
type loadTable struct {
	mu     sync.RWMutex
	m      map[string]*upstreamLoad
	scales modelScales // the token scale last learned for each model served (tokenScale)
}

const (
	sweepAbove = 1024
	idleAfter  = 10 * time.Minute
)

var loads = &loadTable{m: make(map[string]*upstreamLoad)}

// reservation is one request's work on one upstream, released exactly once.
type reservation struct {
	load     *upstreamLoad
	dial     string
	uncached int // prompt tokens to prefill
	output   int // expected output tokens of each of its sequences
	// sequences is how many the backend generates (n, best_of; 0 counts as 1): they decode side by side,
	// so a request takes as long as one of them, and its observed output counts them all.
	sequences int
	kv        int   // KV-cache tokens it takes from the free space (selection.Decision.KVTokens)
	learned   int64 // when the route table learned its prefixes there (affinity.Table.Learn); 0: not
	start     int64 // unix nanoseconds, when it was sent
	waited    float64
	ahead     int // this proxy's other requests in flight on the upstream when it was sent
	// prefill is its own prefill in seconds, and prefillDone when it is predicted (or was observed) to
	// end; firstToken is set when the first token was observed.
	prefill     float64
	prefillDone int64
	firstToken  bool
	decoding    bool // its prefill was done at the last scrape, by the backend's counters (markDecodingLocked)
	index       int  // in load.inflight; -1 once released
	// outputSeen counts the output tokens observed in the response (0 when it is not observed), by the
	// one observer that reported first (counter: observerTransport or observerResume), so that two
	// observers of the same attempt never count it twice.
	outputSeen atomic.Int64
	counter    atomic.Int32
	// prediction is what the decision predicted cached, for the observer to check (observe.go).
	prediction prediction
	cacheSeen  atomic.Bool // the backend's cached tokens were observed for this attempt
}

// work describes a request about to be reserved on an upstream.
type work struct {
	uncached, output int
	sequences        int     // reservation.sequences
	kv               int     // KV-cache space it takes (reservation.kv); 0: uncached + output
	learned          int64   // reservation.learned
	prompt, matched  int     // its prompt tokens and those predicted cached there
	head             uint64  // the hash of its first message's boundary (query.head); 0: none
	waited           float64 // predicted seconds before its prefill can start (from the decision)
	ttft             float64 // its predicted time to first token, without the overrun's stretch (firstTokenCheck)
	prediction       prediction
}

// entry returns dial's load, creating it.
func (t *loadTable) entry(dial string, now int64) *upstreamLoad {
	t.mu.RLock()
	l := t.m[dial]
	t.mu.RUnlock()
	if l != nil {
		return l
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if l = t.m[dial]; l == nil {
		if len(t.m) >= sweepAbove {
			t.sweepLocked(now)
		}
		l = t.newLoad(selection.Prior, now)
		t.m[dial] = l
	}
	return l
}

// newLoad returns an upstream's load with nothing in flight and nothing learned, its service model
// starting from prior, sharing the table's scales learned per model (shareScaleLocked).
func (t *loadTable) newLoad(prior selection.Service, now int64) *upstreamLoad {
	l := &upstreamLoad{model: selection.NewServiceModel(prior), trust: 1, idleSince: now, scales: &t.scales}
	l.lastUsed.Store(now)
	return l
}

// forget replaces the load of every upstream with nothing in flight (only (dial), when dial is not
// empty) by one that has learned nothing (DELETE /llm/upstreams): its service model back at its prior (a
// configured capacity's is kept), slot count, token scale, cache trust and horizon, and scrape baselines
// all start again, and, forgetting every upstream, the scales learned per model; a saturation still
// running is kept. An upstream with requests in flight keeps
// everything, so each of them is released exactly once where it was counted. It returns how many
// upstreams it forgot and kept.
func (t *loadTable) forget(dial string, now int64) (forgotten, kept int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	one := func(d string, l *upstreamLoad) {
		if l.requests.Load() > 0 {
			kept++
			return
		}
		fresh := t.newLoad(l.model.Prior(), now)
		fresh.saturatedUntil.Store(l.saturatedUntil.Load())
		t.m[d] = fresh
		forgotten++
	}
	if dial != "" {
		if l := t.m[dial]; l != nil {
			one(dial, l)
		}
		return forgotten, kept
	}
	for d, l := range t.m {
		one(d, l)
	}
	t.scales.clear() // the scales of the upstreams kept are theirs, and shared again at their next scrape
	return forgotten, kept
}

// lookup returns dial's load, or nil for an upstream never used.
func (t *loadTable) lookup(dial string) *upstreamLoad {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.m[dial]
}

// reserve adds one request to dial's load. The read lock is held while adding, so a sweep cannot delete
// the entry in between.
func (t *loadTable) reserve(dial string, w work, now int64) *reservation {
	for {
		l := t.entry(dial, now)
		t.mu.RLock()
		if t.m[dial] != l { // swept between entry and here: look it up again
			t.mu.RUnlock()
			continue
		}
		r := l.add(dial, w, now)
		t.mu.RUnlock()
		return r
	}
}

// add records r as in flight and queues its prefill.
func (l *upstreamLoad) add(dial string, w work, now int64) *reservation {
	svc := l.model.Service()
	r := &reservation{load: l, dial: dial, uncached: w.uncached, output: w.output, sequences: w.sequences, kv: w.kv,
		learned: w.learned, start: now, waited: w.waited, prediction: w.prediction}
	if r.kv == 0 {
		r.kv = int(r.weight())
	}
	r.prefill = svc.PrefillSecondsPerToken * float64(w.uncached)
	l.mu.Lock()
	begin := max(now+seconds(w.waited), l.prefillUntil.Load())
	l.prefillUntil.Store(begin + seconds(r.prefill))
	r.prefillDone = begin + seconds(r.prefill+svc.Overhead)
	r.index, r.ahead = len(l.inflight), len(l.inflight)
	if len(l.inflight) == 0 && l.idleSince > 0 {
		l.idleTotal += max(now-l.idleSince, 0)
		l.idleSince = 0
	}
	if p := &r.prediction; p.claimAge > 0 && p.claimed > 0 { // only a credited claim can be denied
		p.unsettled = l.prefillingLocked(now - p.claimAge)
	}
	l.inflight = append(l.inflight, r)
	l.firstTokens.sent(now, w.ttft)
	l.kv += int64(r.kv)
	l.allocTotal += int64(w.uncached + selection.OutputKV(r.outputs(), l.tokenScaleLocked()))
	l.allocAt[l.allocNext], l.allocCum[l.allocNext] = now, l.allocTotal
	l.allocReused[l.allocNext], l.allocClaimed[l.allocNext], l.allocHead[l.allocNext] = 0, 0, w.head
	if w.matched > 0 && w.prediction.claimAge > 0 {
		l.allocReused[l.allocNext], l.allocClaimed[l.allocNext] = int32(min(w.matched, math.MaxInt32)), now-w.prediction.claimAge
	}
	l.allocNext = (l.allocNext + 1) % allocRing
	l.allocN = min(l.allocN+1, allocRing)
	if l.meanUncached == 0 {
		l.meanUncached = float64(w.uncached)
	} else {
		l.meanUncached += 0.05 * (float64(w.uncached) - l.meanUncached)
	}
	if l.lastSent > 0 {
		dt := max(float64(now-l.lastSent)/1e9, 0)
		if l.gaps == 0 {
			l.gap = dt
		} else {
			l.gap += 0.1 * (dt - l.gap)
		}
		l.gaps = min(l.gaps+1, minGaps)
	}
	l.lastSent = now
	l.mu.Unlock()
	l.tokens.Add(r.weight())
	l.requests.Add(1)
	l.sequences.Add(r.seqs())
	l.prompt.Add(int64(w.prompt))
	l.predicted.Add(int64(w.matched))
	l.lastUsed.Store(now)
	return r
}

// prefillingLocked reports whether a request of this proxy's in flight there, whose prefixes the route
// table learned at learned (affinity.Table.Learn's time, reservation.learned), has had no first token
// yet: the route table's claim of that time may be a prefix still being computed. The caller holds l.mu.
func (l *upstreamLoad) prefillingLocked(learned int64) bool {
	for _, o := range l.inflight {
		if o.learned == learned && !o.firstToken {
			return true
		}
	}
	return false
}

// noteFirstToken records r's first token at now: its prefill is done. It teaches the service model the
// first-token delay and moves the virtual queue by the prediction's error. Only the first call counts.
//
// The requests predicted to prefill after r (a pass over the upstream's requests in flight) move with
// it: r's prefill delayed (or hastened) theirs, and their own first tokens must not count its error
// again. Before, each one's first token moved the queue by its whole lateness against its first
// prediction, so a delay shared by n requests queued behind one another moved it n times.
//
// A first token that probably waited for a slot the prediction did not count (the model's
// ObserveFirstToken says so: the slot count is unknown) does not move the queue later: the virtual queue
// is prefill, and a slot's wait is none. Moved by such waits, on a shared prefix's home (8 slots, no
// metrics) it grew with every late first token to predicted waits of 200-300 ms there, and the decision
// sent the prefix's requests to upstreams that had to prefill it whole (docs/bench/observed-queue).
func (r *reservation) noteFirstToken(now int64) {
	l := r.load
	l.mu.Lock()
	defer l.mu.Unlock()
	if r.firstToken || r.index < 0 {
		return
	}
	r.firstToken = true
	// The model's lock inside l.mu, as the scrapes take them (ObserveQueue, ObserveBusy).
	since := now - max(r.start, l.endedAt[(l.endNext+endRing-1)%endRing]) // since it was sent, or the last end after that
	slotWait := l.model.ObserveFirstToken(r.uncached, r.ahead, r.waited, float64(now-r.start)/1e9, float64(since)/1e9)
	early := r.prefillDone - now // > 0: done sooner than predicted; the queue behind it moves up
	if slotWait {
		early = max(early, 0)
	}
	was := r.prefillDone
	r.prefillDone = now
	if until := l.prefillUntil.Load(); early != 0 {
		l.prefillUntil.Store(max(until-early, now))
		for _, o := range l.inflight { // those queued behind r move with it, once
			if !o.firstToken && o.prefillDone > was {
				o.prefillDone = max(o.prefillDone-early, now)
			}
		}
	}
}

// release ends r: it leaves the in-flight set and, if it was still predicted to be prefilling, takes its
// remaining prefill out of the queue. completed says the request ran to its end (a whole answer): only
// those teach the service model.
func (r *reservation) release(now int64, completed bool) {
	l := r.load
	l.mu.Lock()
	if r.index < 0 {
		l.mu.Unlock()
		return
	}
	last := len(l.inflight) - 1
	l.inflight[r.index] = l.inflight[last]
	l.inflight[r.index].index = r.index
	l.inflight[last] = nil
	l.inflight = l.inflight[:last]
	l.kv -= int64(r.kv)
	r.index = -1
	if len(l.inflight) == 0 {
		l.idleSince = now
	}
	if r.prefillDone > now {
		l.prefillUntil.Store(max(l.prefillUntil.Load()-r.prefillLeft(now), now))
	}
	l.ended[l.endNext], l.endedAt[l.endNext], l.endedLearned[l.endNext] = r.start, now, r.learned
	l.endedSequences[l.endNext] = r.seqs()
	l.endedPrompt[l.endNext] = -1
	if completed {
		l.endedPrompt[l.endNext] = int64(r.prediction.prompt)
		l.completed++
		l.completedPrompt += int64(r.prediction.prompt)
	}
	l.endNext = (l.endNext + 1) % endRing
	if completed {
		if d := float64(now-r.start) / 1e9; l.held == 0 {
			l.held = d
		} else {
			l.held += 0.05 * (d - l.held)
		}
	}
	l.mu.Unlock()
	l.tokens.Add(-r.weight())
	l.requests.Add(-1)
	l.sequences.Add(-r.seqs())
	l.lastUsed.Store(now)
	if completed {
		output := r.output
		if seen := r.seenPerSequence(); seen > 0 {
			output = seen
		}
		l.model.ObserveEnd(r.uncached, output, r.waited, float64(now-r.start)/1e9)
	}
}

func seconds(s float64) int64 { return int64(s * 1e9) }

// promptTokens is r's prompt tokens by this proxy's count, cached ones included (its uncached ones where
// the decision had no prompt to predict on).
func (r *reservation) promptTokens() int { return max(r.prediction.prompt, r.uncached) }

// weight is what r counts in its upstream's tokens in flight: its uncached prompt and the output of all
// its sequences.
func (r *reservation) weight() int64 { return int64(r.uncached + r.outputs()) }

// outputs is the expected output of all r's sequences.
func (r *reservation) outputs() int { return r.output * int(r.seqs()) }

// seqs is the sequences r runs: its n, or one.
func (r *reservation) seqs() int64 { return int64(max(r.sequences, 1)) }

// seenPerSequence is the output observed so far per sequence of r (rounded up): one sequence's progress,
// which is the request's, since its sequences decode side by side.
func (r *reservation) seenPerSequence() int {
	seqs := r.seqs()
	return int((r.outputSeen.Load() + seqs - 1) / seqs)
}

// outputPerSequence is what r's sequences are to output each, as the decision reads it while r runs:
// the expected output, or what one has been seen to output already when that is more.
func (r *reservation) outputPerSequence() int { return max(r.output, r.seenPerSequence()) }

// prefillLeft is what is left at now of r's predicted prefill (nanoseconds): up to its own prefill
// before the predicted end, nothing after it.
func (r *reservation) prefillLeft(now int64) int64 {
	return min(max(r.prefillDone-now, 0), seconds(r.prefill))
}

// upstreamView is what the decision reads of one upstream at one moment.
type upstreamView struct {
	service  selection.Service
	requests float64 // this proxy's in flight, plus foreign ones its metrics show
	queued   float64 // seconds of prefill queued ahead of a new request
	// settled is queued with this proxy's requests sent since the scrape counted until their predicted
	// first tokens instead of in full (the same as queued without a fresh scrape): the prediction, where
	// queued is the spreading signal (see fromScrapeLocked). See continuesHome.
	settled float64
	// arrivals is the rate at which this proxy sends it requests, per second; -1 when it has been sent
	// requests, but too few gaps between them to tell a rate (arrivalRateLocked).
	arrivals float64
	// kvCapacity is its KV cache in tokens (0: unknown, no fresh scrape says) and kvUsed the tokens wanted:
	// the scraped usage plus what this proxy sent since, and at least what all this proxy's requests in
	// flight there want, admitted or waiting (a scrape counts only the admitted: a prompt waiting for space
	// is in no usage figure). A request wants its prompt to prefill and its expected output, and its whole
	// prompt where the cached prefix it reuses was free (selection.Candidate.CachedFree): an agent whose
	// history waits in the free queue wants all of it back, and counted at what it prefills, three such
	// requests waiting there looked like a third of their demand (fast-prefill agentic: first tokens of
	// 7-10 s predicted at 1-3 s).
	kvCapacity, kvUsed float64
	tokenScale         float64 // the backend's tokens per token of this proxy's count (tokenScale)
	// overdue is how many times longer than service predicts this proxy's requests in flight there have
	// already run (see upstreamLoad.overdueLocked); 0 when none overran, or when a scrape shows others'
	// requests there (see viewInto).
	overdue float64
	// full is the running count at which the upstream is full now: its fresh scrape shows requests
	// waiting, not for cache space, at its likely slot count (selection.Service.LikelySlots: every such
	// scrape the service model has taken was at the most it has been seen running, two at least; a
	// backend limited by the chunked-prefill token budget queues at varying batch sizes); 0 otherwise.
	// See fullNow.
	full float64
	// open is whether its fresh scrape leaves its ceiling open (openCeiling): the decision of a hot
	// prefix brings its next scrape forward.
	open bool
	// load is the upstream's entry, to note the service as priced (notePriced); nil while it has none.
	load *upstreamLoad
}

// pricedService is an upstream's service as a decision priced it: its own model blended with the fleet's
// where it has few samples, aligned with alike backends and stretched by its overrun (loadSignal.fill).
// at is when (unix nanoseconds; 0: never priced).
type pricedService struct {
	prefillSecondsPerToken, tokenSeconds, overhead float64
	at                                             int64
}

// notePriced keeps s as the service the decision at now priced l at, for /llm/upstreams and the metrics:
// what the decision used, where the learned model is what l's own requests taught.
func (l *upstreamLoad) notePriced(s selection.Service, now int64) {
	l.mu.Lock()
	l.priced = pricedService{prefillSecondsPerToken: s.PrefillSecondsPerToken, tokenSeconds: s.TokenSeconds, overhead: s.Overhead, at: now}
	l.mu.Unlock()
}

// viewInto returns dial's state at now for the decision.
//
// Without a fresh scrape, the queued prefill is this proxy's virtual queue, a prediction. With one, it
// is what the backend itself shows waiting at the time of the scrape (its own requests and everyone
// else's, at the mean uncached prompt of this proxy's requests there, or the backend's own where this
// proxy sent none) plus what this proxy sent since, still before its first token; what the scrape
// showed waiting drains at the upstream's prefill speed since: truth up to one scrape old, and this
// proxy's own changes since, so a burst is never sent to an upstream because it looked idle at the last
// scrape, nor a prefix kept off its home for a queue it has prefilled since. Its running and waiting requests beyond this proxy's own at the time of the scrape
// are added to the requests in flight, once.
//
// The overrun of this proxy's requests there (overdueLocked) is reported only where the proxy's own
// view holds all the upstream's load: no scrape, or one that shows no one else's requests. Where others'
// requests are there, they explain why this proxy's overran their predictions (each was predicted
// without the requests others sent after it), and they are already counted, in the queue and the
// requests in flight: stretched by the overrun too, that load was counted twice, and several proxies
// sharing routes, each seeing only its own requests' overruns, disagreed on where a prefix goes (three
// instances sharing routes reached 92-97% of one instance's hit rate with it, 95-101% without; a
// backend 3x slower than the fleet, alone behind one proxy, is avoided as well either way).
//
// viewInto also appends to holds this proxy's requests in flight there, as the wait for a slot reads them
// (selection.Hold; none when there are more than selection.MaxHolding), in the same pass under the
// upstream's lock.
func (t *loadTable) viewInto(dial string, now int64, snap *scraper.Snapshot, holds []selection.Hold) (upstreamView, []selection.Hold) {
	l := t.lookup(dial)
	if l == nil {
		if snap == nil {
			return upstreamView{service: selection.Prior}, holds
		}
		l = t.entry(dial, now)
	}
	v := upstreamView{
		service:  l.model.Service(),
		requests: float64(l.sequences.Load()),
		load:     l,
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	v.arrivals = l.arrivalRateLocked(now)
	foreign := 0.0
	if snap == nil {
		v.queued = max(float64(l.prefillUntil.Load()-now)/1e9, 0)
		v.settled = v.queued
		v.tokenScale = l.tokenScaleLocked()
	} else {
		var kvSince float64
		foreign, v.queued, v.settled, kvSince = l.fromScrapeLocked(snap, now, v.service)
		v.tokenScale = l.tokenScaleLocked() // after the scrape is read: it may have taught the scale
		v.requests += foreign
		if c := l.kvCapacityLocked(snap); c > 0 {
			v.kvCapacity, v.kvUsed = c, max(snap.KVUsage*c+kvSince, float64(l.kv))
		}
		if l := v.service.LikelySlots; l > 0 && snap.Running >= l && selection.SlotBound(snap.Running, snap.Waiting, snap.KVUsage) {
			v.full = snap.Running
		}
		v.open = openCeiling(v.service, snap)
	}
	if foreign < 1 {
		v.overdue = l.overdueLocked(now, v.service)
	}
	if len(l.inflight) <= selection.MaxHolding {
		for _, r := range l.inflight {
			holds = append(holds, selection.Hold{Age: float64(now-r.start) / 1e9, Uncached: r.uncached, Output: r.outputPerSequence()})
		}
	}
	return v, holds
}

// openCeiling reports whether snap, the upstream's latest scrape, shows requests waiting at the most it
// has been seen running while its slot count is not even likely yet (selection.Service.LikelySlots: two
// such scrapes): the next scrape, brought forward, confirms or refutes it. At the interval, the second
// came a simulated second after the first, and in that second the upstreams holding a hot prefix took
// bursts of its cache hits onto 8 slots (small-batch hot-prefix: 12 of 16 requests to one upstream with
// 10-13 in flight, predicted at 60-135 ms, answered in 0.6-1.4 s).
func openCeiling(s selection.Service, snap *scraper.Snapshot) bool {
	return s.Slots == 0 && s.LikelySlots == 0 && snap.Running >= s.Ceiling &&
		selection.SlotBound(snap.Running, snap.Waiting, snap.KVUsage)
}

// overdueLocked returns how many times longer than s predicts this proxy's requests in flight there
// have already run: the second largest ratio of a request's age to its predicted duration (its
// predicted wait, its time to first token, its output at s's time per token), or 0 when it is below 1
// or fewer than two requests are in flight; the caller holds l.mu. A request still running at that age
// is a censored duration: it takes at least that long. A backend much slower than its estimate (one
// barely measured yet, priced at the others' speed) shows it here long before its first request ends
// (the model learns only from ends; this stretches the decision's view, loadSignal); the second
// largest, so that one stalled connection or one answer far longer than expected does not.
func (l *upstreamLoad) overdueLocked(now int64, s selection.Service) float64 {
	first, second := 0.0, 0.0
	for _, r := range l.inflight {
		pred := r.waited + s.Duration(r.uncached, r.outputPerSequence())
		if !(pred > 0) {
			continue
		}
		switch ratio := float64(now-r.start) / 1e9 / pred; {
		case ratio > first:
			first, second = ratio, first
		case ratio > second:
			second = ratio
		}
	}
	if second < 1 {
		return 0
	}
	return second
}

// allocRing is how many recent requests allocatedSince remembers per upstream.
const allocRing = 256

// allocatedSince returns (at least) the KV-cache tokens this proxy's requests allocated on the upstream
// after time at (unix nanoseconds): what it sent there since, uncached prompts and expected outputs.
// Older than the requests it remembers, it is what they allocated: a lower bound.
func (l *upstreamLoad) allocatedSince(at int64) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	n, _ := l.sentSinceLocked(at)
	return n
}

// sentSinceLocked returns allocatedSince's figure and the position (in time order, from the oldest
// remembered) of the first remembered request sent after at. The caller holds l.mu.
func (l *upstreamLoad) sentSinceLocked(at int64) (allocated int64, first int) {
	oldest := (l.allocNext - l.allocN + allocRing) % allocRing
	// The last remembered request sent at or before at (times are in sending order, within the
	// decisions' jitter): binary search over the ring in time order.
	k := sort.Search(l.allocN, func(i int) bool { return l.allocAt[(oldest+i)%allocRing] > at })
	switch {
	case k > 0:
		return l.allocTotal - l.allocCum[(oldest+k-1)%allocRing], k
	case l.allocN < allocRing:
		return l.allocTotal, 0 // nothing was sent there before at
	}
	return l.allocTotal - l.allocCum[oldest], 0
}

// evictedSince returns (at least) the KV-cache tokens of this proxy's requests that stand between a
// prefix last sent to the upstream at seen (unix nanoseconds) and the cache's capacity at now: those
// allocated since the prefix became evictable, when the request that sent it ended (about held after
// seen; vLLM frees a request's blocks to the tail of its least-recently-used queue when it ends, and
// blocks in use are never evicted), plus those still held by requests that were running then and still
// are, plus the cached prefixes reused since that had been sent there before it: the queue is least
// recently *used* first, so a prefix freed ahead of this one and reused since has moved behind it, and
// what is ahead of it shrinks by as much as by an allocation. Each such prefix counts once, at its first
// reuse since (a later one's previous send is after seen), less the first message it shares with the
// claim (head: a system prompt both begin with is the claim's own blocks, not ahead of it). Counting
// allocations alone, an agent's history was predicted cached at its home as long as the new tokens sent
// there since fit beside it, while another session's turn there, a predicted hit on its own 25k-token
// history, had pushed it out (fast-prefill agentic's slowest first tokens, docs/bench/reuse-2a5a2d2).
// 0 while the prefix is still in use.
func (l *upstreamLoad) evictedSince(seen, now int64, head tokenize.Boundary) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	freed := l.freedLocked(seen)
	if freed >= now {
		return 0 // still in use
	}
	n, first := l.sentSinceLocked(freed)
	oldest := l.allocNext - l.allocN + allocRing
	for i := first; i < l.allocN; i++ {
		if k := (oldest + i) % allocRing; l.allocClaimed[k] > 0 && l.allocClaimed[k] < seen {
			reused := int64(l.allocReused[k])
			if head.Hash != 0 && l.allocHead[k] == head.Hash {
				reused = max(reused-int64(head.Tokens), 0)
			}
			n += reused
		}
	}
	// Requests already running when it was freed and running still hold their blocks: what is free
	// ahead of the prefix in the queue is that much less.
	scale := l.tokenScaleLocked()
	for _, r := range l.inflight {
		if r.start <= freed {
			n += int64(r.uncached + selection.OutputKV(r.outputs(), scale))
		}
	}
	return n
}

// holds reports whether the upstream still holds, in a request running there, a prefix the route table
// learned there at seen (unix nanoseconds, affinity.Table.MatchSeen): whether the request that sent it
// is still in flight. When neither it nor its end is remembered (a route a peer learned, or one older
// than the last endRing ends), whether it was sent less than a request's usual duration there ago (see
// evictedSince). An agent's turn that ended early, read by that average, looked as if it still held its
// history, and the next turn was predicted to fit in the cache beside it (hetero agentic: first tokens
// predicted at 0.6 s came after 7 s).
func (l *upstreamLoad) holds(seen, now int64) bool {
	if seen == 0 {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.inflight {
		if r.learned == seen {
			return true
		}
	}
	for _, learned := range l.endedLearned {
		if learned == seen {
			return false
		}
	}
	return l.freedLocked(seen) >= now
}

// freedLocked is when a prefix sent at seen is predicted freed: when the request that sent it ends, about
// held later. The caller holds l.mu.
func (l *upstreamLoad) freedLocked(seen int64) int64 { return seen + seconds(l.held) }

// minGaps is how many gaps between requests an arrival rate needs.
const minGaps = 4

// arrivalRateLocked is how many requests a second this proxy has been sending there: the inverse of the
// mean gap between them, or of the time since the last one when that is longer (traffic stopped); 0 when
// it has been sent nothing, and -1 when it has but with fewer than minGaps gaps (a rate from one or two
// gaps is a guess: a burst of two looks like thousands a second; see knownArrivals). The caller holds
// l.mu.
func (l *upstreamLoad) arrivalRateLocked(now int64) float64 {
	if l.gaps < minGaps {
		if l.lastSent > 0 {
			return -1
		}
		return 0
	}
	gap := max(l.gap, float64(now-l.lastSent)/1e9)
	if gap <= 0 {
		return 0
	}
	return 1 / gap
}

// saturate marks dial saturated until the given time.
func (t *loadTable) saturate(dial string, until time.Time) {
	if l := t.lookup(dial); l != nil {
		l.saturatedUntil.Store(until.UnixNano())
	}
}

// saturated reports whether dial is marked saturated at now.
func (t *loadTable) saturated(dial string, now int64) bool {
	l := t.lookup(dial)
	return l != nil && l.saturatedUntil.Load() > now
}

// get returns dial's in-flight tokens and requests; zero for an upstream never used.
func (t *loadTable) get(dial string) (tokens, requests int64) {
	l := t.lookup(dial)
	if l == nil {
		return 0, 0
	}
	return l.tokens.Load(), l.requests.Load()
}

// snapshot returns every known upstream's load and phases at now, in no particular order.
func (t *loadTable) snapshot(now int64) []upstreamInflight {
	t.mu.RLock()
	out := make([]upstreamInflight, 0, len(t.m))
	ls := make([]*upstreamLoad, 0, len(t.m))
	for dial, l := range t.m {
		out = append(out, upstreamInflight{Dial: dial})
		ls = append(ls, l)
	}
	t.mu.RUnlock()
	for i, l := range ls {
		out[i].Tokens, out[i].Requests = l.tokens.Load(), l.requests.Load()
		out[i].Service = l.model.Service()
		out[i].QueuedSeconds = max(float64(l.prefillUntil.Load()-now)/1e9, 0)
		if out[i].Requests == 0 {
			out[i].IdleSeconds = max(float64(now-l.lastUsed.Load())/1e9, 0)
		}
		out[i].Cache = l.cacheFigures()
		l.mu.Lock()
		out[i].Overrun = l.overdueLocked(now, out[i].Service)
		out[i].TokenScale = l.tokenScaleLocked()
		out[i].Late = l.firstTokens.late()
		out[i].EnginePrefill = l.prefill.tokensPerSecond(out[i].TokenScale)
		out[i].Priced = l.priced
		for _, r := range l.inflight {
			if r.prefillingLocked(l, now) {
				out[i].Prefilling++
				out[i].PrefillTokens += int64(r.uncached)
			}
		}
		l.mu.Unlock()
		out[i].Decoding = out[i].Requests - out[i].Prefilling
	}
	return out
}

// prefillingLocked reports whether r, in flight on l, is prefilling at now, as /llm/upstreams reports
// it: until its predicted (or observed) first token, or, where the last scrape's counters told
// (markDecodingLocked) and r was sent before it, as they told. The caller holds l.mu.
func (r *reservation) prefillingLocked(l *upstreamLoad, now int64) bool {
	if l.decodingKnown && !r.firstToken && r.start <= l.foreignAt {
		return !r.decoding
	}
	return r.prefillDone > now
}

type upstreamInflight struct {
	Dial                 string
	Tokens, Requests     int64
	Prefilling, Decoding int64
	PrefillTokens        int64
	QueuedSeconds        float64
	IdleSeconds          float64 // since a request last began or ended there (or the entry was made); 0 while any is in flight
	Overrun              float64 // see overdueLocked
	TokenScale           float64 // the backend's tokens per token of this proxy's count (tokenScale)
	Late                 float64 // how late its first tokens come by its own count (firstTokenCheck); 0: unknown
	EnginePrefill        float64 // its prefill tokens per second by its own count (enginePrefill); 0: unknown
	Service              selection.Service
	Priced               pricedService // as the last decision that weighed it priced it
	Cache                cacheFigures
}

// sweepLocked deletes idle entries, but not those of upstreams with a configured capacity: their prior
// is configuration (LLMSelection.Capacities, set at Provision), and an entry made again on the next use
// would start from the default one. The caller holds the write lock.
func (t *loadTable) sweepLocked(now int64) {
	for dial, l := range t.m {
		if l.requests.Load() == 0 && now-l.lastUsed.Load() > int64(idleAfter) && l.saturatedUntil.Load() < now &&
			l.model.Prior() == selection.Prior {
			delete(t.m, dial)
		}
	}
}

// reservationHolder owns the one reservation a request holds at a time. Each Select swaps in the new
// attempt's reservation and releases the previous one; the request's end (its context is done: the
// handler returned, the stream ended, or the client went away) releases the last. The lock is needed
// because the end runs on its own goroutine, possibly while a retry is selecting.
type reservationHolder struct {
	mu      sync.Mutex
	current *reservation
	done    bool
	// onEnd is called once at the end with the last reservation's upstream, if any, before it is
	// released; it reports whether the request completed (only completed requests teach the model).
	onEnd func(dial string) (completed bool)
}

// newReservationHolder returns a holder that releases its reservation when ctx is done, calling onEnd
// (if not nil) with the upstream that reservation was on.
func newReservationHolder(ctx context.Context, onEnd func(dial string) bool) *reservationHolder {
	h := &reservationHolder{onEnd: onEnd}
	context.AfterFunc(ctx, h.finish)
	return h
}

// swap releases the current reservation, if any, and holds next instead (nil holds nothing). A request
// that already ended releases next at once, so nothing reserved after the end is lost.
func (h *reservationHolder) swap(next *reservation) {
	h.mu.Lock()
	prev := h.current
	h.current = next
	if h.done {
		h.current = nil
	}
	done := h.done
	h.mu.Unlock()
	now := time.Now().UnixNano()
	if prev != nil {
		prev.release(now, false) // an attempt that was retried did not complete
	}
	if done && next != nil {
		next.release(now, false)
	}
}

// attempt returns the current attempt's reservation (nil if none).
func (h *reservationHolder) attempt() *reservation {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.current
}

// finish releases the last reservation; it runs once, when the request's context is done.
func (h *reservationHolder) finish() {
	h.mu.Lock()
	prev := h.current
	h.current = nil
	h.done = true
	h.mu.Unlock()
	if prev == nil {
		return
	}
	completed := false
	if h.onEnd != nil {
		completed = h.onEnd(prev.dial)
	}
	prev.release(time.Now().UnixNano(), completed)
}
