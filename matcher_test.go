package caddyllm

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// TestMatcherRoutes runs one Caddy with two model pools, a long-prompt pool and a streaming-only route,
// and checks where each request lands, that non-LLM requests fall through untouched, and that LLM
// requests the matcher cannot read get 400/413 with a message saying why.
func TestMatcherRoutes(t *testing.T) {
	llama, qwen, long, stream, rest := newBackend(t), newBackend(t), newBackend(t), newBackend(t), newBackend(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	@long llm {
		min_tokens 1000
		max_body_size 64KiB
	}
	@llama llm {
		model meta-llama/* llama*
		api chat
	}
	@qwen llm {
		model Qwen/Qwen2.5-?B
		max_tokens 999
	}
	@stream llm {
		stream true
	}
	route {
		reverse_proxy @long %s
		reverse_proxy @llama %s
		reverse_proxy @qwen %s
		reverse_proxy @stream %s
		reverse_proxy %s
	}
	handle_errors 4xx {
		respond "{err.status_code} {err.message}" {err.status_code}
	}
}
`, site, long.dial, llama.dial, qwen.dial, stream.dial, rest.dial), "caddyfile")

	chat := func(model string, words int, stream bool) string { return chatBody(model, words, stream) }
	for _, tc := range []struct {
		name, path, body string
		want             *backend
	}{
		{"llama by prefix glob", "/v1/chat/completions", chat("meta-llama/Llama-3.1-8B-Instruct", 10, false), llama},
		{"llama by second glob", "/v1/chat/completions", chat("llama3", 10, false), llama},
		{"llama glob, but completions API", "/v1/completions", `{"model":"llama3","prompt":"hi"}`, rest},
		{"qwen by ? glob", "/v1/chat/completions", chat("Qwen/Qwen2.5-7B", 10, false), qwen},
		{"qwen glob does not match two characters", "/v1/chat/completions", chat("Qwen/Qwen2.5-72B", 10, false), rest},
		{"long prompt wins over the model pools", "/v1/chat/completions", chat("meta-llama/x", 1500, false), long},
		{"qwen with too many tokens for its bound", "/v1/chat/completions", chat("Qwen/Qwen2.5-7B", 1200, false), long},
		{"streaming", "/openai/v1/chat/completions", chat("gpt-4o", 10, true), stream},
		{"non-streaming, unknown model", "/v1/chat/completions", chat("gpt-4o", 10, false), rest},
		{"GET falls through", "/v1/models", "", rest},
		{"other path falls through", "/v1/rerank", `{"model":"llama3","query":"x","documents":["y"]}`, rest},
		// Embeddings match only a matcher that names them: not @long (1,500 words), not @qwen (its model).
		{"embeddings fall through", "/v1/embeddings", `{"model":"Qwen/Qwen2.5-7B","input":"` + strings.Repeat("word ", 1500) + `"}`, rest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := tc.want.requests.Load()
			var res *http.Response
			var got string
			if tc.body == "" {
				var err error
				req, _ := http.NewRequest(http.MethodGet, proxyURL+tc.path, nil)
				res, err = doReloadSafe(tester.Client, req)
				if err != nil {
					t.Fatal(err)
				}
				got = readAll(res)
				res.Body.Close()
			} else {
				res, got = post(t, tester.Client, tc.path, tc.body)
			}
			if res.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", res.StatusCode, got)
			}
			if tc.want.requests.Load() != before+1 {
				t.Errorf("request did not reach the expected upstream %s: %s", tc.want.dial, got)
			}
		})
	}

	for _, tc := range []struct {
		name, body, contentType, wantMsg string
		wantStatus                       int
	}{
		{"malformed JSON", `{"model":"llama3","messages":[`, "", "malformed", http.StatusBadRequest},
		{"messages of the wrong type", `{"model":"llama3","messages":{"role":"user"}}`, "", "messages", http.StatusBadRequest},
		{"empty body", ``, "", "malformed", http.StatusBadRequest},
		{"body over the cap", chat("llama3", 20000, false), "", "too large", http.StatusRequestEntityTooLarge},
		{"not JSON: falls through", `model=llama3`, "application/x-www-form-urlencoded", "", http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPost, proxyURL+"/v1/chat/completions", strings.NewReader(tc.body))
			if tc.contentType != "" {
				req.Header.Set("Content-Type", tc.contentType)
			}
			res, err := doReloadSafe(tester.Client, req)
			if err != nil {
				t.Fatal(err)
			}
			defer res.Body.Close()
			buf := new(strings.Builder)
			_, _ = fmt.Fprint(buf, readAll(res))
			if res.StatusCode != tc.wantStatus {
				t.Fatalf("status %d (%s), want %d", res.StatusCode, buf, tc.wantStatus)
			}
			if tc.wantMsg != "" && !strings.Contains(strings.ToLower(buf.String()), tc.wantMsg) {
				t.Errorf("answer %q does not say %q", buf, tc.wantMsg)
			}
		})
	}
}

// TestMatcherSniffsUndeclaredJSON: curl -d sends JSON as application/x-www-form-urlencoded; such a body
// is matched as the LLM request it is, while a multipart body on the same path is never read.
func TestMatcherSniffsUndeclaredJSON(t *testing.T) {
	llama, rest := newBackend(t), newBackend(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	@llama llm {
		model llama*
	}
	route {
		reverse_proxy @llama %s
		reverse_proxy %s
	}
}
`, site, llama.dial, rest.dial), "caddyfile")
	for _, tc := range []struct {
		contentType, body string
		want              *backend
	}{
		{"application/x-www-form-urlencoded", chatBody("llama3", 10, false), llama},
		{"text/plain", chatBody("llama3", 10, false), llama},
		{"multipart/form-data; boundary=x", chatBody("llama3", 10, false), rest},
		{"application/x-www-form-urlencoded", `{"model":"llama3","messages":"not a list"}`, rest},
	} {
		before := tc.want.requests.Load()
		req, _ := http.NewRequest(http.MethodPost, proxyURL+"/v1/chat/completions", strings.NewReader(tc.body))
		req.Header.Set("Content-Type", tc.contentType)
		res, err := doReloadSafe(tester.Client, req)
		if err != nil {
			t.Fatal(err)
		}
		got := readAll(res)
		res.Body.Close()
		if res.StatusCode != http.StatusOK || tc.want.requests.Load() != before+1 {
			t.Errorf("%s %.40s: status %d %s, want it at %s", tc.contentType, tc.body, res.StatusCode, got, tc.want.dial)
		}
	}
}

func readAll(res *http.Response) string {
	var b strings.Builder
	buf := make([]byte, 4096)
	for {
		n, err := res.Body.Read(buf)
		b.Write(buf[:n])
		if err != nil {
			return b.String()
		}
	}
}
