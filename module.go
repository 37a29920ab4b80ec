// Package caddyllm is a Caddy plugin that load-balances OpenAI-compatible LLM inference servers (vLLM,
// SGLang, ...). It adds the selection policy http.reverse_proxy.selection_policies.llm, which routes each
// request by the tokens every upstream has in flight and by where its prompt prefix is probably cached, and
// the request matcher http.matchers.llm, which matches requests by model, prompt tokens, streaming and API.
package caddyllm

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/selection"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

func init() {
	caddy.RegisterModule(LLMSelection{})
}

// Defaults, documented on the fields that use them.
const (
	defaultOutputTokens = 256
	// defaultMaxTokenizeBytes bounds tokenizing to about 10 ms of CPU a request (tiktoken-go: ~5 MB/s).
	defaultMaxTokenizeBytes = 48 << 10
	defaultBlockSize        = 16
	defaultRouteTTL         = 10 * time.Minute
	defaultRoutes           = 100_000
)

// LLMSelection is a reverse_proxy selection policy for OpenAI-compatible LLM servers. It reads the request
// body once, counts its prompt tokens, and chooses among the available upstreams the one where the request
// costs least: the tokens each upstream already has in flight from this process, plus the prompt tokens it
// would have to prefill given what its KV cache probably holds (learned from earlier routing decisions).
//
// Every request reserves its weight on the chosen upstream and releases it exactly once: a retry releases
// the previous attempt's reservation before reserving again, and the end of the request (the end of a
// stream, or the client going away) releases the last one. The counters and learned routes are
// process-global, so they survive config reloads.
//
// Requests that are not LLM requests (not a POST of JSON to a chat/completions, completions, responses or
// embeddings endpoint), bodies over the cap and bodies that do not parse go to the fallback policy and are
// proxied intact.
type LLMSelection struct {
	// Mode is the routing strategy: "combined" (default) weighs load against the prefill work a cached
	// prefix saves; "least_tokens" uses load alone; "prefix" prefers the longest cached prefix, subject to
	// the hot-spot guard.
	Mode string `json:"mode,omitempty"`

	// Tokenizer counts prompt tokens: "cl100k_base" (default), "o200k_base", or "approx" (no tokenizer:
	// about 4 bytes a token; the cheapest).
	Tokenizer string `json:"tokenizer,omitempty"`

	// MaxBodyBytes is the largest body read and parsed; larger requests go to the fallback policy, unread
	// (weighted by their size). Default 2 MiB: ~500k tokens of prompt, and parsing any body under it
	// costs at most ~10 ms of CPU.
	MaxBodyBytes int64 `json:"max_body_bytes,omitempty"`

	// MaxMessageBytes: a message longer than this is counted by estimate rather than tokenized. Default 32 KiB.
	MaxMessageBytes int `json:"max_message_bytes,omitempty"`

	// MaxTokenizeBytes: after this many bytes of one request are tokenized, the rest is estimated.
	// Default 48 KiB: tokenizing runs at about 5 MB/s, so no request costs more than about 10 ms of CPU
	// however it is built. Messages already in the message cache (a conversation's history) cost nothing
	// against it.
	MaxTokenizeBytes int `json:"max_tokenize_bytes,omitempty"`

	// OutputTokens is the output estimate added to a request's weight: a request's max_tokens (or
	// max_completion_tokens) when it is lower, else this. Default 256.
	OutputTokens int `json:"output_tokens,omitempty"`

	// ConversationHeader names a request header whose value identifies a conversation; a conversation is
	// pinned to the upstream that served it (until the pin expires or the upstream becomes a hot spot).
	// Off by default.
	ConversationHeader string `json:"conversation_header,omitempty"`

	// BlockSize is the backends' KV-cache block size in tokens; learned prefixes are aligned down to it.
	// Default 16 (vLLM's).
	BlockSize int `json:"block_size,omitempty"`

	// RouteCapacity bounds the learned prefix routes (least recently used are evicted). Default 100000.
	RouteCapacity int `json:"route_capacity,omitempty"`

	// RouteTTL is how long a learned route is trusted. Default 10m.
	RouteTTL caddy.Duration `json:"route_ttl,omitempty"`

	// GuardFactor, GuardSlack, GuardRequestSlack and PrefillWeight are accepted for old configs and
	// ignored: the decision is now one cost in seconds of each upstream's learned service, with no
	// constant tied to one backend (see the README's "How it decides").
	GuardFactor       float64 `json:"guard_factor,omitempty"`
	GuardSlack        int64   `json:"guard_slack,omitempty"`
	GuardRequestSlack int64   `json:"guard_request_slack,omitempty"`
	PrefillWeight     float64 `json:"prefill_weight,omitempty"`

	// Metrics scrapes each upstream's Prometheus metrics (vLLM, SGLang, llama.cpp, NIM): the requests
	// they show beyond this proxy's own - other clients, other proxies - join the decision, and the
	// running count at which a backend starts queueing teaches its slot count. On by default (every
	// upstream's /metrics on its own port, every second); {"off": true} (Caddyfile `metrics off`) turns
	// it off. An upstream without usable metrics (404, not Prometheus text, no load gauge it knows) is
	// logged once and routed on this proxy's own signals.
	Metrics *MetricsConfig `json:"metrics,omitempty"`

	// Capacities gives upstreams (by dial address) a relative speed, default 1: the service model of an
	// upstream with capacity 2 starts from a prior twice as fast. Learned rates replace the prior as
	// traffic flows; use it for unequal GPUs so that the first minutes are right too.
	Capacities map[string]float64 `json:"capacities,omitempty"`

	// SaturationBackoff is how long an upstream that answered 429 (vLLM's queue-full answer) is avoided
	// while any other is available. Its learned routes are kept. Default 2s.
	SaturationBackoff caddy.Duration `json:"saturation_backoff,omitempty"`

	// LoRALoadTime is the time an upstream is assumed to take to load a LoRA adapter that is not in one
	// of its slots. Upstreams that report adapters (vLLM's vllm:lora_requests_info, scraped with metrics)
	// and do not hold the request's adapter are charged it, and when all their adapter slots are taken,
	// also about one mean request time of waiting for a slot (see lora.go). Default 500ms.
	LoRALoadTime caddy.Duration `json:"lora_load_time,omitempty"`

	// Availability adapts each upstream's share of new work to its error rate (see AvailabilityConfig):
	// on by default; {"off": true} (Caddyfile `availability off`) turns it off. The availabilities are
	// process-global per controller setting, so a reload with the same settings keeps them.
	Availability *AvailabilityConfig `json:"availability,omitempty"`

	// TenantHeader names a request header whose value identifies a tenant (a project, an API key's
	// owner); each tenant has a fallback chain of upstreams, its home first, that retries walk in order
	// (see tenant.go). Default: the conversation header; with neither, no chains.
	TenantHeader string `json:"tenant_header,omitempty"`

	// FallbackRaw is the policy for requests this one cannot read. Default least_conn.
	FallbackRaw json.RawMessage `json:"fallback,omitempty" caddy:"namespace=http.reverse_proxy.selection_policies inline_key=policy"`

	stateConfig // persist and share: learned state across restarts and instances (persist.go, share.go)

	fallback  reverseproxy.Selector
	decider   *decider
	tokOpts   tokenize.Options
	routes    *affinity.Table
	routesKey string
	avail     *availabilityTable // nil: availability off
	availKey  string
	scrapes   *scrapes
	logger    *zap.Logger
	cleaned   bool // Cleanup ran (only Cleanup reads it); Select may still run for requests in flight
}

