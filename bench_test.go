package caddyllm

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
)

// chatRequest20 is a 20-message chat request of about 4,000 tokens (cl100k): a system prompt and 19
// turns. salt makes every message unique, so a new salt misses the message cache.
func chatRequest20(salt int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"meta-llama/Llama-3.1-8B-Instruct","stream":true,"max_tokens":256,"messages":[`)
	for i := range 20 {
		role := "user"
		switch {
		case i == 0:
			role = "system"
		case i%2 == 0:
			role = "assistant"
		}
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"role":%q,"content":"%d-%d `, role, salt, i)
		for w := range 190 {
			b.WriteString([]string{"the ", "quick ", "brown ", "fox ", "jumps ", "over ", "lazy ", "dogs ", "while ", "routing "}[(w*7+i)%10])
		}
		b.WriteString(`"}`)
	}
	b.WriteString(`]}`)
	return []byte(b.String())
}

// provisionedPolicy provisions s as Caddy would and returns it with four upstreams. They are real
// listeners on 127.0.0.1 that answer 404 (an OpenAI-compatible server without /metrics): the policy
// scrapes its upstreams by default, and a test sends traffic to no address outside this machine.
func provisionedPolicy(tb testing.TB, s *LLMSelection) (*LLMSelection, reverseproxy.UpstreamPool) {
	tb.Helper()
	return provisionedPolicyN(tb, s, 4)
}

// provisionedPolicyN is provisionedPolicy with n upstreams.
func provisionedPolicyN(tb testing.TB, s *LLMSelection, n int) (*LLMSelection, reverseproxy.UpstreamPool) {
	tb.Helper()
	return provisionedPolicyWith(tb, s, n, http.NotFoundHandler())
}

// provisionedPolicyWith is provisionedPolicy with n upstreams that all answer with handler.
func provisionedPolicyWith(tb testing.TB, s *LLMSelection, n int, handler http.Handler) (*LLMSelection, reverseproxy.UpstreamPool) {
	tb.Helper()
	pool := make(reverseproxy.UpstreamPool, n)
	for i := range pool {
		backend := httptest.NewServer(handler)
		tb.Cleanup(backend.Close) // after the policy's cleanup, which stops its scrapes
		pool[i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: backend.Listener.Addr().String()}
		freshUpstream(pool[i].Dial)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	tb.Cleanup(cancel)
	if err := s.Provision(ctx); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = s.Cleanup() })
	s.logger = zap.NewNop() // the bare context logs at debug level; Caddy's default is info
	if s.scrapes != nil {
		s.scrapes.logger, s.scrapes.opts.Logger = s.logger, s.logger // each failed scrape logs at debug
	}
	return s, pool
}

// awaitScrapes starts scraping every upstream of pool and waits until each has a fresh snapshot.
func awaitScrapes(tb testing.TB, s *LLMSelection, pool reverseproxy.UpstreamPool) {
	tb.Helper()
	waitFor(tb, "a fresh scrape of every upstream", func() bool {
		for _, up := range pool {
			if _, fresh := s.scrapes.load(up.Dial); !fresh {
				return false
			}
		}
		return true
	})
}

// newProxyRequest builds the request Select sees: a POST with Caddy's variable table in its context.
func newProxyRequest(body []byte) (*http.Request, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, make(map[string]any))
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/chat/completions", bytes.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	return r, cancel
}

// BenchmarkSelect measures the policy's hot path: read the body, parse and count a 20-message ~4k-token
// chat request, match learned prefixes, choose, reserve and release. Warm: the messages are in the
// message cache (a conversation's history); cold: every message is new. combined/warm16 is warm with
// 16 upstreams instead of 4 (the choice is linear in the pool); combined/scraped16 is that with
// every upstream's metrics scraped, as in front of vLLM (the others' upstreams have no /metrics).
func BenchmarkSelect(b *testing.B) {
	b.Run("combined/warm16", func(b *testing.B) {
		s, pool := provisionedPolicyN(b, &LLMSelection{Mode: "combined"}, 16)
		selectWarm(b, s, pool, [][]byte{chatRequest20(0)})
	})
	b.Run("combined/scraped16", func(b *testing.B) {
		s, pool := provisionedPolicyWith(b, &LLMSelection{Mode: "combined"}, 16, vllmMetrics(b))
		awaitScrapes(b, s, pool)
		selectWarm(b, s, pool, [][]byte{chatRequest20(0)})
	})
	for _, mode := range []string{"least_tokens", "combined"} {
		b.Run(mode+"/warm", func(b *testing.B) {
			s, pool := provisionedPolicy(b, &LLMSelection{Mode: mode})
			selectWarm(b, s, pool, [][]byte{chatRequest20(0)})
		})
		b.Run(mode+"/cold", func(b *testing.B) {
			s, pool := provisionedPolicy(b, &LLMSelection{Mode: mode})
			salt := 1
			selectEach(b, s, pool, func() []byte {
				salt++
				return chatRequest20(salt)
			})
		})
	}
}

