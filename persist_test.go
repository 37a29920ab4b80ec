package caddyllm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/scraper"
	"github.com/tokenrouter/caddy-llm/selection"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

var testBounds = []tokenize.Boundary{{Tokens: 512, Hash: 1}, {Tokens: 600, Hash: 2}, {Tokens: 700, Hash: 3}}

// TestPersisterRestore: a saved snapshot restores; a missing, corrupt or later-version one starts empty
// with exactly one log line, and never an error.
func TestPersisterRestore(t *testing.T) {
	storage := &certmagic.FileStorage{Path: t.TempDir()}
	const key = "caddy-llm/test.snapshot"
	src := affinity.New(affinity.Config{})
	src.Learn("m", testBounds, "10.0.0.1:8000")
	src.Pin("m", "conv", "10.0.0.2:8000")
	p := newPersister(src, storage, key, time.Hour, zap.NewNop())
	p.loads = &loadTable{m: make(map[string]*upstreamLoad)} // no models: this process's could change between saves
	p.save(context.Background())
	if st := p.report(); st.Snapshots != 1 || st.LastBytes == 0 {
		t.Fatalf("report() after save = %+v, want one snapshot", st)
	}
	p.save(context.Background())
	if st := p.report(); st.Snapshots != 1 {
		t.Errorf("report() after saving an unchanged table = %+v, want the save skipped", st)
	}
	good, err := storage.Load(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	future := bytes.Clone(good)
	future[4] = affinity.SnapshotVersion + 1

	for _, tc := range []struct {
		name       string
		data       []byte // nil: no snapshot stored
		wantRoutes int
		wantLog    string
	}{
		{"good", good, 3, "persist: restored learned state"},
		{"missing", nil, 0, "persist: no snapshot to restore, starting empty"},
		{"corrupt", append(bytes.Clone(good[:20]), "garbage"...), 0, "persist: ignoring snapshot, starting empty"},
		{"truncated", good[:len(good)-1], 0, "persist: ignoring snapshot, starting empty"},
		{"future version", future, 0, "persist: ignoring snapshot, starting empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			storage := &certmagic.FileStorage{Path: t.TempDir()}
			if tc.data != nil {
				if err := storage.Store(context.Background(), key, tc.data); err != nil {
					t.Fatal(err)
				}
			}
			core, logs := observer.New(zap.DebugLevel)
			dst := affinity.New(affinity.Config{})
			newPersister(dst, storage, key, time.Hour, zap.New(core)).restore()
			if s := dst.Stats(); s.Routes != tc.wantRoutes {
				t.Errorf("routes after restore = %d, want %d", s.Routes, tc.wantRoutes)
			}
			if all := logs.All(); len(all) != 1 || all[0].Message != tc.wantLog {
				t.Errorf("logs = %v, want exactly %q", all, tc.wantLog)
			}
		})
	}
}

