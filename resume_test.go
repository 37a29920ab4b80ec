package caddyllm

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

func TestResumeUnmarshalCaddyfile(t *testing.T) {
	for name, tc := range map[string]struct {
		input string
		want  LLMResume
	}{
		"defaults":    {input: `llm_resume`, want: LLMResume{}},
		"empty block": {input: "llm_resume {\n}", want: LLMResume{}},
		"all options": {
			input: "llm_resume {\n\tmax_attempts 5\n\tmax_body_size 4MiB\n}",
			want:  LLMResume{MaxAttempts: 5, MaxBodyBytes: 4 << 20},
		},
	} {
		var got LLMResume
		if err := got.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input)); err != nil {
			t.Errorf("%s: UnmarshalCaddyfile() error = %v", name, err)
			continue
		}
		if got.MaxAttempts != tc.want.MaxAttempts || got.MaxBodyBytes != tc.want.MaxBodyBytes {
			t.Errorf("%s: UnmarshalCaddyfile() = %+v, want %+v", name, got, tc.want)
		}
	}
	for input, wantErr := range map[string]string{
		"llm_resume 3":                                          "wrong argument count",
		"llm_resume { max_attempts }":                           "wrong argument count",
		"llm_resume { max_attempts 1 2 }":                       "wrong argument count",
		"llm_resume { max_attempts 0 }":                         "max_attempts must be a positive whole number",
		"llm_resume { max_attempts x }":                         "max_attempts must be a positive whole number",
		"llm_resume { max_attempts 2; max_attempts 3 }":         "max_attempts already specified",
		"llm_resume { max_body_size lots }":                     "max_body_size must be a size",
		"llm_resume { max_body_size 1MiB; max_body_size 2MiB }": "max_body_size already specified",
		"llm_resume { retries 3 }":                              "unrecognized option 'retries'",
	} {
		var h LLMResume
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(multiline(input)))
		if err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("%s: error %v, want one containing %q", input, err, wantErr)
		}
	}
	for name, h := range map[string]LLMResume{
		"negative attempts":  {MaxAttempts: -1},
		"negative body size": {MaxBodyBytes: -1},
	} {
		if err := h.Validate(); err == nil {
			t.Errorf("%s: Validate() = nil, want an error", name)
		}
	}
}

