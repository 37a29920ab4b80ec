package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

// instancesTimeScale is -instances' time scale unless -timescale sets one: real time (see parseOptions).
const instancesTimeScale = 1

// -instances N: N Caddy processes behind a random splitter (the load driver picks an instance per
// request uniformly at random, like a DNS round robin or an L4 balancer) in front of the same simulated
// backends, with the bare llm policy: one instance, N sharing through a real redis-server, and N
// unshared. The question is issue 11's: does sharing through Redis give N instances the hit rate and
// TTFT of one?

// instancesWorkloads are the workloads of -instances and -restart unless -workloads names others.
var instancesWorkloads = []string{"shared-prefix", "multi-turn"}

// frontSetup is one arrangement of Caddy instances in front of the backends.
type frontSetup struct {
	Name      string
	Instances int
	Share     bool
}

// InstancesRun is one setup's figures on one workload with one seed.
type InstancesRun struct {
	Setup     string `json:"setup"`
	Instances int    `json:"instances"`
	Share     bool   `json:"share"`
	Seed      int64  `json:"seed"`
	Summary
	// BackendsPerConversation is the mean number of backends the measured requests of a conversation
	// (multi-turn) or group (shared-prefix) reached, over those with two requests or more: 1 when
	// every instance agrees where each goes.
	BackendsPerConversation float64 `json:"backends_per_conversation"`
	// From each instance's /llm/state at the end of the run.
	Routes           []int    `json:"routes"`
	RemoteRoutes     []int    `json:"remote_routes"`
	ImportedChanges  []uint64 `json:"imported_changes,omitempty"`
	PublishedChanges []uint64 `json:"published_changes,omitempty"`
	PublishedBytes   []uint64 `json:"published_bytes,omitempty"`
	DroppedChanges   []uint64 `json:"dropped_changes,omitempty"`
}

// InstancesWorkload is every setup's figures on one workload: every run, and per setup the medians
// over the seeds.
type InstancesWorkload struct {
	Workload string            `json:"workload"`
	Requests int               `json:"requests"`
	Warmup   int               `json:"warmup_requests"`
	RateRPS  float64           `json:"rate_rps"`
	Runs     []InstancesRun    `json:"runs"`
	Medians  []InstancesMedian `json:"medians"`
	Notes    []string          `json:"notes,omitempty"`
}

// InstancesMedian is one setup's medians over the seeds (failures are summed).
type InstancesMedian struct {
	Setup        string  `json:"setup"`
	Instances    int     `json:"instances"`
	Share        bool    `json:"share"`
	CacheHitRate float64 `json:"cache_hit_rate"`
	TTFTP50      float64 `json:"ttft_p50_ms"`
	TTFTP99      float64 `json:"ttft_p99_ms"`
	Failed       int     `json:"failed"`
	RemoteRoutes []int   `json:"remote_routes"` // of the first seed's run
	// BackendsPerConversation: see InstancesRun.
	BackendsPerConversation float64 `json:"backends_per_conversation"`
	LagP99                  float64 `json:"sched_lag_p99_wall_ms"`
}

// medians fills w.Medians from w.Runs, one entry per setup in the order setups ran.
func (w *InstancesWorkload) medians(setups []frontSetup) {
	w.Medians = nil
	for _, s := range setups {
		m := InstancesMedian{Setup: s.Name, Instances: s.Instances, Share: s.Share}
		var hit, p50, p99, lag, spread []float64
		for _, r := range w.Runs {
			if r.Setup != s.Name {
				continue
			}
			if m.RemoteRoutes == nil {
				m.RemoteRoutes = r.RemoteRoutes
			}
			hit, p50, p99, lag = append(hit, r.CacheHitRate), append(p50, r.TTFTP50), append(p99, r.TTFTP99), append(lag, r.LagP99)
			m.Failed += r.Failed
			spread = append(spread, r.BackendsPerConversation)
		}
		if len(hit) == 0 {
			continue
		}
		m.CacheHitRate, m.TTFTP50, m.TTFTP99, m.LagP99 = round3(median(hit)), round3(median(p50)), round3(median(p99)), round3(median(lag))
		m.BackendsPerConversation = round3(median(spread))
		w.Medians = append(w.Medians, m)
	}
}

