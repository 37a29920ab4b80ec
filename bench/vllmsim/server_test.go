package vllmsim

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestChatNonStreaming(t *testing.T) {
	_, ts := newTestServer(t, Config{})
	got := chat(t, ts, chatBodyJSON(t, "You are a test.", "Hello there", 5, false))
	if got.Object != "chat.completion" || len(got.Choices) != 1 || got.Choices[0].Message.Role != "assistant" {
		t.Fatalf("unexpected response %+v", got)
	}
	if n := len(got.Choices[0].Message.Content); n != 5*bytesPerToken {
		t.Errorf("content length = %d, want %d", n, 5*bytesPerToken)
	}
	if got.Usage == nil || got.Usage.CompletionTokens != 5 || got.Usage.PromptTokens == 0 ||
		got.Usage.TotalTokens != got.Usage.PromptTokens+5 {
		t.Errorf("usage = %+v", got.Usage)
	}
	if fr := got.Choices[0].FinishReason; fr == nil || *fr != "length" {
		t.Errorf("finish_reason = %v, want length", fr)
	}
}

func TestChatStreaming(t *testing.T) {
	_, ts := newTestServer(t, Config{})
	resp := post(t, context.Background(), ts.URL+"/v1/chat/completions", chatBodyJSON(t, "sys", "hi", 7, true), nil)
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Errorf("Content-Type = %q", ct)
	}
	events := sseEvents(t, resp.Body)
	if len(events) != 7+2 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("events = %q, want 7 token chunks, the usage chunk and [DONE]", events)
	}
	var content strings.Builder
	var u *usage
	for i, e := range events[:len(events)-1] {
		var c chatResponse
		if err := json.Unmarshal([]byte(e), &c); err != nil {
			t.Fatalf("event %d %q: %v", i, e, err)
		}
		if c.Object != "chat.completion.chunk" {
			t.Errorf("object = %q", c.Object)
		}
		if c.Usage != nil {
			u = c.Usage
			if len(c.Choices) != 0 {
				t.Errorf("usage chunk has choices")
			}
			continue
		}
		if i == 0 && c.Choices[0].Delta.Role != "assistant" {
			t.Errorf("first chunk has no role")
		}
		content.WriteString(c.Choices[0].Delta.Content)
	}
	if content.Len() != 7*bytesPerToken {
		t.Errorf("streamed %d bytes of content, want %d", content.Len(), 7*bytesPerToken)
	}
	if u == nil || u.CompletionTokens != 7 {
		t.Errorf("usage chunk = %+v, want 7 completion tokens", u)
	}
}

func TestCompletions(t *testing.T) {
	_, ts := newTestServer(t, Config{TokensPerChunk: 3})
	for _, stream := range []bool{false, true} {
		body := `{"model":"sim-model","prompt":"Once upon a time","max_tokens":8,"stream":` +
			map[bool]string{false: "false", true: "true"}[stream] + `}`
		resp := post(t, context.Background(), ts.URL+"/v1/completions", []byte(body), nil)
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("stream=%v: status %d %s", stream, resp.StatusCode, raw)
		}
		var text string
		if !stream {
			var c chatResponse
			if err := json.Unmarshal(raw, &c); err != nil {
				t.Fatal(err)
			}
			text = c.Choices[0].Text
		} else {
			events := sseEvents(t, strings.NewReader(string(raw)))
			if events[len(events)-1] != "[DONE]" {
				t.Fatalf("no [DONE] in %q", events)
			}
			// 8 tokens in chunks of 3: 1 (first token at once), then 3, 3, 1.
			if len(events)-1 != 4 {
				t.Errorf("%d content chunks for 8 tokens at 3 per chunk, want 4", len(events)-1)
			}
			for _, e := range events[:len(events)-1] {
				var c chatResponse
				if err := json.Unmarshal([]byte(e), &c); err != nil {
					t.Fatal(err)
				}
				text += c.Choices[0].Text
			}
		}
		if len(text) != 8*bytesPerToken {
			t.Errorf("stream=%v: text %q, want 8 tokens", stream, text)
		}
	}
}
