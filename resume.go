package caddyllm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"mime"
	"net/http"
	"strconv"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/tokenrouter/caddy-llm/tokenize"
)

func init() {
	caddy.RegisterModule(LLMResume{})
	httpcaddyfile.RegisterHandlerDirective("llm_resume", parseResumeCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("llm_resume", httpcaddyfile.Before, "reverse_proxy")
}

const (
	defaultResumeAttempts = 3
	// maxErrorBodyBytes bounds the body kept of a failed attempt's answer, to be replayed if it is the last.
	maxErrorBodyBytes = 64 << 10
	// maxEventBytes bounds one SSE event held while it arrives; a stream with longer events is relayed as
	// it comes and cannot be resumed.
	maxEventBytes = 1 << 20
)

// LLMResume is an HTTP handler that makes completions survive a failing upstream. It goes before
// reverse_proxy and calls it again when an attempt fails:
//
//   - an answer of 429 or 5xx, or no answer (connection error), before anything reached the client: the
//     request is sent again, unchanged. A failed attempt's status and body are never sent.
//   - a stream that breaks before its "data: [DONE]" (the connection drops, or the upstream sends an error
//     event): the request is sent again as a continuation of what the client already has - for chat the
//     partial answer as a final assistant message with vLLM's continue_final_message: true and
//     add_generation_prompt: false, for completions the partial answer appended to the prompt - with
//     max_tokens, max_completion_tokens and min_tokens reduced by the tokens already sent. The new stream's
//     role chunk is dropped, its chunks carry the first stream's id, and its usage chunk adds up, so the
//     client sees one uninterrupted stream with one [DONE].
//
// Each attempt runs reverse_proxy, and so the selection policy, again: lb_policy llm skips the upstreams
// the request already tried. When no attempt succeeds, a client whose stream has started gets an
// OpenAI-style error event (data: {"error": {...}}) and the stream ends; one that has received nothing gets
// the last failure (the upstream's JSON error, or an OpenAI-style JSON error with its status). A stream is
// never silently truncated.
//
// Only POSTs of JSON to the chat/completions, completions, responses and embeddings endpoints are
// handled; other requests, bodies over max_body_bytes and bodies that cannot be read pass through
// untouched. A Responses API request (/v1/responses) is re-sent only while its client has received
// nothing: its answer, whole or a stream of typed events, is relayed as it comes, and a stream that breaks
// is not continued (a continuation body could not carry the stored response it may continue). An
// embeddings request, always answered whole, is re-sent as a whole chat answer is. A streamed answer
// that holds tool calls or reasoning, has several choices (n > 1), or uses structured output is retried
// only while the client has received no content, since a continuation could not be joined to it.
//
// Every request with a failed attempt is counted once in caddy_llm_resumes_total, by outcome: continued,
// retried_whole or failed (a request whose client left is not counted).
//
// The only body it changes is a continuation's, and only as described. Memory per request is bounded by
// max_body_bytes (the kept answer, beyond which the stream is no longer resumable), one SSE event (1 MiB)
// and one failed answer (64 KiB).
type LLMResume struct {
	// MaxAttempts is how many times a request is sent at most, the first included. Default 3.
	MaxAttempts int `json:"max_attempts,omitempty"`

	// MaxBodyBytes is the largest request body read; larger requests pass through untouched. It also
	// bounds the answer text kept to continue a stream (with the request, a continuation is never larger).
	// Use the policy's max_body_bytes: the policy reads the body this handler read. Default 2 MiB, the
	// policy's default.
	MaxBodyBytes int64 `json:"max_body_bytes,omitempty"`

	logger *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (LLMResume) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.llm_resume",
		New: func() caddy.Module { return new(LLMResume) },
	}
}

// Provision sets up the handler.
func (h *LLMResume) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if h.MaxAttempts == 0 {
		h.MaxAttempts = defaultResumeAttempts
	}
	if h.MaxBodyBytes == 0 {
		h.MaxBodyBytes = defaultMaxBodyBytes
	}
	if err := registerResumeMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	return h.Validate()
}

// Validate checks the configuration.
func (h *LLMResume) Validate() error {
	if h.MaxAttempts < 0 {
		return fmt.Errorf("max_attempts must be positive, got %d", h.MaxAttempts)
	}
	if h.MaxBodyBytes < 0 {
		return fmt.Errorf("max_body_bytes must be positive, got %d", h.MaxBodyBytes)
	}
	return nil
}

