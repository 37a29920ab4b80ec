package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/tokenrouter/caddy-llm/internal/freeport"
)

// demoPorts matches the ports examples/Caddyfile listens on: its admin address, the balancer and the
// three simulated backends.
var demoPorts = regexp.MustCompile(`:(2019|8080|8001|8002|8003)\b`)

// demoAddrs are the addresses demoPorts matches, each given a free port of its own.
var demoAddrs = []string{":2019", ":8080", ":8001", ":8002", ":8003"}

// demoConfig returns examples/Caddyfile with each of its ports moved to a free one, so the test
// neither collides with a Caddy running on the machine nor loads its config into one. It returns the
// config, the admin port and the balancer's port.
func demoConfig(t *testing.T) (config string, admin, proxy int) {
	t.Helper()
	raw, err := os.ReadFile("../../examples/Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	free, err := freeport.Ports(len(demoAddrs))
	if err != nil {
		t.Fatal(err)
	}
	ports := map[string]int{}
	config = demoPorts.ReplaceAllStringFunc(string(raw), func(m string) string {
		p, ok := ports[m]
		if !ok {
			p = free[len(ports)]
			ports[m] = p
		}
		return ":" + strconv.Itoa(p)
	})
	for _, want := range demoAddrs {
		if _, ok := ports[want]; !ok {
			t.Fatalf("examples/Caddyfile no longer uses %s; update demoPorts", want)
		}
	}
	return config, ports[":2019"], ports[":8080"]
}

// TestDemoReloadMidStream pins issue 13 item 1: `caddy reload --force` while a stream was open
// through examples/Caddyfile ended the stream with "simulated engine closed", because the reload tore
// down the vllm_sim backends living in the same Caddy. The stream must finish with every token and
// [DONE].
func TestDemoReloadMidStream(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy and streams for several seconds")
	}
	dir := t.TempDir()
	for _, v := range []string{"HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME"} {
		t.Setenv(v, dir)
	}
	config, admin, proxy := demoConfig(t)
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	tester.InitServer(config, "caddyfile")
	if t.Failed() {
		t.FailNow()
	}

	// The demo's backends decode a token per ~30 ms: 128 tokens stream for ~4 s, where a reload takes
	// milliseconds (a second on a busy machine). The test checks that it really landed mid-stream.
	const maxTokens = 128
	firstBefore, observedBefore := observedByDemo(t, admin) // the policy's state is process-wide: other tests' requests count too
	body := fmt.Sprintf(`{"model":"sim-model","stream":true,"max_tokens":%d,"stream_options":{"include_usage":true},`+
		`"messages":[{"role":"user","content":"Tell me a long story."}]}`, maxTokens)
	resp, err := http.Post(fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", proxy), "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, raw)
	}
	// The reader keeps up with the stream while the test reloads, so `received` is how far the
	// stream really got.
	var (
		got      []string // every data event; read it after ended is closed
		received atomic.Int64
		first    = make(chan struct{})
		ended    = make(chan struct{})
	)
	go func() {
		defer close(ended)
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				got = append(got, d)
				if received.Add(1) == 1 {
					close(first)
				}
			}
		}
	}()
	select {
	case <-first:
	case <-ended:
		t.Fatal("stream ended before its first event")
	case <-time.After(time.Minute):
		t.Fatal("no first event within a minute")
	}

	// What `caddy reload --force` does: POST the same config with Cache-Control: must-revalidate.
	req, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://localhost:%d/load", admin), strings.NewReader(config))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	req.Header.Set("Cache-Control", "must-revalidate")
	start := time.Now()
	reload, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("reloading: %v", err)
	}
	msg, _ := io.ReadAll(reload.Body)
	reload.Body.Close()
	if reload.StatusCode != http.StatusOK {
		t.Fatalf("reloading: status %d: %s", reload.StatusCode, msg)
	}
	before := received.Load()
	t.Logf("the reload answered in %v, after %d of %d tokens had arrived", time.Since(start), before, maxTokens)
	select {
	case <-ended:
		t.Fatalf("the stream ended before the reload answered: the reload did not land mid-stream (machine too slow?)")
	default:
	}

	select {
	case <-ended:
	case <-time.After(time.Minute):
		t.Fatalf("stream stalled after %d events", received.Load())
	}
	if n := len(got); n == 0 || got[n-1] != "[DONE]" {
		t.Fatalf("stream did not end with [DONE]; last events %q", got[max(0, len(got)-2):])
	}

	var tokens int
	var usage struct{ CompletionTokens int }
	for _, e := range got[:len(got)-1] {
		var chunk struct {
			Choices []struct {
				Delta        struct{ Content *string }
				FinishReason *string `json:"finish_reason"`
			}
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			}
			Error *struct{ Message string }
		}
		if err := json.Unmarshal([]byte(e), &chunk); err != nil {
			t.Fatalf("event %q: %v", e, err)
		}
		if chunk.Error != nil {
			t.Fatalf("stream ended with an error event after the reload: %s", e)
		}
		if len(chunk.Choices) > 0 && chunk.Choices[0].Delta.Content != nil {
			tokens++
		}
		if chunk.Usage != nil {
			usage.CompletionTokens = chunk.Usage.CompletionTokens
		}
	}
	if tokens != maxTokens || usage.CompletionTokens != maxTokens {
		t.Errorf("stream carried %d content chunks, usage %d completion tokens; want %d of each",
			tokens, usage.CompletionTokens, maxTokens)
	}

	// The demo's transport llm observed the stream across the reload: its first token reached the
	// service model (taught it or was skipped), and its usage the cache figures.
	firstTokens, observed := observedByDemo(t, admin)
	if firstTokens-firstBefore != 1 || observed-observedBefore != 1 {
		t.Errorf("/llm/upstreams: %d first tokens and %d usages observed during the test, want the stream's one of each",
			firstTokens-firstBefore, observed-observedBefore)
	}
}

// observedByDemo returns the first tokens (taught or skipped) and the usages the demo's policy has observed,
// over its upstreams.
func observedByDemo(t *testing.T, admin int) (firstTokens, observed int) {
	t.Helper()
	var report struct {
		Upstreams []struct {
			Model struct {
				FirstTokens int `json:"first_tokens_observed"`
				Skipped     int `json:"first_tokens_skipped"`
			} `json:"model"`
			Cache struct {
				Requests int `json:"observed_requests"`
			} `json:"cache"`
		} `json:"upstreams"`
	}
	res, err := http.Get(fmt.Sprintf("http://localhost:%d/llm/upstreams", admin))
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if err := json.NewDecoder(res.Body).Decode(&report); err != nil {
		t.Fatalf("decoding /llm/upstreams: %v", err)
	}
	for _, u := range report.Upstreams {
		firstTokens += u.Model.FirstTokens + u.Model.Skipped
		observed += u.Cache.Requests
	}
	return firstTokens, observed
}
