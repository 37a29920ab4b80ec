package caddyllm

import (
	"fmt"
	"math"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/tokenrouter/caddy-llm/selection"
)

// Availability defaults, documented on AvailabilityConfig.
const (
	defaultAvailabilityInterval = 30 * time.Second
	defaultErrorWeight          = 200
	defaultKp                   = 0.1
	defaultKi                   = 0.1
	defaultKd                   = 0
	// minAvailability floors availability in the decision: an upstream at 0 still sees about one request
	// in a thousand.
	minAvailability = 0.001
	// maxCatchUp bounds the controller steps one call runs after a long idle time.
	maxCatchUp = 1000
)

// AvailabilityConfig tunes adaptive availability: each upstream has an availability in [0, 1], the share
// of new work it takes relative to a healthy upstream, adjusted by a PID controller every Interval so that
// its score, successes - ErrorWeight x errors + 1, stays near zero.
//
// The score is divided by the requests counted plus one, so that the gains do not depend on traffic: a
// healthy upstream scores about +1, one failing a share p of its requests about 1 - (ErrorWeight+1) p
// (at the default weight, -3 for 2% of errors, -200 for all of them). An error rate above
// 1/(ErrorWeight+1), 0.5% by default, lowers availability; the +1 bias raises an upstream nobody sends
// to by Ki+Kp an interval. The controller's output is the availability: the integral term (clamped to
// [0, 1], so it does not wind up) holds the level, Kp reacts to this interval's score and Kd to its
// change.
//
// Errors are answers of 5xx and 429, connection failures, and attempts that were retried (by lb_retries
// or llm_resume: a stream cut before its end and resumed counts as an error). A stream cut before its end
// that is not retried reached the client as a 2xx and counts as a success; put llm_resume in front to
// have those counted (and repaired). A request whose client went away before an answer counts as
// neither.
type AvailabilityConfig struct {
	// Off turns adaptive availability off (Caddyfile `availability off`): every upstream counts as fully
	// available.
	Off bool `json:"off,omitempty"`
	// Interval is how often the controller adjusts availability. Default 30s. It steps when a request
	// or a report finds an interval has passed (no goroutine); after an idle time it catches up, at most
	// 1000 intervals.
	Interval caddy.Duration `json:"interval,omitempty"`
	// ErrorWeight is how many successes an error cancels out. Default 200: an error rate above 0.5%
	// lowers availability.
	ErrorWeight float64 `json:"error_weight,omitempty"`
	// Kp, Ki and Kd are the controller's gains on the score of the interval, its sum, and its change.
	// Defaults 0.1, 0.1 and 0: an upstream failing 2% of its requests falls from 1 to 0 in about three
	// intervals, and one that recovers is back to 1 in about ten.
	Kp *float64 `json:"kp,omitempty"`
	Ki *float64 `json:"ki,omitempty"`
	Kd *float64 `json:"kd,omitempty"`
	// Preference lists upstreams (dial addresses) as a waterfall: the first takes a share of new work
	// equal to its availability, the next min(its availability, 1 - the shares before it), and so on;
	// upstreams not listed follow in pool order. A healthy first upstream takes everything, and the next
	// ones take what it sheds as it fails (or all of it when it is down, saturated or already tried).
	// Off by default: each upstream's share is its own availability.
	Preference []string `json:"preference,omitempty"`
}

func (c *AvailabilityConfig) provision() {
	if c.Interval == 0 {
		c.Interval = caddy.Duration(defaultAvailabilityInterval)
	}
	if c.ErrorWeight == 0 {
		c.ErrorWeight = defaultErrorWeight
	}
	for _, g := range []struct {
		gain **float64
		def  float64
	}{{&c.Kp, defaultKp}, {&c.Ki, defaultKi}, {&c.Kd, defaultKd}} {
		if *g.gain == nil {
			v := g.def
			*g.gain = &v
		}
	}
}

func (c *AvailabilityConfig) validate() error {
	if c.Interval < 0 {
		return fmt.Errorf("availability interval must be positive, got %s", time.Duration(c.Interval))
	}
	if c.ErrorWeight < 0 {
		return fmt.Errorf("availability error_weight must be positive, got %g", c.ErrorWeight)
	}
	for name, g := range map[string]*float64{"kp": c.Kp, "ki": c.Ki, "kd": c.Kd} {
		if g != nil && (*g < 0 || math.IsNaN(*g) || math.IsInf(*g, 0)) {
			return fmt.Errorf("availability %s must be a positive number, got %g", name, *g)
		}
	}
	return nil
}

