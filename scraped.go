package caddyllm

import (
	"cmp"
	"slices"
	"time"

	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
)

// What a backend's scraped metrics put into its load entry (upstreamLoad): the reading of a scrape a
// decision prices (fromScrapeLocked: others' requests, the queue, the KV cache taken since) and what each
// new scrape teaches as it arrives (observeScrape, scrapedLocked, noteScrape: which of this proxy's
// requests are decoding, the busy intervals and step pairs the service model learns from, the trust in
// predicted cache hits, a restarted backend). The scrapes themselves are signals.go's; the reservations
// they are combined with, accounting.go's.

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
// ObserveSteps refuses a negative count). The same work goes to ObserveSpan, where a snapshot at which no
// step had ended since the span's start does not end it. The caller holds l.mu.
func (l *upstreamLoad) observeStepsLocked(snap *scraper.Snapshot, idle int64) {
	if seconds, uncached, steps, ok := l.workSinceLocked(&l.stepFrom, &l.stepIdle, snap, idle, false); ok {
		l.model.ObserveSteps(seconds, uncached, steps)
	}
	if seconds, uncached, steps, ok := l.workSinceLocked(&l.spanFrom, &l.spanIdle, snap, idle, true); ok {
		l.model.ObserveSpan(seconds, uncached, steps)
	}
}

// workSinceLocked returns the backend's work from *from (idleAtLocked *fromIdle at its time) to snap, and
// makes snap the next start; ok is false where the two do not say it (see observeStepsLocked). With
// span, a snap that finds the backend running the step it ran at *from (none ended) is no end: *from
// stays. The caller holds l.mu.
func (l *upstreamLoad) workSinceLocked(from *scraper.Snapshot, fromIdle *int64, snap *scraper.Snapshot, idle int64, span bool) (seconds, uncached, steps float64, ok bool) {
	f := *from
	ok = !f.At.IsZero() && snap.At.After(f.At) && !(f.Running < 1) && !(snap.Running < 1) && idle == *fromIdle &&
		!countersWentBack(&f, snap)
	if span && ok && snap.Steps == f.Steps {
		return 0, 0, 0, false
	}
	*from, *fromIdle = *snap, idle
	if !ok || !(snap.Steps > f.Steps) {
		return 0, 0, 0, false
	}
	return snap.At.Sub(f.At).Seconds(), prefilledBetween(&f, snap) / l.tokenScaleLocked(), snap.Steps - f.Steps, true
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
