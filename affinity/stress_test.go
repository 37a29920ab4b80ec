package affinity

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/tokenize"
)

// atomicClock is a fake clock safe for concurrent use.
type atomicClock struct{ nanos atomic.Int64 }

func (c *atomicClock) Now() time.Time          { return time.Unix(0, c.nanos.Load()) }
func (c *atomicClock) Advance(d time.Duration) { c.nanos.Add(int64(d)) }

// checkInvariants verifies the table's internal bookkeeping: sizes within capacity, and every upstream
// slot's reference counts equal to the references actually held by routes and pins.
func checkInvariants(t *testing.T, tb *Table) {
	t.Helper()
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if n := tb.routes.Len() + tb.remote.Len(); n > tb.cfg.Capacity {
		t.Errorf("routes = %d local + %d remote, above Capacity %d", tb.routes.Len(), tb.remote.Len(), tb.cfg.Capacity)
	}
	if n := tb.pins.Len(); n > tb.cfg.ConversationCapacity {
		t.Errorf("pins = %d, above ConversationCapacity %d", n, tb.cfg.ConversationCapacity)
	}
	refs := make(map[uint32]int32)
	routes := make(map[uint32]int32)
	keys := append(tb.routes.Keys(), tb.remote.Keys()...)
	values := append(tb.routes.Values(), tb.remote.Values()...)
	for i, k := range keys {
		r := values[i]
		if tb.routes.Contains(k) && tb.remote.Contains(k) {
			t.Errorf("route %x is both local and remote", k)
		}
		seen := make(map[uint32]bool)
		n := 0
		for _, id := range r.ids {
			if id == 0 {
				continue
			}
			if seen[id] {
				t.Errorf("route %x lists upstream %d twice", k, id)
			}
			seen[id] = true
			refs[id]++
			routes[id]++
			n++
		}
		if n == 0 {
			t.Errorf("route %x is empty", k)
		}
	}
	for _, k := range tb.pins.Keys() {
		p, _ := tb.pins.Peek(k)
		refs[p.id]++
	}
	inUse := 0
	for id := 1; id < len(tb.ups.slots); id++ {
		s := tb.ups.slots[id]
		if s.refs != refs[uint32(id)] || s.routes != routes[uint32(id)] {
			t.Errorf("slot %d (%q): refs %d routes %d, want %d and %d", id, s.name, s.refs, s.routes, refs[uint32(id)], routes[uint32(id)])
		}
		if s.refs > 0 {
			inUse++
			if s.live && tb.ups.byName[s.name] != uint32(id) {
				t.Errorf("live slot %d (%q) not in byName", id, s.name)
			}
		}
	}
	if inUse != tb.ups.inUse() {
		t.Errorf("slots in use = %d, inUse() = %d", inUse, tb.ups.inUse())
	}
	if len(tb.ups.byName) > inUse {
		t.Errorf("byName holds %d names for %d slots in use", len(tb.ups.byName), inUse)
	}
}

// TestStress runs Learn, Match, Pin, Pinned, Forget, Expire, Reconfigure, ImportChanges, DrainFeed and
// AppendSnapshot/Restore from 8 goroutines under -race,
// with a small capacity so that eviction, expiry and slot reuse all happen, then checks the bookkeeping.
func TestStress(t *testing.T) {
	clock := &atomicClock{}
	clock.nanos.Store(time.Unix(1_700_000_000, 0).UnixNano())
	cfg := Config{Capacity: 200, ConversationCapacity: 50, TTL: time.Second, ConversationTTL: time.Second, MaxUpstreamsPerRoute: 3, Now: clock.Now}
	tb := New(cfg)
	tb.EnableFeed(100)

	// A pool of conversations: 20 system prompts, each continued by several turns.
	var prompts [][]tokenize.Boundary
	for s := range 20 {
		for c := range 10 {
			msgs := []msg{{fmt.Sprint("system ", s), 100 + 10*s}}
			for turn := range 6 {
				msgs = append(msgs, msg{fmt.Sprint("conv ", c, " turn ", turn), 20 + 7*turn})
				prompts = append(prompts, prompt(msgs...))
			}
		}
	}
	upstreams := []string{"u0", "u1", "u2", "u3", "u4", "u5", "u6", "u7", "u8", "u9"}

	const goroutines, iterations = 8, 3000
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			cached := make([]int, 4)
			var changes []Change
			for i := range iterations {
				p := prompts[rng.IntN(len(prompts))]
				u := upstreams[rng.IntN(len(upstreams))]
				switch op := rng.IntN(100); {
				case op < 34:
					tb.Learn("m", p, u)
				case op < 38:
					now := clock.Now().UnixNano()
					tb.ImportChanges([]Change{
						{Key: RouteKey(ModelHash("m"), p[rng.IntN(len(p))].Hash), Upstream: u, Seen: now},
						{Key: uint64(rng.IntN(80)), Upstream: u, Seen: now, Pin: true},
					})
				case op < 39:
					changes, _ = tb.DrainFeed(changes[:0])
				case op < 40:
					if _, _, err := tb.Restore(tb.AppendSnapshot(nil)); err != nil {
						t.Errorf("Restore(AppendSnapshot()) = %v", err)
					}
				case op < 80:
					cand := upstreams[rng.IntN(7):][:4]
					longest := tb.Match("m", p, cand, cached)
					if longest > p[len(p)-1].Tokens {
						t.Errorf("Match() = %d, longer than the prompt's %d tokens", longest, p[len(p)-1].Tokens)
					}
				case op < 88:
					tb.Pin("m", fmt.Sprint("conv", rng.IntN(80)), u)
				case op < 94:
					if got, ok := tb.Pinned("m", fmt.Sprint("conv", rng.IntN(80))); ok && got == "" {
						t.Error("Pinned() = \"\", true")
					}
				case op < 96:
					tb.Forget(u)
				case op < 97:
					tb.Expire()
				case op < 98:
					tb.Reconfigure(Config{Capacity: 150 + rng.IntN(100), ConversationCapacity: 50, TTL: time.Second, ConversationTTL: time.Second, Now: clock.Now})
				default:
					s := tb.Stats()
					if s.Routes > 250 || s.Pins > 50 || s.Upstreams > len(upstreams)*2 {
						t.Errorf("Stats() = %+v, beyond the bounds", s)
					}
					_ = tb.RouteCount(u)
				}
				if i%50 == 0 {
					clock.Advance(100 * time.Millisecond)
				}
			}
		})
	}
	wg.Wait()
	checkInvariants(t, tb)
	s := tb.Stats()
	t.Logf("Stats() = %+v", s)
	if s.Evictions == 0 || s.Expired == 0 {
		t.Errorf("Stats() = %+v, want evictions and expiries to have happened", s)
	}
	tb.Clear()
	checkInvariants(t, tb)
}
