package caddyllm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math"
	"net/http"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/selection"
	"github.com/tokenrouter/caddy-llm/share"
)

func init() {
	caddy.RegisterModule(stateAdmin{})
}

// Defaults of PersistConfig.
const (
	defaultPersistInterval = 30 * time.Second
	defaultPersistKey      = "routes"
	// persistStorageTimeout bounds one snapshot read or write to storage.
	persistStorageTimeout = 30 * time.Second
)

// stateConfig holds the options that keep learned routes and conversation pins beyond this process:
// snapshots in Caddy's storage, and sharing with other instances through Redis. It is embedded in
// LLMSelection, so its fields are the policy's JSON keys.
//
// Both apply to the route table the policy uses, which outlives config reloads: the first config that
// enables them starts them, a reload that enables them with other settings changes them, a reload that
// leaves them out changes nothing, and they stop (with a last snapshot) when the last config using the
// table is unloaded.
type stateConfig struct {
	// Persist, when set, snapshots the learned routes and conversation pins, and every upstream's learned
	// service model (beside them, as <key>.models.json), to Caddy's configured storage
	// (files under Caddy's data directory by default) periodically and at shutdown, and restores them
	// before the first request. Off by default.
	Persist *PersistConfig `json:"persist,omitempty"`

	// Share, when set, shares learned routes and pins with every Caddy instance using the same Redis.
	// Off by default.
	Share *ShareConfig `json:"share,omitempty"`

	state *tableState
}

// PersistConfig configures snapshots of the learned state to Caddy's storage.
type PersistConfig struct {
	// Interval between snapshots. A snapshot is skipped when nothing was learned since the previous one;
	// one is always written when Caddy stops. A Caddy killed without warning loses at most this much.
	// Default 30s.
	Interval caddy.Duration `json:"interval,omitempty"`

	// Key names the snapshot in storage: caddy-llm/<key>.snapshot. Default: derived from the route
	// table's settings (routes-<block_size>-<route_capacity>-<route_ttl>), so each route table has its own
	// snapshot; changing those settings starts from an empty table unless the key is set.
	Key string `json:"key,omitempty"`
}

func (p *PersistConfig) storageKey() string { return "caddy-llm/" + p.Key + ".snapshot" }

// provisionState starts (or reconfigures) persistence and sharing for table, restoring a snapshot when
// this is the first config to persist it. Problems with storage or Redis are logged and never fail the
// config: routing works without them. Call once at the end of Provision; cleanupState undoes it.
func (s *stateConfig) provisionState(ctx caddy.Context, table *affinity.Table) error {
	if s.Persist != nil {
		if s.Persist.Interval == 0 {
			s.Persist.Interval = caddy.Duration(defaultPersistInterval)
		}
		if s.Persist.Key == "" {
			s.Persist.Key = defaultPersistKey
		}
		if time.Duration(s.Persist.Interval) < 0 {
			return fmt.Errorf("persist interval must be positive, got %s", time.Duration(s.Persist.Interval))
		}
		if strings.ContainsAny(s.Persist.Key, "/\\") || strings.Contains(s.Persist.Key, "..") {
			return fmt.Errorf("persist key %q must not contain a path", s.Persist.Key)
		}
	}
	if s.Share != nil {
		if err := s.Share.provision(); err != nil {
			return err
		}
	}
	if table == nil || (s.Persist == nil && s.Share == nil) {
		return nil
	}
	if err := registerStateMetrics(ctx); err != nil {
		return fmt.Errorf("registering state metrics: %w", err)
	}
	s.state = acquireState(table, ctx.Logger())
	s.state.configure(ctx, s.Persist, s.Share)
	return nil
}

// cleanupState drops this config's hold; the last one stops persistence (writing a last snapshot) and
// sharing. Call from Cleanup.
func (s *stateConfig) cleanupState() {
	if s.state != nil {
		releaseState(s.state)
		s.state = nil
	}
}

// tableState is the persistence and sharing attached to one route table, reference counted by the
// configs that enable them; see stateConfig.
type tableState struct {
	table *affinity.Table
	refs  int // guarded by statesMu

	mu      sync.Mutex // guards the fields below
	logger  *zap.Logger
	persist *persister
	sharer  *share.Sharer
	shareID string // URL and prefix sharer was started with
}

