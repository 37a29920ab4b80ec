package tokenize

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"unsafe"

	"github.com/cespare/xxhash/v2"
)

// span locates a decoded string: in the body, or in the parser's scratch buffer when the JSON
// string had escapes that had to be decoded.
type span struct {
	off, end int32 // Parse rejects bodies of 2 GiB or more
	scratch  bool
}

func (sp span) len() int { return int(sp.end - sp.off) }

// segKind says what a piece of a message is, which decides how it is counted and hashed.
type segKind uint8

const (
	segText     segKind = iota + 1 // content text, refusal, or a completions prompt: counted, stepped
	segPart                        // a non-text content part's raw JSON: hashed, counted as partTokens
	segCallID                      // a tool call's id: hashed only
	segCallName                    // a tool call's function name: counted, stepped
	segCallArgs                    // a tool call's arguments: counted, stepped
	segTokens                      // a completions token-ID array (a span of parser.ids): counted by length
)

// counted reports whether a segment's text is tokenized and stepped.
func (k segKind) counted() bool { return k == segText || k == segCallName || k == segCallArgs }

// Fields a segment came from; a repeated key in a message replaces the earlier value.
const (
	fieldContent uint8 = iota + 1
	fieldToolCalls
)

type seg struct {
	kind   segKind
	field  uint8
	dead   bool // replaced by a repeated key
	absent bool // a tool call without this field (hashed differently from an empty one)
	sp     span
}

// msg is one parsed chat message or completions prompt.
type msg struct {
	role, name, callID          span
	hasRole, hasName, hasCallID bool
	hashed                      bool   // hash is set
	segStart, segEnd            int32  // range of parser.segs
	hash                        uint64 // hashMessage, computed while the message is hot in cache
	text, charge                int    // with hashed: bytes and budget charge of the counted segments
}

// parser holds the per-call scratch state; parsers are pooled so that a warm Parse allocates
// almost nothing. Not safe for concurrent use.
type parser struct {
	s    scanner
	api  API
	buf  []byte   // decoded strings with escapes
	segs []seg    // all messages' segments
	msgs []msg    // messages or prompts, in order
	ids  []uint32 // token IDs of completions token arrays

	model                 span
	hasModel              bool
	stream                bool
	maxTokens, maxCompl   int64
	hasMax, hasCompl      bool
	n, bestOf             int64 // choices asked for (n) and sampled (a completion's best_of)
	hasN, hasBestOf       bool
	hasMessages, hasTools bool
	hasPrompt             bool
	instructions          span // a response's instructions
	hasInstructions       bool
	hasInput              bool
	previous              span // a response's previous_response_id
	hasPrevious           bool
	tools                 span // raw JSON of the tools array
	stepsLeft             int  // step boundaries this request may still add

	d  xxhash.Digest
	pb pieceBuf
}

// maxPooledBytes keeps a huge request from pinning its scratch memory in the pool (which the
// runtime empties within two garbage collections anyway).
const maxPooledBytes = 8 << 20

func (p *parser) reset(body []byte, api API) {
	buf, segs, msgs, ids := p.buf[:0], p.segs[:0], p.msgs[:0], p.ids[:0]
	*p = parser{s: scanner{b: body}, api: api, buf: buf, segs: segs, msgs: msgs, ids: ids}
}

func (p *parser) release() {
	p.s.b = nil
	if cap(p.buf) > maxPooledBytes || cap(p.segs)*sizeofSeg > maxPooledBytes ||
		cap(p.msgs)*sizeofMsg > maxPooledBytes || cap(p.ids)*4 > maxPooledBytes {
		return
	}
	parserPool.Put(p)
}

const (
	sizeofSeg = int(unsafe.Sizeof(seg{}))
	sizeofMsg = int(unsafe.Sizeof(msg{}))
)

// bytes returns the decoded bytes of a span.
func (p *parser) bytes(sp span) []byte {
	if sp.scratch {
		return p.buf[sp.off:sp.end]
	}
	return p.s.b[sp.off:sp.end]
}

