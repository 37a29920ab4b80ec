package caddyllm

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

func TestTransportCaddyfile(t *testing.T) {
	input := globalOptions + `
:8080 {
	reverse_proxy 127.0.0.1:9001 {
		lb_policy llm
		transport llm {
			read_timeout 5s
			versions 1.1
		}
	}
}`
	adapted, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
	if err != nil {
		t.Fatalf("adapting: %v", err)
	}
	for _, want := range []string{`"transport":{"protocol":"llm","read_timeout":5000000000,"versions":["1.1"]}`} {
		if !bytes.Contains(adapted, []byte(want)) {
			t.Errorf("adapted config lacks %s:\n%s", want, adapted)
		}
	}
	bad := globalOptions + ":8080 {\n\treverse_proxy 127.0.0.1:9001 {\n\t\ttransport llm {\n\t\t\tno_such_option 1\n\t\t}\n\t}\n}"
	if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(bad), nil); err == nil || !strings.Contains(err.Error(), "no_such_option") {
		t.Errorf("adapting an unknown transport option: error %v, want one naming it", err)
	}
}

// recordedSim is a simulated vLLM backend that records a hash of every response body it writes, by the
// request's X-Test-ID.
type recordedSim struct {
	sim  *vllmsim.Server
	dial string
	mu   sync.Mutex
	sums map[string][32]byte
}

func newRecordedSim(t *testing.T, cfg vllmsim.Config) *recordedSim {
	t.Helper()
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 100
	}
	sim, err := vllmsim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rs := &recordedSim{sim: sim, sums: make(map[string][32]byte)}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("X-Test-ID")
		if id == "" {
			sim.ServeHTTP(w, r)
			return
		}
		hw := &hashingWriter{ResponseWriter: w}
		sim.ServeHTTP(hw, r)
		rs.mu.Lock()
		rs.sums[id] = hw.sum()
		rs.mu.Unlock()
	}))
	rs.dial = strings.TrimPrefix(srv.URL, "http://")
	freshUpstream(rs.dial)
	t.Cleanup(func() {
		srv.CloseClientConnections()
		sim.Close()
		srv.Close()
	})
	return rs
}

func (rs *recordedSim) sum(id string) ([32]byte, bool) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	s, ok := rs.sums[id]
	return s, ok
}

type hashingWriter struct {
	http.ResponseWriter
	buf bytes.Buffer
}

