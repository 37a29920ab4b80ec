package vllmsim

import (
	crand "crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Sentinel errors of the engine.
var (
	// ErrClosed: the server was closed; new requests get 503 and in-flight ones end with an error.
	ErrClosed = errors.New("simulated engine closed")
	// errQueueFull: the waiting queue is at MaxQueue (429).
	errQueueFull = errors.New("waiting queue full")
	// errTooLong: prompt plus output can never fit in the KV cache (400, like max_model_len).
	errTooLong = errors.New("prompt and output exceed the model's maximum context length")
)

// Request states, guarded by Server.mu.
const (
	stateWaiting = iota
	stateRunning
	stateDone // finished, aborted or failed; its blocks are released
)

// request is one sequence in the engine. Fields below the mutex comment are guarded by Server.mu; the
// atomics and channels are how the engine hands tokens to the HTTP handler without ever blocking.
type request struct {
	hashes       []uint64 // chained hashes of the prompt's full blocks
	promptTokens int
	maxTokens    int
	adapter      string // LoRA adapter, "" for the base model

	generated atomic.Int64  // output tokens produced so far
	cached    atomic.Int64  // prompt tokens found in the prefix cache at admission
	notify    chan struct{} // capacity 1: new tokens or done
	done      chan struct{} // closed when the request leaves the engine
	err       error         // why it ended early (nil when finished); written before done is closed

	// guarded by Server.mu
	state      int
	blocks     []int32   // KV blocks in token order
	registered int       // prompt blocks published in the prefix cache
	computed   int       // tokens whose KV is computed (cache hits included)
	admittedAt int       // computed at its latest admission: the cache hits it started from
	target     int       // tokens to compute before the next sample while prefilling, else 0
	pendingEst int       // contribution to Server.pendingPrefill
	loraHeld   bool      // holds a reference on its adapter's slot (while running)
	arrival    int64     // order of enqueueing: Schedule "lpm" breaks ties by it
	enqueued   time.Time // wall time of enqueueing: its time to first token counts from it
	// scheduled is the wall time of its first admission, and prefillSeconds the time from then to its
	// first token (vllm:request_prefill_time_seconds, observed when it finishes).
	scheduled      time.Time
	prefillSeconds float64
}

// stepItem is one request's share of a planned engine step.
type stepItem struct {
	r      *request
	tokens int // tokens computed in this step: 1 for a decode, a chunk for a prefill
}

// Server is a simulated vLLM server: an http.Handler in front of one engine goroutine that runs
// continuous batching on a simulated clock over a paged KV cache with prefix caching.
//
// All methods are safe for concurrent use. The engine holds the mutex only to plan and apply a step
// (O(batch + blocks allocated)); introspection takes the same mutex briefly. Memory is bounded by
// NumGPUBlocks, MaxNumSeqs and the waiting queue (MaxQueue, or unbounded when 0) plus each request's
// prompt hashes (8 bytes per block).
type Server struct {
	cfg    Config
	faults atomic.Pointer[Faults]
	wake   chan struct{}
	stop   chan struct{}
	exited chan struct{}
	once   sync.Once
	nextID atomic.Uint64
	idBase uint32 // distinguishes response IDs of servers (see nextIDBase)

	requests, failed429, failed5xx atomic.Int64
	// modelJSON is the served model name as a JSON string literal.
	modelJSON []byte

	rngMu sync.Mutex
	rng   *rand.Rand

	mu             sync.Mutex
	closed         bool
	kv             *kvCache
	waiting        []*request // FIFO (Schedule "lpm": longest cached prefix first); entries in stateDone are tombstones skipped on pop
	arrivals       int64      // requests enqueued (request.arrival)
	lpm            []lpmEntry // scratch of sortWaitingLocked
	waitHead       int
	numWaiting     int
	running        []*request
	watermark      int // free blocks admission leaves for running requests to grow into
	preemptions    int64
	pendingPrefill int
	prefixQueries  int64
	prefixHits     int64
	promptTotal    int64
	outputTotal    int64
	finished       int64
	finishedPrompt int64 // prompt tokens of the finished requests (vllm:request_prompt_tokens' sum)
	finishedOutput int64 // output tokens of the finished requests (tgi_request_generated_tokens' sum)
	// firstTokens counts the first tokens sampled and firstTokenSeconds their times from enqueueing, in
	// wall seconds (vllm:time_to_first_token_seconds' count and sum: a real server's clock).
	firstTokens       int64
	firstTokenSeconds float64
	// finishedPrefillSeconds and finishedComputed are the finished requests' times from their first
	// admission to their first token and the prompt tokens they computed, not found cached
	// (vllm:request_prefill_time_seconds' and vllm:request_prefill_kv_computed_tokens' sums: a real
	// server's clock, observed as each request finishes).
	finishedPrefillSeconds float64
	finishedComputed       int64
	prefilled              int64 // tokens computed by finished prefills (llamacpp:prompt_tokens_total)
	steps                  int64
	busy                   time.Duration // simulated time spent in steps
	lastStep               time.Duration
	loras                  []loraSlot // resident LoRA adapters, at most MaxLoRAs
	loraLoads              int64      // adapters loaded into a slot
	started                time.Time  // the simulated process's start (process_start_time_seconds); Restart moves it

	stored responseStore // the Responses API's stored responses
}

// New validates cfg, fills in defaults and starts the engine goroutine; Close stops it.
func New(cfg Config) (*Server, error) {
	s, err := newServer(cfg)
	if err != nil {
		return nil, err
	}
	go s.run()
	return s, nil
}

// newServer builds a server without starting its engine goroutine (tests step it by hand).
func newServer(cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("configuring simulated vLLM server: %w", err)
	}
	s := &Server{
		cfg:    cfg,
		wake:   make(chan struct{}, 1),
		stop:   make(chan struct{}),
		exited: make(chan struct{}),
		rng:    rand.New(rand.NewPCG(uint64(cfg.Seed), 0x5eed)),
		kv:     newKVCache(cfg.NumGPUBlocks),
		// Like vLLM's 1% watermark: admission keeps a few blocks free for running sequences to grow.
		watermark: cfg.NumGPUBlocks / 100,
		started:   time.Now(),
	}
	s.modelJSON = appendJSONString(nil, cfg.Model)
	s.idBase = nextIDBase()
	s.faults.Store(&Faults{
		ErrorRate:         cfg.ErrorRate,
		DropMidStreamRate: cfg.DropMidStreamRate,
		CutStreamAfter:    cfg.CutStreamAfter,
		MetricsDelay:      cfg.MetricsDelay,
		MetricsFail:       cfg.MetricsFail,
	})
	return s, nil
}

