package vllmsim

import (
	"context"
	"strings"
	"testing"
)

// TestCutStreamAfter checks the "cut after N tokens" fault: from the config, from SetFaults and from the
// X-Sim-Cut-After header, a stream longer than N ends after exactly N tokens without [DONE], and one not
// longer than N is untouched.
func TestCutStreamAfter(t *testing.T) {
	s, ts := newTestServer(t, Config{CutStreamAfter: 7})
	check := func(name string, maxTokens, wantTokens int, hdr map[string]string) {
		t.Helper()
		resp := post(t, context.Background(), ts.URL+"/v1/chat/completions", chatBodyJSON(t, "s", "u", maxTokens, true), hdr)
		events, err := readStream(t, resp)
		cut := wantTokens < maxTokens
		if cut != (err != nil) {
			t.Errorf("%s: read error %v, want a dropped connection: %t", name, err, cut)
		}
		content, done := 0, false
		for _, e := range events {
			switch {
			case e == "[DONE]":
				done = true
			case len(e) > 0 && !strings.Contains(e, `"choices":[]`):
				content++
			}
		}
		if content != wantTokens || done == cut {
			t.Errorf("%s: %d content events, [DONE] %t; want %d, %t", name, content, done, wantTokens, !cut)
		}
	}
	check("config", 20, 7, nil)
	check("shorter than the cut", 7, 7, nil)
	check("header", 20, 3, map[string]string{"X-Sim-Cut-After": "3"})
	s.SetFaults(Faults{CutStreamAfter: 12})
	check("set faults", 20, 12, nil)
	s.SetFaults(Faults{})
	check("off", 20, 20, nil)
}
