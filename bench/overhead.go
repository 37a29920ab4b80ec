package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// OverheadResult compares Caddy's throughput and latency with round_robin and with lb_policy llm
// in front of instant backends, closed loop: what the policy itself costs per request.
type OverheadResult struct {
	PromptTokens int               `json:"prompt_tokens"`
	Concurrency  int               `json:"concurrency"`
	Seconds      float64           `json:"seconds_per_policy"`
	Policies     []OverheadFigures `json:"policies"`
	// RPSRatio is the llm policy's requests/s over round_robin's; AddedLatencyUS the difference of
	// their mean latencies in microseconds.
	RPSRatio       float64 `json:"rps_ratio"`
	AddedLatencyUS float64 `json:"added_latency_us"`
	Note           string  `json:"note,omitempty"`
}

// OverheadFigures is one policy's closed-loop throughput and latency (wall time).
type OverheadFigures struct {
	Policy        string  `json:"policy"`
	Requests      int     `json:"requests"`
	Failed        int     `json:"failed"`
	RequestsPerS  float64 `json:"requests_per_s"`
	MeanLatencyUS float64 `json:"mean_latency_us"`
	P99LatencyUS  float64 `json:"p99_latency_us"`
}

// describe prints the comparison.
func (r OverheadResult) describe() string {
	var b strings.Builder
	fmt.Fprintf(&b, "overhead: instant backends, %d-token prompts, %d concurrent clients, %.0fs per policy in alternating rounds (wall time)\n",
		r.PromptTokens, r.Concurrency, r.Seconds)
	for _, p := range r.Policies {
		fmt.Fprintf(&b, "  %-14s %8.0f req/s  mean %7.0f us  p99 %7.0f us  failed %d/%d\n",
			p.Policy, p.RequestsPerS, p.MeanLatencyUS, p.P99LatencyUS, p.Failed, p.Requests)
	}
	if r.RPSRatio > 0 {
		fmt.Fprintf(&b, "  llm / round_robin requests/s: %.2fx; added latency per request: %.0f us\n", r.RPSRatio, r.AddedLatencyUS)
	}
	if r.Note != "" {
		fmt.Fprintf(&b, "  note: %s\n", r.Note)
	}
	return b.String()
}

// instantCompletion is the fixed answer of the overhead backends.
var instantCompletion = []byte(`{"id":"cmpl-0","object":"chat.completion","created":0,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":4000,"completion_tokens":1,"total_tokens":4001}}`)

// instantBackend reads the request and answers a fixed completion at once.
type instantBackend struct{}

func (instantBackend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(instantCompletion)
}

