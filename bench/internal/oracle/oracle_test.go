package oracle

import (
	"bytes"
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// fakeBackend caches a fixed number of tokens of any prompt.
type fakeBackend struct {
	load           Load
	prompt, cached int
	bodies         []string
}

func (f *fakeBackend) Load() Load { return f.load }

func (f *fakeBackend) Cached(body []byte) (int, int, error) {
	f.bodies = append(f.bodies, string(body))
	return f.prompt, f.cached, nil
}

func TestSelect(t *testing.T) {
	tests := []struct {
		name     string
		backends []*fakeBackend
		want     int
	}{
		{"all cold: fewest requests", []*fakeBackend{
			{load: Load{Requests: 3}, prompt: 1000}, {load: Load{Requests: 1}, prompt: 1000}}, 1},
		{"cache beats idle", []*fakeBackend{
			{load: Load{PendingPrefillTokens: 200, Requests: 5}, prompt: 1000, cached: 900}, {prompt: 1000}}, 0},
		{"queue beats cache", []*fakeBackend{
			{load: Load{PendingPrefillTokens: 5000}, prompt: 1000, cached: 900}, {prompt: 1000}}, 1},
		{"tie goes to the first", []*fakeBackend{{prompt: 10}, {prompt: 10}}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pool := reverseproxy.UpstreamPool{}
			for i, b := range tt.backends {
				dial := "10.0.0." + string(rune('1'+i)) + ":8000"
				Register(dial, b)
				defer Unregister(dial)
				pool = append(pool, &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: dial})
			}
			const body = `{"messages":[{"role":"user","content":"hi"}]}`
			r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body))
			got := Selection{}.Select(pool, r, nil)
			if got != pool[tt.want] {
				t.Errorf("Select() = %s, want %s", got.Dial, pool[tt.want].Dial)
			}
			for i, b := range tt.backends {
				if len(b.bodies) != 1 || b.bodies[0] != body {
					t.Errorf("backend %d saw bodies %q, want the request body once", i, b.bodies)
				}
			}
			// the body is re-installed for the upstream
			again, _ := io.ReadAll(r.Body)
			if !bytes.Equal(again, []byte(body)) || r.ContentLength != int64(len(body)) {
				t.Errorf("body after Select = %q (length %d), want the original", again, r.ContentLength)
			}
			rc, _ := r.GetBody()
			if b, _ := io.ReadAll(rc); string(b) != body {
				t.Errorf("GetBody() = %q, want the original", b)
			}
		})
	}
}

func TestSelectUnregisteredFallsBack(t *testing.T) {
	pool := reverseproxy.UpstreamPool{{Host: new(reverseproxy.Host), Dial: "10.9.9.9:1"}}
	r := httptest.NewRequest("POST", "/", strings.NewReader("{}"))
	if got := (Selection{}).Select(pool, r, nil); got != pool[0] {
		t.Errorf("Select() = %v, want the only (unregistered) upstream", got)
	}
}
