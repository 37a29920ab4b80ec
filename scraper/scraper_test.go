package scraper

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// fakeClock is an injectable clock that only moves when told to.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// backend is an httptest server on 127.0.0.1 whose answer is switched by the test.
type backend struct {
	srv  *httptest.Server
	hits atomic.Int64
	mu   sync.Mutex
	h    http.HandlerFunc
}

func newBackend(t *testing.T, body []byte) *backend {
	t.Helper()
	b := &backend{}
	b.set(serveBody(body))
	b.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.hits.Add(1)
		b.mu.Lock()
		h := b.h
		b.mu.Unlock()
		h(w, r)
	}))
	t.Cleanup(b.srv.Close)
	return b
}

func (b *backend) set(h http.HandlerFunc) {
	b.mu.Lock()
	b.h = h
	b.mu.Unlock()
}

func (b *backend) target() Target { return Target{URL: b.srv.URL + "/metrics"} }

func serveBody(body []byte) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		w.Write(body)
	}
}

// slowOptions never lets the ticker fire during a test: scrapes are driven by ScrapeOnce (plus the
// one initial background scrape, which the tests tolerate).
func slowOptions(clock *fakeClock) Options {
	return Options{Interval: time.Hour, Timeout: 2 * time.Second, StaleAfter: 10 * time.Second, Now: clock.Now}
}

func TestScrapeOnceLoadsSnapshot(t *testing.T) {
	b := newBackend(t, readTestdata(t, "vllm_v1_two_engines.txt"))
	clock := newFakeClock()
	r := NewRegistry()
	h := r.Acquire(b.target(), slowOptions(clock))
	defer h.Release()

	if err := h.ScrapeOnce(context.Background()); err != nil {
		t.Fatalf("ScrapeOnce() = %v", err)
	}
	s, fresh := h.Load()
	if !fresh {
		t.Errorf("Load() fresh = false right after a scrape")
	}
	if s.Running != 12 || s.Waiting != 4 || s.Flavor != FlavorVLLM || !s.At.Equal(clock.Now()) {
		t.Errorf("Load() = %+v, want 12 running, 4 waiting, vllm, At=%v", s, clock.Now())
	}
}

// TestScrapeOverUnixSocket: a target with a socket is fetched through it (the URL's host is not
// dialled), and its errors name the socket; two sockets behind one URL are two targets.
func TestScrapeOverUnixSocket(t *testing.T) {
	dir, err := os.MkdirTemp("", "scrape") // short: a socket path is limited to ~100 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	socket := filepath.Join(dir, "a.sock")
	ln, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: serveBody(readTestdata(t, "vllm_v1_two_engines.txt"))}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })

	r := NewRegistry()
	clock := newFakeClock()
	h := r.Acquire(Target{URL: "http://localhost/metrics", Socket: socket}, slowOptions(clock))
	defer h.Release()
	if err := h.ScrapeOnce(context.Background()); err != nil {
		t.Fatalf("ScrapeOnce() over the socket = %v", err)
	}
	if s, _ := h.Load(); s.Running != 12 || s.Flavor != FlavorVLLM {
		t.Errorf("Load() = %+v, want 12 running, vllm", s)
	}

	missing := Target{URL: "http://localhost/metrics", Socket: filepath.Join(dir, "none.sock")}
	h2 := r.Acquire(missing, slowOptions(clock))
	defer h2.Release()
	err = h2.ScrapeOnce(context.Background())
	if err == nil || !strings.Contains(err.Error(), "none.sock") {
		t.Errorf("ScrapeOnce() of a missing socket = %v, want an error naming it", err)
	}
	if st, _ := r.Status(Target{URL: "http://localhost/metrics", Socket: socket}); st.Errors != 0 {
		t.Errorf("the good socket's status counts %d errors: the two targets share a poller", st.Errors)
	}
}

func TestLoadBeforeAnyScrape(t *testing.T) {
	b := newBackend(t, nil)
	b.set(func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) })
	r := NewRegistry()
	h := r.Acquire(b.target(), slowOptions(newFakeClock()))
	defer h.Release()
	if s, fresh := h.Load(); fresh || s != (Snapshot{}) {
		t.Errorf("Load() = %+v, %v; want zero snapshot, not fresh", s, fresh)
	}
}

