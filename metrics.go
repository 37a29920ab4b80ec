package caddyllm

import (
	"errors"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
)

// Metrics are registered on the registry of every config that uses the policy (Caddy makes a new one per
// config load, so reloads never see duplicates); the collectors themselves are process-global so that two
// policies in one config share them.
var (
	tokenBuckets = prometheus.ExponentialBuckets(16, 2, 15) // 16 .. 262,144 tokens

	decisionsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm", Name: "decisions_total",
		Help: "Routing decisions by reason: affinity, conversation, load, guard, fallback.",
	}, []string{"reason"})
	promptTokens = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "llm", Name: "prompt_tokens",
		Help: "Prompt tokens of the requests routed.", Buckets: tokenBuckets,
	})
	matchedTokens = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "llm", Name: "matched_tokens",
		Help: "Prompt tokens predicted cached on the chosen upstream.", Buckets: tokenBuckets,
	})
	tokenizeSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "llm", Name: "tokenize_seconds",
		Help: "Time to parse and count a request body.", Buckets: prometheus.ExponentialBuckets(10e-6, 4, 8), // 10us .. 160ms
	})
	saturationsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm", Name: "saturations_total",
		Help: "Times an upstream answered 429 and was marked saturated.",
	}, []string{"upstream"})
	resumesTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm", Name: "resumes_total",
		Help: "Requests llm_resume saw fail, by how they ended: continued (a broken stream completed as a continuation), retried_whole (re-sent unchanged, then succeeded), failed (no attempt succeeded).",
	}, []string{"outcome"})
)

// resumeOutcome is how a request that llm_resume had to act on ended.
type resumeOutcome int

const (
	resumeContinued    resumeOutcome = iota // a broken stream was completed: continued, or only its end added
	resumeRetriedWhole                      // re-sent unchanged (the client had no content yet), then succeeded
	resumeFailed                            // no attempt succeeded: the client got an error
)

// resumeOutcomeNames are the outcome labels.
var resumeOutcomeNames = [...]string{
	resumeContinued:    "continued",
	resumeRetriedWhole: "retried_whole",
	resumeFailed:       "failed",
}

// resumeCounters are resumesTotal's series, resolved (and so exported at zero) once.
var resumeCounters = func() (cs [len(resumeOutcomeNames)]prometheus.Counter) {
	for i, name := range resumeOutcomeNames {
		cs[i] = resumesTotal.WithLabelValues(name)
	}
	return cs
}()

// registerResumeMetrics adds llm_resume's collector to the config's registry.
func registerResumeMetrics(ctx caddy.Context) error {
	return registerCollectors(ctx, resumesTotal, bodiesTotal, bodyBytesHeld)
}

// decisionCounters are the reason-labelled counters, resolved once so Select does not look labels up.
var decisionCounters = func() map[selection.Reason]prometheus.Counter {
	m := make(map[selection.Reason]prometheus.Counter)
	for _, r := range []selection.Reason{selection.ReasonLoad, selection.ReasonAffinity, selection.ReasonConversation, selection.ReasonGuard} {
		m[r] = decisionsTotal.WithLabelValues(r.String())
	}
	return m
}()

var fallbackDecisions = decisionsTotal.WithLabelValues("fallback")

// The request bodies read into pooled buffers (body.go), by whichever of the matcher, the policy and
// llm_resume read them first.
var (
	bodiesTotal = prometheus.NewCounterFunc(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm", Name: "request_bodies_total",
		Help: "Request bodies read into pooled buffers (by the llm matcher, policy or llm_resume).",
	}, func() float64 { return float64(pooledBodies.taken.Load()) })
	bodyBytesHeld = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "llm", Name: "request_body_bytes_held",
		Help: "Bytes of pooled request-body buffers not yet released: their requests are in flight. Zero when idle.",
	}, func() float64 { return float64(pooledBodies.bytes.Load()) })
)

