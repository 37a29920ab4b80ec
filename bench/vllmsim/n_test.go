package vllmsim

import (
	"context"
	"encoding/json"
	"testing"
)

// withN returns a chat body with n set.
func withN(t *testing.T, body []byte, n int) []byte {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatal(err)
	}
	m["n"] = n
	out, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestNWhole checks that a request with n > 1 runs n sequences and answers n choices: each its own
// index and whole output, the usage counting the prompt once and every sequence's output.
func TestNWhole(t *testing.T) {
	s, ts := newTestServer(t, Config{})
	const n, maxTokens = 3, 7
	out := chat(t, ts, withN(t, chatBodyJSON(t, "sys", "question", maxTokens, false), n))
	if len(out.Choices) != n {
		t.Fatalf("%d choices, want %d: %+v", len(out.Choices), n, out.Choices)
	}
	for i, c := range out.Choices {
		if c.Index != i || len(c.Message.Content) != maxTokens*bytesPerToken || c.FinishReason == nil || *c.FinishReason != "length" {
			t.Errorf("choice %d = %+v, want index %d, %d tokens, finish_reason length", i, c, i, maxTokens)
		}
	}
	one := chat(t, ts, chatBodyJSON(t, "sys", "question", maxTokens, false))
	if out.Usage == nil || out.Usage.CompletionTokens != n*maxTokens || out.Usage.PromptTokens != one.Usage.PromptTokens ||
		out.Usage.TotalTokens != out.Usage.PromptTokens+n*maxTokens {
		t.Errorf("usage = %+v, want the prompt's %d tokens once and %d output tokens", out.Usage, one.Usage.PromptTokens, n*maxTokens)
	}
	if st := s.State(); st.Running != 0 || st.Waiting != 0 || st.UsedBlocks != 0 {
		t.Errorf("after the requests: %+v, want nothing running, waiting or held", st)
	}
	raw := getMetrics(t, ts)
	f, ok := parseMetrics(t, raw)["vllm:generation_tokens_total"]
	if !ok || len(f.GetMetric()) != 1 {
		t.Fatalf("no vllm:generation_tokens_total in %s", raw)
	}
	if got := f.GetMetric()[0].GetCounter().GetValue(); got != float64((n+1)*maxTokens) {
		t.Errorf("vllm:generation_tokens_total = %v, want %d: every sequence generates", got, (n+1)*maxTokens)
	}
}

// TestNStream checks a streamed request with n > 1: chunks of every choice, each choice's first with the
// role and its last with the finish reason, the usage chunk summing the sequences, then [DONE].
func TestNStream(t *testing.T) {
	s, ts := newTestServer(t, Config{TokensPerChunk: 2})
	const n, maxTokens = 2, 5
	resp := post(t, context.Background(), ts.URL+"/v1/chat/completions", withN(t, chatBodyJSON(t, "sys", "q", maxTokens, true), n), nil)
	defer resp.Body.Close()
	events := sseEvents(t, resp.Body)
	if len(events) == 0 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("events %q do not end with [DONE]", events)
	}
	content := make([]string, n)
	finished := make([]int, n)
	var usage *usage
	for _, e := range events[:len(events)-1] {
		var c chatResponse
		if err := json.Unmarshal([]byte(e), &c); err != nil {
			t.Fatalf("event %q: %v", e, err)
		}
		if c.Usage != nil {
			usage = c.Usage
		}
		for _, ch := range c.Choices {
			if ch.Index < 0 || ch.Index >= n {
				t.Fatalf("choice index %d in %q", ch.Index, e)
			}
			if (content[ch.Index] == "") != (ch.Delta.Role == "assistant") {
				t.Errorf("choice %d: role %q on a chunk after %q", ch.Index, ch.Delta.Role, content[ch.Index])
			}
			if finished[ch.Index] > 0 {
				t.Errorf("choice %d has a chunk after its finish reason: %q", ch.Index, e)
			}
			content[ch.Index] += ch.Delta.Content
			if ch.FinishReason != nil {
				finished[ch.Index]++
			}
		}
	}
	for i := range n {
		if len(content[i]) != maxTokens*bytesPerToken || finished[i] != 1 {
			t.Errorf("choice %d: %q (%d finish reasons), want %d tokens and one finish reason", i, content[i], finished[i], maxTokens)
		}
	}
	if usage == nil || usage.CompletionTokens != n*maxTokens {
		t.Errorf("usage = %+v, want %d completion tokens", usage, n*maxTokens)
	}
	waitFor(t, "the sequences to leave the engine", func() bool {
		st := s.State()
		return st.Running == 0 && st.UsedBlocks == 0
	})
}

// TestNSequencesTakeSlots checks that the sequences of one request are the engine's requests: n of them
// running at once, and a cancelled request ending all of them.
func TestNSequencesTakeSlots(t *testing.T) {
	s, ts := newTestServer(t, Config{TimeScale: 1, MaxNumSeqs: 8})
	ctx, cancel := context.WithCancel(context.Background())
	resp := post(t, ctx, ts.URL+"/v1/chat/completions", withN(t, chatBodyJSON(t, "sys", "u", 1000, true), 3), nil)
	firstEvent(t, resp)
	waitFor(t, "three sequences running", func() bool { return s.State().Running == 3 })
	cancel()
	resp.Body.Close()
	waitFor(t, "the cancelled request's sequences to leave", func() bool {
		st := s.State()
		return st.Running == 0 && st.Waiting == 0 && st.UsedBlocks == 0
	})
}
