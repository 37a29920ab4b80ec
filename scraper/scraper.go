// Package scraper polls LLM inference servers' Prometheus /metrics endpoints (vLLM, SGLang, llama.cpp,
// NVIDIA NIM) and keeps the last good load snapshot of each one: running and waiting requests, KV-cache
// usage, prefix-cache counters and cache geometry.
//
// A Registry runs one polling goroutine per Target, shared by every holder of a Handle for that
// target (several policies, overlapping configurations during a reload), and stops it when the last
// Handle is released. Readers call Handle.Load, which never blocks on I/O: it reads an atomically
// published snapshot. Failed scrapes (timeouts, non-200 answers, garbage, oversized bodies,
// redirects) keep the last good snapshot; Load reports it as not fresh once it is older than
// Options.StaleAfter, and callers then fall back to their own load signals.
//
// Memory is bounded by the number of targets: each holds one Snapshot, one HTTP transport with at
// most one idle connection, and the decoded families of at most one response of Options.MaxBytes
// per scrape in flight.
package scraper

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Defaults applied by Options for zero or negative fields.
const (
	DefaultInterval = time.Second
	DefaultTimeout  = 500 * time.Millisecond
	DefaultMaxBytes = 4 << 20
	// DefaultStaleFactor times the interval is the default StaleAfter.
	DefaultStaleFactor = 5
)

// Errors wrapped by scrape failures, for callers that test the cause with errors.Is.
var (
	// ErrTooLarge: the response body exceeded Options.MaxBytes.
	ErrTooLarge = errors.New("metrics response too large")
	// ErrRedirect: the target answered with a redirect, which is never followed.
	ErrRedirect = errors.New("redirect refused")
	// ErrStatus: the target answered with a status other than 200.
	ErrStatus = errors.New("unexpected status")
)

// Target names one metrics endpoint. It is comparable and used as a map key: the same URL and
// model share one poller.
type Target struct {
	// URL is the full metrics URL, for example http://127.0.0.1:8000/metrics.
	URL string
	// Model, when not empty, keeps only series whose model_name label equals it.
	Model string
	// Socket, when not empty, is the unix socket the scrapes dial (a server started with vLLM's
	// --uds); URL's host is then only the Host header. A Client given in Options must dial it itself
	// (DialSocket).
	Socket string
}

// String is the URL, with the socket it is fetched through, if any: what logs and errors name.
func (t Target) String() string {
	if t.Socket == "" {
		return redact(t.URL)
	}
	return redact(t.URL) + " via unix socket " + t.Socket
}

// DialSocket returns a DialContext for an http.Transport that dials the unix socket at path whatever
// address it is asked for.
func DialSocket(path string) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
}

// Options tune polling. The zero value is valid: every zero field takes its default.
type Options struct {
	// Interval between scrapes; default 1s.
	Interval time.Duration
	// Timeout of one scrape, connection to end of body; default 500ms, never more than Interval.
	Timeout time.Duration
	// MaxBytes caps the (decompressed) response body; default 4 MiB. A larger body is an error.
	MaxBytes int64
	// StaleAfter is the age after which Load reports a snapshot as not fresh; default 5*Interval.
	StaleAfter time.Duration
	// Client sends the scrapes. Default: a client of its own per target, with no proxy. Redirects
	// are refused whatever the client's CheckRedirect says.
	Client *http.Client
	// Now is the clock; default time.Now.
	Now func() time.Time
	// Logger receives scrape failures with the target URL (password redacted): the first failure
	// after a success at warn level, the following ones at debug. Default: no logging.
	Logger *zap.Logger
	// KickGap is the least time from one scrape's start to a scrape a Kick brings; default
	// Interval/5, never more than Interval.
	KickGap time.Duration
	// OnScrape, when set, is called with each good snapshot once it is published, on the poller's
	// goroutine, for as long as the handle is live: a user that learns from every scrape, not only
	// from those it happens to Load. It must return quickly (the next scrape waits for it) and not
	// call back into the Registry.
	OnScrape func(Snapshot)
}

