package tokenize

import (
	"errors"
	"fmt"
	"math/rand"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/pkoukk/tiktoken-go"
)

// ref returns the reference tiktoken count of s, tokenized whole.
func ref(t testing.TB, encoding, s string) int {
	t.Helper()
	e, err := encoderFor(encoding)
	if err != nil {
		t.Fatal(err)
	}
	return len(e.tk.EncodeOrdinary(s))
}

func mustParse(t *testing.T, body string, api API, opts Options) *Request {
	t.Helper()
	r, err := Parse([]byte(body), api, opts)
	if err != nil {
		t.Fatalf("Parse(%.80s) error: %v", body, err)
	}
	return r
}

func TestAPIForPath(t *testing.T) {
	tests := []struct {
		path string
		want API
		ok   bool
	}{
		{"/v1/chat/completions", APIChat, true},
		{"/openai/v1/chat/completions", APIChat, true},
		{"/v1/completions", APICompletions, true},
		{"/completions", APICompletions, true},
		{"/v1/responses", APIResponses, true},
		{"/openai/v1/responses", APIResponses, true},
		{"/v1/responses/resp_123", APIUnknown, false},
		{"/v1/responses/resp_123/cancel", APIUnknown, false},
		{"/v1/embeddings", APIEmbeddings, true},
		{"/v1/rerank", APIUnknown, false},
		{"/v1/chat/completions/", APIUnknown, false},
		{"", APIUnknown, false},
	}
	for _, tt := range tests {
		got, ok := APIForPath(tt.path)
		if got != tt.want || ok != tt.ok {
			t.Errorf("APIForPath(%q) = %v, %v, want %v, %v", tt.path, got, ok, tt.want, tt.ok)
		}
	}
	for a, want := range map[API]string{APIChat: "chat", APICompletions: "completions", APIResponses: "responses", APIEmbeddings: "embeddings", APIUnknown: "unknown", 9: "unknown"} {
		if a.String() != want {
			t.Errorf("API(%d).String() = %q, want %q", a, a.String(), want)
		}
	}
}

func TestValidEncoding(t *testing.T) {
	for name, want := range map[string]bool{"": true, "cl100k_base": true, "o200k_base": true, "approx": true, "p50k_base": false, "gpt2": false} {
		if got := ValidEncoding(name); got != want {
			t.Errorf("ValidEncoding(%q) = %v, want %v", name, got, want)
		}
	}
	if err := Warm("nope"); err == nil || errors.Is(err, ErrMalformed) {
		t.Errorf("Warm(nope) = %v, want a non-malformed error", err)
	}
	if _, err := Parse([]byte(`{"prompt":"x"}`), APICompletions, Options{Encoding: "nope"}); err == nil || errors.Is(err, ErrMalformed) {
		t.Errorf("Parse with unknown encoding = %v, want a non-malformed error", err)
	}
}

func TestCountsMatchTiktoken(t *testing.T) {
	if got := ref(t, "cl100k_base", "hello world"); got != 2 {
		t.Fatalf("reference cl100k count of hello world = %d, want 2", got)
	}
	texts := []string{
		"hello world",
		"Hello, world! How are you today?",
		"<|endoftext|> is plain text here <|im_start|>",
		"func main() {\n\tfmt.Println(\"hi\")\n}\n",
		"数学是研究数量、结构、变化以及空间等概念的一门学科。",
		"   leading and trailing spaces   ",
		"emoji 🙂🙃 and accents: café, naïve, ﬁ ligature",
	}
	for _, encoding := range []string{"cl100k_base", "o200k_base"} {
		for _, text := range texts {
			body := fmt.Sprintf(`{"prompt":%q}`, text)
			r := mustParse(t, body, APICompletions, Options{Encoding: encoding})
			if want := ref(t, encoding, text); r.PromptTokens != want || r.Estimated {
				t.Errorf("%s: completions %q = %d tokens (estimated %v), want %d", encoding, text, r.PromptTokens, r.Estimated, want)
			}
			chat := fmt.Sprintf(`{"messages":[{"role":"user","content":%q}]}`, text)
			r = mustParse(t, chat, APIChat, Options{Encoding: encoding})
			if want := 3 + 3 + 1 + ref(t, encoding, text); r.PromptTokens != want {
				t.Errorf("%s: chat %q = %d tokens, want %d", encoding, text, r.PromptTokens, want)
			}
		}
	}
}

// cutWords are the pieces the exactness tests build texts of: prose, contractions, numbers, accents
// and combining marks, CJK, JSON, whitespace runs, emoji, URLs.
var cutWords = []string{"the", "Quick", "brown", "fox's", "don't", "3.14159", "12345678", "café", "naïve",
	"数学", "研究。", "(x)", "{\"k\":", "\"v\"},", "\n", "\n\n", "\t", "  ", ".", "!!", "a-b", "🙂",
	"e\u0301", "'s", "I'M", "http://x.y/z?q=1", "\r\n", "\u00a0", "\u3000", "—", "x=1;", "0x1F"}

// randomText joins words drawn by rng, each followed by a space two times in three, until it has at
// least n bytes.
func randomText(rng *rand.Rand, words []string, n int) string {
	var b strings.Builder
	for b.Len() < n {
		b.WriteString(words[rng.Intn(len(words))])
		if rng.Intn(3) > 0 {
			b.WriteByte(' ')
		}
	}
	return b.String()
}