// str reads a JSON string and returns its decoded span.
func (p *parser) str() (span, error) {
	start, end, esc, err := p.s.str()
	if err != nil {
		return span{}, err
	}
	if !esc {
		return span{off: int32(start), end: int32(end)}, nil
	}
	off := len(p.buf)
	p.buf = appendUnescaped(p.buf, p.s.b[start:end])
	return span{off: int32(off), end: int32(len(p.buf)), scratch: true}, nil
}

// key returns an object key's decoded bytes.
func (p *parser) key(raw []byte, esc bool) []byte {
	if !esc {
		return raw
	}
	off := len(p.buf)
	p.buf = appendUnescaped(p.buf, raw)
	return p.buf[off:]
}

// fieldName formats a field path such as "messages[%d].tool_calls[%d].id" with as many of idx
// and sub as it has verbs. It is called only on error paths.
func fieldName(what string, idx, sub int) string {
	switch strings.Count(what, "%d") {
	case 0:
		return what
	case 1:
		return fmt.Sprintf(what, idx)
	default:
		return fmt.Sprintf(what, idx, sub)
	}
}

// optString reads a string or null into *dst; what (formatted by fieldName with idx and sub) names
// the field in the error.
func (p *parser) optString(dst *span, has *bool, what string, idx, sub int) error {
	switch p.s.peek() {
	case '"':
		sp, err := p.str()
		if err != nil {
			return err
		}
		*dst, *has = sp, true
		return nil
	case 'n':
		*has = false
		return p.s.literal("null")
	default:
		return p.s.typeErr("%s must be a string", fieldName(what, idx, sub))
	}
}

// reqString reads a string into *dst; anything else, null included, is an error naming the field (what,
// formatted by fieldName with idx and sub).
func (p *parser) reqString(dst *span, has *bool, what string, idx, sub int) error {
	if p.s.peek() != '"' {
		return p.s.typeErr("%s must be a string", fieldName(what, idx, sub))
	}
	sp, err := p.str()
	*dst, *has = sp, true
	return err
}

// The routing hints (stream, max_tokens, max_completion_tokens) are read as leniently as the servers
// behind the proxy read them: vLLM and SGLang validate with pydantic in lax mode, which takes "true",
// 1 or "yes" for a boolean and 100.0 or "100" for an integer. A value neither reads is left as absent
// rather than refused: deciding that a request is invalid is the backend's job, and a proxy that refused
// what its backend accepts would break clients that work without it.

// laxTrue are the strings pydantic's lax mode reads as true (compared case-insensitively); its false
// strings, like every other value, leave the hint false.
var laxTrue = []string{"1", "on", "t", "true", "y", "yes"}

// hintBool reads a boolean hint; any other valid JSON value leaves dst false.
func (p *parser) hintBool(dst *bool) error {
	s := &p.s
	*dst = false
	switch c := s.peek(); {
	case c == 't':
		*dst = true
		return s.literal("true")
	case c == 'f':
		return s.literal("false")
	case c == '"':
		start, end, esc, err := s.str()
		if err != nil || esc {
			return err
		}
		v := strings.ToLower(string(s.b[start:end]))
		*dst = slices.Contains(laxTrue, v)
		return nil
	case c == '-' || c >= '0' && c <= '9':
		start, end, err := s.number()
		if err != nil {
			return err
		}
		*dst = string(s.b[start:end]) == "1"
		return nil
	}
	return s.skip(1)
}

// hintInt reads a non-negative integer hint: an integer, an integral number such as 100.0, or a string of
// digits. null or anything else leaves it absent.
func (p *parser) hintInt(dst *int64, has *bool) error {
	s := &p.s
	*has = false
	var text []byte
	switch c := s.peek(); {
	case c == '"':
		start, end, esc, err := s.str()
		if err != nil || esc {
			return err
		}
		text = s.b[start:end]
	case c == '-' || c >= '0' && c <= '9':
		start, end, err := s.number()
		if err != nil {
			return err
		}
		text = s.b[start:end]
	default:
		return s.skip(1)
	}
	if v, ok := integer(text, 1<<40); ok {
		*dst, *has = v, true
	} else if f, err := strconv.ParseFloat(string(text), 64); err == nil && f >= 0 && f <= 1<<40 && f == math.Trunc(f) {
		*dst, *has = int64(f), true
	}
	return nil
}