func TestScrapeFailuresKeepLastGood(t *testing.T) {
	good := readTestdata(t, "sglang.txt")
	tests := []struct {
		name string
		// failing returns the handler for the failing phase; release is closed when the test ends.
		failing func(t *testing.T, release <-chan struct{}) http.HandlerFunc
		opts    func(o *Options)
		want    func(err error) bool
	}{
		{
			name: "timeout",
			failing: func(t *testing.T, release <-chan struct{}) http.HandlerFunc {
				return func(w http.ResponseWriter, r *http.Request) { <-release }
			},
			opts: func(o *Options) { o.Timeout = 50 * time.Millisecond },
			want: func(err error) bool { return errors.Is(err, context.DeadlineExceeded) },
		},
		{
			name: "garbage",
			failing: func(*testing.T, <-chan struct{}) http.HandlerFunc {
				return serveBody(readTestdata(t, "garbage.txt"))
			},
			want: func(err error) bool { return err != nil && !errors.Is(err, ErrNoMetrics) },
		},
		{
			name: "no known metrics",
			failing: func(*testing.T, <-chan struct{}) http.HandlerFunc {
				return serveBody([]byte("go_goroutines 12\n"))
			},
			want: func(err error) bool { return errors.Is(err, ErrNoMetrics) },
		},
		{
			name: "404",
			failing: func(*testing.T, <-chan struct{}) http.HandlerFunc {
				return func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) }
			},
			want: func(err error) bool { return errors.Is(err, ErrStatus) && strings.Contains(err.Error(), "404") },
		},
		{
			name: "huge body with content length",
			failing: func(*testing.T, <-chan struct{}) http.HandlerFunc {
				return serveBody(append(good, strings.Repeat("# padding\n", 1000)...))
			},
			opts: func(o *Options) { o.MaxBytes = int64(len(good)) },
			want: func(err error) bool { return errors.Is(err, ErrTooLarge) },
		},
		{
			name: "huge streamed body",
			failing: func(*testing.T, <-chan struct{}) http.HandlerFunc {
				return func(w http.ResponseWriter, r *http.Request) {
					for range 100 {
						fmt.Fprint(w, "# padding padding padding padding padding padding\n")
						w.(http.Flusher).Flush() // chunked: no Content-Length to reject early
					}
					w.Write(good)
				}
			},
			opts: func(o *Options) { o.MaxBytes = int64(len(good)) },
			want: func(err error) bool { return errors.Is(err, ErrTooLarge) },
		},
		{
			name: "redirect to another host",
			failing: func(t *testing.T, _ <-chan struct{}) http.HandlerFunc {
				other := newBackend(t, good)
				t.Cleanup(func() {
					if n := other.hits.Load(); n != 0 {
						t.Errorf("redirect target got %d requests, want 0", n)
					}
				})
				return func(w http.ResponseWriter, r *http.Request) {
					http.Redirect(w, r, strings.Replace(other.srv.URL, "127.0.0.1", "localhost", 1)+"/metrics", http.StatusFound)
				}
			},
			want: func(err error) bool { return errors.Is(err, ErrRedirect) },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := newBackend(t, good)
			release := make(chan struct{})
			t.Cleanup(func() { close(release) }) // runs before the server's Close
			clock := newFakeClock()
			o := slowOptions(clock)
			if tt.opts != nil {
				tt.opts(&o)
			}
			r := NewRegistry()
			h := r.Acquire(b.target(), o)
			t.Cleanup(h.Release) // runs first: cancels a blocked scrape

			if err := h.ScrapeOnce(context.Background()); err != nil {
				t.Fatalf("first ScrapeOnce() = %v", err)
			}
			b.set(tt.failing(t, release))
			err := h.ScrapeOnce(context.Background())
			if !tt.want(err) {
				t.Fatalf("ScrapeOnce() = %v, not the expected failure", err)
			}
			s, fresh := h.Load()
			if !fresh || s.Running != 22 || s.Waiting != 30 || s.Flavor != FlavorSGLang {
				t.Errorf("Load() = %+v, %v after a failure; want the last good snapshot, fresh", s, fresh)
			}
			st, ok := r.Status(b.target())
			if !ok || st.Errors == 0 || st.LastError == "" || !st.Fresh {
				t.Errorf("Status() = %+v, %v; want errors counted, last error set, fresh", st, ok)
			}
			clock.Advance(3 * time.Second)
			if st, _ := r.Status(b.target()); st.LastErrorAge != 3*time.Second || st.Age != 3*time.Second {
				t.Errorf("3 s later: LastErrorAge %v, Age %v; want 3s and 3s", st.LastErrorAge, st.Age)
			}
		})
	}
}