// InstancesResults is the content of instances.json.
type InstancesResults struct {
	Command string `json:"command"`
	Started string `json:"started"`
	Machine string `json:"machine"`
	Seed    int64  `json:"seed"`
	// Policy is the llm variant every instance ran, Seeds how many seeds each setup ran with.
	Policy string `json:"policy"`
	Seeds  int    `json:"seeds"`
	// Instances is N; ShareFlush the share flush_interval (wall time) the shared instances used.
	Instances   int                 `json:"instances"`
	ShareFlush  string              `json:"share_flush_interval"`
	Backends    int                 `json:"backends"`
	Load        float64             `json:"load"`
	Sim         simSettings         `json:"sim"`
	Workloads   []InstancesWorkload `json:"workloads"`
	WallSeconds float64             `json:"wall_seconds"`
	Notes       []string            `json:"notes,omitempty"`
}

// shareFlush is the share flush_interval of the benchmark's instances: 100 ms simulated (the default
// on real GPUs) in wall time, unless -share-flush sets it; like the scrape interval, an unscaled
// 100 ms would be timeScale times slower against the simulated request rate than in a deployment.
func (o options) shareFlushInterval() time.Duration {
	if o.shareFlush > 0 {
		return o.shareFlush
	}
	return time.Duration(float64(100*time.Millisecond) / max(o.sim.TimeScale, 1))
}