// TestResumeDirectiveOrder: llm_resume is ordered before reverse_proxy, so a site needs no route block.
func TestResumeDirectiveOrder(t *testing.T) {
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(`:8080 {
	reverse_proxy 127.0.0.1:9 {
		lb_policy llm
	}
	llm_resume {
		max_attempts 2
	}
}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	resume, proxy := bytes.Index(cfg, []byte(`"handler":"llm_resume"`)), bytes.Index(cfg, []byte(`"handler":"reverse_proxy"`))
	if resume < 0 || proxy < 0 || resume > proxy {
		t.Errorf("adapted config %s: want llm_resume before reverse_proxy", cfg)
	}
	if !bytes.Contains(cfg, []byte(`"max_attempts":2`)) {
		t.Errorf("adapted config %s: want max_attempts 2", cfg)
	}
}

func TestResumeContinuationBody(t *testing.T) {
	for _, tc := range []struct {
		name     string
		api      tokenize.API
		body     string
		text     string
		sent     int
		want     string // the continuation, as JSON
		wantDone bool
	}{{
		name: "chat",
		api:  tokenize.APIChat,
		body: `{"model":"m","stream":true,"max_tokens":20,"min_tokens":3,"messages":[{"role":"user","content":"hi"}],"x_extra":{"a":1}}`,
		text: " the sim", sent: 2,
		want: `{"model":"m","stream":true,"max_tokens":18,"min_tokens":1,"x_extra":{"a":1},
			"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":" the sim"}],
			"continue_final_message":true,"add_generation_prompt":false}`,
	}, {
		name: "chat max_completion_tokens, min_tokens reached",
		api:  tokenize.APIChat,
		body: `{"max_completion_tokens":10,"min_tokens":2,"messages":[{"role":"user","content":"hi"}]}`,
		text: "abc", sent: 4,
		want: `{"max_completion_tokens":6,"min_tokens":0,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"abc"}],
			"continue_final_message":true,"add_generation_prompt":false}`,
	}, {
		name: "chat continuing the client's own assistant message",
		api:  tokenize.APIChat,
		body: `{"continue_final_message":true,"add_generation_prompt":false,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Once","name":"x"}]}`,
		text: " upon", sent: 1,
		want: `{"continue_final_message":true,"add_generation_prompt":false,
			"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Once upon","name":"x"}]}`,
	}, {
		name: "completions",
		api:  tokenize.APICompletions,
		body: `{"prompt":"Once","max_tokens":5,"stream":true}`,
		text: " upon a", sent: 2,
		want: `{"prompt":"Once upon a","max_tokens":3,"stream":true}`,
	}, {
		name: "completions, one prompt in an array",
		api:  tokenize.APICompletions,
		body: `{"prompt":["Once"],"max_tokens":null}`,
		text: " upon", sent: 1,
		want: `{"prompt":["Once upon"],"max_tokens":null}`,
	}, {
		name: "nothing left to generate",
		api:  tokenize.APIChat,
		body: `{"max_tokens":3,"messages":[{"role":"user","content":"hi"}]}`,
		text: "a b c", sent: 3,
		wantDone: true,
	}} {
		got, done, err := continuationBody([]byte(tc.body), tc.api, []byte(tc.text), tc.sent)
		if err != nil || done != tc.wantDone {
			t.Errorf("%s: continuationBody() done %t, error %v; want done %t", tc.name, done, err, tc.wantDone)
			continue
		}
		if tc.wantDone {
			continue
		}
		var gotV, wantV any
		if err := json.Unmarshal(got, &gotV); err != nil {
			t.Fatalf("%s: continuation %s: %v", tc.name, got, err)
		}
		if err := json.Unmarshal([]byte(tc.want), &wantV); err != nil {
			t.Fatal(err)
		}
		if g, w := mustJSON(t, gotV), mustJSON(t, wantV); g != w {
			t.Errorf("%s: continuationBody() =\n%s\nwant\n%s", tc.name, g, w)
		}
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestResumeParseResumable(t *testing.T) {
	for _, tc := range []struct {
		name string
		api  tokenize.API
		body string
		want resumeRequest
	}{
		{"chat stream", tokenize.APIChat, `{"stream":true,"messages":[]}`, resumeRequest{stream: true, continuable: true}},
		{"n 2", tokenize.APIChat, `{"n":2,"messages":[]}`, resumeRequest{}},
		{"json schema", tokenize.APIChat, `{"response_format":{"type":"json_schema"}}`, resumeRequest{}},
		{"text format", tokenize.APIChat, `{"response_format":{"type":"text"}}`, resumeRequest{continuable: true}},
		{"guided choice", tokenize.APIChat, `{"guided_choice":["a","b"]}`, resumeRequest{}},
		{"prompt string", tokenize.APICompletions, `{"prompt":"x"}`, resumeRequest{continuable: true}},
		{"two prompts", tokenize.APICompletions, `{"prompt":["x","y"]}`, resumeRequest{}},
		{"token prompt", tokenize.APICompletions, `{"prompt":[1,2,3]}`, resumeRequest{}},
		{"echo", tokenize.APICompletions, `{"prompt":"x","echo":true}`, resumeRequest{}},
		// typed events, relayed as they come: re-sent only while the client has nothing
		{"responses stream", tokenize.APIResponses, `{"stream":true,"input":"x"}`, resumeRequest{}},
		{"embeddings", tokenize.APIEmbeddings, `{"input":["x","y"]}`, resumeRequest{}},
	} {
		got, err := parseResumable([]byte(tc.body), tc.api)
		if err != nil {
			t.Errorf("%s: parseResumable() error = %v", tc.name, err)
			continue
		}
		tc.want.api = tc.api
		if *got != tc.want {
			t.Errorf("%s: parseResumable() = %+v, want %+v", tc.name, *got, tc.want)
		}
	}
}

func TestResumeEvents(t *testing.T) {
	for _, tc := range []struct {
		in      string
		end     int
		data    string
		hasData bool
	}{
		{"data: x\n\nrest", 9, "x", true},
		{"data: x\r\n\r\n", 11, "x", true},
		{"data: x\n", -1, "x", true},
		{"event: e\ndata:a\ndata: b\n\n", 25, "a\nb", true},
		{": keep-alive\n\n", 14, "", false},
	} {
		if got := eventEnd([]byte(tc.in), 0); got != tc.end {
			t.Errorf("eventEnd(%q) = %d, want %d", tc.in, got, tc.end)
		}
		data, ok := eventData([]byte(tc.in))
		if string(data) != tc.data || ok != tc.hasData {
			t.Errorf("eventData(%q) = %q, %t; want %q, %t", tc.in, data, ok, tc.data, tc.hasData)
		}
	}

	fields := map[string]json.RawMessage{"usage": json.RawMessage(`{"prompt_tokens":30,"completion_tokens":5,"total_tokens":35,"prompt_tokens_details":null}`)}
	addUsage(fields, 10)
	if got, want := string(fields["usage"]), `{"completion_tokens":15,"prompt_tokens":20,"prompt_tokens_details":null,"total_tokens":35}`; got != want {
		t.Errorf("addUsage() = %s, want %s", got, want)
	}
	fields = map[string]json.RawMessage{"choices": json.RawMessage(`[{"index":0,"delta":{"role":"assistant","content":"x"}}]`)}
	dropRole(fields)
	if got, want := string(fields["choices"]), `[{"delta":{"content":"x"},"index":0}]`; got != want {
		t.Errorf("dropRole() = %s, want %s", got, want)
	}
}

// resumeTest is an in-process Caddy with llm_resume in front of reverse_proxy and lb_policy llm.
type resumeTest struct {
	t      *testing.T
	tester *caddytest.Tester
	url    string // the site's base URL
	admin  int    // the admin API's port
	ups    []*resumeUpstream
}

// resumePorts are the admin, HTTP and HTTPS ports of the llm_resume tests, picked free once per test
// process so that test processes running side by side never load configs into each other's Caddy. When
// the process already runs Caddy (other tests started it), its admin port is kept, so that those tests
// find it again.
var resumePorts = sync.OnceValue(func() (p [3]int) {
	p[0], p[1], p[2] = freePorts3()
	if caddy.ActiveContext().Context != nil {
		p[0] = caddytest.Default.AdminPort
	}
	return p
})

// resumeUpstream is a simulated vLLM server on 127.0.0.1 that records the completion bodies it receives.
type resumeUpstream struct {
	sim  *vllmsim.Server
	srv  *httptest.Server
	dial string

	mu     sync.Mutex
	bodies [][]byte
}

func newResumeUpstream(t *testing.T, cfg vllmsim.Config) *resumeUpstream {
	t.Helper()
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 200
	}
	sim, err := vllmsim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	u := &resumeUpstream{sim: sim}
	u.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			body, err := io.ReadAll(r.Body)
			if err != nil {
				return
			}
			u.mu.Lock()
			u.bodies = append(u.bodies, body)
			u.mu.Unlock()
			r.Body = io.NopCloser(bytes.NewReader(body))
		}
		sim.ServeHTTP(w, r)
	}))
	u.dial = strings.TrimPrefix(u.srv.URL, "http://")
	freshUpstream(u.dial)
	t.Cleanup(func() {
		sim.Close()
		u.srv.CloseClientConnections()
		u.srv.Close()
	})
	return u
}

func (u *resumeUpstream) received() [][]byte {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([][]byte(nil), u.bodies...)
}

// newResumeTest starts the proxy with the given llm_resume block options in front of the upstreams.
func newResumeTest(t *testing.T, resumeOptions string, ups ...*resumeUpstream) *resumeTest {
	t.Helper()
	return newResumeTestWith(t, resumeOptions, "", ups...)
}

// newResumeTestWith is newResumeTest with proxyOptions added to the reverse_proxy block.
func newResumeTestWith(t *testing.T, resumeOptions, proxyOptions string, ups ...*resumeUpstream) *resumeTest {
	t.Helper()
	ports := resumePorts()
	admin, port := ports[0], ports[1]
	dials := make([]string, len(ups))
	for i, u := range ups {
		dials[i] = u.dial
	}
	cfg := fmt.Sprintf(`{
	skip_install_trust
	admin localhost:%d
	http_port %d
	https_port %d
	grace_period 1ns
	persist_config off
}
:%d {
	llm_resume {
		%s
	}
	reverse_proxy %s {
		lb_policy llm
		%s
	}
}
`, admin, port, ports[2], port, resumeOptions, strings.Join(dials, " "), proxyOptions)
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	tester.InitServer(cfg, "caddyfile")
	rt := &resumeTest{t: t, tester: tester, url: fmt.Sprintf("http://localhost:%d", port), admin: admin, ups: ups}
	t.Cleanup(func() { assertAllZero(t, dials) })
	return rt
}

// streamResult is what a client read from one completion stream.
type streamResult struct {
	status     int
	content    string
	done       int // [DONE] events
	roles      int // chunks carrying a role
	errors     []string
	ids        map[string]bool
	usage      *struct{ PromptTokens, CompletionTokens, TotalTokens int }
	afterDone  bool // events after the first [DONE]
	readErr    error
	finishSeen int
}

