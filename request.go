package caddyllm

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

// varKey is the request variable under which the matcher and the policy share one llmRequest, so the body is
// read and parsed once per request however many matchers, routes and retries look at it.
const varKey = "llm.request"

// defaultMaxBodyBytes is the default body cap: requests larger than this are not parsed (they are still
// proxied, routed by the fallback policy). 2 MiB holds ~500k tokens of prompt text, more than the
// context of the models usually served, and keeps the costliest body a client can send (tens of
// thousands of tiny messages) near 10 ms of CPU.
const defaultMaxBodyBytes = 2 << 20

// errBodyTooLarge marks a body over the cap.
var errBodyTooLarge = errors.New("request body too large")

// errUnsupportedEncoding marks a body compressed with something other than gzip.
var errUnsupportedEncoding = errors.New("unsupported content encoding")

// llmRequest is what this plugin knows about one HTTP request. It lives in the request's variables and is
// used only on the request's goroutine (Caddy's variable table is not locked); the accounting it points to
// is the part another goroutine may touch, and it has its own lock.
type llmRequest struct {
	api     tokenize.API // APIUnknown: not an LLM request
	sniffed bool         // the body did not declare JSON; it is an LLM request only if it parses as one

	body     []byte // the body exactly as received (complete unless tooLarge)
	tooLarge bool   // reading stopped at the cap; the rest of the body is still in r.Body
	readErr  error  // reading failed (client gone, request_body limit)
	decoded  []byte // the body to parse: body itself, or body gunzipped
	bodyErr  error  // why the body cannot be parsed (encoding); nil when decoded is set

	// pool counts what may still read the buffer the body was received in, when it came from the body
	// pools (body.go); nil otherwise. bodyPooled: body is still that buffer (llm_resume can replace it).
	pool       *pooledBody
	bodyPooled bool

	parses []parseResult // one per tokenizer configuration that asked

	streamed *streamedBody // the body as the proxy reads it when it was not read whole; nil otherwise

	acct  *reservationHolder // created by the first Select
	tried []string           // dial addresses of the upstreams already selected for this request
	// routes is the route table of the policy that routed it: a response it gets from the Responses API
	// is pinned there (responses.go).
	routes *affinity.Table
}

// String keeps the request (and its prompt) out of logs and placeholders such as {http.vars.llm.request}.
func (*llmRequest) String() string { return "[llm request]" }

type parseResult struct {
	opts tokenize.Options
	req  *tokenize.Request
	err  error
}

// llmRequestOf returns the llmRequest kept for r, or nil when the plugin has not inspected r. Call it on
// the request's goroutine (request variables are not locked).
func llmRequestOf(r *http.Request) *llmRequest {
	lr, _ := caddyhttp.GetVar(r.Context(), varKey).(*llmRequest)
	return lr
}

// inspectRequest returns the llmRequest for r, reading the body on first use. The body is read at most
// maxBody+1 bytes far; what was read is always put back, so the upstream receives every byte: a body read
// whole goes back into r when the caller, holding it (see hold), calls installBody. Code that reads the
// body's bytes (parses it, keeps a slice of them) must hold it first.
func inspectRequest(r *http.Request, maxBody int64) *llmRequest {
	if lr := llmRequestOf(r); lr != nil {
		return lr
	}
	lr := new(llmRequest)
	caddyhttp.SetVar(r.Context(), varKey, lr)
	if buf := lr.read(r, maxBody); buf != nil {
		// Registered once nothing here reads the buffer any more: from now on, it goes back to its pool
		// when the request's context ends and the last reader lets go (body.go).
		lr.pool, lr.bodyPooled = newPooledBody(buf), true
		context.AfterFunc(r.Context(), lr.pool.drop)
	}
	return lr
}

// holdRequest returns r's llmRequest (inspectRequest) holding its body's bytes, with the body put back
// into r for the upstream (installBody, which hands out readers of the held buffer and so must come
// after the hold). ok is false once the request has ended, its client gone: then nothing is held and the
// caller gives up on it. Every ok has exactly one lr.drop.
func holdRequest(r *http.Request, maxBody int64) (lr *llmRequest, ok bool) {
	lr = inspectRequest(r, maxBody)
	if !lr.hold() {
		return lr, false
	}
	lr.installBody(r)
	return lr, true
}

