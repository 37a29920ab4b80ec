package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokenrouter/caddy-llm/internal/freeport"
)

// Caddy as separate processes, for the modes that need several independent instances (-instances) or a
// real restart (-restart). Process-wide state (route tables, in-flight counts, learned service models)
// is per process, as in a deployment; several configs in this process would share it.

// buildCaddyBinary builds cmd/caddy (standard modules and this plugin) into dir and returns its path.
func buildCaddyBinary(dir string) (string, error) {
	bin := filepath.Join(dir, "caddy")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/tokenrouter/caddy-llm/cmd/caddy")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/caddy: %w\n%s", err, out)
	}
	return bin, nil
}

// caddyProcess is one Caddy process with fixed ports and its own data directory (its storage, where
// persist writes), so that a restart starts from the same storage on the same address.
type caddyProcess struct {
	bin, dir string
	URL      string // the proxy, http://127.0.0.1:port
	admin    string // the admin API, http://127.0.0.1:port
	config   []byte

	cmd    *exec.Cmd
	exited chan struct{}
	logs   *syncBuffer
}

// newCaddyProcess prepares (does not start) a Caddy process proxying to upstreams with policy p.
func newCaddyProcess(bin, dir string, upstreams []string, p policy) (*caddyProcess, error) {
	ports, err := freeport.Ports(2) // together: two calls could be handed one port
	if err != nil {
		return nil, err
	}
	port, adminPort := ports[0], ports[1]
	cfg, err := caddyConfig(port, upstreams, p, proxyExtras{})
	if err != nil {
		return nil, err
	}
	// The in-process config with the admin API on (for /llm/state), warnings logged (share's
	// connection messages) and a grace period long enough for the streams in flight at a stop.
	var m map[string]any
	if err := json.Unmarshal(cfg, &m); err != nil {
		return nil, err
	}
	m["admin"] = map[string]any{"listen": fmt.Sprintf("127.0.0.1:%d", adminPort), "config": map[string]any{"persist": false}}
	m["logging"] = map[string]any{"logs": map[string]any{"default": map[string]any{"level": "WARN"}}}
	m["apps"].(map[string]any)["http"].(map[string]any)["grace_period"] = "10s"
	if cfg, err = json.Marshal(m); err != nil {
		return nil, err
	}
	return &caddyProcess{
		bin: bin, dir: dir, config: cfg,
		URL:   fmt.Sprintf("http://127.0.0.1:%d", port),
		admin: fmt.Sprintf("http://127.0.0.1:%d", adminPort),
		logs:  new(syncBuffer),
	}, nil
}

// start runs the process and waits until its admin API and proxy port answer.
func (p *caddyProcess) start(ctx context.Context) error {
	path := filepath.Join(p.dir, "caddy.json")
	if err := os.WriteFile(path, p.config, 0o600); err != nil {
		return fmt.Errorf("writing caddy config: %w", err)
	}
	p.cmd = exec.Command(p.bin, "run", "--config", path)
	p.cmd.Env = append(os.Environ(), "HOME="+p.dir, "XDG_DATA_HOME="+p.dir, "XDG_CONFIG_HOME="+p.dir)
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	if err := p.cmd.Start(); err != nil {
		return fmt.Errorf("starting caddy: %w", err)
	}
	p.exited = make(chan struct{})
	go func(cmd *exec.Cmd, exited chan struct{}) { _ = cmd.Wait(); close(exited) }(p.cmd, p.exited)
	deadline := time.Now().Add(60 * time.Second) // a loaded 2-core machine
	for {
		if p.ready() {
			return nil
		}
		select {
		case <-p.exited:
			return fmt.Errorf("caddy exited at start:\n%s", p.logs.tail(2000))
		case <-ctx.Done():
			p.kill()
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.kill()
			return fmt.Errorf("caddy did not start within a minute:\n%s", p.logs.tail(2000))
		}
	}
}

func (p *caddyProcess) ready() bool {
	res, err := http.Get(p.admin + "/llm/state")
	if err != nil {
		return false
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return false
	}
	conn, err := net.Dial("tcp", strings.TrimPrefix(p.URL, "http://"))
	if err != nil {
		return false
	}
	conn.Close()
	return true
}

// stop stops the process gracefully (SIGINT: Caddy finishes the streams in flight, runs Cleanup and
// so writes its last snapshot), killing it after 30 s.
func (p *caddyProcess) stop() error {
	if p.cmd == nil {
		return nil
	}
	defer func() { p.cmd = nil }()
	if err := p.cmd.Process.Signal(syscall.SIGINT); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("stopping caddy: %w", err)
	}
	select {
	case <-p.exited:
		return nil
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
		return errors.New("caddy did not stop within 30s after SIGINT; killed")
	}
}

