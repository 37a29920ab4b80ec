package caddyllm

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"testing/iotest"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

// sseChunk is one vLLM chat chunk event with the given delta content.
func sseChunk(content string) string {
	return `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"` +
		content + `"},"logprobs":null,"finish_reason":null}]}` + "\n\n"
}

const (
	sseRole  = `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}` + "\n\n"
	sseUsage = `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":200,"total_tokens":203,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":96}}}` + "\n\n"
	sseDone  = "data: [DONE]\n\n"
	// A Responses API stream (vLLM's event order): content in deltas only; the .done events and the
	// final response repeat the whole text.
	responsesStream = "event: response.created\n" + `data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","instructions":"Be brief.","output":[],"status":"in_progress","text":{"format":{"type":"text"}},"usage":null}}` + "\n\n" +
		"event: response.content_part.added\n" + `data: {"type":"response.content_part.added","item_id":"msg_1","output_index":0,"content_index":0,"part":{"type":"output_text","text":"","annotations":[]}}` + "\n\n" +
		"event: response.output_text.delta\n" + `data: {"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":"Hel"}` + "\n\n" +
		"event: response.output_text.delta\n" + `data: {"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":"lo"}` + "\n\n" +
		"event: response.output_text.delta\n" + `data: {"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":"!"}` + "\n\n" +
		"event: response.output_text.done\n" + `data: {"type":"response.output_text.done","item_id":"msg_1","output_index":0,"content_index":0,"text":"Hello!"}` + "\n\n" +
		"event: response.content_part.done\n" + `data: {"type":"response.content_part.done","item_id":"msg_1","output_index":0,"content_index":0,"part":{"type":"output_text","text":"Hello!","annotations":[]}}` + "\n\n" +
		"event: response.completed\n" + `data: {"type":"response.completed","response":{"id":"resp_1","object":"response","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Hello!"}]}],"status":"completed","usage":{"input_tokens":200,"input_tokens_details":{"cached_tokens":96},"output_tokens":3,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":203},"user":null}}` + "\n\n"
	responsesWhole = `{"id":"resp_1","object":"response","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"say \"output_tokens\":9","annotations":[]}]}],"usage":{"input_tokens":200,"input_tokens_details":{"cached_tokens":128},"output_tokens":7,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":207},"user":null}`
	whole          = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"say \"cached_tokens\":5"},"finish_reason":"stop"}],"usage":{"prompt_tokens":200,"total_tokens":207,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":128}},"prompt_logprobs":null,"kv_transfer_params":null}`
)

