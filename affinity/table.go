package affinity

import (
	"encoding/binary"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/tokenrouter/caddy-llm/tokenize"
)

// Defaults applied by New and Reconfigure to zero (or negative) Config fields.
const (
	DefaultCapacity             = 100_000
	DefaultTTL                  = 10 * time.Minute
	DefaultBlockSize            = 16
	DefaultMaxUpstreamsPerRoute = 4
	DefaultConversationTTL      = 30 * time.Minute
	DefaultConversationCapacity = 100_000
)

// MaxUpstreamsLimit is the largest accepted MaxUpstreamsPerRoute; larger values are clamped to it. A route
// entry is a fixed array of this many (upstream ID, last seen) pairs, which keeps it at 48 bytes.
const MaxUpstreamsLimit = 4

// DefaultOverflowRoutes is how many overflow routes a prefix's holders spill into beyond its route's
// MaxUpstreamsPerRoute (see Config.OverflowRoutes): with 4 upstreams a route, 32 holders of one prefix.
const DefaultOverflowRoutes = 7

// MaxOverflowRoutes is the largest accepted OverflowRoutes.
const MaxOverflowRoutes = 64

// overflowSeed tells an overflow route's key from every boundary hash RouteKey is given.
const overflowSeed = 0x6f766572666c6f77

// sweepBatch bounds how many expired routes (and pins) one Learn (or Pin) removes from the LRU tail, so that
// the first call after a long idle period does not stall; Expire removes them all.
const sweepBatch = 64

// Config shapes a Table. Zero fields take the Default* values.
type Config struct {
	// Capacity is the maximum number of learned routes across all models and upstreams; the least recently
	// learned route is evicted beyond it. Default 100_000 (about 15 MB, see the package doc).
	Capacity int
	// TTL is how long a route's upstream entry is trusted after it was last learned: an engine evicts cold
	// prefixes from its KV cache, so an old route predicts a hit that is no longer there. Default 10 minutes.
	TTL time.Duration
	// BlockSize is the engine's KV-cache block size in tokens: only whole blocks are cached, so boundaries
	// are aligned down to it. Default 16 (vLLM's default).
	BlockSize int
	// MaxUpstreamsPerRoute is how many upstreams one route remembers, most recently learned first. Beyond
	// it, Learn (and ImportChanges) moves the oldest one that is still live and within TTL to an overflow
	// route of the prefix, one of OverflowRoutes chosen by the upstream's name, where it is dropped only
	// when that overflow route is full in turn. Default 4, at most MaxUpstreamsLimit.
	MaxUpstreamsPerRoute int
	// OverflowRoutes is how many overflow routes a prefix has: a prefix cached on more upstreams than a
	// route remembers (a popular system prompt replicated across a large pool) is still matched on all of
	// them, up to MaxUpstreamsPerRoute x (1 + OverflowRoutes) (fewer where names share an overflow route).
	// Overflow routes are ordinary routes under derived keys: they count against Capacity, expire, persist
	// and are shared like the others, and a prefix held by at most MaxUpstreamsPerRoute upstreams has
	// none. Default 7 (DefaultOverflowRoutes), at most MaxOverflowRoutes; negative: none (the oldest
	// holder is dropped).
	OverflowRoutes int
	// ConversationTTL is how long a conversation pin lasts after it was last set. Default 30 minutes.
	ConversationTTL time.Duration
	// ConversationCapacity is the maximum number of conversation pins (LRU beyond it). Default 100_000.
	ConversationCapacity int
	// Now is the clock; time.Now when nil. Tests inject a fake one.
	Now func() time.Time
}