// ServeHTTP sends r through next until an attempt succeeds or max_attempts have failed.
func (h *LLMResume) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	lr, ok := holdRequest(r, h.MaxBodyBytes)
	if !ok {
		return next.ServeHTTP(w, r) // the request has ended, its client gone: the policy says so
	}
	defer lr.drop() // orig, below, is the received body's bytes
	if lr.api == tokenize.APIUnknown || lr.body == nil || lr.decoded == nil {
		return next.ServeHTTP(w, r)
	}
	req, err := parseResumable(lr.decoded, lr.api)
	if err != nil {
		return next.ServeHTTP(w, r) // the upstream tells the client what is wrong with it
	}
	orig := lr.decoded // replaceRequestBody changes lr's fields, never the bytes they pointed to
	rl := &relay{client: w, r: r, req: req, maxText: max(h.MaxBodyBytes-int64(len(orig)), 0)}
	continuedStream := false // an attempt continued a broken stream
	for attempt := 1; ; attempt++ {
		rl.begin()
		req := r
		if attempt > 1 {
			req = ownVars(r)
		}
		err, aborted := rl.serve(next, req)
		if attempt == 1 {
			rl.promptTokens = parsedPromptTokens(lr, orig)
		}
		if rl.clientErr != nil || r.Context().Err() != nil {
			// The client is gone: there is nobody to resume for.
			if aborted {
				panic(http.ErrAbortHandler)
			}
			return err
		}
		switch rl.outcome(err, aborted) {
		case attemptSucceeded:
			if attempt > 1 {
				countResume(continuedStream)
			}
			return nil
		case attemptPassedThrough:
			if attempt > 1 {
				// A re-sent request got an answer this handler does not retry (a 400, say): it failed
				// unless that answer is a success.
				if aborted || rl.status >= http.StatusBadRequest || rl.status == 0 {
					resumeCounters[resumeFailed].Inc()
				} else {
					countResume(continuedStream)
				}
			}
			if aborted {
				panic(http.ErrAbortHandler) // a committed non-streaming answer broke: nothing to add
			}
			return err
		case attemptRetryable:
			if rl.finished {
				resumeCounters[resumeContinued].Inc()
				return rl.finishWithDone() // only the end of the stream is missing
			}
			if attempt < h.MaxAttempts && rl.resumable() {
				done, err := rl.prepareNext(orig, lr)
				if err == nil && done {
					// Every token it asked for was sent; only the end was lost, its finish reason
					// with it: the limit ended it.
					resumeCounters[resumeContinued].Inc()
					rl.sendFinish("length")
					return rl.finishWithDone()
				}
				if err == nil {
					continuedStream = continuedStream || len(rl.text) > 0
					if c := h.logger.Check(zapcore.DebugLevel, "resuming request"); c != nil {
						c.Write(zap.Int("attempt", attempt+1), zap.Int("status", rl.failStatus),
							zap.Int("sent_tokens", rl.sent()), zap.Bool("continuation", len(rl.text) > 0))
					}
					continue
				}
				h.logger.Debug("cannot build continuation", zap.Error(err))
			}
		}
		if c := h.logger.Check(zapcore.DebugLevel, "request failed after resuming"); c != nil {
			c.Write(zap.Int("attempts", attempt), zap.Int("status", rl.failStatus),
				zap.Int("sent_tokens", rl.sent()), zap.Bool("stream_started", rl.committed))
		}
		resumeCounters[resumeFailed].Inc()
		return rl.fail(attempt)
	}
}

// countResume counts a request that succeeded after at least one failed attempt.
func countResume(continuedStream bool) {
	if continuedStream {
		resumeCounters[resumeContinued].Inc()
	} else {
		resumeCounters[resumeRetriedWhole].Inc()
	}
}

// resumeRequest is what the handler needs to know of a request body.
type resumeRequest struct {
	api tokenize.API
	// stream: the answer is a stream of chat or completions chunks, followed event by event.
	stream       bool
	includeUsage bool // stream_options.include_usage
	// continuable: a broken stream can be continued (one choice, a text prompt, no structured output).
	continuable bool
}

// parseResumable reads the fields of body that decide how it can be resumed.
func parseResumable(body []byte, api tokenize.API) (*resumeRequest, error) {
	var b struct {
		Stream        bool `json:"stream"`
		StreamOptions *struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
		N                 *int                   `json:"n"`
		BestOf            *int                   `json:"best_of"`
		Echo              bool                   `json:"echo"`
		Prompt            json.RawMessage        `json:"prompt"`
		ResponseFormat    *struct{ Type string } `json:"response_format"`
		GuidedJSON        json.RawMessage        `json:"guided_json"`
		GuidedRegex       json.RawMessage        `json:"guided_regex"`
		GuidedChoice      json.RawMessage        `json:"guided_choice"`
		GuidedGrammar     json.RawMessage        `json:"guided_grammar"`
		StructuredOutputs json.RawMessage        `json:"structured_outputs"`
	}
	if api == tokenize.APIResponses || api == tokenize.APIEmbeddings {
		// A response's typed events (response.created, response.output_text.delta, ...), maybe continuing a
		// stored response (previous_response_id), and embeddings, always whole: the answer goes to the
		// client as it comes, so the request is re-sent only while the client has nothing.
		return &resumeRequest{api: api}, nil
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return nil, fmt.Errorf("reading request: %w", err)
	}
	req := &resumeRequest{api: api, stream: b.Stream, continuable: true}
	req.includeUsage = b.StreamOptions != nil && b.StreamOptions.IncludeUsage
	switch {
	case b.N != nil && *b.N > 1, b.BestOf != nil && *b.BestOf > 1, b.Echo:
		req.continuable = false
	case b.ResponseFormat != nil && b.ResponseFormat.Type != "" && b.ResponseFormat.Type != "text":
		req.continuable = false
	case isSet(b.GuidedJSON) || isSet(b.GuidedRegex) || isSet(b.GuidedChoice) || isSet(b.GuidedGrammar) ||
		isSet(b.StructuredOutputs):
		req.continuable = false
	case api == tokenize.APICompletions:
		var prompt string
		req.continuable = json.Unmarshal(b.Prompt, &prompt) == nil || onePrompt(b.Prompt)
	}
	return req, nil
}

