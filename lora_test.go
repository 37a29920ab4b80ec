package caddyllm

import (
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

// loraFixture is a decision over three upstreams whose scrapes the test sets.
type loraFixture struct {
	t     *testing.T
	now   time.Time
	keys  []string
	snaps map[string]scraper.Snapshot
	dec   *decider
}

func newLoRAFixture(t *testing.T) *loraFixture {
	f := &loraFixture{
		t:     t,
		now:   time.Unix(1_700_000_000, 0),
		keys:  []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"},
		snaps: make(map[string]scraper.Snapshot),
	}
	lt := &loadTable{m: make(map[string]*upstreamLoad)}
	f.dec = newDecider(selection.DefaultConfig(), nil, lt, 256, nil)
	f.dec.lora = &loraSignal{snapshot: f.snapshot, slots: newLoRASlots(), loadTime: 0.5}
	f.dec.signals = append(f.dec.signals, f.dec.lora)
	return f
}

func (f *loraFixture) snapshot(dial string, _ int64) (scraper.Snapshot, bool) {
	s, ok := f.snaps[dial]
	return s, ok
}

// scrape sets upstream i's scrape, taken now: the base model "base" with the given LoRA state.
func (f *loraFixture) scrape(i int, lora scraper.LoRA) {
	f.snaps[f.keys[i]] = scraper.Snapshot{Flavor: scraper.FlavorVLLM, Model: "base", LoRA: lora, At: f.now}
}

func loraRequest(t *testing.T, model, user string) *tokenize.Request {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": model, "messages": []map[string]string{
		{"role": "system", "content": strings.Repeat("You answer questions about tax law. ", 20)},
		{"role": "user", "content": user},
	}})
	req, err := tokenize.Parse(body, tokenize.APIChat, tokenize.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return req
}

// route decides and commits as Select does, ending the request at once; it returns the chosen index
// and the candidates as filled.
func (f *loraFixture) route(model string) (int, []selection.Candidate) {
	f.now = f.now.Add(time.Millisecond)
	q := &query{req: loraRequest(f.t, model, "question "+f.now.String()), now: f.now.UnixNano()}
	cands := make([]selection.Candidate, len(f.keys))
	d := f.dec.choose(q, f.keys, cands, nil)
	f.dec.commit(q, f.keys[d.Index], d).release(f.now.UnixNano(), false)
	return d.Index, cands
}

func TestLoRADecision(t *testing.T) {
	t.Run("the adapter goes where it runs", func(t *testing.T) {
		f := newLoRAFixture(t)
		f.scrape(0, scraper.LoRA{Running: "legal", MaxLoRA: 2})
		f.scrape(1, scraper.LoRA{Running: "fin", MaxLoRA: 2})
		f.scrape(2, scraper.LoRA{MaxLoRA: 2})
		for range 5 {
			if got, cands := f.route("fin"); got != 1 {
				t.Fatalf("fin went to %d, want 1 where it runs (candidates %+v)", got, cands)
			}
		}
	})
	t.Run("a new adapter avoids full slots", func(t *testing.T) {
		f := newLoRAFixture(t)
		f.scrape(0, scraper.LoRA{Running: "legal", MaxLoRA: 1})
		f.scrape(1, scraper.LoRA{Running: "fin", MaxLoRA: 1})
		f.scrape(2, scraper.LoRA{MaxLoRA: 1})
		got, cands := f.route("med")
		if got != 2 {
			t.Errorf("med went to %d, want 2, the only upstream with a free slot", got)
		}
		want := []float64{selection.Prior.MeanDuration, selection.Prior.MeanDuration, 0}
		for i, c := range cands {
			if c.AdapterLoad != 0.5 || c.AdapterWait != want[i] {
				t.Errorf("candidate %d: load %v wait %v, want 0.5 and %v", i, c.AdapterLoad, c.AdapterWait, want[i])
			}
		}
		// Sent there before any scrape shows it: med's next requests join it, and the slot it takes
		// makes upstream 2 full for another new adapter.
		if got, _ := f.route("med"); got != 2 {
			t.Errorf("med's second request went to %d, want 2 where it is loading", got)
		}
		_, cands = f.route("eye")
		if cands[2].AdapterWait == 0 {
			t.Errorf("upstream 2 after med was sent there: %+v, want its only slot counted as taken", cands[2])
		}
	})
	t.Run("an idle adapter stays resident until the slots fill with others", func(t *testing.T) {
		f := newLoRAFixture(t)
		for i := range 3 {
			f.scrape(i, scraper.LoRA{MaxLoRA: 1})
		}
		first, _ := f.route("fin")
		f.now = f.now.Add(time.Second)
		f.scrape(first, scraper.LoRA{MaxLoRA: 1}) // finished: idle, not reported, still loaded
		if got, _ := f.route("fin"); got != first {
			t.Errorf("fin went to %d, want %d where it was loaded and nothing replaced it", got, first)
		}
		f.now = f.now.Add(time.Second)
		f.scrape(first, scraper.LoRA{Running: "legal", MaxLoRA: 1}) // another adapter took the slot
		if got, _ := f.route("fin"); got == first {
			t.Errorf("fin went to %d, whose only slot another adapter runs in", got)
		}
	})
	t.Run("the base model pays nothing", func(t *testing.T) {
		f := newLoRAFixture(t)
		for i := range 3 {
			f.scrape(i, scraper.LoRA{Running: "legal", MaxLoRA: 1})
		}
		_, cands := f.route("base")
		for i, c := range cands {
			if c.AdapterLoad != 0 || c.AdapterWait != 0 {
				t.Errorf("candidate %d for the base model: %+v, want no adapter terms", i, c)
			}
		}
	})
}

