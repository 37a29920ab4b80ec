package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/tokenrouter/caddy-llm/internal/freeport"
	"github.com/tokenrouter/caddy-llm/selection"
)

// policy is one load-balancing configuration under test: a name for the reports and the JSON of
// reverse_proxy's load_balancing.selection_policy. Variants of a policy (another mode, scraping
// on or off) are one more line in allPolicies.
type policy struct {
	Name string
	JSON string
	// Transport is the reverse_proxy transport module: "" is Caddy's http transport, "llm" this
	// plugin's, which shows the llm policy every response (first tokens, cached tokens).
	Transport string
	// TellSpeeds sets each upstream's capacity to its simulator's prefill speed relative to the
	// policy's prior (times the time scale): what a user who writes `capacity` for unlike engines
	// tells the policy (scalePrior).
	TellSpeeds bool
}

// allPolicies are the policies the benchmark compares, in report order. least_conn is the
// baseline the ratios are computed against.
var allPolicies = []policy{
	{Name: "round_robin", JSON: `{"policy":"round_robin"}`},
	{Name: "least_conn", JSON: `{"policy":"least_conn"}`},
	{Name: "random", JSON: `{"policy":"random"}`},
	{Name: "header", JSON: `{"policy":"header","field":"X-Conversation-ID"}`},
	{Name: "llm", JSON: `{"policy":"llm"}`},
	{Name: "llm-least_tokens", JSON: `{"policy":"llm","mode":"least_tokens"}`},
	{Name: "llm-prefix", JSON: `{"policy":"llm","mode":"prefix"}`},
	{Name: "llm-combined", JSON: `{"policy":"llm","mode":"combined"}`},
	{Name: "oracle", JSON: `{"policy":"oracle"}`},
}

// extraPolicies can be named with -policies but are not part of "all": variants for one experiment.
// llm-combined+metrics scrapes the simulators' /metrics every 200 ms of wall time (1 s simulated at
// time scale 5), for runs with -bypass-rate where load the balancer does not route reaches a backend.
var extraPolicies = []policy{
	{Name: "llm-combined+metrics", JSON: `{"policy":"llm","mode":"combined","metrics":{"interval":"200ms"}}`},
	{Name: "llm-prefix+metrics", JSON: `{"policy":"llm","mode":"prefix","metrics":{"interval":"200ms"}}`},
	// llm's default scrapes every second of wall time, 5-20 s simulated at the matrix's time
	// scales: these two tell a stale scrape from the decision itself.
	{Name: "llm-nometrics", JSON: `{"policy":"llm","metrics":{"off":true}}`},
	{Name: "llm+metrics100ms", JSON: `{"policy":"llm","metrics":{"interval":"100ms"}}`},
	// Every 20 ms of wall time (100 ms simulated at time scale 5): with -instances, where each
	// instance counts only its own requests in flight, how much a fresher view of the backends'
	// queues gives back.
	{Name: "llm+metrics20ms", JSON: `{"policy":"llm","metrics":{"interval":"20ms"}}`},
	// llm behind transport llm: the policy sees the cached tokens each backend reports and corrects
	// its route table (against llm, the same policy without the observer).
	{Name: "llm-observed", JSON: `{"policy":"llm"}`, Transport: "llm"},
	// Without metrics (backends with no usable /metrics): the bare policy against the one that sees
	// first tokens through transport llm, its only other view of a backend's queue.
	{Name: "llm-observed-nometrics", JSON: `{"policy":"llm","metrics":{"off":true}}`, Transport: "llm"},
	// llm given the conversation ID the header policy hashes (conversation_header): the same knowledge
	// as header, against llm's bare default, which infers conversations from their prefixes.
	{Name: "llm-conversation", JSON: `{"policy":"llm","conversation_header":"X-Conversation-ID"}`},
	// llm told each backend's relative speed with capacity, as a user of a pool of unlike engines can:
	// against llm, what learning them costs where an engine that always queues learns slowly.
	{Name: "llm-told", JSON: `{"policy":"llm"}`, TellSpeeds: true},
}

// matrixPolicies are the policies of -matrix: Caddy's stock policies (stockPolicies), this
// plugin's bare default and the oracle.
var matrixPolicies = []string{"round_robin", "least_conn", "header", "llm", "oracle"}

// stockPolicies are the policies llm is judged against: a matrix cell passes when llm's TTFT is
// no worse than the best of them.
var stockPolicies = []string{"round_robin", "least_conn", "header"}

// judgedPolicy is the policy the matrix and the verdicts judge: a bare `lb_policy llm`.
const judgedPolicy = "llm"

// goodputPolicies are the policies -goodput compares.
var goodputPolicies = []string{"least_conn", "llm"}