func TestBodyOfExactlyMaxBytesIsAccepted(t *testing.T) {
	good := readTestdata(t, "vllm_legacy.txt")
	b := newBackend(t, nil)
	b.set(func(w http.ResponseWriter, r *http.Request) {
		w.Write(good)
		w.(http.Flusher).Flush() // chunked, so the cap is enforced while reading
	})
	o := slowOptions(newFakeClock())
	o.MaxBytes = int64(len(good))
	h := NewRegistry().Acquire(b.target(), o)
	defer h.Release()
	if err := h.ScrapeOnce(context.Background()); err != nil {
		t.Fatalf("ScrapeOnce() = %v", err)
	}
}

func TestStaleness(t *testing.T) {
	b := newBackend(t, readTestdata(t, "vllm_legacy.txt"))
	clock := newFakeClock()
	r := NewRegistry()
	h := r.Acquire(b.target(), slowOptions(clock)) // StaleAfter 10s
	defer h.Release()
	if err := h.ScrapeOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	b.set(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusInternalServerError) })
	if err := h.ScrapeOnce(context.Background()); !errors.Is(err, ErrStatus) {
		t.Fatalf("ScrapeOnce() = %v, want ErrStatus", err)
	}

	clock.Advance(10 * time.Second)
	if _, fresh := h.Load(); !fresh {
		t.Errorf("Load() fresh = false at exactly StaleAfter")
	}
	clock.Advance(time.Millisecond)
	s, fresh := h.Load()
	if fresh {
		t.Errorf("Load() fresh = true after StaleAfter")
	}
	if s.Waiting != 9 {
		t.Errorf("Load() = %+v; a stale snapshot still carries the last good values", s)
	}
	st, _ := r.Status(b.target())
	if st.Fresh || st.Age != 10*time.Second+time.Millisecond {
		t.Errorf("Status() = %+v; want not fresh, age 10.001s", st)
	}

	b.set(serveBody(readTestdata(t, "vllm_legacy.txt")))
	if err := h.ScrapeOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, fresh := h.Load(); !fresh {
		t.Errorf("Load() fresh = false after recovering")
	}
}

func TestSharedPollerAndRelease(t *testing.T) {
	a := newBackend(t, readTestdata(t, "vllm_legacy.txt"))
	b := newBackend(t, readTestdata(t, "sglang.txt"))
	r := NewRegistry()
	o := slowOptions(newFakeClock())

	h1 := r.Acquire(a.target(), o)
	h2 := r.Acquire(a.target(), o)
	if got := r.Active(); got != 1 {
		t.Errorf("Active() = %d after two Acquires of one target, want 1", got)
	}
	if h1.p != h2.p {
		t.Errorf("two Acquires of one target got different pollers")
	}
	if err := h1.ScrapeOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	if s, fresh := h2.Load(); !fresh || s.Waiting != 9 {
		t.Errorf("second handle Load() = %+v, %v; want the shared snapshot", s, fresh)
	}
	h3 := r.Acquire(b.target(), o)
	modelTarget := a.target()
	modelTarget.Model = "Qwen/Qwen2.5-7B-Instruct"
	h4 := r.Acquire(modelTarget, o)
	if got := r.Active(); got != 3 {
		t.Errorf("Active() = %d with three targets, want 3", got)
	}

	h1.Release()
	h1.Release() // idempotent
	if got := r.Active(); got != 3 {
		t.Errorf("Active() = %d after releasing one of two handles, want 3", got)
	}
	if _, ok := r.Status(a.target()); !ok {
		t.Errorf("Status() not found while a handle is held")
	}
	h2.Release()
	h3.Release()
	h4.Release()
	if got := r.Active(); got != 0 {
		t.Errorf("Active() = %d after releasing everything, want 0", got)
	}
	if _, ok := r.Status(a.target()); ok {
		t.Errorf("Status() found after the last Release")
	}
	if _, fresh := h2.Load(); !fresh {
		t.Errorf("Load() after Release should still answer with the last snapshot")
	}
}

