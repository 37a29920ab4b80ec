//go:build !race

package affinity

import (
	"runtime"
	"testing"
)

// TestBytesPerRoute keeps the documented memory cost honest: a full table of 100k routes must stay under
// 200 heap bytes per route (measured about 142; BenchmarkLearn reports it at 1M). Skipped under -race,
// whose instrumentation changes allocation sizes.
func TestBytesPerRoute(t *testing.T) {
	if testing.Short() {
		t.Skip("fills 100k routes")
	}
	const n = 100_000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	tb := New(Config{Capacity: n})
	fill(tb, 2*n) // the second half evicts the first: the cost at capacity, churn included
	runtime.GC()
	runtime.ReadMemStats(&after)
	perRoute := float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)) / float64(tb.Stats().Routes)
	t.Logf("%.1f bytes/route at %d routes", perRoute, tb.Stats().Routes)
	if perRoute > 200 {
		t.Errorf("%.1f bytes/route, want at most 200", perRoute)
	}
	runtime.KeepAlive(tb)
}
