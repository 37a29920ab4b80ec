// Package share shares what an affinity.Table learns - prefix routes and conversation pins - with every
// other instance using the same Redis, and imports what they learn as remote entries.
//
// # Design
//
// One Redis stream, <prefix>changes, carries everything. Each instance drains its table's change feed
// every FlushInterval (default 100ms) and appends what it learned as one stream entry (XADD with
// MAXLEN ~ StreamLength, and a PEXPIRE of Window so the stream disappears once every instance is gone).
// Each instance also reads the stream: at start it reads the entries of the last Window (default 30
// minutes, the default conversation TTL) to warm up, then follows it with XREAD BLOCK from the last entry
// it read, importing every other instance's changes with affinity.Table.ImportChanges (its own are
// recognized by a random instance ID and skipped). After a disconnection it resumes from the last entry
// it read, so it catches up with what is still in the stream. A stream instead of pub/sub gives the
// warm-up, the catch-up and the live feed with one key and one mechanism.
//
// # Cost on the wire
//
// An entry of a batch is 8 bytes of key, one byte of upstream index and kind, and one or two bytes of
// age: 10 or 11 bytes a learned route or pin; each batch adds its header (18 bytes plus each upstream's
// dial address once) and Redis's stream entry overhead (an ID and a field name, about 30 bytes). A route
// re-learned continuously is published at most once per TTL/8 (see affinity.EnableFeed). At most
// MaxBatch changes are published per FlushInterval (default 2048 per 100ms, so at most about 225 KB/s
// and 10 XADDs a second per instance); beyond that the table's feed drops changes and counts them.
//
// # Failures
//
// No request ever waits on Redis: Learn and Pin only append to the table's bounded feed under the lock
// they already hold, and one goroutine drains it. When Redis is down or slow (a command taking over
// Timeout), the changes drained meanwhile are dropped and counted, routing goes on with local state, and
// a reader goroutine retries with exponential backoff (100ms to 5s), logging the loss and the recovery
// once each and reporting them through Config.OnConnected.
//
// # Beside the routes
//
// An instance can also publish an opaque summary of what it has learned besides routes (caddy-llm: each
// upstream's service model) with Config.Models: every ModelsInterval it is written as the instance's
// field of one Redis hash, <prefix>models, stamped with the time. A starting instance reads the hash
// in its warm-up and hands the other instances' summaries of the last Window, newest first, to
// Config.PeerModels; fields older than that are deleted.
//
// A Sharer is safe for concurrent use. It holds no more than one batch in memory besides the table's feed.
package share

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
	"go.uber.org/zap"

	"github.com/tokenrouter/caddy-llm/affinity"
)

// Defaults applied by Start to zero Config fields.
const (
	DefaultPrefix        = "caddy-llm:"
	DefaultFlushInterval = 100 * time.Millisecond
	DefaultMaxBatch      = 2048
	DefaultStreamLength  = 10_000
	DefaultWindow        = 30 * time.Minute
	DefaultTimeout       = time.Second
	// DefaultModelsInterval is how often Config.Models is published.
	DefaultModelsInterval = 10 * time.Second

	minBackoff = 100 * time.Millisecond
	maxBackoff = 5 * time.Second
	readBlock  = 2 * time.Second
	pageSize   = 256
)

// Config configures a Sharer.
type Config struct {
	// URL is the Redis server: redis://[user:pass@]host:port/db, or rediss:// for TLS.
	URL string
	// Prefix starts every Redis key used. Default DefaultPrefix.
	Prefix string
	// FlushInterval is how often learned changes are published. Default 100ms.
	FlushInterval time.Duration
	// MaxBatch is the most changes published per FlushInterval (the table's feed capacity). Default 2048.
	MaxBatch int
	// StreamLength caps the stream, in batches (approximately). Default 10_000.
	StreamLength int64
	// Window is how far back a starting instance reads, and how long the stream outlives its last writer.
	// Default 30 minutes.
	Window time.Duration
	// Timeout bounds each Redis command but the blocking read. Default 1s.
	Timeout time.Duration
	// Logger receives connection changes (once each) and problems. Default: no logs.
	Logger *zap.Logger
	// OnConnected, when set, is called with each change of the connection state.
	OnConnected func(connected bool)
	// Models, when set, returns what this instance publishes beside its routes every ModelsInterval (see
	// the package doc); nil or empty publishes nothing. It runs on the publishing goroutine.
	Models func() []byte
	// PeerModels, when set, is called once, at the warm-up, with the other instances' published summaries
	// of the last Window, newest first (none: not called).
	PeerModels func(newestFirst [][]byte)
	// ModelsInterval is how often Models is published. Default 10s.
	ModelsInterval time.Duration
}

