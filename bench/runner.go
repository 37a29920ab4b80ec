package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/tokenrouter/caddy-llm/bench/internal/oracle"
	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
	"github.com/tokenrouter/caddy-llm/internal/freeport"
)

// benchModel is the model name the simulators serve and the requests name.
const benchModel = "bench-model"

// cluster is a set of simulated backends, each behind its own HTTP server on 127.0.0.1.
type cluster struct {
	sims    []*vllmsim.Server
	servers []*http.Server
	dials   []string
}

// prefillSpeeds returns each backend's prefill tokens a simulated second, in dials' order.
func (c *cluster) prefillSpeeds() []float64 {
	speeds := make([]float64, len(c.sims))
	for i, s := range c.sims {
		speeds[i] = s.Config().PrefillTokensPerSec
	}
	return speeds
}

// simBackend adapts a simulator to what the oracle reads.
type simBackend struct{ s *vllmsim.Server }

func (b simBackend) Load() oracle.Load {
	st := b.s.State()
	return oracle.Load{PendingPrefillTokens: st.PendingPrefillTokens, Requests: st.Running + st.Waiting}
}

func (b simBackend) Cached(body []byte) (int, int, error) { return b.s.Cached(body) }

// startCluster starts a fresh simulator (cold cache) per entry of sims and registers them with
// the oracle. Their ports are drawn from seed and run, which names the run (its workload, in the matrix
// its regime and seed too): Caddy's header policy hashes each upstream's address with the key, so which
// backend a conversation lands on, and how unevenly 80 conversations spread over four, followed the
// ports the kernel handed out, and header's figures moved from run to run of one seed by as much as any
// policy change (multi-turn-think p50 and p99 0.81x between two runs of seeds 1-3). Every policy of a
// run sees the same ports, and a run repeats.
func startCluster(sims []simSettings, seed int64, run string) (*cluster, error) {
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%s", seed, run)
	ls, err := freeport.Seeded(len(sims), h.Sum64())
	if err != nil {
		return nil, fmt.Errorf("listening for the backends: %w", err)
	}
	c := &cluster{}
	defer func() {
		for _, l := range ls[len(c.servers):] { // those not served (an error below)
			_ = l.Close()
		}
	}()
	for i, sim := range sims {
		s, err := vllmsim.New(vllmsim.Config{
			Model:               benchModel,
			MaxNumSeqs:          sim.MaxNumSeqs,
			MaxNumBatchedTokens: sim.MaxNumBatchedTokens,
			BlockSize:           sim.BlockSize,
			NumGPUBlocks:        sim.NumGPUBlocks,
			PrefillTokensPerSec: sim.PrefillTokensPerSec,
			DecodeStep:          sim.DecodeStep,
			DecodeStepPerSeq:    sim.DecodeStepPerSeq,
			AttentionTokens:     sim.AttentionTokens,
			DecodeStepPerKToken: sim.DecodeStepPerKToken,
			Schedule:            sim.Schedule,
			SeparatePrefill:     sim.SeparatePrefill,
			TimeScale:           sim.TimeScale,
			TokensPerChunk:      sim.TokensPerChunk,
			ErrorRate:           sim.ErrorRate,
			DropMidStreamRate:   sim.DropMidStreamRate,
			Metrics:             sim.Metrics,
			Seed:                seed + int64(i),
		})
		if err != nil {
			c.close()
			return nil, fmt.Errorf("starting simulator %d: %w", i, err)
		}
		c.sims = append(c.sims, s)
		c.serve(s, ls[i])
	}
	for i, d := range c.dials {
		oracle.Register(d, simBackend{c.sims[i]})
	}
	return c, nil
}

// serve puts h behind an HTTP server on l.
func (c *cluster) serve(h http.Handler, l net.Listener) {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ErrorLog: discardLog}
	go func() { _ = srv.Serve(l) }()
	c.servers = append(c.servers, srv)
	c.dials = append(c.dials, l.Addr().String())
}

// measuredDriver returns a driver of w's sessions at rate requests a simulated second (its target left
// to the caller), and the backends' states when its measured part began (before that, at the call).
func (c *cluster) measuredDriver(client *http.Client, w Workload, rate float64, o options, prog *progress) (*driver, func() []vllmsim.State) {
	var (
		mu       sync.Mutex
		measured = c.states()
	)
	turns := float64(w.NumRequests()) / float64(len(w.Sessions))
	d := &driver{
		client:    client,
		model:     benchModel,
		rate:      rate / turns * o.sim.TimeScale,
		timeScale: o.sim.TimeScale,
		seed:      o.seed,
		warmup:    warmupCount(w.NumRequests()),
		onMeasure: func() {
			st := c.states()
			mu.Lock()
			measured = st
			mu.Unlock()
		},
		onDone: func() { prog.add(1) },
	}
	return d, func() []vllmsim.State {
		mu.Lock()
		defer mu.Unlock()
		return measured
	}
}