func (w *hashingWriter) Write(p []byte) (int, error) {
	w.buf.Write(p)
	return w.ResponseWriter.Write(p)
}
func (w *hashingWriter) Flush()                      { http.NewResponseController(w.ResponseWriter).Flush() }
func (w *hashingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
func (w *hashingWriter) sum() [32]byte               { return sha256.Sum256(w.buf.Bytes()) }

// observerConfig proxies to the simulators in dials with the given policy (its options block inside
// "llm { ... }") and transport. The simulators run 100 times faster than real time: capacity 100 tells the
// policy, so that the first upstream measured does not look 100 times faster than the others' prior.
func observerConfig(transport, policyOptions string, dials ...string) string {
	var caps strings.Builder
	for _, d := range dials {
		fmt.Fprintf(&caps, "\t\t\tcapacity %s 100\n", d)
	}
	policy := "llm {\n" + caps.String() + policyOptions + "\t\t}"
	return globalOptions + fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy %s
		transport %s
		header_down X-Matched-Tokens {http.llm.matched_tokens}
		header_down X-Predicted-TTFT {http.llm.predicted_ttft_ms}
		flush_interval -1
	}
}
`, site, strings.Join(dials, " "), policy, transport)
}

// observedAnswer is what a test client reads of one answer through the proxy.
type observedAnswer struct {
	body     []byte
	upstream string
	matched  int // predicted cached tokens (the policy's count)
	cached   int // reported by the backend (-1: no usage)
	prompt   int
}

// askProxy sends body through the proxy with id as X-Test-ID and reads the answer.
func askProxy(t *testing.T, client *http.Client, id string, body []byte) observedAnswer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, proxyURL+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Test-ID", id)
	res, err := doReloadSafe(client, req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	raw, err := io.ReadAll(res.Body)
	if err != nil || res.StatusCode != http.StatusOK {
		t.Fatalf("request %s: status %d, %v: %s", id, res.StatusCode, err, raw)
	}
	a := observedAnswer{body: raw, cached: -1}
	a.matched, _ = strconv.Atoi(res.Header.Get("X-Matched-Tokens"))
	if ms, err := strconv.Atoi(res.Header.Get("X-Predicted-TTFT")); err != nil || ms < 0 || ms > 60_000 {
		t.Errorf("request %s: predicted TTFT placeholder %q, want whole milliseconds", id, res.Header.Get("X-Predicted-TTFT"))
	}
	doc := raw // a whole answer; in a stream, the last event with a usage
	if bytes.HasPrefix(raw, []byte("data: ")) {
		doc = nil
		for _, ev := range bytes.Split(raw, []byte("\n\n")) {
			if bytes.Contains(ev, []byte(`"usage"`)) {
				doc = bytes.TrimPrefix(ev, []byte("data: "))
			}
		}
	}
	var u struct {
		Usage *struct {
			PromptTokens int `json:"prompt_tokens"`
			Details      struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(doc, &u) == nil && u.Usage != nil {
		a.cached, a.prompt = u.Usage.Details.CachedTokens, u.Usage.PromptTokens
	}
	return a
}

// conversationBody is a chat request of conversation conv at its given turn: a long system prompt of its
// own, then turn user messages, so every turn extends the previous one's prefix.
func conversationBody(conv, turn int, stream bool) []byte {
	msgs := []string{fmt.Sprintf(`{"role":"system","content":"conversation %d: %s"}`, conv, strings.Repeat(fmt.Sprintf("rule %d applies. ", conv), 60))}
	for i := 0; i <= turn; i++ {
		msgs = append(msgs, fmt.Sprintf(`{"role":"user","content":"turn %d of %d: %s"}`, i, conv, strings.Repeat("more words here ", 8)))
	}
	opts := ""
	if stream {
		opts = `,"stream_options":{"include_usage":true}`
	}
	return fmt.Appendf(nil, `{"model":"sim-model","max_tokens":4,"stream":%t%s,"messages":[%s]}`, stream, opts, strings.Join(msgs, ","))
}

// TestTransportRelaysBytesUnchanged: with transport llm, every byte a backend writes reaches the client
// unchanged (hash-checked), streamed and not; each first token reaches the upstream's service model and
// each usage its cache figures. With transport http nothing is observed.
func TestTransportRelaysBytesUnchanged(t *testing.T) {
	for _, tc := range []struct {
		transport string
		observed  bool
	}{
		{transport: "llm", observed: true},
		{transport: "http", observed: false},
	} {
		t.Run(tc.transport, func(t *testing.T) {
			a, b := newRecordedSim(t, vllmsim.Config{Seed: 1}), newRecordedSim(t, vllmsim.Config{Seed: 2})
			tester := caddytest.NewTester(t)
			tester.InitServer(observerConfig(tc.transport, "", a.dial, b.dial), "caddyfile")
			client := &http.Client{Timeout: time.Minute}
			// What is observed is counted from here: the load table is process-wide, and a port the
			// kernel gave an earlier test's observed backend may come back for this one's.
			observed := func() (requests int64, firstTokens int, idle bool) {
				idle = true
				ups := adminUpstreams(t)
				for _, dial := range []string{a.dial, b.dial} {
					u := ups[dial]
					idle = idle && u.InflightRequests == 0
					if u.Cache != nil {
						requests += u.Cache.Requests
					}
					if u.Model != nil { // taught the model or not (a stale prediction of a queue skips one)
						firstTokens += u.Model.FirstTokens + u.Model.SkippedFirstTokens
					}
				}
				return requests, firstTokens, idle
			}
			requests0, firstTokens0, _ := observed()
			const n = 12
			for i := range n {
				stream := i%2 == 0
				id := fmt.Sprintf("%s-%d", tc.transport, i)
				ans := askProxy(t, client, id, conversationBody(i%3, i/3, stream))
				want, ok := a.sum(id)
				if !ok {
					want, ok = b.sum(id)
				}
				if !ok {
					t.Fatalf("request %s reached no backend", id)
				}
				if got := sha256.Sum256(ans.body); got != want {
					t.Errorf("request %s (stream %t): the client's bytes differ from the backend's:\n%s", id, stream, ans.body)
				}
				if ans.cached < 0 {
					t.Errorf("request %s: no usage in the answer: %s", id, ans.body)
				}
			}
			var requests int64
			var firstTokens int
			waitFor(t, "the last request's end", func() bool {
				var idle bool
				requests, firstTokens, idle = observed()
				return idle
			})
			requests, firstTokens = requests-requests0, firstTokens-firstTokens0
			want := int64(0)
			if tc.observed {
				want = n
			}
			if requests != want || int64(firstTokens) != want {
				t.Errorf("observed %d usages and %d first tokens, want %d of each", requests, firstTokens, want)
			}
		})
	}
}

// TestRestartedBackendLosesPredictions: a backend restarted mid-run (cache emptied, counters reset, new
// process start time) stops receiving predicted cache hits at once: its next scrape forgets its routes.
func TestRestartedBackendLosesPredictions(t *testing.T) {
	sims := []*recordedSim{newRecordedSim(t, vllmsim.Config{Seed: 1}), newRecordedSim(t, vllmsim.Config{Seed: 2})}
	tester := caddytest.NewTester(t)
	tester.InitServer(observerConfig("llm", "\t\t\tmetrics {\n\t\t\t\tinterval 50ms\n\t\t\t}\n", sims[0].dial, sims[1].dial), "caddyfile")
	client := &http.Client{Timeout: time.Minute}
	const convs = 8
	// Two turns of every conversation: the second is predicted cached where the first went.
	kept := make([]int, len(sims)) // conversations whose second turn stayed on each upstream
	for turn := range 2 {
		for c := range convs {
			ans := askProxy(t, client, fmt.Sprintf("warm-%d-%d", c, turn), conversationBody(c, turn, false))
			for i, sim := range sims {
				_, first := sim.sum(fmt.Sprintf("warm-%d-0", c))
				_, now := sim.sum(fmt.Sprintf("warm-%d-%d", c, turn))
				if turn == 1 && first && now {
					kept[i]++
					if ans.matched == 0 || ans.cached == 0 {
						t.Errorf("conversation %d's second turn on the same upstream: predicted %d, cached %d, want both > 0", c, ans.matched, ans.cached)
					}
				}
			}
		}
	}
	// Restart the upstream holding more conversations (the policy may have sent them all to one).
	a := sims[0]
	if kept[1] > kept[0] {
		a = sims[1]
	}
	if max(kept[0], kept[1]) == 0 {
		t.Fatalf("no conversation stayed on its upstream (%v)", kept)
	}
	a.sim.Restart()
	restarted := time.Now()
	// Wait for a scrape started after the restart completed (only its age is visible; a scrape
	// started during the restart may read the old counters), then send the next turns: their
	// decision sees the restart and forgets the routes first. The age is measured when the admin
	// API answers, after asked: a scrape is newer than the restart when it is younger than the
	// time from the restart to the question (measured at the answer instead, a slow admin
	// round trip passed a scrape from before the restart).
	waitFor(t, "a scrape after the restart", func() bool {
		asked := time.Now()
		m := adminUpstreams(t)[a.dial].Metrics
		return m != nil && m.AgeSeconds >= 0 && asked.Sub(restarted).Seconds() > m.AgeSeconds
	})
	// The first request the restarted upstream answers must be predicted nothing cached there: what was
	// learned before the restart is gone. (Later ones may rightly be predicted the system prompt that
	// request left in its new cache, which a short prompt's partial block may not hold.)
	first := ""
	for c := range convs {
		id := fmt.Sprintf("after-%d", c)
		ans := askProxy(t, client, id, conversationBody(c, 2, false))
		if _, ok := a.sum(id); ok && first == "" {
			first = id
			if ans.matched > 0 && ans.cached*2 < ans.matched {
				t.Errorf("the first request the restarted upstream answered was predicted %d tokens cached (it had %d), want none", ans.matched, ans.cached)
			}
		}
	}
	if first == "" {
		t.Log("no request after the restart reached the restarted upstream: its predictions were not checked")
	}
	if got := adminUpstreams(t)[a.dial].Cache; got == nil || got.Restarts < 1 {
		t.Errorf("cache report of the restarted upstream = %+v, want a restart", got)
	}
}

// TestEvictingBackendCorrections: a backend whose KV cache is too small for its share of the
// conversations evicts what the route table predicts; its reports correct the table, and the observed hit
// rate is the simulator's own (its prefix-cache counters) within 2 points.
func TestEvictingBackendCorrections(t *testing.T) {
	// 48 blocks of 16 tokens: about two conversations' prefixes (each ~280 simulator tokens and growing).
	cfg := vllmsim.Config{NumGPUBlocks: 48, MaxNumSeqs: 4}
	a, b := newRecordedSim(t, cfg), newRecordedSim(t, cfg)
	tester := caddytest.NewTester(t)
	tester.InitServer(observerConfig("llm", "\t\t\tmetrics off\n", a.dial, b.dial), "caddyfile")
	client := &http.Client{Timeout: time.Minute}
	const convs, turns = 8, 4
	for turn := range turns {
		for c := range convs {
			askProxy(t, client, fmt.Sprintf("kv-%d-%d", c, turn), conversationBody(c, turn, c%2 == 0))
		}
	}
	ups := adminUpstreams(t)
	corrections, evictions := int64(0), int64(0)
	for _, u := range []*recordedSim{a, b} {
		rep := ups[u.dial].Cache
		st := u.sim.State()
		if st.PrefixQueries == 0 {
			continue // the policy sent it nothing
		}
		if rep == nil || rep.Requests == 0 {
			t.Fatalf("%s: cache report %+v, simulator %+v: nothing observed", u.dial, rep, st)
		}
		if st.Preemptions != 0 {
			t.Fatalf("%s: %d preemptions: the simulator's counters count a preempted request twice", u.dial, st.Preemptions)
		}
		truth := float64(st.PrefixHits) / float64(st.PrefixQueries)
		if d := rep.ObservedHitRate - truth; d > 0.02 || d < -0.02 {
			t.Errorf("%s: observed hit rate %.3f, simulator's %.3f: more than 2 points apart", u.dial, rep.ObservedHitRate, truth)
		}
		evictions += st.Evictions
		corrections += rep.Corrections
		t.Logf("%s: predicted %.3f observed %.3f precision %.3f corrections %d evictions %d", u.dial,
			rep.PredictedHitRate, rep.ObservedHitRate, deref(rep.Precision), rep.Corrections, st.Evictions)
	}
	if evictions == 0 {
		t.Fatal("no evictions: the caches were not under pressure")
	}
	if corrections == 0 {
		t.Error("no corrections from backends that evicted predicted prefixes")
	}
}

func deref(p *float64) float64 {
	if p == nil {
		return 0
	}
	return *p
}