// TestPersisterModels: the upstreams' learned service models are saved beside the routes and restored
// into a fresh process's loads; an upstream already learned there keeps its own, one learned from
// another prior (a changed capacity hint) starts from its prior, and a damaged file restores none, with
// one warning, while the routes still restore.
func TestPersisterModels(t *testing.T) {
	storage := &certmagic.FileStorage{Path: t.TempDir()}
	const key = "caddy-llm/models-test.snapshot"
	newLoads := func() *loadTable { return &loadTable{m: make(map[string]*upstreamLoad)} }
	teach := func(lt *loadTable, dial string, seconds float64) {
		m := lt.entry(dial, 1).model
		for range 20 {
			m.ObserveEnd(1000, 100, 0, seconds)
		}
	}
	src := affinity.New(affinity.Config{})
	src.Learn("m", testBounds, "10.0.0.1:8000")
	srcLoads := newLoads()
	teach(srcLoads, "10.0.0.1:8000", 12) // slow
	teach(srcLoads, "10.0.0.2:8000", 1)  // fast
	srcLoads.entry("10.0.0.3:8000", 1)   // never learned: not saved
	p := newPersister(src, storage, key, time.Hour, zap.NewNop())
	p.loads = srcLoads
	p.save(context.Background())
	if st := p.report(); st.Snapshots != 1 || st.LastModels != 2 {
		t.Fatalf("report() after save = %+v, want one snapshot of 2 models", st)
	}
	// Models alone changed: saved again (a restart must not go back to an older speed).
	teach(srcLoads, "10.0.0.2:8000", 2)
	p.save(context.Background())
	if st := p.report(); st.Snapshots != 2 {
		t.Errorf("report() after the models changed = %+v, want a second save", st)
	}
	want := srcLoads.learnedModels()

	restore := func(dst *loadTable) (persistStatus, *observer.ObservedLogs) {
		core, logs := observer.New(zap.DebugLevel)
		q := newPersister(affinity.New(affinity.Config{}), storage, key, time.Hour, zap.New(core))
		q.loads = dst
		q.restore()
		return q.report(), logs
	}

	dst := newLoads()
	dst.entry("10.0.0.2:8000", 1).model.SetPrior(selection.Prior.Slower(2)) // its capacity hint changed
	st, logs := restore(dst)
	if st.RestoredModels != 1 || !strings.Contains(st.ModelsProblem, "10.0.0.2:8000") || st.RestoredRoutes != 3 {
		t.Errorf("restore = %+v, want the slow upstream's model and the routes restored, the other's refused", st)
	}
	if got := dst.lookup("10.0.0.1:8000").model.State(); !reflect.DeepEqual(got, want["10.0.0.1:8000"].Model) {
		t.Errorf("restored model %+v, want %+v", got, want["10.0.0.1:8000"].Model)
	}
	if got := dst.lookup("10.0.0.2:8000").model.Service(); got.Samples != 0 {
		t.Errorf("model learned from another prior restored: %+v", got)
	}
	if n := logs.FilterMessageSnippet("service models not restored").Len(); n != 1 {
		t.Errorf("warnings about refused models = %d, want 1: %v", n, logs.All())
	}

	dst = newLoads()
	teach(dst, "10.0.0.1:8000", 3) // learned here before the restore (a reload changed the key)
	own := dst.lookup("10.0.0.1:8000").model.State()
	if st, _ := restore(dst); st.RestoredModels != 1 {
		t.Errorf("restore = %+v, want only the upstream this process had not learned", st)
	}
	if got := dst.lookup("10.0.0.1:8000").model.State(); !reflect.DeepEqual(got, own) {
		t.Errorf("restore replaced a model this process learned: %+v, want %+v", got, own)
	}

	for name, data := range map[string]string{
		"not JSON":       "LLMR garbage",
		"future version": `{"version":99,"upstreams":{}}`,
		"damaged model":  `{"version":1,"upstreams":{"10.0.0.1:8000":{"model":{"prior":{},"log_scale":1e300}}}}`,
	} {
		if err := storage.Store(context.Background(), strings.TrimSuffix(key, ".snapshot")+".models.json", []byte(data)); err != nil {
			t.Fatal(err)
		}
		dst := newLoads()
		st, logs := restore(dst)
		if st.RestoredModels != 0 || st.ModelsProblem == "" || st.RestoredRoutes != 3 {
			t.Errorf("%s: restore = %+v, want no model, the problem, and the routes", name, st)
		}
		if n := logs.FilterMessageSnippet("service models not restored").Len(); n != 1 {
			t.Errorf("%s: warnings = %d, want 1: %v", name, n, logs.All())
		}
		if len(dst.learnedModels()) != 0 {
			t.Errorf("%s: models learned from a damaged file", name)
		}
	}
}

