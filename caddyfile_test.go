package caddyllm

import (
	"encoding/json"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func TestUnmarshalPolicy(t *testing.T) {
	d := caddyfile.NewTestDispenser(`llm {
		mode prefix
		tokenizer approx
		max_body_size 8MiB
		max_message_size 16KiB
		max_tokenize_size 64KiB
		output_tokens 128
		conversation_header X-Conversation-ID
		block_size 32
		route_capacity 5000
		route_ttl 2m
		guard_factor 1.5
		guard_slack 2048
		guard_request_slack 5
		prefill_weight 3
		capacity 10.0.0.1:8000 2
		capacity 10.0.0.2:8000 0.5
		saturation_backoff 5s
		lora_load_time 2s
		metrics {
			port 9100
			path /prom
			interval 2s
			timeout 300ms
			stale_after 10s
			model llama
			header Authorization "Bearer {env.METRICS_TOKEN}"
			header X-Scraper caddy-llm
			request_tokens 2000
			kv_threshold 0.8
			kv_weight 4096
		}
		fallback header X-User {
			fallback first
		}
	}`)
	var s LLMSelection
	if err := s.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	want := LLMSelection{
		Mode: "prefix", Tokenizer: "approx", MaxBodyBytes: 8 << 20, MaxMessageBytes: 16 << 10,
		MaxTokenizeBytes: 64 << 10, OutputTokens: 128, ConversationHeader: "X-Conversation-ID",
		BlockSize: 32, RouteCapacity: 5000, RouteTTL: caddy.Duration(2 * time.Minute),
		GuardFactor: 1.5, GuardSlack: 2048, GuardRequestSlack: 5, PrefillWeight: 3,
		Capacities:        map[string]float64{"10.0.0.1:8000": 2, "10.0.0.2:8000": 0.5},
		SaturationBackoff: caddy.Duration(5 * time.Second),
		LoRALoadTime:      caddy.Duration(2 * time.Second),
		Metrics: &MetricsConfig{Port: "9100", Path: "/prom", Interval: caddy.Duration(2 * time.Second),
			Timeout: caddy.Duration(300 * time.Millisecond), StaleAfter: caddy.Duration(10 * time.Second),
			Model: "llama", RequestTokens: 2000, KVThreshold: 0.8, KVWeight: 4096,
			Headers: http.Header{"Authorization": {"Bearer {env.METRICS_TOKEN}"}, "X-Scraper": {"caddy-llm"}}},
		FallbackRaw: json.RawMessage(`{"fallback":{"policy":"first"},"field":"X-User","policy":"header"}`),
	}
	if !reflect.DeepEqual(s, want) {
		t.Errorf("UnmarshalCaddyfile() =\n%+v\nwant\n%+v", s, want)
	}
}

func TestUnmarshalPolicyErrors(t *testing.T) {
	for input, wantErr := range map[string]string{
		`llm extra`:                                "wrong argument count",
		`llm { mode }`:                             "wrong argument count",
		`llm { mode a b }`:                         "wrong argument count",
		`llm { speed 3 }`:                          "unrecognized option 'speed'",
		`llm { max_body_size lots }`:               "max_body_size must be a size",
		`llm { output_tokens -1 }`:                 "output_tokens must be a positive whole number",
		`llm { block_size 0 }`:                     "block_size must be a positive whole number",
		`llm { route_ttl soon }`:                   "route_ttl must be a positive duration",
		`llm { lora_load_time soon }`:              "lora_load_time must be a positive duration",
		`llm { guard_factor 0 }`:                   "guard_factor must be a positive number",
		`llm { prefill_weight -1 }`:                "prefill_weight must be a positive number",
		`llm { fallback }`:                         "wrong argument count",
		`llm { capacity 10.0.0.1:80 }`:             "wrong argument count",
		`llm { capacity 10.0.0.1:80 -2 }`:          "capacity must be a positive number",
		`llm { metrics x }`:                        "takes no argument but 'off'",
		`llm { metrics off x }`:                    "takes no argument but 'off'",
		`llm { metrics { interval soon } }`:        "interval must be a positive duration",
		`llm { metrics { kv_threshold 2 } }`:       "kv_threshold must be a number between 0 and 1",
		`llm { metrics { colour blue } }`:          "unrecognized option 'colour' in the metrics { } block",
		`llm { metrics { header Authorization } }`: "header takes a field name and a value: header <field> <value>",
		`llm { metrics; metrics }`:                 "metrics already specified",
		`llm { fallback nope }`:                    "module not registered",
		`llm { fallback first; fallback first }`:   "fallback selection policy already specified",
	} {
		var s LLMSelection
		err := s.UnmarshalCaddyfile(caddyfile.NewTestDispenser(multiline(input)))
		if err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("%s: error %v, want one containing %q", input, err, wantErr)
		}
	}
}

