package caddyllm

import (
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/tokenrouter/caddy-llm/selection"
)

// defaultParams are the provisioned defaults.
func defaultParams() availabilityParams {
	c := new(AvailabilityConfig)
	c.provision()
	return c.controller()
}

// TestAvailabilityConverges: of two equal upstreams, one starts failing 2% of its requests; within a
// few intervals its availability and its share of the requests fall, and after it heals both return.
// The decision is the real one (selection.Choose with the availability signal's values) on an injected
// clock: no sleeps.
func TestAvailabilityConverges(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	table := newAvailabilityTable(defaultParams(), func() time.Time { return now })
	keys := []string{"10.0.0.1:8000", "10.0.0.2:8000"}
	const flaky, perInterval = 1, 2000
	rng := rand.New(rand.NewPCG(3, 4))
	failRate := 0.02

	// interval routes one interval of requests and returns the flaky upstream's share of them.
	interval := func() float64 {
		got := 0
		for range perInterval {
			avail := make([]float64, len(keys))
			table.values(keys, avail)
			cands := make([]selection.Candidate, len(keys))
			for i := range cands {
				cands[i] = selection.Candidate{Key: keys[i], Service: selection.Prior, Availability: max(avail[i], minAvailability)}
			}
			d := selection.Choose(cands, selection.Request{PromptTokens: 500, PrefixHash: rng.Uint64(), AvailabilityHash: rng.Uint64()},
				selection.DefaultConfig(), rng.IntN, nil)
			if d.Index == flaky {
				got++
			}
			table.record(keys[d.Index], d.Index == flaky && rng.Float64() < failRate)
		}
		now = now.Add(30 * time.Second)
		return float64(got) / perInterval
	}

	var shares []float64
	for range 5 {
		shares = append(shares, interval())
	}
	a, _ := table.value(keys[flaky])
	t.Logf("failing 2%%: shares %.3f, availability %.2f", shares, a)
	if shares[0] < 0.4 {
		t.Errorf("first interval share %.2f, want about 0.5 before the controller has seen anything", shares[0])
	}
	if last := shares[len(shares)-1]; last > 0.2 || a > 0.5 {
		t.Errorf("after 5 intervals failing 2%%: share %.2f and availability %.2f, want both well below half", last, a)
	}

	failRate = 0
	shares = shares[:0]
	for range 15 {
		shares = append(shares, interval())
	}
	a, _ = table.value(keys[flaky])
	t.Logf("healed: shares %.3f, availability %.2f", shares, a)
	if last := shares[len(shares)-1]; last < 0.4 || a < 1 {
		t.Errorf("15 intervals after healing: share %.2f and availability %.2f, want about 0.5 and 1", last, a)
	}
	if a, _ := table.value(keys[0]); a != 1 {
		t.Errorf("the healthy upstream's availability is %.2f, want 1", a)
	}
}

// TestAvailabilityBiasRestoresIdle: an upstream that failed everything and then received nothing is
// restored by the +1 bias alone, stepped as the next call finds the intervals that passed (bounded).
func TestAvailabilityBiasRestoresIdle(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	table := newAvailabilityTable(defaultParams(), func() time.Time { return now })
	const dial = "10.0.0.1:8000"
	for range 50 {
		table.record(dial, true)
	}
	now = now.Add(30 * time.Second)
	if a, _ := table.value(dial); a != 0 {
		t.Fatalf("after an interval of errors: availability %.2f, want 0", a)
	}
	now = now.Add(3 * 30 * time.Second)
	a3, _ := table.value(dial)
	if a3 <= 0 || a3 >= 1 {
		t.Errorf("three idle intervals later: availability %.2f, want partly restored", a3)
	}
	now = now.Add(24 * time.Hour)
	if a, _ := table.value(dial); a != 1 {
		t.Errorf("a day idle later: availability %.2f, want 1", a)
	}
}

func TestWaterfall(t *testing.T) {
	keys := []string{"a", "b", "c", "d"}
	for _, tc := range []struct {
		name       string
		avail      []float64
		preference []string
		want       []float64
	}{
		{"healthy primary takes all", []float64{1, 1, 1, 1}, []string{"b", "a"}, []float64{0, 1, 0, 0}},
		{"degraded primary sheds to the next", []float64{1, 0.7, 1, 1}, []string{"b", "a"}, []float64{0.3, 0.7, 0, 0}},
		{"both degraded: unlisted follow in order", []float64{0.2, 0.5, 0.1, 1}, []string{"b", "a"}, []float64{0.2, 0.5, 0.1, 0.2}},
		{"listed upstream missing from the pool", []float64{1, 1, 1, 1}, []string{"x", "c"}, []float64{0, 0, 1, 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := append([]float64(nil), tc.avail...)
			waterfall(keys, tc.preference, got)
			for i := range got {
				if diff := got[i] - tc.want[i]; diff > 1e-9 || diff < -1e-9 {
					t.Errorf("waterfall(%v, %v) = %v, want %v", tc.avail, tc.preference, got, tc.want)
					break
				}
			}
		})
	}
}