// CaddyModule returns the Caddy module information.
func (LLMSelection) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.llm",
		New: func() caddy.Module { return new(LLMSelection) },
	}
}

// Provision sets up the policy.
func (s *LLMSelection) Provision(ctx caddy.Context) error {
	s.logger = ctx.Logger()
	if s.Mode == "" {
		s.Mode = selection.Combined.String()
	}
	if s.Tokenizer == "" {
		s.Tokenizer = "cl100k_base"
	}
	if s.MaxBodyBytes == 0 {
		s.MaxBodyBytes = defaultMaxBodyBytes
	}
	if s.OutputTokens == 0 {
		s.OutputTokens = defaultOutputTokens
	}
	if s.MaxTokenizeBytes == 0 {
		s.MaxTokenizeBytes = defaultMaxTokenizeBytes
	}
	if s.BlockSize == 0 {
		s.BlockSize = defaultBlockSize
	}
	if s.RouteCapacity == 0 {
		s.RouteCapacity = defaultRoutes
	}
	if s.RouteTTL == 0 {
		s.RouteTTL = caddy.Duration(defaultRouteTTL)
	}
	if s.LoRALoadTime == 0 {
		s.LoRALoadTime = caddy.Duration(defaultLoRALoadTime)
	}
	if s.SaturationBackoff == 0 {
		s.SaturationBackoff = caddy.Duration(defaultSaturationBackoff)
	}
	if s.Metrics == nil {
		s.Metrics = new(MetricsConfig)
	}
	s.Metrics.upstreamTLS = upstreamTLS(ctx)
	s.Metrics.provision()
	if s.Availability == nil {
		s.Availability = new(AvailabilityConfig)
	}
	if !s.Availability.Off {
		s.Availability.provision()
	}
	if s.TenantHeader == "" {
		s.TenantHeader = s.ConversationHeader
	}
	if err := s.Validate(); err != nil {
		return err
	}
	if err := registerMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	if s.GuardFactor != 0 || s.GuardSlack != 0 || s.GuardRequestSlack != 0 || s.PrefillWeight != 0 {
		s.logger.Warn("guard_factor, guard_slack, guard_request_slack and prefill_weight are ignored: the decision weighs each upstream's learned speed in seconds")
	}
	cfg := selection.DefaultConfig()
	cfg.Mode, _ = selection.ParseMode(s.Mode)
	s.tokOpts = tokenize.Options{
		Encoding:        s.Tokenizer,
		MaxMessageBytes: s.MaxMessageBytes,
		MaxTotalBytes:   s.MaxTokenizeBytes,
	}
	if err := tokenize.Warm(s.Tokenizer); err != nil {
		return fmt.Errorf("loading tokenizer %s: %w", s.Tokenizer, err)
	}

	if s.FallbackRaw == nil {
		s.FallbackRaw = caddyconfig.JSONModuleObject(reverseproxy.LeastConnSelection{}, "policy", "least_conn", nil)
	}
	mod, err := ctx.LoadModule(s, "FallbackRaw")
	if err != nil {
		return fmt.Errorf("loading fallback selection policy: %w", err)
	}
	s.fallback = mod.(reverseproxy.Selector)

	if !s.Metrics.Off {
		s.scrapes = newScrapes(s.Metrics, s.logger)
		addLiveScrapes(s.scrapes)
		for _, dial := range staticUpstreams(ctx) {
			s.scrapes.load(dial) // start scraping before the first request, so reports are complete
		}
	}
	for dial, c := range s.Capacities {
		loads.entry(dial, time.Now().UnixNano()).model.SetPrior(scaledPrior(c))
	}
	routeCfg := affinity.Config{Capacity: s.RouteCapacity, TTL: time.Duration(s.RouteTTL), BlockSize: s.BlockSize}
	var err2 error
	s.routes, s.routesKey, err2 = acquireRoutes(routeCfg)
	if err2 != nil {
		return err2
	}
	if s.Persist != nil && s.Persist.Key == "" {
		// One snapshot per route table: two pools with different settings never overwrite each other's.
		s.Persist.Key = fmt.Sprintf("routes-%d-%d-%s", routeCfg.BlockSize, routeCfg.Capacity, routeCfg.TTL)
	}
	routes := s.routes
	if cfg.Mode == selection.LeastTokens {
		routes = nil
	}
	if !s.Availability.Off {
		s.avail, s.availKey, err = acquireAvailability(s.Availability.controller())
		if err != nil {
			return err
		}
	}
	s.decider = newDecider(cfg, routes, loads, s.OutputTokens, s.scrapes).
		withAvailability(s.avail, s.Availability.Preference).
		withLoRA(s.scrapes, adapterSlots, time.Duration(s.LoRALoadTime))
	s.decider.capacities = s.Capacities
	return s.provisionState(ctx, s.routes)
}

