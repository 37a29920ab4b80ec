package main

import (
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	data := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	tests := []struct {
		p, want float64
	}{
		{0, 1}, {50, 5.5}, {90, 9.1}, {99, 9.91}, {100, 10},
	}
	for _, tt := range tests {
		if got := percentile(data, tt.p); math.Abs(got-tt.want) > 1e-9 {
			t.Errorf("percentile(1..10, %v) = %v, want %v", tt.p, got, tt.want)
		}
	}
	if got := percentile([]float64{7}, 99); got != 7 {
		t.Errorf("percentile([7], 99) = %v, want 7", got)
	}
	if got := percentile(nil, 50); !math.IsNaN(got) {
		t.Errorf("percentile(nil, 50) = %v, want NaN", got)
	}
}

func TestDistributionSortsACopy(t *testing.T) {
	in := []float64{3, 1, 2}
	d := newDistribution(in)
	if d.P50 != 2 || d.Mean != 2 || in[0] != 3 {
		t.Errorf("newDistribution(3,1,2) = p50 %v mean %v (input now %v), want 2, 2, unchanged", d.P50, d.Mean, in)
	}
}

func TestSummarize(t *testing.T) {
	t0 := time.Unix(1000, 0)
	res := []requestResult{
		{Seq: 0, Warmup: true, Arrival: true, Sent: t0, End: t0.Add(time.Second), TTFT: time.Second, E2E: time.Second, OutputTokens: 5},
		{Seq: 1, Arrival: true, Lag: 2 * time.Millisecond, Sent: t0, End: t0.Add(110 * time.Millisecond),
			TTFT: 10 * time.Millisecond, E2E: 110 * time.Millisecond, OutputTokens: 11, PromptTokens: 100, CachedTokens: 50},
		{Seq: 2, Sent: t0.Add(100 * time.Millisecond), End: t0.Add(200 * time.Millisecond),
			TTFT: 30 * time.Millisecond, E2E: 100 * time.Millisecond, OutputTokens: 9, PromptTokens: 100},
		{Seq: 3, Failed: true, Sent: t0, End: t0.Add(time.Millisecond), E2E: time.Millisecond, Status: 502, Err: "bad gateway"},
		{Seq: 4, Warmup: true, Failed: true, Err: "a warm-up's"},
		{Seq: 5, Failed: true, Err: strings.Repeat("x", 1000)},
	}
	s := summarize("p", res, 10)
	if s.Requests != 4 || s.Completed != 2 || s.Failed != 2 {
		t.Errorf("requests/completed/failed = %d/%d/%d, want 4/2/2", s.Requests, s.Completed, s.Failed)
	}
	if s.FirstError != "status 502: bad gateway" {
		t.Errorf("first error %q, want the first measured failure's status and error", s.FirstError)
	}
	if e := firstError(res[5]); len(e) > maxFirstError+3 || !strings.HasSuffix(e, "...") {
		t.Errorf("a 1000-byte error kept as %d bytes, want at most %d ending in ...", len(e), maxFirstError+3)
	}
	if s.TTFTP50 != 200 || s.E2EMean != 1050 {
		t.Errorf("TTFT p50 = %v, E2E mean = %v (simulated ms), want 200 and 1050", s.TTFTP50, s.E2EMean)
	}
	// TPOT: (110-10)/10 = 10 ms and (100-30)/8 = 8.75 ms, times the scale
	if math.Abs(s.TPOTP50-93.75) > 1e-9 {
		t.Errorf("TPOT p50 = %v, want 93.75", s.TPOTP50)
	}
	// 20 tokens over 200 ms wall = 2 simulated seconds
	if math.Abs(s.OutputTokensPerS-10) > 1e-9 {
		t.Errorf("output tokens/s = %v, want 10", s.OutputTokensPerS)
	}
	if s.ClientCachedRate != 0.25 {
		t.Errorf("client cached rate = %v, want 0.25", s.ClientCachedRate)
	}
	if s.LagMax != 2 {
		t.Errorf("lag max = %v, want 2 (wall ms over arrivals, warm-up included)", s.LagMax)
	}
}

