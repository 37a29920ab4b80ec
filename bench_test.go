package caddyllm

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
)

// chatRequest20 is a 20-message chat request of about 4,000 tokens (cl100k): a system prompt and 19
// turns. salt makes every message unique, so a new salt misses the message cache.
func chatRequest20(salt int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"meta-llama/Llama-3.1-8B-Instruct","stream":true,"max_tokens":256,"messages":[`)
	for i := range 20 {
		role := "user"
		switch {
		case i == 0:
			role = "system"
		case i%2 == 0:
			role = "assistant"
		}
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"role":%q,"content":"%d-%d `, role, salt, i)
		for w := range 190 {
			b.WriteString([]string{"the ", "quick ", "brown ", "fox ", "jumps ", "over ", "lazy ", "dogs ", "while ", "routing "}[(w*7+i)%10])
		}
		b.WriteString(`"}`)
	}
	b.WriteString(`]}`)
	return []byte(b.String())
}

// provisionedPolicy provisions s as Caddy would and returns it with four upstreams. They are real
// listeners on 127.0.0.1 that answer 404 (an OpenAI-compatible server without /metrics): the policy
// scrapes its upstreams by default, and a test sends traffic to no address outside this machine.
func provisionedPolicy(tb testing.TB, s *LLMSelection) (*LLMSelection, reverseproxy.UpstreamPool) {
	tb.Helper()
	pool := make(reverseproxy.UpstreamPool, 4)
	for i := range pool {
		backend := httptest.NewServer(http.NotFoundHandler())
		tb.Cleanup(backend.Close) // after the policy's cleanup, which stops its scrapes
		pool[i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: backend.Listener.Addr().String()}
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	tb.Cleanup(cancel)
	if err := s.Provision(ctx); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = s.Cleanup() })
	s.logger = zap.NewNop() // the bare context logs at debug level; Caddy's default is info
	if s.scrapes != nil {
		s.scrapes.logger, s.scrapes.opts.Logger = s.logger, s.logger // each failed scrape logs at debug
	}
	return s, pool
}

// newProxyRequest builds the request Select sees: a POST with Caddy's variable table in its context.
func newProxyRequest(body []byte) (*http.Request, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, make(map[string]any))
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/chat/completions", bytes.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	return r, cancel
}

// BenchmarkSelect measures the policy's hot path: read the body, parse and count a 20-message ~4k-token
// chat request, match learned prefixes, choose, reserve and release. Warm: the messages are in the
// message cache (a conversation's history); cold: every message is new.
func BenchmarkSelect(b *testing.B) {
	for _, mode := range []string{"least_tokens", "combined"} {
		b.Run(mode+"/warm", func(b *testing.B) {
			s, pool := provisionedPolicy(b, &LLMSelection{Mode: mode})
			body := chatRequest20(0)
			r, cancel := newProxyRequest(body)
			s.Select(pool, r, nil) // warm the caches
			cancel()
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				r, cancel := newProxyRequest(body)
				if s.Select(pool, r, nil) == nil {
					b.Fatal("no upstream")
				}
				cancel()
			}
		})
		b.Run(mode+"/cold", func(b *testing.B) {
			s, pool := provisionedPolicy(b, &LLMSelection{Mode: mode})
			b.ReportAllocs()
			salt := 1
			for b.Loop() {
				b.StopTimer()
				salt++
				r, cancel := newProxyRequest(chatRequest20(salt))
				b.StartTimer()
				if s.Select(pool, r, nil) == nil {
					b.Fatal("no upstream")
				}
				cancel()
			}
		})
	}
}
