// Package oracle is a Caddy load-balancing selection policy that cheats: it reads the simulated
// backends' true KV-cache contents and queues and sends each request to the backend that will
// start it soonest. It is the benchmark's upper bound, registered only in the benchmark binary as
// http.reverse_proxy.selection_policies.oracle.
package oracle

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

func init() {
	caddy.RegisterModule(Selection{})
}

// Load is a backend's queue state as the oracle weighs it.
type Load struct {
	// PendingPrefillTokens are prompt tokens admitted or queued but not yet prefilled.
	PendingPrefillTokens int
	// Requests are running plus waiting requests (the tie-breaker).
	Requests int
}

// Backend is what the oracle can ask a simulated backend.
type Backend interface {
	// Load returns the backend's current queue state.
	Load() Load
	// Cached returns the prompt tokens of a request body and how many of them the backend holds in
	// its KV cache right now.
	Cached(body []byte) (promptTokens, cachedTokens int, err error)
}

var (
	registryMu sync.RWMutex
	registry   = map[string]Backend{}
)

// Register makes b the backend behind dial address dial (an upstream's Dial, e.g.
// "127.0.0.1:8001"). It is process-global, as Caddy's own upstream hosts are.
func Register(dial string, b Backend) {
	registryMu.Lock()
	defer registryMu.Unlock()
	registry[dial] = b
}

// Unregister forgets the backend behind dial.
func Unregister(dial string) {
	registryMu.Lock()
	defer registryMu.Unlock()
	delete(registry, dial)
}

func lookup(dial string) Backend {
	registryMu.RLock()
	defer registryMu.RUnlock()
	return registry[dial]
}

// Request variables: the body bytes, so that every Select of a request (retries included)
// re-installs the same body, and the request's in-flight entry.
const (
	bodyVar     = "oracle.body"
	inflightVar = "oracle.inflight"
)

// inflight is a request the oracle routed that has not finished yet: a backend registers a
// prompt's blocks in its cache only once it has prefilled them, so a request arriving meanwhile
// with the same prefix would otherwise look like a miss everywhere and be sent elsewhere.
type inflight struct {
	dial string
	body []byte
}

var (
	inflightMu sync.Mutex
	inflights  = map[*inflight]struct{}{}
)

// inflightMatch returns the longest common prefix, in simulated tokens (4 bytes of the JSON body;
// the generated text needs no escapes), of body and the bodies in flight to dial.
func inflightMatch(dial string, body []byte) int {
	inflightMu.Lock()
	defer inflightMu.Unlock()
	best := 0
	for f := range inflights {
		if f.dial != dial {
			continue
		}
		n := min(len(f.body), len(body))
		i := 0
		for i < n && f.body[i] == body[i] {
			i++
		}
		best = max(best, i)
	}
	return best / bytesPerToken
}

// bytesPerToken is the simulator's tokenizer.
const bytesPerToken = 4

// track records that the request behind r goes to dial, replacing the entry of an earlier
// attempt, and forgets it when the request ends. Requests outside a Caddy server (no request
// variables, so no way to recognise a retry) are not tracked.
func track(r *http.Request, dial string, body []byte) {
	if _, ok := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any); !ok || r.Context().Done() == nil {
		return
	}
	inflightMu.Lock()
	defer inflightMu.Unlock()
	if f, ok := caddyhttp.GetVar(r.Context(), inflightVar).(*inflight); ok {
		f.dial = dial
		return
	}
	f := &inflight{dial: dial, body: body}
	inflights[f] = struct{}{}
	caddyhttp.SetVar(r.Context(), inflightVar, f)
	context.AfterFunc(r.Context(), func() {
		inflightMu.Lock()
		defer inflightMu.Unlock()
		delete(inflights, f)
	})
}

// Selection picks the available upstream with the least prefill work before this request's first
// token: its pending prefill tokens plus this prompt's tokens it neither holds in cache nor is
// about to (a common prefix with a request in flight there). Ties go to the one with fewer
// requests, then to the first in the pool. Upstreams with no registered backend are used only if
// no registered one is available.
type Selection struct{}

// CaddyModule returns the Caddy module information.
func (Selection) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.oracle",
		New: func() caddy.Module { return new(Selection) },
	}
}

// Select returns the upstream that will start the request soonest.
func (Selection) Select(pool reverseproxy.UpstreamPool, r *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	body := readBody(r)
	var (
		best              *reverseproxy.Upstream
		bestCost, bestReq int
		fallback          *reverseproxy.Upstream
	)
	for _, u := range pool {
		if !u.Available() {
			continue
		}
		b := lookup(u.Dial)
		if b == nil {
			if fallback == nil {
				fallback = u
			}
			continue
		}
		prompt, cached, err := b.Cached(body)
		if err != nil {
			prompt, cached = 0, 0
		}
		cached = max(cached, min(inflightMatch(u.Dial, body), prompt-1))
		l := b.Load()
		cost := l.PendingPrefillTokens + prefillWeight*(prompt-cached)
		if best == nil || cost < bestCost || (cost == bestCost && l.Requests < bestReq) {
			best, bestCost, bestReq = u, cost, l.Requests
		}
	}
	if best == nil {
		return fallback
	}
	track(r, best.Dial, body)
	return best
}

// prefillWeight counts a token this request would have to prefill against a token of backlog. With 1,
// the choice is the fastest first token for this request alone, which scatters a group's prefix over
// backends whenever one has a momentary backlog and costs later requests their hits; weighing the
// prefill as the llm policy does keeps prefixes together (measured: shared-prefix hit rate 59% -> 80%).
const prefillWeight = 4

// readBody returns the request body and re-installs it (Body, ContentLength, GetBody) so that
// the upstream, and a retry's Select, read it again.
func readBody(r *http.Request) []byte {
	body, _ := caddyhttp.GetVar(r.Context(), bodyVar).([]byte)
	if body == nil && r.Body != nil {
		body, _ = io.ReadAll(r.Body)
		_ = r.Body.Close()
		if body == nil {
			body = []byte{}
		}
		caddyhttp.SetVar(r.Context(), bodyVar, body)
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	return body
}

// Interface guards
var _ reverseproxy.Selector = (*Selection)(nil)
