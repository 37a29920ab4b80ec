package main

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

// -restart: one Caddy process with the bare llm policy learns under load for a simulated minute, is
// measured for a minute, is stopped gracefully (SIGINT) and started again from the same storage, and the
// backends' hit rate in the first simulated minute after the restart is compared with the minute before:
// with `persist` (the snapshot written at the stop is restored at the start), with `share` (the new
// process warms up from the Redis the stopped one published to, as a new instance joining would) and
// without (the new process starts empty), as -restart-keep lists. New requests are held while Caddy is
// down (see runRestart). The backends keep their caches throughout: what a restart can lose is only the
// knowledge of where the prefixes are.

// restartWindow is the measuring window in simulated time.
const restartWindow = time.Minute

// RestartPoint is the hit rate of one interval of a restart run.
type RestartPoint struct {
	// T is the end of the interval in simulated seconds since the restarted Caddy answered (negative
	// before the stop). The interval that holds the restart is left out.
	T       float64 `json:"t_s"`
	HitRate float64 `json:"hit_rate"`
	// TTFTP99 is the TTFT p99 (simulated ms) of the requests sent in the interval; 0 when none was.
	TTFTP99 float64 `json:"ttft_p99_ms"`
}

// RestartRun is one restart, its learned state carried over as Keep says.
type RestartRun struct {
	Regime   string `json:"regime"`
	Workload string `json:"workload"`
	Persist  bool   `json:"persist"`
	// Keep is what carries the learned state over the restart: "persist" (storage), "share" (the
	// restarted process warms up from Redis, as a new instance joining would) or "none".
	Keep     string  `json:"keep"`
	RateRPS  float64 `json:"rate_rps"`
	Sessions int     `json:"sessions"`
	// HitBefore is the hit rate of the simulated minute before the stop, HitAfter of the first minute
	// after the restarted Caddy answered (requests that waited through the restart included).
	HitBefore float64 `json:"hit_rate_before"`
	HitAfter  float64 `json:"hit_rate_after"`
	// TTFT p50/p99 (simulated ms) of the requests sent in each window (requests held during the restart
	// are sent when it answers again).
	TTFTP50Before float64 `json:"ttft_p50_before_ms"`
	TTFTP99Before float64 `json:"ttft_p99_before_ms"`
	TTFTP50After  float64 `json:"ttft_p50_after_ms"`
	TTFTP99After  float64 `json:"ttft_p99_after_ms"`
	// TTFTP99First6 is the TTFT p99 of the requests sent in the first 6 simulated seconds after the
	// restarted Caddy answered, those held during the restart included (a fixed window: the series'
	// first interval ends at the next reading, anywhere from 0 to 6 s later).
	TTFTP99First6 float64 `json:"ttft_p99_first_6s_ms"`
	// DowntimeS is from the stop signal to the restarted Caddy answering, in simulated seconds; requests
	// were held meanwhile. Failed counts failed requests of the whole run but those its end cut short.
	DowntimeS      float64 `json:"downtime_s"`
	Failed         int     `json:"failed"`
	RoutesAtStop   int     `json:"routes_at_stop"`
	PinsAtStop     int     `json:"pins_at_stop"`
	RestoredRoutes int     `json:"restored_routes"`
	RestoredPins   int     `json:"restored_pins"`
	RestoredModels int     `json:"restored_models"`
	// PeerModels is, with share, how many instances' service models the restarted process found.
	PeerModels    int            `json:"peer_models,omitempty"`
	SnapshotBytes int            `json:"snapshot_bytes"`
	Series        []RestartPoint `json:"series"`
	Notes         []string       `json:"notes,omitempty"`
}

// RestartResults is the content of restart.json.
type RestartResults struct {
	Command     string       `json:"command"`
	Started     string       `json:"started"`
	Machine     string       `json:"machine"`
	Seed        int64        `json:"seed"`
	Backends    int          `json:"backends"`
	Load        float64      `json:"load"`
	Sim         simSettings  `json:"sim"`
	Runs        []RestartRun `json:"runs"`
	WallSeconds float64      `json:"wall_seconds"`
}