func (p *parser) parseBody() error {
	s := &p.s
	if c := s.peek(); c != '{' {
		if c == 0 {
			return fmt.Errorf("%w: empty body", ErrMalformed)
		}
		return s.typeErr("body must be a JSON object")
	}
	err := s.object(0, func(raw []byte, esc bool) error {
		k := p.key(raw, esc)
		switch {
		case string(k) == "model":
			return p.optString(&p.model, &p.hasModel, "model", 0, 0)
		case p.api == APIEmbeddings:
			if string(k) == "input" {
				return p.parsePrompt()
			}
			// Nothing else is read from an embeddings request: it streams nothing and generates nothing.
		case string(k) == "stream":
			return p.hintBool(&p.stream)
		case string(k) == "max_tokens":
			return p.hintInt(&p.maxTokens, &p.hasMax)
		case string(k) == "max_completion_tokens":
			return p.hintInt(&p.maxCompl, &p.hasCompl)
		case string(k) == "n" && p.api != APIResponses:
			return p.hintInt(&p.n, &p.hasN)
		case string(k) == "best_of" && p.api == APICompletions:
			return p.hintInt(&p.bestOf, &p.hasBestOf)
		case p.api == APIChat && string(k) == "messages":
			return p.parseMessages()
		case p.chatLike() && string(k) == "tools":
			return p.parseTools()
		case p.api == APIResponses && string(k) == "input":
			return p.parseInput()
		case p.api == APIResponses && string(k) == "instructions":
			return p.optString(&p.instructions, &p.hasInstructions, "instructions", 0, 0)
		case p.api == APIResponses && string(k) == "max_output_tokens":
			return p.hintInt(&p.maxCompl, &p.hasCompl)
		case p.api == APIResponses && string(k) == "previous_response_id":
			return p.optString(&p.previous, &p.hasPrevious, "previous_response_id", 0, 0)
		case p.api == APICompletions && string(k) == "prompt":
			return p.parsePrompt()
		}
		return s.skip(1)
	})
	if err != nil {
		return err
	}
	s.ws()
	if s.i != len(s.b) {
		return s.errorf("invalid JSON: unexpected data after the top-level object")
	}
	switch {
	case p.api == APIChat && !p.hasMessages:
		return fmt.Errorf("%w: messages is required", ErrMalformed)
	case p.api == APIChat && len(p.msgs) == 0:
		return fmt.Errorf("%w: messages must not be empty", ErrMalformed)
	case p.api == APICompletions && !p.hasPrompt:
		return fmt.Errorf("%w: prompt is required", ErrMalformed)
	case p.api == APIEmbeddings && !p.hasPrompt:
		return fmt.Errorf("%w: input is required", ErrMalformed)
	case p.api == APIResponses && !p.hasInput:
		return fmt.Errorf("%w: input is required", ErrMalformed)
	}
	if p.api == APIResponses && p.hasInstructions && p.instructions.len() > 0 {
		p.prependInstructions() // vLLM makes no system message of empty instructions
	}
	if p.api == APIResponses && len(p.msgs) == 0 {
		return fmt.Errorf("%w: input must not be empty", ErrMalformed)
	}
	return nil
}

// chatLike reports whether the request's messages are rendered by the model's chat template: a chat
// request's messages, and a response's instructions and input items.
func (p *parser) chatLike() bool { return p.api == APIChat || p.api == APIResponses }

// template is the API whose prompt layout the request's hashes describe. A response's items are
// rendered as the chat messages they stand for, so a response and a chat request with the same
// messages have the same prefix hashes, as the backend has the same cached blocks for them.
func (p *parser) template() API {
	if p.api == APIResponses {
		return APIChat
	}
	return p.api
}

// list names the array of messages in errors: "messages", or a response's "input".
func (p *parser) list() string {
	if p.api == APIResponses {
		return "input"
	}
	return "messages"
}

func (p *parser) parseTools() error {
	s := &p.s
	switch s.peek() {
	case 'n':
		p.hasTools = false
		return s.literal("null")
	case '[':
		start := s.i
		if err := s.skip(1); err != nil {
			return err
		}
		p.tools, p.hasTools = span{off: int32(start), end: int32(s.i)}, true
		return nil
	}
	return s.typeErr("tools must be an array")
}

