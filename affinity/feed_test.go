package affinity

import (
	"fmt"
	"testing"
	"time"
)

// TestFeed records what Learn and Pin learn, once per refresh interval per entry, never what is imported,
// and drops beyond its capacity.
func TestFeed(t *testing.T) {
	tb, clock := newTestTable(Config{TTL: 80 * time.Second, ConversationTTL: 80 * time.Second})
	req := prompt(system, user1)
	tb.Learn("m", req, "a") // before EnableFeed: not recorded
	tb.EnableFeed(4)
	drain := func() []Change {
		got, _ := tb.DrainFeed(nil)
		return got
	}
	if got := drain(); len(got) != 0 {
		t.Errorf("DrainFeed() = %v, want nothing learned since EnableFeed", got)
	}
	tb.Learn("m", req, "b")
	tb.Pin("m", "conv", "b")
	got := drain()
	if len(got) != 3 || got[0].Upstream != "b" || got[2].Pin != true {
		t.Fatalf("DrainFeed() = %+v, want 2 routes and a pin on b", got)
	}
	// Learned longest first: a peer importing them in order keeps the first block the most recent.
	if got[1].Key != RouteKey(ModelHash("m"), req[0].Hash) || got[1].Seen != clock.Now().UnixNano() {
		t.Errorf("DrainFeed()[1] = %+v, want the system prompt's route seen now, after the longer one", got[1])
	}

	clock.Advance(5 * time.Second) // under TTL/8 = 10s: a refresh is not news
	tb.Learn("m", req, "b")
	tb.Pin("m", "conv", "b")
	if got := drain(); len(got) != 0 {
		t.Errorf("DrainFeed() after a refresh within TTL/8 = %+v, want nothing", got)
	}
	tb.Pin("m", "conv", "a") // a changed pin is news at once
	if got := drain(); len(got) != 1 || got[0].Upstream != "a" {
		t.Errorf("DrainFeed() after a changed pin = %+v, want it", got)
	}
	clock.Advance(6 * time.Second)
	tb.Learn("m", req, "b")
	if got := drain(); len(got) != 2 {
		t.Errorf("DrainFeed() after TTL/8 = %+v, want both routes again", got)
	}

	tb.ImportChanges([]Change{{Key: 1, Upstream: "c", Seen: clock.Now().UnixNano()}})
	if got := drain(); len(got) != 0 {
		t.Errorf("DrainFeed() after ImportChanges = %+v, want imports never recorded", got)
	}

	for i := range 3 {
		tb.Learn("m", prompt(msg{fmt.Sprint("new ", i), 100}, user1), "a")
	}
	got, dropped := tb.DrainFeed(nil)
	if len(got) != 4 || dropped != 2 {
		t.Errorf("DrainFeed() = %d changes, %d dropped, want 4 and 2", len(got), dropped)
	}
	if s := tb.Stats(); s.FeedDropped != 2 {
		t.Errorf("Stats().FeedDropped = %d, want 2", s.FeedDropped)
	}
	tb.EnableFeed(0)
	tb.Learn("m", prompt(other), "a")
	if got := drain(); len(got) != 0 {
		t.Errorf("DrainFeed() with the feed off = %+v, want nothing", got)
	}
	checkInvariants(t, tb)
}

