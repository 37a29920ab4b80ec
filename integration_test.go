package caddyllm

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/tokenrouter/caddy-llm/internal/freeport"
)

// TestMain keeps Caddy's autosave and PKI data out of the user's home directory.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "caddy-llm-test")
	if err != nil {
		panic(err)
	}
	for _, k := range []string{"HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME"} {
		os.Setenv(k, dir)
	}
	caddytest.Default.AdminPort = adminPort
	// caddytest gives the admin API 5 s to answer a load and skips the test when it does not: on a
	// busy machine a reload under load takes longer. These are limits, not expectations.
	caddytest.Default.LoadRequestTimeout = time.Minute
	caddytest.Default.TestRequestTimeout = time.Minute
	code := m.Run()
	os.RemoveAll(dir)
	if caddyBinary != "" { // built by buildCaddy: 100 MB a run, left in the temporary directory otherwise
		os.RemoveAll(filepath.Dir(caddyBinary))
	}
	os.Exit(code)
}

// The ports the in-process Caddy uses, chosen free by the kernel once per test process: caddytest loads
// every config into whatever answers on its admin port, so fixed ports would send this process's configs
// to another test run's Caddy, or to any Caddy on the machine. The sites bind 127.0.0.1 only.
var (
	adminPort, httpPort, httpsPort = freePorts3()

	globalOptions = fmt.Sprintf(`{
	skip_install_trust
	admin localhost:%d
	http_port %d
	https_port %d
	default_bind 127.0.0.1
	grace_period 1ns
	persist_config off
}
`, adminPort, httpPort, httpsPort)

	proxyURL = fmt.Sprintf("http://127.0.0.1:%d", httpPort)
	adminURL = fmt.Sprintf("http://localhost:%d", adminPort)
	// site is the site address of the proxy under test.
	site = fmt.Sprintf(":%d", httpPort)
)

// freePorts3 returns three distinct TCP ports free on 127.0.0.1 (freeport.Ports).
func freePorts3() (int, int, int) {
	ports, err := freeport.Ports(3)
	if err != nil {
		panic(fmt.Sprintf("choosing a free port for the test Caddy: %v", err))
	}
	return ports[0], ports[1], ports[2]
}

// backend is a real HTTP upstream on 127.0.0.1 that records what it receives.
type backend struct {
	*httptest.Server
	dial string

	mu       sync.Mutex
	bodies   [][]byte // bodies received, in order
	requests atomic.Int64

	// hold, when set, makes each LLM request wait (after arriving is signalled) until it is closed.
	hold    chan struct{}
	arrived chan string
	handle  func(w http.ResponseWriter, r *http.Request, body []byte) // replaces the default answer
}

func newBackend(t *testing.T) *backend {
	t.Helper()
	b := &backend{arrived: make(chan string, 100)}
	b.Server = httptest.NewServer(http.HandlerFunc(b.serve))
	b.dial = strings.TrimPrefix(b.URL, "http://")
	freshUpstream(b.dial)
	t.Cleanup(b.Close)
	return b
}