func (p *parser) parseMessages() error {
	s := &p.s
	// A repeated "messages" key replaces the earlier one, as in Python's json.
	p.msgs, p.segs = p.msgs[:0], p.segs[:0]
	if s.peek() != '[' {
		return s.typeErr("messages must be an array")
	}
	p.hasMessages = true
	return s.array(1, func() error { return p.parseMessage(len(p.msgs)) })
}

func (p *parser) parseMessage(idx int) error {
	s := &p.s
	if s.peek() != '{' {
		return s.typeErr("messages[%d] must be an object", idx)
	}
	m := msg{segStart: int32(len(p.segs))}
	err := s.object(2, func(raw []byte, esc bool) error {
		k := p.key(raw, esc)
		switch {
		case string(k) == "role":
			return p.reqString(&m.role, &m.hasRole, "messages[%d].role", idx, 0)
		case string(k) == "content":
			p.kill(int(m.segStart), fieldContent)
			return p.parseContent(idx, "content")
		case string(k) == "name":
			return p.optString(&m.name, &m.hasName, "messages[%d].name", idx, 0)
		case string(k) == "tool_call_id":
			return p.optString(&m.callID, &m.hasCallID, "messages[%d].tool_call_id", idx, 0)
		case string(k) == "tool_calls":
			p.kill(int(m.segStart), fieldToolCalls)
			return p.parseToolCalls(idx)
		}
		return s.skip(3)
	})
	if err != nil {
		return err
	}
	if !m.hasRole {
		return s.errorf("messages[%d] must have a string role", idx)
	}
	p.appendMsg(m)
	return nil
}

// kill marks the current message's segments from field as replaced by a repeated key.
func (p *parser) kill(from int, field uint8) {
	for i := from; i < len(p.segs); i++ {
		if p.segs[i].field == field {
			p.segs[i].dead = true
		}
	}
}

// parseContent reads a message's content (what names its key in errors: "content", or a response's
// function_call_output item's "output", counted as its content).
func (p *parser) parseContent(idx int, what string) error {
	s := &p.s
	switch s.peek() {
	case '"':
		sp, err := p.str()
		if err != nil {
			return err
		}
		p.segs = append(p.segs, seg{kind: segText, field: fieldContent, sp: sp})
		return nil
	case 'n':
		return s.literal("null")
	case '[':
		part := 0
		return s.array(3, func() error {
			err := p.parseContentPart(idx, part, what)
			part++
			return err
		})
	}
	return s.typeErr("%s[%d].%s must be a string, an array of content parts, or null", p.list(), idx, what)
}

func (p *parser) parseContentPart(idx, part int, what string) error {
	s := &p.s
	if s.peek() != '{' {
		return s.typeErr("%s[%d].%s[%d] must be an object", p.list(), idx, what, part)
	}
	start := s.i
	var typ, text, refusal span
	var hasType, hasText, hasRefusal bool
	err := s.object(4, func(raw []byte, esc bool) error {
		k := p.key(raw, esc)
		switch {
		case string(k) == "type":
			if s.peek() != '"' {
				return s.typeErr("%s[%d].%s[%d].type must be a string", p.list(), idx, what, part)
			}
			sp, err := p.str()
			typ, hasType = sp, true
			return err
		case string(k) == "text":
			if s.peek() != '"' {
				return s.typeErr("%s[%d].%s[%d].text must be a string", p.list(), idx, what, part)
			}
			sp, err := p.str()
			text, hasText = sp, true
			return err
		case string(k) == "refusal":
			if s.peek() != '"' {
				return s.typeErr("%s[%d].%s[%d].refusal must be a string", p.list(), idx, what, part)
			}
			sp, err := p.str()
			refusal, hasRefusal = sp, true
			return err
		}
		return s.skip(5)
	})
	if err != nil {
		return err
	}
	if !hasType {
		return s.errorf("%s[%d].%s[%d] must have a string type", p.list(), idx, what, part)
	}
	switch t := p.bytes(typ); {
	case string(t) == "text" || p.api == APIResponses && (string(t) == "input_text" || string(t) == "output_text"):
		if !hasText {
			return s.errorf("%s[%d].%s[%d] of type %s must have a string text", p.list(), idx, what, part, t)
		}
		p.segs = append(p.segs, seg{kind: segText, field: fieldContent, sp: text})
	case string(t) == "refusal" && hasRefusal:
		p.segs = append(p.segs, seg{kind: segText, field: fieldContent, sp: refusal})
	default:
		p.segs = append(p.segs, seg{kind: segPart, field: fieldContent, sp: span{off: int32(start), end: int32(s.i)}})
	}
	return nil
}

