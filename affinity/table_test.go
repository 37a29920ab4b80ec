package affinity

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/tokenrouter/caddy-llm/tokenize"
)

// fakeClock is a manually advanced clock for single-goroutine tests.
type fakeClock struct{ now time.Time }

func newFakeClock() *fakeClock { return &fakeClock{now: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time          { return c.now }
func (c *fakeClock) Advance(d time.Duration) { c.now = c.now.Add(d) }

// msg is a chat message for building boundaries: its content (only hashed) and its token count.
type msg struct {
	content string
	tokens  int
}

// prompt builds the boundaries of a conversation, one per message end, with a chained hash of the
// contents, as tokenize does: requests sharing their first k messages share their first k boundaries.
func prompt(msgs ...msg) []tokenize.Boundary {
	var (
		bounds []tokenize.Boundary
		h      uint64
		tokens int
	)
	for _, m := range msgs {
		tokens += m.tokens
		h = xxhash.Sum64String(fmt.Sprintf("%016x|%s", h, m.content))
		bounds = append(bounds, tokenize.Boundary{Tokens: tokens, Hash: h})
	}
	return bounds
}

// bd is a hand-built boundary.
func bd(tokens int, hash uint64) tokenize.Boundary {
	return tokenize.Boundary{Tokens: tokens, Hash: hash}
}

func newTestTable(cfg Config) (*Table, *fakeClock) {
	c := newFakeClock()
	cfg.Now = c.Now
	return New(cfg), c
}

// match is Match with a fresh result slice.
func match(t *Table, model string, bounds []tokenize.Boundary, upstreams ...string) []int {
	cached := make([]int, len(upstreams))
	t.Match(model, bounds, upstreams, cached)
	return cached
}

var (
	system = msg{"You are a helpful assistant. " + "rules...", 500}
	user1  = msg{"user: what is a KV cache?", 40}
	asst1  = msg{"assistant: the keys and values of attention...", 300}
	user2  = msg{"user: and prefix caching?", 30}
	asst2  = msg{"assistant: reusing the cache of a shared prefix...", 250}
	user3  = msg{"user: thanks, and eviction?", 20}
	asst3  = msg{"assistant: LRU over blocks...", 200}
	other  = msg{"user: write a poem about GPUs", 25}
)

// TestMatchConversations covers the three shapes a later request takes relative to a learned one.
func TestMatchConversations(t *testing.T) {
	tests := []struct {
		name    string
		learned []tokenize.Boundary
		request []tokenize.Boundary
		want    int // predicted cached tokens on the learned upstream
	}{
		{
			name:    "continuing conversation matches the whole previous request",
			learned: prompt(system, user1, asst1, user2),
			request: prompt(system, user1, asst1, user2, asst2, user3),
			want:    align(500+40+300+30, 16), // 864
		},
		{
			name:    "branch from a shared system prompt matches the system prompt only",
			learned: prompt(system, user1),
			request: prompt(system, other),
			want:    align(500, 16), // 496
		},
		{
			name:    "conversation resumed from its middle matches the shared history",
			learned: prompt(system, user1, asst1, user2, asst2, user3, asst3),
			request: prompt(system, user1, asst1, other),
			want:    align(500+40+300, 16), // 832
		},
		{
			name:    "identical request matches fully",
			learned: prompt(system, user1),
			request: prompt(system, user1),
			want:    align(540, 16),
		},
		{
			name:    "unrelated prompt matches nothing",
			learned: prompt(system, user1),
			request: prompt(other, user1),
			want:    0,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tb, _ := newTestTable(Config{})
			tb.Learn("m", tt.learned, "10.0.0.1:8000")
			ups := []string{"10.0.0.2:8000", "10.0.0.1:8000", "10.0.0.3:8000"}
			cached := make([]int, len(ups))
			longest := tb.Match("m", tt.request, ups, cached)
			if want := []int{0, tt.want, 0}; !slices.Equal(cached, want) {
				t.Errorf("Match() cached = %v, want %v", cached, want)
			}
			if longest != tt.want {
				t.Errorf("Match() = %d, want %d", longest, tt.want)
			}
		})
	}
}

// TestMatchPerUpstream checks that each upstream gets its own longest prefix.
func TestMatchPerUpstream(t *testing.T) {
	tb, _ := newTestTable(Config{})
	tb.Learn("m", prompt(system, other), "a")
	tb.Learn("m", prompt(system, user1, asst1), "b")
	got := match(tb, "m", prompt(system, user1, asst1, user2), "a", "b", "c")
	if want := []int{496, 832, 0}; !slices.Equal(got, want) {
		t.Errorf("Match() = %v, want %v", got, want)
	}
}

// TestAlignment pins the block rule: boundaries at 15, 17, 31, 33 with block 16 make routes at 16 and 32,
// each keyed by the earliest boundary of its block.
func TestAlignment(t *testing.T) {
	tb, _ := newTestTable(Config{BlockSize: 16})
	b := []tokenize.Boundary{bd(15, 0x15), bd(17, 0x17), bd(31, 0x31), bd(33, 0x33)}
	tb.Learn("m", b, "a")
	if got := tb.Stats().Routes; got != 2 {
		t.Fatalf("Stats().Routes = %d, want 2", got)
	}
	tests := []struct {
		name    string
		request []tokenize.Boundary
		want    int
	}{
		{"shares up to 17: block 16", []tokenize.Boundary{bd(17, 0x17), bd(40, 0x99)}, 16},
		{"shares up to 15 only: aligns to 0", []tokenize.Boundary{bd(15, 0x15), bd(40, 0x99)}, 0},
		{"later boundary of block 16 is not a key", []tokenize.Boundary{bd(31, 0x31)}, 0},
		{"shares up to 33: block 32", []tokenize.Boundary{bd(33, 0x33)}, 32},
		{"full request", b, 32},
		{"full request, diverging after 31", []tokenize.Boundary{bd(15, 0x15), bd(17, 0x17), bd(31, 0x31), bd(34, 0x34)}, 16},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := match(tb, "m", tt.request, "a"); got[0] != tt.want {
				t.Errorf("Match() = %d, want %d", got[0], tt.want)
			}
		})
	}
}