func (b *backend) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/metrics" {
		// An OpenAI-compatible server without metrics: the policy scrapes by default, finds nothing
		// usable, and routes it on its own signals. Scrapes are not requests the tests count.
		http.NotFound(w, r)
		return
	}
	body, _ := io.ReadAll(r.Body)
	b.requests.Add(1)
	b.mu.Lock()
	b.bodies = append(b.bodies, body)
	hold := b.hold
	b.mu.Unlock()
	if hold != nil {
		b.arrived <- b.dial
		select {
		case <-hold:
		case <-r.Context().Done():
			return
		}
	}
	if b.handle != nil {
		b.handle(w, r, body)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"id":"x","object":"chat.completion","upstream":%q}`, b.dial)
}

func (b *backend) received() [][]byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([][]byte(nil), b.bodies...)
}

// chatBody is a chat request whose user message is about tokens words long (cl100k: one token a word).
func chatBody(model string, words int, stream bool) string {
	return fmt.Sprintf(`{"model":%q,"stream":%t,"max_tokens":16,"messages":[{"role":"user","content":%q}]}`,
		model, stream, strings.TrimSpace(strings.Repeat("hello ", words)))
}

func post(t *testing.T, client *http.Client, path, body string, headers ...string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, proxyURL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	res, err := doReloadSafe(client, req)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer res.Body.Close()
	got, _ := io.ReadAll(res.Body)
	return res, string(got)
}

// doer sends requests: an *http.Client, or a transport through roundTripDoer.
type doer interface {
	Do(*http.Request) (*http.Response, error)
}

type roundTripDoer struct{ http.RoundTripper }

func (d roundTripDoer) Do(req *http.Request) (*http.Response, error) { return d.RoundTrip(req) }

// doReloadSafe sends req, and again (up to reloadResends times) while the connection is reset before
// any response: right after a config load, the previous config's server (stopped with the tests' 1 ns
// grace period) can accept a new connection on the shared listener just before it closes, resetting it
// unanswered; and since Caddy's Stop returns once the old servers' shutdowns have started, not
// finished, a request answered just after a load may have been answered by the old server, whose
// shutdown then closes the kept-alive connection under the next request. Requests whose body cannot be
// replayed (no GetBody) are sent once.
func doReloadSafe(client doer, req *http.Request) (*http.Response, error) {
	res, err := client.Do(req)
	replayable := req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
	// Several resends: the old server may take the next new connection too until its shutdown closes
	// its listener (settle's GET failed twice in a row in one CI run, 2026-11-26).
	for range reloadResends {
		if err == nil || !replayable || !(errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF)) {
			return res, err
		}
		retry := req.Clone(req.Context())
		if req.GetBody != nil {
			body, berr := req.GetBody()
			if berr != nil {
				return nil, err
			}
			retry.Body = body
		}
		res, err = client.Do(retry)
	}
	return res, err
}

// reloadResends bounds doReloadSafe's resends of one request.
const reloadResends = 5

// reloadSafeTransport is http.DefaultTransport with doReloadSafe's resends, for clients whose own
// retries a test turns off to see the errors the proxy answers (the official OpenAI clients retry a
// connection reset by default, so a user never sees this one).
type reloadSafeTransport struct{}

func (reloadSafeTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	return doReloadSafe(roundTripDoer{http.DefaultTransport}, req)
}

// settle sends one request through the proxy just loaded (any answer will do), resent if the previous
// config's server reset it: clients that cannot resend, such as the official OpenAI client with retries
// off, then find the new server on a kept-alive connection of http.DefaultClient's. The connections
// http.DefaultClient kept to the previous config's server are closed first: that server is shutting
// down, and a POST sent on one of them fails with EOF. (That is not enough on its own: settle's request
// itself may be answered by the old server just before its shutdown begins; see doReloadSafe.)
func settle(t *testing.T) {
	t.Helper()
	http.DefaultClient.CloseIdleConnections()
	req, _ := http.NewRequest(http.MethodGet, proxyURL+"/v1/models", nil)
	res, err := doReloadSafe(http.DefaultClient, req)
	if err != nil {
		t.Fatalf("GET /v1/models after the config load: %v", err)
	}
	io.Copy(io.Discard, res.Body)
	res.Body.Close()
}

// waitInflightZero waits (boundedly) for every upstream's in-flight counters to return to zero: the last
// release runs when the request's context is done, just after the client has its response.
func waitInflightZero(t *testing.T, dials ...string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		leaked := ""
		for _, d := range dials {
			// The three counters are released one after another, so all three are waited for.
			var sequences int64
			if l := loads.lookup(d); l != nil {
				sequences = l.sequences.Load()
			}
			if tokens, requests := loads.get(d); tokens != 0 || requests != 0 || sequences != 0 {
				leaked += fmt.Sprintf(" %s: %d tokens, %d requests, %d sequences;", d, tokens, requests, sequences)
			}
		}
		if leaked == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("in-flight counters not back to zero:%s", leaked)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func proxyConfig(policy string, extra string, upstreams ...*backend) string {
	dials := make([]string, len(upstreams))
	for i, u := range upstreams {
		dials[i] = u.dial
	}
	return globalOptions + fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy %s
		%s
	}
}
`, site, strings.Join(dials, " "), policy, extra)
}