// kill stops the process at once, if it runs.
func (p *caddyProcess) kill() {
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
	p.cmd = nil
}

// tableState is the part of GET /llm/state the benchmark reports, for the first route table.
type tableState struct {
	Routes       int    `json:"routes"`
	RemoteRoutes int    `json:"remote_routes"`
	Pins         int    `json:"conversation_pins"`
	FeedDropped  uint64 `json:"feed_dropped"`
	Persist      *struct {
		RestoredRoutes int `json:"restored_routes"`
		RestoredPins   int `json:"restored_pins"`
		RestoredModels int `json:"restored_models"`
		LastBytes      int `json:"last_snapshot_bytes"`
	} `json:"persist,omitempty"`
	Share *struct {
		Connected        bool   `json:"connected"`
		PublishedBatches uint64 `json:"published_batches"`
		PublishedChanges uint64 `json:"published_changes"`
		PublishedBytes   uint64 `json:"published_bytes"`
		ImportedChanges  uint64 `json:"imported_changes"`
		DroppedChanges   uint64 `json:"dropped_changes"`
		PeerModels       int    `json:"peer_models"`
	} `json:"share,omitempty"`
}

// state reads the process's /llm/state, or /llm/routes when no table persists or shares.
func (p *caddyProcess) state() (tableState, error) {
	res, err := http.Get(p.admin + "/llm/state")
	if err != nil {
		return tableState{}, fmt.Errorf("GET /llm/state: %w", err)
	}
	defer res.Body.Close()
	var s struct {
		Tables []tableState `json:"tables"`
	}
	if err := json.NewDecoder(res.Body).Decode(&s); err != nil {
		return tableState{}, fmt.Errorf("GET /llm/state: %w", err)
	}
	if len(s.Tables) > 0 {
		return s.Tables[0], nil
	}
	res2, err := http.Get(p.admin + "/llm/routes")
	if err != nil {
		return tableState{}, fmt.Errorf("GET /llm/routes: %w", err)
	}
	defer res2.Body.Close()
	var t tableState
	if err := json.NewDecoder(res2.Body).Decode(&t); err != nil {
		return tableState{}, fmt.Errorf("GET /llm/routes: %w", err)
	}
	return t, nil
}

// syncBuffer collects a process's output.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// tail returns the last n bytes written.
func (b *syncBuffer) tail(n int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.buf.String()
	return s[max(0, len(s)-n):]
}

// count returns how many times s was written.
func (b *syncBuffer) count(s string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Count(b.buf.String(), s)
}

// redisServer is a redis-server process on a free 127.0.0.1 port, without persistence.
type redisServer struct {
	addr string
	cmd  *exec.Cmd
}

// startRedis starts redis-server in dir and waits until it answers PING.
func startRedis(dir string) (*redisServer, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("sharing needs redis-server (apt-get install redis-server): %w", err)
	}
	ports, err := freeport.Ports(1)
	if err != nil {
		return nil, err
	}
	port := ports[0]
	r := &redisServer{addr: fmt.Sprintf("127.0.0.1:%d", port)}
	r.cmd = exec.Command(bin, "--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--daemonize", "no", "--loglevel", "warning")
	r.cmd.Dir = dir
	if err := r.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting redis-server: %w", err)
	}
	c := redis.NewClient(&redis.Options{Addr: r.addr, MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	defer c.Close()
	for deadline := time.Now().Add(10 * time.Second); ; {
		err := c.Ping(context.Background()).Err()
		if err == nil {
			return r, nil
		}
		if time.Now().After(deadline) {
			r.stop()
			return nil, fmt.Errorf("redis-server on %s did not answer: %w", r.addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// url is the redis:// URL of database 0.
func (r *redisServer) url() string { return "redis://" + r.addr + "/0" }

// stop kills the server (it holds nothing worth keeping).
func (r *redisServer) stop() {
	_ = r.cmd.Process.Kill()
	_ = r.cmd.Wait()
}

// withOption returns p with a top-level option of its JSON set (p must be an llm policy).
func withOption(p policy, name string, value any) policy {
	var cfg map[string]any
	if err := json.Unmarshal([]byte(p.JSON), &cfg); err != nil {
		panic(err) // the policies are constants of this package
	}
	cfg[name] = value
	b, err := json.Marshal(cfg)
	if err != nil {
		panic(err)
	}
	p.JSON = string(b)
	return p
}
