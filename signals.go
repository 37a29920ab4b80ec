package caddyllm

import (
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"golang.org/x/net/http/httpguts"

	"github.com/tokenrouter/caddy-llm/scraper"
)

// MetricsConfig turns on scraping of each upstream's Prometheus /metrics (vLLM, SGLang, llama.cpp,
// NVIDIA NIM and TGI names) so that load this proxy cannot see itself - other clients, other proxies - enters
// the routing decision.
type MetricsConfig struct {
	// Off turns scraping off (Caddyfile `metrics off`): routing uses this proxy's own signals only.
	Off bool `json:"off,omitempty"`
	// Scheme of the metrics URL. Default https when the reverse_proxy's transport (http or llm) uses TLS
	// and the metrics are on the upstreams' own port (Port unset), else http. Scrapes over https use
	// that transport's TLS settings (its trust pool, client certificate, tls_insecure_skip_verify,
	// tls_server_name), as the proxied requests do.
	Scheme string `json:"scheme,omitempty"`
	// Port of the metrics endpoint; default the upstream's own port. An upstream on a unix socket
	// (`unix//run/vllm.sock`) is scraped through its socket and takes no port.
	Port string `json:"port,omitempty"`
	// Path of the metrics endpoint. Default /metrics.
	Path string `json:"path,omitempty"`
	// Interval between scrapes of one upstream. Default 1s.
	Interval caddy.Duration `json:"interval,omitempty"`
	// Timeout of one scrape. Default 500ms (never more than the interval).
	Timeout caddy.Duration `json:"timeout,omitempty"`
	// StaleAfter is the age after which scraped values are ignored (routing falls back to this proxy's own
	// counters). Default 5 intervals.
	StaleAfter caddy.Duration `json:"stale_after,omitempty"`
	// Model filters series by their model_name label. Default: all models.
	Model string `json:"model,omitempty"`
	// Headers are sent with every scrape, for a /metrics behind authentication (a key checked by an
	// auth proxy, or by a server that guards /metrics with its API key). Values may use global
	// placeholders such as {env.METRICS_TOKEN}, replaced once at provisioning; they are never logged.
	Headers http.Header `json:"headers,omitempty"`
	// RequestTokens, KVThreshold and KVWeight are accepted for old configs and ignored: a backend's
	// queue and KV pressure now show as its waiting requests and the slot count it runs at.
	RequestTokens int64   `json:"request_tokens,omitempty"`
	KVThreshold   float64 `json:"kv_threshold,omitempty"`
	KVWeight      int64   `json:"kv_weight,omitempty"`

	// upstreamTLS is the TLS client configuration of the reverse_proxy's transport; nil when it uses none.
	upstreamTLS *tls.Config
}

const defaultSaturationBackoff = 2 * time.Second

func (m *MetricsConfig) provision() {
	if len(m.Headers) > 0 {
		repl := caddy.NewReplacer()
		headers := make(http.Header, len(m.Headers))
		for field, values := range m.Headers {
			for _, v := range values {
				headers.Add(field, repl.ReplaceKnown(v, ""))
			}
		}
		m.Headers = headers
	}
	if m.Scheme == "" {
		m.Scheme = "http"
		if m.upstreamTLS != nil && m.Port == "" {
			m.Scheme = "https" // the port the proxied requests use TLS on
		}
	}
	if m.Path == "" {
		m.Path = "/metrics"
	}
}

func (m *MetricsConfig) validate() error {
	switch {
	case m.Scheme != "http" && m.Scheme != "https":
		return fmt.Errorf("metrics scheme must be http or https, got %q", m.Scheme)
	case !strings.HasPrefix(m.Path, "/"):
		return fmt.Errorf("metrics path must start with /, got %q", m.Path)
	case m.Interval < 0 || m.Timeout < 0 || m.StaleAfter < 0:
		return fmt.Errorf("metrics durations must be positive")
	case m.KVThreshold < 0 || m.KVThreshold >= 1:
		return fmt.Errorf("metrics kv_threshold must be in [0, 1), got %g", m.KVThreshold)
	case m.KVWeight < 0 || m.RequestTokens < 0:
		return fmt.Errorf("metrics weights must be positive")
	}
	for field, values := range m.Headers {
		if !httpguts.ValidHeaderFieldName(field) {
			return fmt.Errorf("metrics header name %q is not a valid HTTP header name", field)
		}
		for _, v := range values {
			if !httpguts.ValidHeaderFieldValue(v) {
				return fmt.Errorf("metrics header %s: the value is not a valid HTTP header value", field)
			}
		}
	}
	return nil
}