func (c Config) withDefaults() Config {
	if c.Capacity <= 0 {
		c.Capacity = DefaultCapacity
	}
	if c.TTL <= 0 {
		c.TTL = DefaultTTL
	}
	if c.BlockSize <= 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.MaxUpstreamsPerRoute <= 0 {
		c.MaxUpstreamsPerRoute = DefaultMaxUpstreamsPerRoute
	}
	if c.MaxUpstreamsPerRoute > MaxUpstreamsLimit {
		c.MaxUpstreamsPerRoute = MaxUpstreamsLimit
	}
	switch {
	case c.OverflowRoutes == 0:
		c.OverflowRoutes = DefaultOverflowRoutes
	case c.OverflowRoutes < 0:
		c.OverflowRoutes = 0
	case c.OverflowRoutes > MaxOverflowRoutes:
		c.OverflowRoutes = MaxOverflowRoutes
	}
	if c.ConversationTTL <= 0 {
		c.ConversationTTL = DefaultConversationTTL
	}
	if c.ConversationCapacity <= 0 {
		c.ConversationCapacity = DefaultConversationCapacity
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// route is the value of one learned route: up to MaxUpstreamsLimit upstreams that were sent this prefix,
// most recently learned first. ids[i] == 0 marks an empty entry. 48 bytes, no pointers.
type route struct {
	ids  [MaxUpstreamsLimit]uint32
	seen [MaxUpstreamsLimit]int64 // unix nanoseconds of the last Learn for ids[i]
}

// newest is the most recent seen time among the entries (0 if empty).
func (r *route) newest() int64 {
	var n int64
	for e, id := range r.ids {
		if id != 0 && (n == 0 || r.seen[e] > n) {
			n = r.seen[e]
		}
	}
	return n
}

// pin is the value of one conversation pin. 16 bytes, no pointers.
type pin struct {
	id   uint32
	seen int64
}

// Table holds learned prefix routes and conversation pins. It is safe for concurrent use: Match, Pinned,
// RouteCount and Stats take a shared read lock and never modify the table (Match is a pure lookup and
// does not refresh LRU recency; the Learn that follows every routed request does), while Learn, Pin,
// Forget, Clear, Expire, Import and Reconfigure take the exclusive lock.
//
// Costs (b = len(bounds), u = len(upstreams)): Learn is O(b) LRU operations plus a bounded sweep of
// expired routes; Match is O(b*u) map lookups in the worst case (it probes blocks longest first and stops
// once every upstream has its answer), plus at most 4*OverflowRoutes lookups of overflow routes, and
// does not allocate when cached has len(upstreams) and u <= 32; Pin and Pinned are O(1); Forget, Expire
// and Export are O(routes + pins). Memory is bounded by Capacity routes plus ConversationCapacity pins
// (see the package doc for bytes per entry).
type Table struct {
	mu     sync.RWMutex
	cfg    Config
	routes *simplelru.LRU[uint64, route] // learned here (Learn, Import, Restore)
	remote *simplelru.LRU[uint64, route] // known only from peers (ImportChanges); evicted first
	pins   *simplelru.LRU[uint64, pin]
	ups    upstreamTable
	stats  Stats
	feed   feed
}

// Stats is a snapshot of a Table's size and cumulative counters.
type Stats struct {
	Routes       int    // learned routes held now, local and remote (including ones past TTL not yet swept)
	RemoteRoutes int    // of Routes, those known only from peers (ImportChanges), evicted before local ones
	Pins         int    // conversation pins held now
	Upstreams    int    // interned upstream names held now
	Evictions    uint64 // routes and pins evicted by capacity since New
	Expired      uint64 // routes and pins removed for being older than their TTL since New
	Changes      uint64 // Learn, Pin, Import, ImportChanges and Restore calls since New: unchanged means nothing to save
	FeedDropped  uint64 // changes not recorded because the feed was full (see EnableFeed)
}

// New returns an empty Table shaped by cfg (zero fields take defaults).
func New(cfg Config) *Table {
	cfg = cfg.withDefaults()
	t := &Table{cfg: cfg, ups: newUpstreamTable()}
	var err error
	t.routes, err = simplelru.NewLRU(cfg.Capacity, t.onRouteRemoved)
	if err != nil {
		panic("affinity: " + err.Error()) // unreachable: Capacity > 0 after withDefaults
	}
	t.remote, _ = simplelru.NewLRU(cfg.Capacity, t.onRouteRemoved)
	t.pins, err = simplelru.NewLRU(cfg.ConversationCapacity, t.onPinRemoved)
	if err != nil {
		panic("affinity: " + err.Error()) // unreachable: ConversationCapacity > 0 after withDefaults
	}
	return t
}

// onRouteRemoved releases the upstream references of a route leaving the LRU for any reason. Called with
// the lock held (from inside simplelru).
func (t *Table) onRouteRemoved(_ uint64, r route) {
	for _, id := range r.ids {
		if id != 0 {
			t.ups.unrefRoute(id)
		}
	}
}

func (t *Table) onPinRemoved(_ uint64, p pin) { t.ups.unref(p.id) }

// ModelHash is the fixed-seed hash of a model name that scopes route and pin keys.
func ModelHash(model string) uint64 { return xxhash.Sum64String(model) }

// RouteKey is the key of the route for a prefix ending at a boundary with hash boundaryHash under the
// model whose ModelHash is modelHash: xxhash64 of the two values as little-endian uint64s. It is the same
// in every process, so exported routes can be imported elsewhere.
func RouteKey(modelHash, boundaryHash uint64) uint64 {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], modelHash)
	binary.LittleEndian.PutUint64(b[8:], boundaryHash)
	return xxhash.Sum64(b[:])
}