// observeAll reads body through an observer (piece 0: in one read, 1: byte by byte, 2: in halves) and
// returns what came out.
func observeAll(t *testing.T, res *reservation, body string, stream bool, piece int) []byte {
	t.Helper()
	var r io.Reader = strings.NewReader(body) // piece 0: all at once
	switch piece {
	case 1:
		r = iotest.OneByteReader(r)
	case 2:
		r = iotest.HalfReader(r)
	}
	rc := io.NopCloser(r)
	b := &observedBody{body: rc, res: res, stream: stream, lineEmpty: true}
	out, err := io.ReadAll(b)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestObservedBody(t *testing.T) {
	tests := []struct {
		name       string
		body       string
		stream     bool
		wantTokens int64
		wantCached int64 // -1: none reported
		wantPrompt int64
	}{
		{name: "stream with usage", body: sseRole + sseChunk("Hel") + sseChunk("lo") + sseChunk("!") + sseUsage + sseDone, stream: true, wantTokens: 3, wantCached: 96, wantPrompt: 200},
		{name: "stream without usage", body: sseRole + sseChunk("a") + sseChunk("b") + sseDone, stream: true, wantTokens: 2, wantCached: -1},
		// One content chunk, and a usage that counts 3: chunks of several tokens; the usage's count is taken.
		{name: "stream with CRLF", body: strings.ReplaceAll(sseRole+sseChunk("a")+sseUsage+sseDone, "\n", "\r\n"), stream: true, wantTokens: 3, wantCached: 96, wantPrompt: 200},
		{name: "stream of multi-token chunks", body: sseRole + sseChunk("Hello wor") + sseChunk("ld!") +
			`data: {"choices":[],"usage":{"prompt_tokens":200,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":96}}}` + "\n\n" + sseDone,
			stream: true, wantTokens: 8, wantCached: 96, wantPrompt: 200},
		{name: "stream with continuous usage", stream: true, wantTokens: 5, wantCached: -1,
			body: `data: {"choices":[{"index":0,"delta":{"content":"ab"}}],"usage":{"prompt_tokens":9,"completion_tokens":2}}` + "\n\n" +
				`data: {"choices":[{"index":0,"delta":{"content":"cde"}}],"usage":{"prompt_tokens":9,"completion_tokens":5}}` + "\n\n" + sseDone},
		{name: "completions stream", body: `data: {"choices":[{"index":0,"text":"x"}]}` + "\n\n" + `data: {"choices":[{"index":0,"text":""}]}` + "\n\n" + sseDone, stream: true, wantTokens: 1, wantCached: -1},
		{name: "whole answer", body: whole, wantTokens: 7, wantCached: 128, wantPrompt: 200},
		{name: "responses stream", body: responsesStream, stream: true, wantTokens: 3, wantCached: 96, wantPrompt: 200},
		{name: "responses whole answer", body: responsesWhole, wantTokens: 7, wantCached: 128, wantPrompt: 200},
		{name: "whole answer without details", body: `{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"prompt_tokens_details":null}}`, wantTokens: 1, wantCached: -1},
	}
	for _, tt := range tests {
		for _, piece := range []int{0, 1, 2} {
			t.Run(tt.name, func(t *testing.T) {
				lt := newTestLoads()
				res := lt.reserve("u:1", work{uncached: 100, prompt: 200, matched: 100, prediction: prediction{prompt: 200, predicted: 100}}, time.Now().UnixNano())
				out := observeAll(t, res, tt.body, tt.stream, piece)
				if string(out) != tt.body {
					t.Fatalf("relayed bytes differ:\n%q\nwant\n%q", out, tt.body)
				}
				if got := res.outputSeen.Load(); got != tt.wantTokens {
					t.Errorf("output tokens = %d, want %d", got, tt.wantTokens)
				}
				if !res.firstToken {
					t.Error("first token not marked")
				}
				c := res.load.cacheFigures()
				if tt.wantCached < 0 {
					if c.Requests != 0 {
						t.Errorf("cache figures = %+v, want nothing reported", c)
					}
					return
				}
				if c.Requests != 1 || c.Cached != tt.wantCached || c.Prompt != tt.wantPrompt || c.Predicted != 100 || c.Confirmed != min(100, tt.wantCached) {
					t.Errorf("cache figures = %+v, want cached %d of %d prompt, 100 predicted", c, tt.wantCached, tt.wantPrompt)
				}
			})
		}
	}
}

// TestObservedUsageBeforeContent: a usage chunk before any content (a response of tool calls only, or
// reordered events) counts no tokens: counted, its arrival would be taken for the first token's.
func TestObservedUsageBeforeContent(t *testing.T) {
	lt := newTestLoads()
	res := lt.reserve("u:1", work{uncached: 100, prompt: 200}, time.Now().UnixNano())
	observeAll(t, res, sseRole+sseUsage+sseDone, true, 0)
	if got := res.outputSeen.Load(); got != 0 || res.firstToken {
		t.Errorf("output tokens = %d, first token %v; want none from a usage chunk without content before it", got, res.firstToken)
	}
}

// TestObserversNeverDoubleCount: the transport and llm_resume both report the same attempt; the first to
// count it counts it all, and its cached tokens are taken once.
func TestObserversNeverDoubleCount(t *testing.T) {
	lt := newTestLoads()
	res := lt.reserve("u:1", work{uncached: 10, prompt: 10, prediction: prediction{prompt: 10}}, time.Now().UnixNano())
	for range 3 {
		res.observeTokens(observerTransport, 1)
		res.observeTokens(observerResume, 1)
	}
	res.observeCached(10, 4)
	res.observeCached(10, 4)
	if got := res.outputSeen.Load(); got != 3 {
		t.Errorf("output tokens = %d, want 3", got)
	}
	if c := res.load.cacheFigures(); c.Requests != 1 || c.Cached != 4 {
		t.Errorf("cache figures = %+v, want one report of 4", c)
	}
}

// TestDenialShortensHorizon: a backend that reports far fewer cached tokens than the route table claimed
// kept the prefix for less than the claim's age, which becomes its horizon (older claims are not
// credited); a claim older than the horizon that it confirms lengthens it. Trust follows the share of
// the claim confirmed. A claim whose own request was still prefilling when the report's request was sent
// may not have been computed yet: a shortfall on it moves neither.
func TestDenialShortensHorizon(t *testing.T) {
	const age = int64(4 * time.Second)
	tests := []struct {
		name            string
		horizon         int64 // before the report
		claimed, cut    int
		cached          int // reported, in the backend's tokens
		backendPrompt   int // the backend counts twice as many tokens as the policy when 600
		wantHorizon     int64
		wantCorrections int64
		wantTrust       float64 // from 1, moved by observedTrustGain toward the share confirmed
		// sender: the request that made the claim (its prefixes learned at the claim's time) is still in
		// flight there, without its first token ("prefilling") or after it ("answering"); "": it ended.
		sender string
	}{
		{name: "confirmed", claimed: 256, cached: 256, backendPrompt: 300, wantTrust: 1},
		{name: "a little short is no denial", claimed: 256, cached: 192, backendPrompt: 300, wantTrust: 0.975},
		{name: "denied", claimed: 256, cached: 64, backendPrompt: 300, wantHorizon: age, wantCorrections: 1, wantTrust: 0.925},
		{name: "denied, shorter than the horizon", horizon: 2 * age, claimed: 256, cached: 0, backendPrompt: 300, wantHorizon: age, wantCorrections: 1, wantTrust: 0.9},
		{name: "denied, longer than the horizon", horizon: age / 2, claimed: 256, cached: 0, backendPrompt: 300, wantHorizon: age / 2, wantCorrections: 1, wantTrust: 0.9},
		{name: "scaled to the backend's tokens", claimed: 256, cached: 128, backendPrompt: 600, wantHorizon: age, wantCorrections: 1, wantTrust: 0.925},
		{name: "cut claim confirmed", horizon: age / 2, cut: 256, cached: 256, backendPrompt: 300, wantHorizon: age/2 + age/4, wantTrust: 1},
		{name: "cut claim denied", horizon: age / 2, cut: 256, cached: 0, backendPrompt: 300, wantHorizon: age / 2, wantTrust: 1},
		{name: "denied while its sender prefills", sender: "prefilling", claimed: 256, cached: 0, backendPrompt: 300, wantTrust: 1},
		{name: "half computed while its sender prefills", sender: "prefilling", claimed: 256, cached: 160, backendPrompt: 300, wantTrust: 1},
		{name: "confirmed while its sender prefills", sender: "prefilling", horizon: age / 2, claimed: 256, cached: 256, backendPrompt: 300, wantHorizon: age / 2, wantTrust: 1},
		{name: "denied after its sender's first token", sender: "answering", claimed: 256, cached: 0, backendPrompt: 300, wantHorizon: age, wantCorrections: 1, wantTrust: 0.9},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lt := newTestLoads()
			now := time.Now().UnixNano()
			if tt.sender != "" {
				sender := lt.reserve("u:1", work{prompt: 300, uncached: 300, learned: now - age}, now-age)
				if tt.sender == "answering" {
					sender.noteFirstToken(now - age/2)
				}
				// Another request in flight, learned at another time: not the claim's sender.
				lt.reserve("u:1", work{prompt: 300, uncached: 300, learned: now - age + 1}, now-age+1)
			}
			res := lt.reserve("u:1", work{prompt: 300, matched: tt.claimed, prediction: prediction{
				prompt: 300, predicted: tt.claimed, claimed: tt.claimed, cut: tt.cut, claimAge: age,
			}}, now)
			res.load.horizon = tt.horizon
			res.observeCached(tt.backendPrompt, tt.cached)
			if got := res.load.cacheHorizon(); got != tt.wantHorizon {
				t.Errorf("horizon = %v, want %v", time.Duration(got), time.Duration(tt.wantHorizon))
			}
			c := res.load.cacheFigures()
			if c.Corrections != tt.wantCorrections {
				t.Errorf("corrections = %d, want %d", c.Corrections, tt.wantCorrections)
			}
			if d := c.Trust - tt.wantTrust; d > 1e-9 || d < -1e-9 {
				t.Errorf("trust = %g, want %g", c.Trust, tt.wantTrust)
			}
		})
	}
}