// Validate checks the configuration.
func (s *LLMSelection) Validate() error {
	if _, ok := selection.ParseMode(s.Mode); !ok {
		return fmt.Errorf("unknown mode %q (want combined, least_tokens or prefix)", s.Mode)
	}
	if !tokenize.ValidEncoding(s.Tokenizer) {
		return fmt.Errorf("unknown tokenizer %q (want cl100k_base, o200k_base or approx)", s.Tokenizer)
	}
	for _, v := range []struct {
		name  string
		value float64
	}{
		{"max_body_bytes", float64(s.MaxBodyBytes)},
		{"max_message_bytes", float64(s.MaxMessageBytes)},
		{"max_tokenize_bytes", float64(s.MaxTokenizeBytes)},
		{"output_tokens", float64(s.OutputTokens)},
		{"block_size", float64(s.BlockSize)},
		{"route_capacity", float64(s.RouteCapacity)},
		{"route_ttl", time.Duration(s.RouteTTL).Seconds()},
		{"saturation_backoff", time.Duration(s.SaturationBackoff).Seconds()},
		{"lora_load_time", time.Duration(s.LoRALoadTime).Seconds()},
	} {
		if v.value < 0 {
			return fmt.Errorf("%s must be positive, got %g", v.name, v.value)
		}
	}
	for dial, c := range s.Capacities {
		if c <= 0 {
			return fmt.Errorf("capacity of %s must be positive, got %g", dial, c)
		}
	}
	if s.Availability != nil && !s.Availability.Off {
		if err := s.Availability.validate(); err != nil {
			return err
		}
	}
	if s.Metrics != nil && !s.Metrics.Off {
		return s.Metrics.validate()
	}
	return nil
}