func TestValidatePolicy(t *testing.T) {
	for name, s := range map[string]LLMSelection{
		"unknown mode":      {Mode: "fastest", Tokenizer: "approx"},
		"unknown tokenizer": {Mode: "combined", Tokenizer: "gpt2"},
		"negative body":     {Mode: "combined", Tokenizer: "approx", MaxBodyBytes: -1},
		"negative ttl":      {Mode: "combined", Tokenizer: "approx", RouteTTL: -1},
		"negative lora":     {Mode: "combined", Tokenizer: "approx", LoRALoadTime: -1},
		"zero capacity":     {Mode: "combined", Tokenizer: "approx", Capacities: map[string]float64{"a:1": 0}},
		"bad scheme":        {Mode: "combined", Tokenizer: "approx", Metrics: &MetricsConfig{Scheme: "ftp", Path: "/m"}},
		"relative path":     {Mode: "combined", Tokenizer: "approx", Metrics: &MetricsConfig{Scheme: "http", Path: "m"}},
		"bad header name": {Mode: "combined", Tokenizer: "approx",
			Metrics: &MetricsConfig{Scheme: "http", Path: "/m", Headers: http.Header{"Bad Name": {"x"}}}},
		"bad header value": {Mode: "combined", Tokenizer: "approx",
			Metrics: &MetricsConfig{Scheme: "http", Path: "/m", Headers: http.Header{"Authorization": {"a\r\nb"}}}},
	} {
		if err := s.Validate(); err == nil {
			t.Errorf("%s: Validate() accepted %+v", name, s)
		}
	}
}

func TestUnmarshalMatcher(t *testing.T) {
	d := caddyfile.NewTestDispenser(`llm {
		model llama-* qwen?
		model gpt-4o
		min_tokens 100
		max_tokens 8000
		stream true
		api chat
		tokenizer o200k_base
		max_body_size 1MB
	}`)
	var m MatchLLM
	if err := m.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	stream := true
	want := MatchLLM{Models: []string{"llama-*", "qwen?", "gpt-4o"}, MinTokens: 100, MaxTokens: 8000,
		Stream: &stream, APIs: []string{"chat"}, Tokenizer: "o200k_base", MaxBodyBytes: 1_000_000}
	if !reflect.DeepEqual(m, want) {
		t.Errorf("UnmarshalCaddyfile() =\n%+v\nwant\n%+v", m, want)
	}
}

func TestUnmarshalMatcherErrors(t *testing.T) {
	for input, wantErr := range map[string]string{
		`llm arg`:                 "wrong argument count",
		`llm { model }`:           "wrong argument count",
		`llm { stream maybe }`:    "stream must be true or false",
		`llm { min_tokens many }`: "min_tokens must be a positive whole number",
		`llm { max_tokens 1 2 }`:  "wrong argument count",
		`llm { colour blue }`:     "unrecognized option 'colour'",
		`llm { max_body_size x }`: "max_body_size must be a size",
	} {
		var m MatchLLM
		err := m.UnmarshalCaddyfile(caddyfile.NewTestDispenser(multiline(input)))
		if err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("%s: error %v, want one containing %q", input, err, wantErr)
		}
	}
	for name, m := range map[string]MatchLLM{
		"unknown api":     {APIs: []string{"rerank"}, Tokenizer: "approx"},
		"inverted bounds": {MinTokens: 10, MaxTokens: 5, Tokenizer: "approx"},
	} {
		if err := m.Validate(); err == nil {
			t.Errorf("%s: Validate() accepted %+v", name, m)
		}
	}
}