// TestChunkingIsExact checks that cutting text at isCut points never changes the count, on prose,
// code, JSON and CJK, for both encodings, by tokenizing every piece alone.
func TestChunkingIsExact(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	words := cutWords
	exactTexts, cuts := 0, 0
	for _, encoding := range []string{"cl100k_base", "o200k_base"} {
		e, err := encoderFor(encoding)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 300; i++ {
			text := randomText(rng, words, 300)
			want := len(e.tk.EncodeOrdinary(text))
			got, allExact := 0, true
			for s := []byte(text); len(s) > 0; {
				k, exact := nextPiece(s)
				allExact = allExact && exact
				got += len(e.tk.EncodeOrdinary(string(s[:k])))
				s = s[k:]
				cuts++
			}
			if allExact {
				exactTexts++
				if got != want {
					t.Fatalf("%s: count by pieces %d != whole count %d for %q", encoding, got, want, text)
				}
			}
		}
	}
	if exactTexts < 300 {
		t.Errorf("only %d of 600 texts were cut exactly everywhere (%d cuts in all)", exactTexts, cuts)
	}
}

// TestPieceCountsMatchWhole checks that count, piece by piece through the piece cache, gives the
// tokenizer's count of the whole text, on a cold cache and on a warm one, for both encodings.
func TestPieceCountsMatchWhole(t *testing.T) {
	rng := rand.New(rand.NewSource(2))
	words := append(cutWords[:len(cutWords):len(cutWords)], "func", "(ctx", "context.Context)", "err", "!=", "nil", "{", "}", "    ", "return")
	for _, encoding := range []string{"cl100k_base", "o200k_base"} {
		e, err := encoderFor(encoding)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 400; i++ {
			text := randomText(rng, words, 40+rng.Intn(400))
			if !cutExactly(text) {
				continue
			}
			want := len(e.tk.EncodeOrdinary(text))
			for pass := range 2 {
				if got := e.count([]byte(text)); got != want {
					t.Fatalf("%s, pass %d: count %d != whole count %d for %q", encoding, pass, got, want, text)
				}
			}
		}
	}
}

// cutExactly reports whether every cut between text's pieces is exact (no run of maxRun bytes without
// a cut point).
func cutExactly(text string) bool {
	for s := []byte(text); len(s) > 0; {
		k, exact := nextPiece(s)
		if !exact {
			return false
		}
		s = s[k:]
	}
	return true
}

// TestNextPieceMatchesRunes checks nextPiece, which reads ASCII off a table, against the same cut
// decided rune by rune with isCut, on random mixes of every ASCII byte, multi-byte runes, marks and
// invalid UTF-8.
func TestNextPieceMatchesRunes(t *testing.T) {
	byRunes := func(s []byte) (int, bool) {
		prev, size := utf8.DecodeRune(s)
		for i := size; i < len(s); i += size {
			var r rune
			r, size = utf8.DecodeRune(s[i:])
			if isCut(prev, r) {
				return i, true
			}
			if i >= maxRun {
				return i, false
			}
			prev = r
		}
		return len(s), true
	}
	alphabet := []string{"é", "日本", "\u0301", "\xff", "\xe2\x82", "Ω", "\u00a0", "\u0085", "١٢"}
	for c := range utf8.RuneSelf {
		alphabet = append(alphabet, string(rune(c)))
	}
	rng := rand.New(rand.NewSource(3))
	cuts := 0
	for i := 0; i < 3000; i++ {
		var b []byte
		for n := rng.Intn(200); len(b) < n; {
			if rng.Intn(3) == 0 { // runs of one class, so that long pieces and forced cuts occur too
				b = append(b, strings.Repeat(alphabet[rng.Intn(len(alphabet))], 1+rng.Intn(80))...)
			} else {
				b = append(b, alphabet[rng.Intn(len(alphabet))]...)
			}
		}
		for s := b; len(s) > 0; {
			k, exact := nextPiece(s)
			if wk, wexact := byRunes(s); k != wk || exact != wexact {
				t.Fatalf("nextPiece(%q) = %d, %v; rune by rune %d, %v", s, k, exact, wk, wexact)
			}
			s = s[k:]
			cuts++
		}
	}
	if cuts < 10000 {
		t.Errorf("only %d pieces compared", cuts)
	}
}

func TestNextPieceBounds(t *testing.T) {
	tests := []struct {
		name  string
		text  string
		want  int
		exact bool
	}{
		{"a word before a space", "hello world", 5, true},
		{"no cut point: all of it", "hello", 5, true},
		{"long run is forced at maxRun", strings.Repeat("a", 3000), maxRun, false},
		{"long run of spaces", strings.Repeat(" ", 3000), maxRun, false},
		{"cut before the run", "ab " + strings.Repeat("a", 3000), 2, true},
		{"a word with its leading space", strings.Repeat(" word", 1000), 5, true},
		{"multi-byte run is cut at a rune boundary", strings.Repeat("é", 3000), maxRun, false},
	}
	for _, tt := range tests {
		if got, exact := nextPiece([]byte(tt.text)); got != tt.want || exact != tt.exact {
			t.Errorf("%s: nextPiece = %d, %v, want %d, %v", tt.name, got, exact, tt.want, tt.exact)
		}
	}
}