// onePrompt reports whether a completions prompt is an array of exactly one string.
func onePrompt(raw json.RawMessage) bool {
	var prompts []string
	return json.Unmarshal(raw, &prompts) == nil && len(prompts) == 1
}

func isSet(raw json.RawMessage) bool { return len(raw) > 0 && !bytes.Equal(raw, []byte("null")) }

// continuationBody returns orig changed to continue after text, of which sent tokens were generated: text
// as the final assistant message (chat) or appended to the prompt (completions), and the token limits
// reduced by sent. done reports that the limits left nothing to generate.
func continuationBody(orig []byte, api tokenize.API, text []byte, sent int) (body []byte, done bool, err error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(orig, &fields); err != nil {
		return nil, false, fmt.Errorf("decoding request: %w", err)
	}
	for _, key := range []string{"max_tokens", "max_completion_tokens", "min_tokens"} {
		raw, ok := fields[key]
		if !ok || !isSet(raw) {
			continue
		}
		var n int
		if err := json.Unmarshal(raw, &n); err != nil {
			return nil, false, fmt.Errorf("decoding %s: %w", key, err)
		}
		left := n - sent
		if left <= 0 && key != "min_tokens" {
			return nil, true, nil
		}
		fields[key] = strconv.AppendInt(nil, int64(max(left, 0)), 10)
	}
	if api == tokenize.APIChat {
		var messages []json.RawMessage
		if err := json.Unmarshal(fields["messages"], &messages); err != nil {
			return nil, false, fmt.Errorf("decoding messages: %w", err)
		}
		msg, err := continuedMessage(fields, messages, text)
		if err != nil {
			return nil, false, err
		}
		if msg.replaceLast {
			messages[len(messages)-1] = msg.raw
		} else {
			messages = append(messages, msg.raw)
		}
		if fields["messages"], err = json.Marshal(messages); err != nil {
			return nil, false, err
		}
		fields["continue_final_message"] = json.RawMessage("true")
		fields["add_generation_prompt"] = json.RawMessage("false")
	} else {
		var prompt string
		array := false
		if err := json.Unmarshal(fields["prompt"], &prompt); err != nil {
			var prompts []string
			if err := json.Unmarshal(fields["prompt"], &prompts); err != nil || len(prompts) != 1 {
				return nil, false, errors.New("prompt is not one string")
			}
			prompt, array = prompts[0], true
		}
		prompt += string(text)
		var v any = prompt
		if array {
			v = []string{prompt}
		}
		if fields["prompt"], err = json.Marshal(v); err != nil {
			return nil, false, err
		}
	}
	body, err = json.Marshal(fields)
	return body, false, err
}

type continued struct {
	raw         json.RawMessage
	replaceLast bool
}

// continuedMessage returns the assistant message carrying text: a new one, or - when the client itself
// asked to continue its final assistant message - that message with text appended.
func continuedMessage(fields map[string]json.RawMessage, messages []json.RawMessage, text []byte) (continued, error) {
	if bytes.Equal(fields["continue_final_message"], []byte("true")) && len(messages) > 0 {
		var last map[string]json.RawMessage
		var role, content string
		if json.Unmarshal(messages[len(messages)-1], &last) == nil &&
			json.Unmarshal(last["role"], &role) == nil && role == "assistant" &&
			json.Unmarshal(last["content"], &content) == nil {
			last["content"], _ = json.Marshal(content + string(text))
			raw, err := json.Marshal(last)
			return continued{raw: raw, replaceLast: true}, err
		}
	}
	raw, err := json.Marshal(struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}{"assistant", string(text)})
	return continued{raw: raw}, err
}

// attemptOutcome is how one attempt ended.
type attemptOutcome int

const (
	attemptSucceeded     attemptOutcome = iota // the answer is complete
	attemptPassedThrough                       // an answer this handler does not retry went to the client
	attemptRetryable                           // failed in a way another attempt may fix
	attemptFatal                               // failed in a way another attempt cannot fix
)

// relayMode is what the relay does with an attempt's response.
type relayMode int

const (
	modeNone        relayMode = iota // no status yet
	modeFailed                       // a failure: kept (bounded) and not sent
	modePassthrough                  // sent to the client as it comes
	modeStream                       // a completion stream: relayed event by event
	modeOpaque                       // a stream that could not be followed: sent as it comes
)