// target is the metrics URL of an upstream dialled at dial. An upstream on a unix socket
// (`unix//run/vllm.sock`) serves its metrics on that socket.
func (m *MetricsConfig) target(dial string) (scraper.Target, error) {
	if strings.Contains(dial, "{") {
		// Global placeholders ({env.VLLM_HOST}:8000) are what Caddy dials; those of a request it
		// resolves per request, and nothing can scrape.
		if dial = caddy.NewReplacer().ReplaceKnown(dial, ""); strings.Contains(dial, "{") {
			return scraper.Target{}, fmt.Errorf("metrics target for %s: the address has placeholders known only per request", dial)
		}
	}
	if network, socket, ok := strings.Cut(dial, "/"); ok && caddy.IsUnixNetwork(network) {
		if m.Port != "" {
			return scraper.Target{}, fmt.Errorf("metrics target for %s: metrics port %s does not apply to an upstream on a unix socket, whose metrics are on its socket", dial, m.Port)
		}
		u := url.URL{Scheme: m.Scheme, Host: "localhost", Path: m.Path}
		return scraper.Target{URL: u.String(), Model: m.Model, Socket: socket}, nil
	}
	host, port, err := net.SplitHostPort(dial)
	if err != nil {
		return scraper.Target{}, fmt.Errorf("metrics target for %s: %w", dial, err)
	}
	if m.Port != "" {
		port = m.Port
	}
	u := url.URL{Scheme: m.Scheme, Host: net.JoinHostPort(host, port), Path: m.Path}
	return scraper.Target{URL: u.String(), Model: m.Model}, nil
}

// scrapes holds one policy instance's handles on the process-global scraper registry, one per upstream,
// taken when the upstream is first seen by Select and released by Cleanup, or once the upstream has been
// out of the policy's decisions for forgetAfter while they went on (a dynamic upstream the source no
// longer lists: its scrapes stop, and its slot among maxScrapeTargets frees). The registry runs one poll
// goroutine per target however many configs and policies hold it, so a reload keeps the goroutine (the
// new config takes its handle before the old one releases).
type scrapes struct {
	cfg     *MetricsConfig
	opts    scraper.Options
	mu      sync.RWMutex
	handles map[string]*scrapeEntry // by dial
	closed  bool
	logger  *zap.Logger
	// lastCheck (unix nanoseconds) is when an upstream that never answered was last checked.
	lastCheck atomic.Int64
	// latest (unix nanoseconds) is when any upstream was last in a decision, as far as scrapeEntry.seen
	// records it; lastForget is when entries were last checked for forgetting.
	latest, lastForget atomic.Int64
	now                func() time.Time
	forgetAfter        time.Duration
	// transport sends the scrapes when they use the reverse_proxy's TLS settings or headers of their
	// own; nil otherwise (the scraper's own clients send them). socketClients are its copies that dial
	// the unix socket of an upstream on one, by socket path (guarded by mu; as many as the config names:
	// dynamic sources give addresses, not sockets).
	transport     *http.Transport
	socketClients map[string]*http.Client
}

// scrapeEntry is one upstream's handle (nil: the dial has no valid target, or its metrics were found
// unusable) and when the upstream was last in a decision, to the second (unix nanoseconds). Replaced,
// never changed, but for seen.
type scrapeEntry struct {
	h    *scraper.Handle
	seen atomic.Int64
}

// maxScrapeTargets bounds the handles one policy takes (dynamic upstreams could name endless addresses).
const maxScrapeTargets = 1024