func TestParseChat(t *testing.T) {
	enc := "cl100k_base"
	tok := func(s string) int { return ref(t, enc, s) }
	tests := []struct {
		name   string
		body   string
		tokens int // PromptTokens
		msgs   int
		check  func(t *testing.T, r *Request)
	}{
		{
			name:   "string content and fields",
			body:   `{"model":"llama-3","stream":true,"max_tokens":100,"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"hello world"}]}`,
			tokens: 3 + (3 + 1 + tok("Be brief.")) + (3 + 1 + 2),
			msgs:   2,
			check: func(t *testing.T, r *Request) {
				if r.Model != "llama-3" || !r.Stream || r.MaxTokens != 100 || r.API != APIChat {
					t.Errorf("fields = %q %v %d %v", r.Model, r.Stream, r.MaxTokens, r.API)
				}
			},
		},
		{
			name:   "max_completion_tokens wins over max_tokens",
			body:   `{"max_completion_tokens":7,"max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`,
			tokens: 3 + 3 + 1 + tok("hi"), msgs: 1,
			check: func(t *testing.T, r *Request) {
				if r.MaxTokens != 7 {
					t.Errorf("MaxTokens = %d, want 7", r.MaxTokens)
				}
			},
		},
		{
			name:   "null content, null max_tokens, null model",
			body:   `{"model":null,"max_tokens":null,"stream":null,"messages":[{"role":"assistant","content":null}]}`,
			tokens: 3 + 3 + 1, msgs: 1,
		},
		{
			name:   "content parts: text joined by count, image fixed",
			body:   `{"messages":[{"role":"user","content":[{"type":"text","text":"What is this?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}]}]}`,
			tokens: 3 + 3 + 1 + tok("What is this?") + 2*partTokens, msgs: 1,
		},
		{
			name:   "name adds its tokens plus one",
			body:   `{"messages":[{"role":"user","name":"alice","content":"hi"}]}`,
			tokens: 3 + 3 + 1 + tok("alice") + 1 + tok("hi"), msgs: 1,
		},
		{
			name: "tool calls and tool results",
			body: `{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},` +
				`{"role":"tool","tool_call_id":"call_1","content":"sunny"}]}`,
			tokens: 3 + (3 + 1 + tok("get_weather") + tok(`{"city":"Paris"}`)) + (3 + tok("tool") + tok("sunny")), msgs: 2,
		},
		{
			name:   "tools count as a leading pseudo-message",
			body:   `{"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"messages":[{"role":"user","content":"hi"}]}`,
			tokens: 3 + tok(`[{"type":"function","function":{"name":"f","parameters":{}}}]`) + 3 + 1 + tok("hi"), msgs: 1,
			check: func(t *testing.T, r *Request) {
				want := tok(`[{"type":"function","function":{"name":"f","parameters":{}}}]`)
				if r.ToolsTokens != want || len(r.Boundaries) != 2 || r.Boundaries[0].Tokens != 3+want {
					t.Errorf("ToolsTokens = %d, Boundaries = %v, want %d and 2 boundaries", r.ToolsTokens, r.Boundaries, want)
				}
			},
		},
		{
			name:   "unknown fields and prompt are ignored, escapes decoded",
			body:   `{"temperature":0.5,"logit_bias":{"1":[1,{"x":null}]},"prompt":5,"messages":[{"role":"user","content":"caf\u00e9 \ud83d\ude42\n","extra":true}]}`,
			tokens: 3 + 3 + 1 + tok("café 🙂\n"), msgs: 1,
		},
		{
			name:   "repeated keys: the last one wins",
			body:   `{"messages":[{"role":"user","content":"a"}],"messages":[{"role":"user","content":"x","content":"hello world"},{"role":"user","content":"b"}]}`,
			tokens: 3 + (3 + 1 + 2) + (3 + 1 + tok("b")), msgs: 2,
		},
		{
			name:   "unknown role is tokenized",
			body:   `{"messages":[{"role":"narrator","content":"hi"}]}`,
			tokens: 3 + 3 + tok("narrator") + tok("hi"), msgs: 1,
		},
		{
			name:   "whitespace around everything",
			body:   " \n{ \"messages\" : [ { \"role\" : \"user\" , \"content\" : \"hi\" } ] } \r\n",
			tokens: 3 + 3 + 1 + tok("hi"), msgs: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := mustParse(t, tt.body, APIChat, Options{Encoding: enc})
			if r.PromptTokens != tt.tokens {
				t.Errorf("PromptTokens = %d, want %d", r.PromptTokens, tt.tokens)
			}
			if len(r.Messages) != tt.msgs {
				t.Fatalf("len(Messages) = %d, want %d", len(r.Messages), tt.msgs)
			}
			if last := r.Messages[len(r.Messages)-1].End; last != r.PromptTokens {
				t.Errorf("last End = %d, want PromptTokens %d", last, r.PromptTokens)
			}
			sum := 3 + r.ToolsTokens
			for _, m := range r.Messages {
				sum += m.Tokens
			}
			if sum != r.PromptTokens {
				t.Errorf("3 + tools + Σ Tokens = %d, want %d", sum, r.PromptTokens)
			}
			checkBoundaries(t, r)
			if tt.check != nil {
				tt.check(t, r)
			}
		})
	}
}

