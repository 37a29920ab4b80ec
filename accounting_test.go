package caddyllm

import (
	"cmp"
	"context"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
)

func newTestLoads() *loadTable { return &loadTable{m: make(map[string]*upstreamLoad)} }

// TestPhaseAccounting follows requests through their phases on one upstream: the prefill queue grows
// by each request's own prefill in the upstream's time, an observed first token moves the queue by the
// prediction's error and the request to decoding, and releasing everything leaves exactly nothing.
func TestPhaseAccounting(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	now := time.Unix(1_700_000_000, 0).UnixNano()
	per := selection.Prior.PrefillSecondsPerToken // the prior: nothing learned yet

	a := lt.reserve(dial, work{uncached: 8000, output: 100}, now)
	b := lt.reserve(dial, work{uncached: 4000, output: 100}, now)
	v := lt.view(dial, now, nil)
	if want := 12000 * per; math.Abs(v.queued-want) > 1e-6 || v.requests != 2 {
		t.Fatalf("view = %+v, want %.3f s queued and 2 requests", v, want)
	}
	snap := func(at int64) upstreamInflight {
		for _, u := range lt.snapshot(at) {
			if u.Dial == dial {
				return u
			}
		}
		t.Fatalf("%s not in the snapshot", dial)
		return upstreamInflight{}
	}
	if s := snap(now); s.Prefilling != 2 || s.Decoding != 0 || s.PrefillTokens != 12000 {
		t.Errorf("snapshot = %+v, want 2 prefilling with 12000 tokens", s)
	}
	if s := snap(now + int64(time.Hour)); s.IdleSeconds != 0 {
		t.Errorf("with requests in flight an hour: idle %v s, want 0", s.IdleSeconds)
	}

	// a's first token comes 0.5 s early: b, queued behind it, moves up by as much. Its prefill started
	// when a's ended, an overhead before a's first token.
	aDone := a.prefillDone - int64(500*time.Millisecond)
	a.noteFirstToken(aDone)
	if got, want := lt.view(dial, aDone, nil).queued, 4000*per-selection.Prior.Overhead; math.Abs(got-want) > 1e-3 {
		t.Errorf("after a's early first token: %.3f s queued, want %.3f (b's own prefill)", got, want)
	}
	if s := snap(aDone); s.Prefilling != 1 || s.Decoding != 1 {
		t.Errorf("after a's first token: %+v, want 1 prefilling, 1 decoding", s)
	}
	a.noteFirstToken(aDone + 1) // only the first counts
	if got := a.prefillDone; got != aDone {
		t.Errorf("a second first token moved a's prefill end to %d", got)
	}

	// b is cancelled while still prefilling: its prefill leaves the queue.
	b.release(aDone, false)
	if v := lt.view(dial, aDone, nil); v.queued > 1e-9 || v.requests != 1 {
		t.Errorf("after b's cancel: %+v, want nothing queued and 1 request", v)
	}
	b.release(aDone, false) // a second release changes nothing
	end := aDone + int64(time.Second)
	a.release(end, true)
	if tokens, requests := lt.get(dial); tokens != 0 || requests != 0 {
		t.Errorf("after every release: %d tokens, %d requests, want 0", tokens, requests)
	}
	// Idle is counted from the last release (a backend dropped from a dynamic pool shows it growing).
	if s := snap(end + int64(90*time.Second)); math.Abs(s.IdleSeconds-90) > 1e-9 {
		t.Errorf("90 s after the last release: idle %v s, want 90", s.IdleSeconds)
	}
}

// TestSlotWaitLeavesPrefillQueue: a first token later than predicted moves the upstream's prefill
// queue by its lateness, unless the request may have waited for a slot the decision did not predict
// (its slot count unknown, more of this proxy's requests ahead of it than the upstream was seen to run
// beside a new one): a slot's wait is no prefill. The service model learns from such a first token only
// if it is late even against the time since the last end there (none ended: since it was sent), after
// which it cannot have waited for a slot.
func TestSlotWaitLeavesPrefillQueue(t *testing.T) {
	const dial = "10.0.0.1:8000"
	now := time.Unix(1_700_000_000, 0).UnixNano()
	for _, c := range []struct {
		name   string
		ahead  int  // requests reserved before the late one
		ended  bool // one of them ended 50 ms before its first token
		moved  bool
		taught bool
	}{
		{"alone: its delay was prefill", 0, false, true, true},
		{"behind two, one ended: perhaps a slot", 2, true, false, false},
		// No slot freed while it waited: late even so, its service was slow (taught); the queue
		// stays put, as the slot wait it may also have been.
		{"behind two, none ended", 2, false, false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			lt := newTestLoads()
			var ahead []*reservation
			for range c.ahead {
				ahead = append(ahead, lt.reserve(dial, work{uncached: 100, output: 100}, now))
			}
			late := lt.reserve(dial, work{uncached: 1000, output: 100}, now)
			l := lt.lookup(dial)
			until := l.prefillUntil.Load()
			at := late.prefillDone + int64(time.Second)
			if c.ended {
				ahead[0].release(at-int64(50*time.Millisecond), false)
			}
			late.noteFirstToken(at)
			if got := l.prefillUntil.Load(); (got != until) != c.moved {
				t.Errorf("prefill queue end moved %.3f s by a first token 1 s late behind %d; want moved %v",
					float64(got-until)/1e9, c.ahead, c.moved)
			}
			if s := l.model.Service(); (s.FirstTokens == 1) != c.taught || s.FirstTokens+s.SkippedFirstTokens != 1 {
				t.Errorf("first tokens taught %d, skipped %d; want taught %v", s.FirstTokens, s.SkippedFirstTokens, c.taught)
			}
		})
	}
}

// TestLateFirstTokenMovesQueueOnce: a first token 1 s late delays the prefills queued behind it by 1 s,
// once: the one behind it, answered 1 s after its first prediction, is on time and moves nothing more.
// (Before, every request of a queue moved it by its whole lateness against its first prediction.) The
// slot count is known here, so no wait for a slot is suspected.
func TestLateFirstTokenMovesQueueOnce(t *testing.T) {
	const dial = "10.0.0.1:8000"
	now := time.Unix(1_700_000_000, 0).UnixNano()
	lt := newTestLoads()
	a := lt.reserve(dial, work{uncached: 4000, output: 100}, now)
	b := lt.reserve(dial, work{uncached: 4000, output: 100}, now)
	l := lt.lookup(dial)
	l.model.ReportSlots(64)
	until, bDone := l.prefillUntil.Load(), b.prefillDone
	a.noteFirstToken(a.prefillDone + int64(time.Second))
	if got := l.prefillUntil.Load() - until; got != int64(time.Second) {
		t.Fatalf("a's first token 1 s late moved the queue %.3f s, want 1", float64(got)/1e9)
	}
	if got := b.prefillDone - bDone; got != int64(time.Second) {
		t.Errorf("b, queued behind a, predicted %.3f s later, want 1", float64(got)/1e9)
	}
	b.noteFirstToken(bDone + int64(time.Second))
	if got := l.prefillUntil.Load() - until; got != int64(time.Second) {
		t.Errorf("after b's first token as a's delay predicts: queue moved %.3f s in all, want 1", float64(got)/1e9)
	}
	a.release(b.prefillDone, true)
	b.release(b.prefillDone, true)
	if tokens, requests := lt.get(dial); tokens != 0 || requests != 0 {
		t.Errorf("after every release: %d tokens, %d requests, want 0", tokens, requests)
	}
}

// TestHolderRetriesAndEnd: a retry releases the previous attempt's reservation, the end releases the last
// one, and a reservation swapped in after the end is released at once. Only a completed end teaches the
// service model.
func TestHolderRetriesAndEnd(t *testing.T) {
	lt := newTestLoads()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var ended []string
	h := newReservationHolder(ctx, func(dial string) bool { ended = append(ended, dial); return true })
	now := time.Now().UnixNano()
	h.swap(lt.reserve("a:1", work{uncached: 100, output: 10}, now))
	h.swap(lt.reserve("b:1", work{uncached: 100, output: 10}, now)) // the retry
	if _, n := lt.get("a:1"); n != 0 {
		t.Errorf("a:1 still holds %d requests after the retry", n)
	}
	r := h.attempt()
	r.observeTokens(observerTransport, 1)
	r.observeTokens(observerResume, 3) // a second observer of the same attempt: not counted again
	r.observeTokens(observerTransport, 5)
	if !r.firstToken || r.outputSeen.Load() != 6 {
		t.Errorf("after 6 relayed tokens: first token %t, seen %d", r.firstToken, r.outputSeen.Load())
	}
	h.finish() // what the request's end runs (synchronously here)
	if len(ended) != 1 || ended[0] != "b:1" {
		t.Errorf("onEnd called with %q, want once with b:1", ended)
	}
	if _, n := lt.get("b:1"); n != 0 {
		t.Errorf("b:1 still holds %d requests after the end", n)
	}
	h.swap(lt.reserve("c:1", work{uncached: 1}, now)) // a Select racing the end
	if _, n := lt.get("c:1"); n != 0 {
		t.Errorf("a reservation made after the end was kept")
	}
}