// TestCaddyfileErrorsSayWhatToWrite: a bad value of an option with a fixed set of values fails when the
// Caddyfile is adapted, not when the config runs; an unknown option gets the nearest option's name, or
// the block it belongs in. Issue 13: "mode fastest" passed caddy adapt, "kv_threshold" outside metrics
// and the typo "guard_factr" said only "unrecognized option".
func TestCaddyfileErrorsSayWhatToWrite(t *testing.T) {
	const (
		policy  = "lb_policy llm { }"
		metrics = "the metrics { } block of lb_policy llm"
		matcher = "the llm matcher (@name llm { })"
	)
	for _, tc := range []struct {
		module, input, want string
	}{
		{"policy", `llm { mode fastest }`, "mode must be combined, least_tokens or prefix, got 'fastest'"},
		{"policy", `llm { mode least_token }`, "mode must be combined, least_tokens or prefix, got 'least_token' (did you mean 'least_tokens'?)"},
		{"policy", `llm { tokenizer o200k }`, "tokenizer must be cl100k_base, o200k_base or approx, got 'o200k'"},
		{"policy", `llm { tokenizer o200k_bsae }`, "did you mean 'o200k_base'?"},
		{"policy", `llm { guard_factr 2 }`, "unrecognized option 'guard_factr' in " + policy + " (did you mean 'guard_factor'?)"},
		{"policy", `llm { kv_threshold 0.8 }`, "option 'kv_threshold' belongs in " + metrics + ", not in " + policy},
		{"policy", `llm { kv_treshold 0.8 }`, "unrecognized option 'kv_treshold' in " + policy + " (did you mean 'kv_threshold', an option of " + metrics + "?)"},
		{"policy", `llm { stream true }`, "option 'stream' belongs in " + matcher + ", not in " + policy},
		{"policy", `llm { speed 3 }`, "unrecognized option 'speed' in " + policy + " (its options: mode, tokenizer, "},
		{"policy", `llm { persits }`, "unrecognized option 'persits' in " + policy + " (did you mean 'persist'?)"},
		{"policy", `llm { metrics { scheme ftp } }`, "scheme must be http or https, got 'ftp'"},
		{"policy", `llm { metrics { mode prefix } }`, "option 'mode' belongs in " + policy + ", not in " + metrics},
		{"policy", `llm { metrics { intervall 2s } }`, "unrecognized option 'intervall' in " + metrics + " (did you mean 'interval'?)"},
		{"matcher", `llm { modle llama* }`, "unrecognized option 'modle' in " + matcher + " (did you mean 'model'?)"},
		{"matcher", `llm { api chat rerank }`, "api must be chat, completions, responses or embeddings, got 'rerank'"},
		{"matcher", `llm { tokenizer gpt2 }`, "tokenizer must be cl100k_base, o200k_base or approx, got 'gpt2'"},
		{"matcher", `llm { mode prefix }`, "option 'mode' belongs in " + policy + ", not in " + matcher},
		{"matcher", `llm { max_body_bytes 1MiB }`, "did you mean 'max_body_size'?"},
	} {
		var err error
		d := caddyfile.NewTestDispenser(multiline(tc.input))
		if tc.module == "matcher" {
			err = new(MatchLLM).UnmarshalCaddyfile(d)
		} else {
			err = new(LLMSelection).UnmarshalCaddyfile(d)
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %s: error %v, want one containing %q", tc.module, tc.input, err, tc.want)
		}
	}
}

