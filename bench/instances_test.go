package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokenrouter/caddy-llm/internal/freeport"
)

func TestParseInstancesOptions(t *testing.T) {
	o, err := parseOptions([]string{"-instances", "3"})
	if err != nil {
		t.Fatal(err)
	}
	if o.instances != 3 || len(o.policies) != 1 || o.policies[0].Name != judgedPolicy || strings.Join(o.workloads, ",") != "shared-prefix,multi-turn" {
		t.Errorf("-instances 3: instances %d, policies %v, workloads %v", o.instances, o.policies, o.workloads)
	}
	if o.seeds != 3 {
		t.Errorf("-instances 3: seeds %d, want 3", o.seeds)
	}
	// Real time unless told otherwise (three processes on a shared machine), and -quick keeps its own.
	for _, tt := range []struct {
		args []string
		want float64
	}{
		{[]string{"-instances", "3"}, instancesTimeScale},
		{[]string{"-instances", "3", "-timescale", "5"}, 5},
		{[]string{"-instances", "3", "-quick"}, 10},
	} {
		o, err := parseOptions(tt.args)
		if err != nil {
			t.Fatal(err)
		}
		if o.sim.TimeScale != tt.want {
			t.Errorf("%q: time scale %g, want %g", tt.args, o.sim.TimeScale, tt.want)
		}
	}
	o, err = parseOptions([]string{"-restart", "-timescale", "5"})
	if err != nil {
		t.Fatal(err)
	}
	if !o.restart || o.seeds != 1 || o.sim.TimeScale != 5 {
		t.Errorf("-restart: restart %v, seeds %d, time scale %g", o.restart, o.seeds, o.sim.TimeScale)
	}
	if got := o.shareFlushInterval(); got != 20*time.Millisecond {
		t.Errorf("share flush at time scale 5 = %s, want 20ms (100ms simulated)", got)
	}
	if o, err = parseOptions([]string{"-restart", "-regimes", "hetero"}); err != nil || len(o.regimes) != 1 || o.regimes[0].Name != "hetero" ||
		!slices.Equal(o.restartKeep, []string{"persist", "none"}) {
		t.Errorf("-restart -regimes hetero: regimes %v, keep %v, err %v; want hetero alone, persist and none", o.regimes, o.restartKeep, err)
	}
	if o, err = parseOptions([]string{"-restart", "-restart-keep", "share"}); err != nil || !slices.Equal(o.restartKeep, []string{"share"}) {
		t.Errorf("-restart-keep share: keep %v, err %v", o.restartKeep, err)
	}
	for _, bad := range [][]string{
		{"-restart", "-regimes", "hetero,default"},
		{"-restart", "-restart-keep", "persist,redis"},
		{"-restart", "-restart-keep", "share,share"},
		{"-instances", "1"},
		{"-instances", "3", "-matrix"},
		{"-restart", "-overhead"},
		{"-instances", "3", "-policies", "llm,round_robin"},
	} {
		if _, err := parseOptions(bad); err == nil {
			t.Errorf("parseOptions(%q) succeeded, want an error", bad)
		}
	}
}

// TestDriverSplitsAtRandom sends a workload to three servers through the random splitter: every
// server gets a share near a third, and the same seed splits the same way.
func TestDriverSplitsAtRandom(t *testing.T) {
	var mu sync.Mutex
	counts := map[string]int{}
	var urls []string
	for i := range 3 {
		name := fmt.Sprint(i)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			counts[name]++
			mu.Unlock()
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n")
		}))
		t.Cleanup(srv.Close)
		urls = append(urls, srv.URL)
	}
	w := Workload{Name: "t"}
	for range 300 {
		w.Sessions = append(w.Sessions, Session{Requests: []Request{{Messages: []Message{{Role: "user", Content: "hi"}}, MaxTokens: 1}}})
	}
	run := func() map[string]int {
		mu.Lock()
		clear(counts)
		mu.Unlock()
		d := &driver{targets: urls, client: newClient(), model: "m", rate: 1e6, seed: 3}
		for _, r := range d.run(context.Background(), w) {
			if r.Failed {
				t.Fatalf("request failed: %s", r.Err)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		return map[string]int{"0": counts["0"], "1": counts["1"], "2": counts["2"]}
	}
	first := run()
	for name, n := range first {
		if n < 70 || n > 130 {
			t.Errorf("server %s got %d of 300 requests, want about 100", name, n)
		}
	}
	if second := run(); fmt.Sprint(second) != fmt.Sprint(first) {
		t.Errorf("same seed split %v, then %v", first, second)
	}
}

// TestDriverRetriesUnanswered sends to a port nothing listens on yet: with retryUnanswered the
// request waits until a server answers there, and succeeds.
func TestDriverRetriesUnanswered(t *testing.T) {
	ports, err := freeport.Ports(1) // below the ephemeral range: no listener on port 0 takes it meanwhile
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", ports[0])
	d := &driver{targets: []string{"http://" + addr}, retryUnanswered: true, client: newClient(), model: "m", rate: 1e6, seed: 1}
	w := Workload{Sessions: []Session{{Requests: []Request{{Messages: []Message{{Role: "user", Content: "hi"}}, MaxTokens: 1}}}}}
	done := make(chan []requestResult)
	go func() { done <- d.run(context.Background(), w) }()
	time.Sleep(50 * time.Millisecond) // the request is refused meanwhile: this is what is tested
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("port %s taken meanwhile: %v", addr, err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n")
	})}
	go func() { _ = srv.Serve(l) }()
	defer srv.Close()
	res := <-done
	if len(res) != 1 || res[0].Failed {
		t.Fatalf("results %+v, want one successful request", res)
	}
	if res[0].TTFT < 40*time.Millisecond {
		t.Errorf("TTFT %s does not include the wait for the server", res[0].TTFT)
	}
}

