package selection

import (
	"math/rand/v2"
	"testing"
)

// TestAvailabilityShare: an upstream at availability 0.3 takes roughly 30% of the requests it would take
// healthy, idle (where every candidate ties) as under load (where a least-loaded choice would otherwise
// make up for the exclusion by sending it more of the requests it still sees).
func TestAvailabilityShare(t *testing.T) {
	const n, requests, availability = 4, 40_000, 0.3
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name     string
		inflight int // requests kept in flight across the fleet: 0 is idle
	}{
		{"idle", 0},
		{"half busy", 16},
		{"saturated", 48},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs := cands(make([]float64, n)...)
			cs[0].Availability = availability
			var running []int // the upstream of each request in flight
			var got [n]int
			for range requests {
				req := Request{PromptTokens: 1000, PrefixHash: rng.Uint64(), AvailabilityHash: rng.Uint64()}
				d := Choose(cs, req, DefaultConfig(), rng.IntN, nil)
				got[d.Index]++
				if tc.inflight == 0 {
					continue
				}
				cs[d.Index].Requests++
				running = append(running, d.Index)
				if len(running) > tc.inflight { // a random request in flight ends
					k := rng.IntN(len(running))
					cs[running[k]].Requests--
					running[k] = running[len(running)-1]
					running = running[:len(running)-1]
				}
			}
			fair := float64(requests) / n
			ratio := float64(got[0]) / fair
			t.Logf("upstream at %.1f took %.2f of its fair share (%v)", availability, ratio, got)
			if ratio < 0.15 || ratio > 0.45 {
				t.Errorf("upstream at availability %.1f took %.2f of its fair share, want about %.1f", availability, ratio, availability)
			}
		})
	}
}

// TestAvailabilityExcludes: an excluded upstream loses even its pinned conversation and its cache; when
// every candidate is excluded, the decision is made as if none were; the same hash gives the same draw.
func TestAvailabilityExcludes(t *testing.T) {
	cs := withCached(cands(0, 0), 4000, 0)
	cs[0].Pinned = true
	cs[0].Availability = 0.001
	req := Request{PromptTokens: 4000, AvailabilityHash: 42}
	if d := Choose(cs, req, DefaultConfig(), first, nil); d.Index != 1 {
		t.Errorf("Choose() = %d, want 1: upstream 0 is at availability 0.001", d.Index)
	}
	cs[1].Availability = 0.001
	if d := Choose(cs, req, DefaultConfig(), first, nil); d.Index != 0 || d.Reason != ReasonConversation {
		t.Errorf("both excluded: Choose() = %+v, want 0 by conversation, as without availability", d)
	}
	cs[0].Availability, cs[1].Availability = 0.5, 1
	want := Choose(cs, req, DefaultConfig(), first, nil).Index
	for range 10 {
		if d := Choose(cs, req, DefaultConfig(), first, nil); d.Index != want {
			t.Fatalf("the same availability hash chose %d, then %d", want, d.Index)
		}
	}
}

// TestHomeBreaksTies: the tenant's home wins among equal costs, and only among equal costs.
func TestHomeBreaksTies(t *testing.T) {
	cs := cands(0, 0, 0)
	cs[2].Home = true
	if d := Choose(cs, Request{PromptTokens: 1000, PrefixHash: 7}, DefaultConfig(), first, nil); d.Index != 2 {
		t.Errorf("Choose() = %d, want the home 2 among equals", d.Index)
	}
	cs[2].Queued = 1 // a second of prefill queued at home
	if d := Choose(cs, Request{PromptTokens: 1000, PrefixHash: 7}, DefaultConfig(), first, nil); d.Index == 2 {
		t.Errorf("Choose() = home 2 with 1 s queued there, want a cheaper one")
	}
}

// TestBlindLoadsBounded: where the decision cannot see an upstream's queue (Blind), the one holding a
// request's prefix takes it only while its requests in flight are within LoadBound of one more than the
// mean; past that it spills to the next. Only blind candidates are bounded, and only for prefixes that
// could pile up (hot ones, or of unknown share).
func TestBlindLoadsBounded(t *testing.T) {
	req := Request{PromptTokens: 4000, PrefixHash: 7}
	blind := func(requests ...float64) []Candidate {
		cs := withCached(withRequests(cands(0, 0, 0, 0), requests...), 3900)
		for i := range cs {
			cs[i].Service = Service{Overhead: 0.010, PrefillSecondsPerToken: 1e-4, TokenSeconds: 0.02} // no slots known
			cs[i].Blind = true
		}
		return cs
	}
	for _, tc := range []struct {
		name     string
		requests []float64
		cfg      func(*Config)
		want     int
	}{
		{"within the bound: the prefix's home", []float64{2, 1, 1, 0}, nil, 0},
		{"over 1.25 x (mean 1 + 1)", []float64{3, 1, 0, 0}, nil, -1},
		{"no bound", []float64{9, 0, 0, 0}, func(c *Config) { c.LoadBound = 0 }, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			if tc.cfg != nil {
				tc.cfg(&cfg)
			}
			d := Choose(blind(tc.requests...), req, cfg, first, nil)
			if tc.want >= 0 && d.Index != tc.want || tc.want < 0 && d.Index == 0 {
				t.Errorf("Choose() = %d (%v), want %d (-1: anything but 0)", d.Index, d.Reason, tc.want)
			}
		})
	}
	// Seen upstreams (a fresh scrape or observed first tokens) are priced on what is seen, not bounded.
	cs := blind(3, 1, 0, 0)
	cs[0].Blind = false
	if d := Choose(cs, req, DefaultConfig(), first, nil); d.Index != 0 {
		t.Errorf("a seen home with 3 in flight: Choose() = %d, want 0", d.Index)
	}
	// A prefix fewer than one request in 2N carry (not hot) cannot pile up: it stays home, unbounded.
	shared := req
	shared.Share = 0.05
	if d := Choose(blind(3, 1, 0, 0), shared, DefaultConfig(), first, nil); d.Index != 0 {
		t.Errorf("a prefix of 5%% of requests, its home over the bound: Choose() = %d, want the home 0", d.Index)
	}
	shared.Share = 0.5 // hot: bounded
	if d := Choose(blind(3, 1, 0, 0), shared, DefaultConfig(), first, nil); d.Index == 0 {
		t.Errorf("a prefix of half the requests, its home over the bound: Choose() = 0, want another")
	}
	// A conversation pinned to a blind upstream over the bound moves.
	cs = blind(3, 1, 0, 0)
	cs[0].Pinned = true
	if d := Choose(cs, req, DefaultConfig(), first, nil); d.Index == 0 {
		t.Errorf("pinned to a blind upstream over the bound: Choose() = 0 (%v), want another", d.Reason)
	}
}
