package affinity

import "github.com/cespare/xxhash/v2"

// pinDomain separates pin keys from route keys derived from the same model hash.
const pinDomain = 0x70696e2d636f6e76 // "pin-conv"

// pinKey hashes a client-sent conversation ID under a model. The ID itself is never stored.
func pinKey(model, conversationID string) uint64 {
	return RouteKey(ModelHash(model)^pinDomain, xxhash.Sum64String(conversationID))
}

// Pin records that the conversation conversationID under model was sent to upstream, for clients that send
// a conversation ID header. Only a 64-bit hash of (model, ID) is kept. It replaces any earlier pin of the
// conversation, refreshes its time and LRU recency, and evicts the least recently pinned conversation
// beyond ConversationCapacity. Empty IDs or upstreams are ignored. O(1) plus a bounded sweep of expired
// pins and routes, under the exclusive lock.
func (t *Table) Pin(model, conversationID, upstream string) {
	if conversationID == "" || upstream == "" {
		return
	}
	key := pinKey(model, conversationID)
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.cfg.Now().UnixNano()
	id := t.ups.intern(upstream)
	old, existed := t.pins.Peek(key)
	t.putPinLocked(key, old, existed, pin{id: id, seen: now})
	if t.feed.on && (!existed || old.id != id || news(old.seen, now, t.cfg.pinRefresh())) {
		t.feed.add(Change{Key: key, Upstream: upstream, Seen: now, Pin: true})
	}
	t.stats.Changes++
	t.sweepLocked(now, 8)
}

// importPinLocked sets the pin at key to (id, seen) unless the pin held is at least as recent: the latest
// decision about a conversation wins, wherever it was made. Expired pins are skipped. Must hold t.mu.
func (t *Table) importPinLocked(key uint64, id uint32, seen, now int64) {
	if now-seen > int64(t.cfg.ConversationTTL) {
		return
	}
	old, existed := t.pins.Peek(key)
	if existed && old.seen >= seen {
		return
	}
	t.putPinLocked(key, old, existed, pin{id: id, seen: seen})
}

// putPinLocked replaces the pin at key (old, if it existed) with p, moving the upstream references from
// old's upstream to p's. Must hold t.mu.
func (t *Table) putPinLocked(key uint64, old pin, existed bool, p pin) {
	switch {
	case !existed:
		t.ups.ref(p.id)
	case old.id != p.id:
		t.ups.ref(p.id)
		t.ups.unref(old.id)
	}
	if t.pins.Add(key, p) {
		t.stats.Evictions++
	}
}

// Pinned returns the upstream the conversation was last pinned to, if that pin is not older than
// ConversationTTL and the upstream has not been forgotten. The caller still checks that the upstream is
// in the pool and available: a pin is a preference, never a reason to pick an unhealthy upstream.
// O(1) under the shared lock; does not allocate.
func (t *Table) Pinned(model, conversationID string) (upstream string, ok bool) {
	if conversationID == "" {
		return "", false
	}
	key := pinKey(model, conversationID)
	t.mu.RLock()
	defer t.mu.RUnlock()
	p, ok := t.pins.Peek(key)
	if !ok || t.cfg.Now().UnixNano()-p.seen > int64(t.cfg.ConversationTTL) {
		return "", false
	}
	s := t.ups.slots[p.id]
	if !s.live {
		return "", false
	}
	return s.name, true
}