var (
	statesMu sync.Mutex
	states   = make(map[*affinity.Table]*tableState)
)

func acquireState(table *affinity.Table, logger *zap.Logger) *tableState {
	statesMu.Lock()
	defer statesMu.Unlock()
	st := states[table]
	if st == nil {
		st = &tableState{table: table}
		states[table] = st
	}
	st.refs++
	st.mu.Lock()
	st.logger = logger
	st.mu.Unlock()
	return st
}

func releaseState(st *tableState) {
	statesMu.Lock()
	st.refs--
	last := st.refs == 0
	if last {
		delete(states, st.table)
	}
	statesMu.Unlock()
	if last {
		st.stop()
	}
}

// currentStates returns the table states in use, for reports.
func currentStates() []*tableState {
	statesMu.Lock()
	defer statesMu.Unlock()
	out := make([]*tableState, 0, len(states))
	for _, st := range states {
		out = append(out, st)
	}
	return out
}

// configure applies a newly provisioned config's settings; nil settings leave the running ones alone.
func (st *tableState) configure(ctx caddy.Context, pc *PersistConfig, sc *ShareConfig) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if pc != nil {
		st.configurePersistLocked(ctx, pc)
	}
	if sc != nil {
		st.configureShareLocked(sc)
	}
}

func (st *tableState) configurePersistLocked(ctx caddy.Context, pc *PersistConfig) {
	storage := contextStorage(ctx)
	if storage == nil {
		st.logger.Error("persist: no storage configured; learned state will not be saved")
		return
	}
	key, interval := pc.storageKey(), time.Duration(pc.Interval)
	if p := st.persist; p != nil {
		p.setStorage(storage)
		if p.key == key && p.interval == interval {
			return
		}
		p.stop() // settings changed: a last snapshot under the old key, then start anew
	}
	p := newPersister(st.table, storage, key, interval, st.logger)
	if st.persist == nil || st.persist.key != key {
		p.restore()
	}
	p.start()
	st.persist = p
}

// contextStorage is ctx.Storage(), or nil for a context without a config (some tests).
func contextStorage(ctx caddy.Context) (storage certmagic.Storage) {
	defer func() { _ = recover() }()
	return ctx.Storage()
}

// stop ends persistence (with a last snapshot) and sharing.
func (st *tableState) stop() {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.sharer != nil {
		st.sharer.Close()
		st.sharer = nil
	}
	if st.persist != nil {
		st.persist.stop()
		st.persist = nil
	}
}

// persister snapshots a table to storage every interval (when it changed) and once more when stopped.
type persister struct {
	table    *affinity.Table
	loads    *loadTable // whose service models it keeps (the process's)
	key      string
	interval time.Duration
	logger   *zap.Logger
	cancel   context.CancelFunc
	done     chan struct{}

	mu      sync.Mutex // guards storage and the status below; never held across storage I/O
	storage certmagic.Storage
	status  persistStatus

	saveMu     sync.Mutex // serializes saves (the loop's and the last one)
	changes    uint64     // table's Stats().Changes at the last save or restore; under saveMu
	modelsMark uint64     // hash of the service models at the last save or restore; under saveMu
}

// persistStatus is what /llm/state reports about snapshots.
type persistStatus struct {
	Key            string    `json:"key"`
	Interval       string    `json:"interval"`
	LastSnapshot   time.Time `json:"last_snapshot,omitzero"`
	LastBytes      int       `json:"last_snapshot_bytes"`
	LastDurationMS float64   `json:"last_snapshot_ms"`
	Snapshots      uint64    `json:"snapshots"`
	Failures       uint64    `json:"failures"`
	LastError      string    `json:"last_error,omitempty"`
	RestoredRoutes int       `json:"restored_routes"`
	RestoredPins   int       `json:"restored_pins"`
	RestoredFrom   time.Time `json:"restored_from,omitzero"`
	RestoreProblem string    `json:"restore_problem,omitempty"`
	// LastModels is how many upstreams' service models the last save wrote, RestoredModels how many were
	// restored at the start, and ModelsProblem why some or all of those stored were not.
	LastModels      int    `json:"last_models"`
	RestoredModels  int    `json:"restored_models"`
	ModelsProblem   string `json:"models_problem,omitempty"`
	failingReported bool
}