// Cleanup releases this config's hold on the shared route table; learned routes survive as long as any
// config uses them, so a reload keeps them.
//
// Cleanup changes nothing Select reads: requests of this config may still be selecting (retries, or a
// request that arrived as the reload happened). They keep using the route table they had and the
// released scrape handles, which report nothing, so routing falls back to local counters.
func (s *LLMSelection) Cleanup() error {
	if s.cleaned {
		return nil
	}
	s.cleaned = true
	if s.scrapes != nil {
		removeLiveScrapes(s.scrapes)
		s.scrapes.release()
	}
	s.cleanupState()
	if s.routes != nil {
		releaseRoutes(s.routesKey)
	}
	if s.avail != nil {
		releaseAvailability(s.availKey)
	}
	return nil
}

// Select chooses an upstream for r.
func (s *LLMSelection) Select(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	lr, ok := holdRequest(r, s.MaxBodyBytes)
	if !ok {
		return nil // the request has ended, its client gone: there is nothing to send
	}
	defer lr.drop()
	if lr.api == tokenize.APIUnknown {
		// A stored response's retrieval, cancellation or input items (GET /v1/responses/{id}, ...): where
		// it was produced, the only upstream that has it.
		if dial, ok := s.routes.Pinned(responsesPinModel, responseIDInPath(r.URL.Path)); ok {
			if up := storedUpstream(pool, dial); up != nil {
				return up
			}
		}
		if lr.sniffed {
			// A POST to an LLM endpoint whose body did not declare JSON and is not an OpenAI request
			// (curl -d 'text'): routed by the fallback, and counted as such.
			fallbackDecisions.Inc()
		}
		return s.fallback.Select(pool, r, w)
	}
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if lr.acct == nil {
		backoff := time.Duration(s.SaturationBackoff)
		lr.acct = newReservationHolder(r.Context(), func(dial string) bool {
			if o := endOutcome(repl); o != outcomeNone {
				s.avail.record(dial, o == outcomeError)
			}
			return s.noteStatus(repl, dial, backoff)
		})
	} else if len(lr.tried) > 0 {
		// A retry: the previous attempt's answer (if it got one) is still in the replacer. Whatever it
		// was, the attempt failed: nothing retries a success (lb_retries retries failed round trips and
		// retry_match answers, llm_resume errors and cut streams).
		prev := lr.tried[len(lr.tried)-1]
		s.noteStatus(repl, prev, time.Duration(s.SaturationBackoff))
		s.avail.record(prev, true)
	}
	if repl != nil {
		// reverse_proxy sets the status only when an attempt is answered: cleared here, the request's end
		// sees the last attempt's answer or none, never an earlier attempt's.
		repl.Delete(statusPlaceholder)
	}

	start := time.Now()
	req, err := lr.parse(s.tokOpts)
	if err != nil {
		// Route it anyway, by the fallback: weighted by its size, so a huge prompt is not counted as
		// nothing (a body that turned out not to be an OpenAI request at all reserves nothing).
		up := s.fallback.Select(pool, r, w)
		weight := max(r.ContentLength, 0) / 4
		var res *reservation
		if lr.api != tokenize.APIUnknown && up != nil {
			res = loads.reserve(up.Dial, work{uncached: int(weight)}, time.Now().UnixNano())
		}
		lr.acct.swap(res)
		fallbackDecisions.Inc()
		setPlaceholder(repl, "http.llm.upstream_reason", "fallback")
		if c := s.logger.Check(zapcore.DebugLevel, "routed unparsed request by fallback"); c != nil {
			c.Write(zap.String("upstream", dialOf(up)), zap.Int64("weight", weight), zap.String("error", err.Error()))
		}
		return up
	}
	if len(lr.parses) == 1 && lr.parses[0].req == req {
		tokenizeSeconds.Observe(time.Since(start).Seconds()) // parsed here, not by a matcher earlier
	}

	sc := scratchPool.Get().(*scratch)
	defer scratchPool.Put(sc)
	sc.reset()
	lr.routes = s.routes
	storedThere := false
	if dial, ok := s.routes.Pinned(responsesPinModel, req.PreviousResponseID); ok {
		storedThere = sc.gatherStored(pool, dial)
	}
	if !storedThere {
		sc.gather(pool, lr.tried, start.UnixNano())
	}
	if len(sc.keys) == 0 {
		lr.acct.swap(nil)
		return nil
	}
	q := &sc.query
	q.reset(req, start.UnixNano())
	if s.ConversationHeader != "" {
		q.conversation = r.Header.Get(s.ConversationHeader)
	}
	if s.TenantHeader != "" {
		q.tenant = r.Header.Get(s.TenantHeader)
	}
	q.retry = len(lr.tried) > 0
	sc.cands = slices.Grow(sc.cands[:0], len(sc.keys))[:len(sc.keys)]
	d := s.decider.choose(q, sc.keys, sc.cands, sc.floats[:0])
	if s.decider.noteUnlike(q) {
		s.logger.Info("upstreams of several kinds of engine in one pool; each is priced by what its own kind measured",
			zap.Int("kinds", q.kinds),
			zap.String("hint", "their KV caches differ in size (other GPUs, max_num_seqs or engine settings); a bare lb_policy llm sees no first token to learn each one's own time to a first token from: add `transport llm` to the reverse_proxy (README: Observing responses)"))
	}
	if storedThere {
		d.Reason = selection.ReasonConversation
	}
	up := sc.upstreams[d.Index]
	lr.acct.swap(s.decider.commit(q, up.Dial, d))
	lr.tried = append(lr.tried, up.Dial)

	decisionCounters[d.Reason].Inc()
	promptTokens.Observe(float64(req.PromptTokens))
	matchedTokens.Observe(float64(d.MatchedTokens))
	setPlaceholder(repl, "http.llm.upstream_reason", d.Reason.String())
	setPlaceholder(repl, "http.llm.matched_tokens", d.MatchedTokens)
	setPlaceholder(repl, "http.llm.predicted_ttft_ms", int64(d.TTFT*1000+0.5))
	setRequestPlaceholders(repl, req)
	if c := s.logger.Check(zapcore.DebugLevel, "selected upstream"); c != nil {
		c.Write(
			zap.String("upstream", up.Dial),
			zap.String("reason", d.Reason.String()),
			zap.String("model", req.Model),
			zap.Int("prompt_tokens", req.PromptTokens),
			zap.Int("matched_tokens", d.MatchedTokens),
			zap.Float64("predicted_wait_seconds", d.Wait),
			zap.Float64("predicted_ttft_seconds", d.TTFT),
			zap.Int("candidates", len(sc.cands)),
			zap.Array("costs", pricedCandidates{cands: sc.cands, req: q.priced, mode: s.decider.cfg.Mode}),
		)
	}
	return up
}

