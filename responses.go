package caddyllm

import (
	"bytes"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// Stored responses: the Responses API lets a request continue an earlier response by its id
// (previous_response_id), whose history the server keeps in its own memory (vLLM's store, on by default
// in OpenAI's clients). Only the upstream that produced it can answer such a request; any other answers
// 404. transport llm reads each response's id as it relays the response, and a request continuing it,
// or retrieving, cancelling or listing it (GET /v1/responses/{id}, POST .../{id}/cancel, GET
// .../{id}/input_items, DELETE), goes to that upstream while it is available (Select).

// storedResponseCap bounds how many response ids are remembered (about 100 bytes each), and
// storedResponseTTL how long: a conversation's next turn comes within minutes, and a backend that
// restarted has lost its stored responses anyway.
const (
	storedResponseCap = 1 << 16
	storedResponseTTL = time.Hour
	maxResponseIDLen  = 256
)

// storedResponses maps response ids to the upstream (dial) that produced them. Safe for concurrent use.
type storedResponses struct {
	mu  sync.Mutex
	lru *simplelru.LRU[string, storedResponse]
}

type storedResponse struct {
	dial string
	at   int64 // unix nanoseconds, when it was relayed
}

var stored = newStoredResponses(storedResponseCap)

func newStoredResponses(capacity int) *storedResponses {
	lru, err := simplelru.NewLRU[string, storedResponse](capacity, nil)
	if err != nil {
		panic(err) // capacity is a positive constant
	}
	return &storedResponses{lru: lru}
}

// add remembers that dial produced the response id at now.
func (s *storedResponses) add(id, dial string, now int64) {
	if id == "" || len(id) > maxResponseIDLen {
		return
	}
	s.mu.Lock()
	s.lru.Add(id, storedResponse{dial: dial, at: now})
	s.mu.Unlock()
}

// upstream returns the upstream that produced the response id, if it is remembered and not older than
// storedResponseTTL at now.
func (s *storedResponses) upstream(id string, now int64) (string, bool) {
	if id == "" {
		return "", false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.lru.Get(id)
	if !ok {
		return "", false
	}
	if now-r.at > int64(storedResponseTTL) {
		s.lru.Remove(id)
		return "", false
	}
	return r.dial, true
}

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
