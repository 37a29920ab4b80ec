package vllmsim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// The Responses API (POST /v1/responses), as vLLM serves it: the request's instructions become the
// system message and its input items the messages after it, rendered by the same template as chat; a
// response is stored (unless "store": false) with its conversation, which a later request continues by
// its id (previous_response_id) on this server only: any other answers 404. GET and DELETE
// /v1/responses/{id} retrieve and delete a stored response.

// maxStoredResponses bounds the stored responses (the oldest is forgotten first).
const maxStoredResponses = 4096

// errNotFound marks a request for a stored response this server does not have (404).
var errNotFound = errors.New("not found")

// responseStore holds stored responses' conversations (their prompt after the tools and instructions,
// and their output), by response id. The zero value is ready to use.
type responseStore struct {
	mu    sync.Mutex
	convs map[string][]byte
	order []string // ids, oldest first
}

func (st *responseStore) get(id string) ([]byte, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	c, ok := st.convs[id]
	return c, ok
}

func (st *responseStore) put(id string, conv []byte) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.convs == nil {
		st.convs = make(map[string][]byte)
	}
	for len(st.order) >= maxStoredResponses {
		delete(st.convs, st.order[0])
		st.order = st.order[1:]
	}
	st.convs[id] = conv
	st.order = append(st.order, id)
}

func (st *responseStore) remove(id string) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	if _, ok := st.convs[id]; !ok {
		return false
	}
	delete(st.convs, id)
	if i := slices.Index(st.order, id); i >= 0 {
		st.order = slices.Delete(st.order, i, i+1)
	}
	return true
}

