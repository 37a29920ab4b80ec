package caddyllm

import (
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/tokenrouter/caddy-llm/scraper"
)

// MetricsConfig turns on scraping of each upstream's Prometheus /metrics (vLLM and SGLang names) so that
// load this proxy cannot see itself - other clients, other proxies - enters the routing decision.
type MetricsConfig struct {
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
	// RequestTokens is how many tokens one request the backend has beyond this proxy's own counts as.
	// Default: the mean weight of this proxy's requests in flight, or 1024 when there are none.
	RequestTokens int64 `json:"request_tokens,omitempty"`
	// KVThreshold and KVWeight: above KVThreshold (0-1) KV-cache usage, up to KVWeight tokens are added to
	// an upstream's load, in proportion, because it is about to queue or preempt. Defaults 0.9 and 8192.
	KVThreshold float64 `json:"kv_threshold,omitempty"`
	KVWeight    int64   `json:"kv_weight,omitempty"`
}

const (
	defaultRequestTokens     = 1024
	defaultKVThreshold       = 0.9
	defaultKVWeight          = 8192
	defaultSaturationBackoff = 2 * time.Second
)

func (m *MetricsConfig) provision() {
	if m.Scheme == "" {
		m.Scheme = "http"
	}
	if m.Path == "" {
		m.Path = "/metrics"
	}
	if m.KVThreshold == 0 {
		m.KVThreshold = defaultKVThreshold
	}
	if m.KVWeight == 0 {
		m.KVWeight = defaultKVWeight
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
	return h.Load()
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
	h := scraper.Default.Acquire(t, sc.opts)
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

// extraLoad converts an upstream's scraped metrics into tokens of load this proxy does not see: the
// requests the backend has beyond this proxy's own (waiting ones counted twice: they must be prefilled
// before anything new starts), plus a KV-pressure term once usage passes the threshold.
func (m *MetricsConfig) extraLoad(s scraper.Snapshot, ownRequests int64, requestTokens int64) int64 {
	foreign := max(s.Running+s.Waiting-float64(ownRequests), 0)
	load := (foreign + s.Waiting) * float64(requestTokens)
	if s.KVUsage > m.KVThreshold {
		load += (s.KVUsage - m.KVThreshold) / (1 - m.KVThreshold) * float64(m.KVWeight)
	}
	return int64(load)
}