// TestOnScrape: a handle's OnScrape sees every good scrape once, the snapshot Load then returns, none
// that failed, and nothing after the handle is released; a handle without one is unaffected.
func TestOnScrape(t *testing.T) {
	b := newBackend(t, nil)
	b.set(func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) })
	r := NewRegistry()
	clock := newFakeClock()
	var mu sync.Mutex
	var seen []Snapshot
	o := slowOptions(clock)
	o.OnScrape = func(s Snapshot) {
		mu.Lock()
		seen = append(seen, s)
		mu.Unlock()
	}
	calls := func() []Snapshot {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(seen)
	}
	watching := r.Acquire(b.target(), o)
	plain := r.Acquire(b.target(), slowOptions(clock))
	defer plain.Release()
	deadline := time.Now().Add(5 * time.Second)
	for st, _ := r.Status(b.target()); st.Errors == 0; st, _ = r.Status(b.target()) { // the first scrape, failed
		if time.Now().After(deadline) {
			t.Fatal("the initial background scrape never ran")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got := calls(); len(got) != 0 {
		t.Fatalf("OnScrape called %d times for a failed scrape", len(got))
	}

	b.set(serveBody(readTestdata(t, "vllm_v1_two_engines.txt")))
	for i := range 2 {
		clock.Advance(time.Second)
		if err := plain.ScrapeOnce(context.Background()); err != nil {
			t.Fatal(err)
		}
		got := calls()
		want, _ := watching.Load()
		if len(got) != i+1 || got[i] != want || got[i].Running != 12 {
			t.Fatalf("after good scrape %d OnScrape saw %+v; want %d snapshots, the last %+v", i+1, got, i+1, want)
		}
	}
	b.set(func(w http.ResponseWriter, r *http.Request) { http.Error(w, "down", http.StatusServiceUnavailable) })
	if err := plain.ScrapeOnce(context.Background()); err == nil {
		t.Fatal("a 503 scrape succeeded")
	}
	watching.Release()
	b.set(serveBody(readTestdata(t, "vllm_v1_two_engines.txt")))
	clock.Advance(time.Second)
	if err := plain.ScrapeOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := calls(); len(got) != 2 {
		t.Errorf("OnScrape saw %d snapshots, want 2: none for the failed scrape, none after Release", len(got))
	}
}

func TestOptionsCombine(t *testing.T) {
	b := newBackend(t, readTestdata(t, "vllm_legacy.txt"))
	r := NewRegistry()
	h1 := r.Acquire(b.target(), Options{Interval: time.Hour, Timeout: time.Second, MaxBytes: 100})
	h2 := r.Acquire(b.target(), Options{Interval: 2 * time.Hour, Timeout: 3 * time.Second, MaxBytes: 200})
	defer h2.Release()

	cfg, _ := h1.p.config()
	if cfg.Interval != time.Hour || cfg.Timeout != 3*time.Second || cfg.MaxBytes != 200 {
		t.Errorf("combined options = %v/%v/%d, want shortest interval 1h, longest timeout 3s, largest cap 200",
			cfg.Interval, cfg.Timeout, cfg.MaxBytes)
	}
	h1.Release()
	cfg, _ = h2.p.config()
	if cfg.Interval != 2*time.Hour || cfg.MaxBytes != 200 {
		t.Errorf("options after release = %v/%d, want the remaining handle's 2h/200", cfg.Interval, cfg.MaxBytes)
	}

	d := Options{}.withDefaults()
	if d.Interval != time.Second || d.Timeout != 500*time.Millisecond || d.MaxBytes != 4<<20 || d.StaleAfter != 5*time.Second {
		t.Errorf("defaults = %+v", d)
	}
	if o := (Options{Interval: 100 * time.Millisecond}).withDefaults(); o.Timeout != 100*time.Millisecond {
		t.Errorf("Timeout = %v, want capped at the 100ms interval", o.Timeout)
	}
}

func TestBackgroundLoopScrapes(t *testing.T) {
	hit := make(chan struct{}, 16)
	b := newBackend(t, nil)
	body := readTestdata(t, "vllm_legacy.txt")
	b.set(func(w http.ResponseWriter, r *http.Request) {
		w.Write(body)
		select {
		case hit <- struct{}{}:
		default:
		}
	})
	h := NewRegistry().Acquire(b.target(), Options{Interval: 5 * time.Millisecond})
	defer h.Release()
	deadline := time.After(10 * time.Second) // a failure guard, not a wait
	for i := 0; i < 3; i++ {
		select {
		case <-hit:
		case <-deadline:
			t.Fatalf("only %d background scrapes seen", i)
		}
	}
}

type panicTransport struct{}

func (panicTransport) RoundTrip(*http.Request) (*http.Response, error) { panic("boom") }

func TestScrapePanicIsRecovered(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	o := slowOptions(newFakeClock())
	o.Client = &http.Client{Transport: panicTransport{}}
	o.Logger = zap.New(core)
	h := NewRegistry().Acquire(Target{URL: "http://127.0.0.1:1/metrics"}, o)
	defer h.Release()
	if err := h.ScrapeOnce(context.Background()); err == nil || !strings.Contains(err.Error(), "panic") {
		t.Errorf("ScrapeOnce() = %v, want a panic turned into an error", err)
	}
	if logs.FilterMessage("metrics scrape panicked").Len() == 0 {
		t.Errorf("no panic log; got %v", logs.All())
	}
}

func TestFailureLoggingRedactsAndThrottles(t *testing.T) {
	b := newBackend(t, nil)
	b.set(func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) })
	core, logs := observer.New(zapcore.DebugLevel)
	o := slowOptions(newFakeClock())
	o.Logger = zap.New(core)
	target := Target{URL: strings.Replace(b.srv.URL, "http://", "http://user:secret@", 1) + "/metrics"}
	r := NewRegistry()
	h := r.Acquire(target, o)
	defer h.Release()
	// The loop's own first scrape runs at Acquire; let it fail first, or it could land in the middle
	// of the sequence below and reset the failing state it checks.
	deadline := time.Now().Add(10 * time.Second) // a failure guard, not a wait
	for st, _ := r.Status(target); st.Errors == 0; st, _ = r.Status(target) {
		if time.Now().After(deadline) {
			t.Fatal("the poller's first scrape never ended")
		}
		time.Sleep(time.Millisecond)
	}
	for range 3 {
		h.ScrapeOnce(context.Background())
	}
	// A target that never answered is the caller's to judge (a server without metrics is normal):
	// debug lines only.
	if warn, debug := logs.FilterLevelExact(zapcore.WarnLevel).Len(), logs.FilterLevelExact(zapcore.DebugLevel).Len(); warn != 0 || debug < 3 {
		t.Errorf("never answered: logged %d warnings and %d debug lines, want debug lines only", warn, debug)
	}
	// One that answered and then stops: one warning, then debug.
	b.set(serveBody(readTestdata(t, "vllm_v1_two_engines.txt")))
	h.ScrapeOnce(context.Background())
	b.set(func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) })
	for range 3 {
		h.ScrapeOnce(context.Background())
	}
	warn := logs.FilterLevelExact(zapcore.WarnLevel).Len()
	debug := logs.FilterLevelExact(zapcore.DebugLevel).Len()
	if warn != 1 || debug < 5 {
		t.Errorf("logged %d warnings and %d debug lines, want 1 warning then debug", warn, debug)
	}
	for _, e := range logs.All() {
		if s := fmt.Sprint(e.ContextMap()); strings.Contains(s, "secret") {
			t.Errorf("log leaks the password: %s", s)
		}
	}
	if st, _ := r.Status(target); strings.Contains(st.LastError, "secret") {
		t.Errorf("Status().LastError leaks the password: %s", st.LastError)
	}
}

