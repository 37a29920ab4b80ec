package vllmsim

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"testing"
)

// BenchmarkParseAndHash measures the simulated tokenization of a 4,000-token chat prompt.
func BenchmarkParseAndHash(b *testing.B) {
	body := chatBodyJSON(&testing.T{}, longText("You are a helpful assistant. ", 16000), "question", 64, true)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		p, err := parseRequest(body, true)
		if err != nil {
			b.Fatal(err)
		}
		_ = blockHashes(p.prompt, 16)
	}
}

// BenchmarkStreamingRequest measures the server-side cost of one streamed request (1,000-token prompt,
// 64 output tokens, one chunk per token) over real HTTP with the engine running 10^6 times faster
// than real time, so the figure is CPU, not simulated latency.
func BenchmarkStreamingRequest(b *testing.B) {
	s, err := New(Config{TimeScale: 1e6})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	body := chatBodyJSON(&testing.T{}, longText("system ", 4000), "question", 64, true)
	ts := newBenchHTTP(b, s)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, ts+"/v1/chat/completions", bytes.NewReader(body))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				b.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	})
}