// TestScrapeCountsForeignOnce: a scrape's running and waiting counts beyond this proxy's own requests at
// the time of the scrape are added once; this proxy's requests sent after the scrape are not counted twice,
// and its requests that ended since the scrape still count as its own.
func TestScrapeCountsForeignOnce(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	t0 := time.Unix(1_700_000_000, 0)
	mine := make([]*reservation, 3)
	for i := range mine {
		mine[i] = lt.reserve(dial, work{uncached: 10, output: 10}, t0.UnixNano())
	}
	at := t0.Add(time.Second)
	mine[0].release(at.Add(time.Millisecond).UnixNano(), false) // ended after the scrape: it was in its count
	snap := &scraper.Snapshot{Running: 4, Waiting: 3, At: at}   // 3 of ours + 4 foreign
	later := at.Add(2 * time.Millisecond).UnixNano()
	lt.reserve(dial, work{uncached: 10, output: 10}, later) // sent after the scrape
	v := lt.view(dial, later, snap)
	if v.requests != 3+4 {
		t.Errorf("requests = %v, want 3 of ours in flight + 4 foreign", v.requests)
	}
	spt := selection.Prior.PrefillSecondsPerToken
	if q, want := v.queued, 3*10*spt-0.002+10*spt; q < want*0.99 || q > want*1.01 {
		t.Errorf("queued = %.4f s, want %.4f: the 3 it shows waiting at our mean prompt, less the 2 ms prefilled since, and ours since", q, want)
	}
}

// TestScrapedWaitingAreTheNewest: a backend admits in arrival order, so the requests its scrape shows
// waiting are this proxy's newest ones sent before it, each with its own prompt; requests beyond this
// proxy's are other clients', at its mean prompt; an observed first token takes one out.
func TestScrapedWaitingAreTheNewest(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	t0 := time.Unix(1_700_000_000, 0)
	var mine []*reservation
	for i, uncached := range []int{4000, 4000, 10, 3000} {
		mine = append(mine, lt.reserve(dial, work{uncached: uncached}, t0.Add(time.Duration(i)*time.Millisecond).UnixNano()))
	}
	mine[0].noteFirstToken(t0.Add(530 * time.Millisecond).UnixNano()) // as predicted: decoding since
	at := t0.Add(time.Second)
	now := at.Add(time.Millisecond).UnixNano()
	spt := selection.Prior.PrefillSecondsPerToken
	// The oldest is decoding, the second running, predicted to prefill for 30 ms more (8,000 tokens at 8k/s
	// and the overhead, from t0): the waiting ones start after it.
	running := 8000*spt + selection.Prior.Overhead - 1
	v := lt.view(dial, now, &scraper.Snapshot{Running: 2, Waiting: 2, At: at})
	if want := running - 0.001 + (10+3000)*spt; math.Abs(v.queued-want) > want*0.01 {
		t.Errorf("queued = %.4f s, want %.4f: the two newest of ours (10 and 3000 tokens) behind the 29 ms left of a running one", v.queued, want)
	}
	mine[3].noteFirstToken(now)
	v = lt.view(dial, at.UnixNano(), &scraper.Snapshot{Running: 2, Waiting: 2, At: at})
	if want := running + 10*spt; math.Abs(v.queued-want) > want*0.01 {
		t.Errorf("queued = %.4f s after a first token, want %.4f", v.queued, want)
	}
	at2 := at.Add(time.Second)
	v = lt.view(dial, at2.UnixNano(), &scraper.Snapshot{Running: 1, Waiting: 4, At: at2})
	mean := lt.lookup(dial).meanUncached
	if want := (4000 + 10 + 2*mean) * spt; math.Abs(v.queued-want) > want*0.01 {
		t.Errorf("queued = %.4f s, want %.4f: ours not yet answered, and two other clients' at the mean", v.queued, want)
	}
}

// TestForeignQueueOnUnusedUpstream: another client's waiting requests on an upstream this proxy never
// sent to are sized at the backend's own mean uncached prompt (its finished requests' prompts less what
// its prefix cache answered), in this proxy's tokens; sized at this proxy's mean there, none, that
// queue counted as no prefill and the upstream looked idle.
func TestForeignQueueOnUnusedUpstream(t *testing.T) {
	spt := selection.Prior.PrefillSecondsPerToken
	at := time.Unix(1_700_000_000, 0)
	for _, c := range []struct {
		name string
		snap scraper.Snapshot
		per  float64 // uncached tokens each waiting request is counted at
	}{
		{"vLLM: prompts less cache hits", scraper.Snapshot{FinishedRequests: 10, FinishedPrompt: 20000, PrefixQueries: 20000, PrefixHits: 5000}, 1500},
		{"SGLang: no prefix-cache counters, whole prompts", scraper.Snapshot{FinishedRequests: 4, FinishedPrompt: 8000}, 2000},
		{"nothing finished yet", scraper.Snapshot{PrefixQueries: 100, PrefixHits: 10}, 0},
		{"counters that make no sense", scraper.Snapshot{FinishedRequests: 10, FinishedPrompt: 20000, PrefixQueries: 100, PrefixHits: 500}, 2000},
	} {
		t.Run(c.name, func(t *testing.T) {
			lt := newTestLoads()
			const dial = "10.0.0.2:8000"
			snap := c.snap
			snap.Running, snap.Waiting, snap.At = 8, 4, at
			v := lt.view(dial, at.UnixNano(), &snap)
			if want := 4 * c.per * spt; math.Abs(v.queued-want) > 1e-9 {
				t.Errorf("queued = %.4f s, want %.4f: 4 waiting at %v tokens each", v.queued, want, c.per)
			}
			if v.requests != 12 {
				t.Errorf("requests = %v, want the 12 the backend shows", v.requests)
			}
			// Once this proxy has sent there, its own mean sizes them.
			lt.reserve(dial, work{uncached: 100}, at.UnixNano()).release(at.Add(time.Millisecond).UnixNano(), false)
			at2 := at.Add(time.Second)
			snap.At = at2
			if v, want := lt.view(dial, at2.UnixNano(), &snap), 4*100*spt; math.Abs(v.queued-want) > 1e-9 {
				t.Errorf("after one of ours: queued = %.4f s, want %.4f", v.queued, want)
			}
		})
	}
}

// TestScrapedRunningStillPrefill: a request the scrape counts as running is not done prefilling (chunked
// prefill admits a long prompt into the batch at once and prefills it over several steps): what is left
// of its predicted prefill comes before the waiting ones. A 20k-token prompt sent 0.5 s before a scrape
// showing it running and nothing waiting still has 2 s to go at 8k tokens/s; without this, the upstream
// looked idle and took the next new agent session, whose first token then waited behind the first's.
func TestScrapedRunningStillPrefill(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	spt := selection.Prior.PrefillSecondsPerToken
	t0 := time.Unix(1_700_000_000, 0)
	long := lt.reserve(dial, work{uncached: 20000}, t0.UnixNano())
	at := t0.Add(500 * time.Millisecond)
	snap := &scraper.Snapshot{Running: 1, Waiting: 0, At: at}
	left := 20000*spt + selection.Prior.Overhead - 0.5
	// Later than predicted, it has about as long again to go as it is late (its upstream is slower than
	// its estimate), up to its whole prefill.
	for _, c := range []struct {
		after time.Duration
		want  float64
	}{{0, left}, {time.Second, left - 1}, {time.Duration(left*1e9) + 200*time.Millisecond, 0.2}, {time.Duration(left*1e9) + 4*time.Second, 20000 * spt}} {
		if v := lt.view(dial, at.Add(c.after).UnixNano(), snap); math.Abs(v.queued-c.want) > 1e-6 {
			t.Errorf("%v after the scrape: queued = %.4f s, want %.4f", c.after, v.queued, c.want)
		}
	}
	// Two of ours sent after it, waiting behind it: they start once it is done.
	lt.reserve(dial, work{uncached: 1000}, at.Add(time.Millisecond).UnixNano())
	lt.reserve(dial, work{uncached: 3000}, at.Add(2*time.Millisecond).UnixNano())
	at2 := at.Add(3 * time.Millisecond)
	if v, want := lt.view(dial, at2.UnixNano(), &scraper.Snapshot{Running: 1, Waiting: 2, At: at2}), left-0.003+4000*spt; math.Abs(v.queued-want) > 1e-6 {
		t.Errorf("with two waiting behind it: queued = %.4f s, want %.4f", v.queued, want)
	}
	// Its first token: only the waiting ones are left.
	long.noteFirstToken(at2.UnixNano())
	if v, want := lt.view(dial, at2.UnixNano(), &scraper.Snapshot{Running: 1, Waiting: 2, At: at2}), 4000*spt; math.Abs(v.queued-want) > 1e-6 {
		t.Errorf("after its first token: queued = %.4f s, want %.4f", v.queued, want)
	}
}

