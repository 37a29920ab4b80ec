package selection

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// first always breaks exact ties towards the earliest candidate seen, so tables are deterministic.
func first(int) int { return 1 }

// svc is a backend with 10k prefill tokens/s, 10 ms overhead, 8 slots and 1 s requests: round numbers
// for the tables below.
var svc = Service{Overhead: 0.010, PrefillSecondsPerToken: 1e-4, TokenSeconds: 0.02, Slots: 8, MeanDuration: 1}

// cands returns candidates with the given seconds of queued prefill.
func cands(queued ...float64) []Candidate {
	out := make([]Candidate, len(queued))
	for i, q := range queued {
		out[i] = Candidate{Key: fmt.Sprintf("10.0.0.%d:8000", i+1), Service: svc, Queued: q}
	}
	return out
}

func withCached(cs []Candidate, cached ...int) []Candidate {
	for i, c := range cached {
		cs[i].CachedTokens = c
	}
	return cs
}

func withRequests(cs []Candidate, requests ...float64) []Candidate {
	for i, r := range requests {
		cs[i].Requests = r
	}
	return cs
}

// withKV gives candidate i a KV cache of capacity tokens with used[i] of them wanted.
func withKV(cs []Candidate, capacity float64, used ...float64) []Candidate {
	for i, u := range used {
		cs[i].KVCapacity, cs[i].KVUsed = capacity, u
	}
	return cs
}

// agentKV is an agent's 20k-token history cached on the first of two upstreams with 32k-token caches
// and 5 s requests, 24k tokens used there and none on the second; free says whether the history's
// blocks are free there (Candidate.CachedFree).
func agentKV(free bool) []Candidate {
	cs := withKV(withCached(cands(0, 0), 20000, 0), 32000, 24000, 0)
	for i := range cs {
		cs[i].Service.MeanDuration = 5
	}
	cs[0].CachedFree = free
	return cs
}

