package caddyllm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestBodyClass(t *testing.T) {
	for _, tc := range []struct{ n, class int }{
		{0, -1}, {1, 0}, {1024, 0}, {1025, 1}, {2048, 1}, {16001, 4}, {16384, 4}, {16385, 5},
		{maxPooledBody, maxPooledBodyBits - minPooledBodyBits}, {maxPooledBody + 1, -1}, {-5, -1},
	} {
		if got := bodyClass(tc.n); got != tc.class {
			t.Errorf("bodyClass(%d) = %d, want %d", tc.n, got, tc.class)
		}
		if p := getBodyBuffer(tc.n); (p != nil) != (tc.class >= 0) {
			t.Errorf("getBodyBuffer(%d) pooled = %t, want %t", tc.n, p != nil, tc.class >= 0)
		} else if p != nil && (len(*p) != tc.n || cap(*p) != 1<<(tc.class+minPooledBodyBits)) {
			t.Errorf("getBodyBuffer(%d): len %d cap %d", tc.n, len(*p), cap(*p))
		}
	}
}

// countedBody returns a pooled body over b whose releases are counted.
func countedBody(b []byte) (*pooledBody, *atomic.Int32) {
	var released atomic.Int32
	body := newPooledBody(&b)
	body.put = func(*[]byte) { released.Add(1) }
	return body, &released
}

func TestPooledBodyLifetime(t *testing.T) {
	body, released := countedBody([]byte("prompt"))
	if !body.hold() {
		t.Fatal("hold failed on a live body")
	}
	body.drop() // the request's own reference is still there
	if released.Load() != 0 {
		t.Fatal("released while the request still held it")
	}
	r := newPooledReader(body, []byte("prompt"))
	unread := newPooledReader(body, []byte("prompt"))
	p := make([]byte, 3)
	if n, err := r.Read(p); n != 3 || err != nil {
		t.Fatalf("Read = %d, %v", n, err)
	}
	body.drop() // the request ends while a reader is halfway
	if released.Load() != 0 {
		t.Fatal("released while a reader was reading it")
	}
	if n, err := r.Read(p); n != 3 || err != io.EOF || string(p) != "mpt" {
		t.Fatalf("Read = %d %q, %v; want the rest and EOF", n, p[:n], err)
	}
	if released.Load() != 1 {
		t.Fatalf("released %d times after the last reader reached the end, want 1", released.Load())
	}
	if n, err := r.Read(p); n != 0 || err != io.EOF {
		t.Fatalf("Read after the end = %d, %v", n, err)
	}
	// A reader never read held nothing; reading it now finds the buffer gone, and says so.
	if n, err := unread.Read(p); n != 0 || !errors.Is(err, errBodyReleased) {
		t.Fatalf("Read of a released body = %d, %v", n, err)
	}
	if body.hold() {
		t.Fatal("hold succeeded on a released body")
	}
	r.Close()
	unread.Close()
	if released.Load() != 1 {
		t.Fatalf("released %d times, want exactly 1", released.Load())
	}
}

func TestPooledReaderClose(t *testing.T) {
	body, released := countedBody([]byte("0123456789"))
	r := newPooledReader(body, []byte("0123456789"))
	p := make([]byte, 4)
	r.Read(p)
	r.Close()
	if n, err := r.Read(p); n != 0 || !errors.Is(err, errBodyClosed) {
		t.Fatalf("Read after Close = %d, %v", n, err)
	}
	r.Close() // twice is harmless
	body.drop()
	if released.Load() != 1 {
		t.Fatalf("released %d times, want 1", released.Load())
	}
	// io.ReadAll through a fresh body reads every byte, ending the hold at EOF with no Close.
	body, released = countedBody([]byte("0123456789"))
	got, err := io.ReadAll(newPooledReader(body, []byte("0123456789")))
	if err != nil || string(got) != "0123456789" {
		t.Fatalf("ReadAll = %q, %v", got, err)
	}
	body.drop()
	if released.Load() != 1 {
		t.Fatalf("released %d times, want 1", released.Load())
	}
}

// TestPooledBodyRace: readers on their own goroutines, closes from others and the request's end race;
// the buffer is released exactly once, after every byte any reader returned was read from it intact.
// Run with -race: a Read touching the buffer after its release is a data race with the write below.
func TestPooledBodyRace(t *testing.T) {
	want := bytes.Repeat([]byte("abcdefgh"), 512)
	for range 200 {
		buf := bytes.Clone(want)
		var released atomic.Int32
		body := newPooledBody(&buf)
		body.put = func(p *[]byte) {
			released.Add(1)
			clear(*p) // what the next request's read would do to it
		}
		var wg sync.WaitGroup
		for i := range 6 {
			r := newPooledReader(body, buf)
			wg.Add(2)
			go func() {
				defer wg.Done()
				p := make([]byte, 100)
				var got []byte
				for {
					n, err := r.Read(p)
					got = append(got, p[:n]...)
					if err != nil {
						if !bytes.Equal(got, want[:len(got)]) {
							t.Errorf("a reader read bytes that are not the body's")
						}
						return
					}
				}
			}()
			go func() {
				defer wg.Done()
				if i%2 == 0 {
					r.Close()
				}
			}()
		}
		body.drop() // the request's end
		wg.Wait()
		// Every reader reads to its end, fails to start, or is closed: nothing is left holding it.
		if n := released.Load(); n != 1 {
			t.Fatalf("released %d times, want 1", n)
		}
	}
}