// TestRemoteEvictedFirst: a full table evicts routes known only from peers before its own, and a route
// learned here after a peer's import becomes local.
func TestRemoteEvictedFirst(t *testing.T) {
	tb, clock := newTestTable(Config{Capacity: 4})
	now := clock.Now().UnixNano()
	var local, remote []uint64
	for i := range 2 {
		b := prompt(msg{fmt.Sprint("local ", i), 100})
		tb.Learn("m", b, "a")
		local = append(local, RouteKey(ModelHash("m"), b[0].Hash))
	}
	for i := range 3 {
		key := RouteKey(ModelHash("m"), uint64(1000+i))
		tb.ImportChanges([]Change{{Key: key, Upstream: "peer", Seen: now}})
		remote = append(remote, key)
	}
	if s := tb.Stats(); s.Routes != 4 || s.RemoteRoutes != 2 {
		t.Errorf("Stats() = %+v, want 4 routes of which 2 remote (the oldest remote evicted)", s)
	}
	// Two more local routes push out the remaining remote ones, not the older local ones.
	for i := range 2 {
		tb.Learn("m", prompt(msg{fmt.Sprint("later ", i), 100}), "a")
	}
	s := tb.Stats()
	if s.Routes != 4 || s.RemoteRoutes != 0 {
		t.Errorf("Stats() = %+v, want 4 local routes", s)
	}
	for _, k := range local {
		if !tb.routes.Contains(k) {
			t.Errorf("local route %x evicted while remote routes were held", k)
		}
	}

	// Promotion: learning a prefix a peer sent makes it local, keeping the peer's entry.
	tb2, _ := newTestTable(Config{Capacity: 4})
	b := prompt(system)
	key := RouteKey(ModelHash("m"), b[0].Hash)
	tb2.ImportChanges([]Change{{Key: key, Upstream: "peer", Seen: now}})
	tb2.Learn("m", b, "a")
	if s := tb2.Stats(); s.Routes != 1 || s.RemoteRoutes != 0 {
		t.Errorf("Stats() after learning an imported prefix = %+v, want 1 local route", s)
	}
	if got := match(tb2, "m", b, "a", "peer"); got[0] == 0 || got[1] == 0 {
		t.Errorf("Match() = %v, want both the local and the peer's entry", got)
	}
	checkInvariants(t, tb)
	checkInvariants(t, tb2)
}

// TestImportPins: a peer's pin wins when it is later, loses when it is older, and expired ones are skipped.
func TestImportPins(t *testing.T) {
	tb, clock := newTestTable(Config{ConversationTTL: time.Minute})
	tb.Pin("m", "conv", "a")
	key := pinKey("m", "conv")
	now := clock.Now().UnixNano()
	tb.ImportChanges([]Change{{Key: key, Upstream: "b", Seen: now - 1, Pin: true}})
	if got, _ := tb.Pinned("m", "conv"); got != "a" {
		t.Errorf("Pinned() after an older peer pin = %q, want a", got)
	}
	clock.Advance(time.Second)
	tb.ImportChanges([]Change{{Key: key, Upstream: "b", Seen: clock.Now().UnixNano(), Pin: true}})
	if got, _ := tb.Pinned("m", "conv"); got != "b" {
		t.Errorf("Pinned() after a later peer pin = %q, want b", got)
	}
	tb.ImportChanges([]Change{{Key: pinKey("m", "old"), Upstream: "c", Seen: now - int64(2*time.Minute), Pin: true}})
	if _, ok := tb.Pinned("m", "old"); ok {
		t.Error("Pinned(old) = ok, want an expired peer pin skipped")
	}
	checkInvariants(t, tb)
}

// TestMatchPeers: the longest claim is reported as known only from peers while its route is in the remote
// tier (imported), and no longer once this instance has learned it too; a shorter local claim does not
// hide a longer remote one.
func TestMatchPeers(t *testing.T) {
	tb, clock := newTestTable(Config{})
	now := clock.Now().UnixNano()
	b := prompt(msg{"system", 200}, msg{"question", 40})
	ups := []string{"a", "b"}
	cached := make([]int, len(ups))
	if longest, peers := tb.MatchPeers("m", b, ups, cached, nil); longest != 0 || peers {
		t.Errorf("empty table: longest %d, peers %t", longest, peers)
	}
	tb.Learn("m", b[:1], "a") // this instance sent the system prompt alone to a
	var changes []Change
	for _, x := range b {
		changes = append(changes, Change{Key: RouteKey(ModelHash("m"), x.Hash), Upstream: "b", Seen: now})
	}
	tb.ImportChanges(changes) // a peer sent the whole prompt to b
	longest, peers := tb.MatchPeers("m", b, ups, cached, nil)
	if !peers || longest != cached[1] || cached[0] >= cached[1] {
		t.Errorf("after a peer's longer route: longest %d (cached %v), peers %t; want b's claim, from peers", longest, cached, peers)
	}
	tb.Learn("m", b, "b")
	if _, peers := tb.MatchPeers("m", b, ups, cached, nil); peers {
		t.Errorf("learned here too: still reported as known only from peers")
	}
}
