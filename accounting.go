package caddyllm

import (
	"cmp"
	"context"
	"math"
	"slices"
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

// kvCapacityLocked is the KV cache's size snap reports, in this proxy's tokens (the snapshot's is in the
// backend's, every other KV figure here in this proxy's); 0 when it reports none. The caller holds l.mu.
func (l *upstreamLoad) kvCapacityLocked(snap *scraper.Snapshot) float64 {
	return float64(snap.BlockSize) * float64(snap.NumBlocks) / l.tokenScaleLocked()
}

// fromScrapeLocked returns the requests snap shows beyond this proxy's own at the time of the scrape, the
// seconds of prefill queued there at now for an upstream of service s (queued,
// and settled: with this proxy's requests since the scrape each counted for what is left of its
// predicted prefill instead of in full), and the KV cache tokens this proxy's requests since the scrape
// take (reservation.kv).
// The first call for a new snapshot also tells the service model the backend's queue and checks the
// cache predictions. The caller holds l.mu.
//
// The queue at the scrape is the backend's count of waiting requests, each one sized: a backend admits
// in arrival order, so its waiting requests are the newest it received, and this proxy's requests sent
// before the scrape, newest first, stand for as many of them as they can, with their own uncached prompts
// (until their first token is observed or they end). The rest are other clients', at the mean uncached
// prompt of this proxy's requests there, or the backend's own where it has none (foreignUncachedLocked).
// Ahead of that backlog is what is left of the prefill of this proxy's requests the scrape counts as
// running that have no first token yet: with chunked prefill a
// backend admits a long prompt into its batch at once and prefills it over many steps (a 20k-token
// prompt at 8k tokens/s runs for 2.5 s with nothing waiting), and without them an upstream two seconds
// into a new agent session's prefill looked idle and took the next new session too (large-batch agentic:
// the worst first tokens, 3-7 s, were such pairs). The backend works all that off at its prefill speed from
// the scrape on: a scrape is up to one interval old, and a backlog it showed is mostly prefilled long
// before the next (read as it stood, each waiting request counted for a whole interval against an
// upstream that had long started it: three instances sharing routes moved shared-prefix groups off
// their home for another instance's requests that were gone, and reached 81-95% of one instance's hit
// rate instead of 93-99%). To that come, in full, this proxy's requests sent since the scrape that have
// not had their first token: no scrape has confirmed them yet. (Drained too, they left nothing that
// spreads this proxy's own recent sends while the cost has no term for the batch they join: on
// multi-turn, one backend took no request and TTFT p50 went from 96 to 121 ms.)
func (l *upstreamLoad) fromScrapeLocked(snap *scraper.Snapshot, now int64, s selection.Service) (foreign, queued, settled, kvSince float64) {
	at := snap.At.UnixNano()
	l.scrapedLocked(snap)
	spt := s.PrefillSecondsPerToken
	// Seconds a KV-cache token stands for, its share of the cache's turnover; 0 where it is not used: the
	// cache's size unknown, or first tokens seen there (see the late requests below).
	turnover := 0.0
	if c := l.kvCapacityLocked(snap); c > 0 && s.MeanDuration > 0 && s.FirstTokens+s.SkippedFirstTokens == 0 && !l.decodingKnown {
		turnover = s.MeanDuration / c
	}
	backlog := l.foreignWaiting * l.foreignUncachedLocked()
	for _, r := range l.pendingOurs[:l.waitingOurs] {
		if r.index >= 0 && !r.firstToken {
			backlog += float64(r.uncached)
		}
	}
	// Ahead of the waiting ones, what is left of the prefill of those already running at the scrape: they
	// end when this proxy predicted (prefillDone), unless their first token came sooner. One already later
	// than predicted has about as long again to go as it is late, up to its whole prefill: its upstream
	// is slower than its estimate (a new backend, before its first tokens teach it), and counting it done
	// made that upstream look idle beside the others, whose running prefills count, and took every
	// request until it answered. But a proxy that sees no first tokens there (no transport llm) cannot
	// tell that from a request that has had its first token and is decoding, which holds no prefill but
	// KV-cache space, and that frees as requests end: the whole cache once every mean request duration,
	// so kv tokens of it stand for kv/capacity of that duration. There a late request holds the lesser of
	// its prefill and that. Held at its whole prefill until it ended, each long prompt decoding on a
	// slow-prefill fleet was 2 s of queue (4,000 tokens at 2k tokens/s; at the cache's turnover 0.3-1.2 s),
	// pricing the idle upstreams nearly as busy as those with prompts truly waiting (slow-prefill mixed:
	// llm's own p99 0.86-0.91x with the bound, docs/bench/kv-hold). Where prefill is fast the two are
	// about equal, and the hold keeps long prompts off caches about to fill. Where first tokens are seen,
	// a late one without its first token is still prefilling and holds its prefill.
	//
	// A vLLM backend's own counters tell the two apart (markDecodingLocked): one they show decoding holds
	// nothing more, as one with a first token seen, and one they show still prefilling holds its prefill,
	// without the turnover bound. Bounded instead, a long prompt truly prefilling on a slow-prefill fleet
	// stood for a third of its queue, beside one decoding on the next upstream that stood for as much (the
	// long prompts went to an upstream with more truly pending than the least as often as before the bound,
	// docs/bench/kv-hold); held at its turnover share, a decoding request kept spreading a load the cost
	// prices already, in slots and cache space (docs/bench/decoding-counters).
	var left, ahead int64 // left at now; predicted at the scrape to be left of it
	for _, r := range l.pendingOurs[l.waitingOurs:] {
		if r.index >= 0 && !r.firstToken && !r.decoding {
			late := max(now-r.prefillDone, 0)
			held := seconds(r.prefill)
			if turnover > 0 {
				held = min(held, seconds(float64(r.kv)*turnover))
			}
			left = max(left, r.prefillDone-now, min(late, held))
			ahead = max(ahead, r.prefillDone-at)
		}
	}
	since, sinceLeft := 0, int64(0)
	for _, r := range l.inflight {
		if r.start > at {
			kvSince += float64(r.kv)
			if !r.firstToken {
				since += r.uncached
				sinceLeft += r.prefillLeft(now)
			}
		}
	}
	drained := float64(max(now-at-ahead, 0)) / 1e9 // the waiting ones start once the running ones are done
	scraped := float64(left)/1e9 + max(backlog*spt-drained, 0)
	return l.foreign, scraped + float64(since)*spt, scraped + float64(sinceLeft)/1e9, kvSince
}

// observeScrape reads a new snapshot of dial's metrics as it arrives (scraper.Options.OnScrape), as a
// decision would (noteScrape, then what viewInto reads once per snapshot), so that what it teaches (a restart,
// the service model's queue and busy intervals, the cache trust, the token scale) does not wait for the
// next decision; a decision that reads it later finds it read.
func (t *loadTable) observeScrape(dial string, snap *scraper.Snapshot) {
	now := time.Now().UnixNano()
	t.noteScrape(dial, snap, now)
	l := t.entry(dial, now)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.scrapedLocked(snap)
}

// scrapedLocked reads snap once, whoever sees it first (its arrival or a decision): the requests beyond
// this proxy's own, which of this proxy's are the waiting ones, the service model's queue and the cache
// trust. A snapshot already read is skipped. The caller holds l.mu.
func (l *upstreamLoad) scrapedLocked(snap *scraper.Snapshot) {
	at := snap.At.UnixNano()
	if l.foreignAt == at {
		return
	}
	// Ours at the time of the scrape: those in flight that had started, and those ended since.
	// Counted in sequences, as the backend counts them (one per request unless it asked for several).
	ours := int64(0)
	decoded := 0 // the prompts of those whose first token was seen (markDecodingLocked)
	clear(l.pendingOurs)
	l.pendingOurs = l.pendingOurs[:0]
	for _, r := range l.inflight {
		if r.start <= at {
			ours += r.seqs()
			if !r.firstToken {
				l.pendingOurs = append(l.pendingOurs, r)
			} else {
				decoded += r.promptTokens()
			}
		}
	}
	for i, end := range l.endedAt {
		if end > at && l.ended[i] <= at {
			ours += l.endedSequences[i]
		}
	}
	waiting := int64(max(snap.Waiting, 0))
	slices.SortFunc(l.pendingOurs, func(a, b *reservation) int { return cmp.Compare(b.start, a.start) })
	// The newest of this proxy's requests without a first token are the waiting ones, as many as the
	// backend's waiting sequences hold.
	l.waitingOurs = 0
	for _, r := range l.pendingOurs {
		if r.seqs() > waiting {
			break
		}
		waiting -= r.seqs()
		l.waitingOurs++
	}
	l.foreignWaiting = float64(waiting)
	l.foreignAt, l.foreign = at, max(snap.Running+snap.Waiting-float64(ours), 0)
	l.markDecodingLocked(snap, ours, decoded)
	l.updateTrustLocked(snap)
	n, prompt, ok := l.completedAsOfLocked(at)
	l.scale.fromScrape(snap, n, prompt, ok, l.observed.prompt.Load())
	l.shareScaleLocked(snap.Model)
	l.firstTokens.fromScrape(snap, l.foreign >= 1)
	l.prefill.fromScrape(snap)
	l.backendUncached = backendMeanUncached(snap) / l.tokenScaleLocked()
	// A scrape taken before the engine finished another step shows the batch of the last one again: a
	// second look at one state, not a second observation of where the backend queues. One long prefill
	// step (8k tokens at 2k tokens/s: 4 s) outlasts several scrapes, and three of them at 6 running with
	// requests waiting taught a 64-slot backend that it had 6 slots. Backends that export neither counter
	// count every scrape.
	stepped := snap.GenerationTokens != l.queueGen || snap.Steps != l.queueSteps ||
		snap.GenerationTokens == 0 && snap.Steps == 0
	if stepped {
		l.queueGen, l.queueSteps = snap.GenerationTokens, snap.Steps
		l.model.ObserveQueue(snap.Running, snap.Waiting, snap.KVUsage)
	}
	l.model.ReportSlots(snap.MaxRunning) // a backend that says how many it runs at once (NIM); 0: ignored
	l.observeBusyLocked(snap)
}

// markDecodingLocked tells, from snap's counters, which of this proxy's requests running at its time had
// finished their prefill and were decoding (reservation.decoding), where it can: vLLM's v1 engine adds a
// request's whole prompt to vllm:prompt_tokens_total at its first token, and to the finished requests'
// prompt histogram when it ends, so their difference is the prompts of the requests decoding there at
// the scrape (scraper.Snapshot.PrefilledPrompt). An engine prefills in arrival order, so those are its
// oldest: this proxy's running requests, oldest first, are decoding while the difference, less the
// prompts of those whose first token it has seen, covers at least half of each one's prompt. It cannot
// tell where the scrape shows other clients' requests (theirs are in the difference too) or the backend
// has no such counter (SGLang counts a prompt at its end, and others not at all): decodingKnown is false
// then, and the lateness rule of fromScrapeLocked stands. The difference that stands for no request is
// what it was at the last scrape that found nothing of this proxy's or anyone's there, or lower when it
// goes below that: counters that drifted (a request aborted between its first token and its end may be
// counted in one and not the other) do not mark requests decoding for ever. ours is this proxy's
// sequences there at the scrape and decoded the prompts of its requests whose first token it saw
// (scrapedLocked counts both); a request not marked decoding at the last scrape is not, whether the
// counters told or not. The caller holds l.mu.
func (l *upstreamLoad) markDecodingLocked(snap *scraper.Snapshot, ours int64, decoded int) {
	for _, r := range l.pendingOurs {
		r.decoding = false
	}
	l.decodingKnown = snap.PrefilledPrompt > 0 && l.foreign < 1
	if !l.decodingKnown {
		return
	}
	d := (snap.PrefilledPrompt - snap.FinishedPrompt) / l.tokenScaleLocked()
	if ours == 0 || d < l.decodingBase {
		l.decodingBase = d
	}
	d -= l.decodingBase + float64(decoded)
	running := l.pendingOurs[l.waitingOurs:]
	for i := len(running) - 1; i >= 0; i-- { // oldest first
		r := running[i]
		r.decoding = d >= float64(r.promptTokens())/2
		d -= float64(r.promptTokens())
	}
}

// promptTokens is r's prompt tokens by this proxy's count, cached ones included (its uncached ones where
// the decision had no prompt to predict on).
func (r *reservation) promptTokens() int { return max(r.prediction.prompt, r.uncached) }

// foreignUncachedLocked is the uncached prompt tokens at which other clients' waiting requests there are
// counted: the mean of this proxy's own requests there, or, where it has sent none, the backend's own
// mean (backendUncached). Sized by this proxy's mean alone, another client's queue on an upstream this
// proxy never used counted as no prefill at all, and that upstream, looking idle, drew the next burst.
// The caller holds l.mu.
func (l *upstreamLoad) foreignUncachedLocked() float64 {
	if l.meanUncached > 0 {
		return l.meanUncached
	}
	return l.backendUncached
}

// backendMeanUncached is the mean prompt tokens a request finished on the backend of snap had to
// prefill, in the backend's tokens, over its lifetime: its finished requests' prompt tokens per request,
// less the share its prefix cache answered when it reports one (vLLM's prefix-cache counters; SGLang has
// none, and its whole prompts are an upper bound). 0 when the backend reports no finished requests.
func backendMeanUncached(snap *scraper.Snapshot) float64 {
	if !(snap.FinishedRequests > 0) || !(snap.FinishedPrompt > 0) {
		return 0
	}
	mean := snap.FinishedPrompt / snap.FinishedRequests
	if snap.PrefixQueries > 0 && snap.PrefixHits >= 0 && snap.PrefixHits <= snap.PrefixQueries {
		mean *= 1 - snap.PrefixHits/snap.PrefixQueries
	}
	return mean
}

// observeBusyLocked teaches the service model what the backend did since the snapshot the current busy
// interval started at: the prefill it did (prefix-cache queries not hit) and the tokens it generated, over
// the time between the scrapes. An interval lasts until it spans minBusySteps engine steps and
// minBusyRequests finished requests: counters move only when a step ends, and one prefill step can
// outlast a scrape interval (8k tokens at 2k tokens/s), so a shorter interval would credit a step's work
// to less than its time. Counters that went back (a restart) start a new interval.
// The time within it that this proxy had nothing in flight there is not busy time, where no scrape in it
// showed other clients' requests: the backend ran nothing then either (idleAtLocked). Counted,
// it was taken for engine steps, the dominant term, and the prefill was fitted to what was left: in
// small-batch multi-turn-think the first intervals held 0.03-0.09 s of idle time in 0.5-0.7 s, and the
// four upstreams' fits, replayed, ended at 16-47k tokens/s without it, 18-21k with it. So a scrape that
// finds nothing running ends the interval only where one in it showed others' requests (the backend may
// have worked for them while this proxy idled): ended at every such scrape, the intervals of a backend
// that empties between bursts (agent sessions between turns) seldom reached minBusySteps, and its
// prefill speed stayed the speed-scaled prior's (agentic TTFT p50 0.77x and 0.61x in default and
// kv-pressure, medians over nine seeds, with them spanning idle scrapes: docs/bench/busy-idle). A
// backend without prefix-cache counters shows its prefill as the prompt tokens it says it computed
// (llama.cpp), or not at all (SGLang, NIM, TGI), and an interval without prefill does not pin the
// prefill speed (ObserveBusy). The caller holds l.mu.
func (l *upstreamLoad) observeBusyLocked(snap *scraper.Snapshot) {
	from := &l.busyFrom
	idle := l.idleAtLocked(snap.At.UnixNano())
	l.observeStepsLocked(snap, idle)
	restart := func() {
		l.busyFrom, l.busyIdle, l.busyForeign = *snap, idle, l.foreign >= 1
	}
	l.busyForeign = l.busyForeign || l.foreign >= 1
	// Nothing running at a scrape ends the interval only where the backend may have worked for others
	// while this proxy idled there: its own idle time is taken out below.
	idleEdge := snap.Running < 1 || from.Running < 1
	if from.At.IsZero() || !snap.At.After(from.At) || (l.busyForeign && idleEdge) || countersWentBack(from, snap) {
		restart()
		return
	}
	uncached := prefilledBetween(from, snap)
	// The steps the engine ran: counted by vLLM's per-step histogram, else estimated as the tokens
	// generated over the batch size (which undercounts when part of the batch is prefilling); a scrape
	// that found nothing running says nothing of the batch size while it ran. The histogram's count is 0
	// at an interval's start on a backend that had not stepped yet (just started), and counts from there:
	// taken for a backend without it, every upstream's first interval was estimated as the tokens
	// generated over the running count at its end, the most it had run, and a batch that grew from 0 to 5
	// through it counted 109 of its ~350 steps; the time left over went to the prefill, and that one
	// interval left four identical backends priced 2.5x apart at the end of a run (9-23k tokens/s, for
	// 20-24k fitted without it and 25k true; small-batch multi-turn-think, docs/bench/first-steps).
	batch := (snap.Running + from.Running) / 2
	if idleEdge {
		batch = max(snap.Running, from.Running)
	}
	steps := (snap.GenerationTokens - from.GenerationTokens) / max(batch, 1)
	if snap.Steps > 0 {
		steps = snap.Steps - from.Steps
	}
	if steps < minBusySteps {
		return // not enough steps ended yet: the interval goes on
	}
	if snap.FinishedRequests > 0 && snap.FinishedRequests-from.FinishedRequests < minBusyRequests {
		return // too few prompts in it for the ones at its edges to be a small part of it
	}
	if uncached >= 0 {
		busy := snap.At.Sub(from.At).Seconds()
		if !l.busyForeign {
			busy -= float64(idle-l.busyIdle) / 1e9
		}
		// In this proxy's tokens, the ones the decision multiplies the prefill speed by. The generated
		// tokens are the sequence-steps the batch ran (each step longer for each of them), a count of
		// its own: no token scale (none of the counters went back: countersWentBack, above).
		l.model.ObserveBusy(busy, uncached/l.tokenScaleLocked(), steps, snap.GenerationTokens-from.GenerationTokens)
	}
	restart()
}

// countersWentBack reports whether a counter of snap is below from's: the backend restarted between them.
func countersWentBack(from, snap *scraper.Snapshot) bool {
	return snap.PrefixQueries < from.PrefixQueries || snap.PrefixHits < from.PrefixHits ||
		snap.GenerationTokens < from.GenerationTokens || snap.Steps < from.Steps ||
		snap.PrefilledTokens < from.PrefilledTokens
}

// prefilledBetween is the prompt tokens the backend prefilled between two snapshots: its prefix-cache
// queries not hit (vLLM), or, without those counters, the prompt tokens it says it computed (llama.cpp).
func prefilledBetween(from, snap *scraper.Snapshot) float64 {
	if snap.PrefixQueries == 0 && snap.PrefilledTokens > 0 {
		return snap.PrefilledTokens - from.PrefilledTokens
	}
	return (snap.PrefixQueries - from.PrefixQueries) - (snap.PrefixHits - from.PrefixHits)
}

// observeStepsLocked gives the service model the backend's work since the last snapshot (ObserveSteps:
// its time against the other upstreams', before their responses or busy intervals tell more), where both
// snapshots found it running, this proxy had requests in flight there throughout (idle is idleAtLocked at
// snap's time: nothing running between is not excluded otherwise), the backend counts its steps (vLLM's
// per-step histogram) and no counter went back (a restart): the time between the two, the steps run and
// the prompt tokens prefilled (prefix-cache queries not hit, or the prompt tokens it says it computed;
// ObserveSteps refuses a negative count). The caller holds l.mu.
func (l *upstreamLoad) observeStepsLocked(snap *scraper.Snapshot, idle int64) {
	from, fromIdle := l.stepFrom, l.stepIdle
	l.stepFrom, l.stepIdle = *snap, idle
	if from.At.IsZero() || !snap.At.After(from.At) || from.Running < 1 || snap.Running < 1 ||
		idle != fromIdle || !(snap.Steps > from.Steps) || countersWentBack(&from, snap) {
		return
	}
	l.model.ObserveSteps(snap.At.Sub(from.At).Seconds(), prefilledBetween(&from, snap)/l.tokenScaleLocked(), snap.Steps-from.Steps)
}

// idleAtLocked is how long this proxy has had nothing in flight on the upstream up to at (unix
// nanoseconds, not before the last request's start or end). The caller holds l.mu.
func (l *upstreamLoad) idleAtLocked(at int64) int64 {
	if l.idleSince > 0 {
		return l.idleTotal + max(at-l.idleSince, 0)
	}
	return l.idleTotal
}

// minBusySteps is how many engine steps a busy interval must span to be observed. Prefix-cache queries
// count a prompt when it is scheduled, its prefill runs after: a 4,000-token prompt scheduled at the end
// of a short interval made it look prefilled in no time (traced: 4,004 tokens in 0.1 s, 19 steps, on a
// 2k-tokens/s backend), the next one look slow to step. Over 64 steps a prompt at the edges is a small
// part of the work.
const minBusySteps = 64

// minBusyRequests is how many requests the backend must have finished within a busy interval, when it
// counts them (vLLM's prompt-token histogram, SGLang's counters), for the interval to be observed. A
// prompt's prefix-cache queries count when it is scheduled and its prefill runs over the steps after:
// 64 steps hold many short prompts but not one 30k-token agentic context (15 s of prefill at 2k
// tokens/s), which, scheduled at an interval's end, made a second of busy time look like thousands of
// tokens prefilled. With eight finished, the one prompt at each edge is a small part of the interval.
// It matters since every scrape is observed as it arrives (loadTable.observeScrape): an interval then
// ends at the first scrape 64 steps on, not at the next one a decision happens to read.
const minBusyRequests = 8

// minTrustPrompt is how many prompt tokens this proxy must have sent an upstream between two scrapes
// for their counters to say anything about its predictions.
const minTrustPrompt = 2000

// updateTrustLocked compares the backend's prefix-cache hit rate since the last scrape with the rate this
// proxy predicted for what it sent there. A backend that evicts what the route table thinks it holds (its
// cache is smaller than its share of the working set) confirms fewer hits, and its claims are discounted
// until it confirms them again. While the backend reports cached tokens per request (observe.go), those
// exact figures move trust instead, and this aggregate only keeps its baselines current: it is the check
// for clients that never ask for usage. The caller holds l.mu.
func (l *upstreamLoad) updateTrustLocked(snap *scraper.Snapshot) {
	predicted, prompt := l.predicted.Load(), l.prompt.Load()
	dPred, dPrompt := predicted-l.lastPredicted, prompt-l.lastPrompt
	dHits, dQueries := snap.PrefixHits-l.lastHits, snap.PrefixQueries-l.lastQuery
	if observed := l.observed.prompt.Load(); dHits < 0 || dQueries < 0 || observed != l.lastObserved {
		// Counters reset (the backend restarted: see checkRestartLocked), or reports per request.
		l.lastHits, l.lastQuery = snap.PrefixHits, snap.PrefixQueries
		l.lastPredicted, l.lastPrompt = predicted, prompt
		l.lastObserved = observed
		return
	}
	if dPrompt < minTrustPrompt || dQueries <= 0 {
		return // too little since the last comparison: keep accumulating
	}
	l.lastHits, l.lastQuery = snap.PrefixHits, snap.PrefixQueries
	l.lastPredicted, l.lastPrompt = predicted, prompt
	predictedRate := float64(dPred) / float64(dPrompt)
	if predictedRate < 0.05 {
		return // nothing much was predicted: nothing to confirm
	}
	ratio := min(dHits/dQueries/predictedRate, 1)
	l.trust += 0.3 * (ratio - l.trust)
}

// noteScrape checks every new snapshot of dial, fresh or not, for a restart of the backend (its process
// start time changed, or its prefix-cache counters went back): its KV cache is empty, so its learned
// routes are forgotten (before the decision that reads them) and its cache trust starts again from 1.
func (t *loadTable) noteScrape(dial string, snap *scraper.Snapshot, now int64) {
	if snap.At.IsZero() {
		return
	}
	l := t.entry(dial, now)
	l.mu.Lock()
	restarted := l.checkRestartLocked(snap)
	l.mu.Unlock()
	if restarted {
		forgetRestarted(dial, l)
	}
}

// checkRestartLocked reports whether snap, if newer than the last snapshot checked, shows a restart. The
// caller holds l.mu.
func (l *upstreamLoad) checkRestartLocked(snap *scraper.Snapshot) bool {
	at := snap.At.UnixNano()
	if at <= l.checkedAt {
		return false
	}
	l.checkedAt = at
	restarted := snap.PrefixHits < l.seenHits || snap.PrefixQueries < l.seenQueries ||
		snap.StartTime != 0 && l.startTime != 0 && snap.StartTime != l.startTime
	l.seenHits, l.seenQueries = snap.PrefixHits, snap.PrefixQueries
	if snap.StartTime != 0 {
		l.startTime = snap.StartTime
	}
	if restarted {
		l.trust, l.horizon = 1, 0
		l.model.ForgetSlots() // restarted, perhaps with another max_num_seqs; its speed is kept
	}
	return restarted
}

// cacheTrust returns the share of predicted cache hits to believe.
func (l *upstreamLoad) cacheTrust() float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.trust
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
