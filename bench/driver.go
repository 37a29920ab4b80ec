package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

// driver sends a workload open-loop: sessions start at Poisson arrival times whatever the
// responses do, and the requests of one session follow each other (a turn is sent when the
// previous one finished).
type driver struct {
	// baseURL is where requests go, e.g. "http://127.0.0.1:8080".
	baseURL string
	client  *http.Client
	model   string
	// rate is the session arrival rate per wall-clock second.
	rate float64
	// timeScale converts a request's simulated think time to wall time (divided by it); 0 means 1.
	timeScale float64
	seed      int64
	// warmup is the number of requests, in send order, excluded from the statistics.
	warmup int
	// onMeasure runs once, when the first measured request is sent (to snapshot counters).
	onMeasure func()
	// onDone runs after every request (progress).
	onDone func()
	// targets, when set, replaces baseURL: each request goes to one of them picked uniformly at
	// random (seeded), as a DNS round robin or an L4 balancer in front of several Caddy instances
	// does. Turns of one conversation may therefore reach different instances.
	targets []string
	// retryUnanswered re-sends a request that got no response at all (connection refused or reset
	// while a Caddy restarts) every 10 ms until one answers or ctx ends, as a client retrying would;
	// the request's TTFT and latency include that wait.
	retryUnanswered bool
	// gate, when set, holds every request (a session's first and its later turns) while it is closed,
	// and delays the arrival schedule by the time it was closed.
	gate *gate

	pickMu sync.Mutex
	pick   *rand.Rand // seeded; picks among targets
}

// target returns the base URL of the next request.
func (d *driver) target() string {
	if len(d.targets) == 0 {
		return d.baseURL
	}
	d.pickMu.Lock()
	defer d.pickMu.Unlock()
	if d.pick == nil {
		d.pick = rand.New(rand.NewPCG(uint64(d.seed), 0x5851f42d4c957f2d))
	}
	return d.targets[d.pick.IntN(len(d.targets))]
}

// run drives every session of w and returns one result per request, in send order.
func (d *driver) run(ctx context.Context, w Workload) []requestResult {
	rng := rand.New(rand.NewPCG(uint64(d.seed), 0x9e3779b97f4a7c15))
	var (
		mu       sync.Mutex
		results  []requestResult
		seq      atomic.Int64
		wg       sync.WaitGroup
		measured sync.Once
	)
	start := time.Now()
	at := time.Duration(0)
	for _, s := range w.Sessions {
		at += time.Duration(rng.ExpFloat64() / d.rate * float64(time.Second))
		scheduled := start.Add(at)
		if wait := time.Until(scheduled); wait > 0 {
			select {
			case <-time.After(wait):
			case <-ctx.Done():
			}
		}
		if ctx.Err() != nil {
			break
		}
		if held := d.gate.wait(ctx); held > 0 {
			start, scheduled = start.Add(held), scheduled.Add(held)
		}
		lag := max(time.Since(scheduled), 0)
		wg.Add(1)
		go func(s Session, lag time.Duration) {
			defer wg.Done()
			for i, req := range s.Requests {
				if req.Think > 0 {
					select {
					case <-time.After(d.wall(req.Think)):
					case <-ctx.Done():
						return
					}
				}
				d.gate.wait(ctx)
				n := int(seq.Add(1)) - 1
				if n == d.warmup && d.onMeasure != nil {
					measured.Do(d.onMeasure)
				}
				r := d.send(ctx, req)
				r.Seq, r.Warmup = n, n < d.warmup
				if i == 0 {
					r.Arrival, r.Lag = true, lag
				}
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
				if d.onDone != nil {
					d.onDone()
				}
				if r.Failed && ctx.Err() != nil {
					return
				}
			}
		}(s, lag)
	}
	wg.Wait()
	if d.onMeasure != nil {
		measured.Do(d.onMeasure) // fewer requests than the warm-up: measure nothing, but snapshot
	}
	return results
}

// gate holds requests while closed (Caddy restarting). The zero value and a nil gate are open.
type gate struct {
	mu     sync.Mutex
	closed chan struct{} // nil while open; closed when the gate opens again
}

// close closes the gate: requests wait in wait until open.
func (g *gate) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed == nil {
		g.closed = make(chan struct{})
	}
}

// open opens the gate and releases every waiting request.
func (g *gate) open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed != nil {
		close(g.closed)
		g.closed = nil
	}
}

// wait returns at once while the gate is open, else when it opens or ctx ends, with the time it waited.
func (g *gate) wait(ctx context.Context) time.Duration {
	if g == nil {
		return 0
	}
	g.mu.Lock()
	ch := g.closed
	g.mu.Unlock()
	if ch == nil {
		return 0
	}
	start := time.Now()
	select {
	case <-ch:
	case <-ctx.Done():
	}
	return time.Since(start)
}

// wall converts a simulated duration to wall time.
func (d *driver) wall(simulated time.Duration) time.Duration {
	if d.timeScale <= 0 {
		return simulated
	}
	return time.Duration(float64(simulated) / d.timeScale)
}