// scrapeForgetAfter is how long an upstream may be out of every decision of a policy that goes on
// deciding before the policy stops scraping it: the time a dynamic upstream source (Caddy's `dynamic a`,
// `srv`, `multi`) can have dropped it. Candidates are the available upstreams, so one that passive
// health checks keep out that long is released too, and scraped again from its next decision.
const scrapeForgetAfter = 10 * time.Minute

func newScrapes(cfg *MetricsConfig, logger *zap.Logger) *scrapes {
	sc := &scrapes{
		cfg: cfg,
		opts: scraper.Options{
			Interval:   time.Duration(cfg.Interval),
			Timeout:    time.Duration(cfg.Timeout),
			StaleAfter: time.Duration(cfg.StaleAfter),
			Logger:     logger,
		},
		handles:     make(map[string]*scrapeEntry),
		logger:      logger,
		now:         time.Now,
		forgetAfter: scrapeForgetAfter,
	}
	withTLS := cfg.Scheme == "https" && cfg.upstreamTLS != nil
	if withTLS || len(cfg.Headers) > 0 {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.Proxy = nil // as the scraper's own clients: metrics are fetched directly
		tr.MaxIdleConnsPerHost = 1
		if withTLS {
			tr.TLSClientConfig = cfg.upstreamTLS
		}
		sc.transport = tr
		sc.opts.Client = sc.clientFor(tr)
	}
	return sc
}

// clientFor is the client that sends scrapes through tr, with the configured headers.
func (sc *scrapes) clientFor(tr *http.Transport) *http.Client {
	if len(sc.cfg.Headers) > 0 {
		return &http.Client{Transport: headerTransport{base: tr, headers: sc.cfg.Headers}}
	}
	return &http.Client{Transport: tr}
}

// socketClient returns the policy's own client made to dial socket, one per socket. sc.mu must be held.
func (sc *scrapes) socketClient(socket string) *http.Client {
	if c, ok := sc.socketClients[socket]; ok {
		return c
	}
	tr := sc.transport.Clone()
	tr.DialContext = scraper.DialSocket(socket)
	c := sc.clientFor(tr)
	if sc.socketClients == nil {
		sc.socketClients = make(map[string]*http.Client)
	}
	sc.socketClients[socket] = c
	return c
}

// headerTransport adds headers to every request it sends through base.
type headerTransport struct {
	base    *http.Transport
	headers http.Header
}

// CloseIdleConnections closes base's idle connections (http.Client.CloseIdleConnections calls it).
func (t headerTransport) CloseIdleConnections() { t.base.CloseIdleConnections() }

func (t headerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context()) // a RoundTripper must not change the request it is given
	for field, values := range t.headers {
		req.Header[field] = values
	}
	return t.base.RoundTrip(req)
}

// upstreamTLS returns a copy of the TLS client configuration of the transport of the reverse_proxy
// that ctx provisions a policy for (the http transport, or transport llm, which embeds it), made for
// HTTP/1.1 scrapes; nil when that transport uses no TLS. The transport is provisioned before the
// policy (reverseproxy.Handler.Provision).
func upstreamTLS(ctx caddy.Context) *tls.Config {
	h := proxyHandler(ctx)
	if h == nil {
		return nil
	}
	var ht *reverseproxy.HTTPTransport
	switch t := h.Transport.(type) {
	case *reverseproxy.HTTPTransport:
		ht = t
	case *LLMTransport:
		ht = &t.HTTPTransport
	}
	if ht == nil || !ht.TLSEnabled() || ht.Transport == nil || ht.Transport.TLSClientConfig == nil {
		return nil
	}
	c := ht.Transport.TLSClientConfig.Clone()
	c.NextProtos = nil // the scraper's client speaks HTTP/1.1
	if strings.Contains(c.ServerName, "{") {
		c.ServerName = "" // a per-request placeholder: verify the upstream's own host name
	}
	return c
}

// load returns the fresh snapshot of dial's metrics, starting to scrape it on first use. Each call notes
// dial as in a decision.
func (sc *scrapes) load(dial string) (scraper.Snapshot, bool) {
	snap, fresh, _ := sc.loadAwaited(dial, sc.now().UnixNano())
	return snap, fresh
}