func TestNoGoroutineLeak(t *testing.T) {
	b := newBackend(t, readTestdata(t, "vllm_v1_two_engines.txt"))
	r := NewRegistry()
	// Warm up once so that lazily started runtime and server goroutines are in the baseline.
	h := r.Acquire(b.target(), Options{Interval: time.Hour})
	h.ScrapeOnce(context.Background())
	h.Release()
	waitGoroutines(t, runtime.NumGoroutine()+1) // settle
	baseline := runtime.NumGoroutine()

	for i := range 100 {
		h1 := r.Acquire(b.target(), Options{Interval: time.Hour})
		h2 := r.Acquire(b.target(), Options{Interval: time.Hour})
		if err := h1.ScrapeOnce(context.Background()); err != nil {
			t.Fatalf("cycle %d: ScrapeOnce() = %v", i, err)
		}
		h2.Release()
		h1.Release()
		if got := r.Active(); got != 0 {
			t.Fatalf("cycle %d: Active() = %d after release, want 0", i, got)
		}
	}
	waitGoroutines(t, baseline)
}

// waitGoroutines polls, for a bounded time, until at most n goroutines run.
func waitGoroutines(t *testing.T, n int) {
	t.Helper()
	var got int
	for range 500 {
		if got = runtime.NumGoroutine(); got <= n {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	buf := make([]byte, 1<<16)
	t.Fatalf("%d goroutines still running, want <= %d:\n%s", got, n, buf[:runtime.Stack(buf, true)])
}

func TestConcurrentUse(t *testing.T) {
	b := newBackend(t, readTestdata(t, "sglang.txt"))
	r := NewRegistry()
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for range 20 {
				h := r.Acquire(b.target(), Options{Interval: time.Hour, Timeout: time.Duration(i+1) * time.Second})
				h.ScrapeOnce(context.Background())
				h.Load()
				r.Status(b.target())
				h.Release()
			}
		})
	}
	wg.Wait()
	if got := r.Active(); got != 0 {
		t.Errorf("Active() = %d, want 0", got)
	}
}