// withDefaults returns o with every zero field set to its default.
func (o Options) withDefaults() Options {
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	o.Timeout = min(o.Timeout, o.Interval)
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultMaxBytes
	}
	if o.StaleAfter <= 0 {
		o.StaleAfter = DefaultStaleFactor * o.Interval
	}
	if o.KickGap <= 0 {
		o.KickGap = o.Interval / 5
	}
	o.KickGap = min(o.KickGap, o.Interval)
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return o
}

// Status describes one target for operators (the admin endpoint).
type Status struct {
	// Snapshot is the last good scrape; zero when none succeeded yet.
	Snapshot Snapshot
	// Fresh is true when Snapshot is no older than the StaleAfter of the most recent live handle.
	Fresh bool
	// Errors counts failed scrapes since the poller started.
	Errors uint64
	// BroughtForward counts the scrapes a Kick brought before the interval's tick.
	BroughtForward uint64
	// LastError is the message of the most recent failure ("" if none), LastErrorAt its time and
	// LastErrorAge the time since (zero when none): beside Age, it tells a failure that is over (an
	// older one, such as a first scrape before the backend listened) from one that is not.
	LastError    string
	LastErrorAt  time.Time
	LastErrorAge time.Duration
	// Age is the time since Snapshot was scraped; zero when there is none.
	Age time.Duration
}

// Registry shares one polling goroutine per Target across every user. The zero value is not usable;
// call NewRegistry. All methods are safe for concurrent use.
//
// When holders of the same Target pass different Options, the poller combines them: the shortest
// Interval, the longest Timeout (capped by that interval), the largest MaxBytes; Client, Now, Logger
// and KickGap (capped by the interval) come from the most recent live Handle. Each Handle judges
// freshness with its own StaleAfter and Now. The combination is recomputed on every Acquire and
// Release, so after a config reload releases the old handles the new configuration's options alone
// apply.
type Registry struct {
	mu      sync.Mutex
	pollers map[Target]*poller
	active  atomic.Int64
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{pollers: make(map[Target]*poller)}
}

// Default is the process-wide registry, which survives config reloads.
var Default = NewRegistry()

// Acquire starts polling t if no poller for it is running, and returns a handle on it. Each
// Acquire needs exactly one Release; the goroutine stops when the last handle is released. The
// first scrape starts at once in the background; use ScrapeOnce to wait for one.
// Cost: O(handles of t) under the registry lock.
func (r *Registry) Acquire(t Target, o Options) *Handle {
	h := &Handle{opts: o.withDefaults()}
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.pollers[t]
	started := false
	if p == nil {
		p = newPoller(t, r)
		r.pollers[t] = p
		started = true
	}
	h.p = p
	p.addHandle(h)
	if started {
		r.active.Add(1)
		go p.run(&r.active)
	}
	return h
}

// Status returns what the registry knows about t without holding a handle. ok is false when no
// poller for t is running.
func (r *Registry) Status(t Target) (s Status, ok bool) {
	r.mu.Lock()
	p := r.pollers[t]
	r.mu.Unlock()
	if p == nil {
		return Status{}, false
	}
	return p.status(), true
}

// Active returns the number of running poll goroutines.
func (r *Registry) Active() int {
	return int(r.active.Load())
}

// release detaches h; it stops and waits for the poller when h was its last handle.
func (r *Registry) release(h *Handle) {
	r.mu.Lock()
	p := h.p
	last := p.removeHandle(h)
	if last && r.pollers[p.target] == p {
		delete(r.pollers, p.target)
	}
	r.mu.Unlock()
	if last {
		p.stop()
	}
}

// Handle is one user's claim on a target's poller. Its methods are safe for concurrent use.
type Handle struct {
	p        *poller
	opts     Options
	released sync.Once
}