// postStream sends a completion request and reads the whole answer as SSE.
func (rt *resumeTest) postStream(path string, body []byte, header ...string) streamResult {
	rt.t.Helper()
	req, err := http.NewRequest(http.MethodPost, rt.url+path, bytes.NewReader(body))
	if err != nil {
		rt.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := doReloadSafe(http.DefaultClient, req)
	if err != nil {
		rt.t.Fatalf("POST %s: %v", path, err)
	}
	defer res.Body.Close()
	return readSSE(res.StatusCode, res.Body)
}

func readSSE(status int, body io.Reader) streamResult {
	sr := streamResult{status: status, ids: map[string]bool{}}
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if sr.done > 0 {
			sr.afterDone = true
		}
		if data == "[DONE]" {
			sr.done++
			continue
		}
		var chunk struct {
			ID      string `json:"id"`
			Choices []struct {
				Delta *struct {
					Role    string `json:"role"`
					Content string `json:"content"`
				} `json:"delta"`
				Text         string `json:"text"`
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
				TotalTokens      int `json:"total_tokens"`
			} `json:"usage"`
			Error json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			sr.errors = append(sr.errors, "unreadable event: "+data)
			continue
		}
		if chunk.Error != nil {
			sr.errors = append(sr.errors, string(chunk.Error))
			continue
		}
		sr.ids[chunk.ID] = true
		for _, c := range chunk.Choices {
			sr.content += c.Text
			if c.Delta != nil {
				sr.content += c.Delta.Content
				if c.Delta.Role != "" {
					sr.roles++
				}
			}
			if c.FinishReason != "" {
				sr.finishSeen++
			}
		}
		if chunk.Usage != nil {
			sr.usage = (*struct{ PromptTokens, CompletionTokens, TotalTokens int })(chunk.Usage)
		}
	}
	sr.readErr = sc.Err()
	return sr
}

// checkComplete fails unless sr is one whole stream of maxTokens simulated tokens (4 bytes each).
func checkComplete(t *testing.T, name string, sr streamResult, maxTokens int, chat bool) {
	t.Helper()
	switch {
	case sr.status != http.StatusOK || sr.readErr != nil:
		t.Errorf("%s: status %d, read error %v", name, sr.status, sr.readErr)
	case len(sr.errors) > 0:
		t.Errorf("%s: error events %q", name, sr.errors)
	case len(sr.content) != 4*maxTokens:
		t.Errorf("%s: %d bytes of content (%q), want %d tokens", name, len(sr.content), sr.content, maxTokens)
	case sr.done != 1 || sr.afterDone:
		t.Errorf("%s: %d [DONE] events (events after it: %t), want exactly one, last", name, sr.done, sr.afterDone)
	case sr.finishSeen != 1:
		t.Errorf("%s: %d finish reasons, want 1", name, sr.finishSeen)
	case len(sr.ids) != 1:
		t.Errorf("%s: chunk ids %v, want one", name, sr.ids)
	case chat && sr.roles != 1:
		t.Errorf("%s: %d role chunks, want 1", name, sr.roles)
	case sr.usage != nil && (sr.usage.CompletionTokens != maxTokens ||
		sr.usage.TotalTokens != sr.usage.PromptTokens+sr.usage.CompletionTokens || sr.usage.PromptTokens <= 0):
		t.Errorf("%s: usage %+v, want %d completion tokens adding up", name, *sr.usage, maxTokens)
	}
}

func resumeChat(maxTokens int, user string) []byte {
	return fmt.Appendf(nil, `{"model":"sim-model","stream":true,"stream_options":{"include_usage":true},"max_tokens":%d,"messages":[{"role":"user","content":%q}]}`,
		maxTokens, user)
}

// TestResumeContinuesCutStreams: every upstream cuts every stream after 5 tokens (X-Sim-Cut-After), so a
// 12-token answer takes three attempts - 5, 5 and 2 tokens - that the client receives as one stream. The
// continuations carry the partial answer and the reduced max_tokens.
func TestResumeContinuesCutStreams(t *testing.T) {
	a, b := newResumeUpstream(t, vllmsim.Config{}), newResumeUpstream(t, vllmsim.Config{})
	rt := newResumeTest(t, "", a, b)

	sr := rt.postStream("/v1/chat/completions", resumeChat(12, "hello there"), "X-Sim-Cut-After", "5")
	checkComplete(t, "chat", sr, 12, true)
	if sr.usage == nil {
		t.Errorf("chat: no usage chunk")
	}
	bodies := append(a.received(), b.received()...)
	if len(bodies) != 3 {
		t.Fatalf("upstreams received %d requests, want 3", len(bodies))
	}
	var continued []map[string]any
	for _, body := range bodies {
		var m map[string]any
		if err := json.Unmarshal(body, &m); err != nil {
			t.Fatal(err)
		}
		if m["continue_final_message"] == true {
			continued = append(continued, m)
		} else if string(body) != string(resumeChat(12, "hello there")) {
			t.Errorf("first attempt's body %s, want the client's unchanged", body)
		}
	}
	if len(continued) != 2 {
		t.Fatalf("%d continuations, want 2", len(continued))
	}
	for _, m := range continued {
		msgs := m["messages"].([]any)
		last := msgs[len(msgs)-1].(map[string]any)
		text := last["content"].(string)
		sent := len(text) / 4
		if last["role"] != "assistant" || len(msgs) != 2 || m["add_generation_prompt"] != false ||
			int(m["max_tokens"].(float64)) != 12-sent || (sent != 5 && sent != 10) {
			t.Errorf("continuation %v: want the partial answer (5 or 10 tokens) as an assistant message, max_tokens reduced", m)
		}
	}

	completion := fmt.Appendf(nil, `{"model":"sim-model","stream":true,"max_tokens":9,"prompt":"Once upon a time"}`)
	sr = rt.postStream("/v1/completions", completion, "X-Sim-Cut-After", "4")
	checkComplete(t, "completions", sr, 9, false)
}