// loadAwaited is load at the decision's time now (unix nanoseconds), and whether dial's first good
// scrape is still awaited: the policy scrapes it, none has succeeded yet, and its metrics have not been
// found unusable. A decision reads the clock once for all its upstreams: at 16 upstreams, reading it in
// here for each was 7% of the decision's time.
func (sc *scrapes) loadAwaited(dial string, now int64) (snap scraper.Snapshot, fresh, awaited bool) {
	e := sc.entry(dial)
	if e == nil {
		e = sc.acquire(dial)
		if e == nil {
			return scraper.Snapshot{}, false, false
		}
	}
	sc.touch(e, now)
	if e.h == nil {
		return scraper.Snapshot{}, false, false
	}
	snap, fresh = e.h.LoadAt(time.Unix(0, now))
	if !snap.At.IsZero() {
		return snap, fresh, false
	}
	return snap, fresh, !(sc.checkDue(now) && sc.checkUsable(dial, e))
}

// kick asks for dial's next scrape sooner than the interval (scraper.Handle.Kick), if the policy
// scrapes it.
func (sc *scrapes) kick(dial string) {
	if e := sc.entry(dial); e != nil && e.h != nil {
		e.h.Kick()
	}
}

// entry returns dial's entry, nil when the policy does not scrape it (yet).
func (sc *scrapes) entry(dial string) *scrapeEntry {
	sc.mu.RLock()
	defer sc.mu.RUnlock()
	return sc.handles[dial]
}

// peek returns dial's snapshot at now (unix nanoseconds) and whether it is fresh, if the policy scrapes
// it: a second reader of the decision's snapshots (the LoRA signal) after load, which notes dial as in
// the decision and starts its scrapes.
func (sc *scrapes) peek(dial string, now int64) (scraper.Snapshot, bool) {
	e := sc.entry(dial)
	if e == nil || e.h == nil {
		return scraper.Snapshot{}, false
	}
	return e.h.LoadAt(time.Unix(0, now))
}

// touch records that e's upstream is in a decision at now (unix nanoseconds), to the second: the hot
// path pays two atomic loads, and a store and a check for forgotten upstreams at most once a second per
// upstream.
func (sc *scrapes) touch(e *scrapeEntry, now int64) {
	if now-e.seen.Load() < int64(time.Second) {
		return
	}
	e.seen.Store(now)
	prev := sc.latest.Load()
	if now > prev {
		sc.latest.CompareAndSwap(prev, now) // lost to a concurrent touch: that one is as recent
	}
	if last := sc.lastForget.Load(); now-last >= int64(time.Second) && sc.lastForget.CompareAndSwap(last, now) {
		sc.forget(prev)
	}
}

// forget releases the handles of upstreams that were out of every decision for forgetAfter before
// latest, the last decision before this one, and drops their entries: measured against the decisions
// before, not the clock, so a policy that was idle for an hour keeps scraping its pool. O(upstreams)
// under the write lock, at most once a second.
func (sc *scrapes) forget(latest int64) {
	var gone []*scraper.Handle
	sc.mu.Lock()
	for dial, e := range sc.handles {
		if out := latest - e.seen.Load(); out > int64(sc.forgetAfter) {
			delete(sc.handles, dial)
			if e.h != nil {
				gone = append(gone, e.h)
			}
			sc.logger.Debug("stopped scraping an upstream out of the pool", zap.String("upstream", dial),
				zap.Duration("out_for", time.Duration(out)))
		}
	}
	sc.mu.Unlock()
	releaseLater(gone...)
}

// releaseLater releases handles on a goroutine of its own, off the request path: Release waits for a
// poller's goroutine to stop.
func releaseLater(handles ...*scraper.Handle) {
	if len(handles) == 0 {
		return
	}
	go func() {
		for _, h := range handles {
			h.Release()
		}
	}()
}

