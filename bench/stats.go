package main

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// percentile returns the p-th percentile (0-100) of sorted values with linear interpolation
// between closest ranks, as numpy.percentile (and so vLLM's bench serve) computes it. It returns
// NaN for no values.
func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	if len(sorted) == 1 {
		return sorted[0]
	}
	rank := p / 100 * float64(len(sorted)-1)
	lo := int(math.Floor(rank))
	hi := int(math.Ceil(rank))
	if lo < 0 {
		lo = 0
	}
	if hi >= len(sorted) {
		hi = len(sorted) - 1
	}
	frac := rank - float64(lo)
	return sorted[lo] + (sorted[hi]-sorted[lo])*frac
}

// mean returns the arithmetic mean of values, NaN for none.
func mean(values []float64) float64 {
	if len(values) == 0 {
		return math.NaN()
	}
	sum := 0.0
	for _, v := range values {
		sum += v
	}
	return sum / float64(len(values))
}

// distribution summarises a set of values.
type distribution struct {
	P50, P90, P99, Mean float64
	sorted              []float64
}

// newDistribution sorts a copy of values and computes its percentiles.
func newDistribution(values []float64) distribution {
	s := slices.Clone(values)
	slices.Sort(s)
	return distribution{
		P50:    percentile(s, 50),
		P90:    percentile(s, 90),
		P99:    percentile(s, 99),
		Mean:   mean(s),
		sorted: s,
	}
}

// requestResult is what the load generator measured for one request.
type requestResult struct {
	// Seq is the order in which the request was sent; the first warm-up ones are not measured.
	Seq    int
	Warmup bool
	// Arrival is set for a session's first request, the one sent at a Poisson arrival time.
	Arrival bool
	// Sent and End are wall-clock times; Lag is how late the request left versus its scheduled
	// arrival (zero for follow-up turns, which are sent when the previous turn ends).
	Sent, End time.Time
	Lag       time.Duration
	// TTFT is the time to the first chunk with content; E2E to the end of the stream.
	TTFT, E2E time.Duration
	// Proxy is the wall time from Sent to the request's arrival at the backend that answered (the
	// simulator's X-Sim-Arrived): the proxy's own time, the policy's included; 0 when unknown.
	Proxy        time.Duration
	PromptTokens int
	CachedTokens int
	OutputTokens int
	// MaxTokens is what the request asked for; ContentBytes the streamed content received; ExtraEvents
	// the events after [DONE] (there should be none). -faults counts a stream complete when it has all
	// MaxTokens tokens and one [DONE].
	MaxTokens    int
	ContentBytes int
	ExtraEvents  int
	// Matched and PolicyPrompt are the llm policy's predicted cached tokens and prompt tokens, in its
	// own tokenizer's count (0 for other policies).
	Matched, PolicyPrompt int
	// PredictedTTFT is the llm policy's predicted time to first token for the backend it chose, in
	// wall milliseconds (0 for other policies).
	PredictedTTFT float64
	// Reason is why the llm policy chose that backend (http.llm.upstream_reason: load, affinity,
	// conversation, guard, fallback; "" for other policies).
	Reason string
	Failed bool
	Status int
	Err    string
	// Upstream is the backend that answered, when the proxy says so (X-Upstream), and
	// Conversation the request's X-Conversation-ID.
	Upstream, Conversation string
}

