package caddyllm

import (
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/tokenrouter/caddy-llm/tokenize"
)

func init() {
	caddy.RegisterModule(MatchLLM{})
}

// MatchLLM matches OpenAI-compatible LLM requests by model, prompt tokens, streaming and API. A request
// that is not an LLM request (not a POST of JSON to a chat/completions, completions, responses or
// embeddings endpoint) does not match. An LLM request whose body is malformed is answered 400 with what
// is wrong, and one over the body cap 413, since routing it anywhere would only fail later; llm_errors
// (LLMErrors) sends the client why.
type MatchLLM struct {
	// Models are glob patterns (* matches any run of characters, ? one) for the request's model field.
	Models []string `json:"models,omitempty"`
	// MinTokens and MaxTokens bound the prompt tokens (inclusive); 0 means unbounded.
	MinTokens int `json:"min_tokens,omitempty"`
	MaxTokens int `json:"max_tokens,omitempty"`
	// Stream, when set, matches only streaming (true) or non-streaming (false) requests.
	Stream *bool `json:"stream,omitempty"`
	// APIs limits the match to "chat" (/v1/chat/completions), "completions" (/v1/completions),
	// "responses" (/v1/responses) and/or "embeddings" (/v1/embeddings). Empty: the first three;
	// embeddings match only a matcher that names them, so a matcher written for generation (a model
	// glob, a token bound) does not take an embedding model's requests too.
	APIs []string `json:"apis,omitempty"`
	// Tokenizer counts prompt tokens for the token bounds, as in the policy. Default cl100k_base.
	Tokenizer string `json:"tokenizer,omitempty"`
	// MaxBodyBytes is the largest body read; larger LLM requests are answered 413. Default 2 MiB.
	MaxBodyBytes int64 `json:"max_body_bytes,omitempty"`

	apis    []tokenize.API
	tokOpts tokenize.Options
}

// CaddyModule returns the Caddy module information.
func (MatchLLM) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.matchers.llm",
		New: func() caddy.Module { return new(MatchLLM) },
	}
}

// Provision sets up the matcher.
func (m *MatchLLM) Provision(ctx caddy.Context) error {
	if err := registerBodyMetrics(ctx); err != nil {
		return err
	}
	if m.Tokenizer == "" {
		m.Tokenizer = "cl100k_base"
	}
	if m.MaxBodyBytes == 0 {
		m.MaxBodyBytes = defaultMaxBodyBytes
	}
	if err := m.Validate(); err != nil {
		return err
	}
	m.apis = m.apis[:0]
	for _, name := range m.APIs {
		m.apis = append(m.apis, apiByName[name])
	}
	m.tokOpts = tokenize.Options{Encoding: m.Tokenizer}
	if m.MinTokens > 0 || m.MaxTokens > 0 {
		if err := tokenize.Warm(m.Tokenizer); err != nil {
			return fmt.Errorf("loading tokenizer %s: %w", m.Tokenizer, err)
		}
	}
	return nil
}

var apiByName = map[string]tokenize.API{"chat": tokenize.APIChat, "completions": tokenize.APICompletions,
	"responses": tokenize.APIResponses, "embeddings": tokenize.APIEmbeddings}

// Validate checks the configuration.
func (m *MatchLLM) Validate() error {
	for _, name := range m.APIs {
		if _, ok := apiByName[name]; !ok {
			return fmt.Errorf("unknown api %q (want chat, completions, responses or embeddings)", name)
		}
	}
	if !tokenize.ValidEncoding(m.Tokenizer) {
		return fmt.Errorf("unknown tokenizer %q (want cl100k_base, o200k_base or approx)", m.Tokenizer)
	}
	switch {
	case m.MinTokens < 0 || m.MaxTokens < 0:
		return fmt.Errorf("token bounds must be positive, got min %d max %d", m.MinTokens, m.MaxTokens)
	case m.MaxTokens > 0 && m.MinTokens > m.MaxTokens:
		return fmt.Errorf("min_tokens %d is above max_tokens %d", m.MinTokens, m.MaxTokens)
	case m.MaxBodyBytes < 0:
		return fmt.Errorf("max_body_bytes must be positive, got %d", m.MaxBodyBytes)
	}
	return nil
}

// Match returns true if r matches m. Errors (malformed bodies) count as no match; use MatchWithError.
func (m MatchLLM) Match(r *http.Request) bool {
	ok, _ := m.MatchWithError(r)
	return ok
}

// MatchWithError returns whether r matches m, or an HTTP 400/413/415 error for an LLM request whose body
// cannot be read. Non-LLM requests never error.
func (m MatchLLM) MatchWithError(r *http.Request) (bool, error) {
	lr, ok := holdRequest(r, m.MaxBodyBytes)
	if !ok {
		return false, nil // the request has ended, its client gone
	}
	defer lr.drop()
	if lr.api == tokenize.APIUnknown {
		return false, nil
	}
	if len(m.apis) > 0 && !containsAPI(m.apis, lr.api) || len(m.apis) == 0 && lr.api == tokenize.APIEmbeddings {
		return false, nil // embeddings match only a matcher that names them
	}
	needBody := len(m.Models) > 0 || m.MinTokens > 0 || m.MaxTokens > 0 || m.Stream != nil
	if !needBody {
		return true, nil
	}
	opts := m.tokOpts
	if m.MinTokens == 0 && m.MaxTokens == 0 {
		// Only fields are needed: count by estimate, and share the parse with any other approx user.
		opts = tokenize.Options{Encoding: "approx"}
	}
	req, err := lr.parse(opts)
	if err != nil {
		if lr.api == tokenize.APIUnknown {
			return false, nil // it did not declare JSON, and it is not an OpenAI request
		}
		return false, matcherError(err, m.MaxBodyBytes)
	}
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	setRequestPlaceholders(repl, req)
	if len(m.Models) > 0 && !matchAnyGlob(m.Models, req.Model) {
		return false, nil
	}
	if m.Stream != nil && *m.Stream != req.Stream {
		return false, nil
	}
	if m.MinTokens > 0 && req.PromptTokens < m.MinTokens {
		return false, nil
	}
	if m.MaxTokens > 0 && req.PromptTokens > m.MaxTokens {
		return false, nil
	}
	return true, nil
}

func containsAPI(apis []tokenize.API, api tokenize.API) bool {
	for _, a := range apis {
		if a == api {
			return true
		}
	}
	return false
}

// matchAnyGlob reports whether s matches any of the patterns.
func matchAnyGlob(patterns []string, s string) bool {
	for _, p := range patterns {
		if matchGlob(p, s) {
			return true
		}
	}
	return false
}

// matchGlob matches s against a pattern in which * matches any run of bytes (slashes included: model
// names such as meta-llama/Llama-3.1-8B have them) and ? any one byte. It runs in O(len(p)*len(s)) at
// worst, with no recursion.
func matchGlob(p, s string) bool {
	pi, si := 0, 0
	star, mark := -1, 0
	for si < len(s) {
		switch {
		case pi < len(p) && (p[pi] == '?' || p[pi] == s[si]):
			pi++
			si++
		case pi < len(p) && p[pi] == '*':
			star, mark = pi, si
			pi++
		case star >= 0:
			pi = star + 1
			mark++
			si = mark
		default:
			return false
		}
	}
	for pi < len(p) && p[pi] == '*' {
		pi++
	}
	return pi == len(p)
}

// Interface guards
var (
	_ caddy.Provisioner                 = (*MatchLLM)(nil)
	_ caddy.Validator                   = (*MatchLLM)(nil)
	_ caddyhttp.RequestMatcherWithError = (*MatchLLM)(nil)
)
