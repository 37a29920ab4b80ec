package tokenize

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// chatBody builds a chat request of n messages with about tokensPerMsg tokens each; salt makes
// the texts unique so that a cold benchmark misses the cache.
func chatBody(n, tokensPerMsg int, salt string) []byte {
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	sentence := "The quick brown fox jumps over the lazy dog; then it \"rests\" for a while.\n"
	var msgs []message
	for i := 0; i < n; i++ {
		role := "user"
		switch {
		case i == 0:
			role = "system"
		case i%2 == 0:
			role = "assistant"
		}
		var b strings.Builder
		fmt.Fprintf(&b, "%s message %d. ", salt, i)
		for b.Len() < tokensPerMsg*4 {
			b.WriteString(sentence)
		}
		msgs = append(msgs, message{Role: role, Content: b.String()})
	}
	body, _ := json.Marshal(map[string]any{"model": "llama-3-8b", "stream": true, "max_tokens": 256, "messages": msgs})
	return body
}

func BenchmarkParseChatWarm(b *testing.B) {
	body := chatBody(20, 200, "warm")
	r, err := Parse(body, APIChat, Options{})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	b.ReportMetric(float64(r.PromptTokens), "tokens")
	b.ResetTimer()
	cpu := processCPU()
	for i := 0; i < b.N; i++ {
		if _, err := Parse(body, APIChat, Options{}); err != nil {
			b.Fatal(err)
		}
	}
	reportCPU(b, cpu)
}

func BenchmarkParseChatCold(b *testing.B) {
	if err := Warm(""); err != nil {
		b.Fatal(err)
	}
	bodies := make([][]byte, b.N)
	for i := range bodies {
		bodies[i] = chatBody(20, 200, fmt.Sprintf("cold%d-%d", b.N, i))
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(bodies[0])))
	b.ResetTimer()
	cpu := processCPU()
	for i := 0; i < b.N; i++ {
		if _, err := Parse(bodies[i], APIChat, Options{}); err != nil {
			b.Fatal(err)
		}
	}
	reportCPU(b, cpu)
}