// Release gives the handle back; when it is the last handle of its target, the poller's goroutine
// is stopped (an in-flight scrape is cancelled) and Release waits for it to exit. Idempotent.
// Load still answers afterwards, with a snapshot that eventually turns stale.
func (h *Handle) Release() {
	h.released.Do(func() { h.p.registry.release(h) })
}

// Load returns the last good snapshot and whether it is fresh (scraped within StaleAfter of now).
// It never blocks: one atomic load, no lock, no allocation.
func (h *Handle) Load() (Snapshot, bool) {
	return h.LoadAt(h.opts.Now())
}

// LoadAt is Load with the time to judge freshness against given, for a caller that read the clock
// already (a decision reads every upstream's snapshot at the one time it was made).
func (h *Handle) LoadAt(now time.Time) (Snapshot, bool) {
	s := h.p.last.Load()
	if s == nil {
		return Snapshot{}, false
	}
	return *s, now.Sub(s.At) <= h.opts.StaleAfter
}

// Kick asks for a scrape sooner than the interval: at once when the last one started at least
// KickGap ago, else when it has; kicks in between are one. It never blocks. A user that reads a
// scrape which leaves a question open (requests waiting at a batch size seen once) gets the next
// look in a fraction of the interval instead of a whole one.
func (h *Handle) Kick() {
	select {
	case h.p.kick <- struct{}{}:
	default:
	}
}

// ScrapeOnce scrapes the target now, synchronously, with the poller's current options, and
// publishes the result like a background scrape would. It returns the scrape's error. Tests use it
// instead of waiting for the ticker.
func (h *Handle) ScrapeOnce(ctx context.Context) error {
	return h.p.scrape(ctx)
}

// poller owns the goroutine and the state of one target.
type poller struct {
	target   Target
	logURL   string
	registry *Registry

	// last is the last good snapshot, published atomically for Load.
	last      atomic.Pointer[Snapshot]
	errors    atomic.Uint64
	kicked    atomic.Uint64 // scrapes a Kick brought forward
	failing   atomic.Bool
	stopOnce  sync.Once
	stopCh    chan struct{}
	done      chan struct{}
	ctx       context.Context
	cancel    context.CancelFunc
	reset     chan struct{}
	kick      chan struct{} // Kick: a scrape sooner than the interval
	transport *http.Transport

	mu          sync.Mutex // guards the fields below; never held across I/O
	handles     []*Handle
	cfg         Options // combined options of handles
	client      *http.Client
	lastErr     string
	lastErrorAt time.Time
}

func newPoller(t Target, r *Registry) *poller {
	ctx, cancel := context.WithCancel(context.Background())
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.Proxy = nil
	tr.MaxIdleConnsPerHost = 1
	if t.Socket != "" {
		tr.DialContext = DialSocket(t.Socket)
	}
	return &poller{
		target:    t,
		registry:  r,
		logURL:    t.String(),
		stopCh:    make(chan struct{}),
		done:      make(chan struct{}),
		ctx:       ctx,
		cancel:    cancel,
		reset:     make(chan struct{}, 1),
		kick:      make(chan struct{}, 1),
		transport: tr,
	}
}

func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<invalid url>"
	}
	return u.Redacted()
}

// addHandle registers h and recombines the options. Called with the registry lock held.
func (p *poller) addHandle(h *Handle) {
	p.mu.Lock()
	p.handles = append(p.handles, h)
	p.combineLocked()
	p.mu.Unlock()
}

// removeHandle unregisters h and reports whether it was the last. Called with the registry lock held.
func (p *poller) removeHandle(h *Handle) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if i := slices.Index(p.handles, h); i >= 0 {
		p.handles = slices.Delete(p.handles, i, i+1)
	}
	if len(p.handles) == 0 {
		return true
	}
	p.combineLocked()
	return false
}

