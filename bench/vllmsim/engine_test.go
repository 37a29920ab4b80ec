package vllmsim

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// manualServer is a server whose engine is stepped by the test instead of its goroutine.
func manualServer(t *testing.T, cfg Config) *Server {
	t.Helper()
	s, err := newServer(cfg)
	if err != nil {
		t.Fatalf("newServer() error = %v", err)
	}
	return s
}

// step runs one engine step synchronously and returns its simulated duration and batch size.
func step(s *Server) (time.Duration, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	batch, d := s.planLocked(nil)
	if len(batch) > 0 {
		s.applyLocked(batch, d)
	}
	return d, len(batch)
}

// drain steps until the engine is idle, at most limit steps.
func drain(t *testing.T, s *Server, limit int) int {
	t.Helper()
	for i := range limit {
		if _, n := step(s); n == 0 {
			return i
		}
	}
	t.Fatalf("engine still busy after %d steps", limit)
	return limit
}

func textBody(prompt string, maxTokens int) []byte {
	return fmt.Appendf(nil, `{"prompt":%q,"max_tokens":%d}`, prompt, maxTokens)
}

// submit parses and enqueues a text completion.
func submit(t *testing.T, s *Server, prompt string, maxTokens int) *request {
	t.Helper()
	p, err := parseRequest(textBody(prompt, maxTokens), false)
	if err != nil {
		t.Fatal(err)
	}
	r := s.newRequest(p)
	if err := s.enqueue(r); err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	return r
}

func cachedTokens(t *testing.T, s *Server, prompt string) int {
	t.Helper()
	_, cached, err := s.Cached(textBody(prompt, 1))
	if err != nil {
		t.Fatal(err)
	}
	return cached
}

// checkKV verifies the cache's internal invariants.
func checkKV(t *testing.T, s *Server) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.kv
	n := 0
	for id := c.head; id >= 0; id = c.blocks[id].next {
		if c.blocks[id].ref != 0 || !c.blocks[id].inFree {
			t.Fatalf("free block %d has ref %d", id, c.blocks[id].ref)
		}
		n++
	}
	if n != c.free {
		t.Fatalf("free queue has %d blocks, counter says %d", n, c.free)
	}
	for h, id := range c.cached {
		if b := c.blocks[id]; !b.hashed || b.hash != h {
			t.Fatalf("cached map entry %x -> %d inconsistent", h, id)
		}
	}
	for id, b := range c.blocks {
		if b.ref < 0 {
			t.Fatalf("block %d ref %d", id, b.ref)
		}
	}
	used := 0
	for _, r := range s.running {
		used += len(r.blocks)
	}
	if used < c.used() && len(s.running) > 0 {
		// Shared blocks are counted once per user, so users >= used blocks whenever anything runs.
		t.Fatalf("running requests hold %d block refs, cache says %d used", used, c.used())
	}
}

// blocksText returns a prompt of exactly n full blocks (16 tokens of 4 bytes) plus one token, so
// that all n blocks can be prefix hits.
func blocksText(tag string, n int) string {
	return longText(tag+"-", n*64) + "tail"
}

func TestRepeatedPromptIsCached(t *testing.T) {
	s := manualServer(t, Config{})
	prompt := blocksText("a", 8)
	r1 := submit(t, s, prompt, 4)
	drain(t, s, 100)
	r2 := submit(t, s, prompt, 4)
	drain(t, s, 100)
	if got := r1.cached.Load(); got != 0 {
		t.Errorf("first request cached_tokens = %d, want 0", got)
	}
	if got := r2.cached.Load(); got != 8*16 {
		t.Errorf("second request cached_tokens = %d, want %d", got, 8*16)
	}
	st := s.State()
	if st.PrefixQueries != 2*int64(r1.promptTokens) || st.PrefixHits != 8*16 {
		t.Errorf("prefix queries/hits = %d/%d, want %d/%d", st.PrefixQueries, st.PrefixHits, 2*r1.promptTokens, 8*16)
	}
	if st.UsedBlocks != 0 || st.PendingPrefillTokens != 0 {
		t.Errorf("idle engine holds blocks: %+v", st)
	}
	checkKV(t, s)
}

