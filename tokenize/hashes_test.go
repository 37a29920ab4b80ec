package tokenize

import (
	"encoding/json"
	"fmt"
	"hash/crc64"
	"strings"
	"testing"
)

// stepBodies are requests whose long messages have step boundaries: every kind of counted segment,
// a name, a content part that is hashed but not stepped, a 48 kB message, and a request with more
// steps than maxSteps.
func stepBodies() map[string]struct {
	api  API
	body string
} {
	doc := strings.Repeat("All work and no play makes Jack a dull boy. ", 100) // 4,400 bytes
	long := strings.Repeat("tokens and more tokens, ", 2000)                   // 48,000 bytes: over maxStepCachedBytes
	js := func(v any) string {
		b, err := json.Marshal(v)
		if err != nil {
			panic(err)
		}
		return string(b)
	}
	many := make([]map[string]any, 8)
	for i := range many {
		many[i] = map[string]any{"role": "user", "content": fmt.Sprintf("%d %s", i, strings.Repeat("abc def ", 20000))} // 160 kB each
	}
	return map[string]struct {
		api  API
		body string
	}{
		"chat": {APIChat, js(map[string]any{"messages": []any{
			map[string]any{"role": "system", "name": "policy", "content": doc},
			map[string]any{"role": "user", "content": []any{
				map[string]any{"type": "text", "text": doc[:1000]},
				map[string]any{"type": "image_url", "image_url": map[string]any{"url": "data:image/png;base64,AAAA"}},
				map[string]any{"type": "text", "text": doc[1000:]},
			}},
			map[string]any{"role": "assistant", "content": "calling", "tool_calls": []any{map[string]any{
				"id": "call_1", "type": "function",
				"function": map[string]any{"name": "lookup", "arguments": js(map[string]any{"q": doc})},
			}}},
			map[string]any{"role": "tool", "tool_call_id": "call_1", "content": long},
			map[string]any{"role": "user", "content": "and then?"},
		}})},
		"chat over maxSteps": {APIChat, js(map[string]any{"messages": many})},
		"completions":        {APICompletions, js(map[string]any{"prompt": doc + long})},
		"completions list":   {APICompletions, js(map[string]any{"prompt": []string{doc, doc + "x", "short"}})},
	}
}

// TestStepHashesUnchanged pins the boundaries' hashes and positions, steps included: routes that an
// earlier version learned, persisted or shared must match the same requests after a change to the
// counting or hashing code.
func TestStepHashesUnchanged(t *testing.T) {
	// Recorded on 95ed5b7 (per body: the number of boundaries, and a CRC-64 of their text).
	want := map[string]string{
		"chat":               "243:f74f6872c62a0264",
		"chat over maxSteps": "4104:7d3f85078829548e",
		"completions":        "205:6bf8b8992ca9b13a",
		"completions list":   "37:250e0a27f78ea43f",
	}
	table := crc64.MakeTable(crc64.ECMA)
	type pinned struct { // what routes are keyed and aligned by, as Boundary was when recorded
		Tokens int
		Hash   uint64
	}
	for name, c := range stepBodies() {
		r := mustParse(t, c.body, c.api, Options{})
		bs := make([]pinned, len(r.Boundaries))
		for i, b := range r.Boundaries {
			bs[i] = pinned{b.Tokens, b.Hash}
		}
		got := fmt.Sprintf("%d:%016x", len(bs), crc64.Checksum([]byte(fmt.Sprint(bs)), table))
		if got != want[name] {
			t.Errorf("%s: boundaries %s, want %s", name, got, want[name])
		}
	}
}

// TestStepsMarked: every boundary inside a message is marked a step, every message end is not, and a
// prompt's last boundary is an end.
func TestStepsMarked(t *testing.T) {
	for name, c := range stepBodies() {
		r := mustParse(t, c.body, c.api, Options{})
		ends := map[int]bool{}
		for _, m := range r.Messages {
			ends[m.End] = true
		}
		steps := 0
		for i, b := range r.Boundaries {
			if b.Step == ends[b.Tokens] {
				t.Errorf("%s: boundary %d at %d: step %v, a message end %v", name, i, b.Tokens, b.Step, ends[b.Tokens])
			}
			if b.Step {
				steps++
			}
		}
		if n := len(r.Boundaries); n == 0 || r.Boundaries[n-1].Step || steps == 0 {
			t.Errorf("%s: %d boundaries, %d steps, the last a step: want steps, and an end last", name, n, steps)
		}
	}
}
