package caddyllm

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/affinity"
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

	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	system := message{"system", "You are a support agent for a hardware shop. " + strings.Repeat("Answer politely and cite the manual. ", 60)}
	parse := func(msgs ...message) *tokenize.Request {
		body, _ := json.Marshal(map[string]any{"model": "m", "messages": msgs})
		req, err := tokenize.Parse(body, tokenize.APIChat, tokenize.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return req
	}
	// route decides among the upstreams as Select does, commits, and ends the request at once.
	route := func(req *tokenize.Request) selection.Decision {
		q := &query{req: req, now: now.UnixNano()}
		cands := make([]selection.Candidate, len(keys))
		d := dec.choose(q, keys, cands, nil)
		dec.commit(q, keys[d.Index], d).release(now.UnixNano(), false)
		return d
	}

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
	t0 := time.Unix(1_700_000_000, 0)
	at := func(s float64) int64 { return t0.Add(time.Duration(s * float64(time.Second))).UnixNano() }
	keys := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
	body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 64, "messages": []map[string]string{{"role": "user", "content": strings.Repeat("tell me more ", 1000)}}})
	req, err := tokenize.Parse(body, tokenize.APIChat, tokenize.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// Each request is predicted to take about 2.1 s on the prior (1,000 tokens at 8k/s, 64 at 30 ms).
	w := work{uncached: 1000, output: 64}
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
			for i, starts := range c.starts {
				for _, s := range starts {
					lt.reserve(keys[i], w, at(s))
				}
			}
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