// baselinePolicy is the policy every figure is compared with.
const baselinePolicy = "least_conn"

// policyModuleID returns the Caddy module ID a policy's JSON names.
func policyModuleID(p policy) (string, error) {
	var v struct {
		Policy string `json:"policy"`
	}
	if err := json.Unmarshal([]byte(p.JSON), &v); err != nil {
		return "", fmt.Errorf("decoding policy %s: %w", p.Name, err)
	}
	return "http.reverse_proxy.selection_policies." + v.Policy, nil
}

// isLLMPolicy reports whether p is lb_policy llm (the one with /llm/upstreams to read).
func isLLMPolicy(p policy) bool {
	id, err := policyModuleID(p)
	return err == nil && id == "http.reverse_proxy.selection_policies.llm"
}

// policyAvailable reports whether the policy's module is registered in this binary.
func policyAvailable(p policy) error {
	id, err := policyModuleID(p)
	if err != nil {
		return err
	}
	if _, err := caddy.GetModule(id); err != nil {
		return fmt.Errorf("module %s is not registered", id)
	}
	return nil
}

// proxyExtras are what -faults adds around the policy: Retries extra attempts (lb_retries) for POSTs
// after transport errors and for 429/5xx answers (lb_retry_match), RequestBuffers (request_buffers,
// bytes) so that a stock policy's retry can send a body again after an upstream read it, and
// llm_resume in front of reverse_proxy. The zero value adds nothing.
type proxyExtras struct {
	Retries        int   `json:"lb_retries,omitempty"`
	RequestBuffers int64 `json:"request_buffers,omitempty"`
	Resume         bool  `json:"llm_resume,omitempty"`
	// Admin, when set, is the address Caddy's admin API listens on (-dump reads the llm policy's
	// /llm/upstreams there at the end of a run); otherwise the admin API is off.
	Admin string `json:"-"`
}

// retryableStatusExpr is the lb_retry_match expression of -faults: retry what another upstream may
// answer (in JSON, {rp.status_code} is spelled out).
const retryableStatusExpr = "{http.reverse_proxy.status_code} in [429, 500, 502, 503, 504]"

// caddyConfig returns a Caddy JSON config: admin off, nothing persisted, logs at ERROR, one HTTP
// server on 127.0.0.1:port reverse-proxying to upstreams with the policy, flushing every write
// (streams pass through unbuffered), with the extras.
func caddyConfig(port int, upstreams []string, p policy, extras proxyExtras) ([]byte, error) {
	type upstream struct {
		Dial string `json:"dial"`
	}
	transport := p.Transport
	if transport == "" {
		transport = "http"
	}
	ups := make([]upstream, len(upstreams))
	for i, u := range upstreams {
		ups[i] = upstream{Dial: u}
	}
	lb := map[string]any{"selection_policy": json.RawMessage(p.JSON)}
	if extras.Retries > 0 {
		lb["retries"] = extras.Retries
		lb["retry_match"] = []any{
			map[string]any{"method": []string{"POST"}},
			map[string]any{"expression": retryableStatusExpr},
		}
	}
	var handlers []any
	if extras.Resume {
		handlers = append(handlers, map[string]any{"handler": "llm_resume"})
	}
	proxy := map[string]any{
		"handler":        "reverse_proxy",
		"flush_interval": -1,
		"upstreams":      ups,
		"load_balancing": lb,
		// What the llm policy predicted cached, for the prediction's precision, the time to first token
		// it predicted and why it chose (empty for other policies), and the backend that answered (-dump).
		"headers": map[string]any{"response": map[string]any{"set": map[string]any{
			"X-Upstream":           []string{"{http.reverse_proxy.upstream.hostport}"},
			"X-LLM-Matched-Tokens": []string{"{http.llm.matched_tokens}"},
			"X-LLM-Prompt-Tokens":  []string{"{http.llm.prompt_tokens}"},
			"X-LLM-Predicted-TTFT": []string{"{http.llm.predicted_ttft_ms}"},
			"X-LLM-Reason":         []string{"{http.llm.upstream_reason}"},
		}}},
		"transport": map[string]any{
			"protocol":                transport,
			"keep_alive":              map[string]any{"max_idle_conns_per_host": 1024},
			"response_header_timeout": "60s",
		},
	}
	if extras.RequestBuffers > 0 {
		proxy["request_buffers"] = extras.RequestBuffers
	}
	handlers = append(handlers, proxy)
	admin := map[string]any{"disabled": true, "config": map[string]any{"persist": false}}
	if extras.Admin != "" {
		delete(admin, "disabled")
		admin["listen"] = extras.Admin
	}
	cfg := map[string]any{
		"admin": admin,
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{
			"level": "ERROR",
		}}},
		"apps": map[string]any{"http": map[string]any{
			"grace_period": "1s",
			"servers": map[string]any{"bench": map[string]any{
				"listen":          []string{fmt.Sprintf("127.0.0.1:%d", port)},
				"automatic_https": map[string]any{"disable": true},
				"routes":          []any{map[string]any{"handle": handlers}},
			}},
		}},
	}
	return json.Marshal(cfg)
}