// controller returns the controller settings of a provisioned config.
func (c *AvailabilityConfig) controller() availabilityParams {
	return availabilityParams{
		interval: int64(c.Interval), errorWeight: c.ErrorWeight, kp: *c.Kp, ki: *c.Ki, kd: *c.Kd,
	}
}

type availabilityParams struct {
	interval    int64 // nanoseconds
	errorWeight float64
	kp, ki, kd  float64
}

func (p availabilityParams) String() string {
	return fmt.Sprintf("interval=%s error_weight=%g kp=%g ki=%g kd=%g", time.Duration(p.interval), p.errorWeight, p.kp, p.ki, p.kd)
}

// availabilityTable holds every upstream's availability under one controller setting. It is safe for
// concurrent use: one mutex guards it, record and values are O(1) per upstream, and a controller step
// is O(upstreams). Memory is bounded as the load table's is: an entry back at full availability with
// nothing counted is deleted once idle for idleAfter when the table holds more than sweepAbove.
type availabilityTable struct {
	params availabilityParams
	now    func() time.Time

	mu       sync.Mutex
	m        map[string]*upstreamAvailability
	lastStep int64 // unix nanoseconds of the last controller step
}

// upstreamAvailability is one upstream's controller state.
type upstreamAvailability struct {
	successes, errors float64 // counted since the last step
	integral          float64 // the controller's sum, clamped to [0, 1]
	lastScore         float64 // the score of the last step, for the derivative
	value             float64 // the availability, in [0, 1]
	lastUsed          int64
}

func newAvailabilityTable(p availabilityParams, now func() time.Time) *availabilityTable {
	if now == nil {
		now = time.Now
	}
	return &availabilityTable{params: p, now: now, m: make(map[string]*upstreamAvailability), lastStep: now().UnixNano()}
}

// record counts one attempt's outcome on dial.
func (t *availabilityTable) record(dial string, failed bool) {
	if t == nil {
		return
	}
	now := t.now().UnixNano()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stepDueLocked(now)
	u := t.m[dial]
	if u == nil {
		if len(t.m) >= sweepAbove {
			t.sweepLocked(now)
		}
		u = &upstreamAvailability{integral: 1, value: 1, lastScore: 1}
		t.m[dial] = u
	}
	u.lastUsed = now
	if failed {
		u.errors++
	} else {
		u.successes++
	}
}

// values fills out[i] with keys[i]'s availability (1 for an upstream never counted).
func (t *availabilityTable) values(keys []string, out []float64) {
	now := t.now().UnixNano()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stepDueLocked(now)
	for i, k := range keys {
		out[i] = 1
		if u := t.m[k]; u != nil {
			out[i] = u.value
		}
	}
}

// value returns dial's availability and whether the table knows it.
func (t *availabilityTable) value(dial string) (float64, bool) {
	now := t.now().UnixNano()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stepDueLocked(now)
	if u := t.m[dial]; u != nil {
		return u.value, true
	}
	return 1, false
}

// stepDueLocked runs the controller steps due at now: the first with what was counted, the others (after
// an idle time) with nothing counted, so the bias restores upstreams nobody sent to. The caller holds mu.
func (t *availabilityTable) stepDueLocked(now int64) {
	if t.params.interval <= 0 || now-t.lastStep < t.params.interval {
		return
	}
	steps := (now - t.lastStep) / t.params.interval
	t.lastStep += steps * t.params.interval
	for _, u := range t.m {
		for i := range min(steps, maxCatchUp) {
			if i > 0 && u.value >= 1 && u.integral >= 1 {
				break // at rest
			}
			u.step(t.params)
		}
	}
}

// step adjusts the availability by the score counted since the last step, and starts a new count.
func (u *upstreamAvailability) step(p availabilityParams) {
	n := u.successes + u.errors
	score := (u.successes - p.errorWeight*u.errors + 1) / (n + 1)
	u.integral = clamp01(u.integral + p.ki*score)
	u.value = clamp01(u.integral + p.kp*score + p.kd*(score-u.lastScore))
	u.lastScore = score
	u.successes, u.errors = 0, 0
}