type responsesBody struct {
	Model              string          `json:"model"`
	Instructions       *string         `json:"instructions"`
	Input              json.RawMessage `json:"input"`
	Tools              json.RawMessage `json:"tools"`
	Stream             bool            `json:"stream"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
	PreviousResponseID *string         `json:"previous_response_id"`
	Store              *bool           `json:"store"`
}

type responseItem struct {
	Type    string     `json:"type"`
	Role    string     `json:"role"`
	Content rawContent `json:"content"`
	Output  rawContent `json:"output"`
}

// parseResponses decodes a Responses API body and renders its prompt: the tools and instructions as a
// chat request's, then the conversation of the stored response it continues, then its input items (a
// string is a user message; a message item as a chat message; a function call as the assistant's
// message of its JSON; a function call's output as the tool's message; any other item as a message of
// its type with its JSON). Errors wrap errBadRequest, or errNotFound for an unknown
// previous_response_id.
func (s *Server) parseResponses(body []byte) (parsedRequest, error) {
	p := parsedRequest{chat: true, responses: true, store: true, n: 1}
	var b responsesBody
	if err := json.Unmarshal(body, &b); err != nil {
		return p, fmt.Errorf("%w: decoding response request: %w", errBadRequest, err)
	}
	in := bytes.TrimSpace(b.Input)
	if len(in) == 0 || bytes.Equal(in, []byte("null")) {
		return p, fmt.Errorf("%w: input: field required", errBadRequest)
	}
	var buf, conv bytes.Buffer
	appendTools(&buf, b.Tools)
	if b.Instructions != nil && *b.Instructions != "" {
		buf.WriteString("<|system|>\n")
		buf.WriteString(*b.Instructions)
		buf.WriteByte('\n')
	}
	if id := b.PreviousResponseID; id != nil && *id != "" {
		prev, ok := s.stored.get(*id)
		if !ok {
			return p, fmt.Errorf("%w: Response with id '%s' not found.", errNotFound, *id)
		}
		p.previous = *id
		conv.Write(prev)
	}
	if in[0] == '"' {
		var text string
		if err := json.Unmarshal(in, &text); err != nil {
			return p, fmt.Errorf("%w: input: %w", errBadRequest, err)
		}
		conv.WriteString("<|user|>\n")
		conv.WriteString(text)
		conv.WriteByte('\n')
	} else {
		var items []json.RawMessage
		if err := json.Unmarshal(in, &items); err != nil {
			return p, fmt.Errorf("%w: input must be a string or an array of items: %w", errBadRequest, err)
		}
		for i, raw := range items {
			var it responseItem
			if err := json.Unmarshal(raw, &it); err != nil {
				return p, fmt.Errorf("%w: input[%d]: %w", errBadRequest, i, err)
			}
			var err error
			switch it.Type {
			case "", "message":
				if it.Role == "" {
					return p, fmt.Errorf("%w: input[%d].role: field required", errBadRequest, i)
				}
				conv.WriteString("<|" + it.Role + "|>\n")
				err = appendContent(&conv, it.Content)
			case "function_call":
				conv.WriteString("<|assistant|>\n")
				conv.Write(raw)
			case "function_call_output":
				conv.WriteString("<|tool|>\n")
				err = appendContent(&conv, it.Output)
			default:
				conv.WriteString("<|" + it.Type + "|>\n")
				conv.Write(raw)
			}
			if err != nil {
				return p, fmt.Errorf("%w: input[%d]: %w", errBadRequest, i, err)
			}
			conv.WriteByte('\n')
		}
	}
	buf.Write(conv.Bytes())
	p.model, p.prompt, p.stream, p.conversation = b.Model, buf.Bytes(), b.Stream, conv.Bytes()
	if b.Store != nil {
		p.store = *b.Store
	}
	err := p.setMaxTokens("max_output_tokens", b.MaxOutputTokens)
	return p, err
}

// storeResponse stores a finished response's conversation under its id, when its request asked.
func (s *Server) storeResponse(rs *responseShape) {
	if !rs.p.responses || !rs.p.store {
		return
	}
	n := int(rs.first().generated.Load())
	conv := make([]byte, 0, len(rs.p.conversation)+16+n*bytesPerToken)
	conv = append(conv, rs.p.conversation...)
	conv = append(conv, "<|assistant|>\n"...)
	conv = appendTokens(conv, 0, n)
	s.stored.put(rs.id, append(conv, '\n'))
}

// serveStored answers GET (retrieve) and DELETE on /v1/responses/{id}: 404 unless stored here.
func (s *Server) serveStored(w http.ResponseWriter, r *http.Request, id string) {
	if r.Method != http.MethodGet && r.Method != http.MethodDelete {
		w.Header().Set("Allow", "GET, DELETE")
		s.writeError(w, http.StatusMethodNotAllowed, "method not allowed")
		return
	}
	var ok bool
	if r.Method == http.MethodDelete {
		ok = s.stored.remove(id)
	} else {
		_, ok = s.stored.get(id)
	}
	if !ok {
		s.writeError(w, http.StatusNotFound, "Response with id '"+id+"' not found.")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	buf := append([]byte(`{"id":`), appendJSONString(nil, id)...)
	if r.Method == http.MethodDelete {
		_, _ = w.Write(append(buf, `,"object":"response","deleted":true}`...))
		return
	}
	_, _ = w.Write(append(buf, `,"object":"response","status":"completed","model":`+string(s.modelJSON)+`,"output":[]}`...))
}

// storedID returns the id in a /v1/responses/{id} path, or "".
func storedID(path string) string {
	id, ok := strings.CutPrefix(path, "/v1/responses/")
	if !ok || id == "" || strings.Contains(id, "/") {
		return ""
	}
	return id
}

// The Responses API's answer: one response object, whole or as a stream of typed events.

// appendEvent starts an SSE event of the given type (its "event:" line and its data's first fields).
func (rs *responseShape) appendEvent(buf []byte, typ string) []byte {
	buf = append(buf, "event: "...)
	buf = append(buf, typ...)
	buf = append(buf, "\ndata: {\"type\":\""...)
	buf = append(buf, typ...)
	buf = append(buf, `","sequence_number":`...)
	buf = strconv.AppendInt(buf, int64(rs.seq), 10)
	rs.seq++
	return buf
}

// appendItemRef appends the fields that place an event in the one message item's one text part.
func (rs *responseShape) appendItemRef(buf []byte) []byte {
	buf = append(buf, `,"item_id":"msg_`...)
	buf = append(buf, rs.id...)
	return append(buf, `","output_index":0,"content_index":0`...)
}

// appendMessageItem appends the output message item with output tokens [0, n).
func (rs *responseShape) appendMessageItem(buf []byte, n int, status string) []byte {
	buf = append(buf, `{"id":"msg_`...)
	buf = append(buf, rs.id...)
	buf = append(buf, `","type":"message","status":"`...)
	buf = append(buf, status...)
	buf = append(buf, `","role":"assistant","content":[`...)
	if status != "in_progress" {
		buf = append(buf, `{"type":"output_text","text":"`...)
		buf = appendTokens(buf, 0, n)
		buf = append(buf, `","annotations":[]}`...)
	}
	return append(buf, "]}"...)
}