// TestLateHoldsNoMoreThanItsCache: a request the scrape counts as running, later than predicted and with
// no first token seen, holds the lesser of its whole prefill and its share of the KV cache's turnover
// (its KV tokens over the cache's, times the mean request duration): without first tokens it may as well
// be decoding, and then it holds cache space, not prefill. Where the scrape gives no cache size, or first
// tokens are seen there (a late one without its first token is then still prefilling), the whole prefill
// (TestScrapedRunningStillPrefill).
func TestLateHoldsNoMoreThanItsCache(t *testing.T) {
	const dial = "10.0.0.1:8000"
	spt, md := selection.Prior.PrefillSecondsPerToken, selection.Prior.MeanDuration
	t0 := time.Unix(1_700_000_000, 0)
	for _, c := range []struct {
		name     string
		uncached int
		blocks   int  // of 16 tokens
		seen     bool // a first token was seen there before
		want     float64
	}{
		// 4,064 of a 32,768-token cache: an eighth of the 2 s duration, half of its 0.5 s prefill.
		{"long prompt, cache known", 4000, 2048, false, 4064.0 / 32768 * md},
		// A small cache: its turnover share is more than its prefill, which it holds.
		{"long prompt, small cache", 4000, 256, false, 4000 * spt},
		{"cache unknown", 4000, 0, false, 4000 * spt},
		{"first tokens seen there", 4000, 2048, true, -1}, // -1: its whole prefill at the speed they taught
	} {
		t.Run(c.name, func(t *testing.T) {
			lt := newTestLoads()
			if c.seen {
				first := lt.reserve(dial, work{uncached: 100, output: 1}, t0.Add(-time.Second).UnixNano())
				first.noteFirstToken(first.prefillDone)
				first.release(first.prefillDone, true)
			}
			late := lt.reserve(dial, work{uncached: c.uncached, output: 64}, t0.UnixNano())
			want := c.want
			if want < 0 {
				want = late.prefill
			}
			snap := &scraper.Snapshot{Running: 1, At: t0.Add(10 * time.Millisecond), BlockSize: 16, NumBlocks: c.blocks}
			if c.blocks == 0 {
				snap.BlockSize = 0
			}
			// Long past its predicted first token: late by more than either hold.
			if v := lt.view(dial, t0.Add(10*time.Second).UnixNano(), snap); math.Abs(v.queued-want) > 1e-6 {
				t.Errorf("queued = %.4f s, want %.4f (prefill %.4f)", v.queued, want, late.prefill)
			}
		})
	}
}

// TestCountersTellDecoding: where a vLLM backend's counters say how much prompt its decoding requests
// hold (prompt_tokens_total, counted at a first token, less the finished requests' prompts), this proxy's
// oldest running requests are decoding for that much and hold no prefill, and the others are prefilling
// and hold their whole prefill, not the turnover share that stands in where nothing tells the two apart.
// The requests of other clients (theirs are in the counters too) and a request whose first token this
// proxy saw are counted, and a difference the backend shows with nothing in flight is drift, not a
// request.
func TestCountersTellDecoding(t *testing.T) {
	const dial = "10.0.0.1:8000"
	t0 := time.Unix(1_700_000_000, 0)
	for _, c := range []struct {
		name      string
		prefilled float64 // prompt tokens the backend counts prefilled
		finished  float64 // and finished
		drift     float64 // prefilled, as a scrape with nothing in flight found it before
		foreign   bool    // the scrape shows another client's request
		oldSeen   bool    // the older request's first token was seen
		want      string  // "share": each holds its turnover share; "new": the newer its prefill; "none"
	}{
		{name: "no counters", want: "share"},
		{name: "the older decoding", prefilled: 4000, want: "new"},
		{name: "a finished one's prompt is not decoding", prefilled: 9000, finished: 5000, want: "new"},
		{name: "both decoding", prefilled: 8000, want: "none"},
		{name: "another client's requests there", prefilled: 8000, foreign: true, want: "share"},
		{name: "the older's first token seen", prefilled: 4000, oldSeen: true, want: "new"},
		{name: "drift is not a request", prefilled: 5000, drift: 1000, want: "new"},
	} {
		t.Run(c.name, func(t *testing.T) {
			lt := newTestLoads()
			// Known to the table before: one request sent and ended a second before the scrape of drift.
			lt.reserve(dial, work{uncached: 100, output: 1}, t0.Add(-3*time.Second).UnixNano()).release(t0.Add(-2*time.Second).UnixNano(), true)
			if c.drift > 0 {
				lt.view(dial, t0.Add(-time.Second).UnixNano(), &scraper.Snapshot{At: t0.Add(-time.Second), PrefilledPrompt: c.drift, BlockSize: 16, NumBlocks: 2048})
			}
			old := lt.reserve(dial, work{uncached: 4000, prompt: 4000, output: 64}, t0.UnixNano())
			young := lt.reserve(dial, work{uncached: 4000, prompt: 4000, output: 64}, t0.Add(time.Millisecond).UnixNano())
			running := 2.0
			if c.foreign {
				running++
			}
			if c.oldSeen {
				old.noteFirstToken(t0.Add(5 * time.Millisecond).UnixNano())
			}
			snap := &scraper.Snapshot{Running: running, At: t0.Add(10 * time.Millisecond), BlockSize: 16, NumBlocks: 2048,
				PrefilledPrompt: c.prefilled + c.drift, FinishedPrompt: c.finished}
			share := 4064.0 / 32768 * lt.lookup(dial).model.Service().MeanDuration // each one's (see above)
			want := map[string]float64{"share": share, "new": young.prefill, "none": 0}[c.want]
			// Long past both predicted first tokens: late by more than either hold.
			now := t0.Add(10 * time.Second).UnixNano()
			if v := lt.view(dial, now, snap); math.Abs(v.queued-want) > 1e-6 {
				t.Errorf("queued = %.4f s, want %.4f (%s; prefill %.4f, turnover share %.4f)", v.queued, want, c.want, young.prefill, share)
			}
			// /llm/upstreams reports the phases the same way: without counters, both past their predicted
			// first tokens are decoding.
			wantPrefilling := map[string]int64{"share": 0, "new": 1, "none": 0}[c.want]
			for _, u := range lt.snapshot(now) {
				if u.Prefilling != wantPrefilling || u.Decoding != 2-wantPrefilling {
					t.Errorf("reported %d prefilling, %d decoding; want %d prefilling of 2", u.Prefilling, u.Decoding, wantPrefilling)
				}
			}
		})
	}
}

// TestScrapedQueueDrains: a backlog a scrape showed is prefilled at the upstream's speed from the
// scrape on, so an upstream is not avoided for a queue it has worked off; this proxy's requests sent since
// count in full until their first token or the next scrape, a burst of them all at once (no herding to an
// upstream whose old backlog is gone).
func TestScrapedQueueDrains(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	spt := selection.Prior.PrefillSecondsPerToken
	t0 := time.Unix(1_700_000_000, 0)
	lt.reserve(dial, work{uncached: 1000}, t0.UnixNano()).release(t0.Add(time.Millisecond).UnixNano(), false) // mean prompt 1,000
	at := t0.Add(time.Second)
	snap := &scraper.Snapshot{Running: 8, Waiting: 4, At: at} // 4 of another client's waiting
	after := func(tokens float64) int64 { return at.Add(time.Duration(tokens * spt * 1e9)).UnixNano() }
	for _, c := range []struct {
		now  int64
		want float64 // tokens
	}{{at.UnixNano(), 4000}, {after(1000), 3000}, {after(3900), 100}, {after(6000), 0}} {
		if v := lt.view(dial, c.now, snap); math.Abs(v.queued-c.want*spt) > 1e-6 {
			t.Errorf("%.3f s after the scrape: queued = %.4f s, want %.4f", float64(c.now-at.UnixNano())/1e9, v.queued, c.want*spt)
		}
	}
	// A burst sent once the backlog is gone: each request queues behind the others sent with it.
	for range 3 {
		lt.reserve(dial, work{uncached: 2000}, after(5000))
	}
	if v := lt.view(dial, after(5000), snap); math.Abs(v.queued-6000*spt) > 1e-6 {
		t.Errorf("after a burst of 3 x 2,000 tokens: queued = %.4f s, want %.4f", v.queued, 6000*spt)
	}
	if v := lt.view(dial, after(6000), snap); math.Abs(v.queued-6000*spt) > 1e-6 {
		t.Errorf("1,000 tokens' time after the burst: queued = %.4f s, want %.4f (not confirmed by a scrape yet)", v.queued, 6000*spt)
	}
}