// startCaddy loads a config for p (with the extras) in this process and returns the proxy's base URL;
// stopCaddy stops it. Only one runs at a time.
func startCaddy(upstreams []string, p policy, extras proxyExtras) (string, error) {
	ports, err := freeport.Ports(1)
	if err != nil {
		return "", err
	}
	port := ports[0]
	cfg, err := caddyConfig(port, upstreams, p, extras)
	if err != nil {
		return "", err
	}
	if err := caddy.Load(cfg, true); err != nil {
		return "", fmt.Errorf("loading caddy config for %s: %w", p.Name, err)
	}
	return fmt.Sprintf("http://127.0.0.1:%d", port), nil
}

// stopCaddy stops the running Caddy config.
func stopCaddy() error {
	if err := caddy.Stop(); err != nil {
		return fmt.Errorf("stopping caddy: %w", err)
	}
	return nil
}

// isolateCaddyDirs points Caddy's data and config directories (autosave, PKI) at a temporary
// directory unless the caller set them, so a benchmark run leaves nothing in $HOME.
func isolateCaddyDirs() (cleanup func(), err error) {
	dir, err := os.MkdirTemp("", "caddy-llm-bench-")
	if err != nil {
		return nil, fmt.Errorf("creating caddy state dir: %w", err)
	}
	for _, v := range []string{"XDG_DATA_HOME", "XDG_CONFIG_HOME"} {
		if os.Getenv(v) == "" {
			_ = os.Setenv(v, filepath.Join(dir, v))
		}
	}
	return func() { _ = os.RemoveAll(dir) }, nil
}

// scalePrior returns p with every upstream's capacity set to the simulators' time scale, when p is an llm
// policy that sets no capacities: the policy's prior is a mid-range GPU in real time (8k prefill tokens/s,
// 30 ms steps), and the simulated backends run timeScale times faster in wall time, so without it the
// policy would start every run timeScale times wrong about every backend, which no real deployment does.
// Relative speeds (a slower backend) are still the policy's to learn, unless p.TellSpeeds: then each
// capacity is also its backend's prefill speed over the prior's (selection.Prior: what a capacity of 1
// stands for; speeds[i] is dials[i]'s prefill tokens a simulated second), what a user who writes
// `capacity` for unlike engines tells the policy. Other policies are unchanged.
func scalePrior(p policy, timeScale float64, dials []string, speeds []float64) policy {
	told := p.TellSpeeds && len(speeds) == len(dials)
	if timeScale <= 1 {
		if !told {
			return p
		}
		timeScale = 1
	}
	var cfg map[string]any
	if json.Unmarshal([]byte(p.JSON), &cfg) != nil || cfg["policy"] != "llm" || cfg["capacities"] != nil {
		return p
	}
	caps := make(map[string]float64, len(dials))
	for i, d := range dials {
		caps[d] = timeScale
		if told {
			caps[d] *= speeds[i] * selection.Prior.PrefillSecondsPerToken
		}
	}
	cfg["capacities"] = caps
	return p.withJSON(cfg)
}

// withJSON returns p with cfg as its JSON, every other field kept (p itself when cfg does not encode).
func (p policy) withJSON(cfg map[string]any) policy {
	b, err := json.Marshal(cfg)
	if err != nil {
		return p
	}
	p.JSON = string(b)
	return p
}

// scaleScrapes returns p with the llm policy's default scrape interval (1 s of wall time) divided by the
// simulators' time scale, when p does not set one: the simulated backends run timeScale times faster
// than real time, so 1 s of wall time is timeScale simulated seconds, and the same 1 s interval would
// show the policy a backend timeScale times staler than a real deployment does. Every other policy is
// returned unchanged.
func scaleScrapes(p policy, timeScale float64) policy {
	var cfg map[string]any
	if timeScale <= 1 || json.Unmarshal([]byte(p.JSON), &cfg) != nil || cfg["policy"] != "llm" {
		return p
	}
	metrics, _ := cfg["metrics"].(map[string]any)
	if metrics == nil {
		metrics = map[string]any{}
	}
	if _, set := metrics["interval"]; set || metrics["off"] == true {
		return p
	}
	metrics["interval"] = (time.Duration(float64(time.Second) / timeScale)).String()
	cfg["metrics"] = metrics
	return p.withJSON(cfg)
}