// relay is the http.ResponseWriter every attempt writes to; it owns the client's ResponseWriter. It is
// used by one request: the reverse proxy may call Flush from a timer goroutine, but serializes it with
// Write; the mutex makes that independent of the proxy's internals.
type relay struct {
	mu     sync.Mutex
	client http.ResponseWriter
	r      *http.Request
	req    *resumeRequest

	committed bool // the client has the response headers
	clientErr error

	// The current attempt.
	header         http.Header
	status         int
	mode           relayMode
	errBody        []byte // a failed answer's body, up to maxErrorBodyBytes
	errTruncated   bool
	pending        []byte // bytes of an event not yet complete
	scanned        int    // pending[:scanned] holds no event end
	attemptDone    bool   // the stream's [DONE] went to the client
	attemptTokens  int    // tokens relayed in this attempt: one per content chunk, or what its continuous usage adds
	attemptID      string // the attempt's response id
	upstreamFailed bool   // the upstream sent an error event
	failStatus     int    // the status the failure is reported with

	// The whole response.
	text        []byte // content sent to the client, while it fits maxText
	maxText     int64
	textFull    bool   // text outgrew maxText: the stream cannot be continued
	sentTokens  int    // tokens sent to the client, one per content chunk but where vLLM's continuous usage counts them
	sentText    int    // tokens of the content sent to the client by tokenize.Estimate (see sent)
	usageCounts bool   // a content chunk carried vLLM's continuous usage: sentTokens is exact
	tokensAtTry int    // sent() when the current attempt began (the continuation's starting point)
	unjoinable  bool   // the stream holds something a continuation cannot join (tool calls, reasoning, n > 1)
	sentOutput  bool   // the client has output (content, tool calls, ...), not only role chunks
	continuing  bool   // the current attempt continues a stream the client already receives
	finished    bool   // a choice's finish_reason was sent
	id          string // the first stream's id, created and model
	created     int64
	model       string
	usageSent   bool // a usage chunk went to the client
	// promptTokens is the request's prompt as the policy counted it, for a usage chunk that was lost.
	promptTokens int
	lastError    []byte      // the current attempt's upstream error event (JSON)
	chunk        streamChunk // the chunk being read, kept for its choices' storage
}

// begin resets the per-attempt state.
func (rl *relay) begin() {
	rl.header = rl.client.Header().Clone()
	if rl.header == nil {
		rl.header = make(http.Header)
	}
	rl.status, rl.mode = 0, modeNone
	rl.errBody, rl.errTruncated = rl.errBody[:0], false
	rl.pending, rl.scanned = rl.pending[:0], 0
	rl.attemptDone, rl.attemptTokens, rl.attemptID = false, 0, ""
	rl.upstreamFailed, rl.lastError = false, nil
	rl.tokensAtTry = rl.sent()
	rl.continuing = rl.committed
}

// sent is how many tokens the client has been sent: one per content chunk (or as vLLM's continuous usage
// counts them), unless the chunks' text holds clearly more, 1.5x by estimate (tokenize.Estimate, within
// about 20% of a tokenizer on prose, and lower on JSON and Chinese): then chunks carry several tokens each
// (vLLM's --stream-interval, speculative decoding) and the estimate is the count. A continuation asks for
// the client's max_tokens less this many: counted one per chunk, a stream of 8-token chunks cut halfway
// was continued with 7/16 of max_tokens too many. A stream of one token per chunk keeps its exact count
// (and the usage reported for it) while its text estimates within 1.5x of it, and one counted by vLLM's
// continuous usage keeps that count whatever its text estimates.
func (rl *relay) sent() int {
	if !rl.usageCounts && 2*rl.sentText > 3*rl.sentTokens {
		return rl.sentText
	}
	return rl.sentTokens
}

// serve runs one attempt, recovering the panic with which the reverse proxy aborts a response whose body
// it could not copy. Any other panic goes on.
func (rl *relay) serve(next caddyhttp.Handler, r *http.Request) (err error, aborted bool) {
	defer func() {
		if v := recover(); v != nil {
			if v != http.ErrAbortHandler { //nolint:errorlint // the sentinel is panicked as is
				panic(v)
			}
			aborted = true
		}
	}()
	return next.ServeHTTP(rl, r), false
}

// ownVars returns r with a copy of its request variables, for an attempt after the first. reverse_proxy
// writes a variable on every call, while the transport may still be dialing for an earlier attempt on
// another goroutine, reading them. The copy shares the values: the policy's llmRequest (the upstreams
// tried, the reservation) is the same.
func ownVars(r *http.Request) *http.Request {
	vars, ok := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
	if !ok {
		return r
	}
	return r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, maps.Clone(vars)))
}

// outcome classifies the attempt that just returned err, or aborted.
func (rl *relay) outcome(err error, aborted bool) attemptOutcome {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	switch rl.mode {
	case modeNone:
		if err == nil {
			if rl.committed {
				rl.failStatus = http.StatusBadGateway
				return attemptRetryable
			}
			return attemptPassedThrough // the chain answered nothing: nothing to retry
		}
		rl.failStatus = http.StatusBadGateway
		var he caddyhttp.HandlerError
		if errors.As(err, &he) && he.StatusCode != 0 {
			rl.failStatus = he.StatusCode
		}
		if !retryableStatus(rl.failStatus) && !rl.committed {
			return attemptPassedThrough
		}
		return attemptRetryable
	case modeFailed:
		rl.failStatus = rl.status
		if retryableStatus(rl.status) {
			return attemptRetryable
		}
		return attemptFatal
	case modePassthrough, modeOpaque:
		return attemptPassedThrough
	}
	// modeStream
	if !rl.attemptDone && !aborted && err == nil && len(rl.pending) > 0 {
		// The upstream ended the stream cleanly without the blank line after its last event. (Of a stream
		// that broke, the incomplete event is dropped: the client never gets half an event.)
		rl.relayEvent(append(rl.pending, "\n\n"...))
		rl.pending = rl.pending[:0]
	}
	if rl.attemptDone {
		return attemptSucceeded
	}
	rl.failStatus = http.StatusBadGateway
	if rl.upstreamFailed {
		rl.failStatus = http.StatusServiceUnavailable
	}
	return attemptRetryable
}