// idBases numbers the servers of this process from a random start.
var idBases = func() *atomic.Uint32 {
	var b [4]byte
	_, _ = crand.Read(b[:])
	var n atomic.Uint32
	n.Store(binary.LittleEndian.Uint32(b[:]))
	return &n
}()

// nextIDBase returns the ID prefix of a new server: distinct for every server of one process (the
// counter times an odd constant is a bijection on uint32, so no two of 2^32 servers share it) and
// random across processes. It used to be drawn from the seeded RNG, so servers with the same Seed
// (every vllm_sim in one Caddy config leaves it at 0) returned the same response IDs.
func nextIDBase() uint32 { return idBases.Add(1) * 0x9e3779b1 }

// Config returns the configuration with defaults filled in.
func (s *Server) Config() Config { return s.cfg }

// Close stops the engine goroutine and waits for it; every waiting or running request ends with
// ErrClosed and later requests get 503. It is idempotent and safe to call concurrently.
func (s *Server) Close() {
	s.once.Do(func() { close(s.stop) })
	<-s.exited
}

// SetFaults replaces the fault knobs at run time; rates outside [0, 1] are clamped.
func (s *Server) SetFaults(f Faults) {
	f.ErrorRate = min(max(f.ErrorRate, 0), 1)
	f.DropMidStreamRate = min(max(f.DropMidStreamRate, 0), 1)
	f.CutStreamAfter = max(f.CutStreamAfter, 0)
	s.faults.Store(&f)
}

