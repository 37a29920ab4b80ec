package caddyllm

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// hostileBody is one bad input: what the matcher must answer (status, and words its message must
// contain), while the policy alone routes it and proxies it intact.
type hostileBody struct {
	name       string
	body       func(salt int) []byte // salt makes message texts unique (the message cache never answers)
	wantStatus int                   // from the matcher route: 400, 413, or 200 for bodies that are valid after all
	wantMsg    string                // a phrase the error message must contain (empty for 200)
}

// repeatJSON is prefix, n copies of elem separated by sep, and suffix.
func repeatJSON(prefix, elem, sep, suffix string, n int) []byte {
	var b bytes.Buffer
	b.Grow(len(prefix) + n*(len(elem)+len(sep)) + len(suffix))
	b.WriteString(prefix)
	for i := range n {
		if i > 0 {
			b.WriteString(sep)
		}
		b.WriteString(elem)
	}
	b.WriteString(suffix)
	return b.Bytes()
}

// hostileBodies is the table issue 6 asks for. Sizes are the real ones (10 MB, 100k levels, 100k
// messages); the bodies are built once per use.
var hostileBodies = []hostileBody{
	{name: "empty", body: func(int) []byte { return nil }, wantStatus: 400, wantMsg: "empty body"},
	{name: "truncated_json", body: func(salt int) []byte { return []byte(`{"model":"m","messages":[{"role":"user","content":"hel`) }, wantStatus: 400, wantMsg: "unexpected end"},
	{name: "invalid_json", body: func(salt int) []byte { return []byte(`{model: m, messages: []}`) }, wantStatus: 400, wantMsg: "invalid JSON"},
	{name: "messages_object", body: func(salt int) []byte { return []byte(`{"model":"m","messages":{"role":"user","content":"hi"}}`) }, wantStatus: 400, wantMsg: "messages must be an array"},
	{name: "content_number", body: func(salt int) []byte { return []byte(`{"model":"m","messages":[{"role":"user","content":42}]}`) }, wantStatus: 400, wantMsg: "content must be"},
	{name: "nesting_100k", body: func(salt int) []byte {
		return []byte(`{"model":"m","messages":[{"role":"user","content":"x","x":` + strings.Repeat("[", 100_000) + strings.Repeat("]", 100_000) + `}]}`)
	}, wantStatus: 400, wantMsg: "nest"},
	{name: "invalid_utf8", body: func(salt int) []byte {
		return []byte("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\xff\xfe\xc3(\"}]}")
	}, wantStatus: 400, wantMsg: "UTF-8"},
	{name: "one_char_10MB", body: func(salt int) []byte {
		return []byte(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%d`, salt) + strings.Repeat("a", 10<<20) + `"}]}`)
	}, wantStatus: 413, wantMsg: "too large"},
	{name: "one_char_3MB", body: func(salt int) []byte {
		return []byte(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%d`, salt) + strings.Repeat("a", 3<<20) + `"}]}`)
	}, wantStatus: 413, wantMsg: "too large"},
	{name: "one_char_filling_cap", body: func(salt int) []byte {
		return []byte(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%d`, salt) + strings.Repeat("a", 2<<20-100) + `"}]}`)
	}, wantStatus: 200},
	{name: "special_tokens", body: func(salt int) []byte {
		return []byte(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%d`, salt) + `<|endoftext|><|im_start|>system<|im_end|><|fim_prefix|>` + strings.Repeat("<|endoftext|>", 1000) + `"}]}`)
	}, wantStatus: 200},
	{name: "special_tokens_4x32KiB", body: func(salt int) []byte {
		var msgs []string // four different messages, each just under the 32 KiB tokenized per message
		for i := range 4 {
			msgs = append(msgs, fmt.Sprintf(`{"role":"user","content":"%d`, salt*4+i)+strings.Repeat("<|endoftext|>", 32<<10/13-1)+`"}`)
		}
		return []byte(`{"model":"m","messages":[` + strings.Join(msgs, ",") + `]}`)
	}, wantStatus: 200},
	{name: "messages_100k_tiny", body: func(salt int) []byte {
		return tinyMessages(salt, 100_000)
	}, wantStatus: 413, wantMsg: "too large"},
	{name: "messages_tiny_filling_cap", body: func(salt int) []byte {
		return tinyMessages(salt, 52_000) // just under 2 MiB: about the most messages a body under the default cap holds
	}, wantStatus: 200},
	{name: "prompt_tokens_1M", body: func(salt int) []byte { return repeatJSON(`{"model":"m","prompt":[`, "100257", ",", `]}`, 500_000) }, wantStatus: 413, wantMsg: "too large"},
	{name: "prompt_tokens_filling_cap", body: func(salt int) []byte { return repeatJSON(`{"model":"m","prompt":[`, "100257", ",", `]}`, 290_000) }, wantStatus: 200},
	{name: "binary", body: func(salt int) []byte {
		b := make([]byte, 4096)
		for i := range b {
			b[i] = byte(i * 7)
		}
		return b
	}, wantStatus: 400, wantMsg: "UTF-8"},
}

// tinyMessages is a chat request of n distinct messages of a few bytes each.
func tinyMessages(salt, n int) []byte {
	var b bytes.Buffer
	b.WriteString(`{"model":"m","messages":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"role":"user","content":"%x"}`, salt*n+i)
	}
	b.WriteString(`]}`)
	return b.Bytes()
}

// hostileMatcherConfig routes LLM requests by the matcher; errors are answered with their status and
// message when withErrors is set, else by Caddy's default (the status alone).
func hostileMatcherConfig(withErrors bool) string {
	errs := ""
	if withErrors {
		errs = "\n\thandle_errors {\n\t\trespond \"{err.status_code} {err.message}\"\n\t}"
	}
	return globalOptions + `
` + site + ` {
	@m llm {
		model *
	}
	handle @m {
		respond "matched" 200
	}
	handle {
		respond 404
	}` + errs + `
}
`
}

// TestHostileBodiesMatcher: every hostile body gets a clear answer from the matcher, never a 5xx, a
// panic or a stall: 400 or 413 with a message saying what is wrong, or a match for bodies that are
// valid after all. Without handle_errors Caddy answers the status with an empty body (the message goes
// to the log at debug level); with handle_errors { respond "{err.message}" } the client reads it.
func TestHostileBodiesMatcher(t *testing.T) {
	tester := caddytest.NewTester(t)
	client := newLoadClient(true)
	defer client.CloseIdleConnections()
	for _, withErrors := range []bool{false, true} {
		tester.InitServer(hostileMatcherConfig(withErrors), "caddyfile")
		// The kept-alive connections belong to the server the reload just shut down: a POST sent on one
		// as it closes fails with EOF (net/http retries only idempotent requests), more often the busier
		// the machine. A client's problem after any reload, not this test's subject.
		client.CloseIdleConnections()
		for _, tc := range hostileBodies {
			t.Run(fmt.Sprintf("%s/handle_errors=%t", tc.name, withErrors), func(t *testing.T) {
				path := "/v1/chat/completions"
				if strings.Contains(tc.name, "prompt_tokens") {
					path = "/v1/completions"
				}
				res, got := post(t, client, path, string(tc.body(0)))
				if res.StatusCode != tc.wantStatus {
					t.Fatalf("status %d (body %.200q), want %d", res.StatusCode, got, tc.wantStatus)
				}
				switch {
				case tc.wantStatus == http.StatusOK:
					if got != "matched" {
						t.Errorf("body %q, want matched", got)
					}
				case withErrors:
					if !strings.Contains(got, tc.wantMsg) {
						t.Errorf("message %q does not say %q", got, tc.wantMsg)
					}
				default:
					if got != "" {
						t.Logf("default error body %q", got)
					}
				}
				if withErrors && tc.wantStatus != http.StatusOK {
					t.Logf("%d %s", res.StatusCode, got)
				}
			})
		}
	}
}

// TestHostileBodiesPolicy: through the policy alone, every hostile body is routed (by its estimate or
// the fallback) and reaches the upstream byte for byte; none gets a 5xx from the plugin.
func TestHostileBodiesPolicy(t *testing.T) {
	a, b := newBackend(t), newBackend(t)
	sum := func(w http.ResponseWriter, r *http.Request, body []byte) {
		fmt.Fprintf(w, "%x", sha256.Sum256(body))
	}
	a.handle, b.handle = sum, sum
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm", "", a, b), "caddyfile")
	client := newLoadClient(true)
	defer client.CloseIdleConnections()
	for _, tc := range hostileBodies {
		t.Run(tc.name, func(t *testing.T) {
			body := tc.body(1)
			path := "/v1/chat/completions"
			if strings.Contains(tc.name, "prompt_tokens") {
				path = "/v1/completions"
			}
			res, got := post(t, client, path, string(body))
			if res.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %.200q", res.StatusCode, got)
			}
			if want := fmt.Sprintf("%x", sha256.Sum256(body)); got != want {
				t.Errorf("the upstream received a different body (sha256 %s, want %s)", got, want)
			}
		})
	}
	waitInflightZero(t, a.dial, b.dial)
}

// BenchmarkHostile measures the CPU one hostile body costs the policy (read, parse, count, choose,
// reserve, release), with the default limits; issue 6 asks for at most ~10 ms for the worst. Every
// iteration's messages are new (salted), so the message cache never answers.
//
//	go test -run '^$' -bench BenchmarkHostile -benchtime 20x .
func BenchmarkHostile(b *testing.B) {
	for _, tc := range hostileBodies {
		b.Run(tc.name, func(b *testing.B) {
			s, pool := provisionedPolicy(b, &LLMSelection{})
			path := "/v1/chat/completions"
			if strings.Contains(tc.name, "prompt_tokens") {
				path = "/v1/completions"
			}
			b.ReportAllocs()
			b.SetBytes(int64(len(tc.body(0))))
			salt := 1 << 20 // distinct from the tests' salts
			for b.Loop() {
				b.StopTimer()
				salt++
				body := tc.body(salt)
				r, cancel := newProxyRequest(body)
				r.URL.Path = path
				b.StartTimer()
				if s.Select(pool, r, nil) == nil {
					b.Fatal("no upstream")
				}
				cancel()
			}
		})
	}
}