// runRestartMode runs -restart and writes restart.json and restart.md.
func runRestartMode(ctx context.Context, o options, args []string, started time.Time) error {
	tmp, err := os.MkdirTemp("", "caddy-llm-restart-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	fmt.Fprintln(os.Stderr, "building cmd/caddy ...")
	bin, err := buildCaddyBinary(tmp)
	if err != nil {
		return err
	}
	res := RestartResults{Command: "go run ./bench " + strings.Join(args, " "), Started: started.UTC().Format(time.RFC3339),
		Machine: machine(), Seed: o.seed, Backends: o.backends, Load: o.load, Sim: o.sim}
	sims, regimeName := uniformCluster(o.backends, o.sim), "default"
	if len(o.regimes) == 1 { // -regimes named one (parseOptions refuses more with -restart)
		sims, regimeName = o.regimes[0].build(o.backends, o.sim), o.regimes[0].Name
	}
	redisURL := ""
	if slices.Contains(o.restartKeep, "share") {
		rds, err := startRedis(tmp)
		if err != nil {
			return err
		}
		defer rds.stop()
		redisURL = "redis://" + rds.addr + "/0"
	}
	for _, name := range o.workloads {
		for _, keep := range o.restartKeep {
			fmt.Fprintf(os.Stderr, "%s, keep %s: %.0f s of wall time ...\n", name, keep, 3.2*restartWindow.Seconds()/o.sim.TimeScale)
			run, err := runRestart(ctx, o, sims, name, keep, redisURL, bin, tmp)
			if err != nil {
				return fmt.Errorf("%s restart (keep %s): %w", name, keep, err)
			}
			run.Regime = regimeName
			fmt.Fprintf(os.Stderr, "  hit rate %.1f%% before, %.1f%% after\n", 100*run.HitBefore, 100*run.HitAfter)
			res.Runs = append(res.Runs, run)
		}
	}
	res.WallSeconds = round3(time.Since(started).Seconds())
	writeRestartTable(os.Stdout, res)
	js, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	var md strings.Builder
	writeRestartMarkdown(&md, res)
	if err := writeFiles(o.out, map[string][]byte{"restart.json": append(js, '\n'), "restart.md": []byte(md.String())}); err != nil {
		return err
	}
	fmt.Printf("\nwall time %.1fs; results in %s\n", time.Since(started).Seconds(), filepath.Join(o.out, "restart.md"))
	return nil
}

// restartWorkload is the named workload long enough for a restart run: sessions sessions of the plain
// run's shape (shared-prefix: its 64 groups, more prompts each; multi-turn: more conversations).
func restartWorkload(name string, seed int64, sessions int) (Workload, error) {
	h := fnv.New64a()
	h.Write([]byte(name))
	rng := rand.New(rand.NewPCG(uint64(seed), h.Sum64()))
	switch name {
	case "shared-prefix":
		return sharedPrefix(rng, 64, (sessions+63)/64, 1500, 100, 64), nil
	case "multi-turn":
		return multiTurn(rng, sessions, 6, 10, 500, 150, 64), nil
	}
	return Workload{}, fmt.Errorf("-restart runs shared-prefix and multi-turn, not %q", name)
}

// runRestart runs one restart of one workload.
// keep is one of restartKeeps; with "share", the process shares through the Redis at redisURL under a
// key prefix of the workload's own (each workload runs share once: parseOptions refuses a repeated keep).
func runRestart(ctx context.Context, o options, sims []simSettings, name, keep, redisURL, bin, tmp string) (RestartRun, error) {
	persist := keep == "persist"
	run := RestartRun{Workload: name, Persist: persist, Keep: keep}
	shape, err := generateWorkload(name, o.seed, workloadSize{})
	if err != nil {
		return run, err
	}
	est := estimateCapacity(shape, sims)
	run.RateRPS = o.load * est.ClusterRPS
	turns := float64(shape.NumRequests()) / float64(len(shape.Sessions))
	sessionRate := run.RateRPS / turns // per simulated second
	window := time.Duration(float64(restartWindow) / o.sim.TimeScale)
	// Learn for a minute, measure a minute, restart, measure a minute; sessions for 4 minutes, so that
	// arrivals outlast the run even when the restart takes long. The run stops at the end of the last
	// window.
	w, err := restartWorkload(name, o.seed, int(sessionRate*4*restartWindow.Seconds()))
	if err != nil {
		return run, err
	}
	run.Sessions = len(w.Sessions)

	c, err := startCluster(sims, o.seed, "restart/"+w.Name)
	if err != nil {
		return run, err
	}
	defer c.close()
	p := scalePrior(scaleScrapes(o.policies[0], o.sim.TimeScale), o.sim.TimeScale, c.dials, c.prefillSpeeds())
	switch keep {
	case "persist":
		p = withOption(p, "persist", map[string]any{})
	case "share":
		p = withOption(p, "share", map[string]any{"url": redisURL, "prefix": "restart-" + name + "-", "flush_interval": o.shareFlushInterval().String()})
	}
	dir, err := os.MkdirTemp(tmp, "caddy-")
	if err != nil {
		return run, err
	}
	proc, err := newCaddyProcess(bin, dir, c.dials, p)
	if err != nil {
		return run, err
	}
	defer proc.kill()
	if err := proc.start(ctx); err != nil {
		return run, err
	}

	// The backends' counters every tenth of a window, for the series.
	type reading struct {
		at     time.Time
		states []vllmsim.State
	}
	var (
		mu       sync.Mutex
		readings []reading
	)
	read := func() reading { return reading{time.Now(), c.states()} }
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	client := newClient()
	defer client.CloseIdleConnections()
	g := new(gate)
	d := &driver{targets: []string{proc.URL}, retryUnanswered: true, gate: g, client: client, model: benchModel,
		rate: sessionRate * o.sim.TimeScale, timeScale: o.sim.TimeScale, seed: o.seed}
	var results []requestResult
	driven := make(chan struct{})
	go func() { results = d.run(runCtx, w); close(driven) }()
	tickerDone := make(chan struct{})
	go func() {
		defer close(tickerDone)
		t := time.NewTicker(window / 10)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				r := read()
				mu.Lock()
				readings = append(readings, r)
				mu.Unlock()
			case <-runCtx.Done():
				return
			}
		}
	}()
	sleep := func(d time.Duration) {
		select {
		case <-time.After(d):
		case <-ctx.Done():
		}
	}

	sleep(window) // learn
	b0 := read()
	sleep(window) // the minute before
	b1 := read()
	st, err := proc.state()
	if err != nil {
		return run, err
	}
	run.RoutesAtStop, run.PinsAtStop = st.Routes, st.Pins
	// Hold new requests and turns while Caddy is down: a restart takes 1-2 s of wall time here, which the
	// time scale would turn into 5-20 simulated seconds of backlog; the windows are about routing.
	g.close()
	stopAt := time.Now()
	if err := proc.stop(); err != nil {
		return run, err
	}
	if err := proc.start(ctx); err != nil {
		return run, err
	}
	a0 := read()
	mu.Lock()
	readings = append(readings, a0) // the series restarts here
	mu.Unlock()
	g.open()
	run.DowntimeS = round3(a0.at.Sub(stopAt).Seconds() * o.sim.TimeScale)
	if st, err = proc.state(); err != nil {
		return run, err
	}
	if st.Persist != nil {
		run.RestoredRoutes, run.RestoredPins, run.RestoredModels = st.Persist.RestoredRoutes, st.Persist.RestoredPins, st.Persist.RestoredModels
	}
	if st.Share != nil {
		run.PeerModels = st.Share.PeerModels
	}
	sleep(window) // the minute after
	a1 := read()
	select {
	case <-driven:
		run.Notes = append(run.Notes, "the workload ended before the last window did")
	default:
	}
	if st, err := proc.state(); err == nil && st.Persist != nil {
		run.SnapshotBytes = st.Persist.LastBytes
	}
	cancelAt := time.Now()
	cancel()
	<-driven
	<-tickerDone
	if err := proc.stop(); err != nil {
		return run, err
	}

	run.HitBefore, run.HitAfter = hitRate(b0.states, b1.states), hitRate(a0.states, a1.states)
	var before, after, first6 []requestResult
	first6End := a0.at.Add(time.Duration(float64(6*time.Second) / o.sim.TimeScale))
	for _, r := range results {
		switch {
		case r.Sent.After(b0.at) && r.Sent.Before(b1.at):
			before = append(before, r)
		case r.Sent.After(stopAt) && r.Sent.Before(a1.at):
			after = append(after, r)
			if r.Sent.Before(first6End) {
				first6 = append(first6, r)
			}
		}
		if r.Failed && r.End.Before(cancelAt) {
			run.Failed++ // not those the end of the run cut
		}
	}
	sb, sa := summarize("before", before, o.sim.TimeScale), summarize("after", after, o.sim.TimeScale)
	run.TTFTP50Before, run.TTFTP99Before, run.TTFTP50After, run.TTFTP99After = sb.TTFTP50, sb.TTFTP99, sa.TTFTP50, sa.TTFTP99
	run.TTFTP99First6 = summarize("first 6 s", first6, o.sim.TimeScale).TTFTP99
	if o.dump != "" {
		file := fmt.Sprintf("restart/%s/keep %s/seed %d", name, keep, o.seed)
		if err := dumpResults(filepath.Join(o.dump, dumpName(file, o.policies[0].Name)), results); err != nil {
			return run, err
		}
	}
	mu.Lock()
	for i := 1; i < len(readings); i++ {
		if readings[i].at.After(a1.at) {
			break
		}
		if readings[i].at.After(stopAt) && readings[i-1].at.Before(a0.at) {
			continue // the interval of the restart
		}
		var sent []requestResult
		for _, r := range results {
			if !r.Sent.Before(readings[i-1].at) && r.Sent.Before(readings[i].at) {
				sent = append(sent, r)
			}
		}
		run.Series = append(run.Series, RestartPoint{
			T:       round3(readings[i].at.Sub(a0.at).Seconds() * o.sim.TimeScale),
			HitRate: hitRate(readings[i-1].states, readings[i].states),
			TTFTP99: summarize("interval", sent, o.sim.TimeScale).TTFTP99,
		})
	}
	mu.Unlock()
	return run, nil
}