// checkBoundaries asserts the Boundaries invariants: strictly increasing, every message end present.
func checkBoundaries(t *testing.T, r *Request) {
	t.Helper()
	ends := map[int]bool{}
	for i, b := range r.Boundaries {
		if i > 0 && b.Tokens <= r.Boundaries[i-1].Tokens {
			t.Fatalf("Boundaries not increasing at %d: %v", i, r.Boundaries[i-1:i+1])
		}
		ends[b.Tokens] = true
	}
	prev := -1
	for i, m := range r.Messages {
		if m.End > prev && !ends[m.End] {
			t.Errorf("message %d end %d is not a boundary", i, m.End)
		}
		prev = m.End
	}
}

func TestParseCompletions(t *testing.T) {
	tok := func(s string) int { return ref(t, "cl100k_base", s) }
	tests := []struct {
		name   string
		body   string
		tokens int
		msgs   int
	}{
		{"string", `{"model":"m","prompt":"hello world","max_tokens":3}`, 2, 1},
		{"empty string", `{"prompt":""}`, 0, 1},
		{"array of strings", `{"prompt":["hello world","Once upon a time"]}`, 2 + tok("Once upon a time"), 2},
		{"token IDs", `{"prompt":[1,2,3,4,5]}`, 5, 1},
		{"arrays of token IDs", `{"prompt":[[1,2,3],[4,5]]}`, 5, 2},
		{"special tokens are text", `{"prompt":"<|endoftext|>"}`, tok("<|endoftext|>"), 1},
		{"messages ignored", `{"prompt":"hi","messages":7}`, tok("hi"), 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := mustParse(t, tt.body, APICompletions, Options{})
			if r.PromptTokens != tt.tokens || len(r.Messages) != tt.msgs || r.API != APICompletions {
				t.Errorf("PromptTokens, messages = %d, %d, want %d, %d", r.PromptTokens, len(r.Messages), tt.tokens, tt.msgs)
			}
			checkBoundaries(t, r)
		})
	}
}