// TestResumeObservesOnce: llm_resume reads the stream it relays, so without transport llm it tells the
// policy the attempt's first token and the backend's cached tokens; with transport llm too, the two
// observers of the same attempt count it once. A count past n fails at once: in CI a wait for a count
// of exactly n timed out once, unexplained, which an earlier test's count at a reused port would do
// (newResumeUpstream starts from fresh state since), and so would a double count.
func TestResumeObservesOnce(t *testing.T) {
	for _, proxyOptions := range []string{"", "transport llm"} {
		t.Run(strings.TrimSpace("resume "+proxyOptions), func(t *testing.T) {
			up := newResumeUpstream(t, vllmsim.Config{})
			rt := newResumeTestWith(t, "", proxyOptions, up)
			observed := func() (inflight, usages int64, firstTokens int) {
				res, err := http.Get(fmt.Sprintf("http://localhost:%d/llm/upstreams", rt.admin))
				if err != nil {
					t.Fatal(err)
				}
				defer res.Body.Close()
				var report struct {
					Upstreams []upstreamStatus `json:"upstreams"`
				}
				if err := json.NewDecoder(res.Body).Decode(&report); err != nil {
					t.Fatal(err)
				}
				for _, u := range report.Upstreams {
					if u.Upstream != up.dial {
						continue
					}
					inflight = u.InflightRequests
					if u.Cache != nil {
						usages = u.Cache.Requests
					}
					if u.Model != nil {
						firstTokens = u.Model.FirstTokens + u.Model.SkippedFirstTokens
					}
				}
				return inflight, usages, firstTokens
			}
			const n = 3
			for i := range n {
				sr := rt.postStream("/v1/chat/completions", resumeChat(6, fmt.Sprintf("question %d", i)))
				checkComplete(t, "chat", sr, 6, true)
			}
			var usages int64
			var firstTokens int
			waitFor(t, "the requests' ends", func() bool {
				var inflight int64
				inflight, usages, firstTokens = observed()
				return inflight == 0 && usages >= n
			})
			if usages != n || firstTokens != n {
				t.Errorf("%s: %d usages and %d first tokens observed, want %d of each", up.dial, usages, firstTokens, n)
			}
		})
	}
}

// TestResumeGivesUp: when max_attempts run out, a started stream ends with an error event, never a silent
// truncation, and a request that received nothing gets the last failure as a JSON error.
func TestResumeGivesUp(t *testing.T) {
	a, b := newResumeUpstream(t, vllmsim.Config{}), newResumeUpstream(t, vllmsim.Config{})
	rt := newResumeTest(t, "max_attempts 2", a, b)

	sr := rt.postStream("/v1/chat/completions", resumeChat(20, "hi"), "X-Sim-Cut-After", "3")
	if sr.status != http.StatusOK || len(sr.content) != 4*6 || sr.done != 0 || len(sr.errors) != 1 {
		t.Errorf("stream: status %d, %d bytes, %d [DONE], errors %q; want 6 tokens, then one error event",
			sr.status, len(sr.content), sr.done, sr.errors)
	}

	for _, stream := range []bool{true, false} {
		body := fmt.Appendf(nil, `{"model":"sim-model","stream":%t,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`, stream)
		req, _ := http.NewRequest(http.MethodPost, rt.url+"/v1/chat/completions", bytes.NewReader(body))
		req.Header.Set("X-Sim-Status", "503")
		res, err := doReloadSafe(http.DefaultClient, req)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(res.Body)
		res.Body.Close()
		var e struct {
			Error struct {
				Message string
				Code    int
			}
		}
		if res.StatusCode != 503 || json.Unmarshal(got, &e) != nil || e.Error.Code != 503 {
			t.Errorf("stream %t, every attempt 503: status %d, body %s; want the upstream's 503 JSON error", stream, res.StatusCode, got)
		}
	}
	if n := len(a.received()) + len(b.received()); n != 1+1+2+2 {
		t.Errorf("upstreams received %d requests, want 6 (2 attempts each)", n)
	}
}

// TestResumePassesThrough: what llm_resume does not handle reaches the upstream untouched and is never
// re-sent: a body over max_body_size, a non-LLM request, and a client error (400).
func TestResumePassesThrough(t *testing.T) {
	a := newResumeUpstream(t, vllmsim.Config{})
	rt := newResumeTest(t, "max_body_size 1KiB", a)

	big := resumeChat(8, strings.Repeat("long ", 300))
	sr := rt.postStream("/v1/chat/completions", big, "X-Sim-Cut-After", "3")
	if sr.status != http.StatusOK || len(sr.content) != 4*3 || sr.done != 0 || sr.readErr == nil {
		t.Errorf("over max_body_size: status %d, %d bytes, %d [DONE], read error %v; want the cut stream as is",
			sr.status, len(sr.content), sr.done, sr.readErr)
	}
	if got := a.received(); len(got) != 1 || !bytes.Equal(got[0], big) {
		t.Errorf("over max_body_size: upstream received %d requests, want the one body untouched", len(got))
	}

	res, err := http.Get(rt.url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Errorf("GET /v1/models: status %d", res.StatusCode)
	}

	sr = rt.postStream("/v1/chat/completions", []byte(`{"model":"sim-model","stream":true,"messages":[]}`))
	if sr.status != http.StatusBadRequest || len(a.received()) != 2 {
		t.Errorf("bad request: status %d after %d upstream requests, want 400 after 2", sr.status, len(a.received()))
	}
}

// TestResumeFaultyBackend is issue 10's acceptance test: one of two upstreams cuts half its streams at
// random points and fails 20% of requests with 500; every client stream - raw HTTP and the official
// OpenAI Go client, chat and completions - completes with all max_tokens tokens and one [DONE],
// non-streaming requests succeed, and the in-flight accounting ends at zero.
func TestResumeFaultyBackend(t *testing.T) {
	flaky := newResumeUpstream(t, vllmsim.Config{DropMidStreamRate: 0.5, ErrorRate: 0.2, Seed: 7})
	good := newResumeUpstream(t, vllmsim.Config{Seed: 8})
	rt := newResumeTest(t, "", flaky, good)

	// Rounds of 48 requests until both kinds of failure were met: how much traffic reaches the flaky
	// upstream is the policy's choice (a round sends it from 10 to 45 requests).
	const perRound, rounds, workers = 48, 3, 4
	rng := rand.New(rand.NewPCG(1, 2))
	maxTokens := make([]int, perRound*rounds)
	for i := range maxTokens {
		maxTokens[i] = 8 + rng.IntN(40)
	}
	client := openai.NewClient(option.WithBaseURL(rt.url+"/v1/"), option.WithAPIKey("test"), option.WithMaxRetries(0))
	requests, continuations, sent := 0, 0, 0
	for round := 0; round < rounds && (continuations == 0 || sent-continuations <= requests); round++ {
		var wg sync.WaitGroup
		jobs := make(chan int)
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range jobs {
					n := maxTokens[i]
					user := fmt.Sprintf("request %d: %s", i, strings.Repeat("words ", 10+i))
					switch i % 4 {
					case 0:
						checkComplete(t, fmt.Sprintf("raw chat %d", i), rt.postStream("/v1/chat/completions", resumeChat(n, user)), n, true)
					case 1:
						body := fmt.Appendf(nil, `{"model":"sim-model","stream":true,"max_tokens":%d,"prompt":%q}`, n, user)
						checkComplete(t, fmt.Sprintf("raw completions %d", i), rt.postStream("/v1/completions", body), n, false)
					case 2:
						openAIChat(t, &client, i, user, n)
					case 3:
						body := fmt.Appendf(nil, `{"model":"sim-model","max_tokens":%d,"messages":[{"role":"user","content":%q}]}`, n, user)
						res, err := http.Post(rt.url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
						if err != nil {
							t.Errorf("non-streaming %d: %v", i, err)
							continue
						}
						var whole struct {
							Choices []struct{ Message struct{ Content string } }
						}
						err = json.NewDecoder(res.Body).Decode(&whole)
						res.Body.Close()
						if res.StatusCode != http.StatusOK || err != nil || len(whole.Choices) != 1 || len(whole.Choices[0].Message.Content) != 4*n {
							t.Errorf("non-streaming %d: status %d, %v, %+v", i, res.StatusCode, err, whole)
						}
					}
				}
			}()
		}
		for i := round * perRound; i < (round+1)*perRound; i++ {
			jobs <- i
		}
		close(jobs)
		wg.Wait()
		requests += perRound
		continuations, sent = 0, 0
		for _, body := range append(flaky.received(), good.received()...) {
			sent++
			if bytes.Contains(body, []byte(`"continue_final_message":true`)) {
				continuations++
			}
		}
	}
	if continuations == 0 || sent-continuations <= requests {
		t.Errorf("%d requests upstream for %d from clients, %d continuations: want whole retries and continuations",
			sent, requests, continuations)
	}
	t.Logf("%d requests upstream for %d from clients (%d to the flaky one), %d of them continuations", sent, requests, len(flaky.received()), continuations)
}

