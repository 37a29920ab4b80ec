//go:build unix

package tokenize

import (
	"syscall"
	"testing"
	"time"
)

// processCPU returns the process's user+system CPU time; benchmarks report it per op because the
// CI machine is shared and wall time per op includes waiting for a core.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func reportCPU(b *testing.B, start time.Duration) {
	b.ReportMetric(float64(processCPU()-start)/float64(b.N), "cpu-ns/op")
}
