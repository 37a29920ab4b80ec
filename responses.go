package caddyllm

import (
	"bytes"
	"strings"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// Stored responses: the Responses API lets a request continue an earlier response by its id
// (previous_response_id), whose history the server keeps in its own memory (vLLM's store, on by default
// in OpenAI's clients). Only the upstream that produced it can answer such a request; any other answers
// 404. transport llm reads each response's id as it relays the response and pins the id to that
// upstream in the policy's route table, as a conversation is pinned (so persist and share carry it, a
// restarted backend's pins are forgotten with its routes, and it lasts the pins' TTL); a request
// continuing it, or retrieving, cancelling or listing it (GET /v1/responses/{id}, POST .../{id}/cancel,
// GET .../{id}/input_items, DELETE), goes to that upstream while it is available (Select).

// responsesPinModel is the model the response ids are pinned under: a response id names one response
// whatever its model, and no model is named so, so they never meet a conversation's pins.
const responsesPinModel = "\x00responses"

// maxResponseIDLen is the longest response id remembered.
const maxResponseIDLen = 256

var (
	patResponseCreated = []byte(`"type":"response.created"`)
	patResponseObject  = []byte(`"response":{`)
	patID              = []byte(`"id":"`)
)

// responseID returns the response id in the first bytes of a Responses API answer: in a stream, its
// response.created event (the id of its "response" object); in a whole answer, its first "id" (vLLM
// and OpenAI write it first). It returns "" when there is none, or it is escaped or too long.
func responseID(p []byte, event bool) string {
	if event {
		if !bytes.Contains(p, patResponseCreated) {
			return ""
		}
		i := bytes.Index(p, patResponseObject)
		if i < 0 {
			return ""
		}
		p = p[i+len(patResponseObject):]
	}
	i := bytes.Index(p, patID)
	if i < 0 {
		return ""
	}
	p = p[i+len(patID):]
	end := bytes.IndexByte(p, '"')
	if end <= 0 || end > maxResponseIDLen || bytes.IndexByte(p[:end], '\\') >= 0 {
		return ""
	}
	return string(p[:end])
}

// storedUpstream returns the upstream of dial in pool when it is available, else nil.
func storedUpstream(pool reverseproxy.UpstreamPool, dial string) *reverseproxy.Upstream {
	for _, u := range pool {
		if u.Dial == dial && u.Available() {
			return u
		}
	}
	return nil
}

// responseIDInPath returns the response id a Responses API path addresses (".../responses/{id}", and
// its "/cancel" and "/input_items"), or "".
func responseIDInPath(path string) string {
	i := strings.LastIndex(path, "/responses/")
	if i < 0 {
		return ""
	}
	id, rest, _ := strings.Cut(path[i+len("/responses/"):], "/")
	if rest != "" && rest != "cancel" && rest != "input_items" {
		return ""
	}
	return id
}