// TestHeavyAndLightRequests is the case this project started from: one 4,000-token request and ten
// 10-token requests in flight on two upstreams. By tokens, the light ones all avoid the upstream busy with
// the heavy one; by connections (least_conn) some of them join it.
func TestHeavyAndLightRequests(t *testing.T) {
	for _, tc := range []struct {
		policy       string
		wantOnHeavy0 bool // whether no light request may land on the heavy upstream
	}{
		{policy: "llm {\n\t\t\tmode least_tokens\n\t\t}", wantOnHeavy0: true},
		{policy: "llm", wantOnHeavy0: true},
		{policy: "least_conn", wantOnHeavy0: false},
	} {
		t.Run(strings.Fields(tc.policy)[0]+"/"+fmt.Sprint(tc.wantOnHeavy0), func(t *testing.T) {
			a, b := newBackend(t), newBackend(t)
			hold := make(chan struct{})
			a.hold, b.hold = hold, hold
			tester := caddytest.NewTester(t)
			tester.InitServer(proxyConfig(tc.policy, "", a, b), "caddyfile")

			var wg sync.WaitGroup
			send := func(body string) string {
				wg.Add(1)
				go func() {
					defer wg.Done()
					res, _ := post(t, tester.Client, "/v1/chat/completions", body)
					if res.StatusCode != http.StatusOK {
						t.Errorf("status %d", res.StatusCode)
					}
				}()
				return <-a.arrivedOrB(b)
			}
			// 40,000 tokens: its prefill (seconds at any plausible speed) lasts the whole test, and a
			// request is heavy while it prefills (once decoding, it is one sequence among others).
			heavy := send(chatBody("m", 40000, false))
			onHeavy := 0
			for i := range 10 {
				if send(chatBody("m", 10, false)+strings.Repeat(" ", i)) == heavy {
					onHeavy++
				}
			}
			close(hold)
			wg.Wait()
			if tc.wantOnHeavy0 && onHeavy != 0 {
				t.Errorf("%d of 10 light requests joined the heavy upstream, want 0", onHeavy)
			}
			if !tc.wantOnHeavy0 && onHeavy == 0 {
				t.Errorf("least_conn kept every light request off the heavy upstream; the comparison proves nothing")
			}
			waitInflightZero(t, a.dial, b.dial)
		})
	}
}

// arrivedOrB returns a channel on which the dial of whichever of a and b next receives a request arrives.
func (a *backend) arrivedOrB(b *backend) <-chan string {
	out := make(chan string, 1)
	go func() {
		select {
		case d := <-a.arrived:
			out <- d
		case d := <-b.arrived:
			out <- d
		case <-time.After(5 * time.Second):
			out <- "timeout"
		}
	}()
	return out
}

