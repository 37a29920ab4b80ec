package freeport

import (
	"fmt"
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
			if known && lo-lowest >= 1000 && (p < lowest || p >= lo) {
				t.Errorf("port %d outside [%d, %d): the ephemeral range starts at %d", p, lowest, lo, lo)
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
	ports, err := below(1, lowest+window)
	if err != nil {
		t.Fatal(err)
	}
	if ports[0] != free {
		t.Errorf("chose %d, want the one free port %d", ports[0], free)
	}
}