func align(tokens, blockSize int) int { return tokens / blockSize * blockSize }

// overflowLink is the overflow route (1..links) of the upstream named name: by a fixed-seed hash of the
// name, so that every process, and a restarted one, spills an upstream into the same one.
func overflowLink(name string, links int) uint64 { return 1 + xxhash.Sum64String(name)%uint64(links) }

// overflowKey is the key of overflow route link of the route at key.
func overflowKey(key, link uint64) uint64 { return RouteKey(key, overflowSeed+link) }

// BlockSize returns the block size Match aligns its matches to.
func (t *Table) BlockSize() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.cfg.BlockSize
}

// Learn records that upstream (a dial address) was sent the prompt with these boundaries under model.
// Boundaries are aligned down to BlockSize; a boundary aligning to 0 is skipped; consecutive boundaries
// aligning to the same block collapse into one route keyed by the earliest one's hash, so a request that
// shares only the earlier messages still matches that block. Steps inside a message (Boundary.Step)
// are learned only with an end that is news there (see the package doc). Each touched route moves to the front of the
// LRU, the longest first and the first block last (the LRU evicts a prefix from its end), and lists
// upstream first with the current time; entries of forgotten upstreams and entries past TTL
// are dropped, and those beyond MaxUpstreamsPerRoute move to the route's overflow routes. Cost:
// O(len(bounds)) LRU operations under the exclusive lock, plus removing at most len(bounds)+64 expired
// routes from the LRU tail. It returns the time recorded (unix nanoseconds), the one MatchSeen reports
// for these routes until they are learned again; 0 when there was nothing to learn.
func (t *Table) Learn(model string, bounds []tokenize.Boundary, upstream string) (seen int64) {
	if upstream == "" || len(bounds) == 0 {
		return 0
	}
	mh := ModelHash(model)
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.cfg.Now().UnixNano()
	id := t.ups.intern(upstream)
	t.ups.ref(id) // hold: evictions below must not reclaim id before a route refers to it
	// Longest first, so that the prompt's first block is the most recently learned of its routes and
	// the LRU evicts a prefix from its end, as an engine does: Match trusts no claim past a block that
	// is gone.
	//
	// A message's steps are learned with its end when the end is news here (this upstream not listed,
	// or last seen in an earlier TTL/8 interval), not by every request that repeats the message: only a
	// prompt that shares part of that message ends at one of them, and a 16 KB system prompt is 64
	// steps, most of the route work of every request behind it. Their entries lag by at most TTL/8.
	interval := t.cfg.routeRefresh()
	steps, end := true, false
	for j := len(bounds) - 1; j >= 0; j-- {
		a := align(bounds[j].Tokens, t.cfg.BlockSize)
		if a <= 0 {
			break // boundaries are increasing: all earlier ones align to 0 too
		}
		end = end || !bounds[j].Step // the block holds a message end
		prev := 0
		if j > 0 {
			prev = align(bounds[j-1].Tokens, t.cfg.BlockSize)
		}
		if prev == a {
			continue // the block is keyed by its earliest boundary
		}
		if !end && prev > 0 && !steps { // a step, not the first block
			continue
		}
		key := RouteKey(mh, bounds[j].Hash)
		isNews := news(t.mergeLocked(key, id, now, now, false, true), now, interval)
		if end {
			steps = isNews
		}
		end = false
		if t.feed.on && isNews {
			t.feed.add(Change{Key: key, Upstream: upstream, Seen: now})
		}
	}
	t.stats.Changes++
	t.sweepLocked(now, sweepBatch+len(bounds))
	t.ups.unref(id)
	return now
}

