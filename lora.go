package caddyllm

import (
	"slices"
	"sync"
	"time"

	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
)

// LoRA adapters. vLLM serves each adapter under its own model name and reports, in
// vllm:lora_requests_info, the adapters of its running and waiting requests and its number of adapter
// slots (max_lora). A request for an adapter that is not in a slot waits while the engine loads it (a
// step stalled for every request running there), and when every slot holds an adapter that running
// requests use, it first waits for one of those to finish. The signal below prices both, in the
// seconds of the rest of the decision (selection.Candidate.AdapterLoad, AdapterWait).
//
// A request is an adapter request on an upstream when that upstream reports LoRA (a fresh scrape with
// max_lora > 0) and the request's model is not the upstream's base model (the model_name of its
// metrics). Upstreams that report nothing about LoRA, and requests for the base model, get neither term:
// without LoRA in any scrape the decision is exactly what it is without this signal.

// defaultLoRALoadTime is the time assumed to load an adapter into a slot (LLMSelection.LoRALoadTime).
const defaultLoRALoadTime = 500 * time.Millisecond

// loraSignal fills each candidate's adapter load and slot wait.
type loraSignal struct {
	// snapshot returns an upstream's scraped metrics at the decision's time and whether they are
	// fresh (scrapes.peek: the load signal, which runs first, has read them and started their scrapes).
	snapshot func(dial string, now int64) (scraper.Snapshot, bool)
	slots    *loraSlots
	loadTime float64 // seconds
}

func (s loraSignal) fill(q *query, keys []string, cands []selection.Candidate) {
	adapter := q.req.Model
	if adapter == "" {
		return
	}
	for i, key := range keys {
		snap, fresh := s.snapshot(key, q.now)
		if !fresh || !snap.LoRA.Reported() || adapter == snap.Model {
			continue
		}
		q.adapter = true
		resident, used := s.slots.predict(key, adapter, snap.LoRA, snap.At)
		if resident {
			continue
		}
		cands[i].AdapterLoad = s.loadTime
		if used >= snap.LoRA.MaxLoRA {
			// A slot frees when the last running request of one of its adapters ends: about one mean
			// request time on that upstream.
			cands[i].AdapterWait = cands[i].Service.MeanDuration
		}
	}
}

// commit records that adapter was sent to dial, so that the next requests for it see it loading there
// before the next scrape shows it.
func (s loraSignal) commit(q *query, dial string) {
	if !q.adapter {
		return
	}
	snap, fresh := s.snapshot(dial, q.now)
	if !fresh || !snap.LoRA.Reported() || q.req.Model == snap.Model {
		return
	}
	s.slots.sent(dial, q.req.Model, snap.LoRA.MaxLoRA, q.now)
}

// loraSlots predicts which adapters each upstream holds in its slots, from what this proxy sent there:
// per upstream, the adapters sent most recently, at most as many as it has slots (vLLM evicts the least
// recently used idle adapter to load a new one). The backend's scrape corrects it: an adapter it shows
// running is resident, and when its slots are all taken by other running adapters, ours is not.
//
// Safe for concurrent use. Memory is bounded: at most maxLoRAUpstreams upstreams (the least recently
// sent-to is dropped) of at most maxLoRASlots adapters each. Every operation is O(slots) under one mutex.
type loraSlots struct {
	mu        sync.Mutex
	upstreams map[string]*upstreamSlots
}

type upstreamSlots struct {
	adapters []sentAdapter // most recently sent first
	last     int64
}

type sentAdapter struct {
	name string
	at   int64 // unix nanoseconds it was last sent
}

const (
	maxLoRAUpstreams = 1024
	maxLoRASlots     = 64
)

// adapterSlots is the process-wide residency prediction: it survives reloads, like the load table.
var adapterSlots = newLoRASlots()

func newLoRASlots() *loraSlots {
	return &loraSlots{upstreams: make(map[string]*upstreamSlots)}
}

// predict says whether adapter is probably resident on dial given its last scrape (lora, taken at
// scraped), and how many slots are in use: the adapters the scrape shows running plus those this proxy
// sent there since.
func (ls *loraSlots) predict(dial, adapter string, lora scraper.LoRA, scraped time.Time) (resident bool, used int) {
	used = lora.RunningCount()
	sentHere, sentSince := false, false
	ls.mu.Lock()
	if u := ls.upstreams[dial]; u != nil {
		for i, a := range u.adapters {
			if i >= lora.MaxLoRA {
				break // beyond the slots: evicted by now
			}
			since := a.at > scraped.UnixNano()
			if a.name == adapter {
				sentHere, sentSince = true, since
			}
			if since && !lora.IsRunning(a.name) {
				used++ // sent since the scrape: it takes a slot the scrape does not show yet
			}
		}
	}
	ls.mu.Unlock()
	switch {
	case lora.IsRunning(adapter), sentSince:
		// Running, or sent since the scrape: loaded, or being loaded for a request ahead of this one.
		return true, used
	case sentHere:
		// Sent before the scrape and idle since: still in its slot unless the scrape shows every slot
		// taken by other running adapters.
		return lora.RunningCount() < lora.MaxLoRA, used
	}
	return false, used
}

// sent records that adapter was sent to dial, an upstream with slots adapter slots, at now.
func (ls *loraSlots) sent(dial, adapter string, slots int, now int64) {
	slots = min(max(slots, 1), maxLoRASlots)
	ls.mu.Lock()
	defer ls.mu.Unlock()
	u := ls.upstreams[dial]
	if u == nil {
		if len(ls.upstreams) >= maxLoRAUpstreams {
			ls.dropOldestLocked()
		}
		u = &upstreamSlots{}
		ls.upstreams[dial] = u
	}
	u.last = now
	if i := slices.IndexFunc(u.adapters, func(a sentAdapter) bool { return a.name == adapter }); i >= 0 {
		u.adapters = slices.Delete(u.adapters, i, i+1)
	}
	u.adapters = slices.Insert(u.adapters, 0, sentAdapter{name: adapter, at: now})
	if len(u.adapters) > slots {
		u.adapters = u.adapters[:slots]
	}
}

func (ls *loraSlots) dropOldestLocked() {
	oldest, at := "", int64(0)
	for dial, u := range ls.upstreams {
		if oldest == "" || u.last < at {
			oldest, at = dial, u.last
		}
	}
	delete(ls.upstreams, oldest)
}
