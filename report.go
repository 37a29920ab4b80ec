package caddyllm

// What /llm/upstreams (admin.go) and the state collector (metrics.go) report: one status per upstream,
// gathered from the loads, the scrape sets and the route tables.

import (
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/tokenrouter/caddy-llm/scraper"
)

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
	Priced      *pricedModel    `json:"priced,omitempty"`
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
	// SequenceMS is how much longer each engine step runs for one more sequence in the batch, learned
	// from the busy intervals (the generated tokens beside the steps); absent until they have.
	SequenceMS          float64 `json:"step_ms_per_sequence,omitempty"`
	Slots               float64 `json:"slots,omitempty"` // 0: not known (no metrics, or never queued)
	MeanDurationSeconds float64 `json:"mean_request_seconds"`
	// FirstTokens counts the first tokens observed (by the llm transport or llm_resume) that taught it.
	FirstTokens int `json:"first_tokens_observed"`
	// SkippedFirstTokens counts the first tokens observed that taught it nothing: predicted to wait
	// longer than their own service, come before their predicted wait ended, or (the slot count unknown)
	// probably waiting for a slot. Many of them mean the queue it predicts there is often wrong.
	SkippedFirstTokens int `json:"first_tokens_skipped"`
	// UnqueuedConcurrency is the most of this proxy's requests in flight there beside one whose observed
	// first token still came on time (selection.Service.Free): while the slot count is unknown, a first
	// token later than that teaches nothing and leaves the prefill queue where it was. Absent until a
	// first token is observed behind another request.
	UnqueuedConcurrency int `json:"unqueued_concurrency,omitempty"`
	// BusyIntervals counts the intervals between two scrapes over which the backend's own counters
	// taught it the prefill speed (when no first tokens are observed).
	BusyIntervals int `json:"busy_intervals_observed"`
	// StepsVsPrior is how many times the prior's time (30 ms a decode step, 8k prefill tokens/s) the
	// backend's engine steps took between two scrapes, over the last StepScrapes pairs of them (about
	// ten count): compared with the other upstreams', it scales what this one borrows from them while
	// it has few observations of its own. Absent without a step counter in its metrics (vLLM's).
	StepsVsPrior float64 `json:"steps_vs_prior,omitempty"`
	StepScrapes  int     `json:"step_scrapes_observed,omitempty"`
	// Overrun is how many times longer than this model predicts the requests in flight there have already
	// run (the second longest overrun); absent below 1. The decision stretches the upstream's times by
	// its overrun over the other upstreams' median one.
	Overrun float64 `json:"overrun,omitempty"`
	// TokenScale is how many of the upstream's tokens one token of this proxy's count is, learned from
	// its usage reports or its finished requests' prompt tokens (vLLM's vllm:request_prompt_tokens,
	// SGLang's sglang:prompt_tokens_total; 1 until learned): its KV-cache size, usage and
	// busy-interval prefill are divided by it, to compare with the prompts this proxy counts.
	TokenScale float64 `json:"token_scale"`
	// FirstTokensLate is how many times their predicted time the upstream's first tokens have lately
	// taken, by its own count (vLLM's vllm:time_to_first_token_seconds, SGLang's), against what the
	// decision's model predicted for the requests sent there: absent until eight are compared, or
	// without that histogram. Reported, not used by the decision (firstTokenCheck).
	FirstTokensLate float64 `json:"first_tokens_late,omitempty"`
	// EnginePrefillTokensPerSecond is the upstream's prefill speed as its engine measures it, in this
	// proxy's tokens: the prompt tokens its recently finished requests computed over their times from
	// first scheduled to first token (vLLM's vllm:request_prefill_kv_computed_tokens and
	// vllm:request_prefill_time_seconds): absent until eight have finished, or without those histograms.
	// Reported, not used by the decision (enginePrefill).
	EnginePrefillTokensPerSecond float64 `json:"engine_prefill_tokens_per_sec,omitempty"`
}

// reportService is u's learned service and the figures learned beside it, as reported.
func reportService(u *upstreamInflight) *serviceModel {
	s := &u.Service
	m := &serviceModel{OverheadMS: 1000 * s.Overhead, TokenMS: 1000 * s.TokenSeconds, SequenceMS: 1000 * s.SequenceSeconds, Slots: s.Slots, MeanDurationSeconds: s.MeanDuration, FirstTokens: s.FirstTokens, SkippedFirstTokens: s.SkippedFirstTokens, UnqueuedConcurrency: s.Free, BusyIntervals: s.BusyIntervals,
		Overrun: u.Overrun, TokenScale: u.TokenScale, FirstTokensLate: u.Late, EnginePrefillTokensPerSecond: u.EnginePrefill}
	if s.PrefillSecondsPerToken > 0 {
		m.PrefillTokensPerSecond = 1 / s.PrefillSecondsPerToken
	}
	m.StepsVsPrior, m.StepScrapes = s.StepsVsPrior()
	return m
}

// pricedModel is an upstream's service as the last decision that weighed it priced it: the learned model
// (serviceModel) blended with the fleet's while it has few samples of its own, priced at the speed of the
// alike backends where its work between scrapes is measured (selection.Fleet.Align), and stretched by its
// overrun. Where it differs from the learned model, this is what the decision used. AgeSeconds is how long
// ago that decision was; with several policies over one upstream, it is the latest's.
type pricedModel struct {
	PrefillTokensPerSecond float64 `json:"prefill_tokens_per_sec"`
	OverheadMS             float64 `json:"overhead_ms"`
	TokenMS                float64 `json:"ms_per_output_token"`
	AgeSeconds             float64 `json:"age_seconds"`
}

// reportPriced returns p as reported at now; nil if no decision has priced the upstream.
func reportPriced(p pricedService, now int64) *pricedModel {
	if p.at == 0 {
		return nil
	}
	m := &pricedModel{OverheadMS: 1000 * p.overhead, TokenMS: 1000 * p.tokenSeconds, AgeSeconds: max(float64(now-p.at)/1e9, 0)}
	if p.prefillSecondsPerToken > 0 {
		m.PrefillTokensPerSecond = 1 / p.prefillSecondsPerToken
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
	// BroughtForward counts the scrapes brought before the interval because a hot prefix's decision
	// found requests waiting at a ceiling seen once, or because, in a pool of several kinds of engine,
	// the upstream's kind wanted more spans for its prefill's fit (How it decides, 2).
	BroughtForward uint64 `json:"brought_forward"`
	LastError      string `json:"last_error,omitempty"`
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
			PrefillTokens: l.PrefillTokens, QueuedSeconds: l.QueuedSeconds, IdleSeconds: &l.IdleSeconds, Model: reportService(&l),
			Priced: reportPriced(l.Priced, now),
			Cache:  reportCache(l.Cache), cache: &l.Cache,
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
		AgeSeconds: -1, Fresh: st.Fresh, Errors: st.Errors, BroughtForward: st.BroughtForward, LastError: st.LastError,
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