// TestRestartedBackendForgetsSlots: a backend that restarts (its metrics' start time changes) may run
// with another max_num_seqs: the slots learned for it are forgotten, its speed kept. A stored model
// carries the start time it was learned at, so a restart while Caddy was down counts too, whether the
// first scrape comes after the restore or before it.
func TestRestartedBackendForgetsSlots(t *testing.T) {
	const dial = "10.0.0.1:8000"
	now := time.Now()
	scrape := func(lt *loadTable, start float64) {
		now = now.Add(time.Second)
		lt.noteScrape(dial, &scraper.Snapshot{At: now, StartTime: start, Running: 1}, now.UnixNano())
	}
	learn := func() *loadTable {
		lt := &loadTable{m: make(map[string]*upstreamLoad)}
		m := lt.entry(dial, 1).model
		for range 5 {
			m.ObserveQueue(16, 4, 0.2)
			m.ObserveEnd(1000, 100, 0, 9)
		}
		scrape(lt, 100)
		return lt
	}
	lt := learn()
	speed := lt.lookup(dial).model.Service().TokenSeconds
	if s := lt.lookup(dial).model.Service(); s.Slots != 16 {
		t.Fatalf("learned slots %v, want 16", s.Slots)
	}
	scrape(lt, 100)
	if s := lt.lookup(dial).model.Service(); s.Slots != 16 {
		t.Errorf("slots after a scrape of the same process = %v, want 16 kept", s.Slots)
	}
	scrape(lt, 200)
	if s := lt.lookup(dial).model.Service(); s.Slots != 0 || s.Ceiling != 0 || s.TokenSeconds != speed {
		t.Errorf("after the backend restarted: %+v, want slots and ceiling forgotten, %v s/token kept", s, speed)
	}

	file, _ := encodeModels(learn().learnedModels())
	for _, c := range []struct {
		name      string
		before    float64 // start time a scrape showed before the restore (0: none)
		after     float64 // and after it
		wantSlots float64
	}{
		{"same process", 0, 100, 16},
		{"restarted, scraped after the restore", 0, 200, 0},
		{"restarted, scraped before the restore", 200, 200, 0},
		{"same process, scraped before the restore", 100, 100, 16},
	} {
		dst := &loadTable{m: make(map[string]*upstreamLoad)}
		if c.before != 0 {
			scrape(dst, c.before)
		}
		n, restarted, problem := dst.restoreModels(file)
		if n != 1 || problem != "" {
			t.Fatalf("%s: restoreModels = %d, %q", c.name, n, problem)
		}
		if want := c.before != 0 && c.before != 100; len(restarted) == 1 != want {
			t.Errorf("%s: restarted %v, want it listed: %v", c.name, restarted, want)
		}
		scrape(dst, c.after)
		if s := dst.lookup(dial).model.Service(); s.Slots != c.wantSlots {
			t.Errorf("%s: slots %v, want %v", c.name, s.Slots, c.wantSlots)
		}
	}
}

// TestRestoredRoutesOfRestartedBackend: routes restored from a snapshot of a backend that restarted while
// Caddy was down claim a cache it no longer has, and are forgotten with it, whichever comes first: the
// restore or the scrape that shows the new process. The other backend's routes stay.
func TestRestoredRoutesOfRestartedBackend(t *testing.T) {
	const key = "caddy-llm/restarted-test.snapshot"
	const moved, stayed = "10.0.0.1:8000", "10.0.0.2:8000"
	now := time.Now()
	scrape := func(lt *loadTable, dial string, start float64) {
		now = now.Add(time.Second)
		lt.noteScrape(dial, &scraper.Snapshot{At: now, StartTime: start}, now.UnixNano())
	}
	teach := func(lt *loadTable, dial string) {
		m := lt.entry(dial, 1).model
		for range 5 {
			m.ObserveEnd(1000, 100, 0, 9)
		}
	}
	storage := &certmagic.FileStorage{Path: t.TempDir()}
	src := affinity.New(affinity.Config{})
	src.Learn("m", testBounds, moved)
	src.Learn("m", []tokenize.Boundary{{Tokens: 512, Hash: 7}}, stayed)
	srcLoads := &loadTable{m: make(map[string]*upstreamLoad)}
	for _, dial := range []string{moved, stayed} {
		teach(srcLoads, dial)
		scrape(srcLoads, dial, 100)
	}
	p := newPersister(src, storage, key, time.Hour, zap.NewNop())
	p.loads = srcLoads
	p.save(context.Background())

	for _, c := range []struct {
		name          string
		before, after float64 // moved's start time a scrape showed before the restore (0: none), and after
		wantKept      bool
	}{
		{"same process, scraped after the restore", 0, 100, true},
		{"same process, scraped before the restore", 100, 100, true},
		{"restarted, scraped after the restore", 0, 200, false},
		{"restarted, scraped before the restore", 200, 200, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dst := affinity.New(affinity.Config{})
			defer registerTestRoutes(t, dst)()
			loads := &loadTable{m: make(map[string]*upstreamLoad)}
			if c.before != 0 {
				scrape(loads, moved, c.before)
			}
			q := newPersister(dst, storage, key, time.Hour, zap.NewNop())
			q.loads = loads
			q.restore()
			scrape(loads, moved, c.after)
			scrape(loads, stayed, 100)
			ups, cached := []string{moved, stayed}, make([]int, 2)
			dst.Match("m", testBounds, ups, cached)
			if kept := cached[0] > 0; kept != c.wantKept {
				t.Errorf("restarted backend's routes: cached tokens %v, want kept: %v", cached, c.wantKept)
			}
			dst.Match("m", []tokenize.Boundary{{Tokens: 512, Hash: 7}}, ups, cached)
			if cached[1] != 512 {
				t.Errorf("the other backend's route: cached tokens %v, want 512 on it", cached)
			}
			wantRestarts := int64(0)
			if !c.wantKept {
				wantRestarts = 1
			}
			if n := loads.lookup(moved).cacheFigures().Restarts; n != wantRestarts {
				t.Errorf("restarts counted %d, want %d", n, wantRestarts)
			}
		})
	}
}