// TestHorizonCutsOldClaims: the cache signal does not credit a claim older than its upstream's horizon,
// and commit records it as cut with its age. Where the upstream's cache size is known, the eviction
// estimate judges each claim instead (TestEvictedClaimsAreNotCredited), and the horizon cuts nothing.
func TestHorizonCutsOldClaims(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	clock := now
	routes := affinity.New(affinity.Config{Now: func() time.Time { return clock }})
	bounds := []tokenize.Boundary{{Tokens: 64, Hash: 1}, {Tokens: 128, Hash: 2}}
	routes.Learn("m", bounds, "old:1")
	clock = now.Add(9 * time.Second)
	routes.Learn("m", bounds, "young:1")
	clock = now.Add(10 * time.Second)
	lt := newTestLoads()
	for _, dial := range []string{"old:1", "young:1"} {
		lt.entry(dial, clock.UnixNano()).horizon = int64(5 * time.Second)
	}
	q := &query{req: &tokenize.Request{Model: "m", PromptTokens: 200, Boundaries: bounds}, bounds: bounds, now: clock.UnixNano()}
	keys := []string{"old:1", "young:1"}
	cands := make([]selection.Candidate, 2)
	cacheSignal{routes: routes, loads: lt}.fill(q, keys, cands)
	if cands[0].CachedTokens != 0 || cands[1].CachedTokens != 128 {
		t.Errorf("credited %d and %d cached tokens, want 0 (claim 10s old, horizon 5s) and 128 (1s old)", cands[0].CachedTokens, cands[1].CachedTokens)
	}

	// The cache size known (a scrape), and nothing sent since the claim: the old claim is credited whole.
	known := make([]selection.Candidate, 2)
	for i := range known {
		known[i].KVCapacity = 1 << 20
	}
	cacheSignal{routes: routes, loads: lt}.fill(q, keys, known)
	if known[0].CachedTokens != 128 || known[1].CachedTokens != 128 || q.cut[0] != 0 {
		t.Errorf("cache size known: credited %d and %d cached tokens (cut %v), want 128 and 128, nothing cut", known[0].CachedTokens, known[1].CachedTokens, q.cut)
	}

	cacheSignal{routes: routes, loads: lt}.fill(q, keys, cands) // the size unknown again, for commit
	d := &decider{routes: routes, loads: lt, outputTokens: 16}
	res := d.commit(q, "old:1", selection.Decision{Index: 0})
	if p := res.prediction; p.claimed != 0 || p.cut != 128 || p.claimAge != int64(10*time.Second) {
		t.Errorf("prediction = claimed %d, cut %d, age %v; want 0, 128, 10s", p.claimed, p.cut, time.Duration(p.claimAge))
	}
}