// registerMetrics adds every collector to the config's registry.
func registerMetrics(ctx caddy.Context) error {
	return registerCollectors(ctx, decisionsTotal, promptTokens, matchedTokens, tokenizeSeconds, saturationsTotal, stateCollector{},
		bodiesTotal, bodyBytesHeld)
}

// registerBodyMetrics adds the request-body collectors alone (the matcher's).
func registerBodyMetrics(ctx caddy.Context) error {
	return registerCollectors(ctx, bodiesTotal, bodyBytesHeld)
}

// registerCollectors registers cs on the config's registry; a collector already there (a second policy or
// handler in the same config) is not an error.
func registerCollectors(ctx caddy.Context, cs ...prometheus.Collector) error {
	registry := ctx.GetMetricsRegistry()
	if registry == nil {
		return nil
	}
	for _, c := range cs {
		if err := registry.Register(c); err != nil {
			var already prometheus.AlreadyRegisteredError
			if !errors.As(err, &already) {
				return err
			}
		}
	}
	return nil
}

// stateCollector reports the current state at scrape time: nothing on the request path updates it.
type stateCollector struct{}

var (
	descInflightTokens   = prometheus.NewDesc("caddy_llm_upstream_inflight_tokens", "Tokens (prompt + output estimate) this process has in flight to the upstream.", []string{"upstream"}, nil)
	descInflightRequests = prometheus.NewDesc("caddy_llm_upstream_inflight_requests", "Requests this process has in flight to the upstream.", []string{"upstream"}, nil)
	descSaturated        = prometheus.NewDesc("caddy_llm_upstream_saturated", "1 while the upstream is in its 429 backoff.", []string{"upstream"}, nil)
	descQueue            = prometheus.NewDesc("caddy_llm_upstream_queue_requests", "Waiting requests, as scraped from the upstream.", []string{"upstream"}, nil)
	descRunning          = prometheus.NewDesc("caddy_llm_upstream_running_requests", "Running requests, as scraped from the upstream.", []string{"upstream"}, nil)
	descKV               = prometheus.NewDesc("caddy_llm_upstream_kv_cache_usage", "KV-cache usage (0-1), as scraped from the upstream.", []string{"upstream"}, nil)
	descScrapeAge        = prometheus.NewDesc("caddy_llm_upstream_scrape_age_seconds", "Age of the last good scrape of the upstream's metrics.", []string{"upstream"}, nil)
	descScrapeErrors     = prometheus.NewDesc("caddy_llm_upstream_scrape_errors_total", "Failed scrapes of the upstream's metrics.", []string{"upstream"}, nil)
	descRoutes           = prometheus.NewDesc("caddy_llm_routes", "Learned prefix routes.", nil, nil)
	descRouteEvictions   = prometheus.NewDesc("caddy_llm_route_evictions_total", "Learned routes and conversation pins evicted by capacity.", nil, nil)
	descRoutesExpired    = prometheus.NewDesc("caddy_llm_routes_expired_total", "Learned routes and conversation pins dropped by TTL.", nil, nil)
	descPins             = prometheus.NewDesc("caddy_llm_conversation_pins", "Conversations pinned to an upstream.", nil, nil)
	descPhase            = prometheus.NewDesc("caddy_llm_upstream_phase_requests", "Requests this process has in flight to the upstream, by phase (prefill: before the first token, observed or predicted; decode: after).", []string{"upstream", "phase"}, nil)
	descQueuedPrefill    = prometheus.NewDesc("caddy_llm_upstream_queued_prefill_seconds", "Predicted seconds of prefill this process has queued on the upstream.", []string{"upstream"}, nil)
	descPrefillRate      = prometheus.NewDesc("caddy_llm_upstream_prefill_tokens_per_second", "Learned prefill rate of the upstream.", []string{"upstream"}, nil)
	descTokenSeconds     = prometheus.NewDesc("caddy_llm_upstream_output_token_seconds", "Learned time per output token of one sequence on the upstream.", []string{"upstream"}, nil)
	descOverhead         = prometheus.NewDesc("caddy_llm_upstream_first_token_overhead_seconds", "Learned time to first token beyond prefill on the upstream.", []string{"upstream"}, nil)
	descSlots            = prometheus.NewDesc("caddy_llm_upstream_slots", "Learned number of sequences the upstream runs before it queues (absent while unknown).", []string{"upstream"}, nil)
	descOverrun          = prometheus.NewDesc("caddy_llm_upstream_overrun", "How many times longer than predicted the requests in flight to the upstream have already run (the second longest; 0 below 1). The decision applies it only while no scrape shows other clients' requests there.", []string{"upstream"}, nil)
	descObservedPrompt   = prometheus.NewDesc("caddy_llm_observed_prompt_tokens_total", "Prompt tokens of the responses whose cached tokens the upstream reported, by its count.", []string{"upstream"}, nil)
	descPredictedCached  = prometheus.NewDesc("caddy_llm_predicted_cached_tokens_total", "Of those, the tokens predicted cached (scaled to the upstream's count).", []string{"upstream"}, nil)
	descObservedCached   = prometheus.NewDesc("caddy_llm_observed_cached_tokens_total", "Of those, the tokens the upstream reported cached (usage.prompt_tokens_details.cached_tokens).", []string{"upstream"}, nil)
	descConfirmedCached  = prometheus.NewDesc("caddy_llm_confirmed_cached_tokens_total", "Of those, the predicted tokens the upstream confirmed: the sum over responses of min(predicted, reported).", []string{"upstream"}, nil)
	descCorrections      = prometheus.NewDesc("caddy_llm_cache_corrections_total", "Responses reporting far fewer cached tokens than the route table claimed; claims as old are no longer credited.", []string{"upstream"}, nil)
	descEvictedClaims    = prometheus.NewDesc("caddy_llm_evicted_claims_total", "Route claims on the upstream a decision did not credit: since the prefix was last in use there, this proxy sent it more than its KV cache holds beside it.", []string{"upstream"}, nil)
	descTokenScale       = prometheus.NewDesc("caddy_llm_upstream_token_scale", "Learned tokens of the upstream's tokenizer per token of this process's count of the same prompts (1 until learned); the upstream's KV-cache figures are divided by it.", []string{"upstream"}, nil)
	descRestarts         = prometheus.NewDesc("caddy_llm_upstream_restarts_total", "Restarts of the upstream seen in its metrics; its routes were forgotten.", []string{"upstream"}, nil)
	descAvailability     = prometheus.NewDesc("caddy_llm_upstream_availability", "Adaptive availability of the upstream (0-1): the share of new work it takes relative to a healthy one (absent while availability is off).", []string{"upstream"}, nil)
)

