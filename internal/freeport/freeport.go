// Package freeport chooses free TCP ports on 127.0.0.1 for tests that start servers on ports they
// must name in a config.
package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// rangeFile holds the kernel's ephemeral port range (Linux): the ports it hands to a bind to port 0
// and to outgoing connections.
const rangeFile = "/proc/sys/net/ipv4/ip_local_port_range"

// lowest is the least port Ports chooses below the ephemeral range.
const lowest = 10000

// Ports returns n distinct TCP ports free on 127.0.0.1 now. Every listener stays open until all n are
// chosen, so one port is not handed out twice (two sites on one port: "ambiguous site definition").
//
// Where the kernel's ephemeral range is known, the ports come from below it. A port a test names in a
// config may be closed and opened again while the test runs (Caddy's admin endpoint restarts at every
// config load), and a port from the ephemeral range could meanwhile be handed to any listener on port
// 0 (an httptest server or a simulated backend of a test running beside it): caddytest's next load
// then went to that server ("failed to load config: {"detail":"Not Found"}", a simulator's 404).
//
// They come from the lower half of that range, and Seeded's listeners from the upper half: a benchmark
// test's simulated backends, started beside a test whose Caddy restarts its admin port, are never drawn
// that port.
func Ports(n int) ([]int, error) {
	var ls []net.Listener
	var err error
	if lo, ok := ephemeralLow(); ok && lo-lowest >= 1000 {
		ls, err = listen(n, lowest, middle(lo), rand.IntN)
	} else {
		ls, err = listen(n, 0, 0, nil)
	}
	if err != nil {
		return nil, err
	}
	ports := make([]int, len(ls))
	for i, l := range ls {
		ports[i] = l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
	}
	return ports, nil
}

// middle splits [lowest, lo) between Ports (below it) and Seeded (from it).
func middle(lo int) int { return lowest + (lo-lowest)/2 }

// Seeded returns n listeners on 127.0.0.1 at ports drawn from seed: the same seed gives the same ports
// whenever they are free (a port taken is skipped for the next draw). From the upper half below the
// kernel's ephemeral range when it is known (Ports has the lower), else on ports the kernel chooses.
// For a benchmark whose servers are told apart by address: Caddy's hashing policies hash each
// upstream's address with the key, so which upstream a key lands on, and how evenly keys spread,
// follows the ports; drawn from the run's seed, a run repeats.
func Seeded(n int, seed uint64) ([]net.Listener, error) {
	if lo, ok := ephemeralLow(); ok && lo-lowest >= 1000 {
		return listen(n, middle(lo), lo, rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)).IntN)
	}
	return listen(n, 0, 0, nil)
}

// listen opens n listeners on 127.0.0.1: on ports from + draw(to - from), a port taken skipped for the
// next draw, when to > from; else on ports the kernel chooses (port 0). On an error none is left open.
func listen(n, from, to int, draw func(int) int) ([]net.Listener, error) {
	ls := make([]net.Listener, 0, n)
	fail := func(err error) ([]net.Listener, error) {
		for _, l := range ls {
			_ = l.Close()
		}
		return nil, err
	}
	for tries := 0; len(ls) < n; tries++ {
		if to <= from {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				return fail(fmt.Errorf("choosing a free port: %w", err))
			}
			ls = append(ls, l)
			continue
		}
		if tries == 1000 {
			return fail(fmt.Errorf("choosing a free port: none of 1000 tried in [%d, %d) was free", from, to))
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", from+draw(to-from)))
		if err != nil {
			continue // taken
		}
		ls = append(ls, l)
	}
	return ls, nil
}

// ephemeralLow returns the lowest port of the kernel's ephemeral range, when it can be read.
func ephemeralLow() (int, bool) {
	b, err := os.ReadFile(rangeFile)
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0, false
	}
	lo, err := strconv.Atoi(f[0])
	return lo, err == nil
}