// mergeLocked adds (id, seen) to the route at key, keeping entries most recent first, dropping dead and
// expired ones and those beyond MaxUpstreamsPerRoute, and moves the route to the front of its LRU. A route
// left empty (only possible when seen itself is expired, from an import) is removed. A local merge
// (remote false) of a route known only from peers makes it local; a remote merge of a route known locally
// stays local. It returns the time id was last seen on the route before (0 if it was not listed), so
// that Learn can tell news from a refresh. With spill, an entry still live and within TTL that the cap
// pushes out moves to its overflow route (Config.OverflowRoutes) instead of being dropped. Must hold t.mu.
func (t *Table) mergeLocked(key uint64, id uint32, seen, now int64, remote, spill bool) (before int64) {
	lru := t.routes
	old, existed := t.routes.Peek(key)
	promote := false
	if !existed {
		if old, existed = t.remote.Peek(key); existed {
			promote = !remote
			if remote {
				lru = t.remote
			}
		} else if remote {
			lru = t.remote
		}
	}
	ttl := int64(t.cfg.TTL)
	had := false
	for e, x := range old.ids {
		if x == id {
			had = true
			before = old.seen[e]
			if old.seen[e] > seen {
				seen = old.seen[e]
			}
		}
	}
	// Candidates in order: the new entry placed by time among the surviving old ones (already sorted).
	var nr route
	n := 0
	placed := now-seen > ttl // an expired new entry is never placed
	keptID := false
	var spilled [MaxUpstreamsLimit]int // entries of old pushed out by the cap, to move
	nSpilled := 0
	for e, x := range old.ids {
		if x == 0 || x == id {
			continue
		}
		if !placed && seen >= old.seen[e] {
			if n < t.cfg.MaxUpstreamsPerRoute {
				nr.ids[n], nr.seen[n] = id, seen
				n++
				keptID = true
			}
			placed = true
		}
		if t.ups.live(x) && now-old.seen[e] <= ttl {
			if n < t.cfg.MaxUpstreamsPerRoute {
				nr.ids[n], nr.seen[n] = x, old.seen[e]
				n++
				continue
			}
			if spill && t.cfg.OverflowRoutes > 0 {
				spilled[nSpilled] = e // still referenced: released once moved, below
				nSpilled++
				continue
			}
		}
		t.ups.unrefRoute(x) // dropped
	}
	if !placed && n < t.cfg.MaxUpstreamsPerRoute {
		nr.ids[n], nr.seen[n] = id, seen
		n++
		keptID = true
	}
	switch {
	case keptID && !had:
		t.ups.refRoute(id)
	case !keptID && had:
		t.ups.unrefRoute(id)
	}
	if existed && (n == 0 || promote) {
		// Entries were released or carried over above; remove without releasing them twice.
		from := lru
		if promote {
			from = t.remote
		}
		from.Add(key, route{})
		from.Remove(key)
	}
	if n == 0 {
		return before
	}
	if lru.Add(key, nr) {
		t.stats.Evictions++
	}
	for _, e := range spilled[:nSpilled] {
		x := old.ids[e]
		link := overflowLink(t.ups.slots[x].name, t.cfg.OverflowRoutes)
		t.mergeLocked(overflowKey(key, link), x, old.seen[e], now, lru == t.remote, false)
		t.ups.unrefRoute(x) // its entry in the route at key
	}
	t.boundLocked()
	return before
}

// boundLocked keeps local plus remote routes within Capacity, evicting the least recently learned remote
// routes first: a peer's observations are second-hand, this instance's are ground truth. Must hold t.mu.
func (t *Table) boundLocked() {
	for t.routes.Len()+t.remote.Len() > t.cfg.Capacity {
		if t.remote.Len() > 0 {
			t.remote.RemoveOldest()
		} else {
			t.routes.RemoveOldest()
		}
		t.stats.Evictions++
	}
}

// sweepLocked removes up to limit expired routes and limit expired pins from the LRU tails. Recency in
// both LRUs is the order of the last Learn (Pin), so the expired ones are exactly a tail. Must hold t.mu.
func (t *Table) sweepLocked(now int64, limit int) (removed int) {
	ttl := int64(t.cfg.TTL)
	for _, lru := range [2]*simplelru.LRU[uint64, route]{t.routes, t.remote} {
		for i := 0; i < limit; i++ {
			_, r, ok := lru.GetOldest()
			if !ok || now-r.newest() <= ttl {
				break
			}
			lru.RemoveOldest()
			t.stats.Expired++
			removed++
		}
	}
	pinTTL := int64(t.cfg.ConversationTTL)
	for i := 0; i < limit; i++ {
		_, p, ok := t.pins.GetOldest()
		if !ok || now-p.seen <= pinTTL {
			break
		}
		t.pins.RemoveOldest()
		t.stats.Expired++
		removed++
	}
	return removed
}