// TestBodyReachesUpstreamIntact checks that the upstream receives exactly the client's bytes, for LLM
// requests (parsed) and everything else (not parsed), including chunked bodies with no length.
func TestBodyReachesUpstreamIntact(t *testing.T) {
	a := newBackend(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm", "", a), "caddyfile")

	bodies := []struct{ path, body string }{
		{"/v1/chat/completions", "{\"model\":\"m\",\n  \"messages\":[{\"role\":\"user\",\"content\":\"héllo <|endoftext|>\"}]}  "},
		{"/v1/completions", `{"model":"m","prompt":[1,2,3]}`},
		{"/v1/chat/completions", `{"model":`}, // malformed: routed by fallback, proxied intact
		{"/other", `not json at all`},
	}
	for _, tc := range bodies {
		res, _ := post(t, tester.Client, tc.path, tc.body)
		if res.StatusCode != http.StatusOK {
			t.Errorf("POST %s: status %d", tc.path, res.StatusCode)
		}
	}
	// A chunked body (no Content-Length).
	req, _ := http.NewRequest(http.MethodPost, proxyURL+"/v1/chat/completions", io.MultiReader(strings.NewReader(chatBody("m", 50, false))))
	req.ContentLength = -1
	res, err := tester.Client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()

	got := a.received()
	want := append(bodies, struct{ path, body string }{"", chatBody("m", 50, false)})
	if len(got) != len(want) {
		t.Fatalf("upstream received %d bodies, want %d", len(got), len(want))
	}
	for i, w := range want {
		if !bytes.Equal(got[i], []byte(w.body)) {
			t.Errorf("body %d: upstream received %q, want %q", i, got[i], w.body)
		}
	}
	waitInflightZero(t, a.dial)
}

// TestRetryResendsFullBody: a POST whose first upstream drops the connection mid-request is retried
// (lb_retries + lb_retry_match) on the other upstream, which receives the complete body.
func TestRetryResendsFullBody(t *testing.T) {
	a, b := newBackend(t), newBackend(t)
	var dropped atomic.Int64
	drop := func(w http.ResponseWriter, r *http.Request, body []byte) {
		if dropped.Add(1) == 1 {
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				conn.Close()
			}
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"ok":true,"sha":"%x"}`, sha256.Sum256(body))
	}
	a.handle, b.handle = drop, drop
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm", "lb_retries 2\n\t\tlb_retry_match {\n\t\t\tmethod POST\n\t\t}", a, b), "caddyfile")

	body := chatBody("m", 3000, false)
	res, got := post(t, tester.Client, "/v1/chat/completions", body)
	if res.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", res.StatusCode, got)
	}
	if want := fmt.Sprintf(`"sha":"%x"`, sha256.Sum256([]byte(body))); !strings.Contains(got, want) {
		t.Errorf("retried upstream answered %s, want the hash of the full body %s", got, want)
	}
	if a.requests.Load() != 1 || b.requests.Load() != 1 {
		t.Errorf("requests: a=%d b=%d, want one each (the retry goes to the upstream not yet tried)", a.requests.Load(), b.requests.Load())
	}
	waitInflightZero(t, a.dial, b.dial)
}

// sseBackend streams n events, each only after the test has read the previous one through the proxy, so a
// proxy that buffered the stream would deadlock the test (and fail it on timeout).
func sseBackend(t *testing.T, n int, next chan struct{}) *backend {
	b := newBackend(t)
	b.handle = func(w http.ResponseWriter, r *http.Request, _ []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range n {
			fmt.Fprintf(w, "data: {\"i\":%d}\n\n", i)
			w.(http.Flusher).Flush()
			select {
			case <-next:
			case <-r.Context().Done():
				return
			}
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}
	return b
}

func TestStreamingPassesThroughUnbuffered(t *testing.T) {
	next := make(chan struct{})
	a := sseBackend(t, 3, next)
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm", "", a), "caddyfile")

	events := openStream(t, tester.Client, chatBody("m", 20, true))
	for i := range 3 {
		select {
		case ev := <-events:
			if want := fmt.Sprintf(`data: {"i":%d}`, i); ev != want {
				t.Fatalf("event %d = %q, want %q", i, ev, want)
			}
			if tokens, _ := loads.get(a.dial); tokens == 0 {
				t.Errorf("no tokens in flight while the stream is open")
			}
		case <-time.After(3 * time.Second):
			t.Fatalf("event %d did not arrive: the stream is buffered", i)
		}
		next <- struct{}{}
	}
	if ev := <-events; ev != "data: [DONE]" {
		t.Errorf("last event = %q", ev)
	}
	waitInflightZero(t, a.dial)
}

// openStream posts a streaming request through the proxy and returns its events; the stream is closed
// when the test ends.
func openStream(t *testing.T, client *http.Client, body string) <-chan string {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, proxyURL+"/v1/chat/completions", strings.NewReader(body))
	res, err := doReloadSafe(client, req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { res.Body.Close() })
	return readEvents(res.Body)
}

// readEvents sends each non-empty line of an SSE stream.
func readEvents(r io.Reader) <-chan string {
	out := make(chan string, 16)
	go func() {
		defer close(out)
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			if line := sc.Text(); line != "" {
				out <- line
			}
		}
	}()
	return out
}

// TestClientCancelMidStreamReleases: a client that goes away mid-stream releases its reservation.
func TestClientCancelMidStreamReleases(t *testing.T) {
	next := make(chan struct{})
	a := sseBackend(t, 1000, next)
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm", "", a), "caddyfile")

	for range 5 {
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, proxyURL+"/v1/chat/completions", strings.NewReader(chatBody("m", 20, true)))
		res, err := doReloadSafe(tester.Client, req)
		if err != nil {
			t.Fatal(err)
		}
		if ev := <-readEvents(res.Body); !strings.HasPrefix(ev, "data: ") {
			t.Fatalf("first event %q", ev)
		}
		if _, requests := loads.get(a.dial); requests != 1 {
			t.Errorf("requests in flight = %d during the stream, want 1", requests)
		}
		cancel()
		res.Body.Close()
		waitInflightZero(t, a.dial)
	}
}

// TestReloadWhileStreaming: a stream open across a config reload (POST /load) still releases exactly what
// it reserved, into the counters the new config reads.
func TestReloadWhileStreaming(t *testing.T) {
	next := make(chan struct{})
	a := sseBackend(t, 2, next)
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm", "", a), "caddyfile")

	events := openStream(t, tester.Client, chatBody("m", 20, true))
	<-events

	tester.InitServer(proxyConfig("llm {\n\t\t\tmode least_tokens\n\t\t}", "", a), "caddyfile")
	if tokens, requests := loads.get(a.dial); tokens == 0 || requests != 1 {
		t.Errorf("after reload: %d tokens, %d requests in flight, want the open stream's", tokens, requests)
	}
	next <- struct{}{}
	<-events
	next <- struct{}{}
	if ev := <-events; ev != "data: [DONE]" {
		t.Errorf("last event = %q", ev)
	}
	waitInflightZero(t, a.dial)
}

// TestNonLLMRequestsUseFallback: GETs and other paths are routed by the fallback policy and never fail.
func TestNonLLMRequestsUseFallback(t *testing.T) {
	a := newBackend(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm {\n\t\t\tfallback first\n\t\t}", "", a), "caddyfile")
	settle(t) // AssertGetResponse sends once: a reset by the previous config's server is not this test's subject
	tester.AssertGetResponse(proxyURL+"/v1/models", http.StatusOK, fmt.Sprintf(`{"id":"x","object":"chat.completion","upstream":%q}`, a.dial))
	res, _ := post(t, tester.Client, "/v1/rerank", `{"query":"x","documents":["y"]}`)
	if res.StatusCode != http.StatusOK {
		t.Errorf("POST /v1/rerank: status %d", res.StatusCode)
	}
	if _, requests := loads.get(a.dial); requests != 0 {
		t.Errorf("non-LLM requests were accounted: %d", requests)
	}
}

// TestOversizeBodyIsProxiedIntact: a body over max_body_size is not parsed but reaches the upstream whole.
func TestOversizeBodyIsProxiedIntact(t *testing.T) {
	a := newBackend(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(proxyConfig("llm {\n\t\t\tmax_body_size 1KiB\n\t\t}", "", a), "caddyfile")
	body := chatBody("m", 1000, false)
	for _, length := range []int64{int64(len(body)), -1} { // known length (not read at all), and chunked (read up to the cap)
		req, _ := http.NewRequest(http.MethodPost, proxyURL+"/v1/chat/completions", io.MultiReader(strings.NewReader(body)))
		req.ContentLength = length
		req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(io.MultiReader(strings.NewReader(body))), nil }
		res, err := doReloadSafe(tester.Client, req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			t.Errorf("length %d: status %d", length, res.StatusCode)
		}
	}
	for i, got := range a.received() {
		if string(got) != body {
			t.Errorf("body %d: upstream received %d bytes, want the %d sent", i, len(got), len(body))
		}
	}
	waitInflightZero(t, a.dial)
}