func newPersister(table *affinity.Table, storage certmagic.Storage, key string, interval time.Duration, logger *zap.Logger) *persister {
	return &persister{
		table: table, loads: loads, storage: storage, key: key, interval: interval, logger: logger,
		status: persistStatus{Key: key, Interval: interval.String()},
	}
}

func (p *persister) setStorage(s certmagic.Storage) {
	p.mu.Lock()
	p.storage = s
	p.mu.Unlock()
}

func (p *persister) currentStorage() certmagic.Storage {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.storage
}

// restore merges the stored snapshot into the table. A missing, unreadable, damaged or later-version
// snapshot is logged once and ignored: the table starts empty, and the config loads.
func (p *persister) restore() {
	ctx, cancel := context.WithTimeout(context.Background(), persistStorageTimeout)
	defer cancel()
	data, err := p.currentStorage().Load(ctx, p.key)
	var routes, pins int
	if err == nil {
		routes, pins, err = p.table.Restore(data)
	}
	restoredModels, restarted, modelsProblem := p.restoreModels(ctx)
	for _, dial := range restarted {
		// Its routes just restored were learned of the backend process before: its cache is empty.
		if l := p.loads.lookup(dial); l != nil {
			forgetRestarted(dial, l)
		}
	}
	p.saveMu.Lock()
	p.changes = p.table.Stats().Changes
	_, p.modelsMark = encodeModels(p.loads.learnedModels())
	p.saveMu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.status.RestoredModels, p.status.ModelsProblem = restoredModels, modelsProblem
	if restoredModels > 0 {
		p.logger.Info("persist: restored service models", zap.String("key", p.modelsKey()), zap.Int("upstreams", restoredModels))
	}
	if modelsProblem != "" {
		p.logger.Warn("persist: some stored service models not restored; those upstreams start from the prior",
			zap.String("key", p.modelsKey()), zap.Int("restored", restoredModels), zap.String("problem", modelsProblem))
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		p.logger.Info("persist: no snapshot to restore, starting empty", zap.String("key", p.key))
	case err != nil:
		p.status.RestoreProblem = err.Error()
		p.logger.Warn("persist: ignoring snapshot, starting empty", zap.String("key", p.key), zap.Int("bytes", len(data)), zap.Error(err))
	default:
		p.status.RestoredRoutes, p.status.RestoredPins = routes, pins
		p.status.RestoredFrom = time.Now()
		p.logger.Info("persist: restored learned state", zap.String("key", p.key), zap.Int("bytes", len(data)),
			zap.Int("routes", routes), zap.Int("pins", pins))
	}
}

// start runs the snapshot loop until stop.
func (p *persister) start() {
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel, p.done = cancel, make(chan struct{})
	go p.run(ctx)
}

func (p *persister) run(ctx context.Context) {
	defer close(p.done)
	ticker := time.NewTicker(p.interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			p.save(ctx)
		}
	}
}

// stop ends the loop and writes a last snapshot. The one stop path: Cleanup of the last config, or a
// reload that changes the settings.
func (p *persister) stop() {
	if p.cancel == nil {
		return
	}
	p.cancel()
	<-p.done
	p.cancel = nil
	p.save(context.Background())
}

// save writes a snapshot if the table changed since the last one. The table is copied under its read
// lock into memory; the storage write holds no lock a request could wait on. A panic is logged with its
// stack and the loop goes on.
func (p *persister) save(ctx context.Context) {
	defer func() {
		if r := recover(); r != nil {
			p.logger.Error("persist: panic while saving a snapshot", zap.Any("error", r), zap.ByteString("stack", debug.Stack()))
		}
	}()
	p.saveMu.Lock()
	defer p.saveMu.Unlock()
	changes := p.table.Stats().Changes
	models := p.loads.learnedModels()
	modelsJSON, mark := encodeModels(models)
	if changes == p.changes && mark == p.modelsMark {
		return
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, persistStorageTimeout)
	defer cancel()
	var data []byte
	var err error
	if changes != p.changes {
		data = p.table.AppendSnapshot(make([]byte, 0, 64<<10))
		err = p.currentStorage().Store(ctx, p.key, data)
	}
	if err == nil && mark != p.modelsMark {
		err = p.currentStorage().Store(ctx, p.modelsKey(), modelsJSON)
	}
	elapsed := time.Since(start)

	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		p.status.Failures++
		p.status.LastError = err.Error()
		if !p.status.failingReported {
			p.status.failingReported = true
			p.logger.Error("persist: saving snapshot failed; will retry every interval", zap.String("key", p.key), zap.Error(err))
		}
		return
	}
	p.changes, p.modelsMark = changes, mark
	if p.status.failingReported {
		p.status.failingReported = false
		p.logger.Info("persist: saving snapshots again", zap.String("key", p.key))
	}
	p.status.LastError = ""
	p.status.Snapshots++
	p.status.LastSnapshot = start
	p.status.LastDurationMS = float64(elapsed.Microseconds()) / 1000
	p.status.LastModels = len(models)
	if data != nil {
		p.status.LastBytes = len(data)
		snapshotBytes.Set(float64(len(data)))
	}
}

