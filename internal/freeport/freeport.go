// Package freeport chooses free TCP ports on 127.0.0.1 for tests that start servers on ports they
// must name in a config.
package freeport

import (
	"fmt"
	"net"
)

// Ports returns n distinct TCP ports free on 127.0.0.1 now. Every listener stays open until all n are
// chosen, so the kernel cannot hand out one port twice (two sites on one port: "ambiguous site
// definition").
func Ports(n int) ([]int, error) {
	ports := make([]int, n)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("choosing a free port: %w", err)
		}
		defer l.Close()
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports, nil
}