// restartRows is the table of every restart run.
func restartRows(res RestartResults) [][]string {
	rows := [][]string{{"regime", "workload", "keep", "hit before", "hit after", "after/before", "hit first <=6 s", "TTFT p50 before", "after", "TTFT p99 before", "after", "first <=6 s", "downtime s", "routes at stop", "restored", "failed"}}
	for _, r := range res.Runs {
		rel := "-"
		if r.HitBefore > 0 {
			rel = fmt.Sprintf("%.0f%%", 100*r.HitAfter/r.HitBefore)
		}
		first := "-"
		for _, p := range r.Series {
			if p.T > 0 {
				first = fmt.Sprintf("%.1f%%", 100*p.HitRate)
				break
			}
		}
		restored := "-"
		switch r.keep() {
		case "persist":
			restored = fmt.Sprintf("%d routes, %d pins, %d models", r.RestoredRoutes, r.RestoredPins, r.RestoredModels)
		case "share":
			restored = fmt.Sprintf("models of %d instances", r.PeerModels)
		}
		rows = append(rows, []string{r.Regime, r.Workload, r.keep(), fmt.Sprintf("%.1f%%", 100*r.HitBefore), fmt.Sprintf("%.1f%%", 100*r.HitAfter), rel, first,
			f0(r.TTFTP50Before), f0(r.TTFTP50After), f0(r.TTFTP99Before), f0(r.TTFTP99After), f0(r.TTFTP99First6), f1(r.DowntimeS),
			fmt.Sprintf("%d routes, %d pins", r.RoutesAtStop, r.PinsAtStop), restored, fmt.Sprint(r.Failed)})
	}
	return rows
}