// TestRestartForgetsRoutes: a scrape showing a new process start time, or counters gone back, forgets the
// upstream's routes in every route table at once, and trust starts again from 1.
func TestRestartForgetsRoutes(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	tests := []struct {
		name string
		next scraper.Snapshot
		want bool
	}{
		{name: "same process", next: scraper.Snapshot{Running: 1, PrefixHits: 60, PrefixQueries: 200, StartTime: 1000}, want: false},
		{name: "new start time", next: scraper.Snapshot{Running: 1, PrefixHits: 60, PrefixQueries: 200, StartTime: 2000}, want: true},
		{name: "counters reset", next: scraper.Snapshot{Running: 1, PrefixHits: 0, PrefixQueries: 10, StartTime: 1000}, want: true},
		{name: "counters reset, no start time", next: scraper.Snapshot{Running: 1, PrefixHits: 0, PrefixQueries: 10}, want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			routes := affinity.New(affinity.Config{})
			releaseRoutes := registerTestRoutes(t, routes)
			defer releaseRoutes()
			bounds := []tokenize.Boundary{{Tokens: 64, Hash: 1}}
			routes.Learn("m", bounds, "u:1")
			routes.Learn("m", bounds, "u:2")
			lt := newTestLoads()
			first := scraper.Snapshot{Running: 1, PrefixHits: 50, PrefixQueries: 100, StartTime: 1000, At: t0}
			lt.noteScrape("u:1", &first, t0.UnixNano())
			l := lt.lookup("u:1")
			l.mu.Lock()
			l.trust = 0.4
			l.mu.Unlock()
			next := tt.next
			next.At = t0.Add(time.Second)
			lt.noteScrape("u:1", &next, next.At.UnixNano())
			lt.noteScrape("u:1", &next, next.At.UnixNano()) // the same snapshot again: checked once
			want := map[bool]int{true: 0, false: 1}[tt.want]
			if got := routes.RouteCount("u:1"); got != want {
				t.Errorf("routes of the scraped upstream = %d, want %d", got, want)
			}
			if got := routes.RouteCount("u:2"); got != 1 {
				t.Errorf("routes of the other upstream = %d, want 1", got)
			}
			wantRestarts, wantTrust := int64(0), 0.4
			if tt.want {
				wantRestarts, wantTrust = 1, 1
			}
			if c := l.cacheFigures(); c.Restarts != wantRestarts || c.Trust != wantTrust {
				t.Errorf("restarts %d, trust %g; want %d, %g", c.Restarts, c.Trust, wantRestarts, wantTrust)
			}
		})
	}
}