func (stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descInflightTokens, descInflightRequests, descSaturated, descQueue, descRunning, descKV,
		descScrapeAge, descScrapeErrors, descRoutes, descRouteEvictions, descRoutesExpired, descPins,
		descPhase, descQueuedPrefill, descPrefillRate, descTokenSeconds, descOverhead, descSlots, descOverrun, descAvailability,
		descObservedPrompt, descPredictedCached, descObservedCached, descConfirmedCached, descCorrections, descEvictedClaims, descRestarts, descTokenScale} {
		ch <- d
	}
}

func (stateCollector) Collect(ch chan<- prometheus.Metric) {
	for _, u := range upstreamReport(false) {
		ch <- prometheus.MustNewConstMetric(descInflightTokens, prometheus.GaugeValue, float64(u.InflightTokens), u.Upstream)
		ch <- prometheus.MustNewConstMetric(descInflightRequests, prometheus.GaugeValue, float64(u.InflightRequests), u.Upstream)
		ch <- prometheus.MustNewConstMetric(descSaturated, prometheus.GaugeValue, boolFloat(u.Saturated), u.Upstream)
		ch <- prometheus.MustNewConstMetric(descPhase, prometheus.GaugeValue, float64(u.Prefilling), u.Upstream, "prefill")
		ch <- prometheus.MustNewConstMetric(descPhase, prometheus.GaugeValue, float64(u.Decoding), u.Upstream, "decode")
		ch <- prometheus.MustNewConstMetric(descQueuedPrefill, prometheus.GaugeValue, u.QueuedSeconds, u.Upstream)
		if c := u.cache; c != nil {
			ch <- prometheus.MustNewConstMetric(descObservedPrompt, prometheus.CounterValue, float64(c.Prompt), u.Upstream)
			ch <- prometheus.MustNewConstMetric(descPredictedCached, prometheus.CounterValue, float64(c.Predicted), u.Upstream)
			ch <- prometheus.MustNewConstMetric(descObservedCached, prometheus.CounterValue, float64(c.Cached), u.Upstream)
			ch <- prometheus.MustNewConstMetric(descConfirmedCached, prometheus.CounterValue, float64(c.Confirmed), u.Upstream)
			ch <- prometheus.MustNewConstMetric(descCorrections, prometheus.CounterValue, float64(c.Corrections), u.Upstream)
			ch <- prometheus.MustNewConstMetric(descEvictedClaims, prometheus.CounterValue, float64(c.Evicted), u.Upstream)
			ch <- prometheus.MustNewConstMetric(descRestarts, prometheus.CounterValue, float64(c.Restarts), u.Upstream)
		}
		if u.Availability != nil {
			ch <- prometheus.MustNewConstMetric(descAvailability, prometheus.GaugeValue, *u.Availability, u.Upstream)
		}
		if m := u.Model; m != nil {
			ch <- prometheus.MustNewConstMetric(descPrefillRate, prometheus.GaugeValue, m.PrefillTokensPerSecond, u.Upstream)
			ch <- prometheus.MustNewConstMetric(descTokenSeconds, prometheus.GaugeValue, m.TokenMS/1000, u.Upstream)
			ch <- prometheus.MustNewConstMetric(descOverhead, prometheus.GaugeValue, m.OverheadMS/1000, u.Upstream)
			if m.Slots > 0 {
				ch <- prometheus.MustNewConstMetric(descSlots, prometheus.GaugeValue, m.Slots, u.Upstream)
			}
			ch <- prometheus.MustNewConstMetric(descOverrun, prometheus.GaugeValue, m.Overrun, u.Upstream)
			ch <- prometheus.MustNewConstMetric(descTokenScale, prometheus.GaugeValue, m.TokenScale, u.Upstream)
		}
		if m := u.Metrics; m != nil {
			if m.Fresh {
				ch <- prometheus.MustNewConstMetric(descQueue, prometheus.GaugeValue, m.Waiting, u.Upstream)
				ch <- prometheus.MustNewConstMetric(descRunning, prometheus.GaugeValue, m.Running, u.Upstream)
				if m.KVUsage != nil {
					ch <- prometheus.MustNewConstMetric(descKV, prometheus.GaugeValue, *m.KVUsage, u.Upstream)
				}
			}
			if m.AgeSeconds >= 0 {
				ch <- prometheus.MustNewConstMetric(descScrapeAge, prometheus.GaugeValue, m.AgeSeconds, u.Upstream)
			}
			ch <- prometheus.MustNewConstMetric(descScrapeErrors, prometheus.CounterValue, float64(m.Errors), u.Upstream)
		}
	}
	if st := currentRoutesReport(); st.Provisioned {
		ch <- prometheus.MustNewConstMetric(descRoutes, prometheus.GaugeValue, float64(st.Routes))
		ch <- prometheus.MustNewConstMetric(descPins, prometheus.GaugeValue, float64(st.Pins))
		ch <- prometheus.MustNewConstMetric(descRouteEvictions, prometheus.CounterValue, float64(st.Evictions))
		ch <- prometheus.MustNewConstMetric(descRoutesExpired, prometheus.CounterValue, float64(st.Expired))
	}
}

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// upstreamStatus is what the admin endpoint and the metrics report about one upstream.
type upstreamStatus struct {
	Upstream         string `json:"upstream"`
	InflightTokens   int64  `json:"inflight_tokens"`
	InflightRequests int64  `json:"inflight_requests"`
	Saturated        bool   `json:"saturated"`
	// Prefilling and Decoding split InflightRequests by phase (observed first tokens, else predicted);
	// PrefillTokens is what the prefilling ones still have to prefill and QueuedSeconds how long that takes.
	Prefilling    int64   `json:"prefilling"`
	Decoding      int64   `json:"decoding"`
	PrefillTokens int64   `json:"prefill_tokens"`
	QueuedSeconds float64 `json:"queued_prefill_seconds"`
	// IdleSeconds is how long ago a request last began or ended there, or the policy first met the
	// upstream if none has (0 while any is in flight): an upstream a dynamic source dropped, or one
	// the policy has stopped choosing, keeps its row (and what was learned of it) with this growing.
	// Absent for an upstream only scraped so far.
	IdleSeconds *float64        `json:"idle_seconds,omitempty"`
	Model       *serviceModel   `json:"model,omitempty"`
	Routes      *int            `json:"learned_routes,omitempty"`
	Metrics     *scrapedMetrics `json:"metrics,omitempty"`
	// Availability is the upstream's adaptive availability (the lowest, if policies with different
	// controller settings track it); absent while availability is off.
	Availability *float64 `json:"availability,omitempty"`
	// Cache compares the predicted cache hits with what the backend reported (see cacheReport).
	Cache *cacheReport  `json:"cache,omitempty"`
	cache *cacheFigures // the counters behind Cache, for the metrics
}