// chatRequest is the JSON body of a streaming chat completion.
type chatRequest struct {
	Model         string        `json:"model"`
	Messages      []Message     `json:"messages"`
	MaxTokens     int           `json:"max_tokens"`
	Stream        bool          `json:"stream"`
	StreamOptions streamOptions `json:"stream_options"`
	IgnoreEOS     bool          `json:"ignore_eos"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// requestBody encodes req as the streaming chat completion the benchmark sends.
func requestBody(model string, req Request) []byte {
	b, err := json.Marshal(chatRequest{
		Model:         model,
		Messages:      req.Messages,
		MaxTokens:     req.MaxTokens,
		Stream:        true,
		StreamOptions: streamOptions{IncludeUsage: true},
		IgnoreEOS:     true,
	})
	if err != nil {
		panic(err) // plain strings and ints always encode
	}
	return b
}

// streamChunk is the part of an OpenAI streaming chunk the benchmark reads.
type streamChunk struct {
	Choices []struct {
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		Text string `json:"text"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error json.RawMessage `json:"error"`
}

// errNoDone is a stream that ended without "data: [DONE]" (a dropped connection).
var errNoDone = errors.New("stream ended without [DONE]")

// maxErrorBody is how much of a failed response's body a request's error keeps.
const maxErrorBody = 200

// send posts one streaming request and measures it the way vLLM's bench serve does: TTFT at the
// first chunk with content, end-to-end latency at [DONE], output tokens from the usage chunk.
func (d *driver) send(ctx context.Context, req Request) requestResult {
	body := requestBody(d.model, req)
	r := requestResult{Sent: time.Now(), MaxTokens: req.MaxTokens}
	fail := func(err error) requestResult {
		r.Failed, r.Err, r.End = true, err.Error(), time.Now()
		r.E2E = r.End.Sub(r.Sent)
		return r
	}
	var resp *http.Response
	for {
		hr, err := http.NewRequestWithContext(ctx, http.MethodPost, d.target()+"/v1/chat/completions", bytes.NewReader(body))
		if err != nil {
			return fail(fmt.Errorf("building request: %w", err))
		}
		hr.Header.Set("Content-Type", "application/json")
		hr.Header.Set("Accept", "text/event-stream")
		if req.Conversation != "" {
			hr.Header.Set("X-Conversation-ID", req.Conversation)
		}
		resp, err = d.client.Do(hr)
		if err == nil {
			break
		}
		if !d.retryUnanswered || ctx.Err() != nil {
			return fail(fmt.Errorf("sending request: %w", err))
		}
		select {
		case <-time.After(10 * time.Millisecond):
		case <-ctx.Done():
		}
	}
	defer resp.Body.Close()
	r.Status = resp.StatusCode
	r.Upstream, r.Conversation = resp.Header.Get("X-Upstream"), req.Conversation
	if at, err := strconv.ParseInt(resp.Header.Get(vllmsim.ArrivedHeader), 10, 64); err == nil && at > r.Sent.UnixNano() {
		r.Proxy = time.Duration(at - r.Sent.UnixNano())
	}
	r.Matched, _ = strconv.Atoi(resp.Header.Get("X-LLM-Matched-Tokens"))
	r.PolicyPrompt, _ = strconv.Atoi(resp.Header.Get("X-LLM-Prompt-Tokens"))
	r.PredictedTTFT, _ = strconv.ParseFloat(resp.Header.Get("X-LLM-Predicted-TTFT"), 64)
	r.Reason = resp.Header.Get("X-LLM-Reason")
	if resp.StatusCode != http.StatusOK {
		// What answered, for Summary.FirstError: the start of the body, the server and the upstream
		// (a run once lost 128 requests to 404s whose source nothing recorded).
		body, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		return fail(fmt.Errorf("status %d from %q (server %q, upstream %q): %q", resp.StatusCode, resp.Request.URL.Host,
			resp.Header.Get("Server"), r.Upstream, body))
	}
	br := bufio.NewReader(resp.Body)
	chunks, done := 0, false
	for !done {
		line, err := br.ReadBytes('\n')
		if len(line) > 0 {
			data, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data: "))
			if ok {
				if bytes.Equal(data, []byte("[DONE]")) {
					done = true
					break
				}
				var c streamChunk
				if err := json.Unmarshal(data, &c); err != nil {
					return fail(fmt.Errorf("decoding chunk: %w", err))
				}
				if len(c.Error) > 0 {
					return fail(errors.New("error event in stream"))
				}
				content := 0
				for _, ch := range c.Choices {
					content += len(ch.Delta.Content) + len(ch.Text)
				}
				if content > 0 {
					if chunks == 0 {
						r.TTFT = time.Since(r.Sent)
					}
					chunks++
					r.ContentBytes += content
				}
				if c.Usage != nil {
					r.PromptTokens, r.OutputTokens = c.Usage.PromptTokens, c.Usage.CompletionTokens
					if c.Usage.PromptTokensDetails != nil {
						r.CachedTokens = c.Usage.PromptTokensDetails.CachedTokens
					}
				}
			}
		}
		if err != nil {
			if err == io.EOF {
				err = errNoDone
			}
			return fail(fmt.Errorf("reading stream: %w", err))
		}
	}
	r.End = time.Now()
	r.E2E = r.End.Sub(r.Sent)
	// The response ends right after [DONE]; anything more is a second stream run into the first.
	rest, _ := io.ReadAll(io.LimitReader(br, 1<<16))
	r.ExtraEvents = bytes.Count(rest, []byte("data:"))
	if chunks == 0 {
		return fail(errors.New("no content in stream"))
	}
	if r.OutputTokens == 0 {
		r.OutputTokens = chunks
	}
	return r
}

// newClient returns an HTTP client for the load generator: keep-alive connections, no
// compression, no overall timeout (streams are bounded by the run's context).
func newClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: 4096,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}}
}