// State is a snapshot of the engine for tests and the benchmark's oracle.
type State struct {
	Running, Waiting int
	// PendingPrefillTokens is the prefill work queued: the uncached tokens of waiting requests
	// (estimated from the cache when they arrived) plus what running requests have yet to prefill
	// (exact; a preempted request's output so far counts, since it is recomputed).
	PendingPrefillTokens  int
	UsedBlocks, NumBlocks int
	PrefixQueries         int64 // prompt tokens looked up in the prefix cache
	PrefixHits            int64 // of which found cached
	Requests              int64 // completion requests received
	Failed429, Failed5xx  int64

	// Additions beyond the harness contract.
	CachedBlocks     int           // blocks whose contents are in the prefix cache (referenced or not)
	Preemptions      int64         // running requests evicted to free blocks (they recompute later)
	Evictions        int64         // cached blocks evicted to make room
	Finished         int64         // requests that generated all their tokens
	Steps            int64         // engine steps run
	BusyTime         time.Duration // simulated time spent in steps
	LastStepDuration time.Duration // simulated duration of the latest step
	LoRALoads        int64         // LoRA adapters loaded into a slot (each cost LoRALoadTime)
}

// State returns a snapshot; it takes the engine mutex briefly and allocates nothing.
func (s *Server) State() State {
	s.mu.Lock()
	defer s.mu.Unlock()
	return State{
		Running:              len(s.running),
		Waiting:              s.numWaiting,
		PendingPrefillTokens: s.pendingPrefill,
		UsedBlocks:           s.kv.used(),
		NumBlocks:            len(s.kv.blocks),
		PrefixQueries:        s.prefixQueries,
		PrefixHits:           s.prefixHits,
		Requests:             s.requests.Load(),
		Failed429:            s.failed429.Load(),
		Failed5xx:            s.failed5xx.Load(),
		CachedBlocks:         len(s.kv.cached),
		Preemptions:          s.preemptions,
		Evictions:            s.kv.evictions,
		Finished:             s.finished,
		Steps:                s.steps,
		BusyTime:             s.busy,
		LastStepDuration:     s.lastStep,
		LoRALoads:            s.loraLoads,
	}
}

// Cached returns the simulated tokenization of an OpenAI request body (the same the engine would do)
// and how many of its prompt tokens are cached right now (full cached blocks of the chained-hash
// prefix, at most promptTokens-1 like vLLM, which always computes the last prompt token). A body with
// "messages" is a chat request, anything else a text completion. It costs one parse and one hash pass
// over the prompt and holds the engine mutex for one map lookup per block.
func (s *Server) Cached(body []byte) (promptTokens, cachedTokens int, err error) {
	p, err := parseAny(body)
	if err != nil {
		return 0, 0, err
	}
	r := s.newRequest(p)
	s.mu.Lock()
	hits, _ := s.kv.lookup(r.hashes, s.maxHitBlocks(r))
	s.mu.Unlock()
	return r.promptTokens, hits * s.cfg.BlockSize, nil
}

func (s *Server) newRequest(p parsedRequest) *request {
	return &request{
		hashes:       blockHashes(p.prompt, s.cfg.BlockSize),
		promptTokens: promptTokens(p.prompt),
		maxTokens:    p.maxTokens,
		notify:       make(chan struct{}, 1),
		done:         make(chan struct{}),
	}
}

// sibling returns another sequence of r's request (one of its n completions): the same prompt and
// output limit, its own progress, and r's notify channel, so that one wait hears from every sequence.
func (r *request) sibling() *request {
	return &request{
		hashes:       r.hashes,
		promptTokens: r.promptTokens,
		maxTokens:    r.maxTokens,
		notify:       r.notify,
		done:         make(chan struct{}),
	}
}