// cacheReport is how well the route table predicts an upstream's cache, from the responses whose cached
// tokens the backend reported (the llm transport or llm_resume reads them), in the backend's tokens.
// PredictedHitRate is the share of their prompt tokens predicted cached, ObservedHitRate the share the
// backend reported cached, Precision the share of the predicted tokens it confirmed (absent before any
// prediction), Corrections the reports of far fewer than the route table claimed, EvictedClaims the claims
// not credited because this proxy has since sent the upstream more than its cache holds, HorizonSeconds how long
// the backend has lately kept a prefix (older claims are not credited; absent while no report denied
// one), Restarts the backend restarts seen in its metrics (its routes were forgotten) and Trust the share
// of its claims the decision believes.
type cacheReport struct {
	Requests         int64    `json:"observed_requests"`
	PredictedHitRate float64  `json:"predicted_hit_rate"`
	ObservedHitRate  float64  `json:"observed_hit_rate"`
	Precision        *float64 `json:"precision,omitempty"`
	Corrections      int64    `json:"corrections"`
	EvictedClaims    int64    `json:"evicted_claims"`
	HorizonSeconds   float64  `json:"horizon_seconds,omitempty"`
	Restarts         int64    `json:"restarts"`
	Trust            float64  `json:"trust"`
}

func reportCache(c cacheFigures) *cacheReport {
	r := &cacheReport{Requests: c.Requests, Corrections: c.Corrections, EvictedClaims: c.Evicted, Restarts: c.Restarts, Trust: c.Trust,
		HorizonSeconds: float64(c.Horizon) / 1e9}
	if c.Prompt > 0 {
		r.PredictedHitRate = float64(c.Predicted) / float64(c.Prompt)
		r.ObservedHitRate = float64(c.Cached) / float64(c.Prompt)
	}
	if c.Predicted > 0 {
		p := float64(c.Confirmed) / float64(c.Predicted)
		r.Precision = &p
	}
	return r
}