// registerTestRoutes makes routes one of the tables allRoutes returns, until the returned func runs.
func registerTestRoutes(t *testing.T, routes *affinity.Table) func() {
	t.Helper()
	key := fmt.Sprintf("test %s %p", t.Name(), routes)
	if _, _, err := routeTables.LoadOrNew(key, func() (caddy.Destructor, error) { return routeTable{routes}, nil }); err != nil {
		t.Fatal(err)
	}
	return func() { releaseRoutes(key) }
}

// BenchmarkObservedBodyChunk measures the observer's cost per relayed SSE chunk: it must not allocate.
func BenchmarkObservedBodyChunk(b *testing.B) {
	chunk := []byte(sseChunk(" token"))
	lt := newTestLoads()
	res := lt.reserve("u:1", work{uncached: 10, prompt: 10, prediction: prediction{prompt: 10}}, time.Now().UnixNano())
	src := &repeatReader{chunk: chunk}
	body := &observedBody{body: io.NopCloser(src), res: res, stream: true, lineEmpty: true}
	buf := make([]byte, 32<<10)
	b.ReportAllocs()
	b.SetBytes(int64(len(chunk)))
	b.ResetTimer()
	for range b.N {
		if _, err := body.Read(buf); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if res.outputSeen.Load() != int64(b.N) {
		b.Fatalf("counted %d tokens in %d chunks", res.outputSeen.Load(), b.N)
	}
}

// BenchmarkObservedBodyWhole measures the observer on a whole answer read in one piece.
func BenchmarkObservedBodyWhole(b *testing.B) {
	body := []byte(whole)
	lt := newTestLoads()
	res := lt.reserve("u:1", work{uncached: 10, prompt: 10, prediction: prediction{prompt: 10}}, time.Now().UnixNano())
	ob := &observedBody{res: res}
	buf := make([]byte, 4096)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		ob.tailLen = 0
		ob.observe(body)
		copy(buf, body)
	}
}

// repeatReader returns one chunk per Read, forever.
type repeatReader struct{ chunk []byte }

func (r *repeatReader) Read(p []byte) (int, error) { return copy(p, r.chunk), nil }