// Summary is one policy's figures on one workload. Latencies are in simulated milliseconds (wall
// time multiplied by the simulators' time scale, so they read like a real GPU's) and throughput is
// per simulated second; lag is in wall milliseconds.
type Summary struct {
	Policy    string `json:"policy"`
	Requests  int    `json:"requests"`
	Completed int    `json:"completed"`
	Failed    int    `json:"failed"`
	// FirstError is what the first measured request that failed got (its status and error, cut to
	// maxFirstError bytes), so that a run whose requests failed says why; empty when none failed.
	FirstError string  `json:"first_error,omitempty"`
	TTFTP50    float64 `json:"ttft_p50_ms"`
	TTFTP90    float64 `json:"ttft_p90_ms"`
	TTFTP99    float64 `json:"ttft_p99_ms"`
	TTFTMean   float64 `json:"ttft_mean_ms"`
	// NetTTFTP50 and NetTTFTP99 are the TTFT percentiles with the proxy's own wall time (Proxy)
	// counted once, as a deployment counts it, instead of time-scale times: the simulators run that
	// much faster than real time, but the proxy and the policy in it do not. ProxyP50 and ProxyP99
	// are that wall time's percentiles (wall milliseconds). Zero when the backends do not say when a
	// request arrived.
	NetTTFTP50 float64 `json:"net_ttft_p50_ms,omitempty"`
	NetTTFTP99 float64 `json:"net_ttft_p99_ms,omitempty"`
	// LateTTFTP50 and LateTTFTP99 are the TTFT percentiles of the requests sent after the run's first
	// quarter (lateFraction, in send order, warm-up included): what the policies do once every one of
	// them has seen traffic, the caches are warm and the llm policy's service models are learned (a
	// bare policy learns a backend's slot count from its scrapes, its speeds from requests that end).
	LateTTFTP50      float64 `json:"late_ttft_p50_ms,omitempty"`
	LateTTFTP99      float64 `json:"late_ttft_p99_ms,omitempty"`
	ProxyP50         float64 `json:"proxy_p50_wall_ms,omitempty"`
	ProxyP99         float64 `json:"proxy_p99_wall_ms,omitempty"`
	E2EP50           float64 `json:"e2e_p50_ms"`
	E2EP90           float64 `json:"e2e_p90_ms"`
	E2EP99           float64 `json:"e2e_p99_ms"`
	E2EMean          float64 `json:"e2e_mean_ms"`
	TPOTP50          float64 `json:"tpot_p50_ms"`
	TPOTP99          float64 `json:"tpot_p99_ms"`
	TPOTMean         float64 `json:"tpot_mean_ms"`
	OutputTokensPerS float64 `json:"output_tokens_per_s"`
	RequestsPerS     float64 `json:"requests_per_s"`
	CacheHitRate     float64 `json:"cache_hit_rate"`
	ClientCachedRate float64 `json:"client_cached_rate"`
	// PredictedCachedRate is the share of prompt tokens the llm policy predicted cached and
	// PredictionPrecision the share of those the backends reported cached (per request, the smaller of
	// the two, in the backends' tokens); zero for other policies.
	PredictedCachedRate float64 `json:"predicted_cached_rate,omitempty"`
	PredictionPrecision float64 `json:"prediction_precision,omitempty"`
	BackendRequests     []int   `json:"backend_requests"`
	// BackendTTFTP50 is, for each backend in BackendRequests' order, the TTFT median of the measured
	// requests it answered (0: none, or the responses did not name it): whether the requests a policy
	// concentrated on one backend were answered sooner or later than the rest.
	BackendTTFTP50 []float64 `json:"backend_ttft_p50_ms,omitempty"`
	LagP50         float64   `json:"sched_lag_p50_wall_ms"`
	LagP99         float64   `json:"sched_lag_p99_wall_ms"`
	LagMax         float64   `json:"sched_lag_max_wall_ms"`
	WallSeconds    float64   `json:"wall_seconds"`
	// CPUPercent is the CPU time of the whole benchmark process (Caddy, simulators and load
	// generator) during the run, in percent of one core.
	CPUPercent float64 `json:"cpu_percent_of_one_core"`
	Skipped    string  `json:"skipped,omitempty"`
	ttft       []float64
}

// maxFirstError bounds Summary.FirstError.
const maxFirstError = 300

// firstError describes a failed request for Summary.FirstError: its status (0: no answer) and error.
func firstError(r requestResult) string {
	e := fmt.Sprintf("status %d: %s", r.Status, r.Err)
	if len(e) > maxFirstError {
		e = strings.ToValidUTF8(e[:maxFirstError], "") + "..."
	}
	return e
}

// backendTTFTP50 returns Summary.BackendTTFTP50 of results for the backends at dials (the addresses the
// responses name in X-Upstream); scale converts wall durations to simulated ones.
func backendTTFTP50(results []requestResult, dials []string, scale float64) []float64 {
	by := make(map[string][]float64, len(dials))
	for _, r := range results {
		if !r.Warmup && !r.Failed && r.Upstream != "" {
			by[r.Upstream] = append(by[r.Upstream], ms(r.TTFT)*scale)
		}
	}
	out := make([]float64, len(dials))
	for i, d := range dials {
		if xs := by[d]; len(xs) > 0 {
			out[i] = round3(newDistribution(xs).P50)
		}
	}
	return out
}