// noteStatus reads the answer of the attempt recorded in repl: a 429 marks dial saturated. It reports
// whether the attempt was answered with success.
func (s *LLMSelection) noteStatus(repl *caddy.Replacer, dial string, backoff time.Duration) bool {
	if repl == nil {
		return false
	}
	status, _ := repl.Get("http.reverse_proxy.status_code")
	code, ok := status.(int)
	if ok && code == http.StatusTooManyRequests {
		loads.saturate(dial, time.Now().Add(backoff))
		saturationsTotal.WithLabelValues(dial).Inc()
		if c := s.logger.Check(zapcore.DebugLevel, "upstream saturated"); c != nil {
			c.Write(zap.String("upstream", dial), zap.Duration("backoff", backoff))
		}
	}
	return ok && code >= 200 && code < 300
}

// setRequestPlaceholders exposes what the request is (never its text) as {http.llm.*} placeholders for
// access logs and header_down.
func setRequestPlaceholders(repl *caddy.Replacer, req *tokenize.Request) {
	setPlaceholder(repl, "http.llm.model", req.Model)
	setPlaceholder(repl, "http.llm.prompt_tokens", req.PromptTokens)
	setPlaceholder(repl, "http.llm.api", req.API.String())
	setPlaceholder(repl, "http.llm.stream", req.Stream)
}

func setPlaceholder(repl *caddy.Replacer, key string, value any) {
	if repl != nil {
		repl.Set(key, value)
	}
}