// runInstancesMode runs -instances and writes instances.json and instances.md.
func runInstancesMode(ctx context.Context, o options, args []string, started time.Time) error {
	tmp, err := os.MkdirTemp("", "caddy-llm-instances-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	fmt.Fprintln(os.Stderr, "building cmd/caddy ...")
	bin, err := buildCaddyBinary(tmp)
	if err != nil {
		return err
	}
	rds, err := startRedis(tmp)
	if err != nil {
		return err
	}
	defer rds.stop()

	res := InstancesResults{
		Command: "go run ./bench " + strings.Join(args, " "), Started: started.UTC().Format(time.RFC3339),
		Machine: machine(), Seed: o.seed, Policy: o.policies[0].Name, Seeds: o.seeds, Instances: o.instances, ShareFlush: o.shareFlushInterval().String(),
		Backends: o.backends, Load: o.load, Sim: o.sim,
	}
	var setups []frontSetup
	for _, s := range []frontSetup{{"one", 1, false}, {"shared", o.instances, true}, {"unshared", o.instances, false}} {
		if slices.Contains(o.setups, s.Name) {
			setups = append(setups, s)
		}
	}
	sims := uniformCluster(o.backends, o.sim)
	total := 0
	for _, name := range o.workloads {
		w, err := generateWorkload(name, o.seed, o.size())
		if err != nil {
			return err
		}
		total += w.NumRequests() * len(setups) * o.seeds
	}
	prog := newProgress(os.Stderr, total)
	runs := 0
	for _, name := range o.workloads {
		var iw InstancesWorkload
		for seed := o.seed; seed < o.seed+int64(o.seeds); seed++ {
			w, err := generateWorkload(name, seed, o.size())
			if err != nil {
				return err
			}
			est := estimateCapacity(w, sims)
			iw.Workload, iw.Requests, iw.Warmup, iw.RateRPS = w.Name, w.NumRequests(), warmupCount(w.NumRequests()), o.load*est.ClusterRPS
			so := o
			so.seed = seed
			for _, s := range setups {
				label := fmt.Sprintf("%s/%s seed %d", w.Name, s.Name, seed)
				prog.setLabel(label)
				runs++
				prefix := fmt.Sprintf("bench-%d:", runs) // a fresh stream per run
				run, err := runFront(ctx, so, sims, w, iw.RateRPS, bin, tmp, s, rds.url(), prefix, prog)
				if err != nil {
					return fmt.Errorf("%s: %w", label, err)
				}
				run.Seed = seed
				if run.LagP99 > lagRerunMS {
					iw.Notes = append(iw.Notes, fmt.Sprintf("%s, seed %d: scheduling lag p99 %.1f ms (wall): the machine was busy", s.Name, seed, run.LagP99))
				}
				iw.Runs = append(iw.Runs, run)
				prog.stepDone(fmt.Sprintf("%s: TTFT p50 %.0f ms, hit rate %.1f%%", label, run.TTFTP50, 100*run.CacheHitRate))
			}
		}
		iw.medians(setups)
		res.Workloads = append(res.Workloads, iw)
	}
	prog.finish()
	res.WallSeconds = round3(time.Since(started).Seconds())
	writeInstancesTable(os.Stdout, res)
	js, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	var md strings.Builder
	writeInstancesMarkdown(&md, res)
	if err := writeFiles(o.out, map[string][]byte{"instances.json": append(js, '\n'), "instances.md": []byte(md.String())}); err != nil {
		return err
	}
	fmt.Printf("\nwall time %.1fs; results in %s\n", time.Since(started).Seconds(), filepath.Join(o.out, "instances.md"))
	return nil
}

// runFront runs workload w at rate (requests per simulated second) through setup's Caddy processes in
// front of fresh simulators, the driver splitting requests among the instances at random.
func runFront(ctx context.Context, o options, sims []simSettings, w Workload, rate float64, bin, tmp string,
	setup frontSetup, redisURL, prefix string, prog *progress) (InstancesRun, error) {
	run := InstancesRun{Setup: setup.Name, Instances: setup.Instances, Share: setup.Share}
	c, err := startCluster(sims, o.seed, w.Name)
	if err != nil {
		return run, err
	}
	defer c.close()
	p := scalePrior(scaleScrapes(o.policies[0], o.sim.TimeScale), o.sim.TimeScale, c.dials, c.prefillSpeeds())
	if setup.Share {
		p = withOption(p, "share", map[string]any{"url": redisURL, "prefix": prefix, "flush_interval": o.shareFlushInterval().String()})
	}
	procs := make([]*caddyProcess, setup.Instances)
	for i := range procs {
		dir, err := os.MkdirTemp(tmp, "caddy-")
		if err != nil {
			return run, err
		}
		if procs[i], err = newCaddyProcess(bin, dir, c.dials, p); err != nil {
			return run, err
		}
	}
	defer func() {
		for _, pr := range procs {
			pr.kill()
		}
	}()
	// Start together: each shared instance warms up from Redis (at most 2 s) in its Provision.
	errs := make([]error, len(procs))
	var wg sync.WaitGroup
	for i, pr := range procs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = pr.start(ctx) }()
	}
	wg.Wait()
	var urls []string
	for i, pr := range procs {
		if errs[i] != nil {
			return run, errs[i]
		}
		urls = append(urls, pr.URL)
	}

	client := newClient()
	defer client.CloseIdleConnections()
	before := c.states()
	d, measured := c.measuredDriver(client, w, rate, o, prog)
	d.targets = urls
	start, cpuStart := time.Now(), processCPU()
	results := d.run(ctx, w)
	wall, cpu := time.Since(start), processCPU()-cpuStart
	after := c.states()
	for _, pr := range procs {
		st, err := pr.state()
		if err != nil {
			return run, err
		}
		run.Routes = append(run.Routes, st.Routes)
		run.RemoteRoutes = append(run.RemoteRoutes, st.RemoteRoutes)
		if sh := st.Share; sh != nil {
			run.ImportedChanges = append(run.ImportedChanges, sh.ImportedChanges)
			run.PublishedChanges = append(run.PublishedChanges, sh.PublishedChanges)
			run.PublishedBytes = append(run.PublishedBytes, sh.PublishedBytes)
			run.DroppedChanges = append(run.DroppedChanges, sh.DroppedChanges+st.FeedDropped)
		}
	}
	for _, pr := range procs {
		if err := pr.stop(); err != nil {
			return run, err
		}
	}
	s := summarize(setup.Name, results, o.sim.TimeScale)
	s.WallSeconds = round3(wall.Seconds())
	s.CPUPercent = round3(100 * cpu.Seconds() / wall.Seconds()) // the bench process only: Caddy runs apart
	s.CacheHitRate = hitRate(measured(), after)
	for i := range after {
		s.BackendRequests = append(s.BackendRequests, int(after[i].Requests-before[i].Requests))
	}
	run.Summary = s
	run.BackendsPerConversation = backendsPerConversation(results)
	return run, nil
}

