package affinity

import "time"

// RouteRecord is one learned route in portable form, for snapshotting a Table to storage or sharing it
// between instances. Key is RouteKey(ModelHash(model), boundary hash): both hashes use fixed seeds, so the
// same prefix has the same Key in every process and an imported route matches the importer's traffic.
type RouteRecord struct {
	Key       uint64
	Upstreams []UpstreamSeen // most recently learned first
}

// UpstreamSeen is one upstream of a RouteRecord and when it was last learned for that route.
type UpstreamSeen struct {
	Upstream string
	LastSeen time.Time
}

// Export returns the routes learned here (not those known only from peers) whose newest entry is within TTL, least recently learned first (so that
// importing them in order reproduces the LRU order), with expired entries left out. It allocates the
// whole snapshot and holds the shared lock for O(routes); meant for occasional snapshots, not the hot path.
func (t *Table) Export() []RouteRecord {
	t.mu.RLock()
	defer t.mu.RUnlock()
	now := t.cfg.Now().UnixNano()
	ttl := int64(t.cfg.TTL)
	keys := t.routes.Keys()
	out := make([]RouteRecord, 0, len(keys))
	for _, k := range keys {
		r, _ := t.routes.Peek(k)
		var rec RouteRecord
		for e, id := range r.ids {
			if id == 0 || !t.ups.live(id) || now-r.seen[e] > ttl {
				continue
			}
			rec.Upstreams = append(rec.Upstreams, UpstreamSeen{
				Upstream: t.ups.slots[id].name,
				LastSeen: time.Unix(0, r.seen[e]),
			})
		}
		if len(rec.Upstreams) > 0 {
			rec.Key = k
			out = append(out, rec)
		}
	}
	return out
}

// Import merges routes, typically from another instance's Export: per route and upstream the later
// LastSeen wins, entries already past TTL are skipped, and MaxUpstreamsPerRoute and Capacity apply as for
// Learn (records later in the slice count as more recently learned). O(len(routes)) under the exclusive
// lock. Peers' clocks are trusted as they are; a LastSeen in the future is capped at now.
func (t *Table) Import(routes []RouteRecord) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stats.Changes++
	now := t.cfg.Now().UnixNano()
	for _, rec := range routes {
		// Oldest first, so that ties keep the record's order.
		for i := len(rec.Upstreams) - 1; i >= 0; i-- {
			u := rec.Upstreams[i]
			if u.Upstream == "" {
				continue
			}
			seen := min(u.LastSeen.UnixNano(), now)
			id := t.ups.intern(u.Upstream)
			t.ups.ref(id)
			t.mergeLocked(rec.Key, id, seen, now, false, false)
			t.ups.unref(id)
		}
	}
}