func TestParseMalformed(t *testing.T) {
	deep := strings.Repeat("[", 100000) + strings.Repeat("]", 100000)
	tests := []struct {
		name string
		api  API
		body string
		want string
	}{
		{"empty body", APIChat, ``, "empty body"},
		{"only whitespace", APIChat, "  \n", "empty body"},
		{"not an object", APIChat, `[1,2]`, "body must be a JSON object, not an array"},
		{"truncated", APIChat, `{"messages":[{"role":"user","content":"hi"`, "unexpected end of input"},
		{"trailing garbage", APIChat, `{"messages":[{"role":"user","content":"hi"}]} x`, "unexpected data after the top-level object"},
		{"two objects", APIChat, `{"messages":[{"role":"user","content":"hi"}]}{}`, "unexpected data after"},
		{"invalid JSON token", APIChat, `{"messages":[{"role":"user","content":hi}]}`, "invalid JSON"},
		{"single quotes", APIChat, `{'messages':[]}`, "invalid JSON"},
		{"trailing comma", APIChat, `{"messages":[{"role":"user","content":"hi"},]}`, "invalid JSON"},
		{"bad escape", APIChat, `{"messages":[{"role":"user","content":"\x"}]}`, "bad escape"},
		{"bad unicode escape", APIChat, `{"messages":[{"role":"user","content":"\u12"}]}`, "bad \\u escape"},
		{"control character", APIChat, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\x01\"}]}", "control character"},
		{"bad number", APIChat, `{"x":01,"messages":[]}`, "invalid JSON"},
		{"invalid UTF-8", APIChat, "{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}", "not valid UTF-8 (at offset 39)"},
		{"deep nesting", APIChat, `{"x":` + deep + `,"messages":[]}`, "nested too deeply"},
		{"messages missing", APIChat, `{"model":"m"}`, "messages is required"},
		{"messages an object", APIChat, `{"messages":{"role":"user"}}`, "messages must be an array, not an object"},
		{"messages null", APIChat, `{"messages":null}`, "messages must be an array, not null"},
		{"messages empty", APIChat, `{"messages":[]}`, "messages must not be empty"},
		{"message a string", APIChat, `{"messages":["hi"]}`, "messages[0] must be an object, not a string"},
		{"role missing", APIChat, `{"messages":[{"content":"hi"}]}`, "messages[0] must have a string role"},
		{"role a number", APIChat, `{"messages":[{"role":1,"content":"hi"}]}`, "messages[0].role must be a string, not a number"},
		{"content a number", APIChat, `{"messages":[{"role":"user","content":"a"},{"role":"user","content":42}]}`, "messages[1].content must be a string, an array of content parts, or null, not a number"},
		{"content part a string", APIChat, `{"messages":[{"role":"user","content":["hi"]}]}`, "messages[0].content[0] must be an object, not a string"},
		{"content part without type", APIChat, `{"messages":[{"role":"user","content":[{"text":"hi"}]}]}`, "messages[0].content[0] must have a string type"},
		{"text part without text", APIChat, `{"messages":[{"role":"user","content":[{"type":"text"}]}]}`, "content[0] of type text must have a string text"},
		{"text part text a number", APIChat, `{"messages":[{"role":"user","content":[{"type":"text","text":1}]}]}`, "content[0].text must be a string, not a number"},
		{"name a number", APIChat, `{"messages":[{"role":"user","name":5,"content":"x"}]}`, "messages[0].name must be a string, not a number"},
		{"tool_calls an object", APIChat, `{"messages":[{"role":"assistant","tool_calls":{}}]}`, "messages[0].tool_calls must be an array, not an object"},
		{"tool call function a string", APIChat, `{"messages":[{"role":"assistant","tool_calls":[{"function":"f"}]}]}`, "messages[0].tool_calls[0].function must be an object"},
		{"tool call arguments an object", APIChat, `{"messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":{}}}]}]}`, "messages[0].tool_calls[0].function.arguments must be a string, not an object"},
		{"tool_call_id a number", APIChat, `{"messages":[{"role":"tool","tool_call_id":3,"content":"x"}]}`, "messages[0].tool_call_id must be a string"},
		{"tools an object", APIChat, `{"tools":{},"messages":[{"role":"user","content":"x"}]}`, "tools must be an array, not an object"},
		{"model a number", APIChat, `{"model":5,"messages":[{"role":"user","content":"x"}]}`, "model must be a string, not a number"},
		{"prompt missing", APICompletions, `{"model":"m"}`, "prompt is required"},
		{"prompt null", APICompletions, `{"prompt":null}`, "prompt is required"},
		{"prompt a number", APICompletions, `{"prompt":5}`, "prompt must be a string, an array of strings, or an array of token IDs, not a number"},
		{"prompt empty array", APICompletions, `{"prompt":[]}`, "prompt must not be an empty array"},
		{"prompt mixed", APICompletions, `{"prompt":["a",1]}`, "must all be strings, all token IDs, or all arrays"},
		{"prompt object element", APICompletions, `{"prompt":[{}]}`, "prompt[0] must be a string, a token ID or an array of token IDs, not an object"},
		{"prompt negative token", APICompletions, `{"prompt":[1,-2]}`, "prompt token IDs must be non-negative integers"},
		{"prompt float token", APICompletions, `{"prompt":[1.5]}`, "prompt token IDs must be non-negative integers"},
		{"prompt empty token array", APICompletions, `{"prompt":[[1],[]]}`, "prompt[1] must not be an empty token array"},
		{"prompt nested string", APICompletions, `{"prompt":[["a"]]}`, "prompt token IDs must be integers, not a string"},
		{"unknown API", APIUnknown, `{}`, "unsupported API"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := Parse([]byte(tt.body), tt.api, Options{})
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("Parse() = %+v, %v, want ErrMalformed", r, err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Parse() error %q, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestMessageHashIsCanonical(t *testing.T) {
	base := `{"messages":[{"role":"user","content":"café","name":"a"}]}`
	same := []string{
		`{"messages":[{"name":"a","content":"caf\u00e9","role":"user"}]}`,
		`{"messages":[ {"content" : "café", "role":"user", "name":"\u0061", "x":1} ]}`,
	}
	different := []string{
		`{"messages":[{"role":"user","content":"cafe","name":"a"}]}`,
		`{"messages":[{"role":"system","content":"café","name":"a"}]}`,
		`{"messages":[{"role":"user","content":"café"}]}`,
		`{"messages":[{"role":"user","content":"café","name":"a","tool_call_id":"x"}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"café"},{"type":"image_url","image_url":{"url":"u"}}],"name":"a"}]}`,
	}
	h := mustParse(t, base, APIChat, Options{}).Messages[0].Hash
	for _, b := range same {
		if got := mustParse(t, b, APIChat, Options{}).Messages[0].Hash; got != h {
			t.Errorf("hash of %s = %x, want %x (same message)", b, got, h)
		}
	}
	for _, b := range different {
		if got := mustParse(t, b, APIChat, Options{}).Messages[0].Hash; got == h {
			t.Errorf("hash of %s equals the base message's", b)
		}
	}
	// The model is not part of any hash.
	a := mustParse(t, `{"model":"a","messages":[{"role":"user","content":"x"}]}`, APIChat, Options{})
	b := mustParse(t, `{"model":"b","messages":[{"role":"user","content":"x"}]}`, APIChat, Options{})
	if a.Boundaries[0] != b.Boundaries[0] {
		t.Errorf("boundaries differ by model: %v vs %v", a.Boundaries, b.Boundaries)
	}
}

func chatJSON(contents ...string) string {
	var b strings.Builder
	b.WriteString(`{"model":"m","messages":[`)
	for i, c := range contents {
		if i > 0 {
			b.WriteByte(',')
		}
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		fmt.Fprintf(&b, `{"role":%q,"content":%q}`, role, c)
	}
	b.WriteString(`]}`)
	return b.String()
}

func TestBoundariesSharedPrefix(t *testing.T) {
	a := mustParse(t, chatJSON("one", "two", "three", "four"), APIChat, Options{})
	b := mustParse(t, chatJSON("one", "two", "three", "FOUR", "five"), APIChat, Options{})
	if len(a.Boundaries) != 4 || len(b.Boundaries) != 5 {
		t.Fatalf("boundaries: %d and %d, want 4 and 5", len(a.Boundaries), len(b.Boundaries))
	}
	for i := 0; i < 3; i++ {
		if a.Boundaries[i] != b.Boundaries[i] {
			t.Errorf("boundary %d differs: %v vs %v", i, a.Boundaries[i], b.Boundaries[i])
		}
	}
	if a.Boundaries[3].Hash == b.Boundaries[3].Hash {
		t.Errorf("boundary 3 equal after the messages diverge")
	}
	// Completions and chat with the same text do not share hashes.
	c := mustParse(t, `{"prompt":"one"}`, APICompletions, Options{})
	if c.Boundaries[0].Hash == a.Boundaries[0].Hash {
		t.Errorf("chat and completions share a boundary hash")
	}
}

func TestStepBoundaries(t *testing.T) {
	doc := strings.Repeat("All work and no play makes Jack a dull boy. ", 100) // 4,400 bytes
	a := mustParse(t, chatJSON("sys", doc+"Question one?"), APIChat, Options{})
	b := mustParse(t, chatJSON("sys", doc+"A different, longer question two?"), APIChat, Options{})
	again := mustParse(t, chatJSON("sys", doc+"Question one?"), APIChat, Options{})
	checkBoundaries(t, a)
	checkBoundaries(t, b)
	if fmt.Sprint(a.Boundaries) != fmt.Sprint(again.Boundaries) {
		t.Errorf("the same request gave different boundaries")
	}
	wantSteps := len(doc) / StepBytes // full blocks inside the shared document
	if got := len(a.Boundaries) - 2; got < wantSteps {
		t.Fatalf("%d step boundaries, want at least %d", got, wantSteps)
	}
	aHashes := map[uint64]bool{}
	for _, x := range a.Boundaries {
		aHashes[x.Hash] = true
	}
	shared := 0
	for _, x := range b.Boundaries {
		if aHashes[x.Hash] {
			shared++
		}
	}
	// The first message's end plus every step over the shared document.
	if want := 1 + wantSteps; shared != want {
		t.Errorf("requests share %d boundary hashes, want %d", shared, want)
	}
	// Token positions of steps are inside the message and increasing.
	m := a.Messages[1]
	for _, x := range a.Boundaries[1 : len(a.Boundaries)-1] {
		if x.Tokens <= m.End-m.Tokens || x.Tokens >= m.End {
			t.Errorf("step at %d outside message [%d, %d)", x.Tokens, m.End-m.Tokens, m.End)
		}
	}

	// At most maxSteps step boundaries per request.
	huge := mustParse(t, chatJSON(strings.Repeat("x y ", 600000)), APIChat, Options{})
	if got := len(huge.Boundaries); got != maxSteps+1 {
		t.Errorf("2.4 MB message has %d boundaries, want %d steps and its end", got, maxSteps)
	}

	// Token-ID prompts step every tokenIDBlock tokens at exact positions.
	ids := make([]string, 200)
	for i := range ids {
		ids[i] = fmt.Sprint(i)
	}
	r := mustParse(t, `{"prompt":[`+strings.Join(ids, ",")+`]}`, APICompletions, Options{})
	var got []int
	for _, x := range r.Boundaries {
		got = append(got, x.Tokens)
	}
	if fmt.Sprint(got) != "[64 128 192 200]" {
		t.Errorf("token-ID boundaries at %v, want [64 128 192 200]", got)
	}
}

// TestCacheSkipsTokenizer shows that a repeated conversation tokenizes only its new message.
func TestCacheSkipsTokenizer(t *testing.T) {
	msgs := []string{"cache test: first message " + t.Name(), "second", "third message here"}
	first := mustParse(t, chatJSON(msgs...), APIChat, Options{})
	_, _, calls := CacheStats()
	second := mustParse(t, chatJSON(msgs...), APIChat, Options{})
	if _, _, after := CacheStats(); after != calls {
		t.Errorf("second Parse made %d tokenizer calls, want 0", after-calls)
	}
	if fmt.Sprint(first) != fmt.Sprint(second) {
		t.Errorf("cached result differs: %+v vs %+v", first, second)
	}
	_, _, calls = CacheStats()
	mustParse(t, chatJSON(append(msgs, "xyzzyturn")...), APIChat, Options{})
	if _, _, after := CacheStats(); after != calls+1 {
		t.Errorf("Parse with one new message of one new piece made %d tokenizer calls, want 1", after-calls)
	}
	// A new message of pieces seen before ("xyzzyturn", " xyzzyturn" after the next Parse) is counted
	// from the piece cache.
	_, _, calls = CacheStats()
	mustParse(t, chatJSON(append(msgs, "xyzzyturn xyzzyturn")...), APIChat, Options{})
	if _, _, after := CacheStats(); after != calls+1 {
		t.Errorf("Parse with one new message of one new piece and one seen made %d tokenizer calls, want 1", after-calls)
	}
	_, _, calls = CacheStats()
	third := mustParse(t, chatJSON(append(msgs, "xyzzyturn xyzzyturn xyzzyturn")...), APIChat, Options{})
	if _, _, after := CacheStats(); after != calls {
		t.Errorf("Parse with one new message of seen pieces made %d tokenizer calls, want 0", after-calls)
	}
	if want := first.PromptTokens + 4 + ref(t, "cl100k_base", "xyzzyturn xyzzyturn xyzzyturn"); third.PromptTokens != want {
		t.Errorf("counted from pieces: %d tokens, want %d", third.PromptTokens, want)
	}
	// o200k_base has its own entries.
	_, _, calls = CacheStats()
	mustParse(t, chatJSON(msgs...), APIChat, Options{Encoding: "o200k_base"})
	if _, _, after := CacheStats(); after == calls {
		t.Errorf("o200k_base reused cl100k_base counts")
	}
}

func TestBudgets(t *testing.T) {
	long := strings.Repeat("lorem ipsum ", 1000) // 12,000 bytes
	r := mustParse(t, chatJSON("short", long), APIChat, Options{MaxMessageBytes: 10000})
	if !r.Estimated {
		t.Errorf("message over MaxMessageBytes not estimated")
	}
	if want := 3 + 3 + 1 + ref(t, "cl100k_base", "short") + 3 + 1 + Estimate(long); r.PromptTokens != want {
		t.Errorf("PromptTokens = %d, want %d", r.PromptTokens, want)
	}
	// The total budget: the first message fits, the second does not.
	a, b := strings.Repeat("alpha ", 100)+t.Name(), strings.Repeat("beta ", 100)+t.Name()
	r = mustParse(t, chatJSON(a, b), APIChat, Options{MaxTotalBytes: 700})
	if !r.Estimated || r.Messages[0].Tokens != 3+1+ref(t, "cl100k_base", a) || r.Messages[1].Tokens != 3+1+Estimate(b) {
		t.Errorf("budget: %+v", r)
	}
	// Estimated counts are not cached: with a larger budget the same request is exact.
	r = mustParse(t, chatJSON(a, b), APIChat, Options{})
	if r.Estimated || r.Messages[1].Tokens != 3+1+ref(t, "cl100k_base", b) {
		t.Errorf("after budget: %+v", r)
	}
	// 100k tiny messages: bounded tokenizer calls.
	tiny := make([]string, 100000)
	for i := range tiny {
		tiny[i] = fmt.Sprintf("m%d", i)
	}
	_, _, calls := CacheStats()
	r = mustParse(t, chatJSON(tiny...), APIChat, Options{})
	_, _, after := CacheStats()
	if max := uint64(DefaultMaxTotalBytes / minChargeBytes); after-calls > max {
		t.Errorf("100k tiny messages made %d tokenizer calls, want at most %d", after-calls, max)
	}
	if len(r.Messages) != keepFirstMessages+keepLastMessages || !r.Estimated {
		t.Errorf("100k messages: %d messages (capped), estimated %v", len(r.Messages), r.Estimated)
	}
}

func TestApprox(t *testing.T) {
	r := mustParse(t, chatJSON("hello world", "数学"), APIChat, Options{Encoding: "approx"})
	if want := 3 + (3 + Estimate("user") + Estimate("hello world")) + (3 + Estimate("assistant") + 2); r.PromptTokens != want || !r.Estimated {
		t.Errorf("approx PromptTokens = %d (estimated %v), want %d", r.PromptTokens, r.Estimated, want)
	}
	for s, want := range map[string]int{"": 0, "a": 1, "abcd": 1, "abcde": 2, "数学": 2, "ab数": 2, "\xff": 1} {
		if got := Estimate(s); got != want {
			t.Errorf("Estimate(%q) = %d, want %d", s, got, want)
		}
	}
}

// TestHostile feeds the bodies of issue 6's table: each either parses with an estimate or fails
// with ErrMalformed, with a bounded number of tokenizer calls.
func TestHostile(t *testing.T) {
	run := strings.Repeat("a", 10<<20)
	tests := []struct {
		name      string
		body      string
		malformed bool
	}{
		{"10 MB of one character", chatJSON(run), false},
		{"30 KB run of a", chatJSON(strings.Repeat("a", 30000)), false},
		{"30 KB run of spaces", chatJSON(strings.Repeat(" ", 30000)), false},
		{"30 KB prompt run", `{"prompt":"` + strings.Repeat("z", 30000) + `"}`, false},
		{"special tokens", chatJSON("<|endoftext|><|im_start|>system<|im_end|><|fim_prefix|>"), false},
		{"100k nesting in content", `{"messages":[{"role":"user","content":` + strings.Repeat("[", 100000) + `}]}`, true},
		{"100k nesting of objects", strings.Repeat(`{"a":`, 100000), true},
		{"invalid UTF-8", "{\"messages\":[{\"role\":\"user\",\"content\":\"\xc3\x28\"}]}", true},
		{"lone surrogate escape", `{"messages":[{"role":"user","content":"\ud800x"}]}`, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			api := APIChat
			if strings.HasPrefix(tt.body, `{"prompt"`) {
				api = APICompletions
			}
			_, _, calls := CacheStats()
			r, err := Parse([]byte(tt.body), api, Options{})
			_, _, after := CacheStats()
			if tt.malformed != errors.Is(err, ErrMalformed) {
				t.Fatalf("Parse() error = %v, want malformed %v", err, tt.malformed)
			}
			if err == nil && r.PromptTokens <= 0 {
				t.Errorf("PromptTokens = %d", r.PromptTokens)
			}
			if max := uint64(DefaultMaxTotalBytes/minChargeBytes) + 10; after-calls > max {
				t.Errorf("%d tokenizer calls, want at most %d", after-calls, max)
			}
		})
	}
}

// TestConcurrentParse is a -race stress of the shared encoders and cache.
func TestConcurrentParse(t *testing.T) {
	var wg sync.WaitGroup
	bodies := []string{
		chatJSON("shared system prompt", "hello", "world"),
		chatJSON("shared system prompt", "hello", "there"),
		`{"prompt":["a b c","d e f"]}`,
	}
	want := make([]int, len(bodies))
	for i, b := range bodies {
		api := APIChat
		if i == 2 {
			api = APICompletions
		}
		want[i] = mustParse(t, b, api, Options{}).PromptTokens
	}
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				k := (g + i) % len(bodies)
				api := APIChat
				if k == 2 {
					api = APICompletions
				}
				body := bodies[k]
				if i%10 == 0 { // a cache miss now and then
					body = chatJSON(fmt.Sprintf("g%d i%d", g, i))
					api = APIChat
				}
				r, err := Parse([]byte(body), api, Options{Encoding: []string{"cl100k_base", "o200k_base", "approx"}[i%3]})
				if err != nil {
					t.Error(err)
					return
				}
				if body == bodies[k] && i%3 == 0 && r.PromptTokens != want[k] {
					t.Errorf("concurrent PromptTokens = %d, want %d", r.PromptTokens, want[k])
				}
			}
		}(g)
	}
	wg.Wait()
}

