package affinity

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/tokenize"
)

var benchUpstreams = []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000",
	"10.0.0.5:8000", "10.0.0.6:8000", "10.0.0.7:8000", "10.0.0.8:8000"}

// benchConversations are 1024 conversations of 8 message boundaries behind 16 system prompts.
var benchConversations = func() [][]tokenize.Boundary {
	convs := make([][]tokenize.Boundary, 1024)
	for c := range convs {
		msgs := []msg{{fmt.Sprint("system prompt ", c%16), 1000}}
		for turn := range 7 {
			msgs = append(msgs, msg{fmt.Sprint("conversation ", c, " turn ", turn), 50 + 30*turn})
		}
		convs[c] = prompt(msgs...)
	}
	return convs
}()

func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// fill learns n single-block routes with distinct hashes, spread over the bench upstreams.
func fill(tb *Table, n int) {
	b := make([]tokenize.Boundary, 1)
	for i := range n {
		b[0] = tokenize.Boundary{Tokens: 64, Hash: splitmix(uint64(i))}
		tb.Learn("bench-model", b, benchUpstreams[i%len(benchUpstreams)])
	}
}

// benchTable is a full table of n routes (filler plus benchConversations), built once per size and shared by
// the benchmarks, with its measured heap bytes per route.
type benchTable struct {
	tb            *Table
	bytesPerRoute float64
}

var (
	benchTablesMu sync.Mutex
	benchTables   = map[int]*benchTable{}
)

func getBenchTable(n int) *benchTable {
	benchTablesMu.Lock()
	defer benchTablesMu.Unlock()
	if bt, ok := benchTables[n]; ok {
		return bt
	}
	clock := newFakeClock()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	tb := New(Config{Capacity: n, TTL: time.Hour, Now: clock.Now})
	fill(tb, n)
	runtime.GC()
	runtime.ReadMemStats(&after)
	bt := &benchTable{tb: tb, bytesPerRoute: float64(after.HeapAlloc-before.HeapAlloc) / float64(tb.Stats().Routes)}
	for c, conv := range benchConversations {
		tb.Learn("bench-model", conv, benchUpstreams[c%len(benchUpstreams)])
	}
	benchTables[n] = bt
	return bt
}

var benchSizes = []struct {
	name string
	n    int
}{{"routes=10k", 10_000}, {"routes=1M", 1_000_000}}

// BenchmarkMatch looks up a continuing conversation (its 8 learned boundaries plus 2 new ones) against 4
// candidate upstreams in a full table; hit/op is the fraction of lookups that found a prefix.
func BenchmarkMatch(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(size.name, func(b *testing.B) {
			bt := getBenchTable(size.n)
			reqs := make([][]tokenize.Boundary, len(benchConversations))
			for c, conv := range benchConversations {
				last := conv[len(conv)-1]
				reqs[c] = append(append([]tokenize.Boundary(nil), conv...),
					tokenize.Boundary{Tokens: last.Tokens + 100, Hash: splitmix(last.Hash)},
					tokenize.Boundary{Tokens: last.Tokens + 300, Hash: splitmix(last.Hash + 1)})
			}
			ups := benchUpstreams[:4]
			cached := make([]int, len(ups))
			hits := 0
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				if bt.tb.Match("bench-model", reqs[i%len(reqs)], ups, cached) > 0 {
					hits++
				}
			}
			b.ReportMetric(float64(hits)/float64(b.N), "hit/op")
			b.ReportMetric(bt.bytesPerRoute, "bytes/route")
		})
	}
}

// BenchmarkLearn learns a continuing conversation in a full table: 7 known boundaries are refreshed and one
// new one is inserted, evicting the least recently learned route.
func BenchmarkLearn(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(size.name, func(b *testing.B) {
			bt := getBenchTable(size.n)
			req := make([]tokenize.Boundary, 8)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				conv := benchConversations[i%len(benchConversations)]
				copy(req, conv[:7])
				req[7] = tokenize.Boundary{Tokens: conv[6].Tokens + 200, Hash: splitmix(uint64(i) + 1<<40)}
				bt.tb.Learn("bench-model", req, benchUpstreams[i%len(benchUpstreams)])
			}
			b.ReportMetric(bt.bytesPerRoute, "bytes/route")
		})
	}
}

// BenchmarkMatchWidePrefix matches a hot 4,000-token system prompt (62 boundaries of 64 tokens, then a
// question) learned on 12 of 16 upstreams, against all 16: with overflow routes the 8 older holders are
// found in them, and the 4 upstreams that never held it probe them within the budget; without, only
// the route's 4 newest holders match. matched/op is how many upstreams matched.
func BenchmarkMatchWidePrefix(b *testing.B) {
	ups := make([]string, 16)
	for i := range ups {
		ups[i] = fmt.Sprintf("10.0.1.%d:8000", i+1)
	}
	bounds := make([]tokenize.Boundary, 63)
	for i := range bounds {
		bounds[i] = tokenize.Boundary{Tokens: 64 * (i + 1), Hash: splitmix(uint64(i) + 7)}
	}
	for _, overflow := range []int{DefaultOverflowRoutes, -1} {
		b.Run(fmt.Sprintf("overflow=%d", max(overflow, 0)), func(b *testing.B) {
			clock := newFakeClock()
			tb := New(Config{TTL: time.Hour, OverflowRoutes: overflow, Now: clock.Now})
			for _, u := range ups[:12] {
				tb.Learn("bench-model", bounds[:62], u)
				clock.Advance(time.Millisecond)
			}
			cached := make([]int, len(ups))
			matched := 0
			b.ReportAllocs()
			for b.Loop() {
				tb.Match("bench-model", bounds, ups, cached)
				for _, n := range cached {
					if n > 0 {
						matched++
					}
				}
			}
			b.ReportMetric(float64(matched)/float64(b.N), "matched/op")
		})
	}
}