func (c *Config) withDefaults() {
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.FlushInterval <= 0 {
		c.FlushInterval = DefaultFlushInterval
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = DefaultMaxBatch
	}
	if c.StreamLength <= 0 {
		c.StreamLength = DefaultStreamLength
	}
	if c.Window <= 0 {
		c.Window = DefaultWindow
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.OnConnected == nil {
		c.OnConnected = func(bool) {}
	}
	if c.ModelsInterval <= 0 {
		c.ModelsInterval = DefaultModelsInterval
	}
}

// Status is a Sharer's state, as reported by /llm/state.
type Status struct {
	URL               string    `json:"url"` // password redacted
	Stream            string    `json:"stream"`
	Connected         bool      `json:"connected"`
	Since             time.Time `json:"since"` // of the current connection state
	WarmedUp          bool      `json:"warmed_up"`
	PublishedBatches  uint64    `json:"published_batches"`
	PublishedChanges  uint64    `json:"published_changes"`
	PublishedBytes    uint64    `json:"published_bytes"`
	ImportedBatches   uint64    `json:"imported_batches"`
	ImportedChanges   uint64    `json:"imported_changes"`
	DroppedChanges    uint64    `json:"dropped_changes"` // drained while Redis was unavailable, or feed full
	UndecodedBatches  uint64    `json:"undecoded_batches"`
	LastError         string    `json:"last_error,omitempty"`
	LastErrorAt       time.Time `json:"last_error_at,omitzero"`
	ReconnectAttempts uint64    `json:"reconnect_attempts"`
	// PublishedModels counts the publications of Config.Models; PeerModels is how many other instances'
	// summaries the warm-up found.
	PublishedModels uint64 `json:"published_models"`
	PeerModels      int    `json:"peer_models"`
}

// Sharer publishes a table's changes to Redis and imports other instances' changes into it.
type Sharer struct {
	cfg      Config
	table    *affinity.Table
	client   *redis.Client
	stream   string
	models   string // the hash of the instances' Models
	instance uint64
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	warm     chan struct{} // closed after the warm-up read, successful or not

	connected                                   atomic.Bool
	published, publishedChanges, publishedBytes atomic.Uint64
	imported, importedChanges, dropped          atomic.Uint64
	undecoded, attempts                         atomic.Uint64
	publishedModels                             atomic.Uint64

	mu         sync.Mutex // guards the fields below
	since      time.Time
	lastErr    string
	errAt      time.Time
	warmedUp   bool
	peerModels int

	peerModelsRead bool // only the read loop touches it
	known          bool // the connection state has been reported once
}

// ParseURL checks a Redis URL as Start will use it.
func ParseURL(rawURL string) error {
	_, err := redis.ParseURL(rawURL)
	return err
}

// Redact returns rawURL with its password replaced by "xxxxx".
func Redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparsable)"
	}
	return u.Redacted()
}

// Start enables the table's change feed and starts sharing it. It returns at once, before Redis is even
// reached; WaitWarm waits for the warm-up read. Close stops it.
func Start(table *affinity.Table, cfg Config) (*Sharer, error) {
	cfg.withDefaults()
	opts, err := redis.ParseURL(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("parsing redis URL %s: %w", Redact(cfg.URL), err)
	}
	opts.DialTimeout = cfg.Timeout
	opts.ReadTimeout = cfg.Timeout
	opts.WriteTimeout = cfg.Timeout
	opts.ContextTimeoutEnabled = true
	opts.MaxRetries = -1 // the loops retry with backoff; a command fails fast
	opts.PoolSize = 4
	opts.DisableIdentity = true
	opts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}

	s := &Sharer{
		cfg:      cfg,
		table:    table,
		client:   redis.NewClient(opts),
		stream:   cfg.Prefix + "changes",
		models:   cfg.Prefix + "models",
		instance: rand.Uint64() | 1,
		warm:     make(chan struct{}),
		since:    time.Now(),
	}
	table.EnableFeed(cfg.MaxBatch)
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.wg.Add(2)
	go s.loop(ctx, "publish", s.publishLoop)
	go s.loop(ctx, "read", s.readLoop)
	return s, nil
}

