package affinity

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/tokenize"
)

// TestSnapshotRoundTrip restores routes, remote routes and pins into a fresh table: the same requests match
// the same upstreams, expired entries are left out, and remote routes stay remote.
func TestSnapshotRoundTrip(t *testing.T) {
	src, clock := newTestTable(Config{TTL: time.Minute, ConversationTTL: 5 * time.Minute})
	old := prompt(other)
	src.Learn("m", old, "c")
	src.Pin("m", "conv-old", "c")
	clock.Advance(2 * time.Minute) // old route expired, old pin not
	req := prompt(system, user1, asst1)
	src.Learn("m", req, "a")
	clock.Advance(time.Second)
	src.Learn("m", prompt(system, user1), "b")
	src.Pin("m", "conv-1", "b")
	peer := prompt(user2, asst2)
	src.ImportChanges([]Change{
		{Key: RouteKey(ModelHash("m"), peer[1].Hash), Upstream: "d", Seen: clock.Now().UnixNano()},
		{Key: RouteKey(ModelHash("m"), peer[0].Hash), Upstream: "d", Seen: clock.Now().UnixNano()},
	})

	snap := src.AppendSnapshot(nil)
	dst := New(Config{TTL: time.Minute, ConversationTTL: 5 * time.Minute, Now: clock.Now})
	routes, pins, err := dst.Restore(snap)
	if err != nil {
		t.Fatalf("Restore() error = %v", err)
	}
	if routes != 5 || pins != 2 {
		t.Errorf("Restore() = %d routes %d pins, want 5 and 2", routes, pins)
	}
	for _, tc := range []struct {
		name   string
		bounds []tokenize.Boundary
	}{
		{"full conversation", req},
		{"expired route", old},
		{"remote route", peer},
	} {
		got := match(dst, "m", tc.bounds, "a", "b", "c", "d")
		if want := match(src, "m", tc.bounds, "a", "b", "c", "d"); !slices.Equal(got, want) {
			t.Errorf("%s: Match() after Restore = %v, want %v as before", tc.name, got, want)
		}
	}
	if got := match(dst, "m", req, "a", "b", "c", "d"); got[0] == 0 || got[1] == 0 || got[3] != 0 {
		t.Errorf("Match(full conversation) = %v, want a and b only", got)
	}
	if got := match(dst, "m", peer, "d"); got[0] == 0 {
		t.Error("Match(remote route) = 0, want the remote route restored")
	}
	if got, _ := dst.Pinned("m", "conv-1"); got != "b" {
		t.Errorf("Pinned(conv-1) = %q, want b", got)
	}
	if got, _ := dst.Pinned("m", "conv-old"); got != "c" {
		t.Errorf("Pinned(conv-old) = %q, want c", got)
	}
	if s := dst.Stats(); s.RemoteRoutes != 2 {
		t.Errorf("Stats().RemoteRoutes = %d, want 2", s.RemoteRoutes)
	}
	checkInvariants(t, dst)

	// Restored later than the TTL: nothing is live any more.
	clock.Advance(10 * time.Minute)
	late := New(Config{TTL: time.Minute, ConversationTTL: 5 * time.Minute, Now: clock.Now})
	if routes, pins, err := late.Restore(snap); err != nil || routes+pins != 0 {
		t.Errorf("Restore() after TTL = %d, %d, %v, want nothing restored", routes, pins, err)
	}
	checkInvariants(t, late)
}

// TestSnapshotDamaged: every truncation, a flipped bit and a later version leave the table empty with a
// sentinel error.
func TestSnapshotDamaged(t *testing.T) {
	src, clock := newTestTable(Config{})
	src.Learn("m", prompt(system, user1, asst1, user2), "a")
	src.Pin("m", "conv", "a")
	snap := src.AppendSnapshot(nil)
	for n := range len(snap) {
		dst := New(Config{Now: clock.Now})
		if _, _, err := dst.Restore(snap[:n]); !errors.Is(err, ErrSnapshotCorrupt) {
			t.Fatalf("Restore(first %d of %d bytes) error = %v, want ErrSnapshotCorrupt", n, len(snap), err)
		}
		if s := dst.Stats(); s.Routes+s.Pins+s.Upstreams != 0 {
			t.Fatalf("Restore(first %d bytes) changed the table: %+v", n, s)
		}
	}
	for i := range len(snap) {
		bad := slices.Clone(snap)
		bad[i] ^= 0x10
		dst := New(Config{Now: clock.Now})
		if _, _, err := dst.Restore(bad); err == nil {
			t.Fatalf("Restore(bit flipped at %d) succeeded", i)
		}
	}
	future := slices.Clone(snap)
	future[len(snapshotMagic)] = SnapshotVersion + 1
	if _, _, err := New(Config{}).Restore(future); !errors.Is(err, ErrSnapshotVersion) {
		t.Errorf("Restore(version %d) error = %v, want ErrSnapshotVersion", SnapshotVersion+1, err)
	}
}

// TestSnapshotSize pins the bytes per route the package doc states.
func TestSnapshotSize(t *testing.T) {
	tb, _ := newTestTable(Config{})
	fill(tb, 10_000)
	empty := len(New(Config{}).AppendSnapshot(nil))
	n := len(tb.AppendSnapshot(nil)) - empty
	perRoute := float64(n) / 10_000
	t.Logf("%d routes: %d bytes, %.1f bytes/route", 10_000, n, perRoute)
	if perRoute > 13 {
		t.Errorf("snapshot costs %.1f bytes a route, want at most 13", perRoute)
	}
}

// FuzzRestore: no input makes Restore panic, and whatever it accepts leaves the table consistent.
func FuzzRestore(f *testing.F) {
	src, clock := newTestTable(Config{})
	src.Learn("m", prompt(system, user1, asst1), "a")
	src.Learn("m", prompt(system, other), "b")
	src.Pin("m", "conv", "a")
	f.Add(src.AppendSnapshot(nil))
	f.Add([]byte(snapshotMagic))
	if seeds, _ := filepath.Glob("testdata/snapshot-*"); len(seeds) > 0 {
		for _, s := range seeds {
			if b, err := os.ReadFile(s); err == nil {
				f.Add(b)
			}
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		dst := New(Config{Now: clock.Now, Capacity: 8})
		_, _, _ = dst.Restore(data)
		checkInvariants(t, dst)
	})
}