// TestKVDemandCountsOursInFlight: the KV cache a new request finds taken is at least what this proxy's
// own requests there need (uncached prompt and expected output), admitted or still waiting: a scrape shows
// only what the backend has admitted (a long prompt waiting for space is in no usage figure), and is up to
// one interval old. With two 4k-token prompts waiting behind two running in an 8k cache, the scrape says
// the cache is full, not that 16k tokens want it.
func TestKVDemandCountsOursInFlight(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	t0 := time.Unix(1_700_000_000, 0)
	for i := range 4 {
		lt.reserve(dial, work{uncached: 4000, output: 64}, t0.Add(time.Duration(i)*time.Millisecond).UnixNano())
	}
	at := t0.Add(time.Second)
	snap := &scraper.Snapshot{Running: 2, Waiting: 2, KVUsage: 0.99, BlockSize: 16, NumBlocks: 512, At: at}
	v := lt.view(dial, at.UnixNano(), snap)
	if v.kvCapacity != 8192 || v.kvUsed != 4*4064 {
		t.Errorf("kv = %.0f of %.0f, want 16256 (ours in flight) of 8192", v.kvUsed, v.kvCapacity)
	}
	// Where the scrape shows more (others' requests), it counts.
	snap = &scraper.Snapshot{Running: 6, KVUsage: 0.5, BlockSize: 16, NumBlocks: 4096, At: at}
	if v := lt.view(dial, at.UnixNano(), snap); v.kvUsed != 0.5*16*4096 {
		t.Errorf("kv used = %.0f, want the scrape's 32768", v.kvUsed)
	}
	// One that reuses a cached prefix whose blocks are free takes its whole prompt's space, not only
	// what it prefills: 20,000 of its 21,000 tokens cached.
	lt.reserve(dial, work{uncached: 1000, output: 64, kv: 21064}, at.UnixNano())
	snap = &scraper.Snapshot{Running: 2, Waiting: 3, KVUsage: 0.99, BlockSize: 16, NumBlocks: 512, At: at}
	if v := lt.view(dial, at.UnixNano(), snap); v.kvUsed != 4*4064+21064 {
		t.Errorf("kv used = %.0f, want 37320 (ours in flight, the last with its whole prompt)", v.kvUsed)
	}
}

// TestOverrunOnlyWhereOursIsAll: the overrun of this proxy's requests is reported where its view holds
// all of the upstream's load (no scrape, or one showing only its own requests), not where a scrape shows
// others' requests, which explain the overrun and are counted already.
func TestOverrunOnlyWhereOursIsAll(t *testing.T) {
	const dial = "10.0.0.1:8000"
	t0 := time.Unix(1_700_000_000, 0)
	for _, c := range []struct {
		name    string
		running float64 // the scrape's running requests; -1: no scrape
		overrun bool
	}{{"no scrape", -1, true}, {"only ours", 2, true}, {"others' too", 4, false}} {
		t.Run(c.name, func(t *testing.T) {
			lt := newTestLoads()
			for range 2 { // each predicted to take about 2.1 s on the prior
				lt.reserve(dial, work{uncached: 1000, output: 64}, t0.UnixNano())
			}
			var snap *scraper.Snapshot
			if c.running >= 0 {
				snap = &scraper.Snapshot{Running: c.running, At: t0.Add(5 * time.Second)}
			}
			v := lt.view(dial, t0.Add(6*time.Second).UnixNano(), snap)
			if got := v.overdue > 2.5; got != c.overrun {
				t.Errorf("overdue = %.2f after 6 s (requests in flight %.0f), want an overrun of about 2.9: %v", v.overdue, v.requests, c.overrun)
			}
		})
	}
}

// TestLoadsStress reserves, observes and releases from many goroutines; every counter ends at zero.
func TestLoadsStress(t *testing.T) {
	lt := newTestLoads()
	dials := []string{"a:1", "b:1", "c:1"}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				dial := dials[(g+i)%len(dials)]
				now := time.Now().UnixNano()
				r := lt.reserve(dial, work{uncached: i % 500, output: 16}, now)
				lt.view(dial, now, &scraper.Snapshot{Running: 2, Waiting: float64(i % 3), At: time.Unix(0, now)})
				if i%3 == 0 {
					r.noteFirstToken(now + 1)
				}
				r.release(now+2, i%2 == 0)
			}
		}()
	}
	wg.Wait()
	for _, d := range dials {
		if tokens, requests := lt.get(d); tokens != 0 || requests != 0 {
			t.Errorf("%s: %d tokens, %d requests left", d, tokens, requests)
		}
		if l := lt.lookup(d); len(l.inflight) != 0 {
			t.Errorf("%s: %d requests left in flight", d, len(l.inflight))
		}
	}
}

// TestCacheTrust: a backend whose prefix-cache counters confirm half the hits predicted for what this
// proxy sent there has its claims discounted towards a half; a counter reset (a restart) changes nothing
// at once; a backend that confirms every hit is trusted again.
func TestCacheTrust(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	now := time.Unix(1_700_000_000, 0)
	var hits, queries float64
	round := func(observedRate float64) {
		for range 10 {
			lt.reserve(dial, work{prompt: 1000, matched: 800, uncached: 200}, now.UnixNano()).release(now.UnixNano(), false)
		}
		hits += 10000 * observedRate
		queries += 10000
		now = now.Add(time.Second)
		lt.view(dial, now.UnixNano(), &scraper.Snapshot{PrefixHits: hits, PrefixQueries: queries, At: now})
	}
	for range 15 {
		round(0.4) // predicted 80%, confirmed 40%
	}
	l := lt.lookup(dial)
	if got := l.cacheTrust(); got < 0.45 || got > 0.55 {
		t.Errorf("trust %.2f after half the predicted hits were confirmed, want about 0.5", got)
	}
	before := l.cacheTrust()
	hits, queries = 0, 0 // the backend restarted
	round(0.8)
	if got := l.cacheTrust(); got != before {
		t.Errorf("a counter reset moved the trust from %.2f to %.2f", before, got)
	}
	for range 15 {
		round(0.8)
	}
	if got := l.cacheTrust(); got < 0.95 {
		t.Errorf("trust %.2f after every predicted hit was confirmed again, want about 1", got)
	}
}

// The backend of the busy-interval tests: 5 ms decode steps, 2k prefill tokens/s, 8 requests running.
const (
	busyDial     = "10.0.0.1:8000"
	busyStep     = 0.005      // seconds a decode step
	busyPerToken = 1.0 / 2000 // seconds a prefilled token
	busyRunning  = 8
)

// TestBusyIntervalsTeachPrefill: a backend's own counters between scrapes, while it runs requests
// throughout, pin its prefill speed (here 2k tokens/s, a quarter of the prior's): scrapes inside one long
// step (no counter moved) extend the interval rather than end it, an idle scrape and a restart start a
// new one, and no proxy-side timing enters. The prefill done is the prefix-cache queries not hit
// (vLLM), or the prompt tokens the backend says it evaluated (llama.cpp).
func TestBusyIntervalsTeachPrefill(t *testing.T) {
	for _, evaluated := range []bool{false, true} {
		t.Run(map[bool]string{false: "prefix-cache counters", true: "prompt tokens evaluated"}[evaluated], func(t *testing.T) {
			testBusyIntervalsTeachPrefill(t, evaluated)
		})
	}
}

func testBusyIntervalsTeachPrefill(t *testing.T, evaluated bool) {
	lt := newTestLoads()
	t0 := time.Unix(1_700_000_000, 0)
	at, snap := t0, scraper.Snapshot{Running: busyRunning}
	scrape := func(d time.Duration, s scraper.Snapshot) {
		t.Helper()
		at = at.Add(d)
		s.At = at
		lt.view(busyDial, at.UnixNano(), &s)
	}
	// work advances the counters by one second of work: steps decode steps and the prefill that fills
	// the rest of the second.
	work := func(steps int) {
		uncached := (1 - float64(steps)*busyStep) / busyPerToken
		if evaluated {
			snap.PrefilledTokens += uncached
		} else {
			snap.PrefixQueries += uncached + 500
			snap.PrefixHits += 500
		}
		snap.GenerationTokens += float64(steps * busyRunning)
	}
	busy := func() int { return lt.lookup(busyDial).model.Service().BusyIntervals }

	scrape(0, snap)
	scrape(200*time.Millisecond, snap) // inside a long prefill step: no counter moved
	scrape(200*time.Millisecond, snap)
	work(80)
	scrape(600*time.Millisecond, snap) // the step ended: one interval of 1 s
	if n := busy(); n != 1 {
		t.Fatalf("%d busy intervals after the first second, want 1 (scrapes within a step extend it)", n)
	}
	for _, steps := range []int{150, 100} {
		work(steps)
		scrape(time.Second, snap)
	}
	s := lt.lookup(busyDial).model.Service()
	if s.BusyIntervals != 3 || math.Abs(s.PrefillSecondsPerToken-busyPerToken) > 0.15*busyPerToken {
		t.Errorf("after 3 busy seconds: %d intervals, %.0f tokens/s, want 3 and about %.0f", s.BusyIntervals, 1/s.PrefillSecondsPerToken, 1/busyPerToken)
	}

	// Idle at a scrape: what happened since is unknown (the engine stops stepping), nothing is learned.
	idle := snap
	idle.Running = 0
	scrape(time.Second, idle)
	work(80)
	scrape(10*time.Second, snap)
	// A restart: counters back to zero.
	scrape(time.Second, scraper.Snapshot{Running: busyRunning, GenerationTokens: 80})
	if n := busy(); n != 3 {
		t.Errorf("%d busy intervals after an idle scrape and a restart, want still 3", n)
	}

	// Neither (SGLang): the prefill done is unknown, nothing is learned.
	const sglang = "10.0.0.2:30000"
	for i := range 5 {
		s := scraper.Snapshot{Running: busyRunning, GenerationTokens: float64(i * 80), At: at.Add(time.Duration(i) * time.Second)}
		lt.view(sglang, s.At.UnixNano(), &s)
	}
	if n := lt.lookup(sglang).model.Service().BusyIntervals; n != 0 {
		t.Errorf("%d busy intervals without a count of the prefill done, want 0", n)
	}
}

