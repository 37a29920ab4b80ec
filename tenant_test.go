package caddyllm

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/cespare/xxhash/v2"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/selection"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

var tenantKeys = []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}

// TestTenantChain: a chain is a permutation of the upstreams, the same for a tenant every time, its head
// spread over the upstreams by weight, a weight of 0 last; and its next untried upstream, as the decider
// finds it among a retry's candidates, is the chain's next element.
func TestTenantChain(t *testing.T) {
	for _, tc := range []struct {
		name    string
		weights []float64
		want    []float64 // expected share of homes
	}{
		{"equal", []float64{1, 1, 1, 1}, []float64{0.25, 0.25, 0.25, 0.25}},
		{"one at twice the capacity", []float64{2, 1, 1, 1}, []float64{0.4, 0.2, 0.2, 0.2}},
		{"one at availability 0.3", []float64{1, 1, 1, 0.3}, []float64{1 / 3.3, 1 / 3.3, 1 / 3.3, 0.3 / 3.3}},
		{"one out (weight 0)", []float64{1, 1, 0, 1}, []float64{1. / 3, 1. / 3, 0, 1. / 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const tenants = 20_000
			homes := make([]int, len(tenantKeys))
			for n := range tenants {
				tenant := fmt.Sprintf("tenant-%d", n)
				chain := tenantChain(tenant, tenantKeys, tc.weights)
				if sorted := slices.Sorted(slices.Values(chain)); !slices.Equal(sorted, tenantKeys) {
					t.Fatalf("chain %v is not a permutation of %v", chain, tenantKeys)
				}
				if n < 50 && !slices.Equal(chain, tenantChain(tenant, tenantKeys, tc.weights)) {
					t.Fatalf("%s: two chains differ", tenant)
				}
				homes[slices.Index(tenantKeys, chain[0])]++
				for i, w := range tc.weights {
					if w == 0 && chain[len(chain)-1] != tenantKeys[i] {
						t.Fatalf("%s: chain %v, want %s (weight 0) last", tenant, chain, tenantKeys[i])
					}
				}
				if n < 200 { // walking the chain as retries do: the head among the untried
					cands := make([]selection.Candidate, 0, len(tenantKeys))
					for step := range chain {
						cands = cands[:0]
						for i, k := range tenantKeys {
							if !slices.Contains(chain[:step], k) {
								cands = append(cands, selection.Candidate{Key: k, Availability: max(tc.weights[i], minAvailability)})
							}
						}
						if tc.weights[slices.Index(tenantKeys, chain[step])] == 0 {
							break
						}
						if got := cands[chainHead(xxhash.Sum64String(tenant), cands, nil)].Key; got != chain[step] {
							t.Fatalf("%s: attempt %d goes to %s, want %s (chain %v)", tenant, step+1, got, chain[step], chain)
						}
					}
				}
			}
			for i, n := range homes {
				if share := float64(n) / tenants; share < tc.want[i]-0.02 || share > tc.want[i]+0.02 {
					t.Errorf("%s is home to %.3f of tenants, want %.3f (homes %v)", tenantKeys[i], share, tc.want[i], homes)
				}
			}
		})
	}
}

// TestTenantRetriesLandOnSecondChoice: through the decider, a tenant's first attempts go to its home
// (idle upstreams tie, and the home breaks the tie), and every retry after its home failed goes to its
// second choice - not scattered over the other upstreams. Another tenant has its own chain.
func TestTenantRetriesLandOnSecondChoice(t *testing.T) {
	now := int64(1_700_000_000e9)
	routes := affinity.New(affinity.Config{Capacity: 1000, BlockSize: 16})
	lt := &loadTable{m: make(map[string]*upstreamLoad)}
	dec := newDecider(selection.DefaultConfig(), routes, lt, 256, nil)
	for _, tenant := range []string{"acme", "globex", "initech"} {
		chain := tenantChain(tenant, tenantKeys, nil)
		for n := range 20 {
			body, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{
				{"role": "user", "content": fmt.Sprintf("question %d of %s: %s", n, tenant, strings.Repeat("words ", 50))}}})
			req, err := tokenize.Parse(body, tokenize.APIChat, tokenize.Options{Encoding: "approx"})
			if err != nil {
				t.Fatal(err)
			}
			q := &query{req: req, now: now, tenant: tenant}
			d := dec.choose(q, tenantKeys, make([]selection.Candidate, len(tenantKeys)), nil)
			if got := tenantKeys[d.Index]; got != chain[0] {
				t.Errorf("%s request %d: first attempt on %s, want its home %s", tenant, n, got, chain[0])
			}
			// The home failed: the retry's candidates are the untried upstreams.
			var untried []string
			for _, k := range tenantKeys {
				if k != tenantKeys[d.Index] {
					untried = append(untried, k)
				}
			}
			q = &query{req: req, now: now, tenant: tenant, retry: true}
			d = dec.choose(q, untried, make([]selection.Candidate, len(untried)), nil)
			if got := untried[d.Index]; got != chain[1] {
				t.Errorf("%s request %d: retry on %s, want its second choice %s", tenant, n, got, chain[1])
			}
			dec.commit(q, untried[d.Index], d).release(now, false)
		}
	}
}

// TestTenantFailingHomeIntegration: three real upstreams behind Caddy with lb_retries; the tenant's home
// drops every connection. Every request of the tenant succeeds, all on its second choice: the third
// upstream receives nothing. The home's availability counts the failures.
func TestTenantFailingHomeIntegration(t *testing.T) {
	backends := []*backend{newBackend(t), newBackend(t), newBackend(t)}
	dials := make([]string, len(backends))
	for i, b := range backends {
		dials[i] = b.dial
	}
	chain := tenantChain("acme", dials, nil)
	byDial := func(dial string) *backend { return backends[slices.Index(dials, dial)] }
	byDial(chain[0]).handle = func(w http.ResponseWriter, r *http.Request, body []byte) {
		if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
			conn.Close()
		}
	}
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm {\n\t\t\ttenant_header X-Tenant\n\t\t\tmetrics off\n\t\t}",
		"lb_retries 2\n\t\tlb_retry_match {\n\t\t\tmethod POST\n\t\t}", backends...), "caddyfile")

	for n := range 8 {
		res, got := post(t, tester.Client, "/v1/chat/completions", chatBody("m", 20+n, false), "X-Tenant", "acme")
		if res.StatusCode != http.StatusOK || !strings.Contains(got, chain[1]) {
			t.Fatalf("request %d: status %d %s, want 200 from the second choice %s", n, res.StatusCode, got, chain[1])
		}
	}
	if n := byDial(chain[2]).requests.Load(); n != 0 {
		t.Errorf("the third choice %s received %d requests, want 0: retries scattered", chain[2], n)
	}
	if n := byDial(chain[0]).requests.Load(); n == 0 {
		t.Errorf("the home %s received nothing: the first attempts did not go home", chain[0])
	}
	waitInflightZero(t, dials...)
	var errors, successes float64
	availabilityTables.Range(func(_, v any) bool {
		table := v.(availabilityEntry).availabilityTable
		table.mu.Lock()
		if u := table.m[chain[0]]; u != nil {
			errors += u.errors
		}
		if u := table.m[chain[1]]; u != nil {
			successes += u.successes
		}
		table.mu.Unlock()
		return true
	})
	if errors < 1 || successes < 8 {
		t.Errorf("availability counted %g errors on the home and %g successes on the second choice, want at least 1 and 8", errors, successes)
	}
}