func TestTTL(t *testing.T) {
	tb, clock := newTestTable(Config{TTL: time.Minute})
	req := prompt(system, user1)
	tb.Learn("m", req, "a")
	clock.Advance(time.Minute)
	if got := match(tb, "m", req, "a"); got[0] != 528 {
		t.Errorf("Match() at exactly TTL = %d, want 528", got[0])
	}
	clock.Advance(time.Nanosecond)
	if got := match(tb, "m", req, "a"); got[0] != 0 {
		t.Errorf("Match() after TTL = %d, want 0", got[0])
	}
	// The next Learn sweeps the expired routes from the LRU tail.
	tb.Learn("m", prompt(other), "a")
	if s := tb.Stats(); s.Routes != 1 || s.Expired != 2 {
		t.Errorf("Stats() after sweep = %+v, want 1 route and 2 expired", s)
	}
	// Re-learning refreshes.
	tb.Learn("m", req, "a")
	clock.Advance(30 * time.Second)
	if got := match(tb, "m", req, "a"); got[0] != 528 {
		t.Errorf("Match() after re-learn = %d, want 528", got[0])
	}
	// Expire removes everything past TTL.
	clock.Advance(31 * time.Second)
	if n := tb.Expire(); n != 3 {
		t.Errorf("Expire() = %d, want 3", n)
	}
	if s := tb.Stats(); s.Routes != 0 || s.Upstreams != 0 {
		t.Errorf("Stats() after Expire = %+v, want empty", s)
	}
	checkInvariants(t, tb)
}

// TestTTLPerUpstream checks that an upstream's entry expires on its own while another's is fresh.
func TestTTLPerUpstream(t *testing.T) {
	tb, clock := newTestTable(Config{TTL: time.Minute})
	req := prompt(system)
	tb.Learn("m", req, "a")
	clock.Advance(45 * time.Second)
	tb.Learn("m", req, "b")
	clock.Advance(30 * time.Second)
	if got, want := match(tb, "m", req, "a", "b"), []int{0, 496}; !slices.Equal(got, want) {
		t.Errorf("Match() = %v, want %v", got, want)
	}
}

