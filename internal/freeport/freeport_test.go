package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"testing"
)

// TestPorts: the ports are distinct, free to listen on once Ports returns, and, where the kernel's
// ephemeral range is known, below it (where no listener on port 0 can be handed them).
func TestPorts(t *testing.T) {
	lo, known := ephemeralLow()
	for range 20 {
		ports, err := Ports(3)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[int]bool{}
		for _, p := range ports {
			if seen[p] {
				t.Fatalf("port %d handed out twice in %v", p, ports)
			}
			seen[p] = true
			if known && lo-lowest >= 1000 && (p < lowest || p >= middle(lo)) {
				t.Errorf("port %d outside [%d, %d): the ephemeral range starts at %d, Seeded has the upper half below it", p, lowest, middle(lo), lo)
			}
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
			if err != nil {
				t.Fatalf("port %d is not free after Ports returned: %v", p, err)
			}
			l.Close()
		}
	}
}

// TestPortsSkipsTaken: a port something listens on is never chosen.
func TestPortsSkipsTaken(t *testing.T) {
	lo, known := ephemeralLow()
	if !known || lo-lowest < 1000 {
		t.Skip("no ephemeral range to choose below")
	}
	// Hold every port but one in a small window, and choose from it.
	const window = 50
	var free int
	for i := range window {
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", lowest+i))
		if err != nil {
			continue // taken by someone else already
		}
		if free == 0 {
			free = lowest + i
			l.Close()
			continue
		}
		defer l.Close()
	}
	if free == 0 {
		t.Skip("the window is taken")
	}
	ls, err := listen(1, lowest, lowest+window, rand.IntN)
	if err != nil {
		t.Fatal(err)
	}
	defer ls[0].Close()
	if port := ls[0].Addr().(*net.TCPAddr).Port; port != free {
		t.Errorf("chose %d, want the one free port %d", port, free)
	}
}

// TestSeeded: a seed gives the same ports again once they are free, another seed others, and a port
// taken in between is skipped while the others stay.
func TestSeeded(t *testing.T) {
	lo, known := ephemeralLow()
	if !known || lo-lowest < 1000 {
		t.Skip("no ephemeral range to choose below: the kernel chooses")
	}
	ports := func(seed uint64, n int) []int {
		t.Helper()
		ls, err := Seeded(n, seed)
		if err != nil {
			t.Fatal(err)
		}
		out := make([]int, len(ls))
		for i, l := range ls {
			out[i] = l.Addr().(*net.TCPAddr).Port
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
		}
		return out
	}
	a, b := ports(7, 4), ports(7, 4)
	if fmt.Sprint(a) != fmt.Sprint(b) {
		t.Fatalf("seed 7 gave %v, then %v", a, b)
	}
	for i, p := range a {
		if p < middle(lo) || p >= lo {
			t.Errorf("port %d outside [%d, %d): Ports has the lower half below the ephemeral range", p, middle(lo), lo)
		}
		for _, q := range a[:i] {
			if p == q {
				t.Errorf("port %d twice in %v", p, a)
			}
		}
	}
	if c := ports(8, 4); fmt.Sprint(c) == fmt.Sprint(a) {
		t.Errorf("seeds 7 and 8 both gave %v", a)
	}
	held, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", a[1]))
	if err != nil {
		t.Skipf("port %d taken by another process meanwhile: %v", a[1], err)
	}
	defer held.Close()
	c := ports(7, 3)
	if c[0] != a[0] || c[1] != a[2] || c[2] != a[3] {
		t.Errorf("with %d held, seed 7 gave %v; want %v without it", a[1], c, []int{a[0], a[2], a[3]})
	}
}