// TestPooledBodiesConcurrent: many clients at once send distinct bodies of pooled sizes through a matcher
// and the policy, some retried after the first upstream drops the connection, some cancelled by their
// client at a random moment. Every upstream receives exactly the body its client sent (a buffer reused
// too early would hand one client's prompt to another's request), every request that was not cancelled
// is answered, and every pooled buffer goes back to its pool: taken and released end equal.
func TestPooledBodiesConcurrent(t *testing.T) {
	const (
		requests    = 400
		concurrency = 16
	)
	a, b := newBackend(t), newBackend(t)
	var seen sync.Map
	var mismatches atomic.Int64
	echo := func(w http.ResponseWriter, r *http.Request, body []byte) {
		var id int
		fmt.Sscan(r.Header.Get("X-Test-ID"), &id)
		if sent := testBody(id); !bytes.HasPrefix(sent, body) {
			// A body cut short is its cancelled client's (the upstream's server sees it end early);
			// a byte that differs is another request's.
			mismatches.Add(1)
			http.Error(w, "not the body the client sent", http.StatusTeapot)
			return
		}
		if r.Header.Get("X-Drop-First") != "" {
			if _, again := seen.LoadOrStore(r.Header.Get("X-Test-ID"), true); !again {
				dropConnection(w)
				return
			}
		}
		time.Sleep(time.Duration(len(body)%3) * time.Millisecond)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"choices":[{"message":{"role":"assistant","content":"ok"}}]}`)
	}
	a.handle, b.handle = echo, echo
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	@chat llm {
		stream false
	}
	handle @chat {
		reverse_proxy %s %s {
			lb_policy llm
			%s
		}
	}
	handle {
		respond "not a chat" 404
	}
}
`, site, a.dial, b.dial, retryPOST), "caddyfile")
	client := newLoadClient(true)
	defer client.CloseIdleConnections()
	waitProxyAnswers(t, client)
	taken, held := pooledBodies.taken.Load(), pooledBodies.bytes.Load()

	var wg sync.WaitGroup
	var answered, cancelled atomic.Int64
	jobs := make(chan int)
	for range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for id := range jobs {
				rng := rand.New(rand.NewPCG(uint64(id), 8))
				body := testBody(id)
				ctx, cancel := context.WithCancel(context.Background())
				if id%5 == 0 {
					time.AfterFunc(time.Duration(rng.IntN(3000))*time.Microsecond, cancel)
				}
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, proxyURL+"/v1/chat/completions", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("X-Test-ID", fmt.Sprint(id))
				if id%3 == 0 {
					req.Header.Set("X-Drop-First", "1")
				}
				res, err := client.Do(req)
				switch {
				case err != nil && ctx.Err() != nil:
					cancelled.Add(1)
				case err != nil:
					t.Errorf("request %d: %v", id, err)
				default:
					got, err := io.ReadAll(res.Body)
					res.Body.Close()
					switch {
					case err != nil && ctx.Err() != nil:
						cancelled.Add(1)
					case err != nil || res.StatusCode != http.StatusOK:
						t.Errorf("request %d: status %d, %v: %.200s", id, res.StatusCode, err, got)
					default:
						answered.Add(1)
					}
				}
				cancel()
			}
		}()
	}
	for id := range requests {
		jobs <- id
	}
	close(jobs)
	wg.Wait()
	if n := mismatches.Load(); n > 0 {
		t.Errorf("%d upstream requests carried a body other than their client's", n)
	}
	waitInflightZero(t, a.dial, b.dial)
	deadline := time.Now().Add(5 * time.Second)
	for pooledBodies.bytes.Load() != held && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	nt, left := pooledBodies.taken.Load()-taken, pooledBodies.bytes.Load()-held
	if left != 0 || nt < answered.Load() {
		t.Errorf("pooled bodies: %d taken, %d bytes still held, %d requests answered: want none held, taken >= answered", nt, left, answered.Load())
	}
	// The metrics report the same figures.
	if got := testutil.ToFloat64(bodyBytesHeld); got != float64(held) {
		t.Errorf("caddy_llm_request_body_bytes_held = %v, want %d", got, held)
	}
	t.Logf("%d answered, %d cancelled by their clients; %d pooled bodies taken, all released", answered.Load(), cancelled.Load(), nt)
}

// testBody is request id's body in TestPooledBodiesConcurrent: a chat request of 0.5-40 KB.
func testBody(id int) []byte {
	rng := rand.New(rand.NewPCG(uint64(id), 7))
	return randomBody(rng, "json", 500+rng.IntN(40_000))
}
