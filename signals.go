package caddyllm

import (
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/tokenrouter/caddy-llm/scraper"
)

// MetricsConfig turns on scraping of each upstream's Prometheus /metrics (vLLM and SGLang names) so that
// load this proxy cannot see itself - other clients, other proxies - enters the routing decision.
type MetricsConfig struct {
	// Off turns scraping off (Caddyfile `metrics off`): routing uses this proxy's own signals only.
	Off bool `json:"off,omitempty"`
	// Scheme of the metrics URL. Default http.
	Scheme string `json:"scheme,omitempty"`
	// Port of the metrics endpoint; default the upstream's own port.
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
	// RequestTokens, KVThreshold and KVWeight are accepted for old configs and ignored: a backend's
	// queue and KV pressure now show as its waiting requests and the slot count it runs at.
	RequestTokens int64   `json:"request_tokens,omitempty"`
	KVThreshold   float64 `json:"kv_threshold,omitempty"`
	KVWeight      int64   `json:"kv_weight,omitempty"`
}

const defaultSaturationBackoff = 2 * time.Second

func (m *MetricsConfig) provision() {
	if m.Scheme == "" {
		m.Scheme = "http"
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
	return nil
}

// target is the metrics URL of an upstream dialled at dial.
func (m *MetricsConfig) target(dial string) (scraper.Target, error) {
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
// taken when the upstream is first seen by Select and all released by Cleanup. The registry runs one poll
// goroutine per target however many configs and policies hold it, so a reload keeps the goroutine (the new
// config takes its handle before the old one releases).
type scrapes struct {
	cfg     *MetricsConfig
	opts    scraper.Options
	mu      sync.RWMutex
	handles map[string]*scraper.Handle // by dial; nil value: the dial has no valid target
	closed  bool
	logger  *zap.Logger
	// lastCheck (unix nanoseconds) is when an upstream that never answered was last checked.
	lastCheck atomic.Int64
}

// maxScrapeTargets bounds the handles one policy takes (dynamic upstreams could name endless addresses).
const maxScrapeTargets = 1024

func newScrapes(cfg *MetricsConfig, logger *zap.Logger) *scrapes {
	return &scrapes{
		cfg: cfg,
		opts: scraper.Options{
			Interval:   time.Duration(cfg.Interval),
			Timeout:    time.Duration(cfg.Timeout),
			StaleAfter: time.Duration(cfg.StaleAfter),
			Logger:     logger,
		},
		handles: make(map[string]*scraper.Handle),
		logger:  logger,
	}
}

// load returns the fresh snapshot of dial's metrics, starting to scrape it on first use.
func (sc *scrapes) load(dial string) (scraper.Snapshot, bool) {
	sc.mu.RLock()
	h, seen := sc.handles[dial]
	sc.mu.RUnlock()
	if !seen {
		h = sc.acquire(dial)
	}
	if h == nil {
		return scraper.Snapshot{}, false
	}
	snap, fresh := h.Load()
	if snap.At.IsZero() && sc.checkDue() {
		sc.checkUsable(dial, h)
	}
	return snap, fresh
}

// checkDue reports whether it is time for one more check of an upstream whose metrics never answered:
// once a second per policy, so the hot path pays one atomic load otherwise.
func (sc *scrapes) checkDue() bool {
	now := time.Now().UnixNano()
	last := sc.lastCheck.Load()
	return now-last >= int64(time.Second) && sc.lastCheck.CompareAndSwap(last, now)
}

// dropUnusable checks dial now (the admin report calls it, off the request path).
func (sc *scrapes) dropUnusable(dial string) {
	sc.mu.RLock()
	h := sc.handles[dial]
	sc.mu.RUnlock()
	if h == nil {
		return
	}
	if snap, _ := h.Load(); snap.At.IsZero() {
		sc.checkUsable(dial, h)
	}
}

// unusableAfter is how many failed scrapes, with none good, show that an upstream has no usable metrics.
const unusableAfter = 3

// checkUsable stops scraping dial, saying so once in the log, when its metrics never answered usefully
// (404, not Prometheus text, not vLLM or SGLang: a generic OpenAI-compatible server). Routing there goes
// on with this proxy's own signals. Called only while no scrape of dial has succeeded.
func (sc *scrapes) checkUsable(dial string, h *scraper.Handle) {
	t, err := sc.cfg.target(dial)
	if err != nil {
		return
	}
	st, ok := scraper.Default.Status(t)
	if !ok || st.Errors < unusableAfter || !st.Snapshot.At.IsZero() {
		return
	}
	sc.mu.Lock()
	if sc.handles[dial] != h {
		sc.mu.Unlock()
		return
	}
	sc.handles[dial] = nil
	sc.mu.Unlock()
	h.Release()
	sc.logger.Info("upstream has no usable metrics; routing it on this proxy's own signals",
		zap.String("upstream", dial), zap.String("metrics_url", t.URL), zap.String("last_error", st.LastError),
		zap.String("hint", "without metrics, add transport llm so the policy sees each first token and the queue behind it"))
}

func (sc *scrapes) acquire(dial string) *scraper.Handle {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if h, seen := sc.handles[dial]; seen || sc.closed || len(sc.handles) >= maxScrapeTargets {
		return h
	}
	t, err := sc.cfg.target(dial)
	if err != nil {
		sc.logger.Warn("not scraping upstream", zap.String("upstream", dial), zap.Error(err))
		sc.handles[dial] = nil
		return nil
	}
	opts := sc.opts
	// Every scrape teaches the upstream's load and service model as it arrives: read only at decisions,
	// a scrape taken while no request was routed taught nothing (a backend another client keeps full
	// showed its slot count only to the requests that came after it).
	opts.OnScrape = func(snap scraper.Snapshot) { loads.observeScrape(dial, &snap) }
	h := scraper.Default.Acquire(t, opts)
	sc.handles[dial] = h
	return h
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
	sc.mu.Unlock()
	for _, h := range handles {
		if h != nil {
			h.Release()
		}
	}
}
