package caddyllm

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/tokenrouter/caddy-llm/selection"
	"github.com/tokenrouter/caddy-llm/share/redistest"
)

func TestUnmarshalStateOptions(t *testing.T) {
	d := caddyfile.NewTestDispenser(`llm {
		persist 10s {
			key gpu-pool-a
		}
		share rediss://user:secret@redis.internal:6380/2 {
			prefix pool-a:
			flush_interval 50ms
			max_batch 512
		}
	}`)
	var s LLMSelection
	if err := s.UnmarshalCaddyfile(d); err != nil {
		t.Fatalf("UnmarshalCaddyfile() error = %v", err)
	}
	if p := s.Persist; p == nil || time.Duration(p.Interval) != 10*time.Second || p.Key != "gpu-pool-a" {
		t.Errorf("Persist = %+v", p)
	}
	if sh := s.Share; sh == nil || sh.URL != "rediss://user:secret@redis.internal:6380/2" || sh.Prefix != "pool-a:" ||
		time.Duration(sh.FlushInterval) != 50*time.Millisecond || sh.MaxBatch != 512 {
		t.Errorf("Share = %+v", sh)
	}

	for input, want := range map[string]string{
		"llm {\n persist 1s 2s\n}":                         "wrong argument count",
		"llm {\n persist nope\n}":                          "persist interval must be a positive duration",
		"llm {\n persist\n persist\n}":                     "persist already specified",
		"llm {\n persist {\n color red\n }\n}":             "unrecognized persist option 'color'",
		"llm {\n share\n}":                                 "wrong argument count",
		"llm {\n share redis://a:1 {\n x 1\n }\n}":         "unrecognized share option 'x'",
		"llm {\n share redis://a:1\n share redis://b:1\n}": "share already specified",
	} {
		var s LLMSelection
		err := s.UnmarshalCaddyfile(caddyfile.NewTestDispenser(input))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("UnmarshalCaddyfile(%q) error = %v, want %q", input, err, want)
		}
	}
	bad := LLMSelection{}
	bad.Share = &ShareConfig{URL: "http://not-redis"}
	if err := bad.Share.provision(); err == nil {
		t.Error("provision(http URL) succeeded, want an error")
	}
}

// TestShareProcesses runs two Caddy processes sharing through a real redis-server. Turns of each
// conversation alternate between them and all land on one upstream, each turn after the first chosen by
// affinity or pin. Redis is killed mid-test: no request fails and both say they are disconnected (log,
// /llm/state, caddy_llm_share_connected); Redis restarted: sharing resumes.
func TestShareProcesses(t *testing.T) {
	srv := redistest.Start(t)
	ups := []*backend{newBackend(t), newBackend(t), newBackend(t)}
	cfg := processConfig("share "+srv.URL()+" {\n\t\t\t\tflush_interval 20ms\n\t\t\t}", ups...)
	caddies := []*caddyProcess{startCaddyProcess(t, t.TempDir(), cfg), startCaddyProcess(t, t.TempDir(), cfg)}
	client := &http.Client{Timeout: 10 * time.Second}
	for _, c := range caddies {
		waitState(t, c, "connected", func(s stateResponse) bool { return s.Tables[0].Share.Connected })
	}

	// converse sends turns 1..turns of conversations [from, to), turn i to caddies[(i+id)%2]. With wait,
	// each request waits until the other instance has imported what it taught.
	converse := func(from, to, turns int, wait bool) {
		t.Helper()
		for id := from; id < to; id++ {
			first := ""
			for turn := 1; turn <= turns; turn++ {
				c, other := caddies[(turn+id)%2], caddies[(turn+id+1)%2]
				imported := adminState(t, other.Admin).Tables[0].Share.ImportedChanges
				up, reason, err := c.post(client, conversationTurn(id, turn), fmt.Sprint("conv-", id))
				if err != nil {
					t.Fatalf("conversation %d turn %d: %v", id, turn, err)
				}
				if turn == 1 {
					first = up
				} else if wait {
					if up != first {
						t.Errorf("conversation %d turn %d went to %s, want %s like turn 1", id, turn, up, first)
					}
					if reason != "conversation" && reason != "affinity" {
						t.Errorf("conversation %d turn %d: reason %q, want conversation or affinity", id, turn, reason)
					}
				}
				if wait {
					waitState(t, other, "the other instance to import", func(s stateResponse) bool {
						return s.Tables[0].Share.ImportedChanges > imported
					})
				}
			}
		}
	}
	converse(0, 6, 4, true)
	for _, c := range caddies {
		if s := adminState(t, c.Admin).Tables[0]; s.RemoteRoutes == 0 {
			t.Errorf("/llm/state = %+v, want remote routes", s)
		}
	}
	// A third instance started now prices the upstreams at the speeds the others learned (their service
	// models, published beside the routes) before it has relayed a single request.
	late := startCaddyProcess(t, t.TempDir(), cfg)
	waitState(t, late, "connected", func(s stateResponse) bool { return s.Tables[0].Share.Connected })
	if n := adminState(t, late.Admin).Tables[0].Share.PeerModels; n != 2 {
		t.Errorf("late instance: peer_models = %d, want the 2 others' (%s)", n, late.Logs())
	}
	// (The others publish every 10 s, the first time as soon as they have learned anything: the summaries
	// cover at least the first upstream each learned.)
	learned := 0
	for up, u := range adminUpstreamsAt(t, late.Admin) {
		switch {
		case u.InflightRequests > 0 || u.Model == nil:
		case u.Model.MeanDurationSeconds >= selection.Prior.MeanDuration:
			t.Errorf("late instance: %s has the prior %+v, want the others' learned model", up, *u.Model)
		default:
			learned++
		}
	}
	if learned == 0 {
		t.Errorf("late instance: no upstream has a learned model, want the others' (%s)", late.Logs())
	}
	late.kill()

	srv.Kill()
	converse(6, 12, 4, false) // no request may fail while Redis is down
	for _, c := range caddies {
		waitState(t, c, "disconnected", func(s stateResponse) bool { return !s.Tables[0].Share.Connected })
		if m := metricsText(t, c.Admin); !strings.Contains(m, "caddy_llm_share_connected 0") {
			t.Errorf("metrics while Redis is down lack caddy_llm_share_connected 0")
		}
		if n := strings.Count(c.Logs(), "share: redis unavailable"); n != 1 {
			t.Errorf("log lines about Redis being unavailable = %d, want 1", n)
		}
	}

	srv.Restart()
	for _, c := range caddies {
		waitState(t, c, "reconnected", func(s stateResponse) bool { return s.Tables[0].Share.Connected })
		if m := metricsText(t, c.Admin); !strings.Contains(m, "caddy_llm_share_connected 1") {
			t.Errorf("metrics after Redis restarted lack caddy_llm_share_connected 1")
		}
	}
	converse(12, 16, 4, true)
}