// agenticBody is a coding agent's request as the bench's agentic workload sends it: a 5k-token
// system prompt, a 15k-token task, then turns of a 64-token reply and a 2k-token tool result. Text
// is English-like words drawn by rng; session seeds the task.
type agenticBody struct {
	rng      *rand.Rand
	messages []string // JSON-encoded messages
}

var agenticWords = strings.Fields(`the of and to in is that for it as was with be by on not he this are or his
from at which but have an they you were her she there been one all we their has would when if so no
what can out other into more some could time these two may then do first any my now such like our
cost model token cache request answer explain write summary table list code review document question`)

func (a *agenticBody) text(tokens int) string {
	var b strings.Builder
	for b.Len() < 4*tokens {
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(agenticWords[a.rng.IntN(len(agenticWords))])
		if a.rng.IntN(10) == 0 {
			b.WriteByte('.')
		}
	}
	return b.String()
}

func (a *agenticBody) add(role string, tokens int) {
	a.messages = append(a.messages, fmt.Sprintf(`{"role":%q,"content":%q}`, role, a.text(tokens)))
}

func (a *agenticBody) body() []byte {
	return []byte(`{"model":"m","stream":true,"max_tokens":64,"messages":[` + strings.Join(a.messages, ",") + `]}`)
}

func newAgenticSession(system string, session int) *agenticBody {
	a := &agenticBody{rng: rand.New(rand.NewPCG(uint64(session), 7))}
	a.messages = append(a.messages, system)
	a.add("user", 15000)
	return a
}

// BenchmarkSelectAgentic measures a ~30k-token (120 KB) agent request: warm, the same body again
// (every message cached); turn, the session's next turn (a new reply and tool result after a
// cached history); cold, a new session (a shared system prompt, then 15k new tokens).
func BenchmarkSelectAgentic(b *testing.B) {
	system := newAgenticSession("", 0)
	system.messages = nil
	system.add("system", 5000)
	sys := system.messages[0]
	grow := func(a *agenticBody) {
		for len(a.messages) < 10 {
			a.add("assistant", 64)
			a.add("tool", 2000)
		}
	}
	b.Run("warm", func(b *testing.B) {
		s, pool := provisionedPolicy(b, &LLMSelection{})
		a := newAgenticSession(sys, 1)
		grow(a)
		body := a.body()
		b.SetBytes(int64(len(body)))
		selectWarm(b, s, pool, [][]byte{body})
	})
	b.Run("turn", func(b *testing.B) {
		s, pool := provisionedPolicy(b, &LLMSelection{})
		a := newAgenticSession(sys, 1)
		grow(a)
		selectEach(b, s, pool, func() []byte {
			a.messages = a.messages[:len(a.messages)-2]
			a.add("assistant", 64)
			a.add("tool", 2000)
			return a.body()
		})
	})
	b.Run("cold", func(b *testing.B) {
		s, pool := provisionedPolicy(b, &LLMSelection{})
		session := 1
		selectEach(b, s, pool, func() []byte {
			session++
			return newAgenticSession(sys, session).body()
		})
	})
}

// selectEach runs Select once an iteration on the body next returns, made with its request outside the
// timer.
func selectEach(b *testing.B, s *LLMSelection, pool reverseproxy.UpstreamPool, next func() []byte) {
	b.ReportAllocs()
	for b.Loop() {
		b.StopTimer()
		r, cancel := newProxyRequest(next())
		b.StartTimer()
		if s.Select(pool, r, nil) == nil {
			b.Fatal("no upstream")
		}
		cancel()
	}
}

