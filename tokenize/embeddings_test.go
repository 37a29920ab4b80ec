package tokenize

import (
	"errors"
	"strings"
	"testing"
)

// TestEmbeddings: an embeddings input counts as a completions prompt of the same shape (a batch, the sum
// of its inputs), has no boundaries (no prefix of an encoder's input is cached for another), no output
// and no stream whatever the body says, and its errors name "input".
func TestEmbeddings(t *testing.T) {
	long := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 40)
	for _, tt := range []struct {
		name, input string
	}{
		{"one string", `"` + long + `"`},
		{"a batch of strings", `["` + long + `","a short one","` + long + `"]`},
		{"token IDs", `[1,2,3,4,5,6,7]`},
		{"a batch of token arrays", `[[1,2,3],[4,5],[6]]`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			for _, enc := range []string{"", "approx"} {
				emb := mustParse(t, `{"model":"bge-m3","input":`+tt.input+`,"stream":true,"max_tokens":9,"encoding_format":"float"}`, APIEmbeddings, Options{Encoding: enc})
				compl := mustParse(t, `{"model":"bge-m3","prompt":`+tt.input+`}`, APICompletions, Options{Encoding: enc})
				if emb.API != APIEmbeddings || emb.Model != "bge-m3" {
					t.Errorf("api %v model %q, want embeddings, bge-m3", emb.API, emb.Model)
				}
				if emb.PromptTokens != compl.PromptTokens || emb.PromptTokens == 0 || len(emb.Messages) != len(compl.Messages) {
					t.Errorf("encoding %q: %d prompt tokens in %d inputs, the completions prompt %d in %d", enc, emb.PromptTokens, len(emb.Messages), compl.PromptTokens, len(compl.Messages))
				}
				if len(emb.Boundaries) != 0 || emb.Stream || emb.MaxTokens != 0 {
					t.Errorf("boundaries %v, stream %v, max tokens %d: want none, false, 0", emb.Boundaries, emb.Stream, emb.MaxTokens)
				}
			}
		})
	}
	for body, want := range map[string]string{
		`{"model":"m"}`:            "input is required",
		`{"input":null}`:           "input is required (got null)",
		`{"input":[]}`:             "input must not be an empty array",
		`{"input":{"text":"x"}}`:   "input must be a string, an array of strings, or an array of token IDs, not an object",
		`{"input":["x",1]}`:        "input array elements must all be strings",
		`{"input":[[1],[]]}`:       "input[1] must not be an empty token array",
		`{"input":[-1]}`:           "input token IDs must be non-negative integers",
		`{"input":"x","model":3}`:  "model must be a string",
		`{"prompt":"x","input":7}`: "input must be a string",
	} {
		_, err := Parse([]byte(body), APIEmbeddings, Options{})
		if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), want) {
			t.Errorf("Parse(%s) error %v, want one containing %q", body, err, want)
		}
	}
}