// TestEncodersBuiltOnce guards the "never per request" rule: encoderFor returns the same
// tiktoken instance every time.
func TestEncodersBuiltOnce(t *testing.T) {
	a, _ := encoderFor("")
	b, _ := encoderFor("cl100k_base")
	if a != b || a.tk == nil {
		t.Fatalf("encoderFor built twice or not at all")
	}
	var _ *tiktoken.Tiktoken = a.tk
}

// TestParseLaxHints pins that the routing hints are read as vLLM's and SGLang's pydantic models read them
// (lax mode), and that values they would refuse are left absent rather than refused by the proxy.
func TestParseLaxHints(t *testing.T) {
	for _, tc := range []struct {
		fields    string
		stream    bool
		maxTokens int
	}{
		{`"stream":true,"max_tokens":5`, true, 5},
		{`"stream":"true","max_tokens":"5"`, true, 5},
		{`"stream":"YES","max_tokens":100.0`, true, 100},
		{`"stream":1,"max_completion_tokens":1e2`, true, 100},
		{`"stream":"off","max_tokens":null`, false, 0},
		{`"stream":0,"max_tokens":-1`, false, 0},
		{`"stream":"maybe","max_tokens":1.5`, false, 0},
		{`"stream":{},"max_tokens":[1]`, false, 0},
		{`"stream":[true],"max_tokens":99999999999999999999`, false, 0},
		{`"max_tokens":"many"`, false, 0},
	} {
		body := `{` + tc.fields + `,"messages":[{"role":"user","content":"x"}]}`
		req, err := Parse([]byte(body), APIChat, Options{Encoding: "approx"})
		if err != nil {
			t.Errorf("Parse(%s): %v", body, err)
			continue
		}
		if req.Stream != tc.stream || req.MaxTokens != tc.maxTokens {
			t.Errorf("Parse(%s): stream %v, max tokens %d; want %v, %d", body, req.Stream, req.MaxTokens, tc.stream, tc.maxTokens)
		}
	}
	// Still JSON: a hint that is not a valid JSON value is malformed.
	if _, err := Parse([]byte(`{"stream":tru,"messages":[]}`), APIChat, Options{}); !errors.Is(err, ErrMalformed) {
		t.Errorf("Parse with an invalid literal: %v, want ErrMalformed", err)
	}
}