// matchIDsOnStack is how many upstreams Match handles without allocating.
const matchIDsOnStack = 32

// Match writes into cached[i] the predicted cached prompt tokens for upstreams[i]: the aligned Tokens of
// the longest boundary whose route lists upstreams[i] with an entry not older than TTL, if the route of
// the first block (the earliest boundary that aligns above 0) lists it too; 0 otherwise. It
// returns the longest match over all upstreams. Only the given upstreams are reported, so an upstream
// removed from the pool never matches. It probes the earliest boundary of each block, longest first,
// under the shared lock and does not change recency. Allocation-free when len(cached) >= len(upstreams)
// and len(upstreams) <= 32; with a shorter cached, only its first len(cached) entries are written.
func (t *Table) Match(model string, bounds []tokenize.Boundary, upstreams []string, cached []int) (longest int) {
	return t.MatchSeen(model, bounds, upstreams, cached, nil)
}

// MatchSeen is Match that also writes into seen[i] when the route entry that matched upstreams[i] was last
// learned (unix nanoseconds; 0 when nothing matched): how old the claim is. seen must be nil or have at
// least len(upstreams) elements. Same cost as Match.
func (t *Table) MatchSeen(model string, bounds []tokenize.Boundary, upstreams []string, cached []int, seen []int64) (longest int) {
	longest, _ = t.MatchPeers(model, bounds, upstreams, cached, seen)
	return longest
}

// MatchPeers is MatchSeen that also reports whether the longest claim is known only from peers (a route
// in the remote tier, ImportChanges): another instance sent that prefix and this one has not.
func (t *Table) MatchPeers(model string, bounds []tokenize.Boundary, upstreams []string, cached []int, seen []int64) (longest int, peers bool) {
	if seen != nil {
		clear(seen[:len(upstreams)])
	}
	out := cached
	if len(out) < len(upstreams) {
		out = make([]int, len(upstreams))
		defer copy(cached, out)
	}
	out = out[:len(upstreams)]
	clear(out)
	if len(upstreams) == 0 || len(bounds) == 0 {
		return 0, false
	}
	var idBuf [matchIDsOnStack]uint32
	ids := idBuf[:0]
	if len(upstreams) > len(idBuf) {
		ids = make([]uint32, 0, len(upstreams))
	}
	var linkBuf [matchIDsOnStack]uint64
	var links []uint64 // each upstream's overflow route, computed once a full route is met
	mh := ModelHash(model)

	t.mu.RLock()
	defer t.mu.RUnlock()
	now := t.cfg.Now().UnixNano()
	ttl := int64(t.cfg.TTL)
	bs := t.cfg.BlockSize
	probes := 4 * t.cfg.OverflowRoutes // overflow routes left to probe
	unresolved := 0
	for _, u := range upstreams {
		id := t.ups.lookup(u)
		ids = append(ids, id)
		if id != 0 {
			unresolved++
		}
	}
	// An engine caches a prefix from its first block on (its block hashes chain): an upstream the first
	// block's route does not list holds none of the prompt, whatever a longer route says. Learn keeps
	// the first block the most recently learned of a prompt's routes, so the LRU and the TTL take a
	// prefix from its end; a longer claim without the first block is only possible on routes known
	// from peers (whose first block is re-published once every TTL/8) and is not trusted either. The
	// check settles, in one probe, the candidates that hold nothing, which would otherwise probe every
	// boundary of a long prompt down to its first.
	if unresolved > 0 {
		unresolved, links = t.firstBlockLocked(mh, bounds, upstreams, ids, linkBuf[:0], now)
	}
	// credit gives the upstreams listed in r a match of a tokens.
	credit := func(r *route, remote bool, a int) {
		for e, x := range r.ids {
			if x == 0 || now-r.seen[e] > ttl {
				continue
			}
			for i, id := range ids {
				if id == x && out[i] == 0 {
					out[i] = a
					if seen != nil {
						seen[i] = r.seen[e]
					}
					unresolved--
					if longest == 0 { // boundaries are walked longest first
						peers = remote
					}
					longest = max(longest, a)
				}
			}
		}
	}
	for j := len(bounds) - 1; j >= 0 && unresolved > 0; j-- {
		a := align(bounds[j].Tokens, bs)
		if a <= 0 {
			break // boundaries are increasing: all earlier ones align to 0 too
		}
		if j > 0 && align(bounds[j-1].Tokens, bs) == a {
			continue // Learn keyed this block by its earliest boundary
		}
		key := RouteKey(mh, bounds[j].Hash)
		r, remote, ok := t.peekLocked(key)
		if !ok {
			continue
		}
		credit(&r, remote, a)
		if unresolved == 0 || probes <= 0 || r.ids[t.cfg.MaxUpstreamsPerRoute-1] == 0 {
			continue
		}
		// A full route may have spilled older holders into overflow routes: probe those of the upstreams
		// still unresolved, each once. Holders spill at the longest full route first, so a few probes
		// find them; the budget stops upstreams that hold none of the prefix from probing every
		// boundary of a long prompt down to its first.
		if links == nil {
			links = t.overflowLinks(upstreams, linkBuf[:0])
		}
		var probed [MaxOverflowRoutes + 1]bool
		for i, id := range ids {
			if id == 0 || out[i] != 0 || probed[links[i]] {
				continue
			}
			probed[links[i]] = true
			probes--
			if r, remote, ok := t.peekLocked(overflowKey(key, links[i])); ok {
				credit(&r, remote, a)
			}
		}
	}
	return longest, peers
}

