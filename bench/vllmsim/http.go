package vllmsim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// maxBodyBytes bounds a request body.
const maxBodyBytes = 64 << 20

// outputWords are the simulated output tokens: 4 bytes each, so the output text re-tokenizes to the
// same count, and plain ASCII, so they need no JSON escaping.
var outputWords = [...]string{" the", " sim", " ran", " and", " one", " new", " day", " was", " fun", " yes"}

// ServeHTTP serves the OpenAI-compatible API (POST /v1/chat/completions, POST /v1/completions,
// POST /v1/responses with GET and DELETE /v1/responses/{id}, POST /v1/embeddings, GET /v1/models), GET
// /health and GET /metrics. Headers: "X-Sim-Status: <code>" answers that status (codes >= 400 with an
// OpenAI error body), "X-Sim-Drop: mid-stream" drops the connection after some output,
// "X-Sim-Cut-After: <n>" drops a stream's connection after n output tokens. The request goroutine waits
// on the engine through channels; it never holds the engine mutex while writing.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/v1/chat/completions":
		s.serveCompletion(w, r, apiChat)
	case "/v1/completions":
		s.serveCompletion(w, r, apiCompletions)
	case "/v1/responses":
		s.serveCompletion(w, r, apiResponses)
	case "/v1/embeddings":
		s.serveEmbeddings(w, r)
	case "/v1/models":
		if !allowMethod(w, r, http.MethodGet) {
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%s,"object":"model","created":%d,"owned_by":"vllm","root":%s,"parent":null,"max_model_len":%d}`,
			s.modelJSON, time.Now().Unix(), s.modelJSON, s.cfg.NumGPUBlocks*s.cfg.BlockSize)
		for _, a := range s.cfg.LoRAAdapters {
			name := appendJSONString(nil, a)
			fmt.Fprintf(w, `,{"id":%s,"object":"model","created":%d,"owned_by":"vllm","root":%s,"parent":%s,"max_model_len":%d}`,
				name, time.Now().Unix(), name, s.modelJSON, s.cfg.NumGPUBlocks*s.cfg.BlockSize)
		}
		io.WriteString(w, "]}")
	case "/health":
		if !allowMethod(w, r, http.MethodGet) {
			return
		}
		select {
		case <-s.exited:
			w.WriteHeader(http.StatusServiceUnavailable)
		default:
			w.WriteHeader(http.StatusOK)
		}
	case "/metrics":
		if !allowMethod(w, r, http.MethodGet) {
			return
		}
		s.serveMetrics(w, r)
	default:
		if id := storedID(r.URL.Path); id != "" {
			s.serveStored(w, r, id)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		io.WriteString(w, `{"detail":"Not Found"}`)
	}
}

// api is the endpoint a completion request came to.
type api uint8

const (
	apiCompletions api = iota
	apiChat
	apiResponses
)

func allowMethod(w http.ResponseWriter, r *http.Request, method string) bool {
	if r.Method == method || method == http.MethodGet && r.Method == http.MethodHead {
		return true
	}
	w.Header().Set("Allow", method)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusMethodNotAllowed)
	io.WriteString(w, `{"detail":"Method Not Allowed"}`)
	return false
}

// ArrivedHeader is the response header in which a completion's response says when its request
// arrived (unix nanoseconds).
const ArrivedHeader = "X-Sim-Arrived"

// readPost answers anything but a POST, counts the request, stamps its arrival and reads its body, or
// answers the status X-Sim-Status forces; ok is false when the request is answered.
func (s *Server) readPost(w http.ResponseWriter, r *http.Request) (body []byte, ok bool) {
	if !allowMethod(w, r, http.MethodPost) {
		return nil, false
	}
	s.requests.Add(1)
	// When the request reached the backend, for a benchmark to tell the proxy's time from the
	// backend's (unix nanoseconds, on this process's clock).
	w.Header().Set(ArrivedHeader, strconv.FormatInt(time.Now().UnixNano(), 10))
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			s.writeError(w, http.StatusRequestEntityTooLarge, "request body too large")
			return nil, false
		}
		s.writeError(w, http.StatusBadRequest, "reading request body: "+err.Error())
		return nil, false
	}
	if v := r.Header.Get("X-Sim-Status"); v != "" {
		if code, err := strconv.Atoi(v); err == nil && code >= 400 && code <= 599 {
			s.writeError(w, code, "status forced by X-Sim-Status")
			return nil, false
		}
	}
	return body, true
}

// admit checks the request's model and the fault settings' error rate, and queues reqs (the sequences of
// one request) in the engine for model; ok is false when the request is answered (404, 500, 429, 400 or
// 503), with none of reqs left in the engine.
func (s *Server) admit(w http.ResponseWriter, model string, reqs ...*request) (ok bool) {
	adapter, ok := s.adapterFor(model)
	if !ok {
		s.writeError(w, http.StatusNotFound, "The model `"+model+"` does not exist.")
		return false
	}
	if s.chance(s.faults.Load().ErrorRate) {
		s.writeError(w, http.StatusInternalServerError, "simulated internal error")
		return false
	}
	for i, req := range reqs {
		req.adapter = adapter
		if err := s.enqueue(req); err != nil {
			s.abort(reqs[:i]...)
			s.refuse(w, req, err)
			return false
		}
	}
	return true
}

// refuse answers a request the engine did not queue with the error enqueue gave for req.
func (s *Server) refuse(w http.ResponseWriter, req *request, err error) {
	switch {
	case errors.Is(err, errQueueFull):
		s.writeError(w, http.StatusTooManyRequests, "the server is busy: waiting queue full")
	case errors.Is(err, errTooLong):
		s.writeError(w, http.StatusBadRequest, fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion).",
			s.cfg.NumGPUBlocks*s.cfg.BlockSize, req.promptTokens+req.maxTokens, req.promptTokens, req.maxTokens))
	default:
		s.writeError(w, http.StatusServiceUnavailable, err.Error())
	}
}

func (s *Server) serveCompletion(w http.ResponseWriter, r *http.Request, kind api) {
	body, ok := s.readPost(w, r)
	if !ok {
		return
	}
	var p parsedRequest
	var err error
	if kind == apiResponses {
		p, err = s.parseResponses(body)
	} else {
		p, err = parseRequest(body, kind == apiChat)
	}
	if err != nil {
		if errors.Is(err, errNotFound) {
			s.writeError(w, http.StatusNotFound, strings.TrimPrefix(err.Error(), errNotFound.Error()+": "))
			return
		}
		s.writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	reqs := make([]*request, p.n)
	reqs[0] = s.newRequest(p)
	for i := 1; i < p.n; i++ {
		reqs[i] = reqs[0].sibling()
	}
	req := reqs[0]
	if !s.admit(w, p.model, reqs...) {
		return
	}
	defer s.abort(reqs...) // no-op for the sequences that have left the engine
	faults := s.faults.Load()
	drop := r.Header.Get("X-Sim-Drop") == "mid-stream" || p.stream && s.chance(faults.DropMidStreamRate)
	cutAfter := faults.CutStreamAfter
	if v, err := strconv.Atoi(r.Header.Get("X-Sim-Cut-After")); err == nil && v > 0 {
		cutAfter = v
	}
	rs := responseShape{
		chat:    kind == apiChat,
		id:      s.responseID(kind),
		created: time.Now().Unix(),
		model:   s.modelJSON,
		p:       &p,
		reqs:    reqs,

		tokensPerChunk: s.cfg.TokensPerChunk,
	}
	if req.adapter != "" {
		rs.model = appendJSONString(nil, req.adapter) // vLLM answers with the adapter's name
	}
	if p.stream {
		s.serveStream(w, r, &rs, drop, cutAfter)
	} else {
		s.serveWhole(w, r, &rs, drop)
	}
}

func (s *Server) responseID(kind api) string {
	prefix := "cmpl-"
	switch kind {
	case apiChat:
		prefix = "chatcmpl-"
	case apiResponses:
		prefix = "resp_"
	}
	return fmt.Sprintf("%ssim%08x%08x", prefix, s.idBase, s.nextID.Add(1))
}

// serveStream writes the SSE stream: headers once the request is queued, then a chunk per
// TokensPerChunk output tokens of each sequence (its first token at once; a request with n > 1 streams
// n choices, each chunk carrying its choice's index), the finish reason on each sequence's last content
// chunk, the usage chunk if asked for, and "data: [DONE]". A dropped stream ends after a random number of
// tokens of the first sequence; cutAfter > 0 (below max_tokens) drops it after exactly that many, or
// earlier if drop says so.
func (s *Server) serveStream(w http.ResponseWriter, r *http.Request, rs *responseShape, drop bool, cutAfter int) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	dropAt := 0
	if drop {
		dropAt = 1 + s.intN(rs.p.maxTokens)
	}
	if cutAfter > 0 && cutAfter < rs.p.maxTokens && (!drop || cutAfter < dropAt) {
		drop, dropAt = true, cutAfter
	}
	sent := make([]int, len(rs.reqs)) // output tokens written, per sequence
	buf := make([]byte, 0, 512)
	for {
		// The engine signals the shared channel at new tokens and at each sequence's end.
		select {
		case <-rs.first().notify:
		case <-r.Context().Done():
			return
		}
		allDone := true
		buf = buf[:0]
		for i, q := range rs.reqs {
			done := ended(q)
			allDone = allDone && done
			if done && q.err != nil {
				s.failed5xx.Add(1)
				buf = append(buf[:0], "data: "...)
				buf = appendErrorJSON(buf, http.StatusServiceUnavailable, q.err.Error())
				buf = append(buf, "\n\ndata: [DONE]\n\n"...)
				_, _ = w.Write(buf)
				_ = rc.Flush()
				return
			}
			buf = rs.appendChunks(buf, i, &sent[i], int(q.generated.Load()), done, drop && i == 0, dropAt)
		}
		if len(buf) > 0 {
			if _, err := w.Write(buf); err != nil {
				return
			}
			if err := rc.Flush(); err != nil {
				return
			}
		}
		if drop && sent[0] >= dropAt {
			s.abort(rs.reqs...)
			panic(http.ErrAbortHandler)
		}
		if allDone {
			buf = buf[:0]
			switch {
			case rs.p.responses:
				s.storeResponse(rs)
				buf = rs.appendDone(buf) // a response's stream has no [DONE]
			case rs.p.includeUsage:
				buf = append(rs.appendUsageChunk(buf), "data: [DONE]\n\n"...)
			default:
				buf = append(buf, "data: [DONE]\n\n"...)
			}
			_, _ = w.Write(buf)
			_ = rc.Flush()
			return
		}
	}
}

// ended reports whether q has left the engine (finished, aborted or failed).
func ended(q *request) bool {
	select {
	case <-q.done:
		return true
	default:
		return false
	}
}

// appendChunks appends the chunks of sequence i's output tokens from *sent to generated (done: the
// sequence has ended) and advances *sent: one chunk per TokensPerChunk tokens (the first token alone),
// even when the handler runs behind the engine, so the stream has the same shape at any load. With drop,
// it stops at dropAt.
func (rs *responseShape) appendChunks(buf []byte, i int, sent *int, generated int, done, drop bool, dropAt int) []byte {
	size := rs.tokensPerChunk
	for generated > *sent && !(drop && *sent >= dropAt) {
		n := size
		if *sent == 0 {
			n = 1
		}
		if generated-*sent < n && !done {
			break
		}
		end := min(*sent+n, generated)
		if drop {
			end = min(end, dropAt)
		}
		if end == rs.p.maxTokens && !done {
			// The last chunk carries the finish reason, which needs done: the engine counts the last
			// token before it closes done, and a chunk written in between, with no finish reason, left
			// nothing to carry it.
			break
		}
		buf = rs.appendChunk(buf, i, *sent, end, end == rs.p.maxTokens) // done: the last chunk waits for it
		*sent = end
	}
	return buf
}

// await waits for q to leave the engine; false when the client went away first, or q failed (answered
// 503).
func (s *Server) await(w http.ResponseWriter, r *http.Request, q *request) bool {
	select {
	case <-q.done:
	case <-r.Context().Done():
		return false
	}
	if q.err != nil {
		s.writeError(w, http.StatusServiceUnavailable, q.err.Error())
		return false
	}
	return true
}

// serveWhole waits for the whole output and writes one JSON response.
func (s *Server) serveWhole(w http.ResponseWriter, r *http.Request, rs *responseShape, drop bool) {
	for _, q := range rs.reqs {
		if !s.await(w, r, q) {
			return
		}
	}
	var body []byte
	if rs.p.responses {
		s.storeResponse(rs)
		body = rs.appendResponse(make([]byte, 0, 1024+rs.p.maxTokens*bytesPerToken), true)
	} else {
		body = rs.appendWhole(make([]byte, 0, 512+len(rs.reqs)*(128+rs.p.maxTokens*bytesPerToken)))
	}
	w.Header().Set("Content-Type", "application/json")
	if drop {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(body[:len(body)/2])
		_ = http.NewResponseController(w).Flush()
		panic(http.ErrAbortHandler)
	}
	_, _ = w.Write(body)
}

// writeError writes an OpenAI-style error body and counts 429s and 5xx.
func (s *Server) writeError(w http.ResponseWriter, code int, msg string) {
	switch {
	case code == http.StatusTooManyRequests:
		s.failed429.Add(1)
	case code >= 500:
		s.failed5xx.Add(1)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(appendErrorJSON(nil, code, msg))
}

func appendErrorJSON(buf []byte, code int, msg string) []byte {
	typ := "Error"
	switch code {
	case http.StatusBadRequest:
		typ = "BadRequestError"
	case http.StatusNotFound:
		typ = "NotFoundError"
	case http.StatusTooManyRequests:
		typ = "RateLimitError"
	case http.StatusInternalServerError:
		typ = "InternalServerError"
	case http.StatusServiceUnavailable:
		typ = "ServiceUnavailableError"
	}
	buf = append(buf, `{"error":{"message":`...)
	buf = appendJSONString(buf, msg)
	buf = append(buf, `,"type":"`...)
	buf = append(buf, typ...)
	buf = append(buf, `","param":null,"code":`...)
	buf = strconv.AppendInt(buf, int64(code), 10)
	return append(buf, "}}"...)
}

// responseShape holds what every chunk of one response repeats.
type responseShape struct {
	chat    bool
	id      string
	created int64
	model   []byte // JSON string literal
	p       *parsedRequest
	// reqs is every sequence (the request's n), each a choice of its own; a Responses API request has one.
	reqs []*request
	seq  int // the Responses API's next event sequence number
	// tokensPerChunk is how many output tokens a streamed chunk carries (Config.TokensPerChunk).
	tokensPerChunk int
}

// first is the request's first sequence: the one whose prompt, cache hits and channel the response reports
// and waits on.
func (rs *responseShape) first() *request { return rs.reqs[0] }

func (rs *responseShape) appendHead(buf []byte, object string) []byte {
	buf = append(buf, `{"id":"`...)
	buf = append(buf, rs.id...)
	buf = append(buf, `","object":"`...)
	buf = append(buf, object...)
	buf = append(buf, `","created":`...)
	buf = strconv.AppendInt(buf, rs.created, 10)
	buf = append(buf, `,"model":`...)
	return append(buf, rs.model...)
}

func (rs *responseShape) finishReason() string {
	if rs.p.maxTokensSet {
		return `"length"`
	}
	return `"stop"`
}

func appendTokens(buf []byte, from, to int) []byte {
	for i := from; i < to; i++ {
		buf = append(buf, outputWords[i%len(outputWords)]...)
	}
	return buf
}

// appendChunk appends one SSE event carrying output tokens [from, to) of choice i.
func (rs *responseShape) appendChunk(buf []byte, i, from, to int, last bool) []byte {
	if rs.p.responses {
		return rs.appendDeltas(buf, from, to)
	}
	buf = append(buf, "data: "...)
	if rs.chat {
		buf = rs.appendHead(buf, "chat.completion.chunk")
		buf = append(buf, `,"choices":[{"index":`...)
		buf = strconv.AppendInt(buf, int64(i), 10)
		buf = append(buf, `,"delta":{`...)
		if from == 0 {
			buf = append(buf, `"role":"assistant",`...)
		}
		buf = append(buf, `"content":"`...)
	} else {
		buf = rs.appendHead(buf, "text_completion")
		buf = append(buf, `,"choices":[{"index":`...)
		buf = strconv.AppendInt(buf, int64(i), 10)
		buf = append(buf, `,"text":"`...)
	}
	buf = appendTokens(buf, from, to)
	buf = append(buf, '"')
	if rs.chat {
		buf = append(buf, '}')
	}
	buf = append(buf, `,"logprobs":null,"finish_reason":`...)
	if last {
		buf = append(buf, rs.finishReason()...)
	} else {
		buf = append(buf, "null"...)
	}
	return append(buf, "}]}\n\n"...)
}

// appendUsage appends the usage object: the prompt once, the output of every sequence, and the prompt
// tokens the first sequence found cached.
func (rs *responseShape) appendUsage(buf []byte) []byte {
	prompt, completion := rs.first().promptTokens, 0
	for _, q := range rs.reqs {
		completion += int(q.generated.Load())
	}
	buf = append(buf, `"usage":{"prompt_tokens":`...)
	buf = strconv.AppendInt(buf, int64(prompt), 10)
	buf = append(buf, `,"completion_tokens":`...)
	buf = strconv.AppendInt(buf, int64(completion), 10)
	buf = append(buf, `,"total_tokens":`...)
	buf = strconv.AppendInt(buf, int64(prompt+completion), 10)
	buf = append(buf, `,"prompt_tokens_details":{"cached_tokens":`...)
	buf = strconv.AppendInt(buf, rs.first().cached.Load(), 10)
	return append(buf, "}}"...)
}

func (rs *responseShape) appendUsageChunk(buf []byte) []byte {
	buf = append(buf, "data: "...)
	if rs.chat {
		buf = rs.appendHead(buf, "chat.completion.chunk")
	} else {
		buf = rs.appendHead(buf, "text_completion")
	}
	buf = append(buf, `,"choices":[],`...)
	buf = rs.appendUsage(buf)
	return append(buf, "}\n\n"...)
}

func (rs *responseShape) appendWhole(buf []byte) []byte {
	if rs.chat {
		buf = rs.appendHead(buf, "chat.completion")
	} else {
		buf = rs.appendHead(buf, "text_completion")
	}
	buf = append(buf, `,"choices":[`...)
	for i, q := range rs.reqs {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = append(buf, `{"index":`...)
		buf = strconv.AppendInt(buf, int64(i), 10)
		if rs.chat {
			buf = append(buf, `,"message":{"role":"assistant","content":"`...)
			buf = appendTokens(buf, 0, int(q.generated.Load()))
			buf = append(buf, `"},"logprobs":null,"finish_reason":`...)
		} else {
			buf = append(buf, `,"text":"`...)
			buf = appendTokens(buf, 0, int(q.generated.Load()))
			buf = append(buf, `","logprobs":null,"finish_reason":`...)
		}
		buf = append(buf, rs.finishReason()...)
		buf = append(buf, '}')
	}
	buf = append(buf, "],"...)
	buf = rs.appendUsage(buf)
	return append(buf, '}')
}

func appendJSONString(buf []byte, s string) []byte {
	b, _ := json.Marshal(s) // a string always marshals
	return append(buf, b...)
}

// looksLikeChat tells chat bodies from text completion bodies without a second parse.
func looksLikeChat(body []byte) bool { return bytes.Contains(body, []byte(`"messages"`)) }