// TestAssistantMessagesMarked: chat messages of role assistant are marked, and nothing else is.
func TestAssistantMessagesMarked(t *testing.T) {
	body := `{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"u"},` +
		`{"role":"assistant","content":"a"},{"role":"tool","content":"t"},{"role":"user","content":"assistant"}]}`
	req, err := Parse([]byte(body), APIChat, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i, m := range req.Messages {
		if want := i == 2; m.Assistant != want {
			t.Errorf("message %d: Assistant = %v, want %v", i, m.Assistant, want)
		}
	}
	comp, err := Parse([]byte(`{"model":"m","prompt":["a","b"]}`), APICompletions, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i, m := range comp.Messages {
		if m.Assistant {
			t.Errorf("completions prompt %d marked assistant", i)
		}
	}
}

// TestSequences: n (chat, completions) and a completion's best_of, read as vLLM reads them, make the
// request's Sequences, the larger of the two; absent, zero or unreadable, one; a response's n is no field
// of the Responses API.
func TestSequences(t *testing.T) {
	const chat = `"messages":[{"role":"user","content":"hi"}]`
	for _, tt := range []struct {
		body string
		api  API
		want int
	}{
		{`{` + chat + `}`, APIChat, 1},
		{`{"n":4,` + chat + `}`, APIChat, 4},
		{`{"n":"8",` + chat + `}`, APIChat, 8},
		{`{"n":0,` + chat + `}`, APIChat, 1},
		{`{"n":"many",` + chat + `}`, APIChat, 1},
		{`{"n":1e9,` + chat + `}`, APIChat, 1024},
		{`{"prompt":"hi","n":2,"best_of":5}`, APICompletions, 5},
		{`{"prompt":"hi","best_of":3}`, APICompletions, 3},
		{`{"best_of":3,` + chat + `}`, APIChat, 1},
		{`{"input":"hi","n":4}`, APIResponses, 1},
		{`{"input":"hi","n":4}`, APIEmbeddings, 1},
	} {
		if got := mustParse(t, tt.body, tt.api, Options{Encoding: "approx"}).Sequences; got != tt.want {
			t.Errorf("%v %s: Sequences %d, want %d", tt.api, tt.body, got, tt.want)
		}
	}
}
