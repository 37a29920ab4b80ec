package vllmsim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/scraper"
)

// newTestServer starts a fast simulator behind an httptest server; both stop at cleanup.
func newTestServer(t *testing.T, cfg Config) (*Server, *httptest.Server) {
	t.Helper()
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1000
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatalf("New() error = %v", err)
	}
	ts := httptest.NewServer(s)
	t.Cleanup(func() {
		ts.Close()
		s.Close()
	})
	return s, ts
}

// chatBodyJSON builds a chat request body.
func chatBodyJSON(t *testing.T, system, user string, maxTokens int, stream bool) []byte {
	t.Helper()
	m := map[string]any{
		"messages": []map[string]string{
			{"role": "system", "content": system},
			{"role": "user", "content": user},
		},
		"max_tokens": maxTokens,
		"stream":     stream,
	}
	if stream {
		m["stream_options"] = map[string]bool{"include_usage": true}
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

type chatResponse struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Index   int `json:"index"`
		Message struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"delta"`
		Text         string  `json:"text"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *usage `json:"usage"`
}

func post(t *testing.T, ctx context.Context, url string, body []byte, hdr map[string]string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return resp
}

// chat sends a non-streaming chat request and decodes the response.
func chat(t *testing.T, ts *httptest.Server, body []byte) chatResponse {
	t.Helper()
	resp := post(t, context.Background(), ts.URL+"/v1/chat/completions", body, nil)
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status = %d, body %s", resp.StatusCode, raw)
	}
	var out chatResponse
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("decoding %s: %v", raw, err)
	}
	return out
}

// sseEvents reads the data payloads of an SSE stream until EOF.
func sseEvents(t *testing.T, r io.Reader) []string {
	t.Helper()
	var events []string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			events = append(events, data)
		}
	}
	return events
}

// waitFor polls cond (bounded) for state changes made by other goroutines, such as the server
// noticing a client disconnect.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func longText(seed string, n int) string {
	return strings.Repeat(seed, n/len(seed)+1)[:n]
}

func newBenchHTTP(b *testing.B, h http.Handler) string {
	ts := httptest.NewServer(h)
	b.Cleanup(ts.Close)
	return ts.URL
}

// getMetrics returns the text of ts's /metrics.
func getMetrics(t *testing.T, ts *httptest.Server) []byte {
	t.Helper()
	resp, err := http.Get(ts.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// scrapeMetrics reads ts's /metrics as the policy's scraper does.
func scrapeMetrics(t *testing.T, ts *httptest.Server) scraper.Snapshot {
	t.Helper()
	raw := getMetrics(t, ts)
	snap, err := scraper.Parse(bytes.NewReader(raw), "")
	if err != nil {
		t.Fatalf("scraping: %v\n%s", err, raw)
	}
	return snap
}