// maxRouteBoundaries bounds the prefixes one request matches and learns, so that a request of endless
// tiny messages can neither cost much route-table work nor evict other conversations' routes.
const (
	maxRouteBoundaries  = 256
	keepFirstBoundaries = 64 // system prompts and the start of a conversation
)

// routeBoundaries returns at most maxRouteBoundaries of bounds: the first ones (shared system prompts)
// and the last ones (the longest prefixes: where a continuing conversation matches). It allocates only
// for requests over the limit.
func routeBoundaries(bounds []tokenize.Boundary) []tokenize.Boundary {
	if len(bounds) <= maxRouteBoundaries {
		return bounds
	}
	out := make([]tokenize.Boundary, 0, maxRouteBoundaries)
	out = append(out, bounds[:keepFirstBoundaries]...)
	return append(out, bounds[len(bounds)-(maxRouteBoundaries-keepFirstBoundaries):]...)
}

func dialOf(u *reverseproxy.Upstream) string {
	if u == nil {
		return ""
	}
	return u.Dial
}

// scratch holds Select's per-call slices, pooled so the hot path does not allocate them.
type scratch struct {
	upstreams []*reverseproxy.Upstream
	keys      []string
	cands     []selection.Candidate
	avoid     []uint8 // per candidate while gathering: avoidTried, avoidSaturated
	floats    []float64
	query     query
}

func (sc *scratch) reset() {
	clear(sc.upstreams) // drop references to old configs' upstreams
	sc.upstreams = sc.upstreams[:0]
	sc.keys = sc.keys[:0]
	sc.cands = sc.cands[:0]
	sc.avoid = sc.avoid[:0]
	sc.floats = sc.floats[:0]
	sc.query.reset(nil, 0)
}

const (
	avoidTried     uint8 = 1 << iota // this request already tried it
	avoidSaturated                   // in its 429 backoff
)

// gather fills sc with the candidates for a request: the available upstreams. A retry goes to an
// upstream the request has not tried yet, and an upstream in its 429 backoff is used only when there is
// nothing else; when every available upstream is to be avoided for a reason, that reason is dropped.
func (sc *scratch) gather(pool reverseproxy.UpstreamPool, tried []string, now int64) {
	anyUntried := false
	for _, u := range pool {
		if !u.Available() {
			continue
		}
		var avoid uint8
		if slices.Contains(tried, u.Dial) {
			avoid |= avoidTried
		} else {
			anyUntried = true
		}
		if loads.saturated(u.Dial, now) {
			avoid |= avoidSaturated
		}
		sc.upstreams = append(sc.upstreams, u)
		sc.keys = append(sc.keys, u.Dial)
		sc.avoid = append(sc.avoid, avoid)
	}
	var skip uint8
	if anyUntried {
		skip = avoidTried
	}
	for _, a := range sc.avoid {
		if a&skip == 0 && a&avoidSaturated == 0 {
			skip |= avoidSaturated // a candidate neither skipped nor saturated exists
			break
		}
	}
	kept := 0
	for i, a := range sc.avoid {
		if a&skip != 0 {
			continue
		}
		sc.upstreams[kept], sc.keys[kept] = sc.upstreams[i], sc.keys[i]
		kept++
	}
	clear(sc.upstreams[kept:])
	sc.upstreams, sc.keys = sc.upstreams[:kept], sc.keys[:kept]
}

// gatherStored makes the upstream of dial the only candidate, and reports whether it is in the pool and
// available. A request continuing a response stored there can be answered nowhere else (any other
// upstream answers 404), so it goes there even when it was tried already or answered 429: a retry
// there may succeed.
func (sc *scratch) gatherStored(pool reverseproxy.UpstreamPool, dial string) bool {
	if u := storedUpstream(pool, dial); u != nil {
		sc.upstreams, sc.keys = append(sc.upstreams, u), append(sc.keys, u.Dial)
		return true
	}
	return false
}

var scratchPool = sync.Pool{New: func() any {
	return &scratch{floats: make([]float64, 0, 48), query: query{cached: make([]int, 0, 16), seen: make([]int64, 0, 16)}}
}}

// Interface guards
var (
	_ caddy.Provisioner     = (*LLMSelection)(nil)
	_ caddy.Validator       = (*LLMSelection)(nil)
	_ caddy.CleanerUpper    = (*LLMSelection)(nil)
	_ reverseproxy.Selector = (*LLMSelection)(nil)
)
