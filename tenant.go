package caddyllm

import (
	"math"
	"slices"

	"github.com/cespare/xxhash/v2"

	"github.com/tokenrouter/caddy-llm/selection"
)

// Tenant fallback chains. Each tenant (the value of tenant_header, else of conversation_header) has a
// fallback chain: the upstreams in weighted rendezvous order, by the score -w / ln(u) where u is a
// uniform hash of the tenant and the upstream and w its weight (availability x capacity). That is
// weighted sampling without replacement, drawn the same way by every proxy and every request, with no
// state: a chain needs no store, no TTL and no memory, and an upstream's share of homes follows its
// weight. When a weight changes, only the tenants whose order it crosses move.
//
// The chain's head is the tenant's home, where its caches warm: on a first attempt it wins among
// candidates whose costs are equal (selection.Candidate.Home), so the cost still decides between a cold
// home and a warm or idle elsewhere. A retry (the request already tried an upstream) goes to the next
// untried upstream of the chain alone, so a tenant's failed requests land together on its second choice
// and warm that one cache, instead of scattering over the fleet.

// chainScore is upstream key's weighted rendezvous score for a tenant: higher comes first.
func chainScore(tenant uint64, key string, weight float64) float64 {
	if weight <= 0 {
		return math.Inf(-1)
	}
	h := xxhash.New()
	var b [8]byte
	for i := range b {
		b[i] = byte(tenant >> (8 * i))
	}
	_, _ = h.Write(b[:])
	_, _ = h.WriteString(key)
	u := (float64(h.Sum64()>>11) + 0.5) / (1 << 53) // in (0, 1)
	return -weight / math.Log(u)
}

// tenantChain returns keys in the tenant's fallback order for the given weights (weights[i] is keys[i]'s;
// nil: all equal). Upstreams of equal score keep their order in keys.
func tenantChain(tenant string, keys []string, weights []float64) []string {
	h := xxhash.Sum64String(tenant)
	type scored struct {
		key   string
		score float64
	}
	s := make([]scored, len(keys))
	for i, k := range keys {
		w := 1.0
		if weights != nil {
			w = weights[i]
		}
		s[i] = scored{k, chainScore(h, k, w)}
	}
	slices.SortStableFunc(s, func(a, b scored) int {
		switch {
		case a.score > b.score:
			return -1
		case a.score < b.score:
			return 1
		}
		return 0
	})
	out := make([]string, len(s))
	for i := range s {
		out[i] = s[i].key
	}
	return out
}

// chainHead returns the index of the first upstream of the tenant's chain among cands, whose weights are
// their availability x capacity. Since the candidates of a retry are the upstreams the request has not
// tried, that is the next untried upstream of the chain. It is O(n) and does not allocate.
func chainHead(tenant uint64, cands []selection.Candidate, capacities map[string]float64) int {
	best, bestScore := -1, math.Inf(-1)
	for i := range cands {
		w := cands[i].Availability
		if w <= 0 {
			w = 1
		}
		if c, ok := capacities[cands[i].Key]; ok {
			w *= c
		}
		if score := chainScore(tenant, cands[i].Key, w); best < 0 || score > bestScore {
			best, bestScore = i, score
		}
	}
	return best
}