// TestBusyIntervalsTeachTimePerSequence: the generated tokens between two scrapes (a sequence-step each)
// reach the busy-interval fit beside the steps, so a backend whose steps run 0.1 ms longer for each
// sequence in the batch (5 ms at none), at batches of 4-40, is learned as such, its prefill speed with
// it, and /llm/upstreams reports the time per sequence.
func TestBusyIntervalsTeachTimePerSequence(t *testing.T) {
	const perSeq = 0.0001
	lt := newTestLoads()
	at := time.Unix(1_700_000_000, 0)
	snap := scraper.Snapshot{Running: 4}
	lt.view(busyDial, at.UnixNano(), &snap)
	for i := range 24 {
		running := float64(4 + (i*7)%37)
		steps := float64(50 + (i*13)%70)
		snap.Running = running
		snap.Steps += steps
		snap.GenerationTokens += steps * running
		snap.PrefixQueries += (1 - steps*(busyStep+perSeq*running)) / busyPerToken
		at = at.Add(time.Second)
		snap.At = at
		s := snap
		lt.view(busyDial, at.UnixNano(), &s)
	}
	s := lt.lookup(busyDial).model.Service()
	if math.Abs(s.SequenceSeconds-perSeq) > 0.25*perSeq || math.Abs(s.PrefillSecondsPerToken-busyPerToken) > 0.15*busyPerToken {
		t.Errorf("after %d busy intervals: %.3f ms a sequence, %.0f tokens/s, want about %.3f and %.0f",
			s.BusyIntervals, 1000*s.SequenceSeconds, 1/s.PrefillSecondsPerToken, 1000*perSeq, 1/busyPerToken)
	}
	if got := reportService(&upstreamInflight{Service: s, TokenScale: 1}).SequenceMS; got != 1000*s.SequenceSeconds {
		t.Errorf("reported %v ms a sequence, want the model's %v", got, 1000*s.SequenceSeconds)
	}
}

// TestBusyIntervalsNeedFinishedRequests: where the backend counts finished requests, a busy interval
// ends only once it holds minBusyRequests of them, however many steps it spans: a long prompt is counted
// when scheduled and prefilled after, and an interval of a few prompts is mostly its edges. Scrapes are
// observed as they arrive (observeScrape, as the scraper's OnScrape calls it), not through a decision.
func TestBusyIntervalsNeedFinishedRequests(t *testing.T) {
	lt := newTestLoads()
	at := time.Unix(1_700_000_000, 0)
	snap := scraper.Snapshot{Running: busyRunning, FinishedRequests: 100, FinishedPrompt: 100 * 3000}
	// second observes one second of work, steps decode steps and the prefill that fills the rest, in which
	// the backend finished finished requests.
	second := func(steps int, finished float64) {
		t.Helper()
		snap.PrefixQueries += (1 - float64(steps)*busyStep) / busyPerToken
		snap.GenerationTokens += float64(steps * busyRunning)
		snap.FinishedRequests += finished
		at = at.Add(time.Second)
		snap.At = at
		s := snap
		lt.observeScrape(busyDial, &s)
	}
	busy := func() selection.Service { return lt.lookup(busyDial).model.Service() }

	snap.At = at
	first := snap
	lt.observeScrape(busyDial, &first)
	second(80, 3)
	if n := busy().BusyIntervals; n != 0 {
		t.Fatalf("%d busy intervals after 80 steps and 3 finished requests, want 0 (the interval goes on)", n)
	}
	second(80, minBusyRequests-3)
	if n := busy().BusyIntervals; n != 1 {
		t.Fatalf("%d busy intervals once %d requests finished, want 1", n, minBusyRequests)
	}
	for _, steps := range []int{150, 100} {
		second(steps, minBusyRequests)
	}
	if s := busy(); s.BusyIntervals != 3 || math.Abs(s.PrefillSecondsPerToken-busyPerToken) > 0.15*busyPerToken {
		t.Errorf("after 3 busy intervals: %d, %.0f tokens/s, want 3 and about %.0f", s.BusyIntervals, 1/s.PrefillSecondsPerToken, 1/busyPerToken)
	}
}

// TestBusyIntervalsSkipIdleTime: a busy interval's time that this proxy had nothing in flight on the
// upstream, which no other client's requests share, is not counted as engine time: a backend that works
// 0.7 s of every second and idles the rest is learned at its speed, not at 0.7 of it (counted, the idle
// time went to the step time, the dominant term, and the prefill was fitted to what was left). Where a
// scrape shows other clients' requests there, the backend may have run them meanwhile (here it works the
// whole second for them): nothing is subtracted.
func TestBusyIntervalsSkipIdleTime(t *testing.T) {
	for _, foreign := range []bool{false, true} {
		p := busyProxy{lt: newTestLoads()}
		at := time.Unix(1_700_000_000, 0)
		snap := scraper.Snapshot{Running: busyRunning}
		if foreign {
			snap.Running += 2 // another client's two requests, running throughout
		}
		p.hold(at)
		p.scrape(snap, at)
		worked := 0.7
		if foreign {
			worked = 1
		}
		for _, steps := range []int{80, 120, 100, 90} {
			// worked seconds of work, steps decode steps and the prefill that fills the rest, in a
			// second of which this proxy had nothing in flight for the last 0.3 s.
			snap.PrefixQueries += (worked - float64(steps)*busyStep) / busyPerToken
			snap.GenerationTokens += float64(steps * busyRunning)
			at = at.Add(700 * time.Millisecond)
			p.drop(at)
			at = at.Add(300 * time.Millisecond)
			p.hold(at)
			p.scrape(snap, at)
		}
		s := p.lt.lookup(busyDial).model.Service()
		if s.BusyIntervals != 4 {
			t.Fatalf("foreign %v: %d busy intervals, want 4", foreign, s.BusyIntervals)
		}
		if math.Abs(s.PrefillSecondsPerToken-busyPerToken) > 0.15*busyPerToken {
			t.Errorf("foreign %v: learned %.0f tokens/s, want about %.0f", foreign, 1/s.PrefillSecondsPerToken, 1/busyPerToken)
		}
	}
}

// busyProxy is this proxy on the busy-interval tests' upstream: busyRunning requests in flight from hold
// to drop, and the scrapes it observes.
type busyProxy struct {
	lt   *loadTable
	held []*reservation
}

func (p *busyProxy) hold(at time.Time) {
	for range busyRunning {
		p.held = append(p.held, p.lt.reserve(busyDial, work{uncached: 100, output: 64}, at.UnixNano()))
	}
}

func (p *busyProxy) drop(at time.Time) {
	for _, r := range p.held {
		r.release(at.UnixNano(), false)
	}
	p.held = p.held[:0]
}

// scrape observes snap as scraped at at.
func (p *busyProxy) scrape(snap scraper.Snapshot, at time.Time) {
	snap.At = at
	p.lt.observeScrape(busyDial, &snap)
}

// TestBusyIntervalsCountStepsFromZero: a backend that counts its steps (vLLM's per-step histogram) and
// had run none when the first interval began, the counter at 0, is taught by that interval as one whose
// counter began anywhere else: its steps are the counter's, not the tokens generated over the running
// count at the interval's end. Here the batch grows through each interval (half of busyRunning on
// average, all of it at the scrape), so that estimate would count half the steps and give their time to
// the prefill.
func TestBusyIntervalsCountStepsFromZero(t *testing.T) {
	learned := map[float64]selection.Service{}
	for _, start := range []float64{0, 1000} {
		p := busyProxy{lt: newTestLoads()}
		at := time.Unix(1_700_000_000, 0)
		snap := scraper.Snapshot{Steps: start, GenerationTokens: start * busyRunning / 2}
		p.scrape(snap, at) // nothing running yet
		p.hold(at)
		snap.Running = busyRunning
		for _, steps := range []int{80, 120, 100, 90} {
			snap.Steps += float64(steps)
			snap.GenerationTokens += float64(steps * busyRunning / 2)
			snap.PrefixQueries += (1 - float64(steps)*busyStep) / busyPerToken
			at = at.Add(time.Second)
			p.scrape(snap, at)
		}
		s := p.lt.lookup(busyDial).model.Service()
		if s.BusyIntervals != 4 {
			t.Fatalf("step counter from %v: %d busy intervals, want 4", start, s.BusyIntervals)
		}
		learned[start] = s
	}
	zero, other := learned[0].PrefillSecondsPerToken, learned[1000].PrefillSecondsPerToken
	if math.Abs(zero-other) > 1e-9*other {
		t.Errorf("learned %.0f tokens/s from a step counter that started at 0, %.0f from one at 1000: want the same", 1/zero, 1/other)
	}
	if math.Abs(zero-busyPerToken) > 0.15*busyPerToken {
		t.Errorf("learned %.0f tokens/s, want about %.0f", 1/zero, 1/busyPerToken)
	}
}