// firstBlockLocked zeroes ids[i] for each upstreams[i] that the route of the prompt's first block does
// not list within TTL, nor (where that route is full) the upstream's overflow route of it, and returns
// how many ids are left non-zero, and each upstream's overflow route in buf if it needed them (nil if
// not). Must hold t.mu (shared).
func (t *Table) firstBlockLocked(mh uint64, bounds []tokenize.Boundary, upstreams []string, ids []uint32, buf []uint64, now int64) (left int, links []uint64) {
	j := 0
	for j < len(bounds) && align(bounds[j].Tokens, t.cfg.BlockSize) <= 0 {
		j++
	}
	if j == len(bounds) {
		clear(ids)
		return 0, nil
	}
	key, ttl := RouteKey(mh, bounds[j].Hash), int64(t.cfg.TTL)
	r, _, ok := t.peekLocked(key)
	if !ok {
		clear(ids)
		return 0, nil
	}
	if r.ids[t.cfg.MaxUpstreamsPerRoute-1] == 0 || t.cfg.OverflowRoutes == 0 {
		for i, id := range ids {
			if id != 0 && !r.lists(id, now, ttl) {
				ids[i] = 0
			}
		}
		return countNonZero(ids), nil
	}
	// A full route: the holders it pushed out are in its overflow routes, each read once for all the
	// upstreams it may hold (a pool of 16 shares 7 of them).
	l := t.overflowLinks(upstreams, buf)
	var probed [MaxOverflowRoutes + 1]bool
	for i, id := range ids {
		if id == 0 || r.lists(id, now, ttl) || probed[l[i]] {
			continue
		}
		probed[l[i]] = true
		over, _, _ := t.peekLocked(overflowKey(key, l[i]))
		for k := i; k < len(ids); k++ {
			if l[k] == l[i] && ids[k] != 0 && !r.lists(ids[k], now, ttl) && !over.lists(ids[k], now, ttl) {
				ids[k] = 0
			}
		}
	}
	return countNonZero(ids), l
}

// overflowLinks appends each upstream's overflow route to buf.
func (t *Table) overflowLinks(upstreams []string, buf []uint64) []uint64 {
	for _, u := range upstreams {
		buf = append(buf, overflowLink(u, t.cfg.OverflowRoutes))
	}
	return buf
}

// countNonZero is how many of ids are not 0.
func countNonZero(ids []uint32) (n int) {
	for _, id := range ids {
		if id != 0 {
			n++
		}
	}
	return n
}

// lists reports whether the route has an entry for id last seen within ttl of now.
func (r *route) lists(id uint32, now, ttl int64) bool {
	for e, x := range r.ids {
		if x == id && now-r.seen[e] <= ttl {
			return true
		}
	}
	return false
}