// persistConfig is a site proxying to upstreams with persist on and Caddy's storage in dir.
func persistConfig(dir string, upstreams ...*backend) string {
	dials := make([]string, len(upstreams))
	for i, u := range upstreams {
		dials[i] = u.dial
	}
	return strings.Replace(globalOptions, "{", "{\n\tstorage file_system "+dir, 1) + fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy llm {
			conversation_header X-Conversation
			persist 1h
		}
		header_down X-LLM-Reason {http.llm.upstream_reason}
	}
}
`, site, strings.Join(dials, " "))
}

// conversationTurn is the body of turn n of conversation id: a system prompt, then n user/assistant pairs.
func conversationTurn(id, n int) string {
	msgs := []string{fmt.Sprintf(`{"role":"system","content":%q}`, fmt.Sprintf("system prompt %d: %s", id, strings.Repeat("be helpful ", 60)))}
	for i := range n {
		msgs = append(msgs, fmt.Sprintf(`{"role":"user","content":"conversation %d question %d %s"}`, id, i, strings.Repeat("why ", 40)))
		if i < n-1 {
			msgs = append(msgs, fmt.Sprintf(`{"role":"assistant","content":"answer %d %s"}`, i, strings.Repeat("because ", 40)))
		}
	}
	return fmt.Sprintf(`{"model":"m","max_tokens":8,"messages":[%s]}`, strings.Join(msgs, ","))
}

// upstreamOf returns the upstream named in a backend's answer.
func upstreamOf(t *testing.T, body string) string {
	t.Helper()
	var v struct{ Upstream string }
	if err := json.Unmarshal([]byte(body), &v); err != nil || v.Upstream == "" {
		t.Fatalf("answer %q names no upstream", body)
	}
	return v.Upstream
}

// TestPersistAcrossStop: routes and pins learned, a reload (which keeps the table and writes nothing), the
// last config using the policy unloaded (Caddy's graceful stop path: Cleanup writes the last snapshot), a
// config with the policy loaded again: the conversations continue on their upstreams, by affinity or pin
// rather than by load.
func TestPersistAcrossStop(t *testing.T) {
	dir := t.TempDir()
	ups := []*backend{newBackend(t), newBackend(t), newBackend(t)}
	tester := caddytest.NewTester(t)
	// Start without a route table: one an earlier test's config left with the same settings would be
	// kept by the reload, with its pins (run after TestOpenAIGoClient alone, this test counted 13).
	tester.InitServer(globalOptions+site+" {\n\trespond ok\n}\n", "caddyfile")
	tester.InitServer(persistConfig(dir, ups...), "caddyfile")
	client := &http.Client{Timeout: 10 * time.Second}

	where := make(map[int]string)
	for id := range 6 {
		res, body := post(t, client, "/v1/chat/completions", conversationTurn(id, 1), "X-Conversation", fmt.Sprint("c", id))
		if res.StatusCode != http.StatusOK {
			t.Fatalf("conversation %d: status %d", id, res.StatusCode)
		}
		where[id] = upstreamOf(t, body)
	}

	// A reload keeps the table: nothing is restored or written.
	tester.InitServer(persistConfig(dir, ups...), "caddyfile")
	if s := adminState(t, adminURL).Tables[0]; s.Pins != 6 || s.Persist.Snapshots != 0 || s.Persist.RestoredPins != 0 {
		t.Errorf("/llm/state after a reload = %+v, want the 6 pins kept, nothing restored or saved", s)
	}

	// Unload: no config uses the policy, so the table is dropped after its last snapshot.
	tester.InitServer(globalOptions+site+" {\n\trespond ok\n}\n", "caddyfile")
	if len(allRoutes()) != 0 {
		t.Fatal("the route table outlived the last config using it")
	}
	if _, err := os.Stat(filepath.Join(dir, "caddy-llm", "routes-16-100000-10m0s.snapshot")); err != nil {
		t.Fatalf("no snapshot written at shutdown: %v", err)
	}

	tester.InitServer(persistConfig(dir, ups...), "caddyfile")
	// Unload before t.TempDir's removal (cleanups run last first): the table's last snapshot would
	// otherwise recreate the directory after it was removed, leaving it behind in the temp dir.
	t.Cleanup(func() { tester.InitServer(globalOptions+site+" {\n\trespond ok\n}\n", "caddyfile") })
	state := adminState(t, adminURL)
	if p := state.Tables[0].Persist; p == nil || p.RestoredRoutes == 0 || p.RestoredPins != 6 {
		t.Fatalf("/llm/state after restart = %+v, want routes and 6 pins restored", state)
	}
	for id := range 6 {
		res, body := post(t, client, "/v1/chat/completions", conversationTurn(id, 2), "X-Conversation", fmt.Sprint("c", id))
		if got := upstreamOf(t, body); got != where[id] {
			t.Errorf("conversation %d after restart went to %s, want %s", id, got, where[id])
		}
		if r := res.Header.Get("X-LLM-Reason"); r != "conversation" && r != "affinity" {
			t.Errorf("conversation %d after restart: reason %q, want conversation or affinity", id, r)
		}
	}
}

type stateResponse struct {
	Tables []struct {
		Routes       int            `json:"routes"`
		RemoteRoutes int            `json:"remote_routes"`
		Pins         int            `json:"conversation_pins"`
		Persist      *persistStatus `json:"persist"`
		Share        *struct {
			Connected       bool   `json:"connected"`
			ImportedChanges uint64 `json:"imported_changes"`
			WarmedUp        bool   `json:"warmed_up"`
			PeerModels      int    `json:"peer_models"`
		} `json:"share"`
	} `json:"tables"`
}

func adminState(t *testing.T, admin string) stateResponse {
	t.Helper()
	res, err := http.Get(admin + "/llm/state")
	if err != nil {
		t.Fatalf("GET /llm/state: %v", err)
	}
	defer res.Body.Close()
	var s stateResponse
	if err := json.NewDecoder(res.Body).Decode(&s); err != nil {
		t.Fatalf("GET /llm/state: %v", err)
	}
	if len(s.Tables) == 0 {
		t.Fatalf("GET /llm/state: no table")
	}
	return s
}

var (
	// buildEnv is the environment before TestMain moved HOME to a temporary directory, so that go build
	// uses the real build and module caches.
	buildEnv = os.Environ()

	buildCaddyOnce sync.Once
	caddyBinary    string
	buildErr       error
)

// buildCaddy builds cmd/caddy once per test binary, for the tests that run Caddy as a process.
func buildCaddy(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds cmd/caddy: skipped with -short")
	}
	buildCaddyOnce.Do(func() {
		dir, err := os.MkdirTemp("", "caddy-llm-bin")
		if err != nil {
			buildErr = err
			return
		}
		caddyBinary = filepath.Join(dir, "caddy")
		cmd := exec.Command("go", "build", "-o", caddyBinary, "./cmd/caddy")
		cmd.Env = buildEnv
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build ./cmd/caddy: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return caddyBinary
}

// caddyProcess is Caddy run from the built binary, with its own ports and data directory.
type caddyProcess struct {
	t        *testing.T
	bin      string
	dir      string // HOME and XDG dirs, and the Caddyfile
	Admin    string // http://127.0.0.1:port
	URL      string // the site
	cmd      *exec.Cmd
	logs     *bytes.Buffer
	logsMu   *sync.Mutex
	exitDone chan struct{}
}

// startCaddyProcess writes caddyfile (with HTTP_PORT and ADMIN_PORT replaced by free ports) and runs
// Caddy on it until the test ends.
func startCaddyProcess(t *testing.T, dir, caddyfile string) *caddyProcess {
	t.Helper()
	p := &caddyProcess{t: t, bin: buildCaddy(t), dir: dir}
	httpPort, adminPort, _ := freePorts3()
	p.Admin = fmt.Sprintf("http://127.0.0.1:%d", adminPort)
	p.URL = fmt.Sprintf("http://127.0.0.1:%d", httpPort)
	caddyfile = strings.NewReplacer("HTTP_PORT", fmt.Sprint(httpPort), "ADMIN_PORT", fmt.Sprint(adminPort)).Replace(caddyfile)
	if err := os.WriteFile(filepath.Join(dir, "Caddyfile"), []byte(caddyfile), 0o600); err != nil {
		t.Fatal(err)
	}
	p.start()
	t.Cleanup(p.kill)
	return p
}

func (p *caddyProcess) start() {
	p.t.Helper()
	p.cmd = exec.Command(p.bin, "run", "--config", filepath.Join(p.dir, "Caddyfile"), "--adapter", "caddyfile")
	p.cmd.Env = append(os.Environ(), "HOME="+p.dir, "XDG_DATA_HOME="+p.dir, "XDG_CONFIG_HOME="+p.dir)
	p.logs, p.logsMu = new(bytes.Buffer), new(sync.Mutex)
	p.cmd.Stdout, p.cmd.Stderr = lockedWriter{p.logs, p.logsMu}, lockedWriter{p.logs, p.logsMu}
	if err := p.cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	p.exitDone = make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(p.exitDone) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		res, err := http.Get(p.Admin + "/llm/state")
		if err == nil {
			res.Body.Close()
			if conn, err := net.Dial("tcp", strings.TrimPrefix(p.URL, "http://")); err == nil && res.StatusCode == http.StatusOK {
				conn.Close()
				return
			}
		}
		select {
		case <-p.exitDone:
			p.t.Fatalf("caddy exited at start:\n%s", p.Logs())
		default:
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("caddy did not start:\n%s", p.Logs())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Logs returns what the process has written so far.
func (p *caddyProcess) Logs() string {
	p.logsMu.Lock()
	defer p.logsMu.Unlock()
	return p.logs.String()
}

// stop stops the process with sig (SIGINT: graceful; SIGKILL: without warning) and waits for it.
func (p *caddyProcess) stop(sig syscall.Signal) {
	p.t.Helper()
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.exitDone:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exitDone
		p.t.Errorf("caddy did not exit on %v", sig)
	}
	p.cmd = nil
}

func (p *caddyProcess) kill() { p.stop(syscall.SIGKILL) }

// post sends one chat request with a conversation ID and returns the answering upstream and the reason.
func (p *caddyProcess) post(client *http.Client, body, conversation string) (upstream, reason string, err error) {
	req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Conversation", conversation)
	res, err := client.Do(req)
	if err != nil {
		return "", "", err
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		return "", "", fmt.Errorf("status %d: %s", res.StatusCode, b)
	}
	var v struct{ Upstream string }
	_ = json.Unmarshal(b, &v)
	return v.Upstream, res.Header.Get("X-LLM-Reason"), nil
}

type lockedWriter struct {
	b  *bytes.Buffer
	mu *sync.Mutex
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

const processCaddyfile = `{
	admin 127.0.0.1:ADMIN_PORT
	http_port HTTP_PORT
	skip_install_trust
	grace_period 1s
	persist_config off
}
:HTTP_PORT {
	reverse_proxy UPSTREAMS {
		lb_policy llm {
			conversation_header X-Conversation
			OPTIONS
		}
		header_down X-LLM-Reason {http.llm.upstream_reason}
	}
}
`

// processConfig fills in upstreams and policy options, leaving the ports for startCaddyProcess.
func processConfig(options string, upstreams ...*backend) string {
	dials := make([]string, len(upstreams))
	for i, u := range upstreams {
		dials[i] = u.dial
	}
	return strings.NewReplacer("UPSTREAMS", strings.Join(dials, " "), "OPTIONS", options).Replace(processCaddyfile)
}

// TestPersistProcessRestart runs Caddy as a process: routes and pins learned, Caddy stopped gracefully
// (SIGINT) and started again, then killed without warning (SIGKILL) after a periodic snapshot and started
// again; each time the conversations continue on their upstreams. Then a corrupt snapshot: Caddy starts
// empty, with one log line.
func TestPersistProcessRestart(t *testing.T) {
	dir := t.TempDir()
	ups := []*backend{newBackend(t), newBackend(t), newBackend(t)}
	cfg := processConfig("persist 200ms", ups...)
	client := &http.Client{Timeout: 10 * time.Second}
	p := startCaddyProcess(t, dir, cfg)

	const conversations = 6
	where := make(map[int]string)
	turn := 1
	send := func(check bool) {
		t.Helper()
		for id := range conversations {
			up, reason, err := p.post(client, conversationTurn(id, turn), fmt.Sprint("c", id))
			if err != nil {
				t.Fatalf("turn %d of conversation %d: %v", turn, id, err)
			}
			if !check {
				where[id] = up
				continue
			}
			if up != where[id] {
				t.Errorf("turn %d of conversation %d went to %s, want %s", turn, id, up, where[id])
			}
			if reason != "conversation" && reason != "affinity" {
				t.Errorf("turn %d of conversation %d: reason %q, want conversation or affinity", turn, id, reason)
			}
		}
		turn++
	}
	send(false)
	// What each upstream that answered has learned of its speed (its requests' durations): the restarted
	// process must start from it, not from the prior. A request ends in the proxy (and teaches its
	// model) a moment after its client has read the whole answer: read the models once none is in
	// flight, or the last one's end lands after the read and the saved model differs from it.
	waitFor(t, "the requests to end in the proxy", func() bool {
		for _, u := range adminUpstreamsAt(t, p.Admin) {
			if u.InflightRequests != 0 {
				return false
			}
		}
		return true
	})
	learned := make(map[string]serviceModel)
	for up, u := range adminUpstreamsAt(t, p.Admin) {
		if slices.Contains(slices.Collect(maps.Values(where)), up) {
			learned[up] = *u.Model
		}
	}

	p.stop(syscall.SIGINT) // graceful: Cleanup writes the last snapshot
	p.start()
	if s := adminState(t, p.Admin); s.Tables[0].Persist.RestoredPins != conversations || s.Tables[0].Persist.RestoredModels != len(learned) {
		t.Fatalf("after a graceful stop: /llm/state = %+v, want %d pins and %d service models restored\n%s", s, conversations, len(learned), p.Logs())
	}
	restarted := adminUpstreamsAt(t, p.Admin)
	for up, m := range learned {
		if got := restarted[up].Model; got == nil || *got != m {
			t.Errorf("service model of %s after the restart = %+v, want the learned %+v", up, got, m)
		}
		if m.MeanDurationSeconds >= selection.Prior.MeanDuration {
			t.Errorf("service model of %s before the restart = %+v: learned nothing (the test shows nothing)", up, m)
		}
	}
	send(true)

	// Wait for a periodic snapshot holding this turn, then kill without warning.
	before := adminState(t, p.Admin).Tables[0].Persist.Snapshots
	deadline := time.Now().Add(10 * time.Second)
	for adminState(t, p.Admin).Tables[0].Persist.Snapshots == before {
		if time.Now().After(deadline) {
			t.Fatal("no periodic snapshot within 10s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	p.kill()
	p.start()
	if s := adminState(t, p.Admin); s.Tables[0].Persist.RestoredPins != conversations {
		t.Fatalf("after SIGKILL: /llm/state = %+v, want %d pins restored", s, conversations)
	}
	send(true)

	// A corrupt snapshot: Caddy starts, empty, and says so once.
	p.kill()
	snap := filepath.Join(dir, "caddy", "caddy-llm", "routes-16-100000-10m0s.snapshot")
	if err := os.WriteFile(snap, []byte("LLMR\x01 this is not a snapshot"), 0o600); err != nil {
		t.Fatal(err)
	}
	p.start()
	if s := adminState(t, p.Admin); s.Tables[0].Routes != 0 || s.Tables[0].Persist.RestoreProblem == "" {
		t.Errorf("after a corrupt snapshot: /llm/state = %+v, want empty with the problem reported", s)
	}
	if n := strings.Count(p.Logs(), "ignoring snapshot"); n != 1 {
		t.Errorf("log lines about the corrupt snapshot = %d, want 1:\n%s", n, p.Logs())
	}
	if up, _, err := p.post(client, conversationTurn(0, turn), "c0"); err != nil || up == "" {
		t.Errorf("request after a corrupt snapshot: %v", err)
	}
}