func writeRestartTable(out io.Writer, res RestartResults) {
	fmt.Fprintln(out, "\nrestart under load: backends' hit rate in the simulated minute before the stop and the first after the restart")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	for _, row := range restartRows(res) {
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()
	for _, r := range res.Runs {
		for _, n := range r.Notes {
			fmt.Fprintf(out, "  note (%s, keep %s): %s\n", r.Workload, r.keep(), n)
		}
	}
}

func writeRestartMarkdown(md *strings.Builder, res RestartResults) {
	fmt.Fprintf(md, "# Restart under load, with and without persist\n\n")
	fmt.Fprintf(md, "`%s` (started %s; %s; wall time %.0f s)\n\n", res.Command, res.Started, res.Machine, res.WallSeconds)
	fmt.Fprintf(md, "%d backends (%s), offered load %.2f, seed %d. One Caddy process (built from `cmd/caddy`, the bare `lb_policy llm`, "+
		"with `persist` or without) learns for a simulated minute, is measured for a minute, is stopped with SIGINT and started again "+
		"from the same storage, and is measured for the first minute after it answers again. New sessions and turns are held while it "+
		"is down (the restart takes 1-2 s of wall time, which the time scale would turn into a backlog of 5-20 simulated seconds) and "+
		"the arrival schedule resumes where it stopped; requests refused meanwhile are retried every 10 ms. A simulated minute is %.0f s "+
		"of wall time at time scale %g. Hit rate is the backends' own prefix-cache hit rate; their caches survive the restart. TTFT in "+
		"simulated ms.\n\n",
		res.Backends, res.Sim.describe(), res.Load, res.Seed, restartWindow.Seconds()/res.Sim.TimeScale, res.Sim.TimeScale)
	writeMarkdownTable(md, restartRows(res))
	fmt.Fprintf(md, "\nHit rate and TTFT p99 (simulated ms) per 6 simulated seconds, the first interval after the restart from the moment it answered (t = 0) to the next reading:\n\n")
	for _, r := range res.Runs {
		var pts []string
		for _, p := range r.Series {
			pts = append(pts, fmt.Sprintf("%.0fs %.0f%% %.0f", p.T, 100*p.HitRate, p.TTFTP99))
		}
		fmt.Fprintf(md, "- %s %s, keep %s: %s\n", r.Regime, r.Workload, r.keep(), strings.Join(pts, ", "))
		for _, n := range r.Notes {
			fmt.Fprintf(md, "  - %s\n", n)
		}
	}
}

// restartKeeps are the ways -restart-keep can carry learned state over a restart.
var restartKeeps = []string{"persist", "share", "none"}

// keep is the run's Keep, or what Persist said in results written before Keep existed.
func (r RestartRun) keep() string {
	switch {
	case r.Keep != "":
		return r.Keep
	case r.Persist:
		return "persist"
	}
	return "none"
}
