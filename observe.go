package caddyllm

import (
	"net/http"
	"sync/atomic"
	"time"
)

// What the backends report about each response, checked against what the decision predicted.
//
// A response seen by an observer (the llm transport, or the llm_resume handler) marks its attempt's
// first token and counts its output tokens, which teach the upstream's service model, and at its end
// reports the backend's usage.prompt_tokens_details.cached_tokens. That figure is the truth the route
// table only predicts: per upstream, the observed cached tokens are added up next to the predicted ones,
// a backend that reports far fewer than the route table claimed kept that prefix for less than the
// claim's age, which becomes its horizon: where the upstream's cache size is unknown, claims older than
// it are no longer credited (a claim older than the horizon that it confirms lengthens the horizon; with
// the size known, the eviction estimate judges each claim instead), and its figures move the trust the
// decision puts in its claims. A claim whose own request was still prefilling when the reported one was
// sent may not have been computed yet: a report short of it denies nothing. A backend restart, seen in
// its scraped metrics, forgets its routes at once.
//
// Why a horizon and not dropping the denied routes: the report arrives with the end of the response,
// when the backend has just computed that prompt again; its routes are true again for a while, and
// dropping them lost precision in the benchmark (bench/README.md, "Observing responses").
//
// Every hook is idempotent per attempt (per reservation): the first observer to count an attempt's
// tokens counts all of them, and its cached tokens are taken once, so the transport and llm_resume on
// the same request never count twice.

// Observers of a response, for reservation.counter.
const (
	observerTransport int32 = 1 + iota
	observerResume
)

// denyShare: a backend that reports fewer cached tokens than this share of the route table's claim
// denied the claim (and one that reports at least this share of a cut claim confirmed it).
const denyShare = 0.5

// observedTrustGain is how far one observed request moves an upstream's cache trust toward its
// observed share of the predicted hit (the scraped aggregate moves it by 0.3 a scrape).
const observedTrustGain = 0.1

// prediction is what the decision predicted cached for one attempt, and what to correct if the backend
// denies it.
type prediction struct {
	prompt    int   // prompt tokens, by this proxy's count
	predicted int   // of them, predicted cached (the decision's figure: trust and pins included)
	claimed   int   // of them, the route table's claim on this upstream
	claimAge  int64 // how old the claim (or the cut claim) was at the decision, nanoseconds
	cut       int   // a claim older than the upstream's horizon, not credited (claimed is then 0)
	// unsettled: the request whose sending made the claim was still in flight there without a first
	// token when this one was sent (upstreamLoad.prefillingLocked), so its prefix may not have been
	// computed yet when this one was admitted; set by reserve.
	unsettled bool
}

// cacheCounters add up, per upstream, the attempts whose cached tokens the backend reported, all in the
// backend's tokens: predicted is the decision's prediction scaled by the backend's prompt count over
// this proxy's, confirmed the part of each prediction the backend confirmed (min of the two).
type cacheCounters struct {
	requests, prompt, predicted, cached, confirmed atomic.Int64
	corrections                                    atomic.Int64 // reports denying a claim (they set the horizon)
	restarts                                       atomic.Int64 // restarts seen in scrapes
	// evicted counts the claims on the upstream a decision did not credit because this proxy has sent it
	// more than its cache holds beside them since (evictedSince): no report needed.
	evicted atomic.Int64
}

// cacheFigures is a snapshot of cacheCounters.
type cacheFigures struct {
	Requests, Prompt, Predicted, Cached, Confirmed, Corrections, Restarts, Evicted int64
	Trust                                                                          float64
	Horizon                                                                        int64 // nanoseconds; 0: not known
}

func (l *upstreamLoad) cacheFigures() cacheFigures {
	c := &l.observed
	return cacheFigures{
		Requests: c.requests.Load(), Prompt: c.prompt.Load(), Predicted: c.predicted.Load(),
		Cached: c.cached.Load(), Confirmed: c.confirmed.Load(), Corrections: c.corrections.Load(),
		Restarts: c.restarts.Load(), Evicted: c.evicted.Load(), Trust: l.cacheTrust(), Horizon: l.cacheHorizon(),
	}
}

// observeTokens records n more output tokens of r's response, reported by observer; the first tokens
// reported mark r's first token. Only the first observer to report on r counts.
func (r *reservation) observeTokens(observer int32, n int) {
	if n <= 0 || !r.counter.CompareAndSwap(0, observer) && r.counter.Load() != observer {
		return
	}
	if r.outputSeen.Add(int64(n)) == int64(n) {
		r.noteFirstToken(time.Now().UnixNano())
	}
}

