package caddyllm

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
)

// errorsConfig routes chat requests by an llm matcher with a 1 KiB body cap, and /v1/dead/* to an upstream
// that refuses connections. withLLMErrors adds llm_errors to the site and to handle_errors.
func errorsConfig(withLLMErrors bool, upstream string) string {
	directive, handleErrors := "", ""
	if withLLMErrors {
		directive = "llm_errors"
		handleErrors = "handle_errors {\n\t\tllm_errors\n\t}"
	}
	return globalOptions + fmt.Sprintf(`
%s {
	%s
	@chat llm {
		model *
		max_body_size 1KiB
	}
	handle /v1/dead/* {
		reverse_proxy 127.0.0.1:1
	}
	handle @chat {
		reverse_proxy %s
	}
	handle {
		respond 404
	}
	%s
}
`, site, directive, upstream, handleErrors)
}

// openAIClient is the official client with its retries off, so that a test sees each error the proxy
// answers, except a connection reset before any answer, which it resends (reloadSafeTransport):
// TestErrorsThroughOpenAIClient's first request after its second config load failed with EOF about once
// in 40 runs, sent on a connection the previous config's server closed.
func openAIClient(base string) openai.Client {
	return openai.NewClient(option.WithBaseURL(base), option.WithAPIKey("test"), option.WithMaxRetries(0),
		option.WithHTTPClient(&http.Client{Transport: reloadSafeTransport{}}))
}

// TestErrorsThroughOpenAIClient: what the official OpenAI Go client reports for the requests the llm
// matcher refuses. Without llm_errors Caddy answers the status with an empty body, and the client has
// nothing to show ("413 status code (no body)", issue 13); with it, the client reads an OpenAI-style
// error naming the limit and the option to raise. In handle_errors, llm_errors also answers Caddy's own
// errors (a dead upstream's 502) in that form, saying only the status text.
func TestErrorsThroughOpenAIClient(t *testing.T) {
	a := newBackend(t)
	a.handle = func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}`)
	}
	tester := caddytest.NewTester(t)
	client := openAIClient(proxyURL + "/v1/")
	chat := func(content string, opts ...option.RequestOption) error {
		_, err := client.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
			Model:    "m",
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(content)},
		}, opts...)
		return err
	}
	rawChat := func(body string, opts ...option.RequestOption) error {
		// As bytes, not a reader: the client can then send the body again (reloadSafeTransport).
		return client.Post(context.Background(), "chat/completions", []byte(body), nil,
			append(opts, option.WithHeader("Content-Type", "application/json"))...)
	}
	type want struct {
		status               int
		typ, code, inMessage string
	}
	cases := []struct {
		name string
		send func() error
		want want
	}{
		{"ok", func() error { return chat("hello") }, want{status: 200}},
		{"over max_body_size", func() error { return chat(strings.Repeat("hello ", 400)) },
			want{413, "invalid_request_error", "request_too_large", "over the 1.0 KiB limit of the llm matcher (max_body_size in the Caddyfile"}},
		{"malformed JSON", func() error { return rawChat(`{"model":"m","messages":[{"role":"user","content":`) },
			want{400, "invalid_request_error", "invalid_request_body", "unexpected end of input"}},
		{"wrong shape", func() error { return rawChat(`{"model":"m","messages":{"role":"user"}}`) },
			want{400, "invalid_request_error", "invalid_request_body", "messages must be an array"}},
		{"unread encoding", func() error {
			return rawChat(`{"model":"m","messages":[]}`, option.WithHeader("Content-Encoding", "br"))
		}, want{415, "invalid_request_error", "unsupported_content_encoding", `unsupported content encoding "br"`}},
		{"dead upstream", func() error {
			return client.Get(context.Background(), "dead/models", nil, nil)
		}, want{status: 502, typ: "server_error", inMessage: "Bad Gateway"}},
	}
	for _, withLLMErrors := range []bool{false, true} {
		tester.InitServer(errorsConfig(withLLMErrors, a.dial), "caddyfile")
		settle(t)
		for _, tc := range cases {
			t.Run(fmt.Sprintf("%s/llm_errors=%t", tc.name, withLLMErrors), func(t *testing.T) {
				err := tc.send()
				if tc.want.status == http.StatusOK {
					if err != nil {
						t.Fatalf("error %v, want none", err)
					}
					return
				}
				var apiErr *openai.Error
				if !errors.As(err, &apiErr) {
					t.Fatalf("error %v, want an *openai.Error", err)
				}
				if apiErr.StatusCode != tc.want.status {
					t.Errorf("status %d, want %d", apiErr.StatusCode, tc.want.status)
				}
				if !withLLMErrors {
					// Caddy's default: the status alone. The client has no message to show.
					if apiErr.Message != "" || apiErr.RawJSON() != "" {
						t.Errorf("without llm_errors the body is %q, want empty (Caddy's default)", apiErr.RawJSON())
					}
					return
				}
				if apiErr.Type != tc.want.typ || apiErr.Code != tc.want.code || !strings.Contains(apiErr.Message, tc.want.inMessage) {
					t.Errorf("error type %q code %q message %q, want type %q code %q and a message containing %q",
						apiErr.Type, apiErr.Code, apiErr.Message, tc.want.typ, tc.want.code, tc.want.inMessage)
				}
				if !apiErr.JSON.Param.Valid() && apiErr.JSON.Param.Raw() != "null" {
					t.Errorf("param missing from %s", apiErr.RawJSON())
				}
			})
		}
	}
}