// Close stops sharing, turns the table's feed off and closes the Redis connections. It waits for the
// goroutines, which stop within Timeout.
func (s *Sharer) Close() {
	s.cancel()
	s.wg.Wait()
	s.table.EnableFeed(0)
	_ = s.client.Close()
}

// WaitWarm waits until the warm-up read is done (or failed) or ctx ends; it reports whether it was done.
func (s *Sharer) WaitWarm(ctx context.Context) bool {
	select {
	case <-s.warm:
		return true
	case <-ctx.Done():
		return false
	}
}

// Status returns the current state and counters.
func (s *Sharer) Status() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Status{
		URL: Redact(s.cfg.URL), Stream: s.stream, Connected: s.connected.Load(), Since: s.since,
		WarmedUp: s.warmedUp, PublishedBatches: s.published.Load(), PublishedChanges: s.publishedChanges.Load(),
		PublishedBytes: s.publishedBytes.Load(), ImportedBatches: s.imported.Load(),
		ImportedChanges: s.importedChanges.Load(), DroppedChanges: s.dropped.Load(),
		UndecodedBatches: s.undecoded.Load(), LastError: s.lastErr, LastErrorAt: s.errAt,
		ReconnectAttempts: s.attempts.Load(), PublishedModels: s.publishedModels.Load(), PeerModels: s.peerModels,
	}
}

// loop runs fn until ctx ends, restarting it after a panic (logged with its stack).
func (s *Sharer) loop(ctx context.Context, name string, fn func(context.Context)) {
	defer s.wg.Done()
	for ctx.Err() == nil {
		func() {
			defer func() {
				if r := recover(); r != nil {
					s.cfg.Logger.Error("share: panic in "+name+" loop", zap.Any("error", r), zap.ByteString("stack", debug.Stack()))
					sleep(ctx, time.Second)
				}
			}()
			fn(ctx)
		}()
	}
}

// setConnected records the connection state, logging and reporting changes once each.
func (s *Sharer) setConnected(up bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil && !errors.Is(err, context.Canceled) {
		s.lastErr, s.errAt = err.Error(), time.Now()
	}
	if s.known && s.connected.Load() == up {
		return
	}
	s.known = true
	s.connected.Store(up)
	s.since = time.Now()
	s.cfg.OnConnected(up)
	if up {
		s.cfg.Logger.Info("share: connected to redis", zap.String("url", Redact(s.cfg.URL)), zap.String("stream", s.stream))
	} else {
		s.cfg.Logger.Warn("share: redis unavailable; routing on local state, retrying with backoff",
			zap.String("url", Redact(s.cfg.URL)), zap.Error(err))
	}
}

// publishLoop drains the table's feed every FlushInterval and appends it to the stream as one batch.
// While Redis is unavailable the drained changes are dropped (and counted) without trying.
func (s *Sharer) publishLoop(ctx context.Context) {
	ticker := time.NewTicker(s.cfg.FlushInterval)
	defer ticker.Stop()
	var changes []affinity.Change
	var buf []byte
	var modelsAt time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
		if s.cfg.Models != nil && s.connected.Load() && time.Since(modelsAt) >= s.cfg.ModelsInterval {
			switch published, err := s.publishModels(ctx); {
			case err != nil && ctx.Err() == nil:
				s.setConnected(false, fmt.Errorf("publishing models: %w", err))
			case published:
				modelsAt = time.Now() // until then, tried every flush: the first summary goes out as soon as there is one
			}
		}
		var fullDrops uint64
		changes, fullDrops = s.table.DrainFeed(changes[:0])
		s.dropped.Add(fullDrops)
		if len(changes) == 0 {
			continue
		}
		if !s.connected.Load() {
			s.dropped.Add(uint64(len(changes)))
			clear(changes)
			continue
		}
		buf = appendBatch(buf[:0], s.instance, time.Now(), changes)
		if err := s.publish(ctx, buf); err != nil {
			s.dropped.Add(uint64(len(changes)))
			if ctx.Err() == nil {
				s.setConnected(false, fmt.Errorf("publishing: %w", err))
			}
		} else {
			s.published.Add(1)
			s.publishedChanges.Add(uint64(len(changes)))
			s.publishedBytes.Add(uint64(len(buf)))
		}
		clear(changes) // drop the upstream name references
	}
}