// parseInput reads a response's input: a string (one user message) or an array of input items.
func (p *parser) parseInput() error {
	s := &p.s
	// A repeated "input" key replaces the earlier one, as in Python's json.
	p.msgs, p.segs = p.msgs[:0], p.segs[:0]
	p.hasInput = true
	switch s.peek() {
	case '"':
		sp, err := p.str()
		if err != nil {
			return err
		}
		m := msg{role: p.scratch("user"), hasRole: true, segStart: int32(len(p.segs))}
		p.segs = append(p.segs, seg{kind: segText, field: fieldContent, sp: sp})
		p.appendMsg(m)
		return nil
	case '[':
		return s.array(1, func() error { return p.parseItem(len(p.msgs)) })
	}
	return s.typeErr("input must be a string or an array of input items")
}

// parseItem reads one input item of a response as the chat message it stands for: a message (its
// "type" "message" or absent) as a chat message; a function_call as the assistant's tool call (its
// call_id, name and arguments, as a chat tool call's id, name and arguments); a function_call_output
// as the tool's message (its call_id as the tool_call_id, its output as the content); and any other
// item (reasoning, item_reference, a built-in tool's call, ...) as a message of that type whose text
// is the item's JSON.
func (p *parser) parseItem(idx int) error {
	s := &p.s
	if s.peek() != '{' {
		return s.typeErr("input[%d] must be an object", idx)
	}
	start := s.i
	m := msg{segStart: int32(len(p.segs))}
	var typ, name, args span
	var hasType, hasName, hasArgs bool
	err := s.object(2, func(raw []byte, esc bool) error {
		k := p.key(raw, esc)
		switch {
		case string(k) == "type":
			return p.reqString(&typ, &hasType, "input[%d].type", idx, 0)
		case string(k) == "role":
			return p.reqString(&m.role, &m.hasRole, "input[%d].role", idx, 0)
		case string(k) == "content" || string(k) == "output":
			p.kill(int(m.segStart), fieldContent)
			return p.parseContent(idx, string(k))
		case string(k) == "call_id":
			return p.optString(&m.callID, &m.hasCallID, "input[%d].call_id", idx, 0)
		case string(k) == "name":
			return p.optString(&name, &hasName, "input[%d].name", idx, 0)
		case string(k) == "arguments":
			return p.optString(&args, &hasArgs, "input[%d].arguments", idx, 0)
		}
		return s.skip(3)
	})
	if err != nil {
		return err
	}
	switch t := p.bytes(typ); {
	case !hasType || string(t) == "message":
		if !m.hasRole {
			return s.errorf("input[%d] must have a string role", idx)
		}
		m.hasCallID = false
	case string(t) == "function_call":
		// As a chat assistant message with one tool call: the call's segments, no content.
		p.segs = p.segs[:m.segStart]
		p.appendCall(m.callID, name, args, m.hasCallID, hasName, hasArgs)
		m.role, m.hasRole, m.hasCallID = p.scratch("assistant"), true, false
	case string(t) == "function_call_output":
		m.role, m.hasRole = p.scratch("tool"), true
	default:
		p.segs = append(p.segs[:m.segStart], seg{kind: segText, field: fieldContent, sp: span{off: int32(start), end: int32(s.i)}})
		m.role, m.hasRole, m.hasCallID = typ, true, false
	}
	p.appendMsg(m)
	return nil
}

// appendCall appends a tool call's segments: always three per call, so that calls cannot run into each
// other in the hash.
func (p *parser) appendCall(id, name, args span, hasID, hasName, hasArgs bool) {
	p.segs = append(p.segs,
		seg{kind: segCallID, field: fieldToolCalls, sp: id, absent: !hasID},
		seg{kind: segCallName, field: fieldToolCalls, sp: name, absent: !hasName},
		seg{kind: segCallArgs, field: fieldToolCalls, sp: args, absent: !hasArgs})
}

