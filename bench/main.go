// Command bench drives the same LLM workloads through Caddy with each load-balancing policy side by
// side, against simulated vLLM backends (package vllmsim), and reports the difference the way
// vLLM's `bench serve` measures it: TTFT, TPOT, end-to-end latency, output tokens/s, failures, and
// the backends' own prefix-cache hit rate.
//
// Usage (from the repository root):
//
//	go run ./bench                      # every workload and policy, ~4 backends, results in bench/out
//	go run ./bench -quick               # the same, small enough for CI
//	go run ./bench -workloads shared-prefix -policies least_conn,llm-combined,oracle
//	go run ./bench -overhead            # Caddy's own cost: round_robin vs llm on instant backends
//	go run ./bench -matrix              # backend regimes x workloads, pass/fail of llm per cell (~40 min)
//	go run ./bench -quick -matrix       # 2 regimes x 5 workloads, one seed (CI, ~4 min)
//	go run ./bench -matrix -length 3 -regimes fast-prefill  # runs 3 times as long, at the same load
//	go run ./bench -rejudge docs/bench/results.json -out /tmp/m  # judge a recorded matrix again
//	go run ./bench -rejudge stock1.json,stock2.json -replace llm1.json,llm2.json -out /tmp/m  # llm run alone, judged against those runs' stock policies
//	go run ./bench -compare docs/bench/results.json,/tmp/m/results.json  # two matrices, cell by cell
//	go run ./bench -matrix -regimes hetero -workloads shared-prefix -dump /tmp/d  # and every request
//	go run ./bench -goodput             # highest load with TTFT p99 < 2 s: least_conn vs llm
//	go run ./bench -instances 3         # 3 Caddy processes, shared through Redis vs unshared vs one
//	go run ./bench -restart             # restart Caddy under load, with and without persist
//
// For each workload and policy it starts fresh simulated backends (cold caches) on 127.0.0.1, loads
// a Caddy config in this process (reverse_proxy with that policy, flush_interval -1), sends the
// workload open-loop (Poisson session arrivals at -load times the estimated capacity, see
// estimateCapacity), and stops both. Latencies are reported in simulated time.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/tokenrouter/caddy-llm"
	_ "github.com/tokenrouter/caddy-llm/bench/internal/oracle"
	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

// warmupFraction is the share of requests, in send order, left out of the statistics.
const warmupFraction = 0.10

// lateFraction is the share of requests, in send order, before the ones a matrix's late verdict is on
// (Summary.LateTTFTP50).
const lateFraction = 0.25

// options are the command-line settings.
type options struct {
	quick      bool
	length     int // with -matrix: runs this many times as long (1: the matrix's own size)
	workloads  []string
	policies   []policy
	backends   int
	load       float64
	seed       int64
	out        string
	overhead   bool
	bypassRate float64
	cpuProfile string
	// mutexProfile (-mutexprofile FILE) writes where goroutines waited on locks during the run.
	mutexProfile string
	observe      bool // llm policies behind transport llm
	// dump (-dump DIR) writes every run's requests, one JSON object a line, with the backend that
	// answered each: to see where a cell's tail comes from.
	dump      string
	maxReruns int
	// overheadSeconds overrides the measuring time per policy of -overhead (tests).
	overheadSeconds float64
	sim             simSettings
	// matrix runs regimes x workloads (matrix.go), goodput steps the load (goodput.go); both run
	// every cell with seeds seed, seed+1, ... and take medians.
	matrix, goodput bool
	regimes         []regime
	seeds           int
	// faults runs the fault workload (faults.go).
	faults bool
	// timeScaleSet is true when -timescale was given: the matrix then uses it for every workload.
	timeScaleSet bool
	// instances (-instances N) compares N Caddy processes, shared and unshared, with one
	// (instances.go); restart (-restart) restarts Caddy under load, with and without persist
	// (restart.go). shareFlush overrides the shared instances' flush interval (wall time).
	instances int
	restart   bool
	// restartKeep lists -restart's runs by what carries the state over (restartKeeps).
	restartKeep []string
	shareFlush  time.Duration
	setups      []string // of -instances: one, shared, unshared
	// rejudge (-rejudge FILE[,FILE...]) judges the runs of earlier -matrix results.json again, pooled,
	// and writes their report into out, running nothing (matrix.go).
	rejudge string
	// replace (-replace FILE[,FILE...], with -rejudge) sets the policies of other -matrix results.json
	// into -rejudge's runs in place of theirs, run by run (replaceRuns).
	replace string
	// compare (-compare BASE,NEW) compares two -matrix results.json, cell by cell and policy by policy,
	// running nothing (matrix.go).
	compare string
}