func TestLRUEviction(t *testing.T) {
	tb, _ := newTestTable(Config{Capacity: 3})
	reqs := make([][]tokenize.Boundary, 5)
	for i := range reqs {
		reqs[i] = prompt(msg{fmt.Sprint("prompt ", i), 100})
	}
	for _, r := range reqs[:3] {
		tb.Learn("m", r, "a")
	}
	tb.Learn("m", reqs[0], "a") // refresh 0: 1 is now the least recently learned
	tb.Learn("m", reqs[3], "a")
	tb.Learn("m", reqs[4], "a")
	want := []int{96, 0, 0, 96, 96}
	for i, r := range reqs {
		if got := match(tb, "m", r, "a"); got[0] != want[i] {
			t.Errorf("Match(prompt %d) = %d, want %d", i, got[0], want[i])
		}
	}
	if s := tb.Stats(); s.Routes != 3 || s.Evictions != 2 {
		t.Errorf("Stats() = %+v, want 3 routes and 2 evictions", s)
	}
	if got := tb.RouteCount("a"); got != 3 {
		t.Errorf("RouteCount() = %d, want 3", got)
	}
	checkInvariants(t, tb)
}

// TestPrefixEvictedFromItsEnd: the LRU takes a conversation's routes from its longest boundary back, as
// an engine evicts a prefix's last blocks first, so what survives still matches; a longer route whose
// first block is gone (expired there, or known only from a peer) is no claim, as an engine cannot hit
// blocks past one it evicted.
func TestPrefixEvictedFromItsEnd(t *testing.T) {
	tb, clock := newTestTable(Config{Capacity: 3, TTL: time.Minute})
	conv := prompt(system, user1, asst1)
	tb.Learn("m", conv, "a")
	tb.Learn("m", prompt(other), "b") // one route over capacity: evicts conv's longest
	if got := match(tb, "m", conv, "a"); got[0] != 528 {
		t.Errorf("Match(conversation) after an eviction = %d, want 528 (the system prompt and the question)", got[0])
	}

	tb, clock = newTestTable(Config{TTL: time.Minute})
	tb.Learn("m", conv, "a")
	clock.Advance(50 * time.Second)
	tb.Learn("m", conv[1:], "a") // not a prompt Parse makes: every route but the first refreshed
	clock.Advance(20 * time.Second)
	if got := match(tb, "m", conv, "a", "b"); got[0] != 0 || got[1] != 0 {
		t.Errorf("Match() with the first block expired = %v, want nothing", got)
	}

	tb, _ = newTestTable(Config{})
	tb.ImportChanges([]Change{{Key: RouteKey(ModelHash("m"), conv[2].Hash), Upstream: "d", Seen: clock.Now().UnixNano()}})
	tb.Learn("m", conv[:1], "a")
	if got := match(tb, "m", conv, "a", "d"); got[0] != 496 || got[1] != 0 {
		t.Errorf("Match() of a peer's route without its first block = %v, want [496 0]", got)
	}
	checkInvariants(t, tb)
}

// TestMemoryBoundUniquePrefixes is the adversary: endless unique prefixes on endless upstream names.
func TestMemoryBoundUniquePrefixes(t *testing.T) {
	tb, _ := newTestTable(Config{Capacity: 100, ConversationCapacity: 10})
	for i := range 5000 {
		up := fmt.Sprint("10.0.", i/250, ".", i%250, ":8000")
		tb.Learn("m", prompt(msg{fmt.Sprint("p", i), 64}, msg{"x", 64}), up)
		tb.Pin("m", fmt.Sprint("conv", i), up)
	}
	s := tb.Stats()
	if s.Routes != 100 || s.Pins != 10 {
		t.Errorf("Stats() = %+v, want 100 routes and 10 pins", s)
	}
	if s.Upstreams > 60 { // 100 routes from 50 upstreams (2 each) + 10 pins
		t.Errorf("Stats().Upstreams = %d, want at most 60", s.Upstreams)
	}
	if n := len(tb.ups.byName); n != s.Upstreams {
		t.Errorf("interned names = %d, want %d", n, s.Upstreams)
	}
	checkInvariants(t, tb)
}