// TestLoRAAbsentChangesNothing: when no scrape reports LoRA, the decision with the LoRA signal is
// exactly the decision without it, request by request.
func TestLoRAAbsentChangesNothing(t *testing.T) {
	with := newLoRAFixture(t)
	without := newLoRAFixture(t)
	without.dec.signals = slices.DeleteFunc(without.dec.signals, func(s signal) bool { return s == signal(without.dec.lora) })
	without.dec.lora = nil
	for i := range 3 {
		snap := scraper.Snapshot{Flavor: scraper.FlavorVLLM, Model: "base", Running: float64(i), At: with.now}
		with.snaps[with.keys[i]], without.snaps[without.keys[i]] = snap, snap
	}
	for n := range 40 {
		model := []string{"base", "fin", "legal", ""}[n%4]
		a, ca := with.route(model)
		b, cb := without.route(model)
		if a != b || !reflect.DeepEqual(ca, cb) {
			t.Fatalf("request %d (%s): with the signal %d %+v, without %d %+v", n, model, a, ca, b, cb)
		}
	}
}

func TestLoRASlotsBounded(t *testing.T) {
	ls := newLoRASlots()
	for i := range maxLoRAUpstreams + 10 {
		for j := range maxLoRASlots + 10 {
			ls.sent(fmt.Sprintf("10.0.%d.%d:80", i/256, i%256), fmt.Sprintf("a%d", j), 1000, int64(i*1000+j))
		}
	}
	if n := len(ls.upstreams); n != maxLoRAUpstreams {
		t.Errorf("upstreams = %d, want the bound %d", n, maxLoRAUpstreams)
	}
	for dial, u := range ls.upstreams {
		if len(u.adapters) > maxLoRASlots {
			t.Fatalf("%s holds %d adapters, want at most %d", dial, len(u.adapters), maxLoRASlots)
		}
	}
	if _, ok := ls.upstreams["10.0.0.0:80"]; ok {
		t.Error("the least recently used upstream was kept")
	}
}

// TestLoRASlotsStress runs sends and predictions from several goroutines (run with -race).
func TestLoRASlotsStress(t *testing.T) {
	ls := newLoRASlots()
	lora := scraper.LoRA{Running: "a1", MaxLoRA: 4}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				dial := fmt.Sprintf("10.0.0.%d:80", i%8)
				adapter := fmt.Sprintf("a%d", (g+i)%6)
				if i%2 == 0 {
					ls.sent(dial, adapter, 4, int64(i))
				} else if _, used := ls.predict(dial, adapter, lora, time.Unix(0, int64(i-100))); used < 1 || used > 5 {
					t.Errorf("used = %d, want the running one plus at most 4 sent", used)
					return
				}
			}
		}()
	}
	wg.Wait()
}
