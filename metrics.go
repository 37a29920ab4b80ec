package caddyllm

import (
	"errors"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

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
	descScrapesForward   = prometheus.NewDesc("caddy_llm_upstream_scrapes_brought_forward_total", "Scrapes of the upstream brought before the interval: a hot prefix's decision found requests waiting at a batch size seen once, or, in a pool of several kinds of engine, its kind's prefill wanted more spans.", []string{"upstream"}, nil)
	descRoutes           = prometheus.NewDesc("caddy_llm_routes", "Learned prefix routes.", nil, nil)
	descRouteEvictions   = prometheus.NewDesc("caddy_llm_route_evictions_total", "Learned routes and conversation pins evicted by capacity.", nil, nil)
	descRoutesExpired    = prometheus.NewDesc("caddy_llm_routes_expired_total", "Learned routes and conversation pins dropped by TTL.", nil, nil)
	descPins             = prometheus.NewDesc("caddy_llm_conversation_pins", "Conversations pinned to an upstream.", nil, nil)
	descPhase            = prometheus.NewDesc("caddy_llm_upstream_phase_requests", "Requests this process has in flight to the upstream, by phase (prefill: before the first token, observed or predicted; decode: after).", []string{"upstream", "phase"}, nil)
	descQueuedPrefill    = prometheus.NewDesc("caddy_llm_upstream_queued_prefill_seconds", "Predicted seconds of prefill this process has queued on the upstream.", []string{"upstream"}, nil)
	descPrefillRate      = prometheus.NewDesc("caddy_llm_upstream_prefill_tokens_per_second", "Learned prefill rate of the upstream.", []string{"upstream"}, nil)
	descTokenSeconds     = prometheus.NewDesc("caddy_llm_upstream_output_token_seconds", "Learned time per output token of one sequence on the upstream.", []string{"upstream"}, nil)
	descSequenceSeconds  = prometheus.NewDesc("caddy_llm_upstream_step_seconds_per_sequence", "Learned time each sequence in the batch adds to an engine step of the upstream (absent until busy intervals between scrapes have taught it).", []string{"upstream"}, nil)
	descPricedPrefill    = prometheus.NewDesc("caddy_llm_upstream_priced_prefill_tokens_per_second", "Prefill rate of the upstream as the last decision that weighed it priced it (the learned one blended with the fleet's, aligned with alike upstreams, stretched by its overrun).", []string{"upstream"}, nil)
	descPricedToken      = prometheus.NewDesc("caddy_llm_upstream_priced_output_token_seconds", "Time per output token of the upstream as the last decision that weighed it priced it.", []string{"upstream"}, nil)
	descPricedOverhead   = prometheus.NewDesc("caddy_llm_upstream_priced_first_token_overhead_seconds", "Time to first token beyond prefill of the upstream as the last decision that weighed it priced it.", []string{"upstream"}, nil)
	descOverhead         = prometheus.NewDesc("caddy_llm_upstream_first_token_overhead_seconds", "Learned time to first token beyond prefill on the upstream.", []string{"upstream"}, nil)
	descSlots            = prometheus.NewDesc("caddy_llm_upstream_slots", "Learned number of sequences the upstream runs before it queues (absent while unknown).", []string{"upstream"}, nil)
	descOverrun          = prometheus.NewDesc("caddy_llm_upstream_overrun", "How many times longer than predicted the requests in flight to the upstream have already run (the second longest; 0 below 1). The decision applies it only while no scrape shows other clients' requests there.", []string{"upstream"}, nil)
	descLate             = prometheus.NewDesc("caddy_llm_upstream_first_token_lateness", "How many times their predicted time the upstream's first tokens have lately taken, by its own time-to-first-token histogram (absent until known).", []string{"upstream"}, nil)
	descEnginePrefill    = prometheus.NewDesc("caddy_llm_upstream_engine_prefill_tokens_per_second", "Prefill rate of the upstream as its engine measures it, from its prefill-time and computed-tokens histograms (reported, not used by the decision; absent until known).", []string{"upstream"}, nil)
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
		descScrapeAge, descScrapeErrors, descScrapesForward, descRoutes, descRouteEvictions, descRoutesExpired, descPins,
		descPhase, descQueuedPrefill, descPrefillRate, descTokenSeconds, descSequenceSeconds, descOverhead, descPricedPrefill, descPricedToken, descPricedOverhead, descSlots, descOverrun, descLate, descEnginePrefill, descAvailability,
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
			if m.SequenceMS > 0 {
				ch <- prometheus.MustNewConstMetric(descSequenceSeconds, prometheus.GaugeValue, m.SequenceMS/1000, u.Upstream)
			}
			if m.Slots > 0 {
				ch <- prometheus.MustNewConstMetric(descSlots, prometheus.GaugeValue, m.Slots, u.Upstream)
			}
			ch <- prometheus.MustNewConstMetric(descOverrun, prometheus.GaugeValue, m.Overrun, u.Upstream)
			if m.FirstTokensLate > 0 {
				ch <- prometheus.MustNewConstMetric(descLate, prometheus.GaugeValue, m.FirstTokensLate, u.Upstream)
			}
			if m.EnginePrefillTokensPerSecond > 0 {
				ch <- prometheus.MustNewConstMetric(descEnginePrefill, prometheus.GaugeValue, m.EnginePrefillTokensPerSecond, u.Upstream)
			}
			ch <- prometheus.MustNewConstMetric(descTokenScale, prometheus.GaugeValue, m.TokenScale, u.Upstream)
		}
		if m := u.Priced; m != nil {
			ch <- prometheus.MustNewConstMetric(descPricedPrefill, prometheus.GaugeValue, m.PrefillTokensPerSecond, u.Upstream)
			ch <- prometheus.MustNewConstMetric(descPricedToken, prometheus.GaugeValue, m.TokenMS/1000, u.Upstream)
			ch <- prometheus.MustNewConstMetric(descPricedOverhead, prometheus.GaugeValue, m.OverheadMS/1000, u.Upstream)
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
			ch <- prometheus.MustNewConstMetric(descScrapesForward, prometheus.CounterValue, float64(m.BroughtForward), u.Upstream)
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
