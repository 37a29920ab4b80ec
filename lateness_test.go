package caddyllm

import (
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
	"github.com/tokenrouter/caddy-llm/scraper"
)

// lateRun sends a request every gap seconds for 2 s, each predicted to have its first token in 0.1 s, to
// a backend whose first tokens take factor(sent) times that, scraped every 200 ms, and returns the check
// after it. foreign marks every scrape as showing others' requests; restartAt (seconds; 0: never) is when the
// backend's counters start again from zero.
func lateRun(gap float64, factor func(sent float64) float64, foreign bool, restartAt float64) *firstTokenCheck {
	var c firstTokenCheck
	t0 := time.Unix(1_700_000_000, 0)
	at := func(s float64) int64 { return t0.Add(time.Duration(s * float64(time.Second))).UnixNano() }
	var sends []float64
	next := 0.0
	for scrape := 0.2; scrape <= 2.0+1e-9; scrape += 0.2 {
		for ; next < scrape-1e-9; next += gap {
			c.sent(at(next), 0.1)
			sends = append(sends, next)
		}
		count, sum := 0.0, 0.0
		for _, s := range sends {
			if first := s + 0.1*factor(s); first <= scrape && (restartAt == 0 || scrape < restartAt || s >= restartAt) {
				count++
				sum += 0.1 * factor(s)
			}
		}
		c.fromScrape(&scraper.Snapshot{At: time.Unix(0, at(scrape)), FirstTokens: count, FirstTokenSeconds: sum}, foreign)
	}
	return &c
}

// TestFirstTokenCheck: a backend's own first-token counts against the predictions of the requests sent
// about their time to first token before give how late its first tokens come; others' requests in the
// scrapes, or too few first tokens, give nothing, and a restart's counters going back teach nothing.
func TestFirstTokenCheck(t *testing.T) {
	steady := func(f float64) func(float64) float64 { return func(float64) float64 { return f } }
	// 2 or 6 times late by turns, a 200 ms window of sends each.
	varying := func(s float64) float64 { return 2 + 4*float64(int(s/0.2)%2) }
	for _, tt := range []struct {
		name      string
		gap       float64 // between sends, seconds
		factor    func(float64) float64
		foreign   bool
		restartAt float64
		lo, hi    float64 // 0, 0: nothing known
	}{
		{"on time", 0.01, steady(1), false, 0, 0.9, 1.1},
		{"four times late", 0.01, steady(4), false, 0, 3.6, 4.4},
		{"twice as fast", 0.01, steady(0.5), false, 0, 0.45, 0.55},
		{"four times late, 200 first tokens an interval", 0.001, steady(4), false, 0, 3.6, 4.4},
		// More first tokens an interval than the running mean's memory, their lateness changing: the
		// mean moves to each interval's, never past it.
		{"2 and 6 times late by turns, 200 first tokens an interval", 0.001, varying, false, 0, 2, 6},
		{"others' requests there", 0.01, steady(4), true, 0, 0, 0},
		{"restarted", 0.01, steady(4), false, 1.3, 3.6, 4.4},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := lateRun(tt.gap, tt.factor, tt.foreign, tt.restartAt).late()
			if got < tt.lo || got > tt.hi || (tt.hi == 0 && got != 0) {
				t.Errorf("late = %.2f, want %.2f-%.2f (0: none known)", got, tt.lo, tt.hi)
			}
		})
	}
	var few firstTokenCheck
	t0 := time.Unix(1_700_000_000, 0)
	for i := range 3 {
		few.sent(t0.Add(time.Duration(i)*time.Millisecond).UnixNano(), 0.1)
	}
	few.fromScrape(&scraper.Snapshot{At: t0.Add(time.Millisecond)}, false)
	few.fromScrape(&scraper.Snapshot{At: t0.Add(time.Second), FirstTokens: 3, FirstTokenSeconds: 1.2}, false)
	if got := few.late(); got != 0 {
		t.Errorf("late after 3 first tokens = %.2f, want none known (fewer than %d)", got, minLateTokens)
	}
}

// TestUnstretchedPrediction: the time to first token a request is compared with is its model's, without
// the overrun's stretch the decision priced it with: the lateness measures the model, not the stretch.
func TestUnstretchedPrediction(t *testing.T) {
	q := &query{stretch: []float64{1, 2}}
	if got := q.unstretched(1, 0.5); got != 0.25 {
		t.Errorf("unstretched(stretched 2x) = %v, want 0.25", got)
	}
	if got := q.unstretched(0, 0.5); got != 0.5 {
		t.Errorf("unstretched(not stretched) = %v, want 0.5", got)
	}
	if got := q.unstretched(5, 0.5); got != 0.5 {
		t.Errorf("unstretched(no such candidate) = %v, want 0.5", got)
	}
}

// TestLateFirstTokensReported: through Caddy, a backend that runs one request at a time answers the
// first tokens of a burst later and later, while the policy, which does not know its slot count yet,
// predicts each about at once; the backend's own time-to-first-token histogram, scraped, shows it, and
// /llm/upstreams reports its first tokens late by far more than twice their predictions.
func TestLateFirstTokensReported(t *testing.T) {
	_, b := simBackend(t, vllmsim.Config{TimeScale: 1, MaxNumSeqs: 1, DecodeStep: 20 * time.Millisecond, Seed: 2, Metrics: vllmsim.MetricsVLLM})
	tester := scrapedPair(t, b, "", "interval 200ms", "stale_after 30s")
	var wg sync.WaitGroup
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := strings.Replace(chatBody("sim-model", 10+i, false), `"max_tokens":16`, `"max_tokens":4`, 1)
			req, _ := http.NewRequest(http.MethodPost, proxyURL+"/v1/chat/completions", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			// Resent if the previous test's server, shutting down, took its connection: of twelve dialled
			// at once right after the load, seven were reset so in one run beside a busy-loop CPU hog.
			res, err := doReloadSafe(tester.Client, req)
			if err != nil {
				t.Error(err)
				return
			}
			io.Copy(io.Discard, res.Body)
			res.Body.Close()
			if res.StatusCode != http.StatusOK {
				t.Errorf("status %d", res.StatusCode)
			}
		}()
	}
	wg.Wait()
	waitFor(t, "the backend's first tokens compared with their predictions", func() bool {
		m := adminUpstreams(t)[b].Model
		return m != nil && m.FirstTokensLate > 2
	})
}