// read reads and decodes r's body into lr, if r is an LLM request. It returns the pooled buffer that
// lr.body is in, or nil when lr.body is not pooled.
func (lr *llmRequest) read(r *http.Request, maxBody int64) (pooled *[]byte) {
	if r.Method != http.MethodPost {
		return nil
	}
	declared, sniff := contentType(r.Header.Get("Content-Type"))
	if !declared && !sniff {
		return nil
	}
	api, ok := tokenize.APIForPath(r.URL.Path)
	if !ok {
		return nil
	}
	lr.api = api
	lr.sniffed = !declared
	defer func() {
		// A body that did not declare JSON counts as an LLM request only if it reads as one.
		if lr.sniffed && (lr.tooLarge || lr.readErr != nil || lr.bodyErr != nil || !startsLikeObject(lr.decoded)) {
			lr.api = tokenize.APIUnknown
		}
	}()
	if r.Body == nil || r.Body == http.NoBody {
		lr.decoded = []byte{}
		return nil
	}
	if r.ContentLength > maxBody {
		lr.tooLarge = true
		return nil
	}
	buf, pooled, err := readBody(r.Body, r.ContentLength, maxBody)
	switch {
	case err != nil:
		// What was read is lost to nobody: the client's body is broken, and the proxy will report it.
		lr.readErr = err
		lr.streamed = newStreamedBody(buf, r.Body)
		r.Body = lr.streamed
		return nil
	case int64(len(buf)) > maxBody:
		lr.tooLarge = true
		lr.streamed = newStreamedBody(buf, r.Body)
		r.Body = lr.streamed
		return nil
	}
	_ = r.Body.Close()
	lr.body = buf
	lr.decoded, lr.bodyErr = decodeBody(buf, r.Header.Get("Content-Encoding"), maxBody)
	return pooled
}

// hold keeps the request's body bytes (body, decoded) from going back to their pool until drop. It fails
// once the request has ended (its client gone): the bytes may then be another request's, and the caller
// must give up on this one. Every hold that succeeds has exactly one drop.
func (lr *llmRequest) hold() bool { return lr.pool == nil || lr.pool.hold() }

// drop ends a hold.
func (lr *llmRequest) drop() {
	if lr.pool != nil {
		lr.pool.drop()
	}
}

// readBody reads at most max+1 bytes of body. With a known length it reads into one buffer of exactly
// that size (plus a byte to detect a body longer than declared), taken from the body pools; pooled is
// that buffer when the body is all in it and it can go back to its pool, else nil.
func readBody(body io.Reader, length, max int64) (buf []byte, pooled *[]byte, err error) {
	if length <= 0 {
		buf, err = io.ReadAll(io.LimitReader(body, max+1))
		return buf, nil, err
	}
	if pooled = getBodyBuffer(int(length + 1)); pooled != nil {
		buf = *pooled
	} else {
		buf = make([]byte, length+1)
	}
	n, err := io.ReadFull(body, buf)
	switch err {
	case io.ErrUnexpectedEOF, io.EOF: // the usual case: the body ended where it said it would, or earlier
		return buf[:n:n], pooled, nil
	case nil: // more bytes than declared: keep reading up to the cap, as for an unknown length
		var rest []byte
		rest, err = io.ReadAll(io.LimitReader(body, max+1-int64(n)))
		return append(buf[:n:n], rest...), nil, err
	}
	return buf[:n:n], nil, err
}

