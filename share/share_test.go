package share

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/share/redistest"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

func bounds(conv, turns int) []tokenize.Boundary {
	var b []tokenize.Boundary
	for i := range turns {
		b = append(b, tokenize.Boundary{Tokens: 64 * (i + 1), Hash: uint64(conv)<<16 | uint64(i+1)})
	}
	return b
}

// TestBatchRoundTrip decodes what appendBatch encodes and pins the bytes per change the package doc
// states.
func TestBatchRoundTrip(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	changes := []affinity.Change{
		{Key: 1, Upstream: "10.0.0.1:8000", Seen: now.UnixNano()},
		{Key: 2, Upstream: "10.0.0.2:8000", Seen: now.Add(-50 * time.Millisecond).UnixNano(), Pin: true},
		{Key: 3, Upstream: "10.0.0.1:8000", Seen: now.Add(-time.Second).UnixNano()},
	}
	b := appendBatch(nil, 42, now, changes)
	instance, got, err := decodeBatch(b, nil)
	if err != nil || instance != 42 {
		t.Fatalf("decodeBatch() = %d, %v, want instance 42", instance, err)
	}
	if !slices.Equal(got, changes) {
		t.Errorf("decodeBatch() = %+v, want %+v", got, changes)
	}
	for n := range len(b) {
		if _, _, err := decodeBatch(b[:n], nil); !errors.Is(err, errBatch) {
			t.Fatalf("decodeBatch(first %d of %d bytes) error = %v, want errBatch", n, len(b), err)
		}
	}

	many := make([]affinity.Change, 1000)
	for i := range many {
		many[i] = affinity.Change{Key: uint64(i) * 0x9e3779b97f4a7c15, Upstream: fmt.Sprintf("10.0.0.%d:8000", i%8), Seen: now.UnixNano()}
	}
	small, large := len(appendBatch(nil, 1, now, many[:8])), len(appendBatch(nil, 1, now, many))
	perChange := float64(large-small) / float64(len(many)-8)
	t.Logf("%.2f bytes a change; a batch of 1000 changes on 8 upstreams is %d bytes", perChange, large)
	if perChange > 10.1 {
		t.Errorf("a change costs %.1f bytes, want 10", perChange)
	}
}

// FuzzDecodeBatch: no input makes decodeBatch panic, and a failed decode adds nothing.
func FuzzDecodeBatch(f *testing.F) {
	now := time.Unix(1_700_000_000, 0)
	f.Add(appendBatch(nil, 7, now, []affinity.Change{{Key: 1, Upstream: "a:1", Seen: now.UnixNano()}, {Key: 2, Upstream: "b:1", Pin: true}}))
	f.Add([]byte{batchVersion})
	f.Fuzz(func(t *testing.T, b []byte) {
		_, got, err := decodeBatch(b, nil)
		if err != nil && len(got) != 0 {
			t.Errorf("decodeBatch() returned %d changes with error %v", len(got), err)
		}
	})
}

// waitFor polls cond until it holds or 10 seconds pass: the condition is another goroutine's work
// arriving through Redis, which no clock in the test controls.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func startSharer(t *testing.T, tb *affinity.Table, url string) *Sharer {
	t.Helper()
	return startSharerWith(t, tb, Config{URL: url, Prefix: t.Name() + ":", FlushInterval: 20 * time.Millisecond, Timeout: 300 * time.Millisecond})
}

// startSharerWith starts a sharer of tb with cfg, stopped at the test's end, and waits for its warm-up.
func startSharerWith(t *testing.T, tb *affinity.Table, cfg Config) *Sharer {
	t.Helper()
	s, err := Start(tb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s.WaitWarm(ctx)
	return s
}

// TestShare: what one instance learns reaches the other as remote routes and pins; a third instance
// started later warms up from the stream.
func TestShare(t *testing.T) {
	srv := redistest.Start(t)
	a, b := affinity.New(affinity.Config{}), affinity.New(affinity.Config{})
	sa, sb := startSharer(t, a, srv.URL()), startSharer(t, b, srv.URL())
	if !sa.Status().Connected || !sb.Status().Connected {
		t.Fatalf("Status() = %+v, %+v, want both connected", sa.Status(), sb.Status())
	}
	conv := bounds(1, 3)
	a.Learn("m", conv, "10.0.0.1:8000")
	a.Pin("m", "conv-1", "10.0.0.1:8000")
	waitFor(t, "b to import a's routes", func() bool { return b.Stats().RemoteRoutes == 3 })
	waitFor(t, "b to import a's pin", func() bool { _, ok := b.Pinned("m", "conv-1"); return ok })
	if got := b.Match("m", conv, []string{"10.0.0.1:8000", "10.0.0.2:8000"}, make([]int, 2)); got != 192 {
		t.Errorf("b.Match() = %d, want 192 from a's routes", got)
	}
	if s := a.Stats(); s.RemoteRoutes != 0 {
		t.Errorf("a.Stats().RemoteRoutes = %d, want 0 (its own changes are not imported back)", s.RemoteRoutes)
	}

	c := affinity.New(affinity.Config{})
	sc := startSharer(t, c, srv.URL())
	if s := sc.Status(); !s.WarmedUp || c.Stats().RemoteRoutes != 3 {
		t.Errorf("late instance: Status() = %+v, %d remote routes, want warmed up with 3", s, c.Stats().RemoteRoutes)
	}
	if got, _ := c.Pinned("m", "conv-1"); got != "10.0.0.1:8000" {
		t.Errorf("late instance: Pinned() = %q, want a's pin", got)
	}
	st := sa.Status()
	t.Logf("a published %d changes in %d batches, %d bytes", st.PublishedChanges, st.PublishedBatches, st.PublishedBytes)
}

// TestRedisDown: with Redis killed, Learn never waits and the sharer says it is disconnected; once Redis
// is back it reconnects and sharing resumes.
func TestRedisDown(t *testing.T) {
	srv := redistest.Start(t)
	a, b := affinity.New(affinity.Config{}), affinity.New(affinity.Config{})
	sa, sb := startSharer(t, a, srv.URL()), startSharer(t, b, srv.URL())
	srv.Kill()
	start := time.Now()
	for i := range 1000 {
		a.Learn("m", bounds(100+i, 2), "10.0.0.1:8000")
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("1000 Learns with Redis down took %s", d)
	}
	waitFor(t, "a to notice redis is down", func() bool { return !sa.Status().Connected })
	waitFor(t, "b to notice redis is down", func() bool { return !sb.Status().Connected })

	srv.Restart()
	waitFor(t, "a to reconnect", func() bool { return sa.Status().Connected })
	waitFor(t, "b to reconnect", func() bool { return sb.Status().Connected })
	before := b.Stats().RemoteRoutes
	a.Learn("m", bounds(1, 2), "10.0.0.2:8000")
	waitFor(t, "b to import after the restart", func() bool { return b.Stats().RemoteRoutes >= before+2 })
	if s := sa.Status(); s.DroppedChanges == 0 || s.ReconnectAttempts == 0 && sb.Status().ReconnectAttempts == 0 {
		t.Errorf("Status() = %+v, want dropped changes and reconnect attempts counted", s)
	}
}

// TestUnreachable: a sharer whose Redis does not exist starts at once, disconnected.
func TestUnreachable(t *testing.T) {
	tb := affinity.New(affinity.Config{})
	s, err := Start(tb, Config{URL: "redis://127.0.0.1:1/0", Timeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if !s.WaitWarm(ctx) {
		t.Fatal("WaitWarm() did not return after the failed warm-up")
	}
	if st := s.Status(); st.Connected || st.LastError == "" {
		t.Errorf("Status() = %+v, want disconnected with an error", st)
	}
	tb.Learn("m", bounds(1, 2), "10.0.0.1:8000")
	if _, err := Start(tb, Config{URL: "http://nope"}); err == nil {
		t.Error("Start(http URL) succeeded, want an error")
	}
}

// TestShareModels: what instances publish beside their routes reaches an instance started later, newest
// first, without its own and without what is older than the window (deleted from the hash).
func TestShareModels(t *testing.T) {
	srv := redistest.Start(t)
	prefix := t.Name() + ":"
	start := func(models string, peers func([][]byte)) *Sharer {
		t.Helper()
		cfg := Config{URL: srv.URL(), Prefix: prefix, FlushInterval: 10 * time.Millisecond, ModelsInterval: 20 * time.Millisecond,
			Timeout: 300 * time.Millisecond, PeerModels: peers}
		if models != "" {
			cfg.Models = func() []byte { return []byte(models) }
		}
		return startSharerWith(t, affinity.New(affinity.Config{}), cfg)
	}
	// A field older than the window, as a crashed instance of long ago left it, and one not written by
	// this package.
	rc := srv.Client()
	defer rc.Close()
	old := binary.BigEndian.AppendUint64(nil, uint64(time.Now().Add(-DefaultWindow-time.Minute).UnixMilli()))
	if err := rc.HSet(context.Background(), prefix+"models", "dead", append(old, "stale"...), "junk", "x").Err(); err != nil {
		t.Fatal(err)
	}

	a := start("from a", nil)
	waitFor(t, "a to publish", func() bool { return a.Status().PublishedModels > 0 })
	time.Sleep(5 * time.Millisecond) // b's publication is stamped later than a's
	b := start("from b", nil)
	waitFor(t, "b to publish", func() bool { return b.Status().PublishedModels > 0 })

	var got []string
	c := start("from c", func(blobs [][]byte) {
		for _, b := range blobs {
			got = append(got, string(b))
		}
	})
	// a and b republish every 20ms: whichever published last is first.
	if len(got) != 2 || !slices.Contains(got, "from a") || !slices.Contains(got, "from b") {
		t.Fatalf("peer models = %q, want a's and b's", got)
	}
	if st := c.Status(); st.PeerModels != 2 {
		t.Errorf("Status().PeerModels = %d, want 2", st.PeerModels)
	}
	fields, err := rc.HKeys(context.Background(), prefix+"models").Result()
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(fields, "dead") || slices.Contains(fields, "junk") {
		t.Errorf("hash fields after a warm-up = %q, want the stale ones deleted", fields)
	}
	if ttl := rc.PTTL(context.Background(), prefix+"models").Val(); ttl <= 0 || ttl > DefaultWindow {
		t.Errorf("hash TTL = %s, want at most the window", ttl)
	}

	// Newest first: a and b stopped, two publications of known ages, and c still publishing (the newest).
	a.Close()
	b.Close()
	now := time.Now()
	for field, age := range map[string]time.Duration{"older": 2 * time.Minute, "newer": time.Minute} {
		stamp := binary.BigEndian.AppendUint64(nil, uint64(now.Add(-age).UnixMilli()))
		if err := rc.HSet(context.Background(), prefix+"models", field, append(stamp, field...)).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := rc.HDel(context.Background(), prefix+"models", strconv.FormatUint(a.instance, 16), strconv.FormatUint(b.instance, 16)).Err(); err != nil {
		t.Fatal(err)
	}
	var order []string
	start("", func(blobs [][]byte) {
		for _, b := range blobs {
			order = append(order, string(b))
		}
	})
	if want := []string{"from c", "newer", "older"}; !slices.Equal(order, want) {
		t.Errorf("peer models = %q, want newest first %q", order, want)
	}
}
