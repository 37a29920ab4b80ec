package caddyllm

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/tokenrouter/caddy-llm/affinity"
	"github.com/tokenrouter/caddy-llm/tokenize"
)

func init() {
	caddy.RegisterModule(LLMTransport{})
}

// LLMTransport is Caddy's http transport that also observes the responses of requests routed by the llm
// policy, so the policy learns from them without a handler in front (a selection policy has no completion
// hook): the first body byte of a whole answer, or the first content chunk of a stream, marks the
// attempt's first token (its prefill is over; the upstream's service model learns the delay); a stream's
// content chunks count its output tokens (one per chunk, or vLLM's continuous usage stats; for the
// Responses API one per delta event), a whole answer's usage gives them at once; and the backend's
// usage.prompt_tokens_details.cached_tokens (a response's usage.input_tokens_details.cached_tokens),
// read from the last bytes of the answer or stream, is checked against what the policy predicted cached
// (observe.go).
//
// The relayed bytes are never buffered, delayed or changed: the observer looks at each chunk as it
// passes, keeping at most the first bytes of the current SSE event and the last bytes of the body, in
// fixed buffers allocated once per response. Requests the policy did not route (active health checks,
// other policies, requests it could not read), answers other than 2xx and bodies it cannot read
// (compressed) pass untouched.
//
// It embeds reverseproxy.HTTPTransport by value, so every option of the http transport works as there,
// and reverse_proxy finds the interfaces it looks for (TLS, h2c, proxy protocol, health-check scheme,
// header ops, cleanup).
type LLMTransport struct {
	reverseproxy.HTTPTransport
}

// CaddyModule returns the Caddy module information.
func (LLMTransport) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.transport.llm",
		New: func() caddy.Module { return new(LLMTransport) },
	}
}

// Provision sets up the embedded http transport.
func (t *LLMTransport) Provision(ctx caddy.Context) error {
	return t.HTTPTransport.Provision(ctx)
}

// RoundTrip sends req with the http transport and, for a request the llm policy routed, observes the
// successful response's body as it is relayed. It runs on the request's goroutine, before any other
// attempt of the same request is selected, so the attempt it observes is req's current one.
func (t *LLMTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	lr := llmRequestOf(req)
	res := lr.currentAttempt()
	resp, err := t.HTTPTransport.RoundTrip(req)
	if res == nil || err != nil || resp.StatusCode < 200 || resp.StatusCode > 299 || resp.Body == nil || resp.Body == http.NoBody {
		return resp, err
	}
	encoding := strings.ToLower(resp.Header.Get("Content-Encoding"))
	ob := &observedBody{
		body:   resp.Body,
		res:    res,
		stream: isEventStream(resp.Header.Get("Content-Type")),
		opaque: encoding != "" && encoding != "identity",
		// The body starts on a new line.
		lineEmpty: true,
	}
	if lr != nil && lr.api == tokenize.APIResponses {
		ob.routes = lr.routes // its id is pinned there
	}
	resp.Body = ob
	return resp, nil
}

// Sizes of an observed body's buffers.
const (
	// eventHeadBytes of each SSE event are kept to find its content and continuous usage: a chunk's
	// content starts within its first few hundred bytes, after the id, model and choice index.
	eventHeadBytes = 1024
	// tailBytes of the body are kept to read the usage at its end: a whole answer ends with its usage
	// object and a few short fields, a stream with its usage chunk and [DONE].
	tailBytes = 1024
	// headBytes of a whole Responses API answer are kept to read its id, its first field.
	headBytes = 384
)