// combineLocked recomputes cfg and client from the live handles and wakes the loop if the interval
// changed. p.mu must be held.
func (p *poller) combineLocked() {
	if len(p.handles) == 0 {
		return
	}
	latest := p.handles[len(p.handles)-1].opts
	cfg := latest
	for _, h := range p.handles {
		cfg.Interval = min(cfg.Interval, h.opts.Interval)
		cfg.Timeout = max(cfg.Timeout, h.opts.Timeout)
		cfg.MaxBytes = max(cfg.MaxBytes, h.opts.MaxBytes)
	}
	cfg.Timeout = min(cfg.Timeout, cfg.Interval)
	cfg.KickGap = min(cfg.KickGap, cfg.Interval)
	if cfg.Client != p.cfg.Client || p.client == nil {
		p.client = p.clientFor(cfg.Client)
	}
	changed := cfg.Interval != p.cfg.Interval
	p.cfg = cfg
	if changed {
		select {
		case p.reset <- struct{}{}:
		default:
		}
	}
}

// clientFor returns a copy of c (or of the default client) that never follows redirects.
func (p *poller) clientFor(c *http.Client) *http.Client {
	var cc http.Client
	if c != nil {
		cc = *c
	} else {
		cc.Transport = p.transport
	}
	cc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &cc
}

func (p *poller) config() (Options, *http.Client) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cfg, p.client
}

// run is the polling loop: one scrape at start, then one per tick until stop.
func (p *poller) run(active *atomic.Int64) {
	defer close(p.done) // last: Release returns only after the count and connections are cleaned up
	defer active.Add(-1)
	defer p.transport.CloseIdleConnections()
	cfg, _ := p.config()
	defer func() {
		if r := recover(); r != nil {
			cfg.Logger.Error("metrics poller panicked", zap.String("url", p.logURL),
				zap.Any("panic", r), zap.ByteString("stack", debug.Stack()))
		}
	}()
	ticker := time.NewTicker(cfg.Interval)
	defer ticker.Stop()
	soon := time.NewTimer(time.Hour) // a kicked scrape that had to wait for KickGap
	soon.Stop()
	defer soon.Stop()
	last := time.Now()
	scrape := func() {
		soon.Stop()
		last = time.Now()
		_ = p.scrape(p.ctx)
	}
	scrape()
	for {
		select {
		case <-p.stopCh:
			return
		case <-p.reset:
			cfg, _ := p.config()
			ticker.Reset(cfg.Interval)
		case <-ticker.C:
			scrape()
		case <-p.kick:
			cfg, _ := p.config()
			if wait := cfg.KickGap - time.Since(last); wait > 0 {
				soon.Reset(wait)
				continue
			}
			p.kicked.Add(1)
			scrape()
		case <-soon.C:
			p.kicked.Add(1)
			scrape()
		}
	}
}

// stop ends the loop, cancelling a scrape in flight, and waits for it to exit.
func (p *poller) stop() {
	p.stopOnce.Do(func() {
		p.cancel()
		close(p.stopCh)
	})
	<-p.done
}

// scrape fetches and parses the metrics once and publishes the outcome. A panic in it is recovered
// and reported as an error so that the loop keeps running.
func (p *poller) scrape(ctx context.Context) (err error) {
	cfg, client := p.config()
	start := cfg.Now()
	defer func() {
		if r := recover(); r != nil {
			cfg.Logger.Error("metrics scrape panicked", zap.String("url", p.logURL),
				zap.Any("panic", r), zap.ByteString("stack", debug.Stack()))
			err = fmt.Errorf("scraping %s: panic: %v", p.logURL, r)
		}
		p.record(cfg, start, err)
	}()
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	s, err := fetch(ctx, client, p.target, cfg.MaxBytes)
	if p.ctx.Err() != nil {
		// A ScrapeOnce after the loop stopped: leave no idle connection behind.
		p.transport.CloseIdleConnections()
	}
	if err != nil {
		return fmt.Errorf("scraping %s: %w", p.logURL, err)
	}
	s.At = start
	if p.publish(&s) {
		p.notify(s)
	}
	return nil
}

