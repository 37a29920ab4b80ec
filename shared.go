package caddyllm

import (
	"fmt"
	"net"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/selection"
)

// Process-wide state that outlives a config: the in-flight accounting and service models (loads, in
// accounting.go, keyed by dial address), the scrapers (scraper.Default) and the learned route tables
// here. Each is shared by every policy that uses it and survives reloads.

// routeTables holds one learned route table per distinct table configuration (block size, capacity,
// TTL), so two pools with different settings never overwrite each other's, and two policies with the
// same settings share one. Each Provision takes a reference (LoadOrNew) and each Cleanup drops exactly
// one (Delete); a reload provisions the new config before cleaning up the old, so a table in use
// throughout keeps its routes.
var routeTables = caddy.NewUsagePool()

type routeTable struct{ *affinity.Table }

func (routeTable) Destruct() error { return nil }

func routesKeyOf(cfg affinity.Config) string {
	return fmt.Sprintf("block=%d capacity=%d ttl=%s", cfg.BlockSize, cfg.Capacity, cfg.TTL)
}

func acquireRoutes(cfg affinity.Config) (*affinity.Table, string, error) {
	key := routesKeyOf(cfg)
	v, _, err := routeTables.LoadOrNew(key, func() (caddy.Destructor, error) {
		return routeTable{affinity.New(cfg)}, nil
	})
	if err != nil {
		return nil, "", fmt.Errorf("route table: %w", err)
	}
	return v.(routeTable).Table, key, nil
}

func releaseRoutes(key string) { _, _ = routeTables.Delete(key) }

// allRoutes returns every route table in use, in no particular order.
func allRoutes() []*affinity.Table {
	var out []*affinity.Table
	routeTables.Range(func(_, v any) bool {
		out = append(out, v.(routeTable).Table)
		return true
	})
	return out
}

// scaledPrior is the service prior of an upstream with the given relative capacity: every time in it,
// the mean duration of a request included, is that many times shorter.
func scaledPrior(capacity float64) selection.Service {
	p := selection.Prior
	p.Overhead /= capacity
	p.PrefillSecondsPerToken /= capacity
	p.TokenSeconds /= capacity
	p.MeanDuration /= capacity
	return p
}

// staticUpstreams returns the dial addresses of the reverse_proxy handler provisioning this policy (its
// parent module), without placeholders: they can be scraped and reported before the first request.
func staticUpstreams(ctx caddy.Context) []string {
	h := proxyHandler(ctx)
	if h == nil {
		return nil
	}
	var out []string
	for _, u := range h.Upstreams {
		if u == nil || strings.Contains(u.Dial, "{") {
			continue
		}
		if _, _, err := net.SplitHostPort(u.Dial); err == nil {
			out = append(out, u.Dial)
		}
	}
	return out
}

// proxyHandler is the reverse_proxy handler ctx provisions a module for: the nearest in its ancestry (a
// reverse_proxy inside another's handle_response routes has its own); nil outside one.
func proxyHandler(ctx caddy.Context) *reverseproxy.Handler {
	mods := ctx.Modules()
	for i := len(mods) - 1; i >= 0; i-- {
		if h, ok := mods[i].(*reverseproxy.Handler); ok {
			return h
		}
	}
	return nil
}