// observedBody passes a response body through unchanged while it observes it. It allocates nothing after
// its creation. Read and Close are called by reverse_proxy on the request's goroutine, not concurrently.
type observedBody struct {
	body   io.ReadCloser
	res    *reservation
	stream bool // an SSE stream; else a whole answer
	opaque bool // compressed: only its first byte is observed
	first  bool // a whole answer's first byte was seen
	ended  bool

	// The stream's current event: its first bytes, and whether its current line is empty so far.
	event     [eventHeadBytes]byte
	eventLen  int
	lineEmpty bool
	counted   int // output tokens reported so far (observeTokens)

	tail    [tailBytes]byte
	tailLen int

	// routes, for a Responses API answer: the route table its id is pinned in (responses.go); idSeen once
	// it is. A whole answer's first bytes are kept to find it.
	routes  *affinity.Table
	idSeen  bool
	head    [headBytes]byte
	headLen int
}

// Read reads from the body and observes what it read.
func (b *observedBody) Read(p []byte) (int, error) {
	n, err := b.body.Read(p)
	if n > 0 && !b.ended {
		b.observe(p[:n])
	}
	if err == io.EOF {
		b.end()
	}
	return n, err
}

// Close ends the observation (with what was seen, when the body was not read to its end) and closes the
// body.
func (b *observedBody) Close() error {
	b.end()
	return b.body.Close()
}

// observe looks at one chunk of the body.
func (b *observedBody) observe(p []byte) {
	if b.opaque {
		b.res.noteFirstToken(time.Now().UnixNano())
		b.ended = true // nothing more to read in compressed bytes
		return
	}
	b.keepTail(p)
	if !b.stream {
		if b.routes != nil && b.headLen < headBytes {
			b.headLen += copy(b.head[b.headLen:], p)
		}
		if !b.first {
			b.first = true
			b.res.noteFirstToken(time.Now().UnixNano())
		}
		return
	}
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			b.keepEvent(p)
			b.lineEmpty = b.lineEmpty && isCR(p)
			return
		}
		b.keepEvent(p[:i+1])
		if b.lineEmpty && isCR(p[:i]) {
			b.endEvent() // a blank line ends an event
		} else {
			b.lineEmpty = true
		}
		p = p[i+1:]
	}
}

// isCR reports whether a line's bytes so far leave it blank ("" or the "\r" of a CRLF).
func isCR(p []byte) bool { return len(p) == 0 || len(p) == 1 && p[0] == '\r' }

func (b *observedBody) keepEvent(p []byte) {
	b.eventLen += copy(b.event[min(b.eventLen, eventHeadBytes):], p)
}

func (b *observedBody) keepTail(p []byte) {
	if len(p) >= tailBytes {
		b.tailLen = copy(b.tail[:], p[len(p)-tailBytes:])
		return
	}
	if over := b.tailLen + len(p) - tailBytes; over > 0 {
		b.tailLen = copy(b.tail[:], b.tail[over:b.tailLen])
	}
	b.tailLen += copy(b.tail[b.tailLen:], p)
}

// Patterns found in the JSON of answers and chunks.
var (
	patContent    = []byte(`"content":"`)
	patText       = []byte(`"text":"`)
	patCompletion = []byte(`"completion_tokens":`)
	patPrompt     = []byte(`"prompt_tokens":`)
	patCached     = []byte(`"cached_tokens":`)
	patUsage      = []byte(`"usage":`)
	// The Responses API's: its events are typed, its content comes in deltas (its .done events and the
	// final response.completed repeat the whole text), and its usage names its counts differently.
	patResponseEvent = []byte(`"type":"response.`)
	patDelta         = []byte(`"delta":"`)
	patOutput        = []byte(`"output_tokens":`)
	patInput         = []byte(`"input_tokens":`)
)