// TestEvictedClaimsAreNotCredited: a claim is credited while what this proxy sent its upstream since
// fits in the cache beside it (least recently used blocks go first); beyond that, only the head of the
// prefix that is left (a request's blocks are freed last first, so its end goes first), and nothing once
// all of it went; an upstream whose cache size is unknown is credited as before.
func TestEvictedClaimsAreNotCredited(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	clock := now
	routes := affinity.New(affinity.Config{Now: func() time.Time { return clock }})
	bounds := []tokenize.Boundary{{Tokens: 1024, Hash: 1}, {Tokens: 2048, Hash: 2}}
	keys := []string{"a:1", "b:1", "c:1"}
	for _, k := range keys {
		routes.Learn("m", bounds, k)
	}
	lt := newTestLoads()
	// Since the claim, a:1 was sent 1,500 new tokens (prompt and output), b:1 7,500 and c:1 13,500.
	for i, k := range keys {
		for j := range 1 + 4*i {
			clock = now.Add(time.Duration(j+1) * time.Second)
			lt.reserve(k, work{prompt: 3000, uncached: 1400, output: 100}, clock.UnixNano()).release(clock.UnixNano(), false)
		}
	}
	for _, capacity := range []float64{0, 8192} {
		q := &query{req: &tokenize.Request{Model: "m", PromptTokens: 2200, Boundaries: bounds}, bounds: bounds, now: clock.UnixNano()}
		cands := make([]selection.Candidate, len(keys))
		for i := range cands {
			cands[i].KVCapacity = capacity
		}
		cacheSignal{routes: routes, loads: lt}.fill(q, keys, cands)
		want := []int{2048, 2048, 2048} // the route table's claim
		if capacity > 0 {
			// 8,192 - 2,048 beside the claim: b:1's 7,500 took 1,356 of its end (688 left, in whole
			// blocks), c:1's 13,500 all of it.
			want[1], want[2] = 688, 0
		}
		for i := range keys {
			if cands[i].CachedTokens != want[i] {
				t.Errorf("capacity %.0f: credited %d cached tokens on %s, want %d", capacity, cands[i].CachedTokens, keys[i], want[i])
			}
		}
		for i, k := range keys {
			wantEvicted := int64(0)
			if i == 2 && capacity > 0 {
				wantEvicted = 1
			}
			if got := lt.lookup(k).cacheFigures().Evicted; got != wantEvicted {
				t.Errorf("capacity %.0f: %d claims counted evicted on %s, want %d", capacity, got, k, wantEvicted)
			}
		}
		if q.cut[1] != 0 || q.cut[2] != 0 {
			t.Errorf("capacity %.0f: an evicted claim recorded as cut by the horizon (%v): a report confirming it would start a horizon", capacity, q.cut)
		}
	}
}

// TestAllocatedSince: what this proxy sent an upstream after a time, remembered for the last allocRing
// requests (beyond them a lower bound).
func TestAllocatedSince(t *testing.T) {
	lt := newTestLoads()
	t0 := time.Unix(1_700_000_000, 0).UnixNano()
	for i := range 5 {
		at := t0 + int64(i)*int64(time.Second)
		lt.reserve("a:1", work{prompt: 1000, uncached: 100 * (i + 1), output: 10}, at).release(at, false)
	}
	l := lt.lookup("a:1")
	for _, tt := range []struct {
		at   int64
		want int64
	}{
		{t0 - 1, 1550},
		{t0, 1440},
		{t0 + int64(2*time.Second), 920},
		{t0 + int64(2*time.Second) + 1, 920},
		{t0 + int64(10*time.Second), 0},
	} {
		if got := l.allocatedSince(tt.at); got != tt.want {
			t.Errorf("allocatedSince(t0%+v) = %d, want %d", time.Duration(tt.at-t0), got, tt.want)
		}
	}
	for i := range allocRing + 10 {
		at := t0 + int64(10+i)*int64(time.Second)
		lt.reserve("a:1", work{prompt: 1, uncached: 1}, at).release(at, false)
	}
	if got := l.allocatedSince(t0 - 1); got < allocRing-1 || got > 1550+allocRing+10 {
		t.Errorf("allocatedSince(long ago) = %d, want a lower bound of at least the %d remembered", got, allocRing-1)
	}
}

