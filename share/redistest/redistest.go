// Package redistest runs a real redis-server for tests: on a free 127.0.0.1 port, without persistence,
// stopped when the test ends. Tests are skipped when redis-server is not installed, except in CI (CI set
// to true), where that is a failure.
package redistest

import (
	"context"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/tokenrouter/caddy-llm/internal/freeport"
)

// Server is a redis-server process.
type Server struct {
	t    testing.TB
	bin  string
	Port int
	cmd  *exec.Cmd
}

// Start starts redis-server and waits until it answers PING.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server not found in CI: %v (.ci/run installs it)", err)
		}
		t.Skip("redis-server not installed (apt-get install redis-server); skipping the Redis tests")
	}
	// From below the ephemeral range: Restart stops the server and starts it on the same port, and
	// meanwhile a listener on port 0 elsewhere could be handed a port from that range.
	ports, err := freeport.Ports(1)
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{t: t, bin: bin, Port: ports[0]}
	s.Restart()
	t.Cleanup(s.Kill)
	return s
}

// Addr is host:port of the server.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.Port) }

// URL is the redis:// URL of the server's database 0.
func (s *Server) URL() string { return "redis://" + s.Addr() + "/0" }

// Kill stops the server at once (SIGKILL), as a crash would. Idempotent.
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

// Restart starts the server again on the same port (after Kill) and waits until it answers.
func (s *Server) Restart() {
	s.t.Helper()
	s.cmd = exec.Command(s.bin, "--port", strconv.Itoa(s.Port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning")
	s.cmd.Dir = s.t.TempDir()
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("starting redis-server: %v", err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := c.Ping(context.Background()).Err()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			s.Kill()
			s.t.Fatalf("redis-server on %s did not answer: %v", s.Addr(), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Client returns a client of the server, closed when the test ends.
func (s *Server) Client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr()})
	s.t.Cleanup(func() { c.Close() })
	return c
}