// backendsPerConversation is the mean number of distinct backends the measured, answered requests of
// each conversation reached, over conversations with at least two of them.
func backendsPerConversation(results []requestResult) float64 {
	seen := map[string]map[string]bool{}
	requests := map[string]int{}
	for _, r := range results {
		if r.Warmup || r.Failed || r.Upstream == "" || r.Conversation == "" {
			continue
		}
		if seen[r.Conversation] == nil {
			seen[r.Conversation] = map[string]bool{}
		}
		seen[r.Conversation][r.Upstream] = true
		requests[r.Conversation]++
	}
	sum, n := 0, 0
	for conv, ups := range seen {
		if requests[conv] >= 2 {
			sum += len(ups)
			n++
		}
	}
	if n == 0 {
		return 0
	}
	return round3(float64(sum) / float64(n))
}

// hitRate is the backends' prefix-cache hit rate between two readings of their counters.
func hitRate(from, to []vllmsim.State) float64 {
	var hits, queries int64
	for i := range to {
		hits += to[i].PrefixHits - from[i].PrefixHits
		queries += to[i].PrefixQueries - from[i].PrefixQueries
	}
	if queries == 0 {
		return 0
	}
	return round3(float64(hits)/float64(queries)*1e3) / 1e3
}

// writeInstancesTable prints one table per workload: each setup's hit rate and TTFT, with the ratios
// of the target (shared against one instance).
func writeInstancesTable(out io.Writer, res InstancesResults) {
	for _, w := range res.Workloads {
		fmt.Fprintf(out, "\n%s (%d requests, %.1f req/s simulated, random splitter over the instances)\n", w.Workload, w.Requests, w.RateRPS)
		tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
		for _, row := range instancesRows(w) {
			fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
		}
		tw.Flush()
		for _, n := range w.Notes {
			fmt.Fprintf(out, "  note: %s\n", n)
		}
	}
	fmt.Fprintln(out)
	for _, v := range instancesVerdicts(res) {
		fmt.Fprintln(out, v)
	}
}

// instancesRows is a workload's table: header, then one row per setup.
func instancesRows(w InstancesWorkload) [][]string {
	rows := [][]string{{"setup", "instances", "hit rate", "hit vs one", "TTFT p50 ms", "p50 vs one", "TTFT p99 ms", "p99 vs one", "backends per conv.", "failed", "remote routes", "lag p99 ms"}}
	one, ok := w.median("one")
	for _, r := range w.Medians {
		hit, p50, p99 := "-", "-", "-"
		if ok {
			hit = fmt.Sprintf("%.1f%%", 100*r.CacheHitRate/one.CacheHitRate)
			p50, p99 = ratio(r.TTFTP50, one.TTFTP50), ratio(r.TTFTP99, one.TTFTP99)
		}
		remote := "-"
		if len(r.RemoteRoutes) > 1 {
			remote = joinInts(r.RemoteRoutes)
		}
		rows = append(rows, []string{r.Setup, fmt.Sprint(r.Instances), fmt.Sprintf("%.1f%%", 100*r.CacheHitRate), hit,
			f0(r.TTFTP50), p50, f0(r.TTFTP99), p99, fmt.Sprintf("%.2f", r.BackendsPerConversation), fmt.Sprint(r.Failed), remote, f1(r.LagP99)})
	}
	return rows
}

func (w InstancesWorkload) median(setup string) (InstancesMedian, bool) {
	for _, m := range w.Medians {
		if m.Setup == setup {
			return m, true
		}
	}
	return InstancesMedian{}, false
}

// instancesVerdicts judges the target of issue 11 per workload: shared reaches at least 95% of one
// instance's hit rate, and its TTFT p50 is at most 1.1x one instance's.
func instancesVerdicts(res InstancesResults) []string {
	var out []string
	for _, w := range res.Workloads {
		one, ok1 := w.median("one")
		sh, ok2 := w.median("shared")
		un, ok3 := w.median("unshared")
		if !ok1 || !ok2 || !ok3 || one.CacheHitRate == 0 || one.TTFTP50 == 0 {
			continue
		}
		hit, p50 := sh.CacheHitRate/one.CacheHitRate, sh.TTFTP50/one.TTFTP50
		verdict := "PASS"
		if hit < 0.95 || p50 > 1.1 || sh.Failed > 0 {
			verdict = "MISS"
		}
		out = append(out, fmt.Sprintf("%s: shared hit rate %.0f%% of one instance's (unshared %.0f%%), TTFT p50 %.2fx (unshared %.2fx): %s (target >= 95%%, <= 1.10x)",
			w.Workload, 100*hit, 100*un.CacheHitRate/one.CacheHitRate, p50, un.TTFTP50/one.TTFTP50, verdict))
	}
	return out
}

