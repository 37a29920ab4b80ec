package caddyllm

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"github.com/tokenrouter/caddy-llm/affinity"
	"math/rand/v2"
	"net/http"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

// heapInUse returns the live heap after a full collection.
func heapInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

// soakRound sends n streaming requests at once, each with its own id (from next), and returns how many
// failed their check and, when reloads run beside the round, how many connections a reload closed
// before Caddy read the request (see closedByReload); without reloads those are failures too.
func soakRound(t *testing.T, client *http.Client, plan *faultPlan, n int, next *atomic.Int64, rng func(int) *rand.Rand, reloading bool) (failed, closedUnread int) {
	t.Helper()
	var wg sync.WaitGroup
	var mu sync.Mutex
	for range n {
		id := int(next.Add(1))
		body := simChat(rng(id), id, true)
		wg.Add(1)
		go func() {
			defer wg.Done()
			status, err := doChaosRequest(client, chaosKinds[1], id, body, false) // ok_stream: a complete stream
			if err == nil {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if reloading && closedByReload(plan, id, status, err) {
				closedUnread++
				return
			}
			if failed++; failed <= 5 {
				t.Errorf("request %d: %v", id, err)
			}
		}()
	}
	wg.Wait()
	return failed, closedUnread
}

// TestSoak: 300 concurrent streams at a time through Caddy to three simulated vLLM servers, for a
// bounded number of rounds: no errors the backends did not cause, the heap and goroutines flat, and
// the in-flight counters back to zero. Then twenty reloads while 300 streams at a time keep coming:
// zero failed requests (connections a reload closes before Caddy reads them are counted apart: see
// closedByReload), and the routes learned before the reloads are kept.
func TestSoak(t *testing.T) {
	const (
		streams = 300
		rounds  = 3
		reloads = 20
	)
	plan := newFaultPlan()
	cfg := vllmsim.Config{MaxNumSeqs: 256, TimeScale: 1000}
	ups := make([]*simUpstream, 3)
	for i := range ups {
		cfg.Seed = int64(i + 1)
		ups[i] = newSimUpstream(t, plan, cfg)
	}
	servers := simServers(ups...)
	learning := simProxyConfig(settledPolicy, "", ups...)
	logFile := t.TempDir() + "/caddy.log"
	reloadConfigs := []string{
		simProxyConfigLog(logFile, reloadSafePolicy, "", ups...),
		simProxyConfigLog(logFile, "llm {\n\t\t\tmode least_tokens\n\t\t\toutput_tokens 128\n\t\t}", "", ups...),
	}

	tester := caddytest.NewTester(t)
	client := newLoadClient(false)
	tester.InitServer(learning, "caddyfile")
	var next atomic.Int64
	rng := func(id int) *rand.Rand { return rand.New(rand.NewPCG(uint64(id), 9)) }
	if failed, _ := soakRound(t, client, plan, 10, &next, rng, false); failed > 0 {
		t.Fatal("warm-up failed")
	}
	goroutinesBefore := settleGoroutines(t, tester, learning, client, -1, servers...)
	heapBefore := heapInUse()

	start := time.Now()
	failed := 0
	for range rounds {
		f, _ := soakRound(t, client, plan, streams, &next, rng, false)
		failed += f
	}
	soakTime := time.Since(start)
	assertAllZero(t, simDials(ups...))
	goroutinesAfter := assertNoGoroutineLeak(t, tester, learning, client, goroutinesBefore, servers...)
	heapAfter := heapInUse()
	var sim5xx, sim429 int64
	for _, u := range ups {
		st := u.sim.State()
		sim5xx += st.Failed5xx
		sim429 += st.Failed429
	}
	t.Logf("soak: %d streams in %d rounds of %d in %s, %d failed; backends answered %d 5xx, %d 429",
		rounds*streams, rounds, streams, soakTime.Round(time.Millisecond), failed, sim5xx, sim429)
	t.Logf("soak: heap in use %.1f MiB before, %.1f MiB after; goroutines %d before, %d after",
		float64(heapBefore)/(1<<20), float64(heapAfter)/(1<<20), goroutinesBefore, goroutinesAfter)
	if failed > 0 || sim5xx > 0 || sim429 > 0 {
		t.Errorf("soak: %d failed requests, backends answered %d 5xx and %d 429, want none", failed, sim5xx, sim429)
	}
	// The tokenizer's message cache (about 9 MB at most) and the route table are allowed to fill.
	if heapAfter > heapBefore+32<<20 {
		t.Errorf("soak: heap grew from %d to %d bytes", heapBefore, heapAfter)
	}

	// Reloads under load. The first reload (away from the learning config) is made with nothing in
	// flight: see selectAfterCleanupFixed.
	routes := soleRouteTable(t)
	learned := routes.Stats().Routes
	if learned == 0 {
		t.Fatal("no routes learned by the soak")
	}
	tester.InitServer(reloadConfigs[0], "caddyfile")
	done, closedUnread, failedReload, sent := 0, 0, 0, 0
	for round := 0; done < reloads; round++ {
		finished := make(chan [2]int)
		before := next.Load()
		go func() {
			f, c := soakRound(t, client, plan, streams, &next, rng, true)
			finished <- [2]int{f, c}
		}()
		var res [2]int
	reloading:
		for {
			select {
			case res = <-finished:
				break reloading
			default:
			}
			if done < reloads && next.Load()-before >= streams/2 {
				tester.InitServer(reloadConfigs[done%2], "caddyfile")
				done++
			} else {
				time.Sleep(time.Millisecond) // polling for the round's progress
			}
		}
		failedReload += res[0]
		closedUnread += res[1]
		sent += streams
	}
	assertNoPanicLogged(t, logFile)
	assertAllZero(t, simDials(ups...))
	kept := soleRouteTable(t).Stats().Routes
	t.Logf("reloads: %d reloads under load, %d streams sent, %d failed, %d connections closed by a reload before Caddy read their request; learned routes %d before, %d after",
		done, sent, failedReload, closedUnread, learned, kept)
	if failedReload > 0 {
		t.Errorf("%d requests failed during reloads, want 0", failedReload)
		logCaddyErrors(t, logFile, 10)
	}
	if soleRouteTable(t) != routes || kept < learned {
		t.Errorf("learned routes not kept across reloads: %d before, %d after (same table: %t)", learned, kept, soleRouteTable(t) == routes)
	}
	client.CloseIdleConnections()
}

// TestRouteMemoryBounded: endless unique prefixes never grow the learned routes past their capacity.
func TestRouteMemoryBounded(t *testing.T) {
	const capacity, prefixes = 500, 5000
	s, pool := provisionedPolicy(t, &LLMSelection{RouteCapacity: capacity, Tokenizer: "approx"})
	heapBefore := heapInUse()
	for i := range prefixes {
		body := fmt.Appendf(nil, `{"model":"m","messages":[{"role":"system","content":"system prompt %d"},{"role":"user","content":"question %d %s"}]}`,
			i, i, strings.Repeat("more words ", i%50))
		r, cancel := newProxyRequest(body)
		if s.Select(pool, r, nil) == nil {
			t.Fatal("no upstream")
		}
		cancel()
		if n := s.routes.Stats().Routes; n > capacity {
			t.Fatalf("after %d unique prefixes: %d routes, capacity %d", i+1, n, capacity)
		}
	}
	st := s.routes.Stats()
	heapAfter := heapInUse()
	t.Logf("%d unique prefixes: %d routes held (capacity %d), %d evicted; heap %.1f MiB before, %.1f MiB after",
		prefixes, st.Routes, capacity, st.Evictions, float64(heapBefore)/(1<<20), float64(heapAfter)/(1<<20))
	if st.Evictions == 0 {
		t.Errorf("no evictions: the test did not reach the capacity")
	}
}

// TestNoSecretsInLogs: with Caddy logging at DEBUG, a marker sent in prompts, in bodies (valid,
// malformed, gzip-encoded, over the cap, to non-LLM paths) and in the Authorization header never
// appears in the log, on success, matcher errors, upstream errors and retries alike.
func TestNoSecretsInLogs(t *testing.T) {
	const marker = "SECRET-7f3a9c"
	a := newBackend(t)
	a.handle = func(w http.ResponseWriter, r *http.Request, body []byte) {
		if r.Header.Get("X-Fail") != "" {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		fmt.Fprint(w, "ok")
	}
	logFile := t.TempDir() + "/caddy.log"
	cfg := withLogFile(logFile, "DEBUG") + fmt.Sprintf(`
%[2]s {
	handle /strict/* {
		@strict llm {
			model strict*
			max_body_size 1KiB
		}
		handle @strict {
			reverse_proxy %[1]s {
				lb_policy llm
			}
		}
		handle {
			respond 404
		}
	}
	handle {
		reverse_proxy %[1]s {
			lb_policy llm {
				max_body_size 2KiB
			}
			lb_retries 1
			lb_retry_match {
				method POST
			}
		}
	}
}
`, a.dial, site)
	tester := caddytest.NewTester(t)
	tester.InitServer(cfg, "caddyfile")
	client := newLoadClient(true)
	defer client.CloseIdleConnections()

	chat := func(model, content string) string {
		return fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":"%s sys"},{"role":"user","content":%q}]}`, model, marker, content)
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte(chat("m", marker)))
	zw.Close()
	cases := []struct {
		path, body string
		headers    []string
		want       int
	}{
		{"/v1/chat/completions", chat("m", "hello "+marker), nil, 200},
		{"/strict/v1/chat/completions", chat("strict-1", "hello "+marker), nil, 200},
		{"/strict/v1/chat/completions", chat("strict-1", strings.Repeat(marker, 200)), nil, 413},                                // matcher: 413
		{"/strict/v1/chat/completions", `{"model":"strict-1","messages":[{"role":"user","content":` + marker + `}]}`, nil, 400}, // matcher: 400
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":` + marker + `}]}`, nil, 200},               // policy: unparsed
		{"/v1/chat/completions", `{"model":"m","messages":{"` + marker + `":1}}`, nil, 200},
		{"/v1/chat/completions", chat("m", strings.Repeat(marker, 300)), nil, 200}, // over the policy's cap
		{"/v1/completions", `{"model":"m","prompt":"` + marker + `"}`, []string{"X-Fail", "1"}, 500},
		{"/v1/embeddings", `{"input":"` + marker + `"}`, nil, 200},
		{"/v1/chat/completions", gz.String(), []string{"Content-Encoding", "gzip"}, 200},
		{"/v1/chat/completions", chat("m", "x"), []string{"X-Fail", "1"}, 500}, // upstream 500, retried
	}
	for i, c := range cases {
		// A fresh connection per case: an error answered before its body was read may close the
		// connection the client would reuse, and this test is about logs, not keep-alive.
		client.CloseIdleConnections()
		headers := append([]string{"Authorization", "Bearer " + marker, "Cookie", "session=" + marker}, c.headers...)
		if res, _ := post(t, client, c.path, c.body, headers...); res.StatusCode != c.want {
			t.Errorf("case %d: POST %s: status %d, want %d (the case does not test the path it should)", i, c.path, res.StatusCode, c.want)
		}
	}
	// The log is written synchronously; read it after a reload so the file is flushed and closed.
	tester.InitServer(globalOptions+"\n"+site+" {\n\trespond 404\n}\n", "caddyfile")
	logs, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(logs, []byte(`"selected upstream"`)) {
		t.Fatalf("the log has no debug entries from the policy: the test is not looking at DEBUG logs (%d bytes)", len(logs))
	}
	if n := bytes.Count(logs, []byte(marker)); n > 0 {
		i := bytes.Index(logs, []byte(marker))
		t.Errorf("the marker appears %d times in Caddy's DEBUG log, first: ...%s...", n, logs[max(0, i-300):min(len(logs), i+100)])
	}
	t.Logf("%d requests, %d bytes of DEBUG log, marker found %d times", len(cases), len(logs), bytes.Count(logs, []byte(marker)))
}

// soleRouteTable returns the one route table in use (the soak's configs share one table configuration).
func soleRouteTable(t *testing.T) *affinity.Table {
	t.Helper()
	tables := allRoutes()
	if len(tables) != 1 {
		t.Fatalf("%d route tables in use, want 1", len(tables))
	}
	return tables[0]
}
