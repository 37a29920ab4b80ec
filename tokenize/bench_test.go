package tokenize

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"
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
	b.ResetTimer()
	cpu := processCPU()
	for i := 0; i < b.N; i++ {
		if _, err := Parse(body, APIChat, Options{}); err != nil {
			b.Fatal(err)
		}
	}
	reportCPU(b, cpu)
	b.ReportMetric(float64(r.PromptTokens), "tokens")
	b.ReportMetric(float64(len(r.Boundaries)), "boundaries")
}

func BenchmarkParseChatCold(b *testing.B) {
	if err := Warm(""); err != nil {
		b.Fatal(err)
	}
	body := chatBody(20, 200, "cold")
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	var cpu time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		msgCache.Purge()
		b.StartTimer()
		start := processCPU()
		if _, err := Parse(body, APIChat, Options{}); err != nil {
			b.Fatal(err)
		}
		cpu += processCPU() - start
	}
	b.ReportMetric(float64(cpu)/float64(b.N), "cpu-ns/op")
}

// BenchmarkParseHostile measures the bodies of issue 6's table that cost the most. The message
// cache is purged before every iteration (timer stopped), so these are worst cases paid in full by
// each request.
func BenchmarkParseHostile(b *testing.B) {
	if err := Warm(""); err != nil {
		b.Fatal(err)
	}
	prose := strings.Repeat("Zebras quietly explore vintage harbors while 42 jugglers improvise, ", 500)
	tiny := make([]string, 100000)
	for i := range tiny {
		tiny[i] = fmt.Sprint(i)
	}
	cases := []struct {
		name string
		api  API
		body string
	}{
		{"10MB_one_char_one_message", APIChat, chatJSON(strings.Repeat("a", 10<<20))},
		{"30KB_run_of_a", APIChat, chatJSON(strings.Repeat("a", 30000))},
		{"30KB_run_of_spaces", APIChat, chatJSON(strings.Repeat(" ", 30000))},
		{"100k_tiny_messages", APIChat, chatJSON(tiny...)},
		{"128KB_unique_prose_budget", APIChat, chatJSON(prose[:30000], prose[1:30001], prose[2:30002], prose[3:30003], prose[4:30004])},
		{"deep_nesting_100k", APIChat, `{"messages":[{"role":"user","content":` + strings.Repeat("[", 100000) + `}]}`},
		{"special_tokens", APIChat, chatJSON(strings.Repeat("<|endoftext|>", 1000))},
		{"500k_token_ids", APICompletions, `{"prompt":[` + strings.Repeat("100257,", 500000-1) + `100257]}`},
		{"1000_token_arrays_of_500", APICompletions, `{"prompt":[` + strings.Repeat("["+strings.Repeat("1234,", 499)+"9],", 999) + `[1]]}`},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			body := []byte(c.body)
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			var cpu time.Duration
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				msgCache.Purge()
				b.StartTimer()
				start := processCPU()
				Parse(body, c.api, Options{})
				cpu += processCPU() - start
			}
			b.ReportMetric(float64(cpu)/float64(b.N), "cpu-ns/op")
		})
	}
}
