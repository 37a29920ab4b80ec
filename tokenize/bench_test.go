package tokenize

import (
	"encoding/json"
	"fmt"
	"os"
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

// BenchmarkCount counts real text of three kinds (this repository's English docs, Go code and JSON
// results; new text after other text of its kind has warmed the piece cache, as new messages meet a
// cache warmed by earlier traffic) three ways: the tokenizer over whole chunks of about 1 KiB (what
// count did before the piece cache), piece by piece from an empty cache, and piece by piece after the
// other text, and piece by piece with every piece cached (the split and the lookups alone). It reports
// the share of pieces found in the cache.
func BenchmarkCount(b *testing.B) {
	read := func(paths ...string) []byte {
		var out []byte
		for _, p := range paths {
			data, err := os.ReadFile(p)
			if err != nil {
				b.Fatal(err)
			}
			out = append(out, data...)
		}
		return out
	}
	kinds := []struct {
		name       string
		warm, text []byte
	}{
		{"prose", read("../docs/bench/HISTORY.md"), read("../bench/README.md")},
		{"code", read("../decide.go", "../accounting.go", "../scraped.go", "../module.go"), read("../selection/selection.go")},
		{"json", read("../docs/bench/instances.json"), read("../docs/bench/faults.json")},
	}
	e, err := encoderFor("cl100k_base")
	if err != nil {
		b.Fatal(err)
	}
	for _, k := range kinds {
		b.Run(k.name+"/tokenizer", func(b *testing.B) {
			b.SetBytes(int64(len(k.text)))
			for i := 0; i < b.N; i++ {
				for text := k.text; len(text) > 0; { // about 1 KiB a call, cut between pieces
					n := 0
					for n < len(text) && n < 1024 {
						p, _ := nextPiece(text[n:])
						n += p
					}
					_ = e.tk.EncodeOrdinary(string(text[:n]))
					text = text[n:]
				}
			}
		})
		b.Run(k.name+"/pieces-warm", func(b *testing.B) { // every piece cached: the split and the lookups alone
			saved := e.pieces
			defer func() { e.pieces = saved }()
			e.pieces = new(pieceCache)
			e.count(k.text)
			b.SetBytes(int64(len(k.text)))
			for i := 0; i < b.N; i++ {
				e.count(k.text)
			}
		})
		for _, warmed := range []bool{false, true} {
			name := k.name + "/pieces-cold"
			if warmed {
				name = k.name + "/pieces-after-other-text"
			}
			b.Run(name, func(b *testing.B) {
				saved := e.pieces
				defer func() { e.pieces = saved }()
				start := new(pieceCache)
				if warmed {
					e.pieces = start
					e.count(k.warm)
				}
				b.SetBytes(int64(len(k.text)))
				var calls, pieces uint64
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					e.pieces = new(pieceCache)
					for j := range start {
						e.pieces[j].Store(start[j].Load())
					}
					_, _, before := CacheStats()
					b.StartTimer()
					e.count(k.text)
					b.StopTimer()
					_, _, after := CacheStats()
					calls += after - before
					pieces += uint64(e.countPiecesOnly(k.text))
					b.StartTimer()
				}
				b.ReportMetric(1-float64(calls)/float64(pieces), "hit-rate")
			})
		}
	}
}

// countPiecesOnly is how many pieces count splits text into.
func (e *encoder) countPiecesOnly(text []byte) int {
	n := 0
	for len(text) > 0 {
		k, _ := nextPiece(text)
		n++
		text = text[k:]
	}
	return n
}