func (s *Sharer) publish(ctx context.Context, batch []byte) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	pipe := s.client.Pipeline()
	pipe.XAdd(ctx, &redis.XAddArgs{
		Stream: s.stream, MaxLen: s.cfg.StreamLength, Approx: true, Values: []any{"b", batch},
	})
	pipe.PExpire(ctx, s.stream, s.cfg.Window)
	_, err := pipe.Exec(ctx)
	return err
}

// readLoop warms up from the stream's last Window, then follows it, reconnecting with backoff.
func (s *Sharer) readLoop(ctx context.Context) {
	backoff := minBackoff
	lastID := ""
	for ctx.Err() == nil {
		var err error
		warming := lastID == ""
		if warming {
			lastID, err = s.warmUp(ctx)
		} else {
			lastID, err = s.follow(ctx, lastID)
		}
		if err != nil && ctx.Err() == nil {
			s.setConnected(false, err)
			s.attempts.Add(1)
		}
		if warming {
			s.markWarm() // after a failure is recorded, so Status explains it when WaitWarm returns
		}
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			sleep(ctx, backoff+time.Duration(rand.Int64N(int64(backoff)/4+1)))
			backoff = min(backoff*2, maxBackoff)
			continue
		}
		backoff = minBackoff
	}
}

// warmUp imports the entries of the last Window and returns the ID to follow from. The start of the
// window is computed from the Redis server's clock, which also stamps the entry IDs.
// The caller marks the sharer warm when it returns.
func (s *Sharer) warmUp(ctx context.Context) (string, error) {
	tctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	now, err := s.client.Time(tctx).Result()
	cancel()
	if err != nil {
		return "", fmt.Errorf("warming up: %w", err)
	}
	s.setConnected(true, nil)
	if err := s.readPeerModels(ctx, now); err != nil {
		return "", fmt.Errorf("warming up: %w", err)
	}
	from := strconv.FormatInt(now.Add(-s.cfg.Window).UnixMilli(), 10) + "-0"
	last := from
	for {
		tctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
		msgs, err := s.client.XRangeN(tctx, s.stream, from, "+", pageSize).Result()
		cancel()
		if err != nil {
			return "", fmt.Errorf("warming up: %w", err)
		}
		s.apply(msgs)
		if len(msgs) > 0 {
			last = msgs[len(msgs)-1].ID
			from = "(" + last
		}
		if len(msgs) < pageSize {
			s.mu.Lock()
			s.warmedUp = true
			s.mu.Unlock()
			return last, nil
		}
	}
}

func (s *Sharer) markWarm() {
	select {
	case <-s.warm:
	default:
		close(s.warm)
	}
}

// follow waits up to readBlock for entries after lastID, imports them and returns the new last ID.
func (s *Sharer) follow(ctx context.Context, lastID string) (string, error) {
	streams, err := s.client.XRead(ctx, &redis.XReadArgs{
		Streams: []string{s.stream, lastID}, Count: pageSize, Block: readBlock,
	}).Result()
	if errors.Is(err, redis.Nil) {
		s.setConnected(true, nil)
		return lastID, nil // nothing new within readBlock
	}
	if err != nil {
		return lastID, fmt.Errorf("reading: %w", err)
	}
	s.setConnected(true, nil)
	for _, st := range streams {
		s.apply(st.Messages)
		if n := len(st.Messages); n > 0 {
			lastID = st.Messages[n-1].ID
		}
	}
	return lastID, nil
}

// apply imports the other instances' batches among msgs.
func (s *Sharer) apply(msgs []redis.XMessage) {
	var changes []affinity.Change
	for _, m := range msgs {
		raw, _ := m.Values["b"].(string)
		instance, cs, err := decodeBatch([]byte(raw), changes[:0])
		if err != nil {
			s.undecoded.Add(1)
			continue
		}
		if instance == s.instance {
			continue
		}
		changes = cs
		s.table.ImportChanges(changes)
		s.imported.Add(1)
		s.importedChanges.Add(uint64(len(changes)))
	}
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
