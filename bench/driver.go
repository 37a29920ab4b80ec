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
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, d.baseURL+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return fail(fmt.Errorf("building request: %w", err))
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("Accept", "text/event-stream")
	if req.Conversation != "" {
		hr.Header.Set("X-Conversation-ID", req.Conversation)
	}
	resp, err := d.client.Do(hr)
	if err != nil {
		return fail(fmt.Errorf("sending request: %w", err))
	}
	defer resp.Body.Close()
	r.Status = resp.StatusCode
	r.Matched, _ = strconv.Atoi(resp.Header.Get("X-LLM-Matched-Tokens"))
	r.PolicyPrompt, _ = strconv.Atoi(resp.Header.Get("X-LLM-Prompt-Tokens"))
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		return fail(fmt.Errorf("status %d", resp.StatusCode))
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
