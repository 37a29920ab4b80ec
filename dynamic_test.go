package caddyllm

import (
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
	"github.com/tokenrouter/caddy-llm/scraper"
)

func init() { caddy.RegisterModule(testUpstreams{}) }

// testUpstreams is a dynamic upstream source whose list the test sets (testPools): Caddy's `dynamic a`
// or `srv` with a DNS the test controls. Caddyfile: `dynamic llm_test <pool name>`.
type testUpstreams struct {
	Pool string `json:"pool"`
}

var testPools sync.Map // pool name -> []string of dial addresses

func (testUpstreams) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.reverse_proxy.upstreams.llm_test", New: func() caddy.Module { return new(testUpstreams) }}
}

func (u testUpstreams) GetUpstreams(*http.Request) ([]*reverseproxy.Upstream, error) {
	dials, _ := testPools.Load(u.Pool)
	var ups []*reverseproxy.Upstream
	for _, d := range dials.([]string) {
		ups = append(ups, &reverseproxy.Upstream{Dial: d})
	}
	return ups, nil
}

func (u *testUpstreams) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the source's name
	if !d.NextArg() {
		return d.ArgErr()
	}
	u.Pool = d.Val()
	return nil
}

// TestDynamicUpstreams: behind a dynamic upstream source the pool changes without a reload. The policy
// scrapes an upstream from the first decision that has it, routes only within the current pool, and a
// conversation pinned to an upstream that left goes on elsewhere.
func TestDynamicUpstreams(t *testing.T) {
	simA, a := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 1})
	simB, b := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 2})
	simC, c := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 3})
	sims := map[string]*vllmsim.Server{a: simA, b: simB, c: simC}
	pool := t.Name()
	testPools.Store(pool, []string{a, b})
	t.Cleanup(func() { testPools.Delete(pool) })

	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy {
		dynamic llm_test %s
		lb_policy llm {
			conversation_header X-Conversation-ID
			metrics {
				interval 20ms
			}
		}
	}
}
`, site, pool), "caddyfile")

	// A conversation whose first turn lands on a, if it does (the pool's first half).
	var pinnedOnA string
	for i := range 12 {
		id := fmt.Sprintf("conv-%d", i)
		got := sendCounting(t, tester.Client, chatBody("sim-model", 10+i, false), sims, "X-Conversation-ID", id)
		if got == c {
			t.Fatalf("request %d went to %s, which is not in the pool", i, c)
		}
		if got == a && pinnedOnA == "" {
			pinnedOnA = id
		}
	}
	waitFor(t, "a and b scraped", func() bool {
		m := adminUpstreams(t)
		return m[a].Metrics != nil && m[a].Metrics.Fresh && m[b].Metrics != nil && m[b].Metrics.Fresh
	})
	if m := adminUpstreams(t)[c].Metrics; m != nil {
		t.Fatalf("%s is scraped before any decision had it", c) // (listed it may be, from an earlier test on its port)
	}

	testPools.Store(pool, []string{b, c}) // a leaves, c joins: no reload
	for i := range 8 {
		if got := sendCounting(t, tester.Client, chatBody("sim-model", 40+i, false), sims); got == a {
			t.Fatalf("request %d went to %s after it left the pool", i, a)
		}
	}
	waitFor(t, "c scraped from the decisions that had it", func() bool {
		m := adminUpstreams(t)[c].Metrics
		return m != nil && m.Fresh
	})

	testPools.Store(pool, []string{c}) // b leaves too: the newcomer serves alone
	for i := range 3 {
		if got := sendCounting(t, tester.Client, chatBody("sim-model", 60+i, false), sims); got != c {
			t.Fatalf("request %d went to %s, not %s, the pool's one upstream", i, got, c)
		}
	}
	if pinnedOnA != "" {
		if got := sendCounting(t, tester.Client, chatBody("sim-model", 10, false), sims, "X-Conversation-ID", pinnedOnA); got != c {
			t.Fatalf("a conversation pinned to %s, which left, went to %s, not %s", a, got, c)
		}
	}
	// b, out of the pool, keeps its row (and what was learned of it), idle since before c's last
	// requests; nothing is in flight anywhere. (The proxy releases a request just after its client has
	// the whole answer: wait for that.)
	var m map[string]upstreamStatus
	waitFor(t, c+" idle after its requests", func() bool {
		m = adminUpstreams(t)
		return m[c].InflightRequests == 0 && m[c].IdleSeconds != nil && *m[c].IdleSeconds > 0
	})
	idleB, idleC := m[b].IdleSeconds, m[c].IdleSeconds
	if idleB != nil && *idleB <= *idleC {
		t.Errorf("%s, out of the pool, idle %.3f s; %s, which served last, idle %.3f s", b, *idleB, c, *idleC)
	}
}

// TestScrapesForgetUpstreamsOutOfThePool: an upstream out of every decision for scrapeForgetAfter while
// decisions go on (a dynamic source dropped it) is no longer scraped, and is scraped again once it is back;
// a policy idle for longer than that keeps scraping its pool.
func TestScrapesForgetUpstreamsOutOfThePool(t *testing.T) {
	_, a := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 1})
	_, b := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 2})
	cfg := &MetricsConfig{Interval: caddy.Duration(20 * time.Millisecond)}
	cfg.provision()
	sc := newScrapes(cfg, zap.NewNop())
	t.Cleanup(sc.release)
	clock := time.Unix(1_000_000, 0)
	sc.now = func() time.Time { return clock }
	decide := func(dials ...string) {
		for _, d := range dials {
			sc.load(d)
		}
	}
	scraped := func(dial string) bool { return scrapedNow(t, cfg, dial) }
	entry := func(dial string) *scrapeEntry {
		sc.mu.RLock()
		defer sc.mu.RUnlock()
		return sc.handles[dial]
	}

	decide(a, b)
	if !scraped(a) || !scraped(b) {
		t.Fatal("a and b are not scraped after a decision had them")
	}
	for range 11 { // eleven minutes of decisions without a: not forgotten until it has been out for more than ten
		clock = clock.Add(time.Minute)
		decide(b)
		if entry(a) == nil {
			t.Fatalf("a forgotten after %v out of the pool, want more than %v", clock.Sub(time.Unix(1_000_000, 0)), scrapeForgetAfter)
		}
	}
	clock = clock.Add(time.Minute)
	decide(b)
	if entry(a) != nil {
		t.Fatal("a is still held after twelve minutes of decisions without it")
	}
	waitFor(t, "a's scrapes stopped", func() bool { return !scraped(a) })
	if !scraped(b) {
		t.Fatal("b, in every decision, is no longer scraped")
	}

	clock = clock.Add(time.Minute)
	decide(a, b) // a is back
	if !scraped(a) {
		t.Fatal("a is not scraped again after it came back")
	}
	before := []*scrapeEntry{entry(a), entry(b)}
	clock = clock.Add(time.Hour) // nothing decided for an hour
	decide(b, a)
	if after := []*scrapeEntry{entry(a), entry(b)}; !slices.Equal(before, after) {
		t.Fatal("an hour without decisions made the policy forget its pool")
	}
}

// TestScrapesStress takes, forgets, drops as unusable and releases scrape handles from several
// goroutines at once (run with -race) over a pool that keeps changing; once the policy is released, no
// target is scraped any more.
func TestScrapesStress(t *testing.T) {
	cfg := &MetricsConfig{Interval: caddy.Duration(10 * time.Millisecond)}
	cfg.provision()
	sc := newScrapes(cfg, zap.NewNop())
	var clock atomic.Int64
	start := time.Unix(1_000_000, 0).UnixNano()
	clock.Store(start)
	sc.now = func() time.Time { return time.Unix(0, clock.Load()) }
	// Ports 1-24 of 127.0.0.1, where nothing listens: every scrape fails at once, so upstreams are also
	// dropped as having no usable metrics.
	dials := make([]string, 24)
	for i := range dials {
		dials[i] = fmt.Sprintf("127.0.0.1:%d", i+1)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 600 {
				// The pool, 6 of the 24 upstreams, moves on every 5 minutes of decisions, 3 s apart.
				now := clock.Add(int64(3 * time.Second))
				window := int((now-start)/int64(5*time.Minute)) % 4
				sc.load(dials[window*6+(g+i)%6])
				if i%50 == 0 {
					sc.dropUnusable(dials[(g*7+i)%len(dials)])
				}
			}
		}()
	}
	wg.Wait()
	sc.mu.RLock()
	held := len(sc.handles)
	sc.mu.RUnlock()
	if held > 18 {
		// The pool and the two before it, which left it less than 10 minutes ago: the fourth left it 10-15
		// minutes ago, the policy having decided all along.
		t.Errorf("%d upstreams held after the pool moved through all 24, want 18 at most", held)
	}
	sc.release()
	waitFor(t, "every scrape stopped", func() bool {
		return !slices.ContainsFunc(dials, func(d string) bool { return scrapedNow(t, cfg, d) })
	})
}

// scrapedNow reports whether the process scrapes dial's metrics under cfg (some policy holds a handle).
func scrapedNow(t *testing.T, cfg *MetricsConfig, dial string) bool {
	t.Helper()
	target, err := cfg.target(dial)
	if err != nil {
		t.Fatal(err)
	}
	_, ok := scraper.Default.Status(target)
	return ok
}

// TestNestedProxyScrapesItsOwnUpstreams pins a bug: a policy inside a reverse_proxy nested in another's
// handle_response took the outer proxy's upstreams (and transport) for its own, so it scraped and
// listed an upstream it never routes to. Each policy now reads the nearest reverse_proxy above it.
func TestNestedProxyScrapesItsOwnUpstreams(t *testing.T) {
	_, outer := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 1})
	_, inner := simBackend(t, vllmsim.Config{TimeScale: 1000, Seed: 2})
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy %s {
		@any status 2xx
		handle_response @any {
			reverse_proxy %s {
				lb_policy llm {
					metrics {
						interval 20ms
					}
				}
			}
		}
	}
}
`, site, outer, inner), "caddyfile")
	waitFor(t, "the inner upstream scraped from provisioning", func() bool {
		m := adminUpstreams(t)[inner].Metrics
		return m != nil && m.Fresh
	})
	// Not "not listed": the load table is process-wide, and an earlier test's upstream on the same port
	// (the kernel reuses ports) leaves an entry there; only a live policy scrapes.
	if m := adminUpstreams(t)[outer].Metrics; m != nil {
		t.Errorf("the outer proxy's upstream %s is scraped: the inner policy took it for its own", outer)
	}
}
