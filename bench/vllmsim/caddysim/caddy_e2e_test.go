package caddysim

import (
	"bufio"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/tokenrouter/caddy-llm/internal/freeport"

	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/standard"
)

// freePorts2 returns two distinct TCP ports free on 127.0.0.1 (freeport.Ports).
func freePorts2(t *testing.T) (int, int) {
	t.Helper()
	ports, err := freeport.Ports(2)
	if err != nil {
		t.Fatal(err)
	}
	return ports[0], ports[1]
}

// TestBehindReverseProxy runs a real Caddy (admin off) with a vllm_sim site and a reverse_proxy in
// front of it, and streams a chat completion through the proxy.
func TestBehindReverseProxy(t *testing.T) {
	dir := t.TempDir()
	for _, v := range []string{"HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME"} {
		t.Setenv(v, dir)
	}
	sim, proxy := freePorts2(t)
	caddyfile := fmt.Sprintf(`{
		admin off
		auto_https off
		persist_config off
	}
	http://127.0.0.1:%d {
		vllm_sim sim-model {
			time_scale 1000
		}
	}
	http://127.0.0.1:%d {
		reverse_proxy 127.0.0.1:%d
	}`, sim, proxy, sim)
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	if err != nil {
		t.Fatalf("adapting: %v", err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })

	body := `{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true}`
	resp, err := http.Post(fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", proxy), "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	var events []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			events = append(events, d)
		}
	}
	if len(events) != 6 || events[5] != "[DONE]" {
		t.Errorf("events through the proxy = %q, want 5 chunks and [DONE]", events)
	}
}