func TestPrefixOfLongerPromptReusesBlocks(t *testing.T) {
	s := manualServer(t, Config{})
	short := blocksText("p", 4)
	submit(t, s, short, 2)
	drain(t, s, 100)
	long := short[:4*64] + longText("more", 10*64)
	if got := cachedTokens(t, s, long); got != 4*16 {
		t.Fatalf("Cached(longer prompt) = %d, want %d", got, 4*16)
	}
	r := submit(t, s, long, 2)
	drain(t, s, 100)
	if got := r.cached.Load(); got != 4*16 {
		t.Errorf("cached_tokens = %d, want %d", got, 4*16)
	}
	// A prompt that is entirely cached still computes its last token: hits stop one block short.
	exact := long[:8*64]
	if got := cachedTokens(t, s, exact); got != 7*16 {
		t.Errorf("Cached(fully cached prompt) = %d, want %d", got, 7*16)
	}
}

func TestLRUEvictionUnderKVPressure(t *testing.T) {
	// Each prompt is 8 full blocks + 1 token, plus one output token: 9 blocks. 24 blocks hold two.
	a, b, c := blocksText("a", 8), blocksText("b", 8), blocksText("c", 8)
	full := 8 * 16
	tests := []struct {
		name          string
		order         []string
		wantA, wantB  bool // fully cached at the end
		wantEvictions bool
	}{
		{name: "fits", order: []string{a, b}, wantA: true, wantB: true},
		{name: "oldest evicted", order: []string{a, b, c}, wantA: false, wantB: true, wantEvictions: true},
		{name: "recent use protects", order: []string{a, b, a, c}, wantA: true, wantB: false, wantEvictions: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := manualServer(t, Config{NumGPUBlocks: 24})
			for _, p := range tt.order {
				submit(t, s, p, 1)
				drain(t, s, 100)
				checkKV(t, s)
			}
			if got := cachedTokens(t, s, a) == full; got != tt.wantA {
				t.Errorf("a fully cached = %v, want %v (cached %d)", got, tt.wantA, cachedTokens(t, s, a))
			}
			if got := cachedTokens(t, s, b) == full; got != tt.wantB {
				t.Errorf("b fully cached = %v, want %v (cached %d)", got, tt.wantB, cachedTokens(t, s, b))
			}
			if got := s.State().Evictions > 0; got != tt.wantEvictions {
				t.Errorf("evictions = %d, want some: %v", s.State().Evictions, tt.wantEvictions)
			}
		})
	}
}

func TestRequestWaitsForBlocks(t *testing.T) {
	s := manualServer(t, Config{NumGPUBlocks: 24})
	x := submit(t, s, blocksText("x", 16), 100) // 17 prompt blocks, growing to 23
	step(s)
	y := submit(t, s, blocksText("y", 8), 1) // 9 blocks: do not fit beside x
	z := submit(t, s, "z", 1)                // fits, but FIFO: waits behind y
	for range 10 {
		step(s)
		if st := s.State(); st.Running != 1 || st.Waiting != 2 {
			t.Fatalf("while x runs: running %d waiting %d, want 1 and 2", st.Running, st.Waiting)
		}
	}
	if y.generated.Load() != 0 || z.generated.Load() != 0 {
		t.Fatal("waiting requests produced output")
	}
	drain(t, s, 1000)
	for name, r := range map[string]*request{"x": x, "y": y, "z": z} {
		select {
		case <-r.done:
		default:
			t.Fatalf("%s did not finish", name)
		}
		if r.err != nil || int(r.generated.Load()) != r.maxTokens {
			t.Errorf("%s: err %v, generated %d of %d", name, r.err, r.generated.Load(), r.maxTokens)
		}
	}
	if p := s.State().Preemptions; p != 0 {
		t.Errorf("%d preemptions, want none", p)
	}
	checkKV(t, s)
}

func TestPreemptionUnderKVPressure(t *testing.T) {
	// Two requests of 6 prompt blocks fit at admission; growing to 18 blocks each, they cannot both
	// finish: the later one is preempted, recomputes after the first finishes, and completes.
	s := manualServer(t, Config{NumGPUBlocks: 24})
	a := submit(t, s, blocksText("a", 5), 200)
	b := submit(t, s, blocksText("b", 5), 200)
	step(s)
	if st := s.State(); st.Running != 2 {
		t.Fatalf("running %d, want 2", st.Running)
	}
	last := int64(0)
	for i := 0; i < 2000; i++ {
		if _, n := step(s); n == 0 {
			break
		}
		checkKV(t, s)
		g := b.generated.Load()
		if g < last {
			t.Fatalf("b's output went from %d to %d tokens", last, g)
		}
		last = g
	}
	for name, r := range map[string]*request{"a": a, "b": b} {
		if int(r.generated.Load()) != r.maxTokens {
			t.Errorf("%s generated %d of %d", name, r.generated.Load(), r.maxTokens)
		}
	}
	st := s.State()
	if st.Preemptions == 0 {
		t.Error("no preemption under KV pressure")
	}
	// vllm:prompt_tokens_total counts each prompt once, at its first token, as vLLM v1 does: not again
	// when a preempted request recomputes it.
	s.mu.Lock()
	prefilled, finished := s.promptTotal, s.finishedPrompt
	s.mu.Unlock()
	if prefilled != finished {
		t.Errorf("prompt tokens counted prefilled %d, finished %d: want each prompt once", prefilled, finished)
	}
	if st.UsedBlocks != 0 || st.PendingPrefillTokens != 0 || st.Running != 0 || st.Waiting != 0 {
		t.Errorf("idle state %+v", st)
	}
}