// summarize computes a policy's figures from its measured (non-warm-up) requests. scale converts
// wall durations to simulated ones.
func summarize(policy string, results []requestResult, scale float64) Summary {
	s := Summary{Policy: policy}
	var ttft, e2e, tpot, lag, net, proxy, late []float64
	lateFrom := int(float64(len(results)) * lateFraction)
	var first, last time.Time
	outTokens, prompt, cached := 0, 0, 0
	var predicted, confirmed float64
	for _, r := range results {
		if r.Arrival {
			lag = append(lag, ms(r.Lag))
		}
		if r.Warmup {
			continue
		}
		s.Requests++
		if r.Failed {
			s.Failed++
			if s.FirstError == "" {
				s.FirstError = firstError(r)
			}
			continue
		}
		s.Completed++
		if first.IsZero() || r.Sent.Before(first) {
			first = r.Sent
		}
		if r.End.After(last) {
			last = r.End
		}
		ttft = append(ttft, ms(r.TTFT)*scale)
		if r.Seq >= lateFrom {
			late = append(late, ms(r.TTFT)*scale)
		}
		if r.Proxy > 0 {
			proxy = append(proxy, ms(r.Proxy))
			net = append(net, ms(r.TTFT-r.Proxy)*scale+ms(r.Proxy))
		}
		e2e = append(e2e, ms(r.E2E)*scale)
		if r.OutputTokens > 1 {
			tpot = append(tpot, ms(r.E2E-r.TTFT)*scale/float64(r.OutputTokens-1))
		}
		outTokens += r.OutputTokens
		prompt += r.PromptTokens
		cached += r.CachedTokens
		if r.Matched > 0 && r.PolicyPrompt > 0 && r.PromptTokens > 0 {
			m := float64(r.Matched) * float64(r.PromptTokens) / float64(r.PolicyPrompt) // in backend tokens
			predicted += m
			confirmed += min(m, float64(r.CachedTokens))
		}
	}
	t, e, p, l := newDistribution(ttft), newDistribution(e2e), newDistribution(tpot), newDistribution(lag)
	for _, d := range []*distribution{&t, &e, &p, &l} {
		d.P50, d.P90, d.P99, d.Mean = finite(d.P50), finite(d.P90), finite(d.P99), finite(d.Mean)
	}
	s.TTFTP50, s.TTFTP90, s.TTFTP99, s.TTFTMean = t.P50, t.P90, t.P99, t.Mean
	s.E2EP50, s.E2EP90, s.E2EP99, s.E2EMean = e.P50, e.P90, e.P99, e.Mean
	s.TPOTP50, s.TPOTP99, s.TPOTMean = p.P50, p.P99, p.Mean
	s.LagP50, s.LagP99 = l.P50, l.P99
	if len(l.sorted) > 0 {
		s.LagMax = l.sorted[len(l.sorted)-1]
	}
	if span := last.Sub(first).Seconds() * scale; span > 0 {
		s.OutputTokensPerS = float64(outTokens) / span
		s.RequestsPerS = float64(s.Completed) / span
	}
	if prompt > 0 {
		s.ClientCachedRate = float64(cached) / float64(prompt)
		s.PredictedCachedRate = round3(predicted/float64(prompt)*1e3) / 1e3
	}
	if predicted > 0 {
		s.PredictionPrecision = round3(confirmed/predicted*1e3) / 1e3
	}
	if len(net) == len(ttft) && len(net) > 0 { // every answer said when it arrived
		n, x := newDistribution(net), newDistribution(proxy)
		s.NetTTFTP50, s.NetTTFTP99, s.ProxyP50, s.ProxyP99 = n.P50, n.P99, x.P50, x.P99
	}
	if len(late) > 0 {
		d := newDistribution(late)
		s.LateTTFTP50, s.LateTTFTP99 = d.P50, d.P99
	}
	s.ttft = t.sorted
	for _, f := range []*float64{&s.TTFTP50, &s.TTFTP90, &s.TTFTP99, &s.TTFTMean, &s.E2EP50, &s.E2EP90, &s.E2EP99,
		&s.E2EMean, &s.TPOTP50, &s.TPOTP99, &s.TPOTMean, &s.OutputTokensPerS, &s.RequestsPerS, &s.ClientCachedRate,
		&s.LagP50, &s.LagP99, &s.LagMax, &s.NetTTFTP50, &s.NetTTFTP99, &s.LateTTFTP50, &s.LateTTFTP99, &s.ProxyP50, &s.ProxyP99} {
		*f = round3(*f)
	}
	return s
}

// round3 rounds to 3 decimals so that results.json stays readable.
func round3(x float64) float64 { return math.Round(x*1000) / 1000 }

// ms converts a duration to float milliseconds.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// finite maps NaN (no data) to 0 so that results.json stays valid JSON.
func finite(x float64) float64 {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return 0
	}
	return x
}