func clamp01(x float64) float64 { return min(max(x, 0), 1) }

// sweepLocked deletes entries at rest and idle. The caller holds mu.
func (t *availabilityTable) sweepLocked(now int64) {
	for dial, u := range t.m {
		if u.value >= 1 && u.integral >= 1 && u.successes+u.errors == 0 && now-u.lastUsed > int64(idleAfter) {
			delete(t.m, dial)
		}
	}
}

// availabilitySignal fills each candidate's availability, or its waterfall share when a preference order
// is set.
type availabilitySignal struct {
	table      *availabilityTable
	preference []string
}

func (s availabilitySignal) fill(q *query, keys []string, cands []selection.Candidate) {
	if cap(q.avail) < len(keys) {
		q.avail = make([]float64, len(keys))
	}
	avail := q.avail[:len(keys)]
	s.table.values(keys, avail)
	if len(s.preference) > 0 {
		waterfall(keys, s.preference, avail)
	}
	for i := range cands {
		cands[i].Availability = max(avail[i], minAvailability)
	}
}

// waterfall turns availabilities into waterfall shares in place: in preference order (then the others in
// key order) each upstream gets min(its availability, 1 - the shares before it).
func waterfall(keys, preference []string, avail []float64) {
	left := 1.0
	take := func(i int) {
		avail[i] = min(avail[i], left)
		left = max(left-avail[i], 0)
	}
	for _, p := range preference {
		if i := slices.Index(keys, p); i >= 0 {
			take(i)
		}
	}
	for i, k := range keys {
		if !slices.Contains(preference, k) {
			take(i)
		}
	}
}

// availabilityTables holds one table per distinct controller setting (like routeTables), so a reload with
// the same settings keeps every upstream's availability, and two policies with different settings do not
// drive each other's. Each Provision takes a reference and each Cleanup drops exactly one.
var availabilityTables = caddy.NewUsagePool()

type availabilityEntry struct{ *availabilityTable }

func (availabilityEntry) Destruct() error { return nil }

func acquireAvailability(p availabilityParams) (*availabilityTable, string, error) {
	key := p.String()
	v, _, err := availabilityTables.LoadOrNew(key, func() (caddy.Destructor, error) {
		return availabilityEntry{newAvailabilityTable(p, nil)}, nil
	})
	if err != nil {
		return nil, "", fmt.Errorf("availability table: %w", err)
	}
	return v.(availabilityEntry).availabilityTable, key, nil
}

func releaseAvailability(key string) { _, _ = availabilityTables.Delete(key) }

// reportedAvailability returns dial's availability as reported: the lowest among the tables in use that
// know it, 1 when none does, and false when no table is in use (availability is off everywhere).
func reportedAvailability(dial string) (float64, bool) {
	a, inUse := 1.0, false
	availabilityTables.Range(func(_, v any) bool {
		inUse = true
		if x, ok := v.(availabilityEntry).value(dial); ok {
			a = min(a, x)
		}
		return true
	})
	return a, inUse
}

// Attempt outcomes, as the availability controller counts them.
const (
	outcomeNone    = iota // no signal: the client went away before an answer
	outcomeSuccess        // answered, and not with 5xx or 429
	outcomeError          // 5xx, 429, or no answer from the upstream
)

// statusPlaceholder is where reverse_proxy puts the answer's status; it is not cleared between
// attempts, so the policy clears it at each Select and a missing one means the last attempt got none.
const statusPlaceholder = "http.reverse_proxy.status_code"

// endOutcome classifies the last attempt of a request that has ended, from repl: its answer's status,
// else the error the server recorded (502 for a connection failure, 504 for a timeout; a client gone is
// 499 or nothing, and counts as neither).
func endOutcome(repl *caddy.Replacer) int {
	if repl == nil {
		return outcomeNone
	}
	if v, ok := repl.Get(statusPlaceholder); ok {
		if code, ok := v.(int); ok {
			return statusOutcome(code)
		}
	}
	if v, ok := repl.Get("http.error.status_code"); ok {
		if code, ok := v.(int); ok && code >= 500 {
			return outcomeError
		}
	}
	return outcomeNone
}

func statusOutcome(code int) int {
	if code >= 500 || code == http.StatusTooManyRequests {
		return outcomeError
	}
	return outcomeSuccess
}