func retryableStatus(code int) bool { return code == http.StatusTooManyRequests || code >= 500 }

// resumable reports whether another attempt can give the client what it is missing.
func (rl *relay) resumable() bool {
	if !rl.sentOutput {
		return true // at most role chunks reached the client
	}
	return rl.req.continuable && !rl.unjoinable && !rl.textFull
}

// prepareNext sets up r for the next attempt: the same body, or a continuation of the text sent so far.
// done reports that the stream needs no more tokens and only its end is missing.
func (rl *relay) prepareNext(orig []byte, lr *llmRequest) (done bool, err error) {
	if len(rl.text) == 0 {
		lr.installBody(rl.r) // a fresh reader: the last attempt may have read it
		return false, nil
	}
	body, done, err := continuationBody(orig, rl.req.api, rl.text, rl.sent())
	if err != nil || done {
		return done, err
	}
	rl.r.Header.Del("Content-Encoding") // the continuation is built from the decoded body
	replaceRequestBody(rl.r, body)
	return false, nil
}

// parsedPromptTokens returns the prompt tokens of the request as the policy counted them, or else by
// estimate. Call it before the body is replaced.
func parsedPromptTokens(lr *llmRequest, orig []byte) int {
	for _, p := range lr.parses {
		if p.req != nil {
			return p.req.PromptTokens
		}
	}
	if req, err := tokenize.Parse(orig, lr.api, tokenize.Options{Encoding: "approx"}); err == nil {
		return req.PromptTokens
	}
	return 0
}

// sendFinish sends the client the chunk that ends the stream's choice with reason, unless one was sent:
// a stream cut after its last token but before its finish reason must still end with one (the OpenAI
// clients report a missing finish reason as an incomplete answer).
func (rl *relay) sendFinish(reason string) {
	if rl.finished {
		return
	}
	var choice any = struct {
		Index        int    `json:"index"`
		Text         string `json:"text"`
		FinishReason string `json:"finish_reason"`
	}{FinishReason: reason}
	if rl.req.api == tokenize.APIChat {
		choice = struct {
			Index        int      `json:"index"`
			Delta        struct{} `json:"delta"`
			FinishReason string   `json:"finish_reason"`
		}{FinishReason: reason}
	}
	if rl.writeOwnChunk([]any{choice}, nil) {
		rl.finished = true
	}
}

// ownChunk is a chunk of the stream that this handler writes itself, under the stream's id, creation time
// and model: a finish reason or the usage.
type ownChunk struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []any  `json:"choices"`
	Usage   any    `json:"usage,omitempty"`
}

// writeOwnChunk writes the client a chunk of the stream with choices and usage (nil: none), and reports
// whether it did.
func (rl *relay) writeOwnChunk(choices []any, usage any) bool {
	object := "text_completion"
	if rl.req.api == tokenize.APIChat {
		object = "chat.completion.chunk"
	}
	chunk, err := json.Marshal(ownChunk{rl.id, object, rl.created, rl.model, choices, usage})
	if err != nil {
		return false
	}
	rl.writeClient(sseEvent(chunk))
	return true
}

// finishWithDone ends a stream whose content is complete but whose end was lost: the usage chunk, if the
// client asked for one (its prompt tokens counted by the policy, as the upstream's count was lost), and
// [DONE].
func (rl *relay) finishWithDone() error {
	if rl.req.includeUsage && !rl.usageSent {
		type usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
			TotalTokens      int `json:"total_tokens"`
		}
		sent := rl.sent()
		rl.writeOwnChunk([]any{}, usage{rl.promptTokens, sent, rl.promptTokens + sent})
	}
	rl.writeClient([]byte("data: [DONE]\n\n"))
	rl.flushClient()
	return nil
}

// fail tells the client that no attempt succeeded: an error event if its stream has started, else the
// last failure as an error response.
func (rl *relay) fail(attempts int) error {
	status := rl.failStatus
	if status == 0 {
		status = http.StatusBadGateway
	}
	msg := fmt.Sprintf("upstream failed after %d attempts (last status %d)", attempts, status)
	if rl.committed {
		event := rl.lastError
		if event == nil {
			event = appendOpenAIError(nil, status, msg)
		}
		rl.writeClient(sseEvent(event))
		rl.flushClient()
		return nil
	}
	if rl.mode == modeFailed && !rl.errTruncated && len(rl.errBody) > 0 && isJSON(rl.header.Get("Content-Type")) {
		h := rl.client.Header()
		h.Set("Content-Type", rl.header.Get("Content-Type"))
		h.Set("Content-Length", strconv.Itoa(len(rl.errBody)))
		rl.client.WriteHeader(status)
		_, _ = rl.client.Write(rl.errBody)
		return nil
	}
	body := appendOpenAIError(nil, status, msg)
	h := rl.client.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	rl.client.WriteHeader(status)
	_, _ = rl.client.Write(body)
	return nil
}

