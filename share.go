package caddyllm

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/tokenrouter/caddy-llm/share"
)

// shareWarmWait bounds how long Provision waits for the warm-up read from Redis, so that the first
// requests after a start already see what other instances learned; an unreachable Redis costs at most
// this much at start and never fails it.
const shareWarmWait = 2 * time.Second

// ShareConfig configures sharing learned routes and pins between instances through Redis, and handing a
// starting instance the others' learned service models (see package share for the design, the bytes on
// the wire and the behaviour when Redis is down).
type ShareConfig struct {
	// URL of the Redis server: redis://[user:pass@]host:port/db, or rediss:// for TLS. Placeholders such
	// as {env.REDIS_URL} are replaced. Required.
	URL string `json:"url,omitempty"`

	// Prefix starts every Redis key used, so several clusters can share one Redis: instances share
	// exactly when they use the same Redis and prefix. Default "caddy-llm:".
	Prefix string `json:"prefix,omitempty"`

	// FlushInterval is how often what was learned is published, as one batch. Default 100ms.
	FlushInterval caddy.Duration `json:"flush_interval,omitempty"`

	// MaxBatch is the most changes published per flush interval; beyond it changes are dropped and
	// counted. Default 2048 (at 100ms: at most ~225 KB/s per instance).
	MaxBatch int `json:"max_batch,omitempty"`

	url string // URL with placeholders replaced
}

func (c *ShareConfig) provision() error {
	c.url = caddy.NewReplacer().ReplaceKnown(c.URL, "")
	if c.url == "" {
		return errors.New("share: a redis URL is required")
	}
	if err := share.ParseURL(c.url); err != nil {
		return fmt.Errorf("share: parsing redis URL %s: %w", share.Redact(c.url), err)
	}
	if c.Prefix == "" {
		c.Prefix = share.DefaultPrefix
	}
	if c.FlushInterval < 0 || c.MaxBatch < 0 {
		return fmt.Errorf("share: flush_interval and max_batch must be positive")
	}
	return nil
}

func (c *ShareConfig) id() string { return c.url + "\x00" + c.Prefix }

// configureShareLocked starts sharing, or restarts it when the Redis URL or prefix changed. Must hold
// st.mu.
func (st *tableState) configureShareLocked(sc *ShareConfig) {
	if st.sharer != nil {
		if st.shareID == sc.id() {
			return
		}
		st.sharer.Close()
		st.sharer = nil
	}
	sharer, err := share.Start(st.table, share.Config{
		URL:           sc.url,
		Prefix:        sc.Prefix,
		FlushInterval: time.Duration(sc.FlushInterval),
		MaxBatch:      sc.MaxBatch,
		Logger:        st.logger,
		OnConnected: func(up bool) {
			if up {
				shareConnected.Set(1)
			} else {
				shareConnected.Set(0)
			}
		},
		Models:     loads.sharedModels,
		PeerModels: func(blobs [][]byte) { loads.restorePeerModels(blobs, st.logger) },
	})
	if err != nil { // unreachable: provision parsed the URL
		st.logger.Error("share: not started", zap.Error(err))
		return
	}
	st.sharer, st.shareID = sharer, sc.id()
	ctx, cancel := context.WithTimeout(context.Background(), shareWarmWait)
	defer cancel()
	if !sharer.WaitWarm(ctx) {
		st.logger.Warn("share: redis did not answer in time; starting with local state", zap.Duration("waited", shareWarmWait))
	}
}

// parseShare reads the Caddyfile option:
//
//	share <redis-url> {
//		prefix         <key prefix>
//		flush_interval <duration>
//		max_batch      <changes>
//	}
func (s *stateConfig) parseShare(d *caddyfile.Dispenser) error {
	if s.Share != nil {
		return d.Err("share already specified")
	}
	if !d.NextArg() {
		return d.ArgErr()
	}
	s.Share = &ShareConfig{URL: d.Val()}
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		option := d.Val()
		val, err := oneArg(d)
		if err != nil {
			return err
		}
		switch option {
		case "prefix":
			s.Share.Prefix = val
		case "flush_interval":
			s.Share.FlushInterval, err = parseDuration(d, option, val)
		case "max_batch":
			s.Share.MaxBatch, err = parseCount(d, option, val)
		default:
			return d.Errf("unrecognized share option '%s'", option)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// Collectors of persistence and sharing, registered like the others in metrics.go.
var (
	shareConnected = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "llm", Name: "share_connected",
		Help: "1 while the connection to the Redis used to share learned routes is up, 0 while it is down.",
	})
	snapshotBytes = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "llm", Name: "persist_snapshot_bytes",
		Help: "Size of the last snapshot of learned routes and pins written to storage.",
	})
)

func registerStateMetrics(ctx caddy.Context) error {
	registry := ctx.GetMetricsRegistry()
	if registry == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{shareConnected, snapshotBytes} {
		if err := registry.Register(c); err != nil {
			var already prometheus.AlreadyRegisteredError
			if !errors.As(err, &already) {
				return err
			}
		}
	}
	return nil
}

// sharedModels is what this instance publishes beside its routes: its upstreams' learned service models,
// as persist stores them; nil while none has learned anything.
func (t *loadTable) sharedModels() []byte {
	models := t.learnedModels()
	if len(models) == 0 {
		return nil
	}
	file, _ := encodeModels(models)
	return file
}

// restorePeerModels gives the upstreams this instance has not learned anything about yet the models other
// instances published (newest first: the newest instance's model of an upstream wins), so that a new
// instance beside running ones prices every upstream at its known speed from its first request.
func (t *loadTable) restorePeerModels(newestFirst [][]byte, logger *zap.Logger) {
	restored := 0
	var problems []string
	for _, blob := range newestFirst {
		// A peer's model of a backend that restarted since loses its slots; the peer's routes are its
		// own to forget when it scrapes the restart.
		n, _, problem := t.restoreModels(blob)
		restored += n
		if problem != "" {
			problems = append(problems, problem)
		}
	}
	if restored > 0 {
		logger.Info("share: restored service models from other instances", zap.Int("upstreams", restored), zap.Int("instances", len(newestFirst)))
	}
	if len(problems) > 0 {
		logger.Warn("share: some service models of other instances not restored", zap.String("problem", strings.Join(problems, "; ")))
	}
}