// serviceModel is the learned service of an upstream, as reported.
type serviceModel struct {
	PrefillTokensPerSecond float64 `json:"prefill_tokens_per_sec"`
	OverheadMS             float64 `json:"overhead_ms"`
	TokenMS                float64 `json:"ms_per_output_token"`
	Slots                  float64 `json:"slots,omitempty"` // 0: not known (no metrics, or never queued)
	MeanDurationSeconds    float64 `json:"mean_request_seconds"`
	// FirstTokens counts the first tokens observed (by the llm transport or llm_resume) that taught it.
	FirstTokens int `json:"first_tokens_observed"`
	// UnqueuedConcurrency is the most of this proxy's requests in flight there beside one whose observed
	// first token still came on time (selection.Service.Free): while the slot count is unknown, a first
	// token later than that teaches nothing and leaves the prefill queue where it was. Absent until a
	// first token is observed behind another request.
	UnqueuedConcurrency int `json:"unqueued_concurrency,omitempty"`
	// BusyIntervals counts the intervals between two scrapes over which the backend's own counters
	// taught it the prefill speed (when no first tokens are observed).
	BusyIntervals int `json:"busy_intervals_observed"`
	// Overrun is how many times longer than this model predicts the requests in flight there have already
	// run (the second longest overrun); absent below 1. The decision stretches the upstream's times by
	// its overrun over the other upstreams' median one.
	Overrun float64 `json:"overrun,omitempty"`
	// TokenScale is how many of the upstream's tokens one token of this proxy's count is, learned from
	// its usage reports or its finished requests' prompt tokens (vLLM's vllm:request_prompt_tokens,
	// SGLang's sglang:prompt_tokens_total; 1 until learned): its KV-cache size, usage and
	// busy-interval prefill are divided by it, to compare with the prompts this proxy counts.
	TokenScale float64 `json:"token_scale"`
}