// TestBusyIntervalsSpanIdleScrapes: a scrape that finds the backend running nothing, while this proxy had
// nothing in flight there and no scrape showed other clients' requests, does not end the busy interval:
// the idle time is taken out of it anyway (TestBusyIntervalsSkipIdleTime), and ended there, an interval
// of a backend that empties between bursts never reached its minBusySteps, so its prefill speed was never
// learned. Here every burst is shorter than that (20-60 steps, 0.5 s of work, then 0.5 s idle across a
// scrape), and three intervals of two bursts each teach the speed. Where another client's requests were
// seen, the backend may have worked for them while this proxy idled: an idle scrape still ends it.
func TestBusyIntervalsSpanIdleScrapes(t *testing.T) {
	for _, foreign := range []bool{false, true} {
		p := busyProxy{lt: newTestLoads()}
		at := time.Unix(1_700_000_000, 0)
		snap := scraper.Snapshot{Running: busyRunning}
		if foreign {
			snap.Running += 2 // another client's two requests, seen while the bursts run
		}
		for _, steps := range []int{40, 30, 60, 20, 50, 45} {
			p.hold(at)
			p.scrape(snap, at)
			snap.PrefixQueries += (0.5 - float64(steps)*busyStep) / busyPerToken
			snap.GenerationTokens += float64(steps) * snap.Running
			at = at.Add(500 * time.Millisecond)
			p.scrape(snap, at) // the burst's last step ends as this scrape reads it
			p.drop(at)
			at = at.Add(500 * time.Millisecond)
			idle := snap
			idle.Running = 0
			p.scrape(idle, at) // idle: nothing running, nothing in flight
		}
		s := p.lt.lookup(busyDial).model.Service()
		if foreign {
			if s.BusyIntervals != 0 {
				t.Errorf("with another client's requests seen: %d busy intervals, want 0 (each idle scrape ends one)", s.BusyIntervals)
			}
			continue
		}
		if s.BusyIntervals != 3 {
			t.Fatalf("%d busy intervals, want 3 (two bursts each)", s.BusyIntervals)
		}
		if math.Abs(s.PrefillSecondsPerToken-busyPerToken) > 0.15*busyPerToken {
			t.Errorf("learned %.0f tokens/s, want about %.0f", 1/s.PrefillSecondsPerToken, 1/busyPerToken)
		}
	}
}

// TestSlotsLearnedOncePerStep: scrapes taken while one long prefill step runs (no counter moved) show one
// state, not several observations of where the backend queues: five of them at 6 running with requests
// waiting teach no slot count. Steps that end between scrapes do; so does every scrape of a backend that
// exports neither counter.
func TestSlotsLearnedOncePerStep(t *testing.T) {
	lt := newTestLoads()
	at := time.Unix(1_700_000_000, 0)
	scrape := func(dial string, s scraper.Snapshot) {
		t.Helper()
		at = at.Add(250 * time.Millisecond)
		s.At = at
		lt.view(dial, at.UnixNano(), &s)
	}
	slots := func(dial string) float64 { return lt.lookup(dial).model.Service().Slots }

	const vllm = "10.0.0.1:8000"
	for range 5 {
		scrape(vllm, scraper.Snapshot{Running: 6, Waiting: 3, KVUsage: 0.3, GenerationTokens: 100, Steps: 40})
	}
	if s := slots(vllm); s != 0 {
		t.Errorf("slots %v from five scrapes inside one step, want 0 (unknown)", s)
	}
	for i := range 3 {
		scrape(vllm, scraper.Snapshot{Running: 8, Waiting: 2, KVUsage: 0.3, GenerationTokens: float64(200 + 8*i), Steps: float64(41 + i)})
	}
	if s := slots(vllm); s != 8 {
		t.Errorf("slots %v after three steps pinned at 8 with requests waiting, want 8", s)
	}

	const bare = "10.0.0.2:30000"
	for range 3 {
		scrape(bare, scraper.Snapshot{Running: 8, Waiting: 2, KVUsage: 0.3})
	}
	if s := slots(bare); s != 8 {
		t.Errorf("slots %v on a backend without step counters, want 8", s)
	}
}

// TestScaledPrior: a capacity hint scales every time in the prior, the mean duration of a request too
// (it sets the pace at which slots and cache space free: left at the prior's, an upstream 30x faster
// looked up to 30x slower to free cache space for its first few dozen requests).
func TestScaledPrior(t *testing.T) {
	p, q := selection.Prior, scaledPrior(4)
	for name, v := range map[string][2]float64{
		"overhead":      {p.Overhead, q.Overhead},
		"prefill":       {p.PrefillSecondsPerToken, q.PrefillSecondsPerToken},
		"decode step":   {p.TokenSeconds, q.TokenSeconds},
		"mean duration": {p.MeanDuration, q.MeanDuration},
	} {
		if v[1] != v[0]/4 {
			t.Errorf("%s: %g at capacity 4, want a quarter of the prior's %g", name, v[1], v[0])
		}
	}
}

// TestFullNow: a backend seen with requests waiting at the most it has run, in two scrapes (two steps)
// and never below it, is full at that count for the decisions that read the second, before its slot count is learned (three); one scrape
// is not enough, nor are waits at varying batch sizes (the chunked-prefill token budget) or for cache
// space.
func TestFullNow(t *testing.T) {
	lt := newTestLoads()
	at := time.Unix(1_700_000_000, 0)
	step := 0.0
	scrape := func(dial string, running, waiting, kv float64) upstreamView {
		t.Helper()
		at, step = at.Add(250*time.Millisecond), step+1
		s := scraper.Snapshot{Running: running, Waiting: waiting, KVUsage: kv, GenerationTokens: 10 * step, Steps: step, At: at}
		lt.view(dial, at.UnixNano(), &s) // the decision that reads the scrape first teaches it to the model
		return lt.view(dial, at.UnixNano()+1e6, &s)
	}

	const slots = "10.0.0.1:8000"
	if v := scrape(slots, 8, 3, 0.3); v.full != 0 {
		t.Errorf("one scrape at 8 running with requests waiting: full %v, want 0", v.full)
	}
	if v := scrape(slots, 8, 2, 0.3); v.full != 8 {
		t.Errorf("two scrapes at 8 running with requests waiting: full %v, want 8", v.full)
	}
	if s := lt.lookup(slots).model.Service().Slots; s != 0 {
		t.Errorf("slot count %v learned from two scrapes, want it unknown (fullNow stands in)", s)
	}
	if v := scrape(slots, 8, 0, 0.3); v.full != 0 {
		t.Errorf("nothing waiting: full %v, want 0", v.full)
	}

	const budget = "10.0.0.2:8000"
	for _, running := range []float64{12, 9, 12, 12} {
		if v := scrape(budget, running, 2, 0.3); v.full != 0 {
			t.Errorf("waiting at %v running after waits below the most run: full %v, want 0", running, v.full)
		}
	}

	const cache = "10.0.0.3:8000"
	for range 3 {
		if v := scrape(cache, 2, 2, 0.95); v.full != 0 {
			t.Errorf("waiting for cache space: full %v, want 0", v.full)
		}
	}
}

// TestSettledQueue: a request sent since the last scrape counts in full in the queue until its first
// token (no scrape has confirmed it), and in the settled queue only until its predicted first token.
func TestSettledQueue(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	at := time.Unix(1_700_000_000, 0)
	snap := scraper.Snapshot{Running: 1, At: at}
	lt.view(dial, at.UnixNano(), &snap)
	sent := at.Add(100 * time.Millisecond)
	lt.reserve(dial, work{uncached: 8000, output: 10}, sent.UnixNano()) // ~1 s of prefill at the prior's speed
	spt := selection.Prior.PrefillSecondsPerToken
	for _, tc := range []struct {
		after           time.Duration
		queued, settled float64
	}{
		{200 * time.Millisecond, 8000 * spt, 8000*spt + selection.Prior.Overhead - 0.2}, // mid-prefill
		{2 * time.Second, 8000 * spt, 0},                                                // predicted done
	} {
		v := lt.view(dial, sent.Add(tc.after).UnixNano(), &snap)
		if math.Abs(v.queued-tc.queued) > 1e-6 || math.Abs(v.settled-min(tc.settled, 8000*spt)) > 1e-6 {
			t.Errorf("%v after sending: queued %.3f, settled %.3f; want %.3f, %.3f", tc.after, v.queued, v.settled,
				tc.queued, min(tc.settled, 8000*spt))
		}
	}
}

// TestSequencesTeachOneSequence: an answer of four sequences (n 4), 400 output tokens in all over 2 s,
// teaches the service model what one sequence of 100 tokens over 2 s does (they decode side by side), not
// a backend four times faster per token; it counts four outputs in the tokens in flight while it runs,
// and releases exactly them.
func TestSequencesTeachOneSequence(t *testing.T) {
	lt := newTestLoads()
	now := time.Now().UnixNano()
	for range 20 {
		one := lt.reserve("one:1", work{uncached: 1000, output: 100, sequences: 1}, now)
		four := lt.reserve("four:1", work{uncached: 1000, output: 100, sequences: 4}, now)
		if tokens, _ := lt.get("four:1"); tokens != 1000+4*100 {
			t.Fatalf("four sequences in flight count %d tokens, want the prompt and four outputs (1400)", tokens)
		}
		one.observeTokens(observerTransport, 100)
		four.observeTokens(observerTransport, 400)
		end := now + 2*int64(time.Second)
		one.release(end, true)
		four.release(end, true)
		now = end
	}
	a, b := lt.entry("one:1", now).model.Service(), lt.entry("four:1", now).model.Service()
	if a.TokenSeconds != b.TokenSeconds || a.PrefillSecondsPerToken != b.PrefillSecondsPerToken || a.MeanDuration != b.MeanDuration {
		t.Errorf("learned from n 4: %+v; from one sequence: %+v: want the same", b, a)
	}
	if tokens, requests := lt.get("four:1"); tokens != 0 || requests != 0 {
		t.Errorf("after every release: %d tokens, %d requests, want 0", tokens, requests)
	}
}

// TestScrapeCountsSequences: the backend counts a request for several sequences as that many (vLLM runs
// each as a request), and so does this proxy, in its requests in flight and in what it subtracts from a
// scrape: one n 4 request of ours running and one other client's request waiting are five in flight,
// not 1 + 4 foreign; of the waiting ones, ours are taken as a whole request or not at all.
func TestScrapeCountsSequences(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	t0 := time.Unix(1_700_000_000, 0)
	four := lt.reserve(dial, work{uncached: 100, output: 10, sequences: 4}, t0.UnixNano())
	at := t0.Add(time.Second)
	if v := lt.view(dial, at.UnixNano(), nil); v.requests != 4 {
		t.Errorf("before a scrape: %v requests in flight, want the 4 sequences", v.requests)
	}
	v := lt.view(dial, at.UnixNano(), &scraper.Snapshot{Running: 4, Waiting: 1, At: at})
	if v.requests != 5 {
		t.Errorf("with a scrape of 4 running, 1 waiting: %v in flight, want 4 of ours and 1 foreign", v.requests)
	}
	if l := lt.lookup(dial); l.waitingOurs != 0 || l.foreignWaiting != 1 {
		t.Errorf("waiting: %d of ours, %v foreign; want the one waiting foreign (ours needs 4)", l.waitingOurs, l.foreignWaiting)
	}
	four.release(at.Add(time.Millisecond).UnixNano(), false) // ended after the scrape: still in its count
	at2 := at.Add(2 * time.Millisecond)
	if v := lt.view(dial, at2.UnixNano(), &scraper.Snapshot{Running: 4, Waiting: 1, At: at}); v.requests != 1 {
		t.Errorf("after ours ended: %v in flight, want the 1 foreign of the same scrape", v.requests)
	}
	if l := lt.lookup(dial); l.sequences.Load() != 0 || l.requests.Load() != 0 {
		t.Errorf("after the release: %d sequences, %d requests in flight, want 0", l.sequences.Load(), l.requests.Load())
	}
}

// TestReportedSlotsFromScrape: a backend whose metrics report its slot count (NVIDIA NIM) is known to
// run that many from its first scrape, before any queue showed it; restarted with another count, the
// next scrape's report replaces it.
func TestReportedSlotsFromScrape(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.2:8000"
	at := time.Unix(1_700_000_000, 0)
	snap := scraper.Snapshot{Running: 3, MaxRunning: 256, StartTime: 100, At: at}
	lt.observeScrape(dial, &snap)
	if s := lt.lookup(dial).model.Service().Slots; s != 256 {
		t.Fatalf("slots %v after the first scrape reported 256, want 256", s)
	}
	restarted := scraper.Snapshot{Running: 0, MaxRunning: 64, StartTime: 200, At: at.Add(time.Second)}
	lt.noteScrape(dial, &restarted, restarted.At.UnixNano())
	lt.observeScrape(dial, &restarted)
	if s := lt.lookup(dial).model.Service().Slots; s != 64 {
		t.Errorf("slots %v after a restart reported 64, want 64", s)
	}
}

// TestArrivalsUnknownUntilGaps: an upstream's arrival rate is unknown from its first request sent until
// minGaps gaps tell one, and then 1/gap; one never sent anything has a rate of 0, known. Unknown rates
// take the mean of the candidates that have one (knownArrivals): left at 0, the upstreams of a pool of 16,
// each sent too few requests to have a rate, charged a 20k-token prefill nothing for the requests it
// delays there.
func TestArrivalsUnknownUntilGaps(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	now := time.Unix(1_700_000_000, 0).UnixNano()
	if v := lt.view(dial, now, nil); v.arrivals != 0 {
		t.Fatalf("never sent: arrivals %v, want 0, known", v.arrivals)
	}
	for i := range minGaps + 1 {
		at := now + int64(i)*int64(100*time.Millisecond)
		lt.reserve(dial, work{uncached: 100, output: 10}, at).release(at, true)
		v := lt.view(dial, at, nil)
		if unknown, wantUnknown := v.arrivals < 0, i < minGaps; unknown != wantUnknown {
			t.Errorf("after %d requests: arrivals %v (unknown %v), want unknown %v", i+1, v.arrivals, unknown, wantUnknown)
		}
		if i == minGaps && math.Abs(v.arrivals-10) > 1e-6 {
			t.Errorf("after %d requests 100 ms apart: %v a second, want 10", i+1, v.arrivals)
		}
	}

	cands := []selection.Candidate{{Arrivals: -1}, {Arrivals: 0}, {Arrivals: 10}, {Arrivals: 20}, {Arrivals: -1}}
	knownArrivals(cands)
	for i, want := range []float64{15, 0, 10, 20, 15} {
		if cands[i].Arrivals != want {
			t.Errorf("candidate %d: %v arrivals a second, want %v", i, cands[i].Arrivals, want)
		}
	}
	none := []selection.Candidate{{Arrivals: -1}, {Arrivals: 0}}
	knownArrivals(none)
	if none[0].Arrivals != 0 || none[1].Arrivals != 0 {
		t.Errorf("no rate known: %v, %v, want 0, 0", none[0].Arrivals, none[1].Arrivals)
	}
}

// TestScrapePairsTimeSteps: each pair of consecutive scrapes that found the backend running, while this
// proxy had requests in flight there throughout, says how long its engine steps took against the prior
// (ObserveSteps: the busy-interval backend, steps 5 ms and prefill 2k tokens/s, against the prior's 30 ms
// and 8k: the mix run here takes 0.2-0.4x the prior's time). A pair with the proxy idle between them, or
// with nothing running at one end, or from a backend that counts no steps, says nothing: the backend may
// have idled through part of it.
func TestScrapePairsTimeSteps(t *testing.T) {
	p := busyProxy{lt: newTestLoads()}
	at := time.Unix(1_700_000_000, 0)
	snap := scraper.Snapshot{Steps: 0}
	p.scrape(snap, at) // nothing running
	p.hold(at)
	snap.Running = busyRunning
	work := func(steps int) {
		snap.Steps += float64(steps)
		snap.GenerationTokens += float64(steps * busyRunning)
		snap.PrefixQueries += (0.2 - float64(steps)*busyStep) / busyPerToken
		at = at.Add(200 * time.Millisecond)
	}
	counted := func() (float64, int) { return p.lt.lookup(busyDial).model.Service().StepsVsPrior() }
	work(20)
	p.scrape(snap, at) // nothing was running at the last one
	if _, n := counted(); n != 0 {
		t.Fatalf("%d scrape pairs counted from one that began with nothing running, want 0", n)
	}
	for _, steps := range []int{20, 30, 10} {
		work(steps)
		p.scrape(snap, at)
	}
	ratio, n := counted()
	if n != 3 {
		t.Fatalf("%d scrape pairs counted, want 3", n)
	}
	// 0.2 s of work against the prior's time for it: 10-30 steps at 30 ms and (0.2 - steps x 5 ms) x 2k
	// tokens at 8k tokens/s.
	if ratio < 0.2 || ratio > 0.45 {
		t.Errorf("steps took %.2fx the prior's time, want 0.2-0.45x", ratio)
	}
	p.drop(at.Add(50 * time.Millisecond)) // the proxy idles there for a while
	p.hold(at.Add(100 * time.Millisecond))
	work(20)
	p.scrape(snap, at)
	if _, n := counted(); n != 3 {
		t.Errorf("%d scrape pairs counted after one the proxy idled in, want still 3", n)
	}
	noSteps := busyProxy{lt: newTestLoads()}
	noSteps.hold(at)
	for range 3 {
		snap.Steps, snap.GenerationTokens = 0, snap.GenerationTokens+100
		at = at.Add(200 * time.Millisecond)
		noSteps.scrape(snap, at)
	}
	if _, n := noSteps.lt.lookup(busyDial).model.Service().StepsVsPrior(); n != 0 {
		t.Errorf("%d scrape pairs counted from a backend that counts no steps, want 0", n)
	}
}

// TestScrapePairsSpanALongStep: a scrape that finds the backend still running the step it ran at the last
// one (a prompt prefilled whole, without chunked prefill, for longer than a scrape interval) ends no
// span (ObserveSpan): the span runs on to the scrape after that step ends, so its time and the prompt
// tokens counted when it was scheduled stay together. Split there, the step's tokens fell in a pair that
// was skipped (no step ended) and its time in the next, one step without tokens, and a pooled fit of a
// kind's prefill speed was 9x too fast (the bench's mixed-pool agentic).
func TestScrapePairsSpanALongStep(t *testing.T) {
	p := busyProxy{lt: newTestLoads()}
	at := time.Unix(1_700_000_000, 0)
	p.hold(at)
	snap := scraper.Snapshot{Running: busyRunning, Steps: 100}
	p.scrape(snap, at)
	snap.PrefixQueries += 1600 // a prompt scheduled, its prefill one step of 0.8 s at 2k tokens/s
	at = at.Add(200 * time.Millisecond)
	p.scrape(snap, at) // the step is still running: no step ended
	at = at.Add(200 * time.Millisecond)
	p.scrape(snap, at)
	at = at.Add(500 * time.Millisecond)
	snap.Steps++
	p.scrape(snap, at) // it ended
	m := p.lt.lookup(busyDial).model
	if _, n := m.Service().StepsVsPrior(); n != 1 {
		t.Errorf("%d scrape pairs counted, want 1 (the pair in which the step ended)", n)
	}
	// The span: 0.9 s for one step and 1,600 tokens. Fitted with spans of decode only (10 steps of
	// 5 ms in 50 ms), the step time is 5 ms and the prefill (0.9 - 0.005) / 1,600 s a token.
	for range 4 {
		m.ObserveSpan(0.05, 0, 10)
	}
	got, ok := selection.FitSpans(m.Service())
	if want := (0.9 - 0.005) / 1600; !ok || got < want/1.05 || got > want*1.05 {
		t.Errorf("prefill fitted %.0f tokens/s (ok %v), want %.0f (the step's time with its tokens)", 1/got, ok, 1/want)
	}
}

// TestForgetStartsAgain: DELETE /llm/upstreams (loadTable.forget) gives every upstream with nothing in
// flight a load that has learned nothing, from its own prior (a configured capacity's too), keeps a
// saturation that is still running, and leaves an upstream with a request in flight as it is, so that
// request is released once where it was counted. A sweep of idle entries keeps those with a configured
// capacity, whose prior would otherwise be lost.
func TestForgetStartsAgain(t *testing.T) {
	lt := newTestLoads()
	now := time.Unix(1_700_000_000, 0).UnixNano()
	const plain, sized, busy = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
	for _, dial := range []string{plain, sized, busy} {
		lt.entry(dial, now)
	}
	lt.lookup(sized).model.SetPrior(scaledPrior(4))
	for _, dial := range []string{plain, sized} {
		l := lt.lookup(dial)
		l.model.ReportSlots(8)
		for range 20 {
			l.model.ObserveBusy(2, 4000, 64, 640)
		}
		l.trust = 0.5
	}
	lt.saturate(plain, time.Unix(0, now).Add(time.Minute))
	held := lt.reserve(busy, work{uncached: 1000, output: 10}, now)
	before := lt.lookup(busy)

	// One upstream by its address: only that one.
	learned := lt.lookup(sized)
	if forgotten, kept := lt.forget(busy, now); forgotten != 0 || kept != 1 || lt.lookup(sized) != learned {
		t.Fatalf("forget(%s) = %d forgotten, %d kept; want that one kept (in flight) and no other touched", busy, forgotten, kept)
	}
	if forgotten, kept := lt.forget(plain, now); forgotten != 1 || kept != 0 || lt.lookup(plain).trust != 1 || lt.lookup(sized) != learned {
		t.Fatalf("forget(%s) = %d forgotten, %d kept; want that one forgotten and no other touched", plain, forgotten, kept)
	}
	if forgotten, kept := lt.forget("10.0.0.9:8000", now); forgotten != 0 || kept != 0 {
		t.Fatalf("forget of an upstream never used = %d forgotten, %d kept; want none", forgotten, kept)
	}
	forgotten, kept := lt.forget("", now)
	if forgotten != 2 || kept != 1 {
		t.Fatalf("forget = %d forgotten, %d kept; want 2 and 1", forgotten, kept)
	}
	for dial, prior := range map[string]selection.Service{plain: selection.Prior, sized: scaledPrior(4)} {
		l := lt.lookup(dial)
		if got, want := l.model.Service(), selection.NewServiceModel(prior).Service(); got != want {
			t.Errorf("%s after forget: %+v, want the prior's %+v", dial, got, want)
		}
		if l.trust != 1 {
			t.Errorf("%s after forget: trust %v, want 1", dial, l.trust)
		}
	}
	if !lt.saturated(plain, now) {
		t.Error("a running saturation was forgotten")
	}
	if lt.lookup(busy) != before {
		t.Error("an upstream with a request in flight was forgotten")
	}
	held.release(now+1, true)
	if tokens, requests := lt.get(busy); tokens != 0 || requests != 0 {
		t.Errorf("after its one release: %d tokens, %d requests", tokens, requests)
	}

	lt.mu.Lock()
	lt.sweepLocked(now + int64(2*idleAfter))
	lt.mu.Unlock()
	if lt.lookup(plain) != nil || lt.lookup(busy) != nil {
		t.Error("the sweep kept idle upstreams without a configured capacity")
	}
	if l := lt.lookup(sized); l == nil || l.model.Prior() != scaledPrior(4) {
		t.Error("the sweep lost an upstream's configured capacity")
	}
}

// view is viewInto without the requests in flight, for the tests that read the rest.
func (t *loadTable) view(dial string, now int64, snap *scraper.Snapshot) upstreamView {
	v, _ := t.viewInto(dial, now, snap, nil)
	return v
}

// TestHolding: the requests in flight the wait for a slot reads are this proxy's own on that upstream,
// each with its age and work; released, they are gone; beyond 128 in flight, none are listed (the
// decision falls back to one interval a request ahead).
func TestHolding(t *testing.T) {
	lt := newTestLoads()
	const dial = "10.0.0.1:8000"
	now := time.Unix(1_700_000_000, 0).UnixNano()
	a := lt.reserve(dial, work{uncached: 800, output: 100}, now)
	b := lt.reserve(dial, work{uncached: 40, output: 7}, now+int64(time.Second))
	lt.reserve("10.0.0.2:8000", work{uncached: 1, output: 1}, now).release(now, true)
	holding := func(dial string, now int64) []selection.Hold {
		_, h := lt.viewInto(dial, now, nil, nil)
		return h
	}
	// Appended to what the decision listed for the candidates before (one scratch slice for all).
	before := selection.Hold{Age: 9, Uncached: 9, Output: 9}
	_, got := lt.viewInto(dial, now+2*int64(time.Second), nil, []selection.Hold{before})
	if len(got) == 0 || got[0] != before {
		t.Fatalf("viewInto dropped the holds it was given: %+v", got)
	}
	got = got[1:]
	slices.SortFunc(got, func(x, y selection.Hold) int { return cmp.Compare(y.Age, x.Age) })
	if want := []selection.Hold{{Age: 2, Uncached: 800, Output: 100}, {Age: 1, Uncached: 40, Output: 7}}; !slices.Equal(got, want) {
		t.Fatalf("holding = %+v, want %+v", got, want)
	}
	a.release(now, true)
	if got := holding(dial, now); len(got) != 1 || got[0].Uncached != 40 {
		t.Errorf("holding after a release = %+v, want the other request only", got)
	}
	b.release(now, true)
	many := make([]*reservation, selection.MaxHolding+1)
	for i := range many {
		many[i] = lt.reserve(dial, work{uncached: 1, output: 1}, now)
	}
	if got := holding(dial, now); len(got) != 0 {
		t.Errorf("holding with %d in flight lists %d, want none (more than selection.MaxHolding)", len(many), len(got))
	}
	for _, r := range many {
		r.release(now, true)
	}
	if got := holding("10.0.0.9:8000", now); len(got) != 0 {
		t.Errorf("holding of an upstream never used = %+v", got)
	}
}