// appendResponse appends the response object: in progress (no output yet), or done with its output and
// usage (incomplete when it stopped at max_output_tokens).
func (rs *responseShape) appendResponse(buf []byte, done bool) []byte {
	n := int(rs.first().generated.Load())
	status := "in_progress"
	if done {
		status = "completed"
		if rs.p.maxTokensSet {
			status = "incomplete"
		}
	}
	buf = append(buf, `{"id":"`...)
	buf = append(buf, rs.id...)
	buf = append(buf, `","object":"response","created_at":`...)
	buf = strconv.AppendInt(buf, rs.created, 10)
	buf = append(buf, `,"status":"`...)
	buf = append(buf, status...)
	buf = append(buf, `","incomplete_details":`...)
	if status == "incomplete" {
		buf = append(buf, `{"reason":"max_output_tokens"}`...)
	} else {
		buf = append(buf, "null"...)
	}
	buf = append(buf, `,"model":`...)
	buf = append(buf, rs.model...)
	buf = append(buf, `,"output":[`...)
	if done {
		buf = rs.appendMessageItem(buf, n, "completed")
	}
	buf = append(buf, `],"parallel_tool_calls":true,"previous_response_id":`...)
	if rs.p.previous != "" {
		buf = appendJSONString(buf, rs.p.previous)
	} else {
		buf = append(buf, "null"...)
	}
	buf = append(buf, `,"store":`...)
	buf = strconv.AppendBool(buf, rs.p.store)
	buf = append(buf, `,"tool_choice":"auto","tools":[],"usage":`...)
	if !done {
		return append(buf, "null}"...)
	}
	prompt := rs.first().promptTokens
	buf = append(buf, `{"input_tokens":`...)
	buf = strconv.AppendInt(buf, int64(prompt), 10)
	buf = append(buf, `,"input_tokens_details":{"cached_tokens":`...)
	buf = strconv.AppendInt(buf, rs.first().cached.Load(), 10)
	buf = append(buf, `},"output_tokens":`...)
	buf = strconv.AppendInt(buf, int64(n), 10)
	buf = append(buf, `,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":`...)
	buf = strconv.AppendInt(buf, int64(prompt+n), 10)
	return append(buf, "}}"...)
}

// appendDeltas appends the stream's events for output tokens [from, to): before the first, the
// response's creation and its message item's and text part's; then one text delta.
func (rs *responseShape) appendDeltas(buf []byte, from, to int) []byte {
	if from == 0 {
		buf = rs.appendEvent(buf, "response.created")
		buf = append(buf, `,"response":`...)
		buf = rs.appendResponse(buf, false)
		buf = append(buf, "}\n\n"...)
		buf = rs.appendEvent(buf, "response.output_item.added")
		buf = append(buf, `,"output_index":0,"item":`...)
		buf = rs.appendMessageItem(buf, 0, "in_progress")
		buf = append(buf, "}\n\n"...)
		buf = rs.appendEvent(buf, "response.content_part.added")
		buf = rs.appendItemRef(buf)
		buf = append(buf, `,"part":{"type":"output_text","text":"","annotations":[]}}`+"\n\n"...)
	}
	buf = rs.appendEvent(buf, "response.output_text.delta")
	buf = rs.appendItemRef(buf)
	buf = append(buf, `,"delta":"`...)
	buf = appendTokens(buf, from, to)
	return append(buf, `","logprobs":[]}`+"\n\n"...)
}

// appendDone appends the stream's closing events: the text, part and item done, and the response
// completed with its usage.
func (rs *responseShape) appendDone(buf []byte) []byte {
	n := int(rs.first().generated.Load())
	buf = rs.appendEvent(buf, "response.output_text.done")
	buf = rs.appendItemRef(buf)
	buf = append(buf, `,"text":"`...)
	buf = appendTokens(buf, 0, n)
	buf = append(buf, `","logprobs":[]}`+"\n\n"...)
	buf = rs.appendEvent(buf, "response.content_part.done")
	buf = rs.appendItemRef(buf)
	buf = append(buf, `,"part":{"type":"output_text","text":"`...)
	buf = appendTokens(buf, 0, n)
	buf = append(buf, `","annotations":[]}}`+"\n\n"...)
	buf = rs.appendEvent(buf, "response.output_item.done")
	buf = append(buf, `,"output_index":0,"item":`...)
	buf = rs.appendMessageItem(buf, n, "completed")
	buf = append(buf, "}\n\n"...)
	typ := "response.completed"
	if rs.p.maxTokensSet {
		typ = "response.incomplete"
	}
	buf = rs.appendEvent(buf, typ)
	buf = append(buf, `,"response":`...)
	buf = rs.appendResponse(buf, true)
	return append(buf, "}\n\n"...)
}