// appendMsg ends m at the last segment and appends it, hashed.
func (p *parser) appendMsg(m msg) {
	m.segEnd = int32(len(p.segs))
	m.hash, m.hashed = p.hashMessage(&m), true
	p.msgs = append(p.msgs, m)
}

// prependInstructions puts a response's instructions first, as the system message the server makes of
// them, wherever the key was in the body.
func (p *parser) prependInstructions() {
	m := msg{role: p.scratch("system"), hasRole: true, segStart: int32(len(p.segs))}
	p.segs = append(p.segs, seg{kind: segText, field: fieldContent, sp: p.instructions})
	p.appendMsg(m)
	last := p.msgs[len(p.msgs)-1]
	copy(p.msgs[1:], p.msgs[:len(p.msgs)-1])
	p.msgs[0] = last
}

// scratch returns a span of text in the scratch buffer (a role the request does not spell out).
func (p *parser) scratch(text string) span {
	off := len(p.buf)
	p.buf = append(p.buf, text...)
	return span{off: int32(off), end: int32(len(p.buf)), scratch: true}
}

func (p *parser) parseToolCalls(idx int) error {
	s := &p.s
	switch s.peek() {
	case 'n':
		return s.literal("null")
	case '[':
	default:
		return s.typeErr("messages[%d].tool_calls must be an array", idx)
	}
	call := 0
	return s.array(3, func() error {
		if s.peek() != '{' {
			return s.typeErr("messages[%d].tool_calls[%d] must be an object", idx, call)
		}
		var id, name, args span
		var hasID, hasName, hasArgs bool
		err := s.object(4, func(raw []byte, esc bool) error {
			k := p.key(raw, esc)
			switch {
			case string(k) == "id":
				return p.optString(&id, &hasID, "messages[%d].tool_calls[%d].id", idx, call)
			case string(k) == "function":
				if s.peek() != '{' {
					return s.typeErr("messages[%d].tool_calls[%d].function must be an object", idx, call)
				}
				return s.object(5, func(raw []byte, esc bool) error {
					k := p.key(raw, esc)
					switch {
					case string(k) == "name":
						return p.optString(&name, &hasName, "messages[%d].tool_calls[%d].function.name", idx, call)
					case string(k) == "arguments":
						return p.optString(&args, &hasArgs, "messages[%d].tool_calls[%d].function.arguments", idx, call)
					}
					return s.skip(6)
				})
			}
			return s.skip(5)
		})
		if err != nil {
			return err
		}
		p.appendCall(id, name, args, hasID, hasName, hasArgs)
		call++
		return nil
	})
}

// promptField names the field parsePrompt reads: a completions prompt, or an embeddings input.
func (p *parser) promptField() string {
	if p.api == APIEmbeddings {
		return "input"
	}
	return "prompt"
}

// parsePrompt reads a completions prompt (an embeddings input): a string, an array of strings, an
// array of token IDs, or an array of token-ID arrays.
func (p *parser) parsePrompt() error {
	s := &p.s
	p.msgs, p.segs, p.ids = p.msgs[:0], p.segs[:0], p.ids[:0]
	p.hasPrompt = true
	field := p.promptField()
	switch s.peek() {
	case '"':
		return p.promptString()
	case '[':
	case 'n':
		return s.errorf("%s is required (got null)", field)
	default:
		return s.typeErr("%s must be a string, an array of strings, or an array of token IDs", field)
	}
	var shape byte // 's' strings, 'i' token IDs, 'a' arrays of token IDs
	n := 0
	err := s.array(1, func() error {
		c := s.peek()
		var this byte
		switch {
		case c == '"':
			this = 's'
		case c == '-' || c >= '0' && c <= '9':
			this = 'i'
		case c == '[':
			this = 'a'
		default:
			return s.typeErr("%s[%d] must be a string, a token ID or an array of token IDs", field, n)
		}
		if shape == 0 {
			shape = this
			if shape == 'i' {
				p.msgs = append(p.msgs, msg{segStart: int32(len(p.segs))})
				p.segs = append(p.segs, seg{kind: segTokens, sp: span{off: int32(len(p.ids)), end: int32(len(p.ids))}})
			}
		} else if this != shape {
			return s.errorf("%s array elements must all be strings, all token IDs, or all arrays of token IDs", field)
		}
		n++
		switch this {
		case 's':
			return p.promptString()
		case 'i':
			// A run of plain integers is read here at once; whatever else is next, the array
			// callback sees as usual.
			if k := p.tokenIDRun(); k > 0 {
				n += k - 1
			} else if err := p.tokenID(); err != nil {
				return err
			}
			p.segs[len(p.segs)-1].sp.end = int32(len(p.ids))
			return nil
		default:
			first := len(p.ids)
			if err := s.array(2, p.tokenIDs); err != nil {
				return err
			}
			if len(p.ids) == first {
				return s.errorf("%s[%d] must not be an empty token array", field, n-1)
			}
			p.msgs = append(p.msgs, msg{segStart: int32(len(p.segs)), segEnd: int32(len(p.segs) + 1)})
			p.segs = append(p.segs, seg{kind: segTokens, sp: span{off: int32(first), end: int32(len(p.ids))}})
			return nil
		}
	})
	if err != nil {
		return err
	}
	if n == 0 {
		return s.errorf("%s must not be an empty array", field)
	}
	if shape == 'i' {
		p.msgs[0].segEnd = int32(len(p.segs))
	}
	return nil
}