// maxHitBlocks is how many prompt blocks may come from the cache: vLLM recomputes at least the last
// prompt token to produce logits.
func (s *Server) maxHitBlocks(r *request) int { return (r.promptTokens - 1) / s.cfg.BlockSize }

func (s *Server) blocksFor(tokens int) int { return (tokens + s.cfg.BlockSize - 1) / s.cfg.BlockSize }

// enqueue adds r to the waiting queue, or fails with ErrClosed, errQueueFull or errTooLong. The queue
// limit counts the requests waiting beyond the free sequence slots (those the next step admits anyway,
// if their blocks fit).
func (s *Server) enqueue(r *request) error {
	if s.blocksFor(r.promptTokens+r.maxTokens) > s.cfg.NumGPUBlocks ||
		s.blocksFor(r.promptTokens) > s.cfg.NumGPUBlocks-s.watermark {
		return errTooLong
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	if s.cfg.MaxQueue > 0 && s.numWaiting+1-(s.cfg.MaxNumSeqs-len(s.running)) > s.cfg.MaxQueue {
		s.mu.Unlock()
		return errQueueFull
	}
	r.state = stateWaiting
	s.arrivals++
	r.arrival, r.enqueued = s.arrivals, time.Now()
	s.setPendingLocked(r)
	s.waiting = append(s.waiting, r)
	s.numWaiting++
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
	return nil
}

// knownTokens is the number of tokens whose KV the next sample needs: the prompt and the output so far.
func (r *request) knownTokens() int { return r.promptTokens + int(r.generated.Load()) }

// setPendingLocked sets r's contribution to PendingPrefillTokens to the tokens it still has to
// prefill, estimating a waiting request's cache hits from the cache as it is now.
func (s *Server) setPendingLocked(r *request) {
	pending := 0
	switch r.state {
	case stateWaiting:
		hits, _ := s.kv.lookup(r.hashes, s.maxHitBlocks(r))
		pending = r.knownTokens() - hits*s.cfg.BlockSize
	case stateRunning:
		pending = max(r.target-r.computed, 0)
	}
	s.pendingPrefill += pending - r.pendingEst
	r.pendingEst = pending
}

// abort removes each of reqs (the sequences of one request, or one) from the engine if it is still
// there and releases its blocks.
func (s *Server) abort(reqs ...*request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range reqs {
		switch r.state {
		case stateWaiting:
			s.numWaiting--
			s.retireLocked(r)
		case stateRunning:
			s.removeRunningLocked(r)
			s.retireLocked(r)
		}
	}
}

func (s *Server) removeRunningLocked(r *request) {
	s.releaseLoRALocked(r)
	if i := slices.Index(s.running, r); i >= 0 {
		s.running = slices.Delete(s.running, i, i+1)
	}
}

// retireLocked releases a request's blocks and marks it done (without closing done: the caller
// decides how it ended). A waiting request stays in the queue as a tombstone.
func (s *Server) retireLocked(r *request) {
	s.kv.release(r.blocks)
	r.blocks = nil
	r.state = stateDone
	s.setPendingLocked(r)
}

// admitLocked tries to give the waiting request r its prefix-cache hits and blocks for every token it
// has to compute before its next sample (the prompt, plus the output so far after a preemption). It
// returns false, changing nothing, when the free blocks would fall below the watermark.
func (s *Server) admitLocked(r *request) bool {
	hits, hitsFree := s.kv.lookup(r.hashes, s.maxHitBlocks(r))
	target := r.knownTokens()
	blocks := s.blocksFor(target)
	if hitsFree+(blocks-hits) > s.kv.free-s.watermark {
		return false
	}
	if cap(r.blocks) == 0 {
		r.blocks = make([]int32, 0, s.blocksFor(r.promptTokens+r.maxTokens))
	}
	for _, h := range r.hashes[:hits] {
		r.blocks = append(r.blocks, s.kv.take(h))
	}
	for range blocks - hits {
		r.blocks = append(r.blocks, s.kv.allocate())
	}
	cached := hits * s.cfg.BlockSize
	r.computed, r.registered, r.target, r.admittedAt = cached, hits, target, cached
	if r.generated.Load() == 0 {
		r.cached.Store(int64(cached))
	}
	if r.scheduled.IsZero() {
		r.scheduled = time.Now()
	}
	s.prefixQueries += int64(r.promptTokens)
	s.prefixHits += int64(cached)
	r.state = stateRunning
	s.setPendingLocked(r)
	return true
}

// preemptLocked evicts the running request r back to the front of the waiting queue, releasing its
// blocks; it will recompute its prompt and output so far (vLLM's recompute preemption).
func (s *Server) preemptLocked(r *request) {
	s.removeRunningLocked(r)
	s.kv.release(r.blocks)
	r.blocks = r.blocks[:0]
	r.computed, r.registered, r.target = 0, 0, 0
	r.state = stateWaiting
	s.setPendingLocked(r)
	if s.waitHead > 0 {
		s.waitHead--
		s.waiting[s.waitHead] = r
	} else {
		s.waiting = append([]*request{r}, s.waiting...)
	}
	s.numWaiting++
	s.preemptions++
}

// planLocked chooses the next step's batch, like vLLM's scheduler: running requests first, in order,
// each computing the tokens it still lacks before its next sample (one for a decode, a prefill chunk
// otherwise) within the step's token budget; a decode that needs a new block and finds none preempts
// the most recently admitted running request. Then waiting requests are admitted in FIFO order
// (Schedule "lpm": longest cached prefix first) while a sequence slot, the budget and their blocks allow. It returns the batch and the step's simulated
// duration: prefill tokens / PrefillTokensPerSec + DecodeStep + DecodeStepPerSeq * batch size, each
// prefill token weighed by its position and each decode's context read where AttentionTokens and
// DecodeStepPerKToken say.
//
// With SeparatePrefill (SGLang's steps), a step that can prefill (a chunked prefill unfinished, a
// waiting request admitted) prefills only; the running sequences decode in the steps between.
func (s *Server) planLocked(batch []stepItem) ([]stepItem, time.Duration) {
	if !s.cfg.SeparatePrefill {
		return s.planStepLocked(batch, true, true)
	}
	if b, d := s.planStepLocked(batch, false, true); len(b) > 0 {
		return b, d
	}
	return s.planStepLocked(batch, true, false)
}

// planStepLocked plans a step of the running requests' decodes (when decodes), their prefill chunks and
// the waiting requests' admission (when prefills); see planLocked.
func (s *Server) planStepLocked(batch []stepItem, decodes, prefills bool) ([]stepItem, time.Duration) {
	budget := s.cfg.MaxNumBatchedTokens
	unlimited := budget < 0
	prefill := 0
	positions, read := 0.0, 0.0 // the prefill tokens' positions, summed, and the context the decodes read
	take := func(r *request) {
		n := r.knownTokens() - r.computed
		if r.computed < r.target {
			n = r.target - r.computed
		}
		if !unlimited {
			n = min(n, budget)
		}
		if n <= 0 {
			return
		}
		batch = append(batch, stepItem{r: r, tokens: n})
		budget -= n
		if r.computed < r.target {
			prefill += n
			positions += float64(n) * (float64(r.computed) + float64(n-1)/2)
		} else {
			read += float64(r.computed)
		}
	}
	for i := 0; i < len(s.running) && (unlimited || budget > 0); i++ {
		r := s.running[i]
		decoding := r.computed >= r.target
		if decoding && !decodes || !decoding && !prefills {
			continue
		}
		if decoding {
			// A decode: the block for the token it computes must exist.
			for s.blocksFor(r.computed+1) > len(r.blocks) && r.state == stateRunning {
				if s.kv.free > 0 {
					r.blocks = append(r.blocks, s.kv.allocate())
					continue
				}
				s.preemptLocked(s.running[len(s.running)-1])
			}
			if r.state != stateRunning {
				break // r preempted itself: it was the last one
			}
		}
		take(r)
	}
	loads := 0
	if prefills {
		if s.cfg.Schedule == ScheduleLPM && s.numWaiting > 1 && s.numWaiting <= LPMQueueLimit && len(s.running) < s.cfg.MaxNumSeqs {
			s.sortWaitingLocked()
		}
		for i := s.waitHead; s.numWaiting > 0 && i < len(s.waiting) && len(s.running) < s.cfg.MaxNumSeqs && (unlimited || budget > 0); {
			r := s.waiting[i]
			if r.state == stateDone { // aborted while waiting
				if i == s.waitHead {
					s.popWaitingLocked()
					i = s.waitHead
				} else {
					i++
				}
				continue
			}
			if !s.loraAdmissibleLocked(r) {
				i++ // its adapter has no slot: skipped, like vLLM's scheduler does
				continue
			}
			if !s.admitLocked(r) {
				break // head-of-line blocking, like vLLM's FCFS scheduler
			}
			if s.takeLoRALocked(r) {
				loads++
			}
			if i == s.waitHead {
				s.popWaitingLocked()
				i = s.waitHead
			} else {
				s.waiting = slices.Delete(s.waiting, i, i+1)
			}
			s.numWaiting--
			s.running = append(s.running, r)
			take(r)
		}
		for s.numWaiting == 0 && s.waitHead < len(s.waiting) { // drop trailing tombstones
			s.popWaitingLocked()
		}
	}
	if len(batch) == 0 {
		return batch, 0
	}
	work := float64(prefill)
	if a := s.cfg.AttentionTokens; a > 0 {
		work += positions / float64(a)
	}
	d := time.Duration(work/s.cfg.PrefillTokensPerSec*float64(time.Second)) +
		s.cfg.DecodeStep + s.cfg.DecodeStepPerSeq*time.Duration(len(batch)) +
		time.Duration(float64(s.cfg.DecodeStepPerKToken)*read/1000) +
		s.cfg.LoRALoadTime*time.Duration(loads)
	return batch, d
}

// lpmEntry is a waiting request and the prompt blocks it finds cached (-1: a tombstone).
type lpmEntry struct {
	r    *request
	hits int
}

// sortWaitingLocked orders the waiting queue by the prefix each request finds cached, longest first,
// in arrival order among equals: SGLang's longest-prefix-match schedule, which admits the requests
// that cost least to prefill first.
func (s *Server) sortWaitingLocked() {
	q := s.waiting[s.waitHead:]
	keys := s.lpm[:0]
	for _, r := range q {
		hits := -1
		if r.state != stateDone {
			hits, _ = s.kv.lookup(r.hashes, s.maxHitBlocks(r))
		}
		keys = append(keys, lpmEntry{r, hits})
	}
	slices.SortFunc(keys, func(a, b lpmEntry) int {
		if a.hits != b.hits {
			return b.hits - a.hits
		}
		return int(a.r.arrival - b.r.arrival)
	})
	for i, k := range keys {
		q[i] = k.r
	}
	clear(keys)
	s.lpm = keys[:0]
}

func (s *Server) popWaitingLocked() {
	s.waiting[s.waitHead] = nil
	s.waitHead++
	if s.waitHead == len(s.waiting) {
		s.waiting, s.waitHead = s.waiting[:0], 0
	} else if s.waitHead > 1024 && s.waitHead*2 > len(s.waiting) {
		n := copy(s.waiting, s.waiting[s.waitHead:])
		clear(s.waiting[n:])
		s.waiting, s.waitHead = s.waiting[:n], 0
	}
}

// applyLocked completes a step: every request in the batch has computed its tokens (full prompt
// blocks are published in the prefix cache); those that have now computed everything they know
// sample one output token; finished requests retire. Requests aborted or preempted during the step
// are skipped (a preempted one recomputes later).
func (s *Server) applyLocked(batch []stepItem, d time.Duration) {
	now := time.Now()
	s.steps++
	s.busy += d
	s.lastStep = d
	bs := s.cfg.BlockSize
	finished := false
	for _, it := range batch {
		r := it.r
		if r.state != stateRunning {
			continue
		}
		r.computed += it.tokens
		full := min(r.computed/bs, len(r.hashes))
		for ; r.registered < full; r.registered++ {
			s.kv.register(r.blocks[r.registered], r.hashes[r.registered])
		}
		if r.computed < r.knownTokens() {
			s.setPendingLocked(r)
			continue // more prefill chunks to come
		}
		if r.target > 0 && r.computed == r.target {
			if r.generated.Load() == 0 {
				// vLLM v1 counts a prompt once, at the request's first token: a preempted request
				// recomputing its prompt and output is not prefilling again by that count.
				s.promptTotal += int64(r.promptTokens)
			}
			// Like llama.cpp: the tokens a prefill computed, counted when it ends.
			s.prefilled += int64(r.target - r.admittedAt)
			r.target = 0 // prefill done: decodes from now on
		}
		n := r.generated.Add(1)
		s.outputTotal++
		if n == 1 {
			// Like vLLM v1: each request's time to first token is observed when the token is sampled.
			s.firstTokens++
			s.firstTokenSeconds += now.Sub(r.enqueued).Seconds()
			r.prefillSeconds = max(now.Sub(r.scheduled).Seconds(), 0)
		}
		s.setPendingLocked(r)
		if int(n) == r.maxTokens {
			s.releaseLoRALocked(r)
			s.retireLocked(r)
			s.finished++
			s.finishedPrompt += int64(r.promptTokens)
			s.finishedOutput += n
			s.finishedPrefillSeconds += r.prefillSeconds
			s.finishedComputed += int64(r.promptTokens) - r.cached.Load()
			finished = true
			close(r.done)
			notify(r) // a request's other sequences share the channel: their wait hears this one end
			continue
		}
		if n == 1 || n%int64(s.cfg.TokensPerChunk) == 0 {
			notify(r)
		}
	}
	if finished {
		kept := s.running[:0]
		for _, r := range s.running {
			if r.state == stateRunning {
				kept = append(kept, r)
			}
		}
		clear(s.running[len(kept):])
		s.running = kept
	}
}

// run is the engine goroutine: plan a step, sleep its simulated duration divided by TimeScale on a
// real timer, apply it. Timer lateness is made up on the following steps (bounded), so long runs
// keep the simulated rate. When there is nothing to do it blocks until a request arrives.
func (s *Server) run() {
	defer close(s.exited)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var deadline time.Time
	var batch []stepItem
	const maxLag = 20 * time.Millisecond
	for {
		s.mu.Lock()
		var d time.Duration
		batch, d = s.planLocked(batch[:0])
		s.mu.Unlock()
		if len(batch) == 0 {
			select {
			case <-s.wake:
				continue
			case <-s.stop:
				s.shutdown()
				return
			}
		}
		now := time.Now()
		if now.Sub(deadline) > maxLag {
			deadline = now
		}
		deadline = deadline.Add(time.Duration(float64(d) / s.cfg.TimeScale))
		timer.Reset(time.Until(deadline))
		select {
		case <-timer.C:
		case <-s.stop:
			s.shutdown()
			return
		}
		s.mu.Lock()
		s.applyLocked(batch, d)
		s.mu.Unlock()
		clear(batch)
	}
}

// notify tells the handler waiting on r that it has news (new tokens, or its end), without blocking.
func notify(r *request) {
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// shutdown ends every request with ErrClosed.
func (s *Server) shutdown() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	s.endAllLocked(ErrClosed)
}

// endAllLocked ends every waiting or running request with err and empties the queues.
func (s *Server) endAllLocked(err error) {
	end := func(r *request) {
		if r.state == stateDone {
			return
		}
		s.retireLocked(r)
		r.err = err
		close(r.done)
		notify(r)
	}
	for _, r := range s.running {
		end(r)
	}
	for _, r := range s.waiting[s.waitHead:] {
		end(r)
	}
	s.running, s.waiting, s.waitHead, s.numWaiting = nil, nil, 0, 0
}

// errRestarted ends the requests in flight when the server restarts.
var errRestarted = errors.New("simulated engine restarted")

// Restart simulates the server process restarting, as after a crash or a redeploy: every waiting or
// running request ends with an error (503, or an error event that ends a stream), the KV cache is
// emptied, the counters start again from zero and process_start_time_seconds moves on. Fault knobs
// are kept. Requests that arrive afterwards are served by the new process.
func (s *Server) Restart() {
	s.mu.Lock()
	s.endAllLocked(errRestarted)
	s.kv = newKVCache(s.cfg.NumGPUBlocks)
	s.pendingPrefill = 0
	s.preemptions, s.prefixQueries, s.prefixHits, s.promptTotal, s.outputTotal, s.finished = 0, 0, 0, 0, 0, 0
	s.finishedPrompt, s.finishedOutput, s.prefilled = 0, 0, 0
	s.firstTokens, s.firstTokenSeconds = 0, 0
	s.finishedPrefillSeconds, s.finishedComputed = 0, 0
	s.steps, s.busy, s.lastStep = 0, 0, 0
	// A new start time, even if the clock has not moved on since the last one.
	if now := time.Now(); now.After(s.started) {
		s.started = now
	} else {
		s.started = s.started.Add(time.Millisecond)
	}
	s.mu.Unlock()
	s.requests.Store(0)
	s.failed429.Store(0)
	s.failed5xx.Store(0)
}

// chance reports true with probability p from the seeded RNG.
func (s *Server) chance(p float64) bool {
	if p <= 0 {
		return false
	}
	s.rngMu.Lock()
	defer s.rngMu.Unlock()
	return s.rng.Float64() < p
}

func (s *Server) intN(n int) int {
	s.rngMu.Lock()
	defer s.rngMu.Unlock()
	return s.rng.IntN(n)
}

// Prompt is the simulated tokenization of one request body: its prompt token count and the chained
// hashes of its full blocks. Parse a body once with ParsePrompt and ask several servers with
// CachedPrompt (the benchmark's oracle does this). Immutable and safe to share.
type Prompt struct {
	Tokens    int // prompt tokens
	blockSize int
	hashes    []uint64
}

// ParsePrompt tokenizes an OpenAI request body the way a server with the given block size does (a
// body with "messages" is a chat request). It costs one JSON decode and one hash pass over the prompt.
func ParsePrompt(body []byte, blockSize int) (Prompt, error) {
	if blockSize <= 0 {
		blockSize = 16
	}
	p, err := parseAny(body)
	if err != nil {
		return Prompt{}, err
	}
	return Prompt{Tokens: promptTokens(p.prompt), blockSize: blockSize, hashes: blockHashes(p.prompt, blockSize)}, nil
}

// ErrBlockSize is returned by CachedPrompt for a Prompt parsed with another block size.
var ErrBlockSize = errors.New("prompt parsed with a different block size")

// CachedPrompt returns how many of p's tokens are cached right now, like Cached, without parsing
// again. It holds the engine mutex for one map lookup per block.
func (s *Server) CachedPrompt(p Prompt) (int, error) {
	if p.blockSize != s.cfg.BlockSize {
		return 0, ErrBlockSize
	}
	if p.Tokens == 0 {
		return 0, nil
	}
	s.mu.Lock()
	hits, _ := s.kv.lookup(p.hashes, (p.Tokens-1)/s.cfg.BlockSize)
	s.mu.Unlock()
	return hits * s.cfg.BlockSize, nil
}

// parseAny parses a chat request if the body mentions "messages" and parses as one, else a text
// completion.
func parseAny(body []byte) (parsedRequest, error) {
	if looksLikeChat(body) {
		if p, err := parseRequest(body, true); err == nil {
			return p, nil
		}
	}
	return parseRequest(body, false)
}