// states returns every simulator's state.
func (c *cluster) states() []vllmsim.State {
	out := make([]vllmsim.State, len(c.sims))
	for i, s := range c.sims {
		out[i] = s.State()
	}
	return out
}

// close stops servers and simulators and unregisters them from the oracle.
func (c *cluster) close() {
	for _, d := range c.dials {
		oracle.Unregister(d)
	}
	for _, srv := range c.servers {
		_ = srv.Close()
	}
	for _, s := range c.sims {
		s.Close()
	}
}

// runWorkloads runs every selected workload with every selected policy.
func runWorkloads(ctx context.Context, o options, progressOut *os.File) ([]WorkloadResult, error) {
	size := o.size()
	var wls []Workload
	total := 0
	for _, name := range o.workloads {
		w, err := generateWorkload(name, o.seed, size)
		if err != nil {
			return nil, err
		}
		wls = append(wls, w)
		total += w.NumRequests() * len(o.policies)
	}
	prog := newProgress(progressOut, total)
	defer prog.finish()
	var out []WorkloadResult
	sims := uniformCluster(o.backends, o.sim)
	for _, w := range wls {
		out = append(out, runWorkload(ctx, o, sims, w, prog))
	}
	return out, nil
}

// runWorkload runs one workload with every selected policy on backends with the settings sims.
func runWorkload(ctx context.Context, o options, sims []simSettings, w Workload, prog *progress) WorkloadResult {
	est := estimateCapacity(w, sims)
	wr := WorkloadResult{
		Workload:    w.Name,
		Requests:    w.NumRequests(),
		Warmup:      warmupCount(w.NumRequests()),
		CapacityRPS: est.ClusterRPS,
		BackendRPS:  est.BackendRPS,
		RateRPS:     o.load * est.ClusterRPS,
	}
	wr.Notes = append(wr.Notes, fmt.Sprintf("capacity estimate: mean prompt %.0f tokens, %.0f to prefill with an ideal cache, %.0f output, decode batch %.0f: %.2f req/s per backend",
		est.MeanPrompt, est.MeanUncached, est.MeanOutput, est.Batch, est.PerBackendRPS))
	if est.CachedSessions > 0 {
		wr.Notes = append(wr.Notes, fmt.Sprintf("the KV caches hold the context of %.0f%% of the sessions in flight at that rate: the ideal cache re-prefills the others' own history each turn", 100*est.CachedSessions))
	}
	if o.bypassRate > 0 {
		wr.Notes = append(wr.Notes, fmt.Sprintf("%.1f req/s (simulated) of the same workload went straight to backend 0; hit rates include that traffic, latencies do not", o.bypassRate))
	}
	for _, p := range o.policies {
		label := w.Name + "/" + p.Name
		prog.setLabel(label)
		s, err := runPolicyDump(ctx, o, sims, w, wr.RateRPS, p, prog)
		// Other processes on a shared machine can stall the load generator: run again (up to
		// maxReruns times) while the arrivals left late, and keep the least disturbed run.
		for rerun := 1; err == nil && s.LagP99 > lagRerunMS && rerun <= o.maxReruns; rerun++ {
			prog.grow(w.NumRequests())
			wr.Notes = append(wr.Notes, fmt.Sprintf("%s: run %d had scheduling lag p99 %.1f ms (wall), running it again", p.Name, rerun, s.LagP99))
			again, err2 := runPolicyDump(ctx, o, sims, w, wr.RateRPS, p, prog)
			if err2 == nil && again.LagP99 < s.LagP99 {
				s = again
			}
		}
		if err != nil {
			s = Summary{Policy: p.Name, Skipped: err.Error()}
			wr.Notes = append(wr.Notes, fmt.Sprintf("%s skipped: %v", p.Name, err))
			prog.add(w.NumRequests())
		}
		wr.Policies = append(wr.Policies, s)
		done := fmt.Sprintf("%s: TTFT p50 %.0f ms, hit rate %.0f%%", label, s.TTFTP50, 100*s.CacheHitRate)
		if s.PredictedCachedRate > 0 {
			done += fmt.Sprintf(", predicted %.0f%%, precision %.0f%%", 100*s.PredictedCachedRate, 100*s.PredictionPrecision)
		}
		if s.Failed > 0 {
			done += fmt.Sprintf(", %d of %d failed (first: %s)", s.Failed, s.Requests, s.FirstError)
		}
		prog.stepDone(done)
	}
	return wr
}

// lagRerunMS is the scheduling lag (wall ms, p99) above which a policy's run is repeated.
const lagRerunMS = 10.0

// warmupCount is the number of warm-up requests of a workload of n requests.
func warmupCount(n int) int { return int(float64(n) * warmupFraction) }