// TestCaddyfileEnumsMatchValidate: every value the Caddyfile accepts for an enumerated option passes
// Validate, so the two lists cannot drift apart.
func TestCaddyfileEnumsMatchValidate(t *testing.T) {
	for _, mode := range caddyfileBlocks[policyBlock].enums["mode"] {
		s := LLMSelection{Mode: mode, Tokenizer: "approx"}
		if err := s.Validate(); err != nil {
			t.Errorf("mode %s: %v", mode, err)
		}
	}
	for _, tok := range caddyfileBlocks[policyBlock].enums["tokenizer"] {
		s := LLMSelection{Mode: "combined", Tokenizer: tok}
		if err := s.Validate(); err != nil {
			t.Errorf("tokenizer %s: %v", tok, err)
		}
	}
	for _, api := range caddyfileBlocks[matcherBlock].enums["api"] {
		m := MatchLLM{APIs: []string{api}, Tokenizer: "approx"}
		if err := m.Validate(); err != nil {
			t.Errorf("api %s: %v", api, err)
		}
	}
	for _, scheme := range caddyfileBlocks[metricsBlock].enums["scheme"] {
		m := MetricsConfig{Scheme: scheme, Path: "/metrics"}
		if err := m.validate(); err != nil {
			t.Errorf("scheme %s: %v", scheme, err)
		}
	}
}

func TestUnmarshalLLMErrors(t *testing.T) {
	if err := new(LLMErrors).UnmarshalCaddyfile(caddyfile.NewTestDispenser(`llm_errors`)); err != nil {
		t.Errorf("llm_errors: %v", err)
	}
	for input, wantErr := range map[string]string{
		`llm_errors json`:       "wrong argument count",
		`llm_errors { format }`: "llm_errors takes no options",
	} {
		err := new(LLMErrors).UnmarshalCaddyfile(caddyfile.NewTestDispenser(multiline(input)))
		if err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("%s: error %v, want one containing %q", input, err, wantErr)
		}
	}
}

// TestEditDistance pins the distance the suggestions use.
func TestEditDistance(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want int
	}{
		{"", "", 0}, {"", "abc", 3}, {"model", "model", 0}, {"modle", "model", 1},
		{"guard_factr", "guard_factor", 1}, {"kitten", "sitting", 3}, {"ab", "ba", 1},
	} {
		if got := editDistance(tc.a, tc.b); got != tc.want {
			t.Errorf("editDistance(%q, %q) = %d, want %d", tc.a, tc.b, got, tc.want)
		}
	}
}

func TestMatchGlob(t *testing.T) {
	for _, tc := range []struct {
		pattern, s string
		want       bool
	}{
		{"*", "", true},
		{"*", "meta-llama/Llama-3.1-8B", true},
		{"meta-llama/*", "meta-llama/Llama-3.1-8B", true},
		{"*llama*", "meta-llama/Llama-3.1-8B", true},
		{"*Llama-3.?-8B", "meta-llama/Llama-3.1-8B", true},
		{"llama", "llama-3", false},
		{"llama-*", "llama", false},
		{"qwen?", "qwen2", true},
		{"qwen?", "qwen", false},
		{"a*b*c", "axxbyyc", true},
		{"a*b*c", "axxbyy", false},
		{"", "", true},
		{"", "x", false},
	} {
		if got := matchGlob(tc.pattern, tc.s); got != tc.want {
			t.Errorf("matchGlob(%q, %q) = %v, want %v", tc.pattern, tc.s, got, tc.want)
		}
	}
}

// multiline turns the one-line blocks of the error tables ("llm { a 1; b 2 }") into Caddyfile syntax.
func multiline(s string) string {
	s = strings.ReplaceAll(s, "{ ", "{\n")
	s = strings.ReplaceAll(s, " }", "\n}")
	return strings.ReplaceAll(s, "; ", "\n")
}