func (p *persister) report() persistStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.status
}

// parsePersist reads the Caddyfile option `persist [<interval>] [{ key <name> }]`.
func (s *stateConfig) parsePersist(d *caddyfile.Dispenser) error {
	if s.Persist != nil {
		return d.Err("persist already specified")
	}
	s.Persist = new(PersistConfig)
	if d.NextArg() {
		dur, err := parseDuration(d, "persist interval", d.Val())
		if err != nil {
			return err
		}
		s.Persist.Interval = dur
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "key":
			val, err := oneArg(d)
			if err != nil {
				return err
			}
			s.Persist.Key = val
		default:
			return d.Errf("unrecognized persist option '%s'", d.Val())
		}
	}
	return nil
}

// stateAdmin serves GET /llm/state on Caddy's admin listener: for each route table with persistence or
// sharing, its local and remote route counts, pins, the last snapshot (time, size, duration, errors,
// what was restored) and the Redis connection state.
type stateAdmin struct{}

// CaddyModule returns the Caddy module information.
func (stateAdmin) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.llm_state",
		New: func() caddy.Module { return new(stateAdmin) },
	}
}

// Routes returns the admin routes.
func (stateAdmin) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/llm/state", Handler: caddy.AdminHandlerFunc(serveState)}}
}

type stateReport struct {
	Routes       int            `json:"routes"`
	LocalRoutes  int            `json:"local_routes"`
	RemoteRoutes int            `json:"remote_routes"`
	Pins         int            `json:"conversation_pins"`
	FeedDropped  uint64         `json:"feed_dropped"`
	Persist      *persistStatus `json:"persist,omitempty"`
	Share        *share.Status  `json:"share,omitempty"`
}

func stateReports() []stateReport {
	out := []stateReport{}
	for _, st := range currentStates() {
		s := st.table.Stats()
		r := stateReport{Routes: s.Routes, LocalRoutes: s.Routes - s.RemoteRoutes, RemoteRoutes: s.RemoteRoutes, Pins: s.Pins, FeedDropped: s.FeedDropped}
		st.mu.Lock()
		if st.persist != nil {
			ps := st.persist.report()
			r.Persist = &ps
		}
		if st.sharer != nil {
			ss := st.sharer.Status()
			r.Share = &ss
		}
		st.mu.Unlock()
		out = append(out, r)
	}
	return out
}

func serveState(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	return writeJSON(w, struct {
		Tables []stateReport `json:"tables"`
	}{stateReports()})
}

// Interface guards
var _ caddy.AdminRouter = (*stateAdmin)(nil)

// The upstreams' learned service models (how fast each prefills and decodes, its slots: see
// selection.ServiceModel) are kept beside the route snapshot, as JSON under <key>.models.json, so that a
// restarted Caddy prices every upstream at the speed it had learned instead of the prior: in a pool with
// a slower backend, a fresh process sends that backend its fair share of requests until the first of them
// end, seconds later. They are process-wide (one model per upstream address, shared by every policy), so
// each persisting route table writes and restores them all; restoring never replaces a model this
// process has already learned from.

// modelsFile is the stored form of the models.
type modelsFile struct {
	Version   int                    `json:"version"`
	Taken     time.Time              `json:"taken"`
	Upstreams map[string]storedModel `json:"upstreams"`
}