func reportService(s selection.Service, overrun, tokenScale float64) *serviceModel {
	m := &serviceModel{OverheadMS: 1000 * s.Overhead, TokenMS: 1000 * s.TokenSeconds, Slots: s.Slots, MeanDurationSeconds: s.MeanDuration, FirstTokens: s.FirstTokens, UnqueuedConcurrency: s.Free, BusyIntervals: s.BusyIntervals, Overrun: overrun, TokenScale: tokenScale}
	if s.PrefillSecondsPerToken > 0 {
		m.PrefillTokensPerSecond = 1 / s.PrefillSecondsPerToken
	}
	return m
}

type scrapedMetrics struct {
	Flavor     string   `json:"flavor,omitempty"`
	Running    float64  `json:"running"`
	Waiting    float64  `json:"waiting"`
	KVUsage    *float64 `json:"kv_cache_usage,omitempty"` // absent for a server that does not report it (llama.cpp)
	BlockSize  int      `json:"block_size,omitempty"`
	NumBlocks  int      `json:"num_blocks,omitempty"`
	AgeSeconds float64  `json:"age_seconds"` // -1 before the first good scrape
	Fresh      bool     `json:"fresh"`
	Errors     uint64   `json:"errors"`
	LastError  string   `json:"last_error,omitempty"`
	// LastErrorAgeSeconds is the time since LastError; beside AgeSeconds it tells a failure that is over
	// from one that is not. Absent with LastError.
	LastErrorAgeSeconds *float64 `json:"last_error_age_seconds,omitempty"`
	// LoRA is the adapter residency the upstream reports (vLLM with LoRA enabled); absent otherwise.
	LoRA *loraReport `json:"lora,omitempty"`
}

type loraReport struct {
	Running []string `json:"running"`
	Waiting []string `json:"waiting"`
	MaxLoRA int      `json:"max_lora"`
}

func splitAdapters(list string) []string {
	if list == "" {
		return []string{}
	}
	return strings.Split(list, ",")
}

// liveScrapes are the scrape sets of every provisioned policy, for reporting.
var (
	liveScrapesMu sync.Mutex
	liveScrapes   []*scrapes
)