func isJSON(contentType string) bool {
	mt, _, err := mime.ParseMediaType(contentType)
	return err == nil && mt == "application/json"
}

// appendOpenAIError appends an OpenAI-style error object.
func appendOpenAIError(buf []byte, status int, msg string) []byte {
	typ := "server_error"
	if status == http.StatusTooManyRequests {
		typ = "rate_limit_error"
	}
	b, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": msg, "type": typ, "param": nil, "code": status,
	}})
	return append(buf, b...)
}

// Header returns the current attempt's header map; the client gets it when the response is committed.
func (rl *relay) Header() http.Header { return rl.header }

// WriteHeader decides what to do with the attempt's response. Informational responses are not relayed, and
// the headers of an attempt after the first that reached the client are dropped.
func (rl *relay) WriteHeader(code int) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	rl.writeHeaderLocked(code)
}

func (rl *relay) writeHeaderLocked(code int) {
	if rl.status != 0 || code < 200 {
		return
	}
	rl.status = code
	switch {
	case retryableStatus(code):
		rl.mode = modeFailed
	case rl.committed:
		// A continuation must be a stream too; anything else (a 400 for a continuation too long, say) fails.
		if code == http.StatusOK && rl.req.stream && isEventStream(rl.header.Get("Content-Type")) {
			rl.mode = modeStream
		} else {
			rl.mode = modeFailed
		}
	case code == http.StatusOK && rl.req.stream && isEventStream(rl.header.Get("Content-Type")):
		rl.mode = modeStream // committed with its first event: the stream may yet fail before any
	default:
		rl.mode = modePassthrough
		rl.commitLocked()
		rl.header = rl.client.Header() // later header changes (trailers) go to the client
	}
}

func isEventStream(contentType string) bool {
	mt, _, err := mime.ParseMediaType(contentType)
	return err == nil && mt == "text/event-stream"
}

// commitLocked sends the current attempt's status and headers to the client.
func (rl *relay) commitLocked() {
	h := rl.client.Header()
	clear(h)
	for k, v := range rl.header {
		h[k] = v
	}
	if rl.mode == modeStream {
		h.Del("Content-Length") // events are dropped and rewritten
	}
	rl.client.WriteHeader(rl.status)
	rl.committed = true
}

// Write takes the attempt's response body.
func (rl *relay) Write(p []byte) (int, error) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	if rl.status == 0 {
		rl.writeHeaderLocked(http.StatusOK)
	}
	switch rl.mode {
	case modeFailed:
		room := maxErrorBodyBytes - len(rl.errBody)
		if len(p) > room {
			rl.errTruncated = true
		}
		rl.errBody = append(rl.errBody, p[:min(len(p), max(room, 0))]...)
		return len(p), nil
	case modePassthrough, modeOpaque:
		n, err := rl.client.Write(p)
		if err != nil {
			rl.clientErr = err
		}
		return n, err
	case modeStream:
		rl.pending = append(rl.pending, p...)
		rl.relayEvents()
		if rl.clientErr != nil {
			return 0, rl.clientErr
		}
		return len(p), nil
	}
	return len(p), nil // modeNone cannot happen: the status was set above
}

// Flush flushes what was sent to the client.
func (rl *relay) Flush() { _ = rl.FlushError() }

// FlushError flushes what was sent to the client, if anything was.
func (rl *relay) FlushError() error {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	if !rl.committed || rl.mode == modeFailed {
		return nil
	}
	return rl.flushClientLocked()
}

// Unwrap returns the client's ResponseWriter, for http.ResponseController.
func (rl *relay) Unwrap() http.ResponseWriter { return rl.client }

func (rl *relay) flushClient() {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	_ = rl.flushClientLocked()
}

func (rl *relay) flushClientLocked() error {
	err := http.NewResponseController(rl.client).Flush()
	if err != nil && !errors.Is(err, http.ErrNotSupported) && rl.clientErr == nil {
		rl.clientErr = err
	}
	return err
}

// writeClient sends bytes to the client, committing the response first if needed.
func (rl *relay) writeClient(b []byte) {
	if rl.clientErr != nil {
		return
	}
	if !rl.committed {
		rl.commitLocked()
	}
	if _, err := rl.client.Write(b); err != nil {
		rl.clientErr = err
	}
}

// relayEvents sends the complete events in pending, as they are or changed, and keeps the rest.
func (rl *relay) relayEvents() {
	start := 0
	for {
		end := eventEnd(rl.pending, max(start, rl.scanned))
		if end < 0 {
			break
		}
		rl.relayEvent(rl.pending[start:end])
		start = end
		rl.scanned = end
	}
	rl.pending = append(rl.pending[:0], rl.pending[start:]...)
	rl.scanned = max(rl.scanned-start, len(rl.pending)-2, 0)
	if len(rl.pending) > maxEventBytes {
		// Not a stream this handler can follow: send it on as it comes.
		rl.mode = modeOpaque
		rl.unjoinable, rl.sentOutput = true, true
		rl.writeClient(rl.pending)
		rl.pending = rl.pending[:0]
	}
}

