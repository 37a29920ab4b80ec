package vllmsim

import (
	"context"
	"encoding/json"
	"testing"

	dto "github.com/prometheus/client_model/go"
)

// TestStreamUsageReportsCachedTokens: the final usage chunk of a stream that asked for it carries the
// same cached_tokens a non-streamed answer would, and the engine's counters agree.
func TestStreamUsageReportsCachedTokens(t *testing.T) {
	s, ts := newTestServer(t, Config{})
	system := longText("You are a helpful assistant. ", 2000)
	chat(t, ts, chatBodyJSON(t, system, "warm the cache", 2, false))
	_, want, err := s.Cached(chatBodyJSON(t, system, "streamed question", 3, true))
	if err != nil || want == 0 {
		t.Fatalf("Cached() = %d, %v, want a hit", want, err)
	}
	resp := post(t, context.Background(), ts.URL+"/v1/chat/completions", chatBodyJSON(t, system, "streamed question", 3, true), nil)
	events, err := readStream(t, resp)
	if err != nil || len(events) < 3 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("stream = %q, %v", events, err)
	}
	var last struct {
		Choices []json.RawMessage `json:"choices"`
		Usage   *usage            `json:"usage"`
	}
	if err := json.Unmarshal([]byte(events[len(events)-2]), &last); err != nil || last.Usage == nil || len(last.Choices) != 0 {
		t.Fatalf("usage chunk = %s, %v", events[len(events)-2], err)
	}
	if got := last.Usage.PromptTokensDetails.CachedTokens; got != want {
		t.Errorf("stream cached_tokens = %d, want %d", got, want)
	}
	st := s.State()
	if st.PrefixHits != int64(want) {
		t.Errorf("PrefixHits = %d, want %d (only the streamed request hit)", st.PrefixHits, want)
	}
}

func TestRestart(t *testing.T) {
	s, ts := newTestServer(t, Config{})
	system := longText("You are a helpful assistant. ", 2000)
	body := chatBodyJSON(t, system, "question", 2, false)
	chat(t, ts, body)
	chat(t, ts, body)
	before := parseMetrics(t, s.metricsText())
	if _, cached, _ := s.Cached(body); cached == 0 {
		t.Fatal("Cached() = 0 before the restart, want a hit")
	}

	s.Restart()

	if _, cached, _ := s.Cached(body); cached != 0 {
		t.Errorf("Cached() after Restart = %d, want 0 (cache emptied)", cached)
	}
	if st := s.State(); st.PrefixHits != 0 || st.PrefixQueries != 0 || st.Requests != 0 || st.Finished != 0 || st.UsedBlocks != 0 {
		t.Errorf("State() after Restart = %+v, want counters and cache at zero", st)
	}
	after := parseMetrics(t, s.metricsText())
	start := func(f map[string]*dto.MetricFamily) float64 {
		m := f["process_start_time_seconds"]
		if m == nil || len(m.GetMetric()) != 1 {
			t.Fatal("process_start_time_seconds missing")
		}
		return m.GetMetric()[0].GetGauge().GetValue()
	}
	if b, a := start(before), start(after); a <= b {
		t.Errorf("process_start_time_seconds = %v after Restart, want later than %v", a, b)
	}
	if got := after["vllm:prefix_cache_queries_total"].GetMetric()[0].GetCounter().GetValue(); got != 0 {
		t.Errorf("prefix_cache_queries_total after Restart = %v, want 0", got)
	}
	// The restarted server serves, and its first answer has nothing cached.
	if got := chat(t, ts, body).Usage.PromptTokensDetails.CachedTokens; got != 0 {
		t.Errorf("cached_tokens after Restart = %d, want 0", got)
	}
}