func TestStepTimeGrowsWithBatch(t *testing.T) {
	cfg := Config{PrefillTokensPerSec: 1e15, MaxNumSeqs: 64}
	decodeStep := func(n int) time.Duration {
		s := manualServer(t, cfg)
		for i := range n {
			submit(t, s, fmt.Sprintf("prompt %d", i), 10)
		}
		step(s) // prefill step
		d, batch := step(s)
		if batch != n {
			t.Fatalf("batch = %d, want %d", batch, n)
		}
		return d
	}
	prev := time.Duration(0)
	for _, n := range []int{1, 2, 8, 32} {
		d := decodeStep(n)
		if d <= prev {
			t.Errorf("decode step with batch %d = %v, not longer than with fewer sequences (%v)", n, d, prev)
		}
		prev = d
	}
}

// TestAttentionCostsGrowWithContext: with AttentionTokens a prefill token's cost grows with its position
// (a prompt's later tokens, and tokens appended behind a cached history, cost more than its first), and
// with DecodeStepPerKToken a decode step grows with the context its decodes read.
func TestAttentionCostsGrowWithContext(t *testing.T) {
	const rate, attention = 1000.0, 800
	cfg := Config{PrefillTokensPerSec: rate, AttentionTokens: attention, MaxNumBatchedTokens: -1,
		DecodeStep: 10 * time.Millisecond, DecodeStepPerKToken: time.Millisecond}
	s := manualServer(t, cfg)
	s.cfg.DecodeStepPerSeq = 0 // withDefaults set its default; this test weighs context alone
	prompt := blocksText("a", 100)
	r := submit(t, s, prompt, 2)
	p := float64(r.promptTokens)
	d, _ := step(s)
	want := 10*time.Millisecond + time.Duration(p/rate*(1+(p-1)/2/attention)*float64(time.Second))
	if diff := d - want; diff < -time.Microsecond || diff > time.Microsecond {
		t.Errorf("cold prefill of %v tokens took %v, want %v (linear: %v)", p, d, want,
			10*time.Millisecond+time.Duration(p/rate*float64(time.Second)))
	}
	d, _ = step(s)
	if want := 10*time.Millisecond + time.Duration(p/1000*float64(time.Millisecond)); d != want {
		t.Errorf("decode step over %v tokens of context took %v, want %v", p, d, want)
	}
	drain(t, s, 10)

	// The same tokens appended behind the cached prompt cost more than they did at its start.
	r2 := submit(t, s, prompt+longText("b-", 64*50), 1)
	behind, _ := step(s)
	appended := r2.promptTokens - int(r2.cached.Load())
	s2 := manualServer(t, cfg)
	s2.cfg.DecodeStepPerSeq = 0
	r3 := submit(t, s2, longText("b-", 64*50), 1)
	alone, _ := step(s2)
	if r2.cached.Load() == 0 || r3.promptTokens+16 < appended || behind <= alone {
		t.Errorf("%d tokens appended behind %d cached took %v, %d alone %v: want longer behind",
			appended, r2.cached.Load(), behind, r3.promptTokens, alone)
	}
}

func TestPrefillTimeCountsOnlyUncachedTokens(t *testing.T) {
	s := manualServer(t, Config{})
	prompt := blocksText("q", 100)
	submit(t, s, prompt, 1)
	cold, _ := step(s)
	drain(t, s, 10)
	submit(t, s, prompt, 1)
	warm, _ := step(s)
	if warm >= cold {
		t.Errorf("prefill step with cached prefix %v, want shorter than cold %v", warm, cold)
	}
}