func BenchmarkLoad(b *testing.B) {
	srv := httptest.NewServer(serveBody(readTestdata(b, "vllm_v1_two_engines.txt")))
	defer srv.Close()
	h := NewRegistry().Acquire(Target{URL: srv.URL}, Options{Interval: time.Hour})
	defer h.Release()
	if err := h.ScrapeOnce(context.Background()); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			h.Load()
		}
	})
}

func BenchmarkScrapeOnce(b *testing.B) {
	srv := httptest.NewServer(serveBody(readTestdata(b, "vllm_v1_two_engines.txt")))
	defer srv.Close()
	h := NewRegistry().Acquire(Target{URL: srv.URL}, Options{Interval: time.Hour})
	defer h.Release()
	b.ReportAllocs()
	for b.Loop() {
		if err := h.ScrapeOnce(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
}

// TestKick: a kick brings a scrape long before the interval, and kicks in a row bring at most one
// scrape per KickGap.
func TestKick(t *testing.T) {
	b := newBackend(t, readTestdata(t, "vllm_legacy.txt"))
	const gap = 20 * time.Millisecond
	h := NewRegistry().Acquire(b.target(), Options{Interval: time.Hour, KickGap: gap})
	defer h.Release()
	waitHits := func(n int64) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second) // a failure guard, not a wait
		for b.hits.Load() < n {
			if time.Now().After(deadline) {
				t.Fatalf("%d scrapes, want %d", b.hits.Load(), n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	waitHits(1) // the first, at start
	h.Kick()    // within the gap of the first: it comes once the gap has passed
	waitHits(2)

	before, start := b.hits.Load(), time.Now()
	for time.Since(start) < 10*gap {
		h.Kick()
		time.Sleep(100 * time.Microsecond)
	}
	elapsed := time.Since(start)
	time.Sleep(2 * gap) // a kick still waiting for its gap
	got := b.hits.Load() - before
	if most := int64(elapsed/gap) + 2; got > most {
		t.Errorf("%d scrapes from kicks over %v, want at most one per %v gap (%d)", got, elapsed, gap, most)
	}
	if got < 1 {
		t.Error("kicks brought no scrape")
	}
	if st, _ := h.p.registry.Status(b.target()); st.BroughtForward != uint64(got+1) {
		t.Errorf("Status().BroughtForward = %d, want the %d scrapes kicks brought", st.BroughtForward, got+1)
	}

	if o := (Options{Interval: 100 * time.Millisecond}).withDefaults(); o.KickGap != 20*time.Millisecond {
		t.Errorf("KickGap = %v, want a fifth of the 100ms interval", o.KickGap)
	}
	if o := (Options{Interval: 100 * time.Millisecond, KickGap: time.Second}).withDefaults(); o.KickGap != 100*time.Millisecond {
		t.Errorf("KickGap = %v, want capped at the 100ms interval", o.KickGap)
	}
}