// TestEvictedSinceCountsFromRelease: a prefix's blocks cannot be evicted while the request that sent it
// runs, so what this proxy sent the upstream meanwhile counts against the claim only while it still
// holds blocks (those requests running still); what it sent after the request ended (about as long after
// as its requests there take) counts in full.
func TestEvictedSinceCountsFromRelease(t *testing.T) {
	lt := newTestLoads()
	sec := int64(time.Second)
	t0 := time.Unix(1_700_000_000, 0).UnixNano()
	// The claim's request: sent at t0, ended 4 s later (the upstream's requests there take 4 s).
	lt.reserve("a:1", work{prompt: 2048, uncached: 2048, output: 100}, t0).release(t0+4*sec, true)
	l := lt.lookup("a:1")
	var during []*reservation
	for i := int64(1); i <= 3; i++ { // 9,000 tokens sent while it ran
		during = append(during, lt.reserve("a:1", work{prompt: 3000, uncached: 2900, output: 100}, t0+i*sec))
	}
	lt.reserve("a:1", work{prompt: 1000, uncached: 900, output: 100}, t0+5*sec).release(t0+6*sec, false)
	for _, tt := range []struct {
		name    string
		now     int64
		release bool // the requests sent while it ran have ended
		want    int64
	}{
		{"its request still running", t0 + 3*sec, false, 0},
		{"those sent meanwhile still hold their blocks", t0 + 6*sec, false, 10_000},
		{"those sent meanwhile ended", t0 + 7*sec, true, 1_000},
	} {
		if tt.release {
			for _, r := range during {
				r.release(t0+7*sec, false) // cancels: they teach nothing about how long requests take
			}
		}
		if got := l.evictedSince(t0, tt.now, tokenize.Boundary{}); got != tt.want {
			t.Errorf("%s: evictedSince(claim) = %d, want %d", tt.name, got, tt.want)
		}
	}
	if got := l.allocatedSince(t0); got != 10_000 {
		t.Errorf("allocatedSince(claim) = %d, want 10000", got)
	}
}

// TestEvictedSinceCountsReuse: the backend's queue is least recently used first, so a cached prefix that
// was sent there before the claim's and is reused after it has moved behind the claim: it counts against
// the claim like an allocation of its size, once (its later reuses were last sent after the claim), less
// the first message it shares with the claim (the claim's own blocks); a prefix last sent after the
// claim, or the claim's own prefix, does not count.
func TestEvictedSinceCountsReuse(t *testing.T) {
	lt := newTestLoads()
	sec := int64(time.Second)
	t0 := time.Unix(1_700_000_000, 0).UnixNano()
	system := tokenize.Boundary{Tokens: 500, Hash: 77} // the system prompt every conversation starts with
	hit := func(at, lastSent int64, cached int, head uint64) work {
		return work{prompt: cached + 100, matched: cached, uncached: 100, output: 50, head: head, prediction: prediction{claimAge: at - lastSent}}
	}
	// Group A's prefix, sent at t0-10 s and t0-5 s; conversation B (behind the system prompt) at t0-4 s;
	// the claim: conversation C's history, behind the same system prompt, sent at t0.
	for _, at := range []int64{t0 - 10*sec, t0 - 5*sec} {
		lt.reserve("a:1", work{prompt: 1500, uncached: 1500, output: 50}, at).release(at, true)
	}
	lt.reserve("a:1", work{prompt: 3000, uncached: 3000, output: 50, head: system.Hash}, t0-4*sec).release(t0-4*sec, true)
	lt.reserve("a:1", work{prompt: 1500, uncached: 1500, output: 50, head: system.Hash}, t0).release(t0, true)
	l := lt.lookup("a:1")
	if got := l.evictedSince(t0, t0+sec, system); got != 0 {
		t.Fatalf("evictedSince with nothing sent since = %d", got)
	}
	lt.reserve("a:1", hit(t0+2*sec, t0-5*sec, 1400, 0), t0+2*sec).release(t0+2*sec, true)           // A reused: moves past C
	lt.reserve("a:1", hit(t0+3*sec, t0+2*sec, 1400, 0), t0+3*sec).release(t0+3*sec, true)           // A again: already behind
	lt.reserve("a:1", hit(t0+4*sec, t0, 1400, system.Hash), t0+4*sec).release(t0+4*sec, true)       // C itself (a shorter part)
	lt.reserve("a:1", hit(t0+5*sec, t0-4*sec, 3000, system.Hash), t0+5*sec).release(t0+5*sec, true) // B: its history past the system prompt
	lt.reserve("a:1", work{prompt: 800, uncached: 800, output: 50}, t0+6*sec).release(t0+6*sec, true)
	got := l.evictedSince(t0, t0+7*sec, system)
	want := int64(4*150 + 850 + 1400 + 2500) // four hits' new tokens, one miss, A's prefix once, B's history past the system prompt
	if got != want {
		t.Errorf("evictedSince(claim) = %d, want %d: allocations plus the prefixes reused since, once each, without the shared system prompt", got, want)
	}
	if got, want := l.evictedSince(t0, t0+7*sec, tokenize.Boundary{}), want+500; got != want {
		t.Errorf("evictedSince(claim without a first message) = %d, want %d: B's whole prefix", got, want)
	}
	if got := l.allocatedSince(t0); got != 4*150+850 {
		t.Errorf("allocatedSince(claim) = %d, want %d: reuse is not an allocation", got, 4*150+850)
	}
}