func TestChoose(t *testing.T) {
	cfg := DefaultConfig()
	leastTokens := cfg
	leastTokens.Mode = LeastTokens
	prefix := cfg
	prefix.Mode = Prefix
	slow := cands(0, 0)
	slow[0].Service.PrefillSecondsPerToken *= 3 // 3x slower prefill

	tests := []struct {
		name       string
		cands      []Candidate
		req        Request
		cfg        Config
		want       int
		wantReason Reason
	}{
		{name: "no candidates", cfg: cfg, want: -1, wantReason: ReasonNone},
		{
			// 2000 tokens to prefill: 0.2 s on either; 0.15 s queued on the first.
			name:  "least queued prefill wins",
			cands: cands(0.15, 0.01), req: Request{PromptTokens: 2000}, cfg: leastTokens,
			want: 1, wantReason: ReasonLoad,
		},
		{
			name:  "least_tokens ignores cache predictions",
			cands: withCached(cands(0.05, 0), 2000, 0), req: Request{PromptTokens: 2100}, cfg: leastTokens,
			want: 1, wantReason: ReasonLoad,
		},
		{
			// cached: 0.1 s queue + 0.01 s prefill; elsewhere 0.21 s of prefill.
			name:  "combined: a cached prefix outweighs a shorter queue",
			cands: withCached(cands(0.1, 0), 2000, 0), req: Request{PromptTokens: 2100}, cfg: cfg,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			// cached: 0.3 s queue, more than the 0.2 s the cache saves: the prefix is replicated.
			name:  "combined: a queue longer than the saving moves the request (replication)",
			cands: withCached(cands(0.3, 0), 2000, 0), req: Request{PromptTokens: 2100}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
		{
			// The same queue, for a prefix one request in ten carries (0.2 of one upstream's share of
			// two): one home can serve it, and 0.32 s there is within twice the 0.22 s elsewhere.
			name:  "combined: a prefix one upstream can serve stays home within the pin's margin",
			cands: withCached(cands(0.3, 0), 2000, 0), req: Request{PromptTokens: 2100, Share: 0.1}, cfg: cfg,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			name:  "combined: a prefix more than one upstream's share of requests is replicated",
			cands: withCached(cands(0.3, 0), 2000, 0), req: Request{PromptTokens: 2100, Share: 0.6}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "combined: a prefix that would fill more than half of one upstream goes by the cost",
			cands: withCached(cands(0.3, 0), 2000, 0), req: Request{PromptTokens: 2100, Share: 0.3}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "combined: a request of such a prefix that brings more work than it finds cached goes by the cost",
			cands: withCached(cands(0.3, 0), 1000, 0), req: Request{PromptTokens: 2100, Share: 0.1}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "combined: a prefix one upstream can serve moves past the margin",
			cands: withCached(cands(0.6, 0), 2000, 0), req: Request{PromptTokens: 2100, Share: 0.1}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "combined: the longer match wins at equal queue",
			cands: withCached(cands(0, 0), 512, 1024), req: Request{PromptTokens: 2000}, cfg: cfg,
			want: 1, wantReason: ReasonAffinity,
		},
		{
			// 10 requests on 8 slots of 1 s: (10-8+1)/8 s = 0.375 s of slot wait, more than the saving.
			name:  "full slots are a wait too",
			cands: withRequests(withCached(cands(0, 0), 2000, 0), 10, 2), req: Request{PromptTokens: 2100}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "a few requests on many slots cost little wait",
			cands: withRequests(withCached(cands(0, 0), 2000, 0), 2, 0), req: Request{PromptTokens: 2100}, cfg: cfg,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			// 8 of 8 slots taken with this one: it starts at once, and the cache saves 0.2 s.
			name:  "the last free slot costs no wait",
			cands: withRequests(withCached(cands(0, 0), 2000, 0), 7, 0), req: Request{PromptTokens: 2100}, cfg: cfg,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			// One request ahead of it for a slot: one interval (1 s / 8 slots) is less than the 0.2 s saved.
			name:  "one request ahead for a slot waits one interval, less than the cache saves",
			cands: withRequests(withCached(cands(0, 0), 2000, 0), 8, 0), req: Request{PromptTokens: 2100}, cfg: cfg,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			// Two ahead: 0.25 s, more than the cache saves. The wait grows by one interval a request, not
			// quadratically: 18 requests on 8 slots wait 11 intervals.
			name:  "two requests ahead for a slot wait longer than the cache saves",
			cands: withRequests(withCached(cands(0, 0), 2000, 0), 9, 0), req: Request{PromptTokens: 2100}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "prefix: the longest match wins while its queue is below a full prefill",
			cands: withCached(cands(0.3, 0), 2000, 0), req: Request{PromptTokens: 2100}, cfg: prefix,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			name:  "prefix: a queue beyond a full prefill still moves it",
			cands: withCached(cands(0.6, 0), 2000, 0), req: Request{PromptTokens: 2100}, cfg: prefix,
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "pinned conversation stays while nothing is faster",
			cands: func() []Candidate { c := withCached(cands(0, 0), 1000, 1000); c[1].Pinned = true; return c }(),
			req:   Request{PromptTokens: 1200}, cfg: cfg,
			want: 1, wantReason: ReasonConversation,
		},
		{
			// Home: 0.2 s queued + 0.03 s; elsewhere: 0.13 s of full prefill. Faster, but not twice as fast.
			name:  "pinned conversation stays when another is only somewhat faster",
			cands: func() []Candidate { c := withCached(cands(0, 0.2), 0, 1000); c[1].Pinned = true; return c }(),
			req:   Request{PromptTokens: 1200}, cfg: cfg,
			want: 1, wantReason: ReasonConversation,
		},
		{
			name:  "pinned conversation moves when re-prefilling elsewhere is faster",
			cands: func() []Candidate { c := withCached(cands(0, 2), 0, 1000); c[1].Pinned = true; return c }(),
			req:   Request{PromptTokens: 1200}, cfg: cfg,
			want: 0, wantReason: ReasonGuard,
		},
		{
			name:  "a slower backend costs more for the same prompt",
			cands: slow, req: Request{PromptTokens: 2000}, cfg: cfg,
			want: 1, wantReason: ReasonLoad,
		},
		{
			// 100 cached of 2100 saves 10 ms at 10k tokens/s, and 12.5 ms queued there cost as much: within
			// the tolerance, the claim wins over the fewer requests per slot of the other.
			name: "near-equal costs go to the longer cache claim before balance",
			cands: func() []Candidate {
				c := withRequests(withCached(cands(0.0125, 0), 100, 0), 3, 1)
				c[0].Service.Slots, c[1].Service.Slots = 64, 64
				return c
			}(),
			req: Request{PromptTokens: 2100}, cfg: cfg,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			name:  "ties go to fewer requests per slot",
			cands: withRequests(cands(0, 0, 0), 5, 2, 4), req: Request{PromptTokens: 100, PrefixHash: 9}, cfg: cfg,
			want: 1, wantReason: ReasonLoad,
		},
		{
			// 8 slots of 1 s. The hit: 11 in flight, 2.75 s of slot wait, 0.01 s of prefill that delays the 3
			// waiting. The miss: 10 in flight, 2.27 s of wait, 0.21 s of prefill: a sooner first token (2.49 s
			// against 2.77 s), but 0.21 s more for each of the 2 waiting there.
			name:  "a miss's prefill delays the requests waiting for the batch's slots",
			cands: withRequests(withCached(cands(0, 0), 2000, 0), 11, 10), req: Request{PromptTokens: 2100}, cfg: cfg,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			// 64 slots: 20 decoding leave room, so their stall delays no first token.
			name: "requests decoding on free slots do not make a miss dearer",
			cands: func() []Candidate {
				c := withRequests(withCached(cands(0.3, 0), 2000, 0), 20, 20)
				c[0].Service.Slots, c[1].Service.Slots = 64, 64
				return c
			}(),
			req: Request{PromptTokens: 2100}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
		{
			// 500 tokens free on the first: 1100 to prefill and 1000 to generate do not fit; 1 s requests
			// free its 31.5k tokens in use at 31.5k/s, so ~50 ms of wait; the second has room, 10 ms queued.
			name:  "a request waits for KV cache space in tokens",
			cands: withKV(cands(0, 0.01), 32000, 31500, 1000),
			req:   Request{PromptTokens: 1100, OutputTokens: 1000}, cfg: leastTokens,
			want: 1, wantReason: ReasonLoad,
		},
		{
			name:  "many short requests fit where few long ones would not",
			cands: withKV(cands(0, 0.004), 32000, 31500, 1000),
			req:   Request{PromptTokens: 20, OutputTokens: 64}, cfg: leastTokens,
			want: 0, wantReason: ReasonLoad,
		},
		{
			// Requests waiting for space (demand beyond the capacity) hold up even a short one behind them
			// (FCFS admission): 8,084 tokens must free first, at the pace the 32,000 held (not the 40,000
			// wanted) free: 253 ms while requests last 1 s; the second has room behind 230 ms of prefill.
			name:  "a short request waits behind prompts waiting for cache space",
			cands: withKV(cands(0, 0.23), 32000, 40000, 31000),
			req:   Request{PromptTokens: 20, OutputTokens: 64}, cfg: leastTokens,
			want: 1, wantReason: ReasonLoad,
		},
		{
			// A 20k-token history cached on the first, with 8k of 32k free there; requests last 5 s. In use
			// there (a request running holds it), only the 1,500 tokens to prefill and generate take space:
			// they fit, 0.11 s to the first token against 2.1 s of prefill on the second.
			name:  "a cached prefix in use takes no free cache space",
			cands: agentKV(false), req: Request{PromptTokens: 21000, OutputTokens: 500}, cfg: cfg,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			// Free there (the turn that sent it has ended), reusing it takes it out of the free space: the
			// whole 21,500 tokens must fit, 13,500 more than is free, 2.8 s for the 24k held to free that
			// much, longer than prefilling everything on the empty second.
			name:  "a cached prefix whose blocks are free needs room for the whole prompt",
			cands: agentKV(true), req: Request{PromptTokens: 21000, OutputTokens: 500}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "on idle upstreams the same queue is not worth the hit",
			cands: withCached(cands(0.55, 0), 4500, 0), req: Request{PromptTokens: 5000}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := Choose(tt.cands, tt.req, tt.cfg, first, nil)
			if d.Index != tt.want || d.Reason != tt.wantReason {
				t.Errorf("Choose() = %d (%s), want %d (%s)", d.Index, d.Reason, tt.want, tt.wantReason)
			}
		})
	}
}

// TestChooseSharesEqualBackends checks that exact ties are spread, not always sent to the first candidate.
func TestChooseSharesEqualBackends(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	counts := make([]int, 4)
	for range 4000 {
		d := Choose(cands(0, 0, 0, 0), Request{PromptTokens: 10}, DefaultConfig(), rng.IntN, nil)
		counts[d.Index]++
	}
	for i, n := range counts {
		if n < 800 || n > 1200 {
			t.Errorf("candidate %d chosen %d of 4000 times, want about 1000 (%v)", i, n, counts)
		}
	}
}

// TestChooseUnseenPrefixes checks that prefixes no candidate has cached spread evenly over equal backends,
// and that the choice depends only on the prefix and the keys (so independent proxies agree).
func TestChooseUnseenPrefixes(t *testing.T) {
	counts := make([]int, 4)
	for p := range uint64(4000) {
		req := Request{PromptTokens: 500, PrefixHash: p*0x9E3779B97F4A7C15 + 1}
		d := Choose(cands(0, 0, 0, 0), req, DefaultConfig(), func(int) int { panic("rnd used with a prefix hash") }, nil)
		again := Choose(cands(0, 0, 0, 0), req, DefaultConfig(), first, nil)
		if d.Index != again.Index {
			t.Fatalf("prefix %d went to %d, then %d", p, d.Index, again.Index)
		}
		counts[d.Index]++
	}
	for i, n := range counts {
		if n < 850 || n > 1150 {
			t.Errorf("candidate %d got %d of 4000 prefixes, want about 1000 (%v)", i, n, counts)
		}
	}
	// The same prefix stays put when candidates are listed in another order.
	req := Request{PromptTokens: 500, PrefixHash: 42}
	cs := cands(0, 0, 0)
	d := Choose(cs, req, DefaultConfig(), first, nil)
	reversed := []Candidate{cs[2], cs[1], cs[0]}
	d2 := Choose(reversed, req, DefaultConfig(), first, nil)
	if cs[d.Index].Key != reversed[d2.Index].Key {
		t.Errorf("prefix went to %s, then to %s when reordered", cs[d.Index].Key, reversed[d2.Index].Key)
	}
	// A clearly less loaded candidate still wins over the hash.
	loaded := cands(0.5, 0.5, 0.5)
	loaded[1].Queued = 0
	if d := Choose(loaded, req, DefaultConfig(), first, nil); d.Index != 1 {
		t.Errorf("Choose() = %d, want the idle candidate 1", d.Index)
	}
}

func TestModeNames(t *testing.T) {
	for _, m := range []Mode{Combined, LeastTokens, Prefix} {
		got, ok := ParseMode(m.String())
		if !ok || got != m {
			t.Errorf("ParseMode(%q) = %v, %v", m.String(), got, ok)
		}
	}
	if _, ok := ParseMode("fastest"); ok {
		t.Error("ParseMode accepted an unknown mode")
	}
}

func TestChooseDoesNotAllocate(t *testing.T) {
	cs := withCached(cands(0.1, 0, 0.2, 0.05), 0, 512, 1024, 0)
	scratch := make([]float64, 0, len(cs))
	allocs := testing.AllocsPerRun(100, func() {
		Choose(cs, Request{PromptTokens: 2000, PrefixHash: 7}, DefaultConfig(), first, scratch)
	})
	if allocs != 0 {
		t.Errorf("Choose allocates %v times per call, want 0", allocs)
	}
}

func BenchmarkChoose(b *testing.B) {
	cs := withCached(cands(0.1, 0, 0.2, 0.05, 0.3, 0, 0, 0.01), 0, 512, 1024, 0, 0, 0, 64, 0)
	scratch := make([]float64, 0, len(cs))
	b.ReportAllocs()
	for b.Loop() {
		Choose(cs, Request{PromptTokens: 2000, PrefixHash: 7}, DefaultConfig(), first, scratch)
	}
}

// TestTieToleranceInTheBackendsTime checks that what counts as a tie scales with the backends' own
// time: the same fleet k times faster or slower makes the same decisions. Two candidates, one with a
// cache claim of 100 tokens (preferred among equals) and more queued ahead of it; its cost is 5 ms x k
// above the other's (within the noise of a 30 ms x k decode step: a tie, the claim wins), or 15 ms x k
// (beyond it: the cheaper one). A fixed 2 ms made the first no tie at k = 1 and the second a tie at
// k = 1/30.
func TestTieToleranceInTheBackendsTime(t *testing.T) {
	for _, k := range []float64{1, 0.2, 1.0 / 30, 3} {
		s := Service{Overhead: 0.010 * k, PrefillSecondsPerToken: 1e-4 * k, TokenSeconds: 0.030 * k, Slots: 64, MeanDuration: k}
		for _, tt := range []struct {
			extra float64 // seconds of queue ahead of the claim, over what the claim saves (10 ms x k)
			want  int
		}{{0.005, 0}, {0.015, 1}} {
			cs := []Candidate{
				{Key: "10.0.0.1:8000", Service: s, CachedTokens: 100, Queued: (0.010 + tt.extra) * k},
				{Key: "10.0.0.2:8000", Service: s},
			}
			dec := Choose(cs, Request{PromptTokens: 1000, PrefixHash: 7}, DefaultConfig(), first, nil)
			if dec.Index != tt.want {
				t.Errorf("time x%.3g, claim %.0f ms x k dearer: chose %d, want %d", k, 1000*tt.extra, dec.Index, tt.want)
			}
		}
	}
}

// TestKVTokensInThePromptCountsTokens: a request's KV demand adds its output, counted in the upstream's
// tokens, at the upstream's TokenScale: an upstream that counts 2 tokens for each of the prompt counts'
// takes 100 output tokens as 50 of the cache in those terms, and waits for space accordingly.
func TestKVTokensInThePromptCountsTokens(t *testing.T) {
	req := Request{PromptTokens: 1000, OutputTokens: 100}
	for _, tc := range []struct {
		scale  float64
		cached int
		free   bool
		held   int // Candidate.HeldTokens
		want   int
	}{
		{0, 0, false, 0, 1100},
		{1, 400, false, 0, 700},
		{2, 400, false, 0, 650},
		{2, 400, true, 0, 1050},
		{0.5, 0, false, 0, 1200},
		// A free history behind a system prompt others hold: the held blocks take no space.
		{1, 400, true, 160, 940},
		{1, 400, false, 160, 700}, // held only matters where the prefix is free
		{1, 400, true, 900, 700},  // never more than the cached prefix
	} {
		c := Candidate{Service: svc, TokenScale: tc.scale, CachedFree: tc.free, HeldTokens: tc.held}
		if got := kvTokens(&c, req, tc.cached); got != tc.want {
			t.Errorf("scale %v, cached %d, free %v, held %d: KV tokens %d, want %d", tc.scale, tc.cached, tc.free, tc.held, got, tc.want)
		}
	}
	// In a 1,100-token cache with nothing free, the wait is for all of it at 1x, for 1,050 of it at 2x.
	full := Candidate{Service: svc, KVCapacity: 1100, KVUsed: 1100}
	one := Wait(&full, float64(kvTokens(&full, req, 0)), req.Sequences)
	full.TokenScale = 2
	two := Wait(&full, float64(kvTokens(&full, req, 0)), req.Sequences)
	if !(two < one) {
		t.Errorf("wait for cache space at scale 2 = %v, at 1 = %v: want less", two, one)
	}
}

// TestSequencesTakeSlotsAndCache: a request of n sequences takes n slots and the KV cache of n outputs.
// On an 8-slot upstream running 4, one sequence (or an unset count) starts at once and eight wait for 4
// slots to free (a quarter of the mean duration each); in a cache with 1,000 tokens free, one 200-token
// output fits and eight do not.
func TestSequencesTakeSlotsAndCache(t *testing.T) {
	svc := Service{Overhead: 0.01, PrefillSecondsPerToken: 1e-4, TokenSeconds: 0.02, MeanDuration: 2, Slots: 8}
	busy := Candidate{Service: svc, Requests: 4}
	for _, tt := range []struct {
		sequences int
		wait      float64
	}{{0, 0}, {1, 0}, {4, 0}, {5, 0.25}, {8, 1}} {
		_, wait, _ := Cost(&busy, Request{PromptTokens: 500, OutputTokens: 200, Sequences: tt.sequences}, 0)
		if math.Abs(wait-tt.wait) > 1e-9 {
			t.Errorf("%d sequences on 8 slots running 4: wait %v s, want %v", tt.sequences, wait, tt.wait)
		}
	}
	c := Candidate{Service: svc, KVCapacity: 10_000, KVUsed: 9_000}
	one := Wait(&c, float64(kvTokens(&c, Request{PromptTokens: 100, OutputTokens: 200, Sequences: 1}, 0)), 1)
	eight := Wait(&c, float64(kvTokens(&c, Request{PromptTokens: 100, OutputTokens: 200, Sequences: 8}, 0)), 8)
	if one != 0 || eight <= 0 {
		t.Errorf("wait for cache space: %v for one sequence, %v for eight; want none, then some", one, eight)
	}
	if got := kvTokens(&c, Request{PromptTokens: 100, OutputTokens: 200, Sequences: 8}, 0); got != 100+8*200 {
		t.Errorf("KV tokens of 8 sequences: %d, want the prompt once and 8 outputs (1700)", got)
	}
}

// TestSlotFreedFromHolders: the wait for a slot is at least when the slot it needs frees, from what the
// requests holding the slots still have to run. Each holder here runs 0.2 s (a 100-token prefill at
// 0.1 ms a token after 10 ms, 90 output tokens at 2 ms); one interval per request ahead would be
// MeanDuration/slots, 12.5 ms.
func TestSlotFreedFromHolders(t *testing.T) {
	svc := Service{Overhead: 0.01, PrefillSecondsPerToken: 1e-4, TokenSeconds: 0.002, MeanDuration: 0.1, Slots: 8}
	holders := func(ages ...float64) []Hold {
		h := make([]Hold, len(ages))
		for i, a := range ages {
			h[i] = Hold{Age: a, Uncached: 100, Output: 90}
		}
		return h
	}
	for _, tc := range []struct {
		name     string
		requests float64 // in flight there; more than the holders: others' requests too
		slots    float64
		holding  []Hold
		want     float64
	}{
		// A burst filled the 8 slots within 70 ms: the first to free is the oldest, 130 ms from now.
		{"burst", 8, 8, holders(0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01, 0), 0.13},
		// In no order: the oldest 8 of 10 run; the new request is the third to need a slot.
		{"third", 10, 8, holders(0.005, 0.15, 0.01, 0.195, 0.02, 0.12, 0.1, 0.08, 0.06, 0.04), 0.08},
		// Holders past their predicted end free their slots any moment: one interval a request ahead.
		{"overdue", 8, 8, holders(0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5), 0.0125},
		// Another client's request is there too, its age unknown: one interval a request ahead.
		{"others", 9, 8, holders(0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01, 0), 0.025},
		// More slots to free than are running: one interval a request ahead.
		{"beyond", 8, 4, holders(0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01, 0), 0.125},
		// Free slots: no wait.
		{"free", 7, 8, holders(0.06, 0.05, 0.04, 0.03, 0.02, 0.01, 0), 0},
		{"unknown holders", 8, 8, nil, 0.0125},
	} {
		s := svc
		s.Slots = tc.slots
		c := Candidate{Service: s, Requests: tc.requests, Holding: tc.holding}
		if got := Wait(&c, 0, 1); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("%s: wait %v s, want %v", tc.name, got, tc.want)
		}
	}
	// One request runs 0.2 s where it is three times slower: its slot frees three times later.
	c := Candidate{Service: svc.Slower(3), Requests: 8, Holding: holders(0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01, 0)}
	if got, want := Wait(&c, 0, 1), 0.6-0.07; math.Abs(got-want) > 1e-9 {
		t.Errorf("3x slower: wait %v s, want %v", got, want)
	}
}