// waitState polls an instance's /llm/state until cond holds (the state arrives through Redis from
// another process: no clock in the test controls it).
func waitState(t *testing.T, c *caddyProcess, what string, cond func(stateResponse) bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond(adminState(t, c.Admin)) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s: %+v\n%s", what, adminState(t, c.Admin), c.Logs())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func metricsText(t *testing.T, admin string) string {
	t.Helper()
	res, err := http.Get(admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return string(b)
}

// TestRestorePeerModels: a new instance takes the service models other instances published, the newest
// instance's model of an upstream first; an upstream it has learned itself keeps its own, and a summary
// it cannot read is one warning, not a failure.
func TestRestorePeerModels(t *testing.T) {
	publisher := func(seconds float64, dials ...string) []byte {
		lt := &loadTable{m: make(map[string]*upstreamLoad)}
		for _, d := range dials {
			for range 20 {
				lt.entry(d, 1).model.ObserveEnd(1000, 100, 0, seconds)
			}
		}
		return lt.sharedModels()
	}
	if empty := (&loadTable{m: make(map[string]*upstreamLoad)}).sharedModels(); empty != nil {
		t.Errorf("sharedModels() of nothing learned = %q, want nil (nothing published)", empty)
	}
	newer := publisher(9, "10.0.0.1:8000")
	older := publisher(2, "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
	want := func(blob []byte, dial string) selection.ModelState {
		var f modelsFile
		if err := json.Unmarshal(blob, &f); err != nil {
			t.Fatal(err)
		}
		return f.Upstreams[dial].Model
	}

	lt := &loadTable{m: make(map[string]*upstreamLoad)}
	for range 3 {
		lt.entry("10.0.0.3:8000", 1).model.ObserveEnd(500, 10, 0, 0.5) // learned here
	}
	own := lt.lookup("10.0.0.3:8000").model.State()
	core, logs := observer.New(zap.InfoLevel)
	lt.restorePeerModels([][]byte{newer, []byte("not a summary"), older}, zap.New(core))
	if got := lt.lookup("10.0.0.1:8000").model.State(); !reflect.DeepEqual(got, want(newer, "10.0.0.1:8000")) {
		t.Errorf("10.0.0.1 took %+v, want the newest instance's model", got)
	}
	if got := lt.lookup("10.0.0.2:8000").model.State(); !reflect.DeepEqual(got, want(older, "10.0.0.2:8000")) {
		t.Errorf("10.0.0.2 took %+v, want the older instance's model (the newest has none)", got)
	}
	if got := lt.lookup("10.0.0.3:8000").model.State(); !reflect.DeepEqual(got, own) {
		t.Errorf("10.0.0.3 took %+v, want its own model kept", got)
	}
	if n := logs.FilterMessage("share: restored service models from other instances").Len(); n != 1 {
		t.Errorf("restore log lines = %d, want 1: %v", n, logs.All())
	}
	if n := logs.FilterMessageSnippet("not restored").Len(); n != 1 {
		t.Errorf("warnings = %d, want 1 for the unreadable summary: %v", n, logs.All())
	}
}