// storedModel is one upstream's model, with the backend's process start time (its metrics'
// process_start_time_seconds; 0: unknown) when it was stored: a backend that restarted since (a scrape
// shows another start time, before the restore or after it) forgets the slots it was learned to have and
// the routes restored for it, as one restarting under a running Caddy does (checkRestartLocked).
type storedModel struct {
	Model     selection.ModelState `json:"model"`
	StartTime float64              `json:"backend_start_time,omitempty"`
}

const (
	modelsVersion = 1
	// maxStoredModels bounds how many models a restore accepts: the load table sweeps idle upstreams
	// beyond sweepAbove, so a file with far more is not one this package wrote.
	maxStoredModels = 4 * sweepAbove
)

func (p *persister) modelsKey() string {
	return strings.TrimSuffix(p.key, ".snapshot") + ".models.json"
}

// learnedModels returns the model of every upstream that has learned something (an observation, or a
// running count from its metrics).
func (t *loadTable) learnedModels() map[string]storedModel {
	t.mu.RLock()
	ls := make(map[string]*upstreamLoad, len(t.m))
	maps.Copy(ls, t.m)
	t.mu.RUnlock()
	out := make(map[string]storedModel)
	for dial, l := range ls {
		if st := l.model.State(); st.Learned() {
			l.mu.Lock()
			out[dial] = storedModel{Model: st, StartTime: l.startTime}
			l.mu.Unlock()
		}
	}
	return out
}

// encodeModels returns the file to store for models and a hash of the models alone (not the time
// taken), to tell whether they changed since the last save.
func encodeModels(models map[string]storedModel) (file []byte, mark uint64) {
	ups, err := json.Marshal(models) // maps marshal in key order
	if err != nil {
		return nil, 0 // not reached: a ModelState is plain numbers
	}
	file, _ = json.Marshal(modelsFile{Version: modelsVersion, Taken: time.Now().UTC(), Upstreams: models})
	return file, xxhash.Sum64(ups)
}

// restoreModels gives each upstream in the stored file its saved model (restoreModels of the loads). A
// missing file is no problem: a first start, or a snapshot of a version before models were kept.
func (p *persister) restoreModels(ctx context.Context) (restored int, restarted []string, problem string) {
	data, err := p.currentStorage().Load(ctx, p.modelsKey())
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil, ""
	}
	if err != nil {
		return 0, nil, err.Error()
	}
	return p.loads.restoreModels(data)
}

// restoreModels gives each upstream in a models file (persist's, or another instance's through share)
// its model, unless this process has already learned one. It returns how many were restored, the
// upstreams whose backend a scrape has already shown running as another process than the one the file
// was learned of (their restored slots are forgotten here; what else was stored of them, the caller
// knows), and, when some or all were not restored, why. A backend not yet scraped is judged by its
// first scrape (checkRestartLocked), as one restarting under a running Caddy is.
func (t *loadTable) restoreModels(data []byte) (restored int, restarted []string, problem string) {
	var f modelsFile
	switch err := json.Unmarshal(data, &f); {
	case err != nil:
		return 0, nil, "not a models file: " + err.Error()
	case f.Version != modelsVersion:
		return 0, nil, fmt.Sprintf("models file version %d, want %d", f.Version, modelsVersion)
	case len(f.Upstreams) > maxStoredModels:
		return 0, nil, fmt.Sprintf("%d models, more than the %d kept", len(f.Upstreams), maxStoredModels)
	}
	var problems []string
	now := time.Now().UnixNano()
	for _, dial := range slices.Sorted(maps.Keys(f.Upstreams)) {
		l := t.entry(dial, now)
		if l.model.State().Learned() {
			continue // learned here already (or restored from a newer file): newer than this one
		}
		stored := f.Upstreams[dial]
		if err := l.model.Restore(stored.Model); err != nil {
			problems = append(problems, dial+": "+err.Error())
			continue
		}
		if stored.StartTime > 0 && !math.IsInf(stored.StartTime, 0) {
			l.mu.Lock()
			switch l.startTime {
			case 0:
				l.startTime = stored.StartTime // the next scrape tells whether the backend restarted since
			case stored.StartTime:
			default:
				l.model.ForgetSlots() // a scrape already showed it restarted since
				restarted = append(restarted, dial)
			}
			l.mu.Unlock()
		}
		restored++
	}
	return restored, restarted, strings.Join(problems, "; ")
}