func addLiveScrapes(sc *scrapes) {
	liveScrapesMu.Lock()
	liveScrapes = append(liveScrapes, sc)
	liveScrapesMu.Unlock()
}

func removeLiveScrapes(sc *scrapes) {
	liveScrapesMu.Lock()
	liveScrapes = slices.DeleteFunc(liveScrapes, func(x *scrapes) bool { return x == sc })
	liveScrapesMu.Unlock()
}

// upstreamReport describes every upstream this process has routed to or scrapes, sorted by address.
// withRoutes adds each one's learned route count (O(routes)).
func upstreamReport(withRoutes bool) []upstreamStatus {
	now := time.Now().UnixNano()
	var out []upstreamStatus
	index := make(map[string]int)
	for _, l := range loads.snapshot(now) {
		index[l.Dial] = len(out)
		out = append(out, upstreamStatus{
			Upstream: l.Dial, InflightTokens: l.Tokens, InflightRequests: l.Requests,
			Saturated: loads.saturated(l.Dial, now), Prefilling: l.Prefilling, Decoding: l.Decoding,
			PrefillTokens: l.PrefillTokens, QueuedSeconds: l.QueuedSeconds, IdleSeconds: &l.IdleSeconds, Model: reportService(l.Service, l.Overrun, l.TokenScale),
			Cache: reportCache(l.Cache), cache: &l.Cache,
		})
	}
	liveScrapesMu.Lock()
	scrapeSets := slices.Clone(liveScrapes)
	liveScrapesMu.Unlock()
	for _, sc := range scrapeSets {
		sc.mu.RLock()
		dials := make([]string, 0, len(sc.handles))
		for dial := range sc.handles {
			dials = append(dials, dial)
		}
		sc.mu.RUnlock()
		for _, dial := range dials {
			i, ok := index[dial]
			if !ok {
				i = len(out)
				index[dial] = i
				out = append(out, upstreamStatus{Upstream: dial})
			}
			if out[i].Metrics != nil {
				continue
			}
			sc.dropUnusable(dial) // an upstream whose metrics never answered is dropped without traffic too
			if st, ok := sc.status(dial); ok {
				out[i].Metrics = reportScrape(st)
			}
		}
	}
	if tables := allRoutes(); withRoutes && len(tables) > 0 {
		for i := range out {
			n := 0
			for _, t := range tables {
				n += t.RouteCount(out[i].Upstream)
			}
			out[i].Routes = &n
		}
	}
	for i := range out {
		if a, ok := reportedAvailability(out[i].Upstream); ok {
			out[i].Availability = &a
		}
	}
	slices.SortFunc(out, func(a, b upstreamStatus) int { return strings.Compare(a.Upstream, b.Upstream) })
	return out
}

func reportScrape(st scraper.Status) *scrapedMetrics {
	m := &scrapedMetrics{
		Flavor: st.Snapshot.Flavor, Running: st.Snapshot.Running, Waiting: st.Snapshot.Waiting,
		BlockSize: st.Snapshot.BlockSize, NumBlocks: st.Snapshot.NumBlocks,
		AgeSeconds: -1, Fresh: st.Fresh, Errors: st.Errors, LastError: st.LastError,
	}
	if !st.Snapshot.At.IsZero() {
		m.AgeSeconds = st.Age.Seconds()
	}
	if st.Snapshot.KVReported || st.Snapshot.At.IsZero() {
		kv := st.Snapshot.KVUsage // 0 before the first good scrape, as the other figures
		m.KVUsage = &kv
	}
	if st.LastError != "" {
		age := st.LastErrorAge.Seconds()
		m.LastErrorAgeSeconds = &age
	}
	if l := st.Snapshot.LoRA; l.Reported() {
		m.LoRA = &loraReport{Running: splitAdapters(l.Running), Waiting: splitAdapters(l.Waiting), MaxLoRA: l.MaxLoRA}
	}
	return m
}