func TestMaxUpstreamsPerRoute(t *testing.T) {
	tb, clock := newTestTable(Config{MaxUpstreamsPerRoute: 2, OverflowRoutes: -1})
	req := prompt(system)
	for _, u := range []string{"a", "b", "c"} {
		tb.Learn("m", req, u)
		clock.Advance(time.Second)
	}
	if got, want := match(tb, "m", req, "a", "b", "c"), []int{0, 496, 496}; !slices.Equal(got, want) {
		t.Errorf("Match() = %v, want %v", got, want)
	}
	tb.Learn("m", req, "a") // most recent first: b is now the oldest and goes
	if got, want := match(tb, "m", req, "a", "b", "c"), []int{496, 0, 496}; !slices.Equal(got, want) {
		t.Errorf("Match() after re-learn = %v, want %v", got, want)
	}
	for u, want := range map[string]int{"a": 1, "b": 0, "c": 1} {
		if got := tb.RouteCount(u); got != want {
			t.Errorf("RouteCount(%s) = %d, want %d", u, got, want)
		}
	}
	if s := tb.Stats(); s.Upstreams != 2 {
		t.Errorf("Stats().Upstreams = %d, want 2 (b reclaimed)", s.Upstreams)
	}

	big, _ := newTestTable(Config{MaxUpstreamsPerRoute: 99})
	if got := big.cfg.MaxUpstreamsPerRoute; got != MaxUpstreamsLimit {
		t.Errorf("MaxUpstreamsPerRoute 99 clamped to %d, want %d", got, MaxUpstreamsLimit)
	}
	checkInvariants(t, tb)
}