// errSkipped marks a policy that could not run in this binary.
var errSkipped = errors.New("policy unavailable")

// runPolicy runs workload w through a fresh Caddy with policy p in front of fresh simulators (one
// per entry of sims), at rate requests per simulated second.
func runPolicy(ctx context.Context, o options, sims []simSettings, w Workload, rate float64, p policy, prog *progress) (Summary, error) {
	s, _, err := runPolicyResults(ctx, o, sims, w, rate, p, proxyExtras{}, prog)
	return s, err
}

// runPolicyDump is runPolicy that also writes the run's requests into o.dump when it is set (the
// file of a run repeated for lag is overwritten: the last run's).
func runPolicyDump(ctx context.Context, o options, sims []simSettings, w Workload, rate float64, p policy, prog *progress) (Summary, error) {
	s, results, err := runPolicyResults(ctx, o, sims, w, rate, p, proxyExtras{}, prog)
	if err == nil && o.dump != "" {
		err = dumpResults(filepath.Join(o.dump, dumpName(w.Name, p.Name)), results)
	}
	return s, err
}

// dumpName is a run's file name in -dump's directory: the workload's name (with the matrix's regime,
// seed and load) and the policy, path separators and spaces replaced.
func dumpName(workload, policy string) string {
	return strings.NewReplacer("/", "_", " ", "").Replace(workload+"_"+policy) + ".jsonl"
}

// upstreamsDumpName is the file in -dump's directory that holds an llm run's /llm/upstreams at its
// end, beside the run's dumpName.
func upstreamsDumpName(workload, policy string) string {
	return strings.TrimSuffix(dumpName(workload, policy), ".jsonl") + ".upstreams.json"
}

// saveUpstreams writes what the admin API at addr reports in /llm/upstreams (every upstream's learned
// speed, slots, load and scrape) for the run's dials to path: with -dump, an llm run's estimates at its
// end, beside its requests. The report also lists the upstreams of the runs before, which the process
// keeps for a while as it would across a reload; they are left out.
func saveUpstreams(client *http.Client, addr string, dials []string, path string) error {
	resp, err := client.Get("http://" + addr + "/llm/upstreams")
	if err != nil {
		return fmt.Errorf("reading /llm/upstreams: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil || resp.StatusCode != http.StatusOK {
		return fmt.Errorf("reading /llm/upstreams: status %d, %v", resp.StatusCode, err)
	}
	var rep map[string]json.RawMessage
	var ups []map[string]json.RawMessage
	if err := json.Unmarshal(body, &rep); err != nil {
		return fmt.Errorf("/llm/upstreams: %w", err)
	}
	if err := json.Unmarshal(rep["upstreams"], &ups); err != nil {
		return fmt.Errorf("/llm/upstreams: upstreams: %w", err)
	}
	ups = slices.DeleteFunc(ups, func(u map[string]json.RawMessage) bool {
		var name string
		return json.Unmarshal(u["upstream"], &name) != nil || !slices.Contains(dials, name)
	})
	if rep["upstreams"], err = json.Marshal(ups); err != nil {
		return err
	}
	indented, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, indented, 0o644)
}