// TestReusedHistoryEvictsClaim: two agents behind one system prompt take turns on an upstream whose cache
// holds about one history. The other agent's turn since this one's, a predicted hit on its own history
// (few new tokens), moved that history behind this one's in the backend's LRU queue: the decision credits
// only the part of this one's history the cache still holds beside it.
func TestReusedHistoryEvictsClaim(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	clock := now
	routes := affinity.New(affinity.Config{Now: func() time.Time { return clock }})
	system := tokenize.Boundary{Tokens: 1024, Hash: 1}
	mine := []tokenize.Boundary{system, {Tokens: 4096, Hash: 2}}
	other := []tokenize.Boundary{system, {Tokens: 6024, Hash: 3}}
	lt := newTestLoads()
	send := func(bounds []tokenize.Boundary, w work) {
		routes.Learn("m", bounds, "a:1")
		lt.reserve("a:1", w, clock.UnixNano()).release(clock.UnixNano(), true)
	}
	// The other agent's turn, then this one's, then the other's next turn: a hit on its history.
	send(other, work{prompt: 6024, uncached: 6024, output: 100, head: system.Hash})
	clock = now.Add(time.Second)
	send(mine, work{prompt: 4096, uncached: 3072, matched: 1024, output: 100, head: system.Hash, prediction: prediction{claimAge: int64(time.Second)}})
	clock = now.Add(2 * time.Second)
	send(other, work{prompt: 6124, uncached: 100, matched: 6024, output: 100, head: system.Hash, prediction: prediction{claimAge: 2 * int64(time.Second)}})
	clock = now.Add(3 * time.Second)
	req := &tokenize.Request{Model: "m", PromptTokens: 4200, Boundaries: mine, Messages: []tokenize.Message{{Tokens: 1024, End: 1024}, {Tokens: 3072, End: 4096}, {Tokens: 104, End: 4200}}}
	q := &query{req: req, bounds: mine, now: clock.UnixNano()}
	cands := []selection.Candidate{{KVCapacity: 8192}}
	cacheSignal{routes: routes, loads: lt}.fill(q, []string{"a:1"}, cands)
	// 8,192 - 4,096 beside the claim; since: the other's 200 new tokens and its history past the system
	// prompt (5,000), 1,104 over: what is left is 2,992 tokens in whole blocks of 16.
	if got, want := cands[0].CachedTokens, 2992; got != want {
		t.Errorf("credited %d cached tokens, want %d: the other agent's reused history stands ahead of this one's", got, want)
	}
	if q.head() != system {
		t.Errorf("query head %+v, want the system prompt's boundary %+v", q.head(), system)
	}
}

// TestEvictedSinceConcurrent: decisions read the allocation ring and the requests in flight while
// others reserve and release on the same upstream (run with -race); every allocation is counted once.
func TestEvictedSinceConcurrent(t *testing.T) {
	lt := newTestLoads()
	t0 := time.Unix(1_700_000_000, 0).UnixNano()
	const writers, each = 4, 200
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for i := range each {
				at := t0 + int64(w*each+i)*int64(time.Millisecond)
				lt.reserve("a:1", work{prompt: 100, uncached: 90, output: 10}, at).release(at+int64(time.Millisecond), i%2 == 0)
			}
		}()
		go func() {
			defer wg.Done()
			for i := range each {
				if l := lt.lookup("a:1"); l != nil {
					if got := l.evictedSince(t0, t0+int64(i)*int64(time.Second), tokenize.Boundary{}); got < 0 {
						t.Errorf("evictedSince = %d", got)
					}
				}
			}
		}()
	}
	wg.Wait()
	l := lt.lookup("a:1")
	if got, want := l.allocatedSince(t0-1), int64((allocRing-1)*100); got != want { // beyond the ring: a lower bound
		t.Errorf("allocatedSince(before all) = %d, want %d: what the ring remembers after its oldest", got, want)
	}
	if l.allocTotal != writers*each*100 {
		t.Errorf("allocated %d tokens in all, want %d", l.allocTotal, writers*each*100)
	}
}
