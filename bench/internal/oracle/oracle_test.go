package oracle

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
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

// TestSelectCountsPrefixesInFlight pins the duplicate-prefill bug: a request the oracle routed is
// invisible to the backend until it arrives there (and its prefix is cached only once
// prefilled), so a second request with the same long prefix, routed in that window, must follow
// it instead of prefilling the prefix elsewhere.
func TestSelectCountsPrefixesInFlight(t *testing.T) {
	a := &fakeBackend{prompt: 1000}
	b := &fakeBackend{prompt: 1000}
	Register("10.1.0.1:8000", a)
	Register("10.1.0.2:8000", b)
	defer Unregister("10.1.0.1:8000")
	defer Unregister("10.1.0.2:8000")
	pool := reverseproxy.UpstreamPool{
		{Host: new(reverseproxy.Host), Dial: "10.1.0.1:8000"},
		{Host: new(reverseproxy.Host), Dial: "10.1.0.2:8000"},
	}
	prefix := `{"messages":[{"role":"system","content":"` + strings.Repeat("shared words ", 300)
	newRequest := func(question string) (*http.Request, context.CancelFunc) {
		ctx, cancel := context.WithCancel(context.Background())
		ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{})
		body := prefix + `"},{"role":"user","content":"` + question + `"}]}`
		return httptest.NewRequest("POST", "/", strings.NewReader(body)).WithContext(ctx), cancel
	}

	first, endFirst := newRequest("one?")
	if got := (Selection{}).Select(pool, first, nil); got != pool[0] {
		t.Fatalf("first Select() = %s, want %s (tie)", got.Dial, pool[0].Dial)
	}
	// the first request is still in transit (the backend does not count it), and an unrelated
	// request makes the other backend win ties
	a.load = Load{Requests: 1}
	second, endSecond := newRequest("two?")
	defer endSecond()
	if got := (Selection{}).Select(pool, second, nil); got != pool[0] {
		t.Errorf("second Select() = %s, want %s where the same prefix is in flight", got.Dial, pool[0].Dial)
	}

	// once the requests end, nothing is in flight and the queue decides again
	endFirst()
	endSecond()
	waitReleased()
	third, endThird := newRequest("three?")
	defer waitReleased()
	defer endThird()
	if got := (Selection{}).Select(pool, third, nil); got != pool[1] {
		t.Errorf("third Select() = %s, want %s (nothing in flight: a tie, fewer requests)", got.Dial, pool[1].Dial)
	}
}

// waitReleased waits (bounded) until no request is in flight: context.AfterFunc releases in its
// own goroutine.
func waitReleased() {
	for i := 0; i < 1e6; i++ {
		inflightMu.Lock()
		n := len(inflights)
		inflightMu.Unlock()
		if n == 0 {
			return
		}
		runtime.Gosched()
	}
}