// eventEnd returns the index just past the blank line that ends the first event in b, looking from from
// on; -1 if b holds no complete event. Lines end with \n or \r\n.
func eventEnd(b []byte, from int) int {
	for i := from; ; {
		j := bytes.IndexByte(b[i:], '\n')
		if j < 0 {
			return -1
		}
		k := i + j + 1 // just past this newline
		switch {
		case k < len(b) && b[k] == '\n':
			return k + 1
		case k+1 < len(b) && b[k] == '\r' && b[k+1] == '\n':
			return k + 2
		}
		i = k
	}
}

// streamChunk is what the relay reads of a chat or text completion chunk.
// Decoding one costs a few microseconds and about ten allocations (the strings); the relay reuses its
// choices, and reads the id, created and model (streamHead) only from an attempt's first chunk.
type streamChunk struct {
	Choices []struct {
		Index int `json:"index"`
		Delta struct {
			Role             string          `json:"role"`
			Content          string          `json:"content"`
			ToolCalls        json.RawMessage `json:"tool_calls"`
			ReasoningContent string          `json:"reasoning_content"`
			Reasoning        string          `json:"reasoning"`
		} `json:"delta"`
		Text         string `json:"text"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens *int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error json.RawMessage `json:"error"`
}

type streamHead struct {
	ID      string `json:"id"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
}

// relayEvent handles one complete event (its blank line included).
func (rl *relay) relayEvent(ev []byte) {
	data, ok := eventData(ev)
	if !ok {
		rl.writeClient(ev) // a comment or a field this handler does not read
		return
	}
	if bytes.Equal(data, []byte("[DONE]")) {
		if !rl.upstreamFailed {
			rl.writeClient(ev)
			rl.attemptDone = true
		}
		return
	}
	if rl.upstreamFailed {
		return // what follows an error event belongs to a failed attempt
	}
	choices := rl.chunk.Choices[:cap(rl.chunk.Choices)]
	clear(choices) // the decoder fills reused elements without zeroing them
	rl.chunk = streamChunk{Choices: choices[:0]}
	chunk := &rl.chunk
	if err := json.Unmarshal(data, chunk); err != nil {
		rl.unjoinable, rl.sentOutput = true, true // not a chunk this handler reads: sent on, not continuable
		rl.writeClient(ev)
		return
	}
	if isSet(chunk.Error) {
		rl.upstreamFailed = true
		rl.lastError = append(rl.lastError[:0], data...)
		return
	}
	if rl.attemptID == "" {
		var head streamHead
		_ = json.Unmarshal(data, &head) // it decoded as a chunk
		rl.attemptID = head.ID
		if rl.id == "" {
			rl.id, rl.created, rl.model = head.ID, head.Created, head.Model
		}
	}
	var content string
	role, finish := false, false
	for _, c := range chunk.Choices {
		if c.Index > 0 {
			rl.unjoinable = true
		}
		finish = finish || c.FinishReason != ""
		text := c.Text
		if d := &c.Delta; rl.req.api == tokenize.APIChat {
			text = d.Content
			role = role || d.Role != ""
			if isSet(d.ToolCalls) || d.ReasoningContent != "" || d.Reasoning != "" {
				rl.unjoinable = true
			}
		}
		content += text
	}
	// The attempt's final usage chunk (stream_options.include_usage): no choices, only the usage.
	finalUsage := len(chunk.Choices) == 0 && chunk.Usage != nil
	tokens := 0
	if content != "" {
		tokens = 1
		if chunk.Usage != nil && len(chunk.Choices) > 0 {
			// vLLM's continuous_usage_stats: the usage so far, in every chunk; what it counts beyond the
			// tokens counted, and a chunk with content one at least (as observedBody.endEvent counts).
			tokens = max(chunk.Usage.CompletionTokens-rl.attemptTokens, 1)
			rl.usageCounts = true
		}
	}
	out := ev
	switch {
	case role && rl.continuing:
		// The new stream's role chunk: the client has had one.
		if content == "" && !finish && !rl.unjoinable {
			return
		}
		out = rewriteChunk(data, dropRole)
	case finalUsage && rl.tokensAtTry > 0:
		// The usage of a continuation: count the whole answer.
		before := rl.tokensAtTry
		out = rewriteChunk(data, func(fields map[string]json.RawMessage) { addUsage(fields, before) })
	}
	if rl.continuing && rl.attemptID != rl.id && plainJSONString(rl.attemptID) && plainJSONString(rl.id) {
		out = bytes.Replace(out, []byte(`"id":"`+rl.attemptID+`"`), []byte(`"id":"`+rl.id+`"`), 1)
	}
	rl.writeClient(out)
	rl.finished = rl.finished || finish
	rl.usageSent = rl.usageSent || finalUsage
	if u := chunk.Usage; finalUsage && u.PromptTokensDetails != nil && u.PromptTokensDetails.CachedTokens != nil {
		noteCached(rl.r, u.PromptTokens, *u.PromptTokensDetails.CachedTokens)
	}
	if content != "" || rl.unjoinable {
		rl.sentOutput = true
	}
	if content != "" {
		rl.keepText(content)
		noteToken(rl.r, tokens) // the first also ends this attempt's prefill phase
		rl.attemptTokens += tokens
		rl.sentTokens += tokens
		rl.sentText += tokenize.Estimate(content)
	} else if finalUsage && rl.attemptTokens > 0 && chunk.Usage.CompletionTokens > rl.attemptTokens {
		// The attempt's final usage counts more tokens than its chunks did (chunks of several tokens):
		// the service model learns the whole output, as from transport llm (observedBody.endEvent). A
		// continuation is shortened by sent(): a stream cut before its usage chunk never shows one.
		noteToken(rl.r, chunk.Usage.CompletionTokens-rl.attemptTokens)
	}
}

// keepText keeps content sent to the client, to continue from, while it fits the cap.
func (rl *relay) keepText(content string) {
	if rl.textFull {
		return
	}
	if int64(len(rl.text)+len(content)) > rl.maxText {
		rl.textFull, rl.text = true, nil
		return
	}
	rl.text = append(rl.text, content...)
}

// eventData returns the data of an SSE event (its data lines joined by newlines), and whether it has any.
func eventData(ev []byte) (data []byte, ok bool) {
	for len(ev) > 0 {
		line := ev
		if i := bytes.IndexByte(ev, '\n'); i >= 0 {
			line, ev = ev[:i], ev[i+1:]
		} else {
			ev = nil
		}
		line = bytes.TrimSuffix(line, []byte("\r"))
		v, found := bytes.CutPrefix(line, []byte("data:"))
		if !found {
			continue
		}
		v = bytes.TrimPrefix(v, []byte(" "))
		if ok {
			data = append(append(bytes.Clone(data), '\n'), v...)
		} else {
			data, ok = v, true
		}
	}
	return data, ok
}

// rewriteChunk returns the event carrying data changed by edit (or unchanged, if it is not an object).
func rewriteChunk(data []byte, edit func(fields map[string]json.RawMessage)) []byte {
	var fields map[string]json.RawMessage
	if json.Unmarshal(data, &fields) == nil {
		edit(fields)
		if b, err := json.Marshal(fields); err == nil {
			data = b
		}
	}
	return sseEvent(data)
}

// sseEvent frames data as one server-sent event: "data: ", data, a blank line.
func sseEvent(data []byte) []byte {
	return append(append([]byte("data: "), data...), "\n\n"...)
}

// dropRole removes the role from every choice's delta.
func dropRole(fields map[string]json.RawMessage) {
	var choices []map[string]json.RawMessage
	if json.Unmarshal(fields["choices"], &choices) != nil {
		return
	}
	for _, c := range choices {
		var delta map[string]json.RawMessage
		if json.Unmarshal(c["delta"], &delta) != nil {
			continue
		}
		delete(delta, "role")
		c["delta"], _ = json.Marshal(delta)
	}
	fields["choices"], _ = json.Marshal(choices)
}

// addUsage makes a continuation's usage count the whole answer: the before tokens sent earlier are
// completion tokens, not prompt tokens, as they are in the continuation's prompt. The total is unchanged.
func addUsage(fields map[string]json.RawMessage, before int) {
	var usage map[string]json.RawMessage
	if json.Unmarshal(fields["usage"], &usage) != nil {
		return
	}
	var prompt, completion int
	if json.Unmarshal(usage["prompt_tokens"], &prompt) != nil || json.Unmarshal(usage["completion_tokens"], &completion) != nil {
		return
	}
	moved := min(before, prompt)
	prompt, completion = prompt-moved, completion+before
	usage["prompt_tokens"] = strconv.AppendInt(nil, int64(prompt), 10)
	usage["completion_tokens"] = strconv.AppendInt(nil, int64(completion), 10)
	usage["total_tokens"] = strconv.AppendInt(nil, int64(prompt+completion), 10)
	fields["usage"], _ = json.Marshal(usage)
}

// plainJSONString reports whether s is non-empty and needs no escaping in JSON.
func plainJSONString(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c == '"' || c == '\\' || c >= 0x80 {
			return false
		}
	}
	return s != ""
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	llm_resume [<matcher>] {
//		max_attempts  <n>
//		max_body_size <size>
//	}
func (h *LLMResume) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		option := d.Val()
		val, err := oneArg(d)
		if err != nil {
			return err
		}
		switch option {
		case "max_attempts":
			if h.MaxAttempts != 0 {
				return d.Err("max_attempts already specified")
			}
			h.MaxAttempts, err = parseCount(d, option, val)
		case "max_body_size":
			if h.MaxBodyBytes != 0 {
				return d.Err("max_body_size already specified")
			}
			h.MaxBodyBytes, err = parseSize(d, option, val)
		default:
			return d.Errf("unrecognized option '%s'", option)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func parseResumeCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	var m LLMResume
	err := m.UnmarshalCaddyfile(h.Dispenser)
	return &m, err
}

// Interface guards
var (
	_ caddy.Provisioner           = (*LLMResume)(nil)
	_ caddy.Validator             = (*LLMResume)(nil)
	_ caddyhttp.MiddlewareHandler = (*LLMResume)(nil)
	_ caddyfile.Unmarshaler       = (*LLMResume)(nil)
	_ http.ResponseWriter         = (*relay)(nil)
	_ http.Flusher                = (*relay)(nil)
)