func TestChunkedPrefillKeepsDecoding(t *testing.T) {
	s := manualServer(t, Config{MaxNumBatchedTokens: 256})
	short := submit(t, s, "short", 50)
	step(s)
	long := submit(t, s, longText("L", 4000), 1) // 1000 tokens: 4 chunks
	for range 3 {
		step(s)
	}
	if long.generated.Load() != 0 {
		t.Fatal("long prompt finished prefill too early")
	}
	if got := short.generated.Load(); got != 4 {
		t.Errorf("short request generated %d tokens during the long prefill, want 4", got)
	}
	if st := s.State(); st.PendingPrefillTokens <= 0 {
		t.Errorf("PendingPrefillTokens = %d during a chunked prefill", st.PendingPrefillTokens)
	}
	drain(t, s, 100)
	if s.State().PendingPrefillTokens != 0 {
		t.Errorf("PendingPrefillTokens = %d when idle", s.State().PendingPrefillTokens)
	}
}

func TestAbortReleasesBlocks(t *testing.T) {
	s := manualServer(t, Config{NumGPUBlocks: 64})
	running := submit(t, s, blocksText("r", 4), 100)
	step(s)
	waiting := submit(t, s, blocksText("w", 59), 20) // 60 blocks: does not fit beside the 5 of running
	step(s)
	if st := s.State(); st.Running != 1 || st.Waiting != 1 || st.UsedBlocks == 0 {
		t.Fatalf("state %+v", st)
	}
	s.abort(waiting)
	s.abort(running)
	s.abort(running) // idempotent
	st := s.State()
	if st.Running != 0 || st.Waiting != 0 || st.UsedBlocks != 0 || st.PendingPrefillTokens != 0 {
		t.Errorf("after aborts: %+v", st)
	}
	if _, n := step(s); n != 0 {
		t.Errorf("engine still has work")
	}
	checkKV(t, s)
	// The aborted request's prompt blocks stay cached.
	if got := cachedTokens(t, s, blocksText("r", 4)); got != 4*16 {
		t.Errorf("cached after abort = %d, want %d", got, 4*16)
	}
}

func TestQueueLimit(t *testing.T) {
	s := manualServer(t, Config{MaxNumSeqs: 1, MaxQueue: 1})
	submit(t, s, "a", 100)
	step(s)
	submit(t, s, "b", 1)
	p, _ := parseRequest(textBody("c", 1), false)
	if err := s.enqueue(s.newRequest(p)); err != errQueueFull {
		t.Errorf("third request: err = %v, want errQueueFull", err)
	}
}

func TestTooLongRequest(t *testing.T) {
	s := manualServer(t, Config{NumGPUBlocks: 4})
	p, _ := parseRequest(textBody(strings.Repeat("x", 4*60), 10), false)
	if err := s.enqueue(s.newRequest(p)); err != errTooLong {
		t.Errorf("err = %v, want errTooLong", err)
	}
}

func TestBlockHashesChain(t *testing.T) {
	a := blockHashes([]byte(longText("abc", 64*3)), 16)
	b := blockHashes([]byte(longText("abc", 64*2)+longText("zzz", 64)), 16)
	if len(a) != 3 || len(b) != 3 {
		t.Fatalf("got %d and %d hashes, want 3", len(a), len(b))
	}
	if a[0] != b[0] || a[1] != b[1] || a[2] == b[2] {
		t.Errorf("shared prefix must share hashes and diverge after: %x %x", a, b)
	}
	// The same block content at another position hashes differently (chained).
	c := blockHashes([]byte(longText("zzz", 64)), 16)
	if c[0] == b[2] {
		t.Error("block hash does not depend on its prefix")
	}
	if n := len(blockHashes([]byte("short"), 16)); n != 0 {
		t.Errorf("%d hashes for a partial block", n)
	}
}

func TestParsePromptMatchesCached(t *testing.T) {
	s := manualServer(t, Config{})
	prompt := blocksText("o", 6)
	submit(t, s, prompt, 1)
	drain(t, s, 10)
	body := textBody(prompt+" and more", 3)
	p, err := ParsePrompt(body, 16)
	if err != nil {
		t.Fatal(err)
	}
	tokens, cached, err := s.Cached(body)
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.CachedPrompt(p)
	if err != nil || got != cached || p.Tokens != tokens || cached != 6*16 {
		t.Errorf("CachedPrompt = %d, %v; Cached = %d of %d; Prompt.Tokens %d", got, err, cached, tokens, p.Tokens)
	}
	p32, _ := ParsePrompt(body, 32)
	if _, err := s.CachedPrompt(p32); err != ErrBlockSize {
		t.Errorf("mismatched block size: err = %v", err)
	}
}