// peekLocked returns the route at key, local or known from peers (remote), without changing recency.
// Must hold t.mu (shared).
func (t *Table) peekLocked(key uint64) (r route, remote, ok bool) {
	if r, ok = t.routes.Peek(key); ok || t.remote.Len() == 0 {
		return r, false, ok
	}
	r, ok = t.remote.Peek(key)
	return r, ok, ok
}

// Forget drops every route entry and pin pointing at upstream (its pool membership ended); a later Learn
// of the same name starts afresh. Routes left without upstreams are removed; in routes shared with other
// upstreams the entry is ignored from now on and reclaimed when the route is next learned or evicted.
// O(routes + pins) under the exclusive lock (skipped when upstream holds none); allocates a key slice.
func (t *Table) Forget(upstream string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	id := t.ups.forget(upstream)
	if id == 0 {
		return
	}
	t.ups.ref(id) // hold while scanning so the slot is not reused mid-way
	for _, lru := range [2]*simplelru.LRU[uint64, route]{t.routes, t.remote} {
		if t.ups.slots[id].routes == 0 {
			break
		}
		for _, k := range lru.Keys() {
			r, _ := lru.Peek(k)
			mine, others := false, false
			for _, x := range r.ids {
				switch {
				case x == 0:
				case x == id:
					mine = true
				case t.ups.live(x):
					others = true
				}
			}
			if mine && !others {
				lru.Remove(k)
			}
		}
	}
	if t.ups.slots[id].refs > t.ups.slots[id].routes+1 { // it holds pins
		for _, k := range t.pins.Keys() {
			if p, _ := t.pins.Peek(k); p.id == id {
				t.pins.Remove(k)
			}
		}
	}
	t.ups.unref(id)
}

// Clear drops every route and pin (operators: DELETE /llm/routes). Counters in Stats are kept.
// O(routes + pins) under the exclusive lock.
func (t *Table) Clear() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.routes.Purge()
	t.remote.Purge()
	t.pins.Purge()
	t.ups = newUpstreamTable() // release the grown slices and map too
}

// Expire removes every route and pin older than its TTL and returns how many it removed. Learn and Pin
// already sweep a bounded number each; call Expire from a background loop to release memory promptly
// after traffic stops. Cost proportional to the number removed.
func (t *Table) Expire() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.sweepLocked(t.cfg.Now().UnixNano(), int(^uint(0)>>1))
}

// Stats returns the current sizes and cumulative counters. O(1) under the shared lock.
func (t *Table) Stats() Stats {
	t.mu.RLock()
	defer t.mu.RUnlock()
	s := t.stats
	s.Routes = t.routes.Len() + t.remote.Len()
	s.RemoteRoutes = t.remote.Len()
	s.FeedDropped += t.feed.dropped
	s.Pins = t.pins.Len()
	s.Upstreams = t.ups.inUse()
	return s
}

// RouteCount returns how many routes list upstream, including entries past TTL that no Learn or Expire
// has swept yet. O(1) under the shared lock (kept as a counter).
func (t *Table) RouteCount(upstream string) int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	id := t.ups.lookup(upstream)
	if id == 0 {
		return 0
	}
	return int(t.ups.slots[id].routes)
}

// Reconfigure applies a new Config in place, keeping learned state across config reloads (zero fields take
// defaults, as in New; Now is replaced too).
//   - A smaller Capacity or ConversationCapacity evicts the least recently learned entries at once
//     (counted in Evictions); a larger one just raises the bound.
//   - TTL and ConversationTTL apply to existing entries immediately (a longer TTL revives entries not yet
//     swept).
//   - A smaller MaxUpstreamsPerRoute trims each route the next time it is learned; until then Match may
//     still report its older extra entries, which are true observations.
//   - A changed BlockSize keeps the routes: each still records a prefix its upstreams were sent, and Match
//     reports it aligned to the new size. Routes keyed by boundaries that are no longer the earliest of
//     their block under the new size are simply not probed and age out.
func (t *Table) Reconfigure(cfg Config) {
	cfg = cfg.withDefaults()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stats.Evictions += uint64(t.remote.Resize(cfg.Capacity))
	t.stats.Evictions += uint64(t.routes.Resize(cfg.Capacity))
	t.stats.Evictions += uint64(t.pins.Resize(cfg.ConversationCapacity))
	t.cfg = cfg
	t.boundLocked()
}