// observeCached records the backend's report of r's cached prompt tokens; backendPrompt is its own
// prompt_tokens (0 if not reported: this proxy's count is used). Only the first report counts. A report
// of far fewer than the route table claimed shortens the upstream's horizon to the claim's age, a cut
// claim confirmed lengthens it, and every report on a claim moves the upstream's cache trust toward the
// share of the claim it confirmed.
func (r *reservation) observeCached(backendPrompt, cached int) {
	if cached < 0 || backendPrompt < 0 || !r.cacheSeen.CompareAndSwap(false, true) {
		return
	}
	p := &r.prediction
	scale := 1.0 // backend tokens per token of this proxy's count
	if backendPrompt > 0 && p.prompt > 0 {
		scale = float64(backendPrompt) / float64(p.prompt)
		r.load.mu.Lock()
		r.load.scale.add(float64(backendPrompt), float64(p.prompt)) // the upstream's (tokenScale)
		r.load.mu.Unlock()
	} else {
		backendPrompt = p.prompt
	}
	predicted := int64(float64(p.predicted)*scale + 0.5)
	c := &r.load.observed
	c.requests.Add(1)
	c.prompt.Add(int64(backendPrompt))
	c.predicted.Add(predicted)
	c.cached.Add(int64(cached))
	c.confirmed.Add(min(predicted, int64(cached)))
	l := r.load
	switch {
	case p.claimed > 0:
		// Trust is the share of the route table's claims to believe: it follows the share of this claim
		// the backend confirmed (not of the decision's figure, which trust already discounted).
		claimed := float64(p.claimed) * scale
		denied := float64(cached) < denyShare*claimed
		if p.unsettled && float64(cached) < claimed {
			// The claim's own request was still prefilling: a backend computes a prefix before it caches it,
			// and one admitted beside that prefill finds none of it, or the part computed so far. The
			// shortfall says nothing of how long the backend keeps a prefix (counted as a denial, it set
			// horizons of 2-20 ms on shared-prefix groups sent in bursts: every claim older was cut, and
			// the groups scattered), nor of the claims to believe.
			break
		}
		l.mu.Lock()
		l.trust += observedTrustGain * (min(float64(cached)/claimed, 1) - l.trust)
		if denied && p.claimAge > 0 {
			// The backend kept the prefix for less than the claim's age: claims that old are not
			// credited from now on. The routes themselves stay: this very response just cached the
			// prompt again there, so they are true for a while.
			if l.horizon == 0 || p.claimAge < l.horizon {
				l.horizon = p.claimAge
			}
		}
		l.mu.Unlock()
		if denied {
			c.corrections.Add(1)
		}
	case p.cut > 0 && float64(cached) >= denyShare*float64(p.cut)*scale && p.claimAge > 0:
		// A claim older than the horizon that the backend confirmed: it keeps prefixes longer.
		l.mu.Lock()
		if p.claimAge > l.horizon {
			l.horizon += (p.claimAge - l.horizon) / 2
		}
		l.mu.Unlock()
	}
}

// cacheHorizon returns how long the backend has lately kept a prefix (nanoseconds; 0: not known).
func (l *upstreamLoad) cacheHorizon() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.horizon
}

// forgetRestarted forgets every learned route and pin of an upstream whose backend restarted: its KV
// cache is empty. O(routes) per route table, once per restart.
// The restart is counted once its routes are gone, so a report that shows it shows them forgotten.
func forgetRestarted(dial string, l *upstreamLoad) {
	for _, t := range allRoutes() {
		t.Forget(dial)
	}
	l.observed.restarts.Add(1)
}

// attemptOf returns the reservation of r's current attempt, or nil when the policy did not route it.
// Call it on the request's goroutine (request variables are not locked).
func attemptOf(r *http.Request) *reservation { return llmRequestOf(r).currentAttempt() }

// currentAttempt returns the reservation of lr's current attempt, or nil when lr is nil or the policy
// did not route it.
func (lr *llmRequest) currentAttempt() *reservation {
	if lr == nil || lr.acct == nil {
		return nil
	}
	return lr.acct.attempt()
}

// noteToken records tokens more output tokens relayed for r's current attempt, as seen by llm_resume
// (the first call also marks the first token). The count teaches the service model the real output
// length, which is often far below max_tokens.
func noteToken(r *http.Request, tokens int) {
	if res := attemptOf(r); res != nil {
		res.observeTokens(observerResume, tokens)
	}
}

// noteCached records the backend's report of r's current attempt's cached prompt tokens.
func noteCached(r *http.Request, backendPrompt, cached int) {
	if res := attemptOf(r); res != nil {
		res.observeCached(backendPrompt, cached)
	}
}
