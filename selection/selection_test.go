package selection

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// first always breaks exact ties towards the earliest candidate seen, so tables are deterministic.
func first(int) int { return 1 }

func cands(loads ...int64) []Candidate {
	out := make([]Candidate, len(loads))
	for i, l := range loads {
		out[i] = Candidate{Key: fmt.Sprintf("10.0.0.%d:8000", i+1), InflightTokens: l}
	}
	return out
}

func withCached(cs []Candidate, cached ...int) []Candidate {
	for i, c := range cached {
		cs[i].CachedTokens = c
	}
	return cs
}

func TestChoose(t *testing.T) {
	// An explicit configuration, so the guard thresholds below do not move with the defaults.
	cfg := Config{Mode: Combined, GuardFactor: 2, GuardSlack: 4096, TieTolerance: 0.05, PrefillWeight: 1}
	leastTokens := cfg
	leastTokens.Mode = LeastTokens
	prefix := cfg
	prefix.Mode = Prefix

	tests := []struct {
		name       string
		cands      []Candidate
		req        Request
		cfg        Config
		want       int
		wantReason Reason
	}{
		{
			name:  "no candidates",
			cfg:   cfg,
			want:  -1,
			cands: nil, wantReason: ReasonNone,
		},
		{
			name:  "least in-flight tokens wins, not least requests",
			cands: []Candidate{{Key: "a", InflightTokens: 4000, InflightRequests: 1}, {Key: "b", InflightTokens: 100, InflightRequests: 9}},
			req:   Request{PromptTokens: 10}, cfg: leastTokens,
			want: 1, wantReason: ReasonLoad,
		},
		{
			name:  "least_tokens ignores cache predictions",
			cands: withCached(cands(500, 0), 2000, 0),
			req:   Request{PromptTokens: 2100}, cfg: leastTokens,
			want: 1, wantReason: ReasonLoad,
		},
		{
			name:  "combined: cached prefix outweighs moderate load",
			cands: withCached(cands(1500, 0), 2000, 0),
			req:   Request{PromptTokens: 2100}, cfg: cfg,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			name:  "combined: a heavier prefill weight lets the cache outweigh more load",
			cands: withCached(cands(3000, 0), 1024, 0),
			req:   Request{PromptTokens: 2100}, cfg: Config{Mode: Combined, GuardFactor: 2, GuardSlack: 4096, PrefillWeight: 4},
			want: 0, wantReason: ReasonAffinity,
		},
		{
			name:  "combined: load outweighs a small cached prefix",
			cands: withCached(cands(3000, 0), 256, 0),
			req:   Request{PromptTokens: 2100}, cfg: cfg,
			want: 1, wantReason: ReasonLoad,
		},
		{
			name:  "combined: the longer match wins at equal load",
			cands: withCached(cands(0, 0, 0), 512, 1024, 0),
			req:   Request{PromptTokens: 2000}, cfg: cfg,
			want: 1, wantReason: ReasonAffinity,
		},
		{
			name:  "prefix: longest match wins even against load",
			cands: withCached(cands(3000, 0, 0), 256, 0, 0),
			req:   Request{PromptTokens: 2100}, cfg: prefix,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			// median 0, threshold 2*0+4096: 4096 keeps the claim...
			name:  "guard: at the threshold the claim holds",
			cands: withCached(cands(4096, 0, 0), 2000, 0, 0),
			req:   Request{PromptTokens: 2100}, cfg: prefix,
			want: 0, wantReason: ReasonAffinity,
		},
		{
			// ...4097 loses it, and the reason says why.
			name:  "guard: above the threshold the claim is lost",
			cands: withCached(cands(4097, 0, 0), 2000, 0, 0),
			req:   Request{PromptTokens: 2100}, cfg: prefix,
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "guard: combined mode diverts too",
			cands: withCached(cands(20000, 100, 100), 2000, 0, 0),
			req:   Request{PromptTokens: 2100}, cfg: cfg,
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "guard: the next-best claim is used when the best is a hot spot",
			cands: withCached(cands(20000, 100, 100), 2000, 0, 1000),
			req:   Request{PromptTokens: 2100}, cfg: prefix,
			want: 2, wantReason: ReasonAffinity,
		},
		{
			// Requests behind a cached prefix weigh little in tokens but still fill the decode batch.
			name:  "guard: too many requests lose the claim even when tokens are low",
			cands: []Candidate{{Key: "a", InflightTokens: 1000, InflightRequests: 15, CachedTokens: 2000}, {Key: "b", InflightTokens: 1200, InflightRequests: 3}, {Key: "c", InflightTokens: 1200, InflightRequests: 3}},
			req:   Request{PromptTokens: 2100}, cfg: Config{Mode: Prefix, GuardFactor: 2, GuardSlack: 4096, GuardRequestSlack: 8},
			want: 1, wantReason: ReasonGuard,
		},
		{
			name:  "guard: requests at the threshold keep the claim",
			cands: []Candidate{{Key: "a", InflightTokens: 1000, InflightRequests: 14, CachedTokens: 2000}, {Key: "b", InflightTokens: 1200, InflightRequests: 3}, {Key: "c", InflightTokens: 1200, InflightRequests: 3}},
			req:   Request{PromptTokens: 2100}, cfg: Config{Mode: Prefix, GuardFactor: 2, GuardSlack: 4096, GuardRequestSlack: 8},
			want: 0, wantReason: ReasonAffinity,
		},
		{
			name:  "guard off keeps the claim",
			cands: withCached(cands(20000, 100, 100), 2000, 0, 0),
			req:   Request{PromptTokens: 2100}, cfg: Config{Mode: Prefix},
			want: 0, wantReason: ReasonAffinity,
		},
		{
			name:  "pinned conversation stays, even where the cache claims elsewhere",
			cands: []Candidate{{Key: "a", CachedTokens: 1000}, {Key: "b", Pinned: true}},
			req:   Request{PromptTokens: 1100}, cfg: cfg,
			want: 1, wantReason: ReasonConversation,
		},
		{
			name:  "a pin holds while another upstream is the hot spot",
			cands: []Candidate{{Key: "a", InflightTokens: 10, Pinned: true, InflightRequests: 5}, {Key: "b", InflightTokens: 10}, {Key: "c", InflightTokens: 50000}},
			req:   Request{PromptTokens: 100}, cfg: Config{Mode: Combined, GuardFactor: 2, GuardSlack: 0, PrefillWeight: 1},
			want: 0, wantReason: ReasonConversation,
		},
		{
			name:  "a pinned hot spot loses its pin, over the threshold",
			cands: []Candidate{{Key: "a", InflightTokens: 50000, Pinned: true}, {Key: "b", InflightTokens: 10}, {Key: "c", InflightTokens: 10}},
			req:   Request{PromptTokens: 100}, cfg: Config{Mode: Combined, GuardFactor: 2, GuardSlack: 0, PrefillWeight: 1},
			want: 1, wantReason: ReasonLoad,
		},
		{
			name:  "capacity normalises load across unequal backends",
			cands: []Candidate{{Key: "big", InflightTokens: 3000, Capacity: 4}, {Key: "small", InflightTokens: 1000, Capacity: 1}},
			req:   Request{PromptTokens: 10}, cfg: leastTokens,
			want: 0, wantReason: ReasonLoad,
		},
		{
			name:  "extra load from scraped metrics counts",
			cands: []Candidate{{Key: "a", ExtraLoad: 8000}, {Key: "b", InflightTokens: 1000}},
			req:   Request{PromptTokens: 10}, cfg: leastTokens,
			want: 1, wantReason: ReasonLoad,
		},
		{
			name:  "ties on tokens go to fewer requests",
			cands: []Candidate{{Key: "a", InflightRequests: 3}, {Key: "b", InflightRequests: 1}, {Key: "c", InflightRequests: 2}},
			req:   Request{PromptTokens: 10}, cfg: leastTokens,
			want: 1, wantReason: ReasonLoad,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			scratch := make([]float64, 0, 3*len(tt.cands))
			d := Choose(tt.cands, tt.req, tt.cfg, first, scratch)
			if d.Index != tt.want || d.Reason != tt.wantReason {
				t.Errorf("Choose() = %d (%s), want %d (%s)", d.Index, d.Reason, tt.want, tt.wantReason)
			}
			if d.Index >= 0 && d.MatchedTokens != tt.cands[d.Index].CachedTokens {
				t.Errorf("MatchedTokens = %d, want %d", d.MatchedTokens, tt.cands[d.Index].CachedTokens)
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
	loaded := cands(5000, 5000, 5000)
	loaded[1].InflightTokens = 0
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
	cs := withCached(cands(100, 0, 2000, 50), 0, 512, 1024, 0)
	scratch := make([]float64, 0, 3*len(cs))
	allocs := testing.AllocsPerRun(100, func() {
		Choose(cs, Request{PromptTokens: 2000, PrefixHash: 7}, DefaultConfig(), first, scratch)
	})
	if allocs != 0 {
		t.Errorf("Choose allocates %v times per call, want 0", allocs)
	}
}

func BenchmarkChoose(b *testing.B) {
	cs := withCached(cands(100, 0, 2000, 50, 300, 0, 0, 10), 0, 512, 1024, 0, 0, 0, 64, 0)
	scratch := make([]float64, 0, 3*len(cs))
	b.ReportAllocs()
	for b.Loop() {
		Choose(cs, Request{PromptTokens: 2000, PrefixHash: 7}, DefaultConfig(), first, scratch)
	}
}