// endEvent handles the complete event kept in b.event: a chunk with content (a non-empty delta content or
// text, as llm_resume counts them) is one output token, or as many as its continuous usage says. A usage
// chunk without content (the last one, with stream_options.include_usage) adds the tokens its count has
// beyond those counted: a chunk may carry several tokens (vLLM's --stream-interval, speculative decoding,
// the benchmark's simulators), and counted as one each, eight-token chunks taught the model a time per
// output token 7-8x too long (24-28 ms for 3.6; docs/bench/usage-count). Before any content it adds none:
// its time would be taken for the first token's.
func (b *observedBody) endEvent() {
	ev := b.event[:b.eventLen]
	b.eventLen, b.lineEmpty = 0, true
	if b.routes != nil && !b.idSeen {
		b.remember(responseID(ev, true))
	}
	var content bool
	if bytes.Contains(ev, patResponseEvent) {
		content = hasNonEmptyString(ev, patDelta)
	} else {
		content = hasNonEmptyString(ev, patContent) || hasNonEmptyString(ev, patText)
	}
	tokens := 0
	if content {
		tokens = 1
	}
	if bytes.Contains(ev, patUsage) && (content || b.counted > 0) {
		if n, ok := lastInt(ev, patCompletion); ok && n > b.counted {
			tokens = n - b.counted
		}
	}
	if tokens > 0 {
		b.counted += tokens
		b.res.observeTokens(observerTransport, tokens)
	}
}

// end reports the usage at the end of the body, once: its cached tokens, and for a whole answer its
// output tokens.
func (b *observedBody) end() {
	if b.ended {
		return
	}
	b.ended = true
	tail := b.tail[:b.tailLen]
	if b.routes != nil && !b.stream && !b.idSeen {
		b.remember(responseID(b.head[:b.headLen], false))
	}
	if !b.stream {
		if n, ok := lastInt(tail, patCompletion); ok {
			b.res.observeTokens(observerTransport, n)
		} else if n, ok := lastInt(tail, patOutput); ok {
			b.res.observeTokens(observerTransport, n)
		}
	}
	if cached, ok := lastInt(tail, patCached); ok {
		prompt, ok := lastInt(tail, patPrompt)
		if !ok {
			prompt, _ = lastInt(tail, patInput)
		}
		b.res.observeCached(prompt, cached)
	}
}

// remember records that the upstream of the observed attempt produced the response id (none: "").
func (b *observedBody) remember(id string) {
	if id != "" {
		b.routes.Pin(responsesPinModel, id, b.res.dial)
		b.idSeen = true
	}
}

// hasNonEmptyString reports whether the JSON text s holds key pat (ending with its string's opening
// quote) with a non-empty string value. A key escaped inside a string value (\"content\":\") does not
// count.
func hasNonEmptyString(s, pat []byte) bool {
	for {
		i := bytes.Index(s, pat)
		if i < 0 {
			return false
		}
		if (i == 0 || s[i-1] != '\\') && i+len(pat) < len(s) && s[i+len(pat)] != '"' {
			return true
		}
		s = s[i+len(pat):]
	}
}

// lastInt returns the non-negative integer after the last occurrence of key pat in the JSON text s, if
// the occurrence is a key (not escaped inside a string) followed by digits.
func lastInt(s, pat []byte) (int, bool) {
	for {
		i := bytes.LastIndex(s, pat)
		if i < 0 {
			return 0, false
		}
		if i > 0 && s[i-1] == '\\' {
			s = s[:i]
			continue
		}
		rest := s[i+len(pat):]
		for len(rest) > 0 && rest[0] == ' ' {
			rest = rest[1:]
		}
		n, digits := 0, 0
		for _, c := range rest {
			if c < '0' || c > '9' || digits == 18 {
				break
			}
			n = n*10 + int(c-'0')
			digits++
		}
		return n, digits > 0
	}
}

// Interface guards
var (
	_ caddy.Provisioner                                = (*LLMTransport)(nil)
	_ caddy.CleanerUpper                               = (*LLMTransport)(nil)
	_ http.RoundTripper                                = (*LLMTransport)(nil)
	_ reverseproxy.TLSTransport                        = (*LLMTransport)(nil)
	_ reverseproxy.H2CTransport                        = (*LLMTransport)(nil)
	_ reverseproxy.HealthCheckSchemeOverriderTransport = (*LLMTransport)(nil)
	_ reverseproxy.ProxyProtocolTransport              = (*LLMTransport)(nil)
	_ reverseproxy.RequestHeaderOpsTransport           = (*LLMTransport)(nil)
)
