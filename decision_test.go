package caddyllm

import (
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

// TestDecisionPipeline runs the policy's decision without Caddy: real request parsing, the real route
// table on an injected clock, and the real choice, over conversations as a client sends them.
func TestDecisionPipeline(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	routes := affinity.New(affinity.Config{Capacity: 1000, TTL: 10 * time.Minute, BlockSize: 16, Now: func() time.Time { return now }})
	keys := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
	lt := &loadTable{m: make(map[string]*upstreamLoad)}
	dec := newDecider(selection.DefaultConfig(), routes, lt, 256, nil)

	type message = chatMessage
	system := message{"system", "You are a support agent for a hardware shop. " + strings.Repeat("Answer politely and cite the manual. ", 60)}
	parse := func(msgs ...message) *tokenize.Request { return parseChat(t, msgs...) }
	route := func(req *tokenize.Request) selection.Decision { return routeNow(dec, keys, req, now) }

	turn1 := []message{system, {"user", "My drill will not start."}}
	first := route(parse(turn1...))
	if first.Reason != selection.ReasonLoad || first.MatchedTokens != 0 {
		t.Fatalf("a new conversation: %+v, want a load decision with nothing matched", first)
	}
	home := first.Index

	// Continuing: the next turn resends the history and finds all of it where it was.
	turn2 := append(append([]message{}, turn1...), message{"assistant", "Is the battery charged?"}, message{"user", "Yes, fully."})
	req2 := parse(turn2...)
	d := route(req2)
	if d.Index != home || d.Reason != selection.ReasonAffinity {
		t.Errorf("continuing conversation: %+v, want affinity to upstream %d", d, home)
	}
	if want := req2.Messages[2].End / 16 * 16; d.MatchedTokens != want {
		t.Errorf("continuing conversation matched %d tokens, want turn 1's prompt and the answer generated there: %d", d.MatchedTokens, want)
	}

	// Branching: another conversation behind the same system prompt matches the system prompt.
	branch := parse(system, message{"user", "Where is my order 1234?"})
	d = route(branch)
	if d.Index != home || d.MatchedTokens == 0 || d.MatchedTokens > branch.Messages[0].End {
		t.Errorf("branch from the system prompt: %+v, want upstream %d matching at most the system prompt (%d tokens)", d, home, branch.Messages[0].End)
	}

	// Resumed from its middle: a client that trims the history still lands where its prefix lives.
	d = route(parse(turn1[0], turn1[1], message{"assistant", "Is the battery charged?"}))
	if d.Index != home || d.MatchedTokens == 0 {
		t.Errorf("resumed conversation: %+v, want upstream %d with a match", d, home)
	}

	// A queue at home longer than re-prefilling the conversation elsewhere moves it: 20 requests of
	// 8000 tokens queued there, about 20 s at the prior's 8k tokens/s.
	for range 20 {
		lt.reserve(keys[home], work{uncached: 8000}, now.UnixNano())
	}
	d = route(parse(append(turn2, message{"user", "Still nothing."})...))
	if d.Index == home || d.Reason != selection.ReasonGuard {
		t.Errorf("hot spot: %+v, want another upstream and reason guard", d)
	}

	// TTL: after the routes age out, the same prompt is decided by load again (rendezvous among equals).
	now = now.Add(11 * time.Minute)
	d = route(parse(system, message{"user", "A new question."}))
	if d.MatchedTokens != 0 {
		t.Errorf("after the TTL: %+v, want nothing matched", d)
	}
}

// TestAnsweredThere: a match ending where a message ends is extended over the assistant answer after it,
// and nothing else is.
func TestAnsweredThere(t *testing.T) {
	// system (0-400), user (400-450), assistant (450-650), user (650-700), assistant (700-900), user (900-950)
	msgs := []tokenize.Message{
		{Tokens: 400, End: 400}, {Tokens: 50, End: 450}, {Tokens: 200, End: 650, Assistant: true},
		{Tokens: 50, End: 700}, {Tokens: 200, End: 900, Assistant: true}, {Tokens: 50, End: 950},
	}
	tests := []struct {
		name          string
		matched, want int
	}{
		{"nothing matched", 0, 0},
		{"the first prompt, aligned down to its block", 448, 640},
		{"a later prompt", 688, 896},
		{"a match inside a message", 300, 300},
		{"the system prompt: a user message follows", 400, 400},
		{"the whole history: the answer is the last message but one", 896, 896},
	}
	for _, tt := range tests {
		if got := answeredThere(msgs, tt.matched, 16); got != tt.want {
			t.Errorf("%s: answeredThere(%d) = %d, want %d", tt.name, tt.matched, got, tt.want)
		}
	}
	// A final assistant message (a prefill the client asks to continue) is not an answer given there.
	if got := answeredThere(msgs[:5], 688, 16); got != 688 {
		t.Errorf("assistant message last: answeredThere(688) = %d, want 688", got)
	}
}

// TestUnseenPrefixesAgreeAcrossInstances: two independent policies (separate route tables) send the same
// new system prompt to the same upstream, so active-active proxies build one cache, not two.
func TestUnseenPrefixesAgreeAcrossInstances(t *testing.T) {
	keys := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	spread := make(map[int]int)
	for g := range 40 {
		body := fmt.Sprintf(`{"model":"m","messages":[{"role":"system","content":"tenant %d %s"},{"role":"user","content":"hi"}]}`, g, strings.Repeat("policy text ", 100))
		var chosen [2]int
		for instance := range chosen {
			req, err := tokenize.Parse([]byte(body), tokenize.APIChat, tokenize.Options{Encoding: "approx"})
			if err != nil {
				t.Fatal(err)
			}
			dec := newDecider(selection.DefaultConfig(), affinity.New(affinity.Config{Capacity: 100}), &loadTable{m: make(map[string]*upstreamLoad)}, 256, nil)
			chosen[instance] = dec.choose(&query{req: req, now: 1}, keys, make([]selection.Candidate, len(keys)), nil).Index
		}
		if chosen[0] != chosen[1] {
			t.Errorf("tenant %d: instance 0 chose %d, instance 1 chose %d", g, chosen[0], chosen[1])
		}
		spread[chosen[0]]++
	}
	if len(spread) < len(keys) {
		t.Errorf("40 new prefixes used only %d of %d upstreams: %v", len(spread), len(keys), spread)
	}
}

// TestRouteBoundariesBounded: a request of endless tiny messages learns a bounded number of routes (so
// it cannot evict other conversations' routes) and keeps its first and longest prefixes.
func TestRouteBoundariesBounded(t *testing.T) {
	var b strings.Builder
	b.WriteString(`{"model":"m","messages":[`)
	for i := range 20_000 {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"role":"user","content":"message number %d with a few words"}`, i)
	}
	b.WriteString(`]}`)
	req, err := tokenize.Parse([]byte(b.String()), tokenize.APIChat, tokenize.Options{Encoding: "approx"})
	if err != nil {
		t.Fatal(err)
	}
	// Whichever layer bounds it (tokenize may cap boundaries itself), one request learns few routes.
	bounds := routeBoundaries(req.Boundaries)
	routes := affinity.New(affinity.Config{Capacity: 10_000})
	routes.Learn("m", bounds, "10.0.0.1:8000")
	if n := routes.Stats().Routes; n > maxRouteBoundaries {
		t.Errorf("one request learned %d routes, want at most %d", n, maxRouteBoundaries)
	}
	if bounds[len(bounds)-1] != req.Boundaries[len(req.Boundaries)-1] {
		t.Errorf("the longest prefix was lost")
	}

	// routeBoundaries itself: the first 64 and the last 192 of a long list, short lists untouched.
	long := make([]tokenize.Boundary, 1000)
	for i := range long {
		long[i] = tokenize.Boundary{Tokens: 16 * (i + 1), Hash: uint64(i + 1)}
	}
	thin := routeBoundaries(long)
	if len(thin) != maxRouteBoundaries || thin[0] != long[0] || thin[keepFirstBoundaries-1] != long[keepFirstBoundaries-1] ||
		thin[keepFirstBoundaries] != long[1000-(maxRouteBoundaries-keepFirstBoundaries)] || thin[len(thin)-1] != long[999] {
		t.Errorf("routeBoundaries kept the wrong %d boundaries", len(thin))
	}
	if short := long[:10]; len(routeBoundaries(short)) != 10 {
		t.Errorf("a short request's boundaries were thinned")
	}
}

// TestRouteTablesPerSettings: two policies with different table settings get different tables (before,
// the last provisioned one's block_size, capacity and TTL silently applied to both); the same settings
// share one, and each table lives while a policy holds it.
func TestRouteTablesPerSettings(t *testing.T) {
	small := affinity.Config{Capacity: 10, TTL: time.Minute, BlockSize: 16}
	big := affinity.Config{Capacity: 1000, TTL: time.Hour, BlockSize: 32}
	a, keyA, err := acquireRoutes(small)
	if err != nil {
		t.Fatal(err)
	}
	defer releaseRoutes(keyA)
	b, keyB, _ := acquireRoutes(big)
	defer releaseRoutes(keyB)
	a2, keyA2, _ := acquireRoutes(small)
	defer releaseRoutes(keyA2)
	if a == b || keyA == keyB {
		t.Error("different settings share one route table")
	}
	if a != a2 {
		t.Error("the same settings got two route tables")
	}
	found := 0
	for _, tb := range allRoutes() {
		if tb == a || tb == b {
			found++
		}
	}
	if found != 2 {
		t.Errorf("allRoutes lists %d of the 2 tables in use", found)
	}
}

// TestOverrunSlowsAnUpstream: an upstream whose requests in flight have already run far longer than
// predicted (a backend slower than the estimate it borrowed from the fleet) is priced that much slower,
// long before one of them ends; an overrun every upstream shares (outputs longer than estimated
// everywhere) changes nothing, and neither does one stalled request.
func TestOverrunSlowsAnUpstream(t *testing.T) {
	at, keys, req := overrunFixture(t)
	cases := []struct {
		name string
		// starts of the requests in flight on each upstream (seconds), decided at 6 s
		starts [3][]float64
		slow   bool // keys[0] is avoided
	}{
		{"first overran 3x", [3][]float64{{0, 0}, {5, 5, 5}, {5, 5, 5}}, true},
		{"all overran alike", [3][]float64{{0, 0}, {0, 0, 0}, {0, 0, 0}}, false},
		{"one stalled request", [3][]float64{{0, 5}, {5, 5, 5}, {5, 5, 5}}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			lt := &loadTable{m: make(map[string]*upstreamLoad)}
			dec := newDecider(selection.DefaultConfig(), nil, lt, 256, nil)
			reserveStarts(lt, keys, at, c.starts)
			q := &query{req: req, now: at(6)}
			cands := make([]selection.Candidate, len(keys))
			d := dec.choose(q, keys, cands, nil)
			if slow := d.Index != 0; slow != c.slow {
				t.Errorf("chose %s (costs: %+v), want keys[0] avoided: %v", keys[d.Index], cands, c.slow)
			}
			if c.slow && cands[0].Service.PrefillSecondsPerToken < 2.5*cands[1].Service.PrefillSecondsPerToken {
				t.Errorf("overrun upstream's prefill %.0f µs/token against %.0f: want about 3x", cands[0].Service.PrefillSecondsPerToken*1e6, cands[1].Service.PrefillSecondsPerToken*1e6)
			}
		})
	}
}

// overrunFixture is three upstreams, a clock in seconds and a request of 1,000 prompt tokens.
func overrunFixture(t *testing.T) (at func(float64) int64, keys []string, req *tokenize.Request) {
	t.Helper()
	t0 := time.Unix(1_700_000_000, 0)
	at = func(s float64) int64 { return t0.Add(time.Duration(s * float64(time.Second))).UnixNano() }
	keys = []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
	body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 64, "messages": []map[string]string{{"role": "user", "content": strings.Repeat("tell me more ", 1000)}}})
	req, err := tokenize.Parse(body, tokenize.APIChat, tokenize.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return at, keys, req
}

// reserveStarts puts requests in flight on each of keys, sent at starts[i] (seconds), each predicted to
// take about 2.1 s on the prior (1,000 tokens at 8k/s, 64 at 30 ms).
func reserveStarts(lt *loadTable, keys []string, at func(float64) int64, starts [3][]float64) {
	for i, ss := range starts {
		for _, s := range ss {
			lt.reserve(keys[i], work{uncached: 1000, output: 64}, at(s))
		}
	}
}

// TestPricedAsDecided: /llm/upstreams and the metrics report each upstream's service as the decision
// priced it, beside the learned model: an upstream whose requests overran 3x is priced about 3x slower
// than its model has learned, and that is what is reported as priced; none before any decision.
func TestPricedAsDecided(t *testing.T) {
	at, keys, req := overrunFixture(t)
	lt := &loadTable{m: make(map[string]*upstreamLoad)}
	dec := newDecider(selection.DefaultConfig(), nil, lt, 256, nil)
	reserveStarts(lt, keys, at, [3][]float64{{0, 0}, {5, 5, 5}, {5, 5, 5}}) // keys[0]'s overran 3x at 6 s
	report := func(now int64) map[string]upstreamInflight {
		out := map[string]upstreamInflight{}
		for _, u := range lt.snapshot(now) {
			out[u.Dial] = u
		}
		return out
	}
	for dial, u := range report(at(6)) {
		if p := reportPriced(u.Priced, at(6)); p != nil {
			t.Errorf("%s reported priced %+v before any decision", dial, *p)
		}
	}
	q := &query{req: req, now: at(6)}
	cands := make([]selection.Candidate, len(keys))
	dec.choose(q, keys, cands, nil)
	got := report(at(7))
	for i, dial := range keys {
		p := reportPriced(got[dial].Priced, at(7))
		if p == nil {
			t.Fatalf("%s: no priced model reported after a decision weighed it", dial)
		}
		want := cands[i].Service
		if math.Abs(p.PrefillTokensPerSecond*want.PrefillSecondsPerToken-1) > 1e-9 || math.Abs(p.TokenMS-1000*want.TokenSeconds) > 1e-9 ||
			math.Abs(p.OverheadMS-1000*want.Overhead) > 1e-9 {
			t.Errorf("%s: reported priced %+v, the decision priced %+v", dial, *p, want)
		}
		if math.Abs(p.AgeSeconds-1) > 1e-9 {
			t.Errorf("%s: priced %v s ago, want 1 (decided at 6 s, reported at 7 s)", dial, p.AgeSeconds)
		}
	}
	learned := 1 / got[keys[0]].Service.PrefillSecondsPerToken
	if priced := reportPriced(got[keys[0]].Priced, at(7)).PrefillTokensPerSecond; priced > learned/2.5 {
		t.Errorf("overrun upstream priced at %.0f prefill tokens/s, learned %.0f: want about 3x slower as priced", priced, learned)
	}
}

// TestCachedPrefixFreeOnceItsTurnEnded: a cached prefix counts as free space to reuse (its whole prompt
// takes cache space) once the request that last sent it has ended, and as held (only the uncached part
// takes space) while it runs; the reservation carries that space.
func TestCachedPrefixFreeOnceItsTurnEnded(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	clock := t0
	at := func(s float64) int64 { return t0.Add(time.Duration(s * float64(time.Second))).UnixNano() }
	routes := affinity.New(affinity.Config{Capacity: 1000, TTL: 10 * time.Minute, BlockSize: 16, Now: func() time.Time { return clock }})
	keys := []string{"10.0.0.1:8000", "10.0.0.2:8000"}
	lt := &loadTable{m: make(map[string]*upstreamLoad)}
	dec := newDecider(selection.DefaultConfig(), routes, lt, 256, nil)
	history := []map[string]string{{"role": "user", "content": strings.Repeat("run the tests ", 1000)}}
	parse := func(msgs []map[string]string) *tokenize.Request {
		body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 64, "messages": msgs})
		req, err := tokenize.Parse(body, tokenize.APIChat, tokenize.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return req
	}
	turn := func(now int64) (*query, []selection.Candidate, selection.Decision) {
		history = append(history, map[string]string{"role": "assistant", "content": "ok"}, map[string]string{"role": "user", "content": "go on"})
		clock = time.Unix(0, now)
		q := &query{req: parse(history), now: now}
		cands := make([]selection.Candidate, len(keys))
		return q, cands, dec.choose(q, keys, cands, nil)
	}

	// The first turn runs 2 s: requests there hold their prefix about that long.
	q, _, d := turn(at(0))
	home := d.Index
	dec.commit(q, keys[home], d).release(at(2), true)

	// 3 s after it was sent, it has ended: reusing its prefix takes its whole prompt's space.
	q, cands, d := turn(at(3))
	if d.Index != home || !cands[home].CachedFree || d.KVTokens != q.req.PromptTokens+64 {
		t.Fatalf("after the turn ended: chose %d, free %v, kv %d; want %d, free, the whole prompt and output (%d)",
			d.Index, cands[home].CachedFree, d.KVTokens, home, q.req.PromptTokens+64)
	}
	r := dec.commit(q, keys[home], d)
	if got := lt.lookup(keys[home]).kv; got != int64(d.KVTokens) {
		t.Errorf("reserved kv %d, want the decision's %d", got, d.KVTokens)
	}

	// While that turn runs, the next one (a client's retry) finds the prefix held: only what it
	// prefills and generates takes space.
	q, cands, d = turn(at(3.5))
	if d.Index != home || cands[home].CachedFree || d.KVTokens != q.req.PromptTokens-d.MatchedTokens+64 {
		t.Errorf("while the sender runs: chose %d, free %v, kv %d; want %d, held, %d", d.Index, cands[home].CachedFree,
			d.KVTokens, home, q.req.PromptTokens-d.MatchedTokens+64)
	}
	// It ends early, 0.6 s after it was sent where requests have taken 2 s: the next turn finds the
	// prefix free, though sent less than a usual request's duration ago.
	r.release(at(3.6), true)
	if got := lt.lookup(keys[home]).kv; got != 0 {
		t.Errorf("kv after the release: %d, want 0", got)
	}
	q, cands, d = turn(at(4))
	if d.Index != home || !cands[home].CachedFree || d.KVTokens != q.req.PromptTokens+64 {
		t.Errorf("after a turn that ended early: chose %d, free %v, kv %d; want %d, free, %d", d.Index,
			cands[home].CachedFree, d.KVTokens, home, q.req.PromptTokens+64)
	}
}

// TestSharedPromptHeldWhileHistoryIsFree: a conversation whose last turn has ended finds its history
// free at its home, but the system prompt it shares with another conversation running there is in use:
// only the rest of its prompt takes free space (kv-pressure multi-turn-think moved 12-22% of later turns
// off homes predicted full when every turn's system prompt was counted again). Once nothing running there
// carries the system prompt, the whole prompt takes space again.
func TestSharedPromptHeldWhileHistoryIsFree(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	clock := t0
	at := func(s float64) int64 { return t0.Add(time.Duration(s * float64(time.Second))).UnixNano() }
	routes := affinity.New(affinity.Config{Capacity: 1000, TTL: 10 * time.Minute, BlockSize: 16, Now: func() time.Time { return clock }})
	keys := []string{"10.0.0.1:8000"}
	lt := &loadTable{m: make(map[string]*upstreamLoad)}
	dec := newDecider(selection.DefaultConfig(), routes, lt, 256, nil)
	system := map[string]string{"role": "system", "content": strings.Repeat("You review pull requests. ", 200)}
	histories := map[string][]map[string]string{
		"a": {system, {"role": "user", "content": strings.Repeat("first conversation ", 300)}},
		"b": {system, {"role": "user", "content": strings.Repeat("second conversation ", 300)}},
	}
	turn := func(conv string, now int64) (*query, []selection.Candidate, selection.Decision) {
		h := histories[conv]
		if len(h) > 2 {
			h = append(h, map[string]string{"role": "user", "content": "go on"})
		}
		histories[conv] = append(h, map[string]string{"role": "assistant", "content": "ok"})
		clock = time.Unix(0, now)
		body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 64, "messages": h})
		req, err := tokenize.Parse(body, tokenize.APIChat, tokenize.Options{})
		if err != nil {
			t.Fatal(err)
		}
		q := &query{req: req, now: now}
		cands := make([]selection.Candidate, len(keys))
		return q, cands, dec.choose(q, keys, cands, nil)
	}

	q, _, d := turn("a", at(0))
	dec.commit(q, keys[0], d).release(at(1), true) // a's first turn ends
	q, _, d = turn("b", at(2))
	running := dec.commit(q, keys[0], d) // b's runs on: it holds the system prompt
	systemEnd := q.req.Messages[0].End

	q, cands, d := turn("a", at(3))
	held := cands[0].HeldTokens
	if !cands[0].CachedFree || held <= 0 || held > systemEnd || systemEnd-held >= 16 {
		t.Fatalf("a's next turn with b running: free %v, held %d; want free, the system prompt's %d tokens in whole blocks",
			cands[0].CachedFree, held, systemEnd)
	}
	if want := q.req.PromptTokens - held + 64; d.KVTokens != want {
		t.Errorf("a's next turn with b running: kv %d, want the prompt but the held system prompt, and the output (%d)", d.KVTokens, want)
	}
	running.release(at(3.5), true)

	q, cands, d = turn("a", at(4))
	if !cands[0].CachedFree || cands[0].HeldTokens != 0 || d.KVTokens != q.req.PromptTokens+64 {
		t.Errorf("a's turn with nothing running: free %v, held %d, kv %d; want free, 0, the whole prompt and output (%d)",
			cands[0].CachedFree, cands[0].HeldTokens, d.KVTokens, q.req.PromptTokens+64)
	}
}

// TestPrefixDemandShares: the share of recent requests that carried a prefix, counted by request: a
// prefix in four of five requests has about 0.8 of them, one seen once a small share, and nothing is
// said before minDemand requests.
func TestPrefixDemandShares(t *testing.T) {
	var p prefixDemand
	if got := shareOnly(&p, 1, false); got != 0 {
		t.Errorf("first request: share %v, want 0 (too few to tell)", got)
	}
	var hot float64
	for i := range 1000 {
		if i%5 != 0 {
			hot = shareOnly(&p, 1, false)
		} else {
			shareOnly(&p, uint64(1000+i), false) // a prefix seen once
		}
	}
	if math.Abs(hot-0.8) > 0.02 {
		t.Errorf("a prefix in 4 of 5 requests: share %.3f, want about 0.8", hot)
	}
	// A one-off prefix in the hot one's slot neither replaces it nor is counted.
	if got := shareOnly(&p, 1+demandSlots, false); got != 0 {
		t.Errorf("a one-off colliding with a hot prefix: share %v, want 0 (not counted)", got)
	}
	if got := shareOnly(&p, 1, false); math.Abs(got-0.8) > 0.02 {
		t.Errorf("the hot prefix after a colliding one-off: share %.3f, want about 0.8", got)
	}
	if got := shareOnly(&p, 999_999, false); got > 0.01 {
		t.Errorf("a new prefix: share %.3f, want about 1/%d", got, demandMemory)
	}
	// Traffic moves on: after demandMemory x 4 requests of other prefixes, the old hot one is forgotten.
	for i := range 4 * demandMemory {
		shareOnly(&p, uint64(5000+i%7), false)
	}
	if got := shareOnly(&p, 1, false); got > 0.05 {
		t.Errorf("the old hot prefix after %d other requests: share %.3f, want small", 4*demandMemory, got)
	}
	if got := shareOnly(&p, 0, false); got != 0 {
		t.Errorf("no prefix: share %v, want 0", got)
	}
	// A prefix is reported seen once on its first request, not on its second, nor when a peer sent it.
	if _, once := p.share(2_000_001, false); !once {
		t.Errorf("a new prefix: once false, want true")
	}
	if _, once := p.share(2_000_001, false); once {
		t.Errorf("a prefix on its second request: once true, want false")
	}
	if _, once := p.share(2_000_002, true); once {
		t.Errorf("a new prefix a peer sent: once true, want false")
	}
	var none *prefixDemand
	if got := shareOnly(none, 1, false); got != 0 {
		t.Errorf("no table: share %v, want 0", got)
	}
}

// shareOnly is p.share's share.
func shareOnly(p *prefixDemand, h uint64, elsewhere bool) float64 {
	s, _ := p.share(h, elsewhere)
	return s
}

// TestPrefixDemandKeepsAGroupHome: a queue at a prefix's home that makes a cold upstream's prefill a
// little cheaper moves a hot prefix (most requests carry it: it needs more than one home) and not a
// group that one request in eight carries (one home serves it); a retry is not counted.
func TestPrefixDemandKeepsAGroupHome(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	keys := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
	type message = chatMessage
	parse := func(msgs ...message) *tokenize.Request { return parseChat(t, msgs...) }
	group := message{"system", "You review pull requests for a storage engine. " + strings.Repeat("Cite the line you mean. ", 150)}
	// scenario routes 64 requests, one in every `every` behind the group's system prompt and the
	// others behind system prompts of their own, then queues work at the group's home and routes one
	// more of the group's requests.
	scenario := func(every int) (home int, d selection.Decision, dec *decider) {
		routes := affinity.New(affinity.Config{Capacity: 1000, TTL: 10 * time.Minute, BlockSize: 16, Now: func() time.Time { return now }})
		lt := &loadTable{m: make(map[string]*upstreamLoad)}
		dec = newDecider(selection.DefaultConfig(), routes, lt, 256, nil)
		route := func(req *tokenize.Request) selection.Decision { return routeNow(dec, keys, req, now) }
		home = -1
		for i := range 64 {
			if i%every != 0 {
				route(parse(message{"system", fmt.Sprintf("Assistant %d. ", i) + strings.Repeat("Be brief. ", 100)}, message{"user", "hi"}))
				continue
			}
			d := route(parse(group, message{"user", fmt.Sprintf("Review change %d.", i)}))
			if home >= 0 && d.Index != home {
				t.Fatalf("every %d: request %d of the group went to %d, its home is %d (nothing queued yet)", every, i, d.Index, home)
			}
			home = d.Index
		}
		lt.reserve(keys[home], work{uncached: 1500}, now.UnixNano())
		return home, route(parse(group, message{"user", "Review change 99."})), dec
	}

	home, d, dec := scenario(8)
	if d.Index != home || d.Reason != selection.ReasonAffinity {
		t.Errorf("a group one request in eight carries: %+v, want its home %d (reason affinity)", d, home)
	}
	home, d, _ = scenario(1)
	if d.Index == home || d.Reason != selection.ReasonGuard {
		t.Errorf("a prefix every request carries: %+v, want another upstream than its home %d (reason guard)", d, home)
	}

	counted := dec.demand.n
	q := &query{req: parse(group, message{"user", "Again."}), now: now.UnixNano(), retry: true}
	dec.choose(q, keys, make([]selection.Candidate, len(keys)), nil)
	if dec.demand.n != counted {
		t.Errorf("a retry counted again: %d requests, want %d", dec.demand.n, counted)
	}
}

// TestPrefixHash: a request's prefix is the prompt before its last message however long that message
// is (its steps are boundaries too), so that requests behind one system prompt share it and
// conversations part once their histories differ.
func TestPrefixHash(t *testing.T) {
	parse := func(msgs ...string) uint64 {
		var body []map[string]string
		for i, m := range msgs {
			role := []string{"system", "user", "assistant"}[min(i, 1+(i+1)%2)]
			body = append(body, map[string]string{"role": role, "content": m})
		}
		b, _ := json.Marshal(map[string]any{"model": "m", "messages": body})
		req, err := tokenize.Parse(b, tokenize.APIChat, tokenize.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return prefixBoundary(req).Hash
	}
	long := func(s string) string { return strings.Repeat(s+" ", 4*tokenize.StepBytes/len(s)) }
	system := long("You answer questions about the manual.")
	a := parse(system, long("How do I reset the router?"))
	if b := parse(system, long("Which ports are open by default?")); a == 0 || a != b {
		t.Errorf("two long questions behind one system prompt: prefixes %x and %x, want one", a, b)
	}
	if b := parse(system, "Short?"); a != b {
		t.Errorf("a short and a long question behind one system prompt: prefixes %x and %x, want one", a, b)
	}
	if b := parse(long("You write poems."), long("How do I reset the router?")); a == b {
		t.Errorf("different system prompts: the same prefix %x", a)
	}
	turn2 := parse(system, long("How do I reset the router?"), long("Hold the button."), long("Then what?"))
	other := parse(system, long("Which ports are open by default?"), long("Hold the button."), long("Then what?"))
	if turn2 == a || turn2 == other {
		t.Errorf("later turns: prefix %x (first turn %x, another conversation %x), want the history's own", turn2, a, other)
	}
	if b := parse(system, long("How do I reset the router?"), long("Hold the button."), "Ok."); b != turn2 {
		t.Errorf("one history, two last messages: prefixes %x and %x, want one", turn2, b)
	}
}

// chatMessage is one message of a chat request body.
type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// parseChat parses a chat request of model "m" with msgs as the policy does.
func parseChat(t *testing.T, msgs ...chatMessage) *tokenize.Request {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": "m", "messages": msgs})
	req, err := tokenize.Parse(body, tokenize.APIChat, tokenize.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return req
}

// routeNow decides among keys as Select does, commits, and ends the request at once (at now).
func routeNow(dec *decider, keys []string, req *tokenize.Request, now time.Time) selection.Decision {
	q := &query{req: req, now: now.UnixNano()}
	d := dec.choose(q, keys, make([]selection.Candidate, len(keys)), nil)
	dec.commit(q, keys[d.Index], d).release(now.UnixNano(), false)
	return d
}

// TestFullNowOnlyForHotPrefixes: the full count stands in for an unknown slot count only for a request
// whose prefix is to be replicated; a learned count is kept.
func TestFullNowOnlyForHotPrefixes(t *testing.T) {
	for _, tc := range []struct {
		name        string
		slots, full float64
		hot         bool
		want        float64
	}{
		{"hot, unknown slots, seen full", 0, 8, true, 8},
		{"held prefix", 0, 8, false, 0},
		{"not seen full", 0, 0, true, 0},
		{"slots learned", 16, 8, true, 16},
	} {
		if got := fullNow(selection.Service{Slots: tc.slots}, tc.full, tc.hot).Slots; got != tc.want {
			t.Errorf("%s: slots %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestPeerSeenPrefixStaysHome: a group's prefix that another instance sent (its routes imported through
// `share`) counts as seen before, so this instance's first request of the group stays at the group's
// home under a queue that would move a one-off, as the group's second request would locally.
func TestPeerSeenPrefixStaysHome(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	keys := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
	type message = chatMessage
	group := message{"system", "You review pull requests for a storage engine. " + strings.Repeat("Cite the line you mean. ", 150)}
	cfg := affinity.Config{Capacity: 1000, TTL: 10 * time.Minute, BlockSize: 16, Now: func() time.Time { return now }}
	routes := affinity.New(cfg)
	lt := &loadTable{m: make(map[string]*upstreamLoad)}
	dec := newDecider(selection.DefaultConfig(), routes, lt, 256, nil)
	for i := range 40 { // enough requests for the shares to say anything, none of the group's
		routeNow(dec, keys, parseChat(t, message{"system", fmt.Sprintf("Assistant %d. ", i) + strings.Repeat("Be brief. ", 100)}, message{"user", "hi"}), now)
	}

	// A peer sent one of the group's requests to keys[1]; its routes arrive here.
	peer := affinity.New(cfg)
	peer.EnableFeed(1000)
	peer.Learn("m", parseChat(t, group, message{"user", "Review change 1."}).Boundaries, keys[1])
	changes, _ := peer.DrainFeed(nil)
	routes.ImportChanges(changes)

	lt.reserve(keys[1], work{uncached: 1500}, now.UnixNano())
	if d := routeNow(dec, keys, parseChat(t, group, message{"user", "Review change 2."}), now); d.Index != 1 || d.Reason != selection.ReasonAffinity {
		t.Errorf("the group's first request here: %+v, want its home 1 (reason affinity)", d)
	}
}

// queueSignal sets each candidate's queue as two figures, counted in full (Queued) and as predicted
// (query.settled), as the load signal does from a scrape with requests sent since it.
type queueSignal struct{ queued, settled []float64 }

func (s queueSignal) fill(q *query, keys []string, cands []selection.Candidate) {
	for i := range cands {
		cands[i].Queued, q.settled[i] = s.queued[i], s.settled[i]
	}
}

// TestNextTurnPricedOnPredictedQueues: a conversation's next turn, whose history its home holds, is
// priced on the queues as predicted, so requests sent there since the last scrape whose first tokens
// are predicted past do not move it off its history; a new conversation behind a shared system prompt
// still sees them in full and goes elsewhere.
func TestNextTurnPricedOnPredictedQueues(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	keys := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
	type message = chatMessage
	system := message{"system", "You are a helpful assistant. " + strings.Repeat("Answer briefly. ", 60)}
	history := []message{system, {"user", "Tell me about " + strings.Repeat("the history of the harbour and its trade, ", 40)},
		{"assistant", strings.Repeat("The harbour grew with the grain trade. ", 60)}}
	for _, tc := range []struct {
		name     string
		settled  float64 // the home's queue as predicted
		wantHome bool
	}{
		{"sends since the scrape predicted prefilled", 0, true},
		{"a queue predicted to stay", 0.5, false},
	} {
		routes := affinity.New(affinity.Config{Capacity: 1000, TTL: 10 * time.Minute, BlockSize: 16, Now: func() time.Time { return now }})
		lt := &loadTable{m: make(map[string]*upstreamLoad)}
		dec := newDecider(selection.DefaultConfig(), routes, lt, 256, nil)
		home := routeNow(dec, keys, parseChat(t, history[0], history[1]), now).Index

		queued, settled := make([]float64, len(keys)), make([]float64, len(keys))
		queued[home], settled[home] = 0.5, tc.settled // 0.5 s: more than the history's prefill saves
		dec.signals = append(dec.signals, queueSignal{queued, settled})
		next := parseChat(t, append(history, message{"user", "And today?"})...)
		if d := routeNow(dec, keys, next, now); (d.Index == home) != tc.wantHome {
			t.Errorf("%s: the next turn went to %d (reason %v), home %d; want home %v", tc.name, d.Index, d.Reason, home, tc.wantHome)
		}
		// A new conversation behind the same system prompt, held only at the home: the full count
		// spreads it.
		if d := routeNow(dec, keys, parseChat(t, system, message{"user", "Hello."}), now); d.Index == home {
			t.Errorf("%s: a new conversation went to the queued home %d", tc.name, home)
		}
	}
}

// TestBlindHotPrefixSpills: without metrics or observed first tokens, nothing shows an upstream's
// queue but this proxy's own requests. A prefix every request carries goes to its home only while the
// home holds at most 1.25x one more than the mean in flight; the next request goes elsewhere (reason
// guard: a claim lost to load), which learns the prefix, and the prefix is replicated. Observed first
// tokens do not lift the bound; only metrics do.
func TestBlindHotPrefixSpills(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	routes := affinity.New(affinity.Config{Capacity: 1000, TTL: 10 * time.Minute, BlockSize: 16, Now: func() time.Time { return now }})
	keys := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	lt := &loadTable{m: make(map[string]*upstreamLoad)}
	dec := newDecider(selection.DefaultConfig(), routes, lt, 64, nil) // no scrapes
	system := chatMessage{"system", "You are a careful assistant. " + strings.Repeat("Follow the style guide to the letter. ", 80)}
	ask := func(i int) *tokenize.Request {
		return parseChat(t, system, chatMessage{"user", fmt.Sprintf("Question %d?", i)})
	}
	// Requests held in flight, as a burst of them would be.
	var held []*reservation
	send := func(i int) selection.Decision {
		q := &query{req: ask(i), now: now.UnixNano()}
		d := dec.choose(q, keys, make([]selection.Candidate, len(keys)), nil)
		held = append(held, dec.commit(q, keys[d.Index], d))
		return d
	}
	home := send(0).Index
	perUpstream := make([]int, len(keys))
	perUpstream[home]++
	spilled := false
	for i := 1; i < 12; i++ {
		d := send(i)
		perUpstream[d.Index]++
		if d.Index != home && !spilled {
			spilled = true
			if d.Reason != selection.ReasonGuard {
				t.Errorf("request %d, the first off the home, went with reason %v, want guard", i, d.Reason)
			}
		}
		if limit := 1.25*(float64(i)/float64(len(keys))+1) + 1; float64(perUpstream[home]) > limit {
			t.Fatalf("after %d requests the home holds %d, over the bound %.2f", i+1, perUpstream[home], limit)
		}
	}
	if !spilled {
		t.Fatalf("12 requests of one prefix in flight, all on its home %v", perUpstream)
	}

	// A first token observed at home shows its speed, not its queue: it stays bounded.
	held[0].noteFirstToken(now.Add(300 * time.Millisecond).UnixNano())
	q := &query{req: ask(100), now: now.UnixNano()}
	cands := make([]selection.Candidate, len(keys))
	dec.choose(q, keys, cands, nil)
	for i := range cands {
		if !cands[i].Blind {
			t.Errorf("candidate %d not blind without metrics", i)
		}
	}
	if lt.lookup(keys[home]).model.Service().FirstTokens != 1 {
		t.Fatal("the first token was not observed")
	}
	for _, r := range held {
		r.release(now.UnixNano(), false)
	}
}

// TestOpenCeiling: a scrape leaves an upstream's ceiling open when it shows requests waiting, not for
// cache space, at the most the upstream has been seen running, and no slot count is known or likely.
func TestOpenCeiling(t *testing.T) {
	for _, tt := range []struct {
		name string
		s    selection.Service
		snap scraper.Snapshot
		want bool
	}{
		{"waiting at the ceiling", selection.Service{Ceiling: 8}, scraper.Snapshot{Running: 8, Waiting: 3, KVUsage: 0.3}, true},
		{"nothing waiting", selection.Service{Ceiling: 8}, scraper.Snapshot{Running: 8, KVUsage: 0.3}, false},
		{"below the ceiling", selection.Service{Ceiling: 12}, scraper.Snapshot{Running: 8, Waiting: 3, KVUsage: 0.3}, false},
		{"waiting for cache space", selection.Service{Ceiling: 8}, scraper.Snapshot{Running: 8, Waiting: 3, KVUsage: 0.95}, false},
		{"slot count likely", selection.Service{Ceiling: 8, LikelySlots: 8}, scraper.Snapshot{Running: 8, Waiting: 3, KVUsage: 0.3}, false},
		{"slot count known", selection.Service{Ceiling: 8, Slots: 8}, scraper.Snapshot{Running: 8, Waiting: 3, KVUsage: 0.3}, false},
	} {
		if got := openCeiling(tt.s, &tt.snap); got != tt.want {
			t.Errorf("%s: openCeiling = %v, want %v", tt.name, got, tt.want)
		}
	}
}

// TestDecisionDebugLogPricesEveryCandidate: at debug level each decision's log line lists every candidate
// as the decision priced it, so an operator can see why one upstream was chosen over another. With one
// request in flight on an upstream, the next (unrelated) request goes elsewhere, and its line shows the
// busy upstream's request and a cost above the chosen one's.
func TestDecisionDebugLogPricesEveryCandidate(t *testing.T) {
	s, pool := provisionedPolicy(t, &LLMSelection{})
	core, logs := observer.New(zap.DebugLevel)
	s.logger = zap.New(core)
	r1, cancel1 := newProxyRequest(chatRequest20(101))
	busy := s.Select(pool, r1, nil)
	r2, cancel2 := newProxyRequest(chatRequest20(102))
	chosen := s.Select(pool, r2, nil)
	if busy == nil || chosen == nil {
		t.Fatal("Select returned no upstream")
	}
	cancel1()
	cancel2()
	waitInflightZero(t, simDialsOf(pool)...)
	if chosen == busy {
		t.Fatalf("the second request went to %s, which had the first in flight, with three idle upstreams", busy.Dial)
	}
	entries := logs.FilterMessage("selected upstream").AllUntimed()
	if len(entries) != 2 {
		t.Fatalf("%d 'selected upstream' lines, want 2", len(entries))
	}
	fields := entries[1].ContextMap()
	if fields["upstream"] != chosen.Dial {
		t.Errorf("logged upstream %v, chose %s", fields["upstream"], chosen.Dial)
	}
	costs, _ := fields["costs"].([]any)
	if len(costs) != len(pool) {
		t.Fatalf("costs = %v, want one entry per candidate (%d)", fields["costs"], len(pool))
	}
	byDial := map[string]map[string]any{}
	for _, c := range costs {
		m, _ := c.(map[string]any)
		dial, _ := m["upstream"].(string)
		byDial[dial] = m
	}
	for _, up := range pool {
		if byDial[up.Dial] == nil {
			t.Fatalf("no cost logged for candidate %s: %v", up.Dial, costs)
		}
	}
	cost := func(dial string) float64 { v, _ := byDial[dial]["cost_seconds"].(float64); return v }
	for dial := range byDial {
		if !(cost(dial) > 0) || math.IsInf(cost(dial), 0) {
			t.Errorf("%s: cost_seconds %v, want a finite positive time", dial, byDial[dial]["cost_seconds"])
		}
		if cost(dial) < cost(chosen.Dial) {
			t.Errorf("%s priced %v, less than the chosen %s's %v", dial, cost(dial), chosen.Dial, cost(chosen.Dial))
		}
	}
	if n, _ := byDial[busy.Dial]["requests"].(float64); n != 1 {
		t.Errorf("the busy upstream's logged requests = %v, want 1 (the first request, in flight)", byDial[busy.Dial]["requests"])
	}
	if !(cost(busy.Dial) > cost(chosen.Dial)) {
		t.Errorf("the busy upstream priced %v, not above the chosen idle one's %v", cost(busy.Dial), cost(chosen.Dial))
	}
	if w, _ := byDial[busy.Dial]["wait_seconds"].(float64); !(w > 0) {
		t.Errorf("the busy upstream's wait_seconds = %v, want the first request's prefill ahead", byDial[busy.Dial]["wait_seconds"])
	}
	for dial, m := range byDial {
		if r, _ := m["prefill_tokens_per_sec"].(float64); !(r > 0) {
			t.Errorf("%s: prefill_tokens_per_sec %v, want the speed it was priced at", dial, m["prefill_tokens_per_sec"])
		}
	}
}