// writeInstancesMarkdown writes instances.md.
func writeInstancesMarkdown(md *strings.Builder, res InstancesResults) {
	fmt.Fprintf(md, "# Several Caddy instances: shared, unshared and one\n\n")
	fmt.Fprintf(md, "`%s` (started %s; %s; wall time %.0f s)\n\n", res.Command, res.Started, res.Machine, res.WallSeconds)
	fmt.Fprintf(md, "%d backends (%s), offered load %.2f of the estimated capacity, seeds %d-%d. Each setup runs `%s` "+
		"(scrapes scaled to 1 s simulated unless it sets them) in separate Caddy processes built from `cmd/caddy`; the load driver "+
		"sends each request to an instance picked uniformly at random. `shared` instances use `share` through a redis-server the "+
		"benchmark starts on 127.0.0.1, flush_interval %s of wall time at time scale %g (the default 100 ms is scaled like the "+
		"scrapes unless -share-flush sets it). Hit rate is the backends' own prefix-cache hit rate; TTFT in simulated ms; the first "+
		"%.0f%% of requests are warm-up. Tables show medians over the seeds.\n\n",
		res.Backends, res.Sim.describe(), res.Load, res.Seed, res.Seed+int64(res.Seeds)-1, res.Policy, res.ShareFlush, res.Sim.TimeScale, 100*warmupFraction)
	for _, v := range instancesVerdicts(res) {
		fmt.Fprintf(md, "- %s\n", v)
	}
	for _, w := range res.Workloads {
		fmt.Fprintf(md, "\n## %s\n\n%d requests, %.1f req/s (simulated). Medians over %d seeds:\n\n", w.Workload, w.Requests, w.RateRPS, res.Seeds)
		writeMarkdownTable(md, instancesRows(w))
		fmt.Fprintf(md, "\nEvery run (hit rate, TTFT p50 / p99 ms):\n\n")
		for _, r := range w.Runs {
			fmt.Fprintf(md, "- seed %d, %s: %.1f%%, %.0f / %.0f; requests per backend %s; %.2f backends per conversation", r.Seed, r.Setup,
				100*r.CacheHitRate, r.TTFTP50, r.TTFTP99, joinInts(r.BackendRequests), r.BackendsPerConversation)
			if r.Share {
				fmt.Fprintf(md, "; per instance: published %s changes (%s bytes), imported %s, dropped %s, routes %s (remote %s)",
					joinU(r.PublishedChanges), joinU(r.PublishedBytes), joinU(r.ImportedChanges), joinU(r.DroppedChanges), joinInts(r.Routes), joinInts(r.RemoteRoutes))
			}
			fmt.Fprintln(md)
		}
		for _, n := range w.Notes {
			fmt.Fprintf(md, "- %s\n", n)
		}
	}
	for _, n := range res.Notes {
		fmt.Fprintf(md, "- %s\n", n)
	}
}

// writeMarkdownTable writes rows (the first is the header) as a markdown table.
func writeMarkdownTable(md io.Writer, rows [][]string) {
	for i, row := range rows {
		if i == 0 {
			writeTableHeader(md, row)
			continue
		}
		fmt.Fprintf(md, "| %s |\n", strings.Join(row, " | "))
	}
}

// writeTableHeader writes a markdown table's header row and the rule under it.
func writeTableHeader(out io.Writer, columns []string) {
	fmt.Fprintf(out, "| %s |\n|%s\n", strings.Join(columns, " | "), strings.Repeat("---|", len(columns)))
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, "/")
}

func joinU(v []uint64) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, "/")
}

// writeFiles writes each named file into dir.
func writeFiles(dir string, files map[string][]byte) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("creating output dir: %w", err)
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			return fmt.Errorf("writing %s: %w", name, err)
		}
	}
	return nil
}