// installBody puts the complete body back into r, as a fresh reader with a matching length and GetBody, so
// that every attempt (retries included) sends all of it. A body that was not read whole (over the cap)
// is streamed once: once an attempt has read from it, later attempts get a body that fails, so that a
// retry is an error rather than a request with an empty or partial body that the upstream would take
// for the whole (with no Content-Length, nothing else tells it the body is incomplete).
func (lr *llmRequest) installBody(r *http.Request) {
	if lr.streamed != nil && lr.streamed.started.Load() {
		r.Body = errBodySentOnce
		r.GetBody = nil
		return
	}
	if lr.body == nil {
		return
	}
	body := lr.body
	r.ContentLength = int64(len(body))
	if lr.bodyPooled {
		// Readers that hold the buffer only while they read it (body.go).
		pool := lr.pool
		r.Body = newPooledReader(pool, body)
		r.GetBody = func() (io.ReadCloser, error) { return newPooledReader(pool, body), nil }
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
}

// replaceRequestBody makes body the request's body from now on, for the policy as for the upstream: the
// next Select parses and sends body instead of the one received. What the request has done so far is kept:
// the upstreams it tried and its reservation holder. It is for llm_resume, which re-issues a request with
// a changed body (a continuation); body must be plain JSON (the caller removes any Content-Encoding), and
// must not be modified afterwards.
func replaceRequestBody(r *http.Request, body []byte) {
	lr := llmRequestOf(r)
	if lr == nil {
		return
	}
	lr.body, lr.decoded, lr.bodyPooled = body, body, false
	lr.tooLarge, lr.readErr, lr.bodyErr, lr.streamed = false, nil, nil, nil
	lr.parses = nil
	lr.installBody(r)
}

// parse returns the request parsed with opts, parsing at most once per distinct opts.
func (lr *llmRequest) parse(opts tokenize.Options) (*tokenize.Request, error) {
	for _, p := range lr.parses {
		if p.opts == opts {
			return p.req, p.err
		}
	}
	var req *tokenize.Request
	var err error
	switch {
	case lr.api == tokenize.APIUnknown:
		err = errors.New("not an LLM request")
	case lr.tooLarge:
		err = errBodyTooLarge
	case lr.readErr != nil:
		err = fmt.Errorf("reading request body: %w", lr.readErr)
	case lr.bodyErr != nil:
		err = lr.bodyErr
	default:
		req, err = tokenize.Parse(lr.decoded, lr.api, opts)
		if err != nil && lr.sniffed {
			// It looked like JSON but is no OpenAI request: not ours to refuse.
			lr.api = tokenize.APIUnknown
		}
	}
	lr.parses = append(lr.parses, parseResult{opts: opts, req: req, err: err})
	return req, err
}

// decodeBody returns the JSON text of a body sent with the given Content-Encoding, never longer than max.
func decodeBody(body []byte, encoding string, max int64) ([]byte, error) {
	switch strings.ToLower(strings.TrimSpace(encoding)) {
	case "", "identity":
		return body, nil
	case "gzip", "x-gzip":
		zr, err := gzip.NewReader(bytes.NewReader(body))
		if err != nil {
			return nil, fmt.Errorf("%w: decompressing gzip body: %v", tokenize.ErrMalformed, err)
		}
		decoded, err := io.ReadAll(io.LimitReader(zr, max+1))
		if err != nil {
			return nil, fmt.Errorf("%w: decompressing gzip body: %v", tokenize.ErrMalformed, err)
		}
		if int64(len(decoded)) > max {
			return nil, fmt.Errorf("%w: decompressed body is over %d bytes", errBodyTooLarge, max)
		}
		return decoded, nil
	default:
		return nil, fmt.Errorf("%w %q (only gzip is read)", errUnsupportedEncoding, encoding)
	}
}

// contentType reports whether a Content-Type declares JSON (an absent type counts: many clients omit it),
// or else whether the body is worth sniffing: curl -d sends application/x-www-form-urlencoded, and a
// plugin that ignored those requests would quietly route them by its fallback. Multipart bodies are
// never read.
func contentType(ct string) (declared, sniff bool) {
	if ct == "" {
		return true, false
	}
	mediaType, _, err := mime.ParseMediaType(ct)
	if err != nil {
		return false, false
	}
	if mediaType == "application/json" || strings.HasSuffix(mediaType, "+json") {
		return true, false
	}
	return false, !strings.HasPrefix(mediaType, "multipart/")
}

// startsLikeObject reports whether body's first non-space byte opens a JSON object.
func startsLikeObject(body []byte) bool {
	for _, c := range body {
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		}
		return c == '{'
	}
	return false
}

// streamedBody is a body the policy did not read whole: the part it read, then the rest of the original,
// closing the original. It records whether the proxy has started reading it, which the proxy may do on
// its transport's goroutine.
type streamedBody struct {
	io.Reader
	io.Closer
	started atomic.Bool
}

func newStreamedBody(read []byte, rest io.ReadCloser) *streamedBody {
	return &streamedBody{Reader: io.MultiReader(bytes.NewReader(read), rest), Closer: rest}
}

func (b *streamedBody) Read(p []byte) (int, error) {
	b.started.Store(true)
	return b.Reader.Read(p)
}

// errBodySentOnce is the body of a retry whose body was streamed to an earlier attempt and not kept.
var errBodySentOnce = io.NopCloser(errReader{errors.New("request body over max_body_size was already sent to an upstream and cannot be sent again (buffer it with request_buffers to retry such requests)")})

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }
