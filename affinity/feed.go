package affinity

// Change is one thing a Table learned locally, as recorded in its feed for sharing with peers: a route
// (Key is a RouteKey) or a conversation pin (Pin set; Key is the pin's hash of model and conversation ID)
// now pointing at Upstream, last seen at Seen (unix nanoseconds). Keys use fixed seeds, so a peer's
// ImportChanges applies them to the same prefixes and conversations.
type Change struct {
	Key      uint64
	Upstream string
	Seen     int64
	Pin      bool
}

// feed is the bounded buffer of local changes a sharing layer drains. Learn and Pin append under the
// table's lock they already hold (no allocation once the buffer has grown, never a wait); when it is full,
// new changes are counted as dropped instead. An entry re-learned on the same upstream within the refresh
// interval is not recorded again: peers already have it, and a hot system prompt would otherwise be
// published on every request. Time is cut into refresh intervals and an entry is news when its previous
// time falls in an earlier interval, so an entry learned continuously is still recorded once per interval
// without keeping a "last recorded" time per entry.
type feed struct {
	on      bool
	buf     []Change
	max     int
	dropped uint64
}

func (f *feed) add(c Change) {
	if len(f.buf) >= f.max {
		f.dropped++
		return
	}
	f.buf = append(f.buf, c)
}

// routeRefresh is how often (nanoseconds) a route entry learned again is news: TTL/8. The feed records
// it then, and Learn learns a message's steps with its end then.
func (c Config) routeRefresh() int64 { return max(int64(c.TTL/8), 1) }

// pinRefresh is how often (nanoseconds) a pin set again is news: ConversationTTL/8.
func (c Config) pinRefresh() int64 { return max(int64(c.ConversationTTL/8), 1) }

// news reports whether an entry last seen at before (0: never) and seen again at now is worth recording
// (or, for Learn, a message's steps worth learning again), at most once an interval.
func news(before, now, interval int64) bool {
	return before == 0 || before/interval != now/interval
}

// EnableFeed makes the table record what Learn and Pin learn, up to capacity changes between two
// DrainFeed calls (memory: about 40 bytes a change); capacity <= 0 turns the feed off and discards what
// it holds. A route or pin re-learned on the same upstream is recorded again only when its previous time is
// in an earlier interval of TTL/8 (for pins ConversationTTL/8), so a peer's copy of an entry learned
// continuously ages at most that much faster than the original. Imports (Import, ImportChanges, Restore) are never recorded: sharing
// does not echo.
func (t *Table) EnableFeed(capacity int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if capacity <= 0 {
		t.feed = feed{}
		return
	}
	t.feed.on = true
	t.feed.max = capacity
}

// DrainFeed appends the recorded changes to dst, oldest first, empties the feed and returns dst with the
// number of changes dropped since the previous call because the feed was full. O(changes) under the
// exclusive lock (a copy); call it from one goroutine, a few times a second.
func (t *Table) DrainFeed(dst []Change) ([]Change, uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	dst = append(dst, t.feed.buf...)
	clear(t.feed.buf) // drop the upstream name references
	t.feed.buf = t.feed.buf[:0]
	dropped := t.feed.dropped
	t.feed.dropped = 0
	t.stats.FeedDropped += dropped
	return dst, dropped
}

// ImportChanges applies changes learned by peers. Routes not learned here go to the remote tier, which
// Match consults like local routes but which is evicted first when the table is full; a route later
// learned here becomes local. Pins are global: the latest pin of a conversation wins, wherever it was
// made. Per route and upstream the later time wins, entries already past their TTL are skipped, and a
// Seen in the future is capped at now (peers' clocks are trusted otherwise). O(len(changes)) under the
// exclusive lock; nothing is recorded in the feed.
func (t *Table) ImportChanges(changes []Change) {
	if len(changes) == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stats.Changes++
	now := t.cfg.Now().UnixNano()
	for _, c := range changes {
		if c.Upstream == "" {
			continue
		}
		seen := min(c.Seen, now)
		id := t.ups.intern(c.Upstream)
		t.ups.ref(id) // hold: an eviction below must not reclaim id before an entry refers to it
		if c.Pin {
			t.importPinLocked(c.Key, id, seen, now)
		} else {
			t.mergeLocked(c.Key, id, seen, now, true, true)
		}
		t.ups.unref(id)
	}
}