// openAIChat streams a chat completion through the official client and its accumulator, which rejects a
// chunk whose id differs from the stream's.
func openAIChat(t *testing.T, client *openai.Client, i int, user string, maxTokens int) {
	stream := client.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{
		Model:         "sim-model",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage(user)},
		MaxTokens:     openai.Int(int64(maxTokens)),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	defer stream.Close()
	var acc openai.ChatCompletionAccumulator
	var content strings.Builder
	for stream.Next() {
		chunk := stream.Current()
		if !acc.AddChunk(chunk) {
			t.Errorf("openai-go %d: accumulator rejected chunk %s", i, chunk.RawJSON())
		}
		for _, c := range chunk.Choices {
			content.WriteString(c.Delta.Content)
		}
	}
	if err := stream.Err(); err != nil {
		t.Errorf("openai-go %d: %v", i, err)
		return
	}
	if content.Len() != 4*maxTokens || len(acc.Choices) != 1 || acc.Choices[0].Message.Content != content.String() ||
		acc.Usage.CompletionTokens != int64(maxTokens) || acc.Choices[0].FinishReason != "length" {
		t.Errorf("openai-go %d: %d bytes, accumulated %+v; want %d tokens", i, content.Len(), acc.ChatCompletion, maxTokens)
	}
}

// fakeProxy stands in for reverse_proxy in the handler's unit tests: attempt i runs script[i] with the
// body that attempt would send.
type fakeProxy struct {
	script []func(w http.ResponseWriter, body string) error
	bodies []string
}

func (f *fakeProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	body, _ := io.ReadAll(r.Body)
	f.bodies = append(f.bodies, string(body))
	return f.script[len(f.bodies)-1](w, string(body))
}

// sse writes a 200 event stream of the given data lines; abort then drops it as reverse_proxy does.
func sse(w http.ResponseWriter, abort bool, data ...string) error {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	for _, d := range data {
		fmt.Fprintf(w, "data: %s\n\n", d)
		http.NewResponseController(w).Flush()
	}
	if abort {
		panic(http.ErrAbortHandler)
	}
	return nil
}

// continuousBody asks for a stream with vLLM's continuous usage stats (the usage so far in every chunk).
const continuousBody = `{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"max_tokens":20,"messages":[{"role":"user","content":"hi"}]}`

// continuousChunk is a content chunk of stream "a" carrying vLLM's continuous usage: completion tokens so
// far, of a prompt of 8.
func continuousChunk(content string, completion int) string {
	return fmt.Sprintf(`{"id":"a","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":%q},"finish_reason":null}],"usage":{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d}}`,
		content, completion, 8+completion)
}

func chatChunk(id, delta, finish string) string {
	if finish == "" {
		finish = "null"
	}
	return fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":%s,"finish_reason":%s}]}`, id, delta, finish)
}

func serveResume(t *testing.T, body string, w http.ResponseWriter, next *fakeProxy) {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{}))
	h := &LLMResume{MaxAttempts: 3, MaxBodyBytes: defaultMaxBodyBytes, logger: zap.NewNop()}
	if err := h.ServeHTTP(w, r, next); err != nil {
		t.Errorf("ServeHTTP() error = %v", err)
	}
}

