package caddyllm

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// upstreamLoad is the work this process has in flight to one upstream. It is process-global, keyed by the
// upstream's dial address, so it survives config reloads: a request that started under an old config
// releases into the same counters the new config reads.
type upstreamLoad struct {
	tokens   atomic.Int64
	requests atomic.Int64
	lastUsed atomic.Int64 // unix nanoseconds of the last reserve or release

	// saturatedUntil (unix nanoseconds) is set when the upstream answers 429 (vLLM's queue is full): until
	// then it is chosen only if nothing else is available. Its learned routes are kept.
	saturatedUntil atomic.Int64
}

// loadTable maps dial addresses to their loads. Entries are created on first use and removed only when
// idle (nothing in flight) for idleAfter once the table holds more than sweepAbove of them, so memory is
// bounded by the number of upstreams in recent use however many dynamic upstreams come and go.
//
// Reserving holds the read lock while it increments, and sweeping holds the write lock while it checks and
// deletes, so an entry is never deleted between being looked up and being reserved.
type loadTable struct {
	mu sync.RWMutex
	m  map[string]*upstreamLoad
}

const (
	sweepAbove = 1024
	idleAfter  = 10 * time.Minute
)

var loads = &loadTable{m: make(map[string]*upstreamLoad)}

// reservation is weight reserved on one upstream, released exactly once.
type reservation struct {
	load   *upstreamLoad
	tokens int64
	dial   string
}

// reserve adds one request of the given weight to dial's load.
func (t *loadTable) reserve(dial string, tokens int64) *reservation {
	now := time.Now().UnixNano()
	t.mu.RLock()
	l := t.m[dial]
	if l != nil {
		l.add(tokens, 1, now)
		t.mu.RUnlock()
		return &reservation{load: l, tokens: tokens, dial: dial}
	}
	t.mu.RUnlock()

	t.mu.Lock()
	defer t.mu.Unlock()
	l = t.m[dial]
	if l == nil {
		if len(t.m) >= sweepAbove {
			t.sweepLocked(now)
		}
		l = new(upstreamLoad)
		t.m[dial] = l
	}
	l.add(tokens, 1, now)
	return &reservation{load: l, tokens: tokens, dial: dial}
}

// get returns dial's in-flight tokens and requests; zero for an upstream never used.
func (t *loadTable) get(dial string) (tokens, requests int64) {
	tokens, requests, _ = t.state(dial, 0)
	return tokens, requests
}

// saturate marks dial saturated until the given time.
func (t *loadTable) saturate(dial string, until time.Time) {
	t.mu.RLock()
	l := t.m[dial]
	t.mu.RUnlock()
	if l != nil {
		l.saturatedUntil.Store(until.UnixNano())
	}
}

// saturated reports whether dial is marked saturated at now.
func (t *loadTable) saturated(dial string, now int64) bool {
	_, _, saturated := t.state(dial, now)
	return saturated
}

// state returns dial's in-flight tokens and requests and whether it is saturated at now, in one lookup.
func (t *loadTable) state(dial string, now int64) (tokens, requests int64, saturated bool) {
	t.mu.RLock()
	l := t.m[dial]
	t.mu.RUnlock()
	if l == nil {
		return 0, 0, false
	}
	return l.tokens.Load(), l.requests.Load(), l.saturatedUntil.Load() > now
}

// snapshot returns every known upstream's load, in no particular order.
func (t *loadTable) snapshot() []upstreamInflight {
	t.mu.RLock()
	defer t.mu.RUnlock()
	out := make([]upstreamInflight, 0, len(t.m))
	for dial, l := range t.m {
		out = append(out, upstreamInflight{Dial: dial, Tokens: l.tokens.Load(), Requests: l.requests.Load()})
	}
	return out
}

type upstreamInflight struct {
	Dial     string
	Tokens   int64
	Requests int64
}

// sweepLocked deletes idle entries. The caller holds the write lock.
func (t *loadTable) sweepLocked(now int64) {
	for dial, l := range t.m {
		if l.requests.Load() == 0 && l.tokens.Load() == 0 && now-l.lastUsed.Load() > int64(idleAfter) &&
			l.saturatedUntil.Load() < now {
			delete(t.m, dial)
		}
	}
}

func (l *upstreamLoad) add(tokens, requests, now int64) {
	l.tokens.Add(tokens)
	l.requests.Add(requests)
	l.lastUsed.Store(now)
}

func (r *reservation) release() {
	r.load.add(-r.tokens, -1, time.Now().UnixNano())
}

// reservationHolder owns the one reservation a request holds at a time. Each Select swaps in the new
// attempt's reservation and releases the previous one; the request's end (its context is done: the
// handler returned, the stream ended, or the client went away) releases the last. The lock is needed
// because the end runs on its own goroutine, possibly while a retry is selecting.
type reservationHolder struct {
	mu      sync.Mutex
	current *reservation
	done    bool
	onEnd   func(dial string) // called once at the end with the last reservation's upstream, if any
}

// newReservationHolder returns a holder that releases its reservation when ctx is done, then calls onEnd
// (if not nil) with the upstream that reservation was on.
func newReservationHolder(ctx context.Context, onEnd func(dial string)) *reservationHolder {
	h := &reservationHolder{onEnd: onEnd}
	context.AfterFunc(ctx, h.finish)
	return h
}

// swap releases the current reservation, if any, and holds next instead (nil holds nothing). A request
// that already ended releases next at once, so nothing reserved after the end is lost.
func (h *reservationHolder) swap(next *reservation) {
	h.mu.Lock()
	prev := h.current
	h.current = next
	if h.done {
		h.current = nil
	}
	done := h.done
	h.mu.Unlock()
	if prev != nil {
		prev.release()
	}
	if done && next != nil {
		next.release()
	}
}

// finish releases the last reservation; it runs once, when the request's context is done.
func (h *reservationHolder) finish() {
	h.mu.Lock()
	prev := h.current
	h.current = nil
	h.done = true
	h.mu.Unlock()
	if prev != nil {
		prev.release()
		if h.onEnd != nil {
			h.onEnd(prev.dial)
		}
	}
}