// BenchmarkSelectShared is -overhead's traffic through Select alone: 512 requests cycling, each a
// ~3,900-token system prompt (one of 16) and its own ~100-token question, every message cached.
func BenchmarkSelectShared(b *testing.B) {
	gen := &agenticBody{rng: rand.New(rand.NewPCG(3, 4))}
	systems := make([]string, 16)
	for i := range systems {
		systems[i] = fmt.Sprintf(`{"role":"system","content":%q}`, gen.text(3900))
	}
	bodies := make([][]byte, 512)
	for i := range bodies {
		gen.messages = []string{systems[gen.rng.IntN(len(systems))]}
		gen.add("user", 100)
		bodies[i] = gen.body()
	}
	s, pool := provisionedPolicy(b, &LLMSelection{})
	selectWarm(b, s, pool, bodies)
}

// selectWarm runs Select on each of bodies once to warm the caches, then on them in turn, one an
// iteration (the request built inside the timer).
func selectWarm(b *testing.B, s *LLMSelection, pool reverseproxy.UpstreamPool, bodies [][]byte) {
	for _, body := range bodies {
		r, cancel := newProxyRequest(body)
		s.Select(pool, r, nil)
		cancel()
	}
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for b.Loop() {
		r, cancel := newProxyRequest(bodies[i%len(bodies)])
		i++
		if s.Select(pool, r, nil) == nil {
			b.Fatal("no upstream")
		}
		cancel()
	}
}

// BenchmarkSelectTurns is the bench's multi-turn-think traffic through Select in front of four
// scraped vLLM upstreams: 64 conversations in turn, each request its conversation's next turn (a
// 64-token reply and a 150-token question after a cached history behind a 500-token system prompt),
// a conversation restarting after 6 turns with new text, with the 48 requests before it still in
// flight (their reservations held, as on a busy proxy). busy runs the requests back to back; apart
// sleeps 5 ms before each (outside the timer), as a proxy whose requests arrive a few milliseconds
// apart does between them: its caches go cold, and the same work takes longer (README: Fleets beyond
// the matrix).
// Run apart with a count (-benchtime 2000x: 10 s of sleeping).
func BenchmarkSelectTurns(b *testing.B) {
	for _, c := range []struct {
		name  string
		apart time.Duration
	}{{"busy", 0}, {"apart", 5 * time.Millisecond}} {
		b.Run(c.name, func(b *testing.B) { selectTurns(b, c.apart) })
	}
}

func selectTurns(b *testing.B, apart time.Duration) {
	s, pool := provisionedPolicyWith(b, &LLMSelection{}, 4, vllmMetrics(b))
	awaitScrapes(b, s, pool)
	convs := make([]*agenticBody, 64)
	started := 0
	restart := func(i int) {
		started++
		c := &agenticBody{rng: rand.New(rand.NewPCG(uint64(started), 11))}
		c.add("system", 500)
		c.add("user", 150)
		convs[i] = c
	}
	for i := range convs {
		restart(i)
	}
	next := 0
	selectInFlight(b, s, pool, 48, apart, func() []byte {
		i := next % len(convs)
		next++
		c := convs[i]
		if len(c.messages) >= 12 {
			restart(i)
			c = convs[i]
		} else {
			c.add("assistant", 64)
			c.add("user", 150)
		}
		return c.body()
	})
}

// vllmMetrics answers every request with a vLLM metrics page, as an upstream's /metrics in front of vLLM.
func vllmMetrics(tb testing.TB) http.Handler {
	tb.Helper()
	page, err := os.ReadFile("scraper/testdata/vllm_v1_two_engines.txt")
	if err != nil {
		tb.Fatal(err)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		_, _ = w.Write(page)
	})
}

// selectInFlight is selectEach with the last inFlight requests still in flight when Select runs (their
// reservations held, as a busy proxy's are), each ended inFlight iterations later, and a sleep of apart
// before each request.
func selectInFlight(b *testing.B, s *LLMSelection, pool reverseproxy.UpstreamPool, inFlight int, apart time.Duration, next func() []byte) {
	cancels := make([]context.CancelFunc, inFlight)
	b.Cleanup(func() {
		for _, cancel := range cancels {
			if cancel != nil {
				cancel()
			}
		}
	})
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		b.StopTimer()
		r, cancel := newProxyRequest(next())
		if old := cancels[i%inFlight]; old != nil {
			old()
		}
		cancels[i%inFlight] = cancel
		i++
		if apart > 0 {
			time.Sleep(apart)
		}
		b.StartTimer()
		if s.Select(pool, r, nil) == nil {
			b.Fatal("no upstream")
		}
	}
}