func (p *parser) promptString() error {
	sp, err := p.str()
	if err != nil {
		return err
	}
	p.msgs = append(p.msgs, msg{segStart: int32(len(p.segs)), segEnd: int32(len(p.segs) + 1)})
	p.segs = append(p.segs, seg{kind: segText, sp: sp})
	return nil
}

func (p *parser) tokenID() error {
	s := &p.s
	c := s.peek()
	if c != '-' && (c < '0' || c > '9') {
		return s.typeErr("%s token IDs must be integers", p.promptField())
	}
	start, end, err := s.number()
	if err != nil {
		return err
	}
	v, ok := integer(s.b[start:end], 1<<32-1)
	if !ok {
		s.i = start
		return s.errorf("%s token IDs must be non-negative integers", p.promptField())
	}
	p.ids = append(p.ids, uint32(v))
	return nil
}

// fastTokenIDs enables tokenIDRun; tests turn it off to compare with the element-by-element path.
var fastTokenIDs = true

// tokenIDs reads one or more token IDs of a token array: a run of plain integers, or else one
// element by tokenID (which reports what is wrong with it).
func (p *parser) tokenIDs() error {
	if p.tokenIDRun() > 0 {
		return nil
	}
	return p.tokenID()
}

// tokenIDRun is the fast path of token-ID arrays, which can hold a million elements: from the
// scanner's position, it appends the IDs of a run "12, 345, 6" of plain non-negative integers
// (the values tokenID accepts) and returns how many it read. It stops after the last integer
// it read, before a ',' that is not followed by one and before anything else (a ']', a
// fraction, an exponent, a sign, a leading zero, a value over 2^32-1, ...), which the array
// loop or tokenID then handles as if the fast path did not exist.
func (p *parser) tokenIDRun() int {
	if !fastTokenIDs {
		return 0
	}
	b, i, ids := p.s.b, p.s.i, p.ids // i: the start of the next element
	end, start := i, len(ids)        // end: just after the last integer read
	for {
		j := i
		var v uint64
		if j < len(b) && b[j] == '0' {
			j++
		} else {
			for j < len(b) && j-i < 10 && b[j]-'0' < 10 {
				v = v*10 + uint64(b[j]-'0')
				j++
			}
		}
		if j == i || v > 1<<32-1 || j < len(b) && (b[j]-'0' < 10 || b[j] == '.' || b[j] == 'e' || b[j] == 'E') {
			break
		}
		ids = append(ids, uint32(v))
		end = j
		for j < len(b) && (b[j] == ' ' || b[j] == '\n' || b[j] == '\t' || b[j] == '\r') {
			j++
		}
		if j >= len(b) || b[j] != ',' {
			break
		}
		j++
		for j < len(b) && (b[j] == ' ' || b[j] == '\n' || b[j] == '\t' || b[j] == '\r') {
			j++
		}
		if j >= len(b) || b[j]-'0' >= 10 {
			break
		}
		i = j
	}
	p.s.i, p.ids = end, ids
	return len(ids) - start
}