// publish stores s unless a newer snapshot (from a concurrent scrape) is already there, and reports
// whether it did.
func (p *poller) publish(s *Snapshot) bool {
	for {
		old := p.last.Load()
		if old != nil && old.At.After(s.At) {
			return false
		}
		if p.last.CompareAndSwap(old, s) {
			return true
		}
	}
}

// notify calls the OnScrape of every live handle that set one with s, outside the lock.
func (p *poller) notify(s Snapshot) {
	p.mu.Lock()
	var calls []func(Snapshot)
	for _, h := range p.handles {
		if h.opts.OnScrape != nil {
			calls = append(calls, h.opts.OnScrape)
		}
	}
	p.mu.Unlock()
	for _, f := range calls {
		f(s)
	}
}

// record counts and logs a failure, or clears the failing state after a success.
func (p *poller) record(cfg Options, at time.Time, err error) {
	if err == nil {
		p.failing.Store(false)
		return
	}
	p.errors.Add(1)
	p.mu.Lock()
	p.lastErr, p.lastErrorAt = err.Error(), at
	p.mu.Unlock()
	if errors.Is(err, context.Canceled) && p.ctx.Err() != nil {
		return // stopping
	}
	// A target that used to answer and stopped is worth a warning; one that never answered is the
	// caller's to judge (an OpenAI-compatible server without metrics is normal).
	level := zap.DebugLevel
	if !p.failing.Swap(true) && p.last.Load() != nil {
		level = zap.WarnLevel
	}
	if c := cfg.Logger.Check(level, "metrics scrape failed"); c != nil {
		c.Write(zap.String("url", p.logURL), zap.Error(err))
	}
}

func (p *poller) status() Status {
	cfg, _ := p.config()
	now := cfg.Now() // one reading, so that the two ages compare
	var st Status
	p.mu.Lock()
	st.LastError, st.LastErrorAt = p.lastErr, p.lastErrorAt
	p.mu.Unlock()
	if st.LastError != "" {
		st.LastErrorAge = max(now.Sub(st.LastErrorAt), 0)
	}
	st.Errors = p.errors.Load()
	st.BroughtForward = p.kicked.Load()
	if s := p.last.Load(); s != nil {
		st.Snapshot = *s
		st.Age = max(now.Sub(s.At), 0)
		st.Fresh = st.Age <= cfg.StaleAfter
	}
	return st
}

// fetch performs one GET and parses the body, reading at most maxBytes.
func fetch(ctx context.Context, client *http.Client, t Target, maxBytes int64) (Snapshot, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, t.URL, nil)
	if err != nil {
		return Snapshot{}, err
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	req.Header.Set("User-Agent", "caddy-llm-scraper")
	resp, err := client.Do(req)
	if err != nil {
		return Snapshot{}, err
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode >= 300 && resp.StatusCode < 400:
		return Snapshot{}, fmt.Errorf("%w: status %d", ErrRedirect, resp.StatusCode)
	case resp.StatusCode != http.StatusOK:
		return Snapshot{}, fmt.Errorf("%w %d", ErrStatus, resp.StatusCode)
	}
	if resp.ContentLength > maxBytes {
		return Snapshot{}, fmt.Errorf("%w: content length %d exceeds %d bytes", ErrTooLarge, resp.ContentLength, maxBytes)
	}
	s, err := Parse(&cappedReader{r: resp.Body, left: maxBytes}, t.Model)
	if err != nil {
		return Snapshot{}, err
	}
	return s, nil
}

// cappedReader reads at most left bytes and then fails with ErrTooLarge if more remain.
type cappedReader struct {
	r    io.Reader
	left int64
}

func (c *cappedReader) Read(b []byte) (int, error) {
	if c.left <= 0 {
		// Probe for one more byte: an exactly-sized body is fine.
		var one [1]byte
		n, err := c.r.Read(one[:])
		if n > 0 {
			return 0, ErrTooLarge
		}
		return 0, err
	}
	if int64(len(b)) > c.left {
		b = b[:c.left]
	}
	n, err := c.r.Read(b)
	c.left -= int64(n)
	return n, err
}