func TestResumeHandler(t *testing.T) {
	const stream = `{"stream":true,"stream_options":{"include_usage":true},"max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`
	role := chatChunk("a", `{"role":"assistant","content":""}`, "")
	for _, tc := range []struct {
		name     string
		body     string
		script   []func(w http.ResponseWriter, body string) error
		want     []string // data lines the client receives
		wantSent int      // attempts
		counted  resumeOutcome
	}{{
		name: "end lost after the finish reason: usage (prompt by estimate: no policy ran) and [DONE] made up",
		body: stream,
		script: []func(http.ResponseWriter, string) error{func(w http.ResponseWriter, _ string) error {
			return sse(w, true, role, chatChunk("a", `{"content":"x"}`, `"length"`))
		}},
		want: []string{role, chatChunk("a", `{"content":"x"}`, `"length"`),
			`{"id":"a","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}`,
			"[DONE]"},
		wantSent: 1,
		counted:  resumeContinued,
	}, {
		name: "an upstream error event is not relayed: the stream continues elsewhere",
		body: stream,
		script: []func(http.ResponseWriter, string) error{
			func(w http.ResponseWriter, _ string) error {
				return sse(w, false, role, chatChunk("a", `{"content":"x"}`, ""), `{"error":{"message":"engine died","code":503}}`, "[DONE]")
			},
			func(w http.ResponseWriter, body string) error {
				if !strings.Contains(body, `{"role":"assistant","content":"x"}`) || !strings.Contains(body, `"max_tokens":9`) {
					t.Errorf("continuation body %s", body)
				}
				return sse(w, false, chatChunk("b", `{"role":"assistant","content":""}`, ""), chatChunk("b", `{"content":"y"}`, `"length"`), "[DONE]")
			},
		},
		want:     []string{role, chatChunk("a", `{"content":"x"}`, ""), chatChunk("a", `{"content":"y"}`, `"length"`), "[DONE]"},
		wantSent: 2,
		counted:  resumeContinued,
	}, {
		name: "chunks of several tokens: the continuation asks for max_tokens less their text's tokens, and the usage counts them",
		body: `{"stream":true,"stream_options":{"include_usage":true},"max_tokens":20,"messages":[{"role":"user","content":"hi"}]}`,
		script: []func(http.ResponseWriter, string) error{
			func(w http.ResponseWriter, _ string) error {
				// 60 bytes in two chunks: 16 tokens by estimate, 8 times the chunks.
				return sse(w, true, role, chatChunk("a", `{"content":"The quick brown fox jumps over"}`, ""), chatChunk("a", `{"content":" the lazy dog and keeps going"}`, ""))
			},
			func(w http.ResponseWriter, body string) error {
				if !strings.Contains(body, `"max_tokens":4`) {
					t.Errorf("continuation body %s, want max_tokens 20 - 16", body)
				}
				return sse(w, false, chatChunk("b", `{"role":"assistant","content":""}`, ""), chatChunk("b", `{"content":" on."}`, `"length"`),
					`{"id":"b","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":30,"completion_tokens":4,"total_tokens":34}}`, "[DONE]")
			},
		},
		want: []string{role, chatChunk("a", `{"content":"The quick brown fox jumps over"}`, ""), chatChunk("a", `{"content":" the lazy dog and keeps going"}`, ""),
			chatChunk("a", `{"content":" on."}`, `"length"`),
			`{"choices":[],"created":1,"id":"a","model":"m","object":"chat.completion.chunk","usage":{"completion_tokens":20,"prompt_tokens":14,"total_tokens":34}}`, "[DONE]"},
		wantSent: 2,
		counted:  resumeContinued,
	}, {
		name: "chunks counted by vLLM's continuous usage keep that count, whatever their text estimates",
		body: continuousBody,
		script: []func(http.ResponseWriter, string) error{
			func(w http.ResponseWriter, _ string) error {
				return sse(w, true, role,
					continuousChunk("The quick brown fox jumps over", 1),
					continuousChunk(" the lazy dog and keeps going", 3))
			},
			func(w http.ResponseWriter, body string) error {
				if !strings.Contains(body, `"max_tokens":17`) {
					t.Errorf("continuation body %s, want max_tokens 20 - 3", body)
				}
				return sse(w, false, chatChunk("b", `{"role":"assistant","content":""}`, ""), chatChunk("b", `{"content":" on."}`, `"length"`), "[DONE]")
			},
		},
		want: []string{role,
			continuousChunk("The quick brown fox jumps over", 1),
			continuousChunk(" the lazy dog and keeps going", 3),
			chatChunk("a", `{"content":" on."}`, `"length"`), "[DONE]"},
		wantSent: 2,
		counted:  resumeContinued,
	}, {
		// A usage that repeats its count beside new content: that chunk is one token, and the next count
		// is measured from the tokens counted (3 in all), as transport llm counts (observedBody.endEvent).
		name: "continuous usage that repeats a count is counted as transport llm counts it",
		body: continuousBody,
		script: []func(http.ResponseWriter, string) error{
			func(w http.ResponseWriter, _ string) error {
				return sse(w, true, role,
					continuousChunk("The quick", 1),
					continuousChunk(" brown fox", 1),
					continuousChunk(" jumps over", 3))
			},
			func(w http.ResponseWriter, body string) error {
				if !strings.Contains(body, `"max_tokens":17`) {
					t.Errorf("continuation body %s, want max_tokens 20 - 3", body)
				}
				return sse(w, false, chatChunk("b", `{"role":"assistant","content":""}`, ""), chatChunk("b", `{"content":" it."}`, `"length"`), "[DONE]")
			},
		},
		want: []string{role,
			continuousChunk("The quick", 1),
			continuousChunk(" brown fox", 1),
			continuousChunk(" jumps over", 3),
			chatChunk("a", `{"content":" it."}`, `"length"`), "[DONE]"},
		wantSent: 2,
		counted:  resumeContinued,
	}, {
		name: "a broken stream of tool calls is not continued",
		body: stream,
		script: []func(http.ResponseWriter, string) error{func(w http.ResponseWriter, _ string) error {
			return sse(w, true, role, chatChunk("a", `{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}`, ""))
		}},
		want: []string{role, chatChunk("a", `{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}`, ""),
			`{"error":{"code":502,"message":"upstream failed after 1 attempts (last status 502)","param":null,"type":"server_error"}}`},
		wantSent: 1,
		counted:  resumeFailed,
	}, {
		name: "a stream that breaks before any content is sent again unchanged",
		body: stream,
		script: []func(http.ResponseWriter, string) error{
			func(w http.ResponseWriter, _ string) error { return sse(w, true, role) },
			func(w http.ResponseWriter, body string) error {
				if body != stream {
					t.Errorf("second attempt's body %s, want the original", body)
				}
				return sse(w, false, chatChunk("b", `{"role":"assistant","content":""}`, ""), chatChunk("b", `{"content":"y"}`, `"stop"`), "[DONE]")
			},
		},
		want:     []string{role, chatChunk("a", `{"content":"y"}`, `"stop"`), "[DONE]"},
		wantSent: 2,
		counted:  resumeRetriedWhole,
	}} {
		next := &fakeProxy{script: tc.script}
		rec := httptest.NewRecorder()
		before := resumeCounts()
		serveResume(t, tc.body, rec, next)
		checkResumeCounted(t, tc.name, before, tc.counted)
		var got []string
		for _, line := range strings.Split(rec.Body.String(), "\n") {
			if d, ok := strings.CutPrefix(line, "data: "); ok {
				got = append(got, d)
			}
		}
		if strings.Join(got, "\n") != strings.Join(tc.want, "\n") || len(next.bodies) != tc.wantSent {
			t.Errorf("%s: after %d attempts the client got\n%s\nwant (after %d)\n%s", tc.name, len(next.bodies),
				strings.Join(got, "\n"), tc.wantSent, strings.Join(tc.want, "\n"))
		}
	}
}