// TestOverflowRoutes: a prefix learned on more upstreams than a route remembers is matched on all of
// them, its older holders moved to overflow routes chosen by name, and those are ordinary routes: they
// expire, hold their upstreams' references, are forgotten with them and persist.
func TestOverflowRoutes(t *testing.T) {
	tb, clock := newTestTable(Config{MaxUpstreamsPerRoute: 2, OverflowRoutes: 3, TTL: time.Minute})
	req := prompt(system, user1)
	names := make([]string, 12)
	for i := range names {
		names[i] = fmt.Sprintf("10.0.0.%d:8000", i+1)
		tb.Learn("m", req, names[i])
		clock.Advance(time.Second)
	}
	got := match(tb, "m", req, names...)
	linkHolders := map[uint64]int{}
	for _, n := range names[:len(names)-2] { // the two newest are in the route itself
		linkHolders[overflowLink(n, 3)]++
	}
	// Each overflow route keeps its two newest holders; the older ones are dropped.
	kept := map[uint64]int{}
	want := make([]int, len(names))
	for i := len(names) - 1; i >= 0; i-- {
		if i >= len(names)-2 {
			want[i] = 528
			continue
		}
		l := overflowLink(names[i], 3)
		if kept[l] < 2 {
			kept[l]++
			want[i] = 528
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("Match() = %v, want %v (overflow routes %v)", got, want, linkHolders)
	}
	matched := 0
	for _, n := range got {
		if n > 0 {
			matched++
		}
	}
	if matched <= 2 {
		t.Fatalf("Match() = %v: only the route's own %d holders matched", got, 2)
	}
	// A prefix on no more upstreams than a route lists never spills: the table holds the same routes as
	// for one upstream.
	four, fourClock := newTestTable(Config{MaxUpstreamsPerRoute: 2, OverflowRoutes: 3, TTL: time.Minute})
	four.Learn("m", req, names[0])
	one := four.Stats().Routes
	for _, n := range names[:2] {
		four.Learn("m", req, n)
		fourClock.Advance(time.Second)
	}
	if s := four.Stats(); s.Routes != one {
		t.Errorf("two upstreams in routes of two: %d routes, want %d (no overflow routes)", s.Routes, one)
	}
	if s := tb.Stats(); s.Routes <= one {
		t.Errorf("twelve upstreams: %d routes, want overflow routes beyond the %d", s.Routes, one)
	}
	// Without overflow routes only the two newest match.
	plain, plainClock := newTestTable(Config{MaxUpstreamsPerRoute: 2, OverflowRoutes: -1, TTL: time.Minute})
	for _, n := range names {
		plain.Learn("m", req, n)
		plainClock.Advance(time.Second)
	}
	if got := match(plain, "m", req, names...); slices.ContainsFunc(got[:len(got)-2], func(n int) bool { return n > 0 }) {
		t.Errorf("Match() without overflow = %v, want only the last two", got)
	}
	checkInvariants(t, tb)

	// A snapshot carries the overflow routes.
	snap := tb.AppendSnapshot(nil)
	restored := New(Config{MaxUpstreamsPerRoute: 2, OverflowRoutes: 3, TTL: time.Minute, Now: clock.Now})
	if _, _, err := restored.Restore(snap); err != nil {
		t.Fatal(err)
	}
	if got := match(restored, "m", req, names...); !slices.Equal(got, want) {
		t.Errorf("Match() after Restore = %v, want %v", got, want)
	}

	// Forgetting a spilled holder takes it out of its overflow route.
	spilled := slices.IndexFunc(want[:len(want)-2], func(n int) bool { return n > 0 })
	tb.Forget(names[spilled])
	if got := match(tb, "m", req, names...); got[spilled] != 0 {
		t.Errorf("Match() after Forget(%s) = %v, want 0 for it", names[spilled], got)
	}
	checkInvariants(t, tb)

	// Overflow routes expire like the others.
	clock.Advance(2 * time.Minute)
	tb.Expire()
	if s := tb.Stats(); s.Routes != 0 || s.Upstreams != 0 {
		t.Errorf("Stats() after expiry = %+v, want nothing left", s)
	}
	checkInvariants(t, tb)
}

func TestForget(t *testing.T) {
	tb, _ := newTestTable(Config{})
	only := prompt(other)
	shared := prompt(system, user1)
	tb.Learn("m", only, "a")
	tb.Learn("m", shared, "a")
	tb.Learn("m", shared, "b")
	tb.Pin("m", "conv-1", "a")
	tb.Pin("m", "conv-2", "b")

	tb.Forget("a")
	if got, want := match(tb, "m", shared, "a", "b"), []int{0, 528}; !slices.Equal(got, want) {
		t.Errorf("Match(shared) after Forget = %v, want %v", got, want)
	}
	if got := match(tb, "m", only, "a"); got[0] != 0 {
		t.Errorf("Match(only) after Forget = %d, want 0", got[0])
	}
	if _, ok := tb.Pinned("m", "conv-1"); ok {
		t.Error("Pinned(conv-1) after Forget: ok, want not pinned")
	}
	if got, ok := tb.Pinned("m", "conv-2"); !ok || got != "b" {
		t.Errorf("Pinned(conv-2) = %q, %v, want b, true", got, ok)
	}
	if got := tb.RouteCount("a"); got != 0 {
		t.Errorf("RouteCount(a) = %d, want 0", got)
	}
	if s := tb.Stats(); s.Routes != 2 || s.Pins != 1 {
		t.Errorf("Stats() = %+v, want 2 routes (shared ones) and 1 pin", s)
	}

	// Back in the pool: it starts afresh and learns again.
	tb.Learn("m", shared, "a")
	if got, want := match(tb, "m", shared, "a", "b"), []int{528, 528}; !slices.Equal(got, want) {
		t.Errorf("Match() after re-learn = %v, want %v", got, want)
	}
	if got := tb.RouteCount("a"); got != 2 {
		t.Errorf("RouteCount(a) = %d, want 2", got)
	}
	if s := tb.Stats(); s.Upstreams != 2 {
		t.Errorf("Stats().Upstreams = %d, want 2 (the forgotten slot reclaimed)", s.Upstreams)
	}
	tb.Forget("never-seen") // no-op
	checkInvariants(t, tb)
}

func TestClear(t *testing.T) {
	tb, _ := newTestTable(Config{})
	req := prompt(system, user1)
	tb.Learn("m", req, "a")
	tb.Pin("m", "c", "a")
	tb.Clear()
	if s := tb.Stats(); s.Routes != 0 || s.Pins != 0 || s.Upstreams != 0 {
		t.Errorf("Stats() after Clear = %+v, want empty", s)
	}
	if got := match(tb, "m", req, "a"); got[0] != 0 {
		t.Errorf("Match() after Clear = %d, want 0", got[0])
	}
	if _, ok := tb.Pinned("m", "c"); ok {
		t.Error("Pinned() after Clear: ok, want not pinned")
	}
	tb.Learn("m", req, "a")
	if got := match(tb, "m", req, "a"); got[0] != 528 {
		t.Errorf("Match() after Clear and Learn = %d, want 528", got[0])
	}
}

func TestPin(t *testing.T) {
	tb, clock := newTestTable(Config{ConversationTTL: time.Hour, ConversationCapacity: 2})
	tb.Pin("m", "conv-1", "a")
	if got, ok := tb.Pinned("m", "conv-1"); !ok || got != "a" {
		t.Errorf("Pinned() = %q, %v, want a, true", got, ok)
	}
	if _, ok := tb.Pinned("other-model", "conv-1"); ok {
		t.Error("Pinned() under another model: ok, want not pinned")
	}
	tb.Pin("m", "conv-1", "b") // moved
	if got, _ := tb.Pinned("m", "conv-1"); got != "b" {
		t.Errorf("Pinned() after re-pin = %q, want b", got)
	}
	if s := tb.Stats(); s.Upstreams != 1 {
		t.Errorf("Stats().Upstreams = %d, want 1 (a reclaimed)", s.Upstreams)
	}
	clock.Advance(time.Hour)
	if _, ok := tb.Pinned("m", "conv-1"); !ok {
		t.Error("Pinned() at exactly TTL: not pinned, want pinned")
	}
	clock.Advance(time.Nanosecond)
	if _, ok := tb.Pinned("m", "conv-1"); ok {
		t.Error("Pinned() after TTL: pinned, want expired")
	}
	tb.Pin("m", "conv-2", "a") // sweeps conv-1
	tb.Pin("m", "conv-3", "a")
	tb.Pin("m", "conv-4", "a") // evicts conv-2
	if _, ok := tb.Pinned("m", "conv-2"); ok {
		t.Error("Pinned(conv-2) beyond capacity: pinned, want evicted")
	}
	s := tb.Stats()
	if s.Pins != 2 || s.Expired != 1 || s.Evictions != 1 {
		t.Errorf("Stats() = %+v, want 2 pins, 1 expired, 1 eviction", s)
	}
	tb.Pin("m", "", "a")
	tb.Pin("m", "conv-5", "")
	if _, ok := tb.Pinned("m", ""); ok {
		t.Error("Pinned(\"\"): pinned, want ignored")
	}
	checkInvariants(t, tb)
}

func TestModelScoping(t *testing.T) {
	tb, _ := newTestTable(Config{})
	req := prompt(system, user1)
	tb.Learn("llama-3.1-8b", req, "a")
	if got := match(tb, "qwen3-32b", req, "a"); got[0] != 0 {
		t.Errorf("Match() under another model = %d, want 0", got[0])
	}
	if got := match(tb, "llama-3.1-8b", req, "a"); got[0] != 528 {
		t.Errorf("Match() under the same model = %d, want 528", got[0])
	}
}

func TestMatchEdgeCases(t *testing.T) {
	tb, _ := newTestTable(Config{})
	req := prompt(system, user1)
	tb.Learn("m", req, "a")
	tb.Learn("m", nil, "a")
	tb.Learn("m", req, "")
	tb.Learn("m", []tokenize.Boundary{bd(3, 1)}, "z") // aligns to 0: nothing learned, nothing interned
	if s := tb.Stats(); s.Routes != 2 || s.Upstreams != 1 {
		t.Errorf("Stats() = %+v, want 2 routes and 1 upstream", s)
	}

	short := []int{-1}
	if got := tb.Match("m", req, []string{"b", "a"}, short); got != 528 || short[0] != 0 {
		t.Errorf("Match() with short cached = %d, cached %v, want 528, [0]", got, short)
	}
	if got := tb.Match("m", req, []string{"a"}, nil); got != 528 {
		t.Errorf("Match() with nil cached = %d, want 528", got)
	}
	dup := match(tb, "m", req, "a", "a")
	if !slices.Equal(dup, []int{528, 528}) {
		t.Errorf("Match() with a duplicate upstream = %v, want [528 528]", dup)
	}
	if got := tb.Match("m", nil, []string{"a"}, make([]int, 1)); got != 0 {
		t.Errorf("Match() without boundaries = %d, want 0", got)
	}
	many := make([]string, 40) // beyond the on-stack ID buffer
	for i := range many {
		many[i] = fmt.Sprint("u", i)
	}
	many[39] = "a"
	if got := match(tb, "m", req, many...); got[39] != 528 || got[0] != 0 {
		t.Errorf("Match() with 40 upstreams = %v, want 528 last", got)
	}
}

func TestMatchDoesNotAllocate(t *testing.T) {
	tb, _ := newTestTable(Config{})
	req := prompt(system, user1, asst1, user2)
	tb.Learn("m", req, "a")
	ups := []string{"a", "b", "c", "d"}
	cached := make([]int, len(ups))
	allocs := testing.AllocsPerRun(100, func() { tb.Match("m", req, ups, cached) })
	if allocs != 0 {
		t.Errorf("Match() allocations = %v, want 0", allocs)
	}
	allocs = testing.AllocsPerRun(100, func() { tb.Pinned("m", "conv") })
	if allocs != 0 {
		t.Errorf("Pinned() allocations = %v, want 0", allocs)
	}
}

func TestReconfigure(t *testing.T) {
	tb, clock := newTestTable(Config{Capacity: 10, TTL: time.Minute})
	reqs := make([][]tokenize.Boundary, 4)
	for i := range reqs {
		reqs[i] = prompt(msg{fmt.Sprint("prompt ", i), 40})
		tb.Learn("m", reqs[i], "a")
	}

	// A reload with the same shape keeps everything.
	tb.Reconfigure(Config{Capacity: 10, TTL: time.Minute, Now: clock.Now})
	if got := match(tb, "m", reqs[3], "a"); got[0] != 32 {
		t.Errorf("Match() after Reconfigure = %d, want 32", got[0])
	}

	// A smaller capacity evicts the least recently learned.
	tb.Reconfigure(Config{Capacity: 2, TTL: time.Minute, Now: clock.Now})
	if s := tb.Stats(); s.Routes != 2 || s.Evictions != 2 {
		t.Errorf("Stats() after shrinking = %+v, want 2 routes, 2 evictions", s)
	}
	if got := match(tb, "m", reqs[0], "a"); got[0] != 0 {
		t.Errorf("Match(evicted) = %d, want 0", got[0])
	}

	// A longer TTL applies to existing entries.
	clock.Advance(2 * time.Minute)
	if got := match(tb, "m", reqs[3], "a"); got[0] != 0 {
		t.Errorf("Match() past TTL = %d, want 0", got[0])
	}
	tb.Reconfigure(Config{Capacity: 2, TTL: time.Hour, Now: clock.Now})
	if got := match(tb, "m", reqs[3], "a"); got[0] != 32 {
		t.Errorf("Match() with longer TTL = %d, want 32", got[0])
	}

	// A changed block size keeps routes and reports them at the new alignment.
	tb.Reconfigure(Config{Capacity: 2, TTL: time.Hour, BlockSize: 32, Now: clock.Now})
	if got := match(tb, "m", reqs[3], "a"); got[0] != 32 {
		t.Errorf("Match() with block 32 = %d, want 32", got[0])
	}
	tb.Reconfigure(Config{Capacity: 2, TTL: time.Hour, BlockSize: 64, Now: clock.Now})
	if got := match(tb, "m", reqs[3], "a"); got[0] != 0 {
		t.Errorf("Match() with block 64 = %d, want 0 (40 tokens is no whole block)", got[0])
	}
	checkInvariants(t, tb)
}

func TestExportImport(t *testing.T) {
	src, clock := newTestTable(Config{TTL: time.Minute})
	old := prompt(other)
	src.Learn("m", old, "a")
	clock.Advance(2 * time.Minute) // old is expired and not exported
	req := prompt(system, user1)
	src.Learn("m", req, "a")
	clock.Advance(time.Second)
	src.Learn("m", req, "b")
	recs := src.Export()
	if len(recs) != 2 {
		t.Fatalf("Export() = %d records, want 2", len(recs))
	}
	if r := recs[0]; len(r.Upstreams) != 2 || r.Upstreams[0].Upstream != "b" {
		t.Errorf("Export()[0] = %+v, want b then a", r)
	}

	// Another instance (same clock for simplicity) computes the same keys.
	dst := New(Config{TTL: time.Minute, Now: clock.Now, MaxUpstreamsPerRoute: 2})
	dst.Learn("m", req, "c")
	dst.Import(recs)
	if got, want := match(dst, "m", req, "a", "b", "c"), []int{0, 528, 528}; !slices.Equal(got, want) {
		t.Errorf("Match() after Import = %v, want %v (c newest, then b; a beyond 2)", got, want)
	}
	if got := match(dst, "m", old, "a"); got[0] != 0 {
		t.Errorf("Match(expired route) after Import = %d, want 0", got[0])
	}
	stale := []RouteRecord{{Key: RouteKey(ModelHash("m"), 42), Upstreams: []UpstreamSeen{{"d", clock.Now().Add(-time.Hour)}}}}
	dst.Import(stale)
	if s := dst.Stats(); s.Routes != 2 || s.Upstreams != 2 {
		t.Errorf("Stats() after importing a stale route = %+v, want it skipped", s)
	}
	checkInvariants(t, dst)
}

func TestMatchSeen(t *testing.T) {
	tb, clock := newTestTable(Config{})
	conv := []tokenize.Boundary{bd(64, 1), bd(128, 2)}
	learnedA := clock.Now().UnixNano()
	tb.Learn("m", conv, "a")
	clock.Advance(time.Second)
	tb.Learn("m", conv[:1], "b")
	cached, seen := make([]int, 3), []int64{7, 7, 7}
	tb.MatchSeen("m", conv, []string{"a", "b", "c"}, cached, seen)
	if want := []int{128, 64, 0}; !slices.Equal(cached, want) {
		t.Errorf("MatchSeen() cached = %v, want %v", cached, want)
	}
	if want := []int64{learnedA, learnedA + int64(time.Second), 0}; !slices.Equal(seen, want) {
		t.Errorf("MatchSeen() seen = %v, want %v", seen, want)
	}
}

// TestStepsLearnedWithTheirMessageEnd: the steps inside a message are learned with its end when that end
// is news on the upstream (new there, or last seen in an earlier TTL/8 interval), not by every request
// that repeats the message; the first block is learned by every one (Match trusts nothing without it).
func TestStepsLearnedWithTheirMessageEnd(t *testing.T) {
	tb, clock := newTestTable(Config{TTL: 80 * time.Second}) // intervals of 10 s; the clock starts on one
	step := func(tokens int, hash uint64) tokenize.Boundary {
		return tokenize.Boundary{Tokens: tokens, Hash: hash, Step: true}
	}
	// A system prompt with two steps inside, then a question.
	req := []tokenize.Boundary{step(64, 1), step(128, 2), bd(160, 3), bd(200, 4)}
	partial := []tokenize.Boundary{step(64, 1), step(128, 2), bd(150, 99)} // shares the first two steps
	firstOnly := []tokenize.Boundary{step(64, 1), bd(100, 98)}
	seenBy := func(bounds []tokenize.Boundary, upstream string) (int, int64) {
		cached, seen := make([]int, 1), make([]int64, 1)
		tb.MatchSeen("m", bounds, []string{upstream}, cached, seen)
		return cached[0], seen[0]
	}
	t0 := clock.Now().UnixNano()
	tb.Learn("m", req, "a")
	clock.Advance(4 * time.Second)
	t1 := clock.Now().UnixNano()
	tb.Learn("m", req, "a")
	for _, c := range []struct {
		name   string
		bounds []tokenize.Boundary
		cached int
		seen   int64
	}{
		{"the whole prompt", req, 192, t1},
		{"a prompt ending at a step", partial, 128, t0},
		{"the first block", firstOnly, 64, t1},
	} {
		if cached, seen := seenBy(c.bounds, "a"); cached != c.cached || seen != c.seen {
			t.Errorf("%s, within the interval: matched %d learned at +%v, want %d at +%v", c.name,
				cached, time.Duration(seen-t0), c.cached, time.Duration(c.seen-t0))
		}
	}
	tb.Learn("m", req, "b") // new on b: its steps too
	if cached, seen := seenBy(partial, "b"); cached != 128 || seen != t1 {
		t.Errorf("a prompt ending at a step on a new upstream: matched %d at +%v, want 128 at +4s", cached, time.Duration(seen-t0))
	}
	clock.Advance(7 * time.Second) // the next interval
	t2 := clock.Now().UnixNano()
	tb.Learn("m", req, "a")
	if cached, seen := seenBy(partial, "a"); cached != 128 || seen != t2 {
		t.Errorf("a prompt ending at a step, in the next interval: matched %d at +%v, want 128 at +11s", cached, time.Duration(seen-t0))
	}
	for range 20 { // 100 s: past the TTL of the first learning
		clock.Advance(5 * time.Second)
		tb.Learn("m", req, "a")
	}
	if cached, _ := seenBy(partial, "a"); cached != 128 {
		t.Errorf("a prompt ending at a step after 100 s of requests repeating it: matched %d, want 128", cached)
	}
	checkInvariants(t, tb)
}
