package tokenize

import (
	"encoding/json"
	"errors"
	"testing"
)

// FuzzParse checks that no body makes Parse panic, that every rejection is ErrMalformed, that only
// valid JSON is accepted, and that accepted requests keep the Request invariants. Seeds are in
// testdata/fuzz/FuzzParse; run with: go test -run '^$' -fuzz FuzzParse -fuzztime 30s ./tokenize
func FuzzParse(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"hello world"}]}`), uint8(1))
	f.Add([]byte(`{"prompt":[[1,2],[3]],"max_tokens":4}`), uint8(2))
	f.Add([]byte(`{"instructions":"be brief","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]},`+
		`{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":"ok"},`+
		`{"type":"reasoning","summary":[]}]}`), uint8(4))
	f.Add([]byte(`{"model":"e","input":["a text",  "another"],"encoding_format":"float"}`), uint8(8))
	f.Fuzz(func(t *testing.T, body []byte, mode uint8) {
		api := APIChat
		switch {
		case mode&8 != 0:
			api = APIEmbeddings
		case mode&4 != 0:
			api = APIResponses
		case mode&1 == 0:
			api = APICompletions
		}
		encoding := "approx"
		if mode&2 != 0 {
			encoding = "cl100k_base"
		}
		r, err := Parse(body, api, Options{Encoding: encoding, MaxTotalBytes: 4096})
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("Parse() error %v is not ErrMalformed", err)
			}
			return
		}
		if !json.Valid(body) {
			t.Fatalf("Parse accepted invalid JSON %q", body)
		}
		if len(r.Messages) == 0 || r.Messages[len(r.Messages)-1].End != r.PromptTokens || r.PromptTokens < 0 {
			t.Fatalf("inconsistent request %+v", r)
		}
		if r.Sequences < 1 || r.Sequences > maxSequences {
			t.Fatalf("Sequences %d out of [1, %d]", r.Sequences, maxSequences)
		}
		if api == APIEmbeddings && (len(r.Boundaries) > 0 || r.Stream || r.MaxTokens != 0) {
			t.Fatalf("embeddings request with boundaries, a stream or an output limit: %+v", r)
		}
		for i := 1; i < len(r.Boundaries); i++ {
			if r.Boundaries[i].Tokens <= r.Boundaries[i-1].Tokens {
				t.Fatalf("boundaries not increasing: %v", r.Boundaries)
			}
		}
		if n := len(r.Boundaries); n > 0 && r.Boundaries[n-1].Tokens > r.PromptTokens {
			t.Fatalf("boundary beyond the prompt: %v > %d", r.Boundaries[n-1], r.PromptTokens)
		}
	})
}