// TestAvailabilityOutcome: how the end of a request is counted, from what reverse_proxy and the server
// left in the replacer.
func TestAvailabilityOutcome(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values map[string]any
		want   int
	}{
		{"ok", map[string]any{statusPlaceholder: 200}, outcomeSuccess},
		{"client error is the client's", map[string]any{statusPlaceholder: 400}, outcomeSuccess},
		{"saturated", map[string]any{statusPlaceholder: 429}, outcomeError},
		{"server error", map[string]any{statusPlaceholder: 503}, outcomeError},
		{"connection failure", map[string]any{"http.error.status_code": 502}, outcomeError},
		{"client gone", map[string]any{"http.error.status_code": 499}, outcomeNone},
		{"nothing", nil, outcomeNone},
	} {
		repl := caddy.NewReplacer()
		for k, v := range tc.values {
			repl.Set(k, v)
		}
		if got := endOutcome(repl); got != tc.want {
			t.Errorf("%s: endOutcome() = %d, want %d", tc.name, got, tc.want)
		}
	}
}

// TestAvailabilityStress: records, reads and steps from many goroutines (run with -race).
func TestAvailabilityStress(t *testing.T) {
	var mu sync.Mutex
	now := time.Unix(1_700_000_000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	table := newAvailabilityTable(availabilityParams{interval: int64(time.Second), errorWeight: 200, kp: 0.1, ki: 0.1}, clock)
	keys := []string{"a:1", "b:1", "c:1"}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out := make([]float64, len(keys))
			for i := range 2000 {
				table.record(keys[(g+i)%len(keys)], i%50 == 0)
				table.values(keys, out)
				if i%100 == 0 {
					mu.Lock()
					now = now.Add(time.Second)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	out := make([]float64, len(keys))
	table.values(keys, out)
	for i, a := range out {
		if a < 0 || a > 1 {
			t.Errorf("availability of %s = %g, want within [0, 1]", keys[i], a)
		}
	}
}

// TestAvailabilityTablesSurviveReload: a policy provisioned with the same settings gets the same table
// (its availabilities survive a reload); different settings get their own.
func TestAvailabilityTablesSurviveReload(t *testing.T) {
	p := defaultParams()
	a, keyA, _ := acquireAvailability(p)
	defer releaseAvailability(keyA)
	a.record("10.9.9.9:1", true)
	b, keyB, _ := acquireAvailability(p) // the new config, provisioned before the old one is cleaned up
	releaseAvailability(keyA)
	defer releaseAvailability(keyB)
	if a != b {
		t.Error("a reload with the same settings got a new availability table")
	}
	q := p
	q.kp = 0.5
	c, keyC, _ := acquireAvailability(q)
	defer releaseAvailability(keyC)
	if c == a {
		t.Error("different controller settings share one table")
	}
	if _, inUse := reportedAvailability("10.9.9.9:1"); !inUse {
		t.Error("reportedAvailability: no table in use")
	}
}

func TestUnmarshalAvailability(t *testing.T) {
	d := caddyfile.NewTestDispenser(`llm {
		availability {
			interval 10s
			error_weight 100
			kp 0.2
			ki 0.05
			kd 0
			preference 10.0.0.1:8000 10.0.0.2:8000
			preference 10.0.0.3:8000
		}
		tenant_header X-Project-ID
	}`)
	var s LLMSelection
	if err := s.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	c := s.Availability
	if c == nil || c.Interval != caddy.Duration(10*time.Second) || c.ErrorWeight != 100 || *c.Kp != 0.2 || *c.Ki != 0.05 || *c.Kd != 0 ||
		strings.Join(c.Preference, " ") != "10.0.0.1:8000 10.0.0.2:8000 10.0.0.3:8000" || s.TenantHeader != "X-Project-ID" {
		t.Errorf("UnmarshalCaddyfile() = %+v, tenant header %q", c, s.TenantHeader)
	}

	var off LLMSelection
	if err := off.UnmarshalCaddyfile(caddyfile.NewTestDispenser("llm {\n availability off\n}")); err != nil || !off.Availability.Off {
		t.Errorf("availability off: %+v, %v", off.Availability, err)
	}

	for input, wantErr := range map[string]string{
		"availability on":                    "availability takes no argument but 'off'",
		"availability off extra":             "availability takes no argument but 'off'",
		"availability off\navailability off": "availability already specified",
		"availability {\ninterval never\n}":  "interval must be a positive duration",
		"availability {\nerror_weight 0\n}":  "error_weight must be a positive number",
		"availability {\nkp -1\n}":           "kp must be a number of at least 0",
		"availability {\npreference\n}":      "wrong argument count",
		"availability {\nspeed 3\n}":         "unrecognized availability option 'speed'",
		"tenant_header":                      "wrong argument count",
	} {
		var s LLMSelection
		err := s.UnmarshalCaddyfile(caddyfile.NewTestDispenser("llm {\n" + input + "\n}"))
		if err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("%q: error %v, want %q", input, err, wantErr)
		}
	}
}