// size returns the workload size the options ask for.
// -goodput uses a plain run's size: past a policy's knee its queue grows with the length of the
// run, and a matrix-sized run (128 requests, 2-3 s simulated at high load) ends before it shows.
func (o options) size() workloadSize {
	switch {
	case o.matrix:
		return workloadSize{matrix: true, length: o.length}
	case o.goodput:
		return workloadSize{}
	}
	return workloadSize{quick: o.quick}
}

// defaultSim is the simulated GPU: vLLM-like speeds (8k prefill tokens/s, 30 ms decode steps),
// a KV cache small enough that caching matters (32k tokens per backend), run 5x faster than real
// time with 8 output tokens per SSE chunk so that 2 cores can drive 4 backends and Caddy.
var defaultSim = simSettings{
	MaxNumSeqs:          64,
	MaxNumBatchedTokens: 8192,
	BlockSize:           16,
	NumGPUBlocks:        2048,
	PrefillTokensPerSec: 8000,
	DecodeStep:          30 * time.Millisecond,
	DecodeStepPerSeq:    250 * time.Microsecond,
	TimeScale:           5,
	TokensPerChunk:      8,
}

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// parseOptions reads the command line.
func parseOptions(args []string) (options, error) {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	o := options{sim: defaultSim}
	var workloads, policies, regimeList, restartKeep string
	fs.BoolVar(&o.quick, "quick", false, "small run of every workload and policy (for CI, ~2 minutes on 2 cores)")
	fs.StringVar(&workloads, "workloads", "all", "comma-separated workloads: "+strings.Join(knownWorkloads, ",")+" (all: "+strings.Join(workloadNames, ",")+"; with -matrix "+strings.Join(matrixWorkloads, ",")+")")
	fs.StringVar(&policies, "policies", "all", "comma-separated policies: "+strings.Join(policyNames(), ","))
	fs.BoolVar(&o.matrix, "matrix", false, "run backend regimes x workloads with round_robin, least_conn, header, llm and oracle, and judge llm per cell")
	fs.BoolVar(&o.goodput, "goodput", false, "step the load on shared-prefix and report the highest at which TTFT p99 stays under 2 s, least_conn vs llm")
	fs.BoolVar(&o.faults, "faults", false, "one backend drops 10% of its streams mid-way and fails 3% of requests: complete streams, goodput and TTFT p99 of least_conn + lb_retries, llm, and llm + llm_resume")
	fs.StringVar(&regimeList, "regimes", "all", "with -matrix or -goodput: comma-separated regimes (with -restart: one): "+strings.Join(regimeNames(), ",")+"; extra (beyond the matrix: "+strings.Join(extraRegimeNames(), ",")+") or any of those")
	fs.IntVar(&o.length, "length", 1, "with -matrix: N times as many sessions (requests) per run at the same offered load, to see what a longer run (more learned, a p99 over more requests) changes; unset, a pool of more than 4 -backends runs ceil(backends/4) times as many (at most 20), as long as a 4-backend run")
	fs.IntVar(&o.seeds, "seeds", 3, "with -matrix, -goodput or -faults: seeds per cell (medians over them; -faults pools them); 1 with -quick, -goodput or -faults unless set")
	fs.IntVar(&o.backends, "backends", 4, "number of simulated backends")
	fs.Float64Var(&o.load, "load", 0.75, "offered load as a fraction of the estimated cluster capacity")
	fs.Int64Var(&o.seed, "seed", 1, "seed of the workloads, arrivals and simulators")
	fs.StringVar(&o.out, "out", "bench/out", "output directory for results.json, report.md and ttft.svg (out when run from inside bench/)")
	fs.BoolVar(&o.overhead, "overhead", false, "measure Caddy's overhead instead: instant backends, round_robin vs llm, closed loop")
	fs.Float64Var(&o.bypassRate, "bypass-rate", 0, "extra requests per simulated second sent straight to backend 0, not through Caddy (another client)")
	fs.Float64Var(&o.sim.TimeScale, "timescale", defaultSim.TimeScale, "how many times faster than real time the simulators run")
	fs.IntVar(&o.sim.NumGPUBlocks, "kv-blocks", defaultSim.NumGPUBlocks, "KV cache blocks (16 tokens) per simulated backend")
	fs.StringVar(&o.sim.Metrics, "metrics", "", "the simulators' /metrics dialect: vllm (default), vllm-legacy, sglang, llamacpp, nim or tgi (what the policy can learn from each kind of server)")
	fs.IntVar(&o.maxReruns, "reruns", 2, "run a policy again up to this many times when the load generator's scheduling lag shows the machine was busy")
	fs.IntVar(&o.instances, "instances", 0, "run N Caddy processes behind a random splitter: one instance vs N sharing through redis-server vs N unshared")
	fs.BoolVar(&o.restart, "restart", false, "restart Caddy under load: hit rate in the first simulated minute after the restart vs the minute before, with and without persist")
	fs.StringVar(&restartKeep, "restart-keep", "persist,none", "with -restart: what carries the learned state over the restart, comma-separated runs: "+strings.Join(restartKeeps, ",")+" (share: the restarted process warms up from a redis-server the benchmark starts, as a new instance would)")
	fs.DurationVar(&o.shareFlush, "share-flush", 0, "with -instances: the shared instances' flush_interval in wall time (default 100ms simulated: 100ms / time scale)")
	var setups string
	fs.StringVar(&setups, "setups", "one,shared,unshared", "with -instances: which setups to run")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the run to this file")
	fs.StringVar(&o.mutexProfile, "mutexprofile", "", "write a profile of lock contention (one event in 5 sampled) during the run to this file")
	fs.StringVar(&o.compare, "compare", "", "BASE.json,NEW.json: compare two -matrix results.json (nothing is run): each cell's median TTFT p50, p99 and hit rate of NEW over BASE per policy, the same seed by seed (geometric mean of the per-seed ratios, seeds worse), and their geometric means")
	fs.StringVar(&o.rejudge, "rejudge", "", "judge the runs of an earlier -matrix results.json again (nothing is run) and write its report, results.json and matrix.svg into -out; several comma-separated files of different seeds are pooled, as one run of all their seeds")
	fs.StringVar(&o.replace, "replace", "", "with -rejudge: comma-separated -matrix results.json whose policies (say llm, run alone) replace the same policies in -rejudge's runs of the same regime, workload, seed and load before they are judged; every run on either side must have its match")
	fs.StringVar(&o.dump, "dump", "", "write every run's requests (timings, tokens, the backend that answered) as JSON lines into this directory, one file per run")
	fs.BoolVar(&o.observe, "observe", false, "run every llm policy behind transport llm (it reads each response's cached tokens and corrects the routes)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if o.backends < 1 {
		return o, fmt.Errorf("-backends must be at least 1")
	}
	if !(o.load > 0) {
		return o, fmt.Errorf("-load must be positive")
	}
	if o.sim.Metrics != "" && !slices.Contains(vllmsim.MetricsFlavours, o.sim.Metrics) {
		return o, fmt.Errorf("-metrics must be one of %s, got %q", strings.Join(vllmsim.MetricsFlavours, ", "), o.sim.Metrics)
	}
	if modes := btoi(o.matrix) + btoi(o.goodput) + btoi(o.faults) + btoi(o.overhead) + btoi(o.rejudge != "") + btoi(o.compare != ""); modes > 1 {
		return o, fmt.Errorf("-matrix, -goodput, -faults, -overhead, -rejudge and -compare are separate modes")
	}
	if o.replace != "" && o.rejudge == "" {
		return o, fmt.Errorf("-replace is for -rejudge")
	}
	if (o.instances > 0 || o.restart) && policies != "all" && strings.Contains(policies, ",") {
		return o, fmt.Errorf("-instances and -restart run one policy (an llm variant)")
	}
	for _, s := range strings.Split(setups, ",") {
		if s != "one" && s != "shared" && s != "unshared" {
			return o, fmt.Errorf("unknown setup %q (known: one, shared, unshared)", s)
		}
		o.setups = append(o.setups, s)
	}
	if o.instances < 0 || o.instances == 1 {
		return o, fmt.Errorf("-instances must be at least 2")
	}
	if (o.instances > 0 || o.restart) && (o.matrix || o.goodput || o.overhead || o.faults) {
		return o, fmt.Errorf("-instances and -restart are separate from -matrix, -goodput, -faults and -overhead")
	}
	if (o.quick || o.goodput || o.faults || o.restart) && !isSet(fs, "seeds") {
		o.seeds = 1
	}
	if o.length < 1 || o.length > 20 {
		return o, fmt.Errorf("-length must be 1-20, got %d", o.length)
	}
	if o.matrix && !isSet(fs, "length") {
		o.length = poolLength(o.backends)
	}
	if o.length > 1 && !o.matrix {
		return o, fmt.Errorf("-length is for -matrix")
	}
	if o.seeds < 1 {
		return o, fmt.Errorf("-seeds must be at least 1")
	}
	o.timeScaleSet = isSet(fs, "timescale")
	if (o.quick || o.matrix || o.goodput) && !o.timeScaleSet {
		o.sim.TimeScale = 10
	}
	if o.instances > 0 && !o.quick && !o.timeScaleSet {
		// Several Caddy processes, redis-server and the simulators share this machine's cores: at a
		// compressed time scale each millisecond of their CPU counts several simulated ones, and three
		// processes contend where one does not, which the comparison with one instance would charge to
		// sharing (shared-prefix TTFT p50 1.09-1.14x one instance's at time scale 5 in nine runs over two
		// decisions, 0.99x and 1.00x in real time on the same two). Real time, as each instance would run
		// on its own machine.
		o.sim.TimeScale = instancesTimeScale
	}
	if o.faults && !o.quick && !o.timeScaleSet {
		o.sim.TimeScale = faultTimeScale
	}
	if o.faults && !isSet(fs, "load") {
		o.load = faultLoad
	}
	if st, err := os.Stat("bench"); !isSet(fs, "out") && (err != nil || !st.IsDir()) {
		o.out = "out" // run from inside bench/
	}
	switch {
	case isSet(fs, "reruns"):
	case o.quick && o.matrix:
		o.maxReruns = 0 // CI proves the harness; medians over seeds absorb a disturbed run
	case o.quick || o.matrix || o.goodput:
		o.maxReruns = 1
	}
	o.workloads = workloadNames
	switch {
	case o.matrix:
		o.workloads = matrixWorkloads
	case o.goodput:
		o.workloads = []string{"shared-prefix"}
	case o.instances > 0 || o.restart:
		o.workloads = instancesWorkloads
	}
	if workloads != "all" {
		o.workloads = nil
		for _, w := range strings.Split(workloads, ",") {
			if _, err := generateWorkload(w, 0, workloadSize{quick: true}); err != nil {
				return o, err
			}
			o.workloads = append(o.workloads, w)
		}
	}
	o.policies = allPolicies
	switch {
	case o.matrix:
		o.policies = policiesNamed(matrixPolicies)
	case o.goodput:
		o.policies = policiesNamed(goodputPolicies)
	case o.instances > 0 || o.restart:
		o.policies = policiesNamed([]string{judgedPolicy})
	}
	if policies != "all" {
		o.policies = nil
		for _, name := range strings.Split(policies, ",") {
			p, ok := findPolicy(name)
			if !ok {
				return o, fmt.Errorf("unknown policy %q (known: %s)", name, strings.Join(policyNames(), ","))
			}
			o.policies = append(o.policies, p)
		}
	}
	if o.observe {
		o.policies = slices.Clone(o.policies) // not the shared table's entries
		for i, p := range o.policies {
			if strings.HasPrefix(p.Name, "llm") {
				o.policies[i].Transport = "llm"
			}
		}
	}
	switch {
	case regimeList == "extra":
		o.regimes = extraRegimes
	case regimeList != "all":
		for _, name := range strings.Split(regimeList, ",") {
			r, err := findRegime(name)
			if err != nil {
				return o, err
			}
			o.regimes = append(o.regimes, r)
		}
	case o.goodput:
		o.regimes = []regime{mustRegime("default")}
	case o.matrix && o.quick:
		o.regimes = []regime{mustRegime("small-batch"), mustRegime("default")}
	default:
		o.regimes = regimes
	}
	for _, k := range strings.Split(restartKeep, ",") {
		if !slices.Contains(restartKeeps, k) || slices.Contains(o.restartKeep, k) {
			return o, fmt.Errorf("-restart-keep %q: want a comma-separated list of distinct %s", restartKeep, strings.Join(restartKeeps, ","))
		}
		o.restartKeep = append(o.restartKeep, k)
	}
	if o.restart && regimeList != "all" && len(o.regimes) != 1 {
		return o, fmt.Errorf("-restart runs one regime, not %d", len(o.regimes))
	}
	return o, nil
}