// forgetUpstreams asks the admin API at addr to forget what earlier runs taught about the upstreams
// (DELETE /llm/upstreams), waiting (boundedly) for requests still ending to be released. An llm run
// calls it once its Caddy is up and before its first request, not at the end of the one before: a
// scrape of the old simulators that landed between that forget and Caddy's stop learned their
// counters again, and the fresh ones at the same ports looked like those backends restarted (CI on
// 9e24372). The plugin keeps each upstream's learned service model, slot count and scrape baselines
// process-wide, by dial address, across configs, as it would across a reload; every policy of a run
// sees the same ports (startCluster), so without this the second llm policy of a run started from the
// first one's estimates at fresh simulators (in the matrix's multi-turn-think runs on eecd874,
// llm-observed after llm left a backend of four without a request in 13 of 21, and run first in 2 of
// 42), and a run whose seeded ports met an earlier cell's (one run in ten) started that backend at the
// other cell's speed (docs/bench/cold-start).
func forgetUpstreams(client *http.Client, addr string) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		req, err := http.NewRequest(http.MethodDelete, "http://"+addr+"/llm/upstreams", nil)
		if err != nil {
			return err
		}
		resp, err := client.Do(req)
		if err != nil {
			return fmt.Errorf("forgetting the upstreams: %w", err)
		}
		var rep struct {
			Forget struct {
				InFlight int `json:"kept_in_flight"`
			} `json:"forget"`
		}
		err = json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&rep)
		resp.Body.Close()
		switch {
		case err != nil || resp.StatusCode != http.StatusOK:
			return fmt.Errorf("forgetting the upstreams: status %d, %v", resp.StatusCode, err)
		case rep.Forget.InFlight == 0:
			return nil
		case time.Now().After(deadline):
			return fmt.Errorf("forgetting the upstreams: %d still have requests in flight", rep.Forget.InFlight)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// dumpResults writes results to path, one JSON object a line.
func dumpResults(path string, results []requestResult) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	bw := bufio.NewWriter(f)
	enc := json.NewEncoder(bw)
	for _, r := range results {
		if err := enc.Encode(r); err != nil {
			_ = f.Close()
			return err
		}
	}
	if err := bw.Flush(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// runPolicyResults is runPolicy with the extras around the policy; it also returns every request's
// result.
func runPolicyResults(ctx context.Context, o options, sims []simSettings, w Workload, rate float64, p policy, extras proxyExtras, prog *progress) (Summary, []requestResult, error) {
	if err := policyAvailable(p); err != nil {
		return Summary{}, nil, fmt.Errorf("%w: %w", errSkipped, err)
	}
	c, err := startCluster(sims, o.seed, w.Name)
	if err != nil {
		return Summary{}, nil, err
	}
	defer c.close()
	upstreamsDump := ""
	if isLLMPolicy(p) {
		// The admin API: to forget at the start what earlier runs taught (forgetUpstreams), and with
		// -dump to save at the end what this one learned.
		ports, err := freeport.Ports(1)
		if err != nil {
			return Summary{}, nil, err
		}
		extras.Admin = fmt.Sprintf("127.0.0.1:%d", ports[0])
		if o.dump != "" {
			upstreamsDump = filepath.Join(o.dump, upstreamsDumpName(w.Name, p.Name))
		}
	}
	url, err := startCaddy(c.dials, scalePrior(scaleScrapes(p, o.sim.TimeScale), o.sim.TimeScale, c.dials, c.prefillSpeeds()), extras)
	if err != nil {
		return Summary{}, nil, err
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = stopCaddy()
		}
	}()

	client := newClient()
	defer client.CloseIdleConnections()
	if extras.Admin != "" {
		if err := forgetUpstreams(client, extras.Admin); err != nil {
			return Summary{}, nil, err
		}
	}
	before := c.states()
	d, measured := c.measuredDriver(client, w, rate, o, prog)
	d.baseURL = url

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var bypassDone sync.WaitGroup
	if o.bypassRate > 0 {
		bypassDone.Add(1)
		go func() {
			defer bypassDone.Done()
			runBypass(runCtx, o, w.Name, c.dials[0], client)
		}()
	}
	start, cpuStart := time.Now(), processCPU()
	results := d.run(ctx, w)
	wall, cpu := time.Since(start), processCPU()-cpuStart
	cancel()
	bypassDone.Wait()
	after := c.states()
	if upstreamsDump != "" {
		if err := saveUpstreams(client, extras.Admin, c.dials, upstreamsDump); err != nil {
			return Summary{}, nil, err
		}
	}
	if err := stopCaddy(); err != nil {
		return Summary{}, nil, err
	}
	stopped = true

	s := summarize(p.Name, results, o.sim.TimeScale)
	s.WallSeconds = wall.Seconds()
	s.CPUPercent = round3(100 * cpu.Seconds() / wall.Seconds())
	from := measured()
	var hits, queries int64
	for i := range after {
		hits += after[i].PrefixHits - from[i].PrefixHits
		queries += after[i].PrefixQueries - from[i].PrefixQueries
		s.BackendRequests = append(s.BackendRequests, int(after[i].Requests-before[i].Requests))
	}
	if queries > 0 {
		s.CacheHitRate = round3(float64(hits)/float64(queries)*1e3) / 1e3
	}
	s.BackendTTFTP50 = backendTTFTP50(results, c.dials, o.sim.TimeScale)
	s.WallSeconds = round3(s.WallSeconds)
	return s, results, nil
}

// runBypass sends another seeded copy of the workload straight to one backend, open-loop at
// o.bypassRate requests per simulated second, until ctx ends: load the balancer does not see.
func runBypass(ctx context.Context, o options, workload, dial string, client *http.Client) {
	w, err := generateWorkload(workload, o.seed+7919, o.size())
	if err != nil {
		return
	}
	turns := float64(w.NumRequests()) / float64(len(w.Sessions))
	d := &driver{baseURL: "http://" + dial, client: client, model: benchModel,
		rate: o.bypassRate / turns * o.sim.TimeScale, timeScale: o.sim.TimeScale, seed: o.seed + 7919}
	for ctx.Err() == nil {
		d.run(ctx, w)
	}
}

// discardLog silences net/http's server error log (closed connections at shutdown).
var discardLog = newDiscardLogger()

func newDiscardLogger() *log.Logger { return log.New(io.Discard, "", 0) }