// checkDue reports whether, at now (unix nanoseconds), it is time for one more check of an upstream
// whose metrics never answered: once a second per policy, so the hot path pays one atomic load otherwise.
func (sc *scrapes) checkDue(now int64) bool {
	last := sc.lastCheck.Load()
	return now-last >= int64(time.Second) && sc.lastCheck.CompareAndSwap(last, now)
}

// dropUnusable checks dial now (the admin report calls it, off the request path).
func (sc *scrapes) dropUnusable(dial string) {
	e := sc.entry(dial)
	if e == nil || e.h == nil {
		return
	}
	if snap, _ := e.h.Load(); snap.At.IsZero() {
		sc.checkUsable(dial, e)
	}
}

// unusableAfter is how many failed scrapes, with none good, show that an upstream has no usable metrics.
const unusableAfter = 3

// checkUsable stops scraping dial, saying so once in the log, when its metrics never answered usefully
// (404, not Prometheus text, no load gauge it knows: a generic OpenAI-compatible server). Routing there goes
// on with this proxy's own signals, and reports whether it did. Called only while no scrape of dial has
// succeeded.
func (sc *scrapes) checkUsable(dial string, e *scrapeEntry) bool {
	t, err := sc.cfg.target(dial)
	if err != nil {
		return false
	}
	st, ok := scraper.Default.Status(t)
	if !ok || st.Errors < unusableAfter || !st.Snapshot.At.IsZero() {
		return false
	}
	sc.mu.Lock()
	if sc.handles[dial] != e {
		sc.mu.Unlock()
		return false
	}
	unusable := new(scrapeEntry)
	unusable.seen.Store(e.seen.Load())
	sc.handles[dial] = unusable
	sc.mu.Unlock()
	releaseLater(e.h)
	sc.logger.Info("upstream has no usable metrics; routing it on this proxy's own signals",
		zap.String("upstream", dial), zap.String("metrics_url", t.String()), zap.String("last_error", st.LastError),
		zap.String("hint", "without metrics the policy cannot see this upstream's queue and bounds its share of requests in flight; enable the server's Prometheus metrics (vLLM, SGLang with --enable-metrics, llama-server --metrics, NIM, TGI)"))
	return true
}

// acquire returns dial's entry, taking a handle on its scrapes if it has none; nil when the policy holds
// maxScrapeTargets or is released.
func (sc *scrapes) acquire(dial string) *scrapeEntry {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if e, seen := sc.handles[dial]; seen || sc.closed || len(sc.handles) >= maxScrapeTargets {
		return e
	}
	e := new(scrapeEntry)
	sc.handles[dial] = e
	t, err := sc.cfg.target(dial)
	if err != nil {
		sc.logger.Warn("not scraping upstream", zap.String("upstream", dial), zap.Error(err))
		return e
	}
	opts := sc.opts
	if t.Socket != "" && sc.transport != nil {
		opts.Client = sc.socketClient(t.Socket)
	}
	// Every scrape teaches the upstream's load and service model as it arrives: read only at decisions,
	// a scrape taken while no request was routed taught nothing (a backend another client keeps full
	// showed its slot count only to the requests that came after it).
	opts.OnScrape = func(snap scraper.Snapshot) { loads.observeScrape(dial, &snap) }
	e.h = scraper.Default.Acquire(t, opts)
	return e
}

// status returns the scrape status of dial, if this policy scrapes it.
func (sc *scrapes) status(dial string) (scraper.Status, bool) {
	t, err := sc.cfg.target(dial)
	if err != nil {
		return scraper.Status{}, false
	}
	return scraper.Default.Status(t)
}

// release drops every handle; the registry stops a target's goroutine when no config holds it.
func (sc *scrapes) release() {
	sc.mu.Lock()
	handles := sc.handles
	sc.handles = nil
	sc.closed = true
	sockets := sc.socketClients
	sc.mu.Unlock()
	for _, e := range handles {
		if e.h != nil {
			e.h.Release()
		}
	}
	if sc.transport != nil {
		sc.transport.CloseIdleConnections() // a newer config scrapes with a client of its own
	}
	for _, c := range sockets {
		c.CloseIdleConnections()
	}
}