// mustRegime returns a regime of the table by name (the name is a constant of this package).
func mustRegime(name string) regime {
	r, err := findRegime(name)
	if err != nil {
		panic(err)
	}
	return r
}

// policiesNamed returns the policies of the given names (known names only).
func policiesNamed(names []string) []policy {
	var out []policy
	for _, n := range names {
		if p, ok := findPolicy(n); ok {
			out = append(out, p)
		}
	}
	return out
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// poolLength is a matrix run's length for a pool of n backends when -length is not given: the
// offered load is a fraction of the pool's capacity, so the same sessions on 16 backends would arrive
// 4 times as fast and the run would end in a quarter of the simulated time, about 8 requests a
// backend, before a learned speed or a queue has formed (the 16-backend runs of 2026-11-27 moved
// 0.4-1.9x between runs). ceil(n/4) times the sessions keeps a 4-backend run's duration and requests
// a backend.
func poolLength(n int) int {
	return min(max((n+3)/4, 1), 20)
}

func isSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

func policyNames() []string {
	var names []string
	for _, p := range append(allPolicies[:len(allPolicies):len(allPolicies)], extraPolicies...) {
		names = append(names, p.Name)
	}
	return names
}

func findPolicy(name string) (policy, bool) {
	for _, p := range append(allPolicies[:len(allPolicies):len(allPolicies)], extraPolicies...) {
		if p.Name == name {
			return p, true
		}
	}
	return policy{}, false
}

// machine describes the machine a run ran on.
func machine() string {
	gc := os.Getenv("GOGC")
	if gc == "" {
		gc = "100"
	}
	return fmt.Sprintf("%s/%s, %d CPUs, GOMAXPROCS %d, GOGC %s, %s", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.GOMAXPROCS(0), gc, runtime.Version())
}

// run executes the benchmark described by args.
func run(args []string) error {
	o, err := parseOptions(args)
	if err != nil {
		return err
	}
	if o.rejudge != "" {
		return rejudgeMatrix(o.rejudge, o.replace, o.out, "go run ./bench "+strings.Join(args, " "))
	}
	if o.compare != "" {
		base, changed, ok := strings.Cut(o.compare, ",")
		if !ok || base == "" || changed == "" {
			return fmt.Errorf("-compare wants BASE.json,NEW.json, got %q", o.compare)
		}
		return compareMatrices(os.Stdout, base, changed)
	}
	cleanup, err := isolateCaddyDirs()
	if err != nil {
		return err
	}
	defer cleanup()
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return fmt.Errorf("creating CPU profile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("starting CPU profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	if o.mutexProfile != "" {
		f, err := os.Create(o.mutexProfile)
		if err != nil {
			return fmt.Errorf("creating mutex profile: %w", err)
		}
		defer f.Close()
		runtime.SetMutexProfileFraction(5)
		defer func() { _ = pprof.Lookup("mutex").WriteTo(f, 0) }()
	}
	// Interrupted (Ctrl-C, or a kill from a script), the run stops its drivers and every deferred stop
	// runs: the Caddy processes and redis-server it started end with it instead of outliving it.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	started := time.Now()
	res := Results{
		Command:   "go run ./bench " + strings.Join(args, " "),
		Started:   started.UTC().Format(time.RFC3339),
		Machine:   machine(),
		Seed:      o.seed,
		Backends:  o.backends,
		Load:      o.load,
		BypassRPS: o.bypassRate,
		Sim:       o.sim,
	}
	if o.matrix || o.goodput {
		return runMatrixMode(ctx, o, res, started)
	}
	if o.faults {
		return runFaults(ctx, o, res, started)
	}
	if o.instances > 0 || o.restart {
		if o.instances > 0 {
			if err := runInstancesMode(ctx, o, args, started); err != nil {
				return err
			}
		}
		if o.restart {
			return runRestartMode(ctx, o, args, time.Now())
		}
		return nil
	}
	if o.overhead {
		oh, err := runOverhead(ctx, o)
		if err != nil {
			return err
		}
		res.Overhead = &oh
		fmt.Println(oh.describe())
	} else {
		res.Workloads, err = runWorkloads(ctx, o, os.Stderr)
		if err != nil {
			return err
		}
		fmt.Println("verdicts:")
		writeVerdicts(os.Stdout, res.Workloads, "  ")
		for _, w := range res.Workloads {
			writeTable(os.Stdout, w)
		}
	}
	res.Notes = append(res.Notes, fmt.Sprintf("wall time %.1fs", time.Since(started).Seconds()))
	if err := writeOutputs(o.out, res); err != nil {
		return err
	}
	fmt.Printf("\nwall time %.1fs; results in %s\n", time.Since(started).Seconds(), o.out)
	return nil
}