// runOverhead measures round_robin and llm (default mode) back to back on the same instant
// backends.
func runOverhead(ctx context.Context, o options) (OverheadResult, error) {
	res := OverheadResult{PromptTokens: 4000, Concurrency: 8, Seconds: 8}
	if o.quick {
		res.Seconds = 2
	}
	if o.overheadSeconds > 0 {
		res.Seconds = o.overheadSeconds
	}
	// 4k-token prompts: 16 system prompts of ~3,900 tokens shared by many requests (as an
	// affinity index would see in production), each with its own ~100-token question.
	rng := rand.New(rand.NewPCG(uint64(o.seed), 0x0e4))
	systems := make([]string, 16)
	for i := range systems {
		systems[i] = textOfTokens(rng, 3900)
	}
	bodies := make([][]byte, 512)
	for i := range bodies {
		b, _ := json.Marshal(chatRequest{Model: benchModel, MaxTokens: 1, Messages: []Message{
			{Role: "system", Content: systems[rng.IntN(len(systems))]},
			{Role: "user", Content: textOfTokens(rng, 100)},
		}})
		bodies[i] = b
	}
	c := &cluster{}
	for range o.backends {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			c.close()
			return res, fmt.Errorf("listening for a backend: %w", err)
		}
		c.serve(instantBackend{}, l)
	}
	defer c.close()
	// Alternate the policies in short rounds so that background load on a shared machine hits
	// both alike, and add the rounds up.
	const rounds = 4
	policies := []policy{{Name: "round_robin", JSON: `{"policy":"round_robin"}`}, {Name: "llm", JSON: `{"policy":"llm"}`}}
	sums := make([]overheadSum, len(policies))
	for round := range rounds {
		for i, p := range policies {
			if err := policyAvailable(p); err != nil {
				res.Note = fmt.Sprintf("%s skipped: %v", p.Name, err)
				continue
			}
			if round > 0 && sums[i].err != nil {
				continue
			}
			lat, failed, elapsed, err := closedLoop(ctx, c.dials, p, bodies, res.Concurrency, time.Duration(res.Seconds/rounds*float64(time.Second)))
			if err != nil {
				sums[i].err = err
				res.Note = fmt.Sprintf("%s failed: %v", p.Name, err)
				continue
			}
			sums[i].latencies = append(sums[i].latencies, lat...)
			sums[i].failed += failed
			sums[i].elapsed += elapsed
		}
	}
	for i, p := range policies {
		if len(sums[i].latencies) == 0 {
			continue
		}
		dist := newDistribution(sums[i].latencies)
		res.Policies = append(res.Policies, OverheadFigures{
			Policy:        p.Name,
			Requests:      len(sums[i].latencies) + sums[i].failed,
			Failed:        sums[i].failed,
			RequestsPerS:  float64(len(sums[i].latencies)) / sums[i].elapsed.Seconds(),
			MeanLatencyUS: finite(dist.Mean),
			P99LatencyUS:  finite(dist.P99),
		})
	}
	if len(res.Policies) == 2 && res.Policies[0].RequestsPerS > 0 {
		res.RPSRatio = res.Policies[1].RequestsPerS / res.Policies[0].RequestsPerS
		res.AddedLatencyUS = res.Policies[1].MeanLatencyUS - res.Policies[0].MeanLatencyUS
	}
	return res, nil
}

// overheadSum accumulates one policy's rounds.
type overheadSum struct {
	latencies []float64
	failed    int
	elapsed   time.Duration
	err       error
}

// closedLoop runs concurrency clients back to back through a Caddy with policy p for d (after a
// warm-up of d/5) and returns the measured latencies (us), failures and measuring time.
func closedLoop(ctx context.Context, dials []string, p policy, bodies [][]byte, concurrency int, d time.Duration) ([]float64, int, time.Duration, error) {
	url, err := startCaddy(dials, p, proxyExtras{})
	if err != nil {
		return nil, 0, 0, err
	}
	defer func() { _ = stopCaddy() }()
	client := newClient()
	defer client.CloseIdleConnections()
	var (
		measuring atomic.Bool
		stop      atomic.Bool
		mu        sync.Mutex
		latencies []float64
		failed    int
		wg        sync.WaitGroup
		next      atomic.Int64
	)
	for range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() && ctx.Err() == nil {
				body := bodies[int(next.Add(1))%len(bodies)]
				start := time.Now()
				ok := postOnce(ctx, client, url, body)
				lat := time.Since(start)
				if measuring.Load() {
					mu.Lock()
					if ok {
						latencies = append(latencies, float64(lat)/float64(time.Microsecond))
					} else {
						failed++
					}
					mu.Unlock()
				}
			}
		}()
	}
	time.Sleep(d / 5)
	measuring.Store(true)
	start := time.Now()
	time.Sleep(d)
	measuring.Store(false)
	elapsed := time.Since(start)
	stop.Store(true)
	wg.Wait()
	return latencies, failed, elapsed, nil
}

// postOnce sends one non-streaming completion and reports whether it succeeded.
func postOnce(ctx context.Context, client *http.Client, url string, body []byte) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return false
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode == http.StatusOK
}