// TestDriverSaysWhatFailed: a request answered other than 200 fails with what answered it: the
// status, the address, the Server header and the start of the body, no more of it than maxErrorBody.
func TestDriverSaysWhatFailed(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Server", "somebody-else")
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprint(w, `{"detail":"Not Found"}`+strings.Repeat("x", 1000))
	}))
	defer srv.Close()
	d := &driver{targets: []string{srv.URL}, client: newClient(), model: "m", rate: 1e6, seed: 1}
	w := Workload{Sessions: []Session{{Requests: []Request{{Messages: []Message{{Role: "user", Content: "hi"}}, MaxTokens: 1}}}}}
	res := d.run(context.Background(), w)
	if len(res) != 1 || !res[0].Failed || res[0].Status != http.StatusNotFound {
		t.Fatalf("results %+v, want one request failed with 404", res)
	}
	e := res[0].Err
	for _, want := range []string{"status 404", strings.TrimPrefix(srv.URL, "http://"), "somebody-else", `Not Found`} {
		if !strings.Contains(e, want) {
			t.Errorf("error %q lacks %q", e, want)
		}
	}
	if strings.Count(e, "x") > maxErrorBody {
		t.Errorf("error keeps %d bytes of the body, want at most %d", strings.Count(e, "x"), maxErrorBody)
	}
}

func TestInstancesMediansAndVerdict(t *testing.T) {
	setups := []frontSetup{{"one", 1, false}, {"shared", 3, true}, {"unshared", 3, false}}
	w := InstancesWorkload{Workload: "w"}
	add := func(setup string, hit, p50 float64) {
		w.Runs = append(w.Runs, InstancesRun{Setup: setup, Summary: Summary{CacheHitRate: hit, TTFTP50: p50, TTFTP99: 2 * p50}})
	}
	for _, v := range []float64{0.80, 0.70, 0.90} {
		add("one", v, 100*v)
		add("shared", v-0.02, 104*v)
		add("unshared", v/2, 300)
	}
	w.medians(setups)
	if len(w.Medians) != 3 {
		t.Fatalf("medians = %+v", w.Medians)
	}
	if m := w.Medians[0]; m.CacheHitRate != 0.8 || m.TTFTP50 != 80 {
		t.Errorf("median of one = %+v, want hit 0.8, p50 80", m)
	}
	v := instancesVerdicts(InstancesResults{Workloads: []InstancesWorkload{w}})
	if len(v) != 1 || !strings.Contains(v[0], ": PASS") {
		t.Errorf("verdict = %q, want PASS (97.5%% of the hit rate, p50 1.04x)", v)
	}
}

func TestRestartWorkloadSize(t *testing.T) {
	for _, name := range []string{"shared-prefix", "multi-turn"} {
		w, err := restartWorkload(name, 1, 1000)
		if err != nil {
			t.Fatal(err)
		}
		if n := len(w.Sessions); n < 1000 || n > 1064 {
			t.Errorf("%s: %d sessions, want 1000 (shared-prefix: up to a group more)", name, n)
		}
	}
	if _, err := restartWorkload("mixed", 1, 10); err == nil {
		t.Error("restartWorkload(mixed) succeeded, want an error")
	}
}