// TestResumeHandlerNonStreaming: a failed attempt's status and body are never sent; the success is.
func TestResumeHandlerNonStreaming(t *testing.T) {
	next := &fakeProxy{script: []func(http.ResponseWriter, string) error{
		func(w http.ResponseWriter, _ string) error {
			w.Header().Set("X-Attempt", "1")
			w.WriteHeader(http.StatusTooManyRequests)
			io.WriteString(w, `{"error":"busy"}`)
			return nil
		},
		func(http.ResponseWriter, string) error { return caddyhttp.Error(http.StatusBadGateway, io.EOF) },
		func(w http.ResponseWriter, _ string) error {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"choices":[]}`)
			return nil
		},
	}}
	rec := httptest.NewRecorder()
	before := resumeCounts()
	serveResume(t, `{"messages":[{"role":"user","content":"hi"}]}`, rec, next)
	if rec.Code != http.StatusOK || rec.Body.String() != `{"choices":[]}` || rec.Header().Get("X-Attempt") != "" {
		t.Errorf("client got %d %v %s, want only the third attempt's answer", rec.Code, rec.Header(), rec.Body)
	}
	checkResumeCounted(t, "non-streaming", before, resumeRetriedWhole)
}

// resumeCounts reads caddy_llm_resumes_total by outcome.
func resumeCounts() [len(resumeCounters)]float64 {
	var out [len(resumeCounters)]float64
	for i, c := range resumeCounters {
		out[i] = testutil.ToFloat64(c)
	}
	return out
}

// awaitResumeCounted is checkResumeCounted for a request served by a real server: the handler counts it
// after it wrote the answer, which the client may have read already, so it waits (up to 5 s) for the count.
func awaitResumeCounted(t *testing.T, name string, before [len(resumeCounters)]float64, want resumeOutcome) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if after := resumeCounts(); after != before {
			break
		}
	}
	checkResumeCounted(t, name, before, want)
}

// checkResumeCounted fails unless exactly one request was counted since before, with outcome want.
func checkResumeCounted(t *testing.T, name string, before [len(resumeCounters)]float64, want resumeOutcome) {
	t.Helper()
	after := resumeCounts()
	for i := range after {
		wantDelta := 0.0
		if resumeOutcome(i) == want {
			wantDelta = 1
		}
		if d := after[i] - before[i]; d != wantDelta {
			t.Errorf("%s: caddy_llm_resumes_total{outcome=%q} grew by %v, want %v", name, resumeOutcomeNames[i], d, wantDelta)
		}
	}
}

// failingWriter is a client that went away.
type failingWriter struct{ *httptest.ResponseRecorder }

func (failingWriter) Write([]byte) (int, error) { return 0, io.ErrClosedPipe }

// TestResumeHandlerPanics: the handler recovers only reverse_proxy's abort, and only to resume for a
// client that is still there.
func TestResumeHandlerPanics(t *testing.T) {
	const body = `{"stream":true,"messages":[{"role":"user","content":"hi"}]}`
	for name, tc := range map[string]struct {
		w    http.ResponseWriter
		next func(w http.ResponseWriter, _ string) error
		want any
	}{
		"client gone": {
			w: failingWriter{httptest.NewRecorder()},
			next: func(w http.ResponseWriter, _ string) error {
				return sse(w, true, chatChunk("a", `{"content":"x"}`, ""))
			},
			want: http.ErrAbortHandler,
		},
		"another panic": {
			w:    httptest.NewRecorder(),
			next: func(http.ResponseWriter, string) error { panic("bug") },
			want: "bug",
		},
	} {
		func() {
			defer func() {
				if v := recover(); v != tc.want {
					t.Errorf("%s: panic %v, want %v", name, v, tc.want)
				}
			}()
			next := &fakeProxy{script: []func(http.ResponseWriter, string) error{tc.next, tc.next, tc.next}}
			serveResume(t, body, tc.w, next)
		}()
	}
}

// TestResumeHandlerLastEventUnterminated: a stream whose [DONE] lacks the blank line after it is complete.
func TestResumeHandlerLastEventUnterminated(t *testing.T) {
	next := &fakeProxy{script: []func(http.ResponseWriter, string) error{func(w http.ResponseWriter, _ string) error {
		sse(w, false, chatChunk("a", `{"role":"assistant","content":"x"}`, `"stop"`))
		io.WriteString(w, "data: [DONE]")
		return nil
	}}}
	rec := httptest.NewRecorder()
	serveResume(t, `{"stream":true,"messages":[{"role":"user","content":"hi"}]}`, rec, next)
	if got := rec.Body.String(); !strings.HasSuffix(got, "data: [DONE]\n\n") || strings.Contains(got, "error") || len(next.bodies) != 1 {
		t.Errorf("client got %q after %d attempts, want the stream and its [DONE] after one", got, len(next.bodies))
	}
}

// TestResumeHandlerCutAfterLastToken: a stream cut after its last token but before its finish reason is
// not continued (nothing is left to ask for); the client gets the finish reason the limit gave it, the
// usage it asked for and [DONE] (TestResumeBackendKilled hit this: a stream ended without a finish
// reason when its upstream died between the two).
func TestResumeHandlerCutAfterLastToken(t *testing.T) {
	next := &fakeProxy{script: []func(http.ResponseWriter, string) error{func(w http.ResponseWriter, _ string) error {
		return sse(w, true, chatChunk("a", `{"role":"assistant","content":""}`, ""),
			chatChunk("a", `{"content":"x"}`, ""), chatChunk("a", `{"content":"y"}`, ""))
	}}}
	rec := httptest.NewRecorder()
	serveResume(t, `{"stream":true,"max_tokens":2,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`, rec, next)
	got := rec.Body.String()
	sr := readSSE(http.StatusOK, strings.NewReader(got))
	if len(next.bodies) != 1 || sr.finishSeen != 1 || sr.done != 1 || len(sr.errors) > 0 || sr.content != "xy" ||
		sr.usage == nil || sr.usage.CompletionTokens != 2 || len(sr.ids) != 1 {
		t.Errorf("after %d attempts the client got %+v, want one attempt, xy, one finish reason, usage and [DONE]", len(next.bodies), sr)
	}
	if !strings.Contains(got, `"finish_reason":"length"`) {
		t.Errorf("client got %q, want finish_reason length", got)
	}
}

// TestResumeBackendKilled: an upstream dies (its engine stopped, every connection closed, the port shut)
// while streams to it are open. Each of them is continued on the other upstream, and the client sees
// every stream complete.
func TestResumeBackendKilled(t *testing.T) {
	// Slower than the other tests (1.5 ms a token), so that the streams are still open when one dies.
	ups := []*resumeUpstream{
		newResumeUpstream(t, vllmsim.Config{TimeScale: 20, Seed: 1}),
		newResumeUpstream(t, vllmsim.Config{TimeScale: 20, Seed: 2}),
	}
	rt := newResumeTest(t, "", ups...)

	const streams, maxTokens = 6, 200
	type open struct {
		body  io.ReadCloser
		first string
	}
	var opened []open
	for i := range streams {
		req, _ := http.NewRequest(http.MethodPost, rt.url+"/v1/chat/completions", bytes.NewReader(resumeChat(maxTokens, fmt.Sprintf("stream %d", i))))
		req.Header.Set("Content-Type", "application/json")
		res, err := doReloadSafe(http.DefaultClient, req)
		if err != nil {
			t.Fatal(err)
		}
		if res.StatusCode != http.StatusOK {
			t.Fatalf("stream %d: status %d", i, res.StatusCode)
		}
		// Read up to the first event: the stream is under way.
		br := bufio.NewReader(res.Body)
		var first strings.Builder
		for !strings.HasPrefix(first.String(), "data: ") || !strings.HasSuffix(first.String(), "\n\n") {
			line, err := br.ReadString('\n')
			if err != nil {
				t.Fatalf("stream %d: %v after %q", i, err, first.String())
			}
			first.WriteString(line)
		}
		opened = append(opened, open{struct {
			io.Reader
			io.Closer
		}{br, res.Body}, first.String()})
	}
	victim, survivor := ups[0], ups[1]
	if _, n := loads.get(ups[1].dial); n > 0 {
		victim, survivor = ups[1], ups[0]
	}
	if _, n := loads.get(victim.dial); n == 0 {
		t.Fatalf("no stream open to either upstream")
	}
	victim.sim.Close()
	victim.srv.CloseClientConnections()
	victim.srv.Close()

	for i, o := range opened {
		sr := readSSE(http.StatusOK, io.MultiReader(strings.NewReader(o.first), o.body))
		o.body.Close()
		checkComplete(t, fmt.Sprintf("stream %d", i), sr, maxTokens, true)
	}
	continued := 0
	for _, body := range survivor.received() {
		if bytes.Contains(body, []byte(`"continue_final_message":true`)) {
			continued++
		}
	}
	if continued == 0 {
		t.Errorf("no stream was continued on the surviving upstream: the test did not test that")
	}
}

// TestResumeHandlerGzipBody: a gzip request is first sent as received; its continuation is plain JSON,
// without the Content-Encoding header.
func TestResumeHandlerGzipBody(t *testing.T) {
	const body = `{"stream":true,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`
	var zipped bytes.Buffer
	zw := gzip.NewWriter(&zipped)
	io.WriteString(zw, body)
	zw.Close()
	var encodings []string
	next := &fakeProxy{}
	next.script = []func(http.ResponseWriter, string) error{
		func(w http.ResponseWriter, got string) error {
			if got != zipped.String() {
				t.Errorf("first attempt's body is not the client's gzip bytes")
			}
			return sse(w, true, chatChunk("a", `{"role":"assistant","content":"x"}`, ""))
		},
		func(w http.ResponseWriter, got string) error {
			if !strings.Contains(got, `"continue_final_message":true`) || !strings.Contains(got, `"max_tokens":4`) {
				t.Errorf("continuation %q, want plain JSON continuing the answer", got)
			}
			return sse(w, false, chatChunk("b", `{"content":"y"}`, `"length"`), "[DONE]")
		},
	}
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(zipped.Bytes()))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("Content-Encoding", "gzip")
	r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{}))
	h := &LLMResume{MaxAttempts: 3, MaxBodyBytes: defaultMaxBodyBytes, logger: zap.NewNop()}
	rec := httptest.NewRecorder()
	wrapped := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		encodings = append(encodings, r.Header.Get("Content-Encoding"))
		return next.ServeHTTP(w, r)
	})
	if err := h.ServeHTTP(rec, r, wrapped); err != nil {
		t.Fatal(err)
	}
	if strings.Join(encodings, ",") != "gzip," || !strings.HasSuffix(rec.Body.String(), "data: [DONE]\n\n") {
		t.Errorf("Content-Encoding per attempt %q, client got %q", encodings, rec.Body)
	}
}

// discardWriter is a client that reads everything.
type discardWriter struct{ h http.Header }

func (d discardWriter) Header() http.Header       { return d.h }
func (discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (discardWriter) WriteHeader(int)             {}
func (discardWriter) Flush()                      {}

// BenchmarkResumeRelayChunk is the handler's cost per streamed chunk: reading it as SSE, decoding it,
// keeping its text and relaying it.
func BenchmarkResumeRelayChunk(b *testing.B) {
	chunk := []byte("data: " + chatChunk("chatcmpl-0123456789abcdef", `{"content":" the"}`, "") + "\n\n")
	rl := &relay{client: discardWriter{h: http.Header{}}, r: httptest.NewRequest(http.MethodPost, "/", nil),
		req: &resumeRequest{api: tokenize.APIChat, stream: true, continuable: true}, maxText: 1 << 30}
	rl.begin()
	rl.header.Set("Content-Type", "text/event-stream")
	rl.WriteHeader(http.StatusOK)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%4096 == 0 {
			rl.text = rl.text[:0] // keep memory flat across b.N
		}
		if _, err := rl.Write(chunk); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(chunk)), "bytes/chunk")
}

// TestResumeCountsFinalUsage: chunks of several tokens (vLLM's --stream-interval, speculative decoding)
// are counted one each as they are relayed; the attempt's final usage chunk, which counts them all, gives
// the service model the rest, so that it learns the real output length and not a time per token several
// times too long. A usage chunk that counts no more adds nothing.
func TestResumeCountsFinalUsage(t *testing.T) {
	for _, c := range []struct {
		usage int
		want  int64
	}{{8, 8}, {2, 2}} {
		lt := newTestLoads()
		res := lt.reserve("u:1", work{uncached: 100, prompt: 200, output: 16}, time.Now().UnixNano())
		ctx, cancel := context.WithCancel(context.WithValue(context.Background(), caddyhttp.VarsCtxKey, map[string]any{}))
		lr := &llmRequest{acct: newReservationHolder(ctx, nil)}
		lr.acct.swap(res)
		caddyhttp.SetVar(ctx, varKey, lr)
		rl := &relay{client: discardWriter{h: http.Header{}}, r: httptest.NewRequest(http.MethodPost, "/", nil).WithContext(ctx),
			req: &resumeRequest{api: tokenize.APIChat, stream: true, continuable: true, includeUsage: true}, maxText: 1 << 20}
		rl.begin()
		rl.header.Set("Content-Type", "text/event-stream")
		rl.WriteHeader(http.StatusOK)
		for _, ev := range []string{
			chatChunk("c1", `{"content":"Hello wor"}`, ""),
			chatChunk("c1", `{"content":"ld!"}`, `"length"`),
			fmt.Sprintf(`{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":200,"completion_tokens":%d}}`, c.usage),
			"[DONE]",
		} {
			if _, err := rl.Write([]byte("data: " + ev + "\n\n")); err != nil {
				t.Fatal(err)
			}
		}
		if got := res.outputSeen.Load(); got != c.want {
			t.Errorf("usage %d after two content chunks: %d output tokens counted, want %d", c.usage, got, c.want)
		}
		if rl.sentTokens != 2 {
			t.Errorf("usage %d: %d tokens counted as sent, want the chunks' 2", c.usage, rl.sentTokens)
		}
		cancel()
	}
}