// The proxy's own wall time counts once in the net TTFT, the rest of a TTFT time-scale times; without
// it on every answer there is no net figure at all (an average over some requests would mislead).
func TestSummarizeNetOfProxy(t *testing.T) {
	t0 := time.Unix(1000, 0)
	res := []requestResult{
		{Seq: 0, Sent: t0, End: t0.Add(100 * time.Millisecond), TTFT: 20 * time.Millisecond, E2E: 100 * time.Millisecond, Proxy: 4 * time.Millisecond},
		{Seq: 1, Sent: t0, End: t0.Add(100 * time.Millisecond), TTFT: 10 * time.Millisecond, E2E: 100 * time.Millisecond, Proxy: time.Millisecond},
		{Seq: 2, Sent: t0, End: t0.Add(100 * time.Millisecond), TTFT: 30 * time.Millisecond, E2E: 100 * time.Millisecond, Proxy: 2 * time.Millisecond},
	}
	s := summarize("p", res, 10)
	// (20-4)x10+4 = 164, (10-1)x10+1 = 91, (30-2)x10+2 = 282 (p99 interpolated between 164 and 282)
	if s.TTFTP50 != 200 || s.NetTTFTP50 != 164 || s.NetTTFTP99 < 279 || s.NetTTFTP99 > 282 {
		t.Errorf("TTFT p50 %v, net p50 %v p99 %v; want 200, 164, ~280", s.TTFTP50, s.NetTTFTP50, s.NetTTFTP99)
	}
	if s.ProxyP50 != 2 || s.ProxyP99 < 3.9 || s.ProxyP99 > 4 {
		t.Errorf("proxy p50 %v p99 %v (wall ms), want 2 and ~4", s.ProxyP50, s.ProxyP99)
	}
	res[1].Proxy = 0
	if s := summarize("p", res, 10); s.NetTTFTP50 != 0 || s.ProxyP50 != 0 {
		t.Errorf("one answer without its arrival time: net p50 %v, proxy p50 %v; want none", s.NetTTFTP50, s.ProxyP50)
	}
}

// The late figures are those of the requests sent after the run's first quarter, warm-up included in the
// count: here 8 requests, the first 2 left out (one of them warm-up), the slow start not in them.
func TestSummarizeLate(t *testing.T) {
	t0 := time.Unix(1000, 0)
	var res []requestResult
	for i, ttft := range []int{900, 800, 10, 20, 30, 40, 50, 60} {
		d := time.Duration(ttft) * time.Millisecond
		res = append(res, requestResult{Seq: i, Warmup: i == 0, Sent: t0, End: t0.Add(d), TTFT: d, E2E: d})
	}
	s := summarize("p", res, 1)
	if s.LateTTFTP50 != 35 || s.LateTTFTP99 < 59 || s.LateTTFTP99 > 60 {
		t.Errorf("late TTFT p50 %v p99 %v, want 35 and ~60 (requests 2-7)", s.LateTTFTP50, s.LateTTFTP99)
	}
	if s.TTFTP50 != 40 || s.TTFTP99 < 700 {
		t.Errorf("TTFT p50 %v p99 %v, want 40 and over 700 (requests 1-7)", s.TTFTP50, s.TTFTP99)
	}
}

func TestSummarizeEmptyIsValidJSON(t *testing.T) {
	s := summarize("p", nil, 1)
	for name, v := range map[string]float64{"ttft": s.TTFTP99, "e2e": s.E2EMean, "tpot": s.TPOTP50} {
		if math.IsNaN(v) {
			t.Errorf("%s of no requests is NaN, want 0", name)
		}
	}
}

// TestBackendTTFTP50: each backend's TTFT median is of the measured requests it answered, in the dials'
// order and the simulated time; warm-up and failed requests do not count, and a backend no response
// named has none.
func TestBackendTTFTP50(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	results := []requestResult{
		{Upstream: "a:1", TTFT: ms(10)}, {Upstream: "a:1", TTFT: ms(30)}, {Upstream: "a:1", TTFT: ms(20)},
		{Upstream: "b:2", TTFT: ms(5)},
		{Upstream: "b:2", TTFT: ms(500), Warmup: true},
		{Upstream: "b:2", TTFT: ms(900), Failed: true},
		{TTFT: ms(1)}, // no X-Upstream
	}
	got := backendTTFTP50(results, []string{"b:2", "a:1", "c:3"}, 10)
	if want := []float64{50, 200, 0}; !slices.Equal(got, want) {
		t.Errorf("backendTTFTP50() = %v, want %v", got, want)
	}
}