// TestScheduleLPM: with SGLang's longest-prefix-match order, a waiting request whose prefix is cached
// is admitted before one that came earlier and finds nothing; in arrival order (vLLM's) the earlier one
// goes first.
func TestScheduleLPM(t *testing.T) {
	for _, tt := range []struct {
		schedule string
		first    string // the waiting request admitted first
	}{{ScheduleFCFS, "cold"}, {ScheduleLPM, "warm"}} {
		t.Run(tt.schedule, func(t *testing.T) {
			s := manualServer(t, Config{MaxNumSeqs: 1, Schedule: tt.schedule})
			shared := blocksText("shared", 40)
			submit(t, s, shared, 1)
			drain(t, s, 10) // shared's blocks now cached
			submit(t, s, longText("busy-", 64), 3)
			step(s) // busy takes the one slot
			cold := submit(t, s, blocksText("cold", 40), 1)
			warm := submit(t, s, shared+longText("more", 64), 1)
			for range 10 {
				if cold.state != stateWaiting || warm.state != stateWaiting {
					break
				}
				step(s)
			}
			got := map[bool]string{true: "cold", false: "warm"}[cold.state != stateWaiting]
			if cold.state != stateWaiting && warm.state != stateWaiting {
				t.Fatal("both admitted in one step on one slot")
			}
			if got != tt.first {
				t.Errorf("%s admitted first, want %s", got, tt.first)
			}
		})
	}
}

// TestSeparatePrefill: SGLang's steps prefill apart from decodes, so a prompt arriving beside a running
// sequence gets a step of its own; vLLM's mixed steps decode and prefill together.
func TestSeparatePrefill(t *testing.T) {
	for _, separate := range []bool{false, true} {
		s := manualServer(t, Config{SeparatePrefill: separate})
		submit(t, s, "first prompt", 5)
		step(s) // its prefill
		second := submit(t, s, longText("second-", 256), 5)
		_, n := step(s)
		want := 2 // the first one's decode and the second's prefill
		if separate {
			want = 1
		}
		if n != want || second.state != stateRunning {
			t.Errorf("separate %v: a step of %d (second %v), want %d with the second admitted", separate, n, second.state, want)
		}
		if _, n := step(s); separate && n != 2 {
			t.Errorf("separate: the step after the prefill ran %d sequences, want both decoding", n)
		}
	}
}

func TestScheduleValidated(t *testing.T) {
	if _, err := New(Config{Schedule: "sjf"}); err == nil || !strings.Contains(err.Error(), "schedule") {
		t.Errorf("New(schedule sjf) error = %v, want one naming schedule", err)
	}
	if _, err := New(Config{AttentionTokens: -1}); err == nil || !strings.Contains(err.Error(), "attention_tokens") {
		t.Errorf("New(attention_tokens -1) error = %v, want one naming attention_tokens", err)
	}
}

// TestPrefillHistograms: like vLLM, each finished request's prefill time and the prompt tokens it
// computed are observed as it finishes; a request whose prefix was cached computed only the rest.
func TestPrefillHistograms(t *testing.T) {
	s := manualServer(t, Config{})
	prompt := blocksText("h", 8)
	r1 := submit(t, s, prompt, 2)
	drain(t, s, 100)
	submit(t, s, prompt, 2)
	drain(t, s, 100)
	rec := httptest.NewRecorder()
	s.serveMetrics(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	fams := parseMetrics(t, rec.Body.Bytes())
	computed := fams["vllm:request_prefill_kv_computed_tokens"].GetMetric()[0].GetHistogram()
	if want := float64(2*r1.promptTokens - 8*16); computed.GetSampleCount() != 2 || computed.GetSampleSum() != want {
		t.Errorf("computed tokens: %d requests, %v tokens; want 2, %v (the second's 128 cached not counted)", computed.GetSampleCount(), computed.GetSampleSum(), want)
	}
	prefill := fams["vllm:request_prefill_time_seconds"].GetMetric()[0].GetHistogram()
	if prefill.GetSampleCount() != 2 || prefill.GetSampleSum() < 0 {
		t.Errorf("prefill time: %d requests, %v s; want 2, not negative", prefill.GetSampleCount(), prefill.GetSampleSum())
	}
}
