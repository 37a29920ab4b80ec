package caddyllm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
)

// embeddingsBackend answers POST /v1/embeddings as vLLM does: one two-dimensional vector per input and a
// usage, whole (embeddings never stream). While hold is set, each request waits for release before it
// answers. It has no /metrics, as an OpenAI-compatible server other than vLLM or SGLang.
type embeddingsBackend struct {
	name     string
	dial     string
	served   atomic.Int64
	failNext atomic.Int64  // answer this many requests 503 first
	arrived  chan struct{} // one value per request received
	mu       sync.Mutex
	hold     bool
	released chan struct{}
}

func newEmbeddingsBackend(t *testing.T, name string) *embeddingsBackend {
	t.Helper()
	b := &embeddingsBackend{name: name, arrived: make(chan struct{}, 64), released: make(chan struct{})}
	srv := httptest.NewServer(b)
	t.Cleanup(srv.Close)
	t.Cleanup(b.release) // before the server closes: a held request must not hang its Close
	b.dial = strings.TrimPrefix(srv.URL, "http://")
	return b
}

func (b *embeddingsBackend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/embeddings" {
		http.NotFound(w, r)
		return
	}
	var req struct {
		Input json.RawMessage `json:"input"`
		Model string          `json:"model"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	inputs := 1
	var batch []json.RawMessage
	if json.Unmarshal(req.Input, &batch) == nil && len(batch) > 0 && batch[0][0] != '-' && (batch[0][0] < '0' || batch[0][0] > '9') {
		inputs = len(batch)
	}
	if b.failNext.Add(-1) >= 0 {
		http.Error(w, `{"error":{"message":"busy"}}`, http.StatusServiceUnavailable)
		return
	}
	b.failNext.Store(0)
	b.arrived <- struct{}{}
	b.mu.Lock()
	hold, released := b.hold, b.released
	b.mu.Unlock()
	if hold {
		select {
		case <-released:
		case <-r.Context().Done():
			return
		}
	}
	b.served.Add(1)
	var data []string
	for i := range inputs {
		data = append(data, fmt.Sprintf(`{"object":"embedding","index":%d,"embedding":[0.25,-0.5]}`, i))
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Backend", b.name)
	fmt.Fprintf(w, `{"id":"embd-%s","object":"list","created":1,"model":%q,"data":[%s],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":0}}`,
		b.name, req.Model, strings.Join(data, ","), 10*inputs, 10*inputs)
}

// setHold makes the backend hold every request until release (hold true), or answer at once.
func (b *embeddingsBackend) setHold(hold bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.hold = hold
	if hold {
		b.released = make(chan struct{})
	}
}

// release answers every held request.
func (b *embeddingsBackend) release() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.hold = false
	select {
	case <-b.released:
	default:
		close(b.released)
	}
}

// TestEmbeddings drives embeddings requests through lb_policy llm, transport llm and the llm matcher
// with the official OpenAI Go client: the matcher's api embeddings sends them to the embedding pool; the
// policy counts each request's inputs (a batch, the sum) and routes by the work each backend has, so
// while one backend prefills a batch of several thousand tokens, the single texts that follow go to the
// other (least_conn sees one request in flight on each and sends some behind the batch); every
// reservation ends (nothing generated, nothing left in flight); llm_resume sends one again after its
// upstream answered 503; and a chat request still goes to the chat pool.
func TestEmbeddings(t *testing.T) {
	a, b := newEmbeddingsBackend(t, "a"), newEmbeddingsBackend(t, "b")
	chat := newBackend(t)
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	@embed llm {
		api embeddings
		model bge-*
	}
	handle @embed {
		llm_resume
		reverse_proxy %s %s {
			lb_policy llm
			transport llm
			header_down X-LLM-API {http.llm.api}
			header_down X-LLM-Prompt-Tokens {http.llm.prompt_tokens}
		}
	}
	handle {
		reverse_proxy %s {
			lb_policy llm
		}
	}
}
`, site, a.dial, b.dial, chat.dial), "caddyfile")
	client := openai.NewClient(option.WithBaseURL(proxyURL+"/v1/"), option.WithAPIKey("test"), option.WithMaxRetries(0))
	ctx := context.Background()
	embed := func(input openai.EmbeddingNewParamsInputUnion) (backend string, prompt int, vectors int, err error) {
		var httpRes *http.Response
		res, err := client.Embeddings.New(ctx, openai.EmbeddingNewParams{
			Model:          "bge-m3",
			Input:          input,
			EncodingFormat: openai.EmbeddingNewParamsEncodingFormatFloat,
		}, option.WithResponseInto(&httpRes))
		if err != nil {
			return "", 0, 0, err
		}
		if api := httpRes.Header.Get("X-LLM-API"); api != "embeddings" {
			t.Errorf("api placeholder %q, want embeddings", api)
		}
		prompt, _ = strconv.Atoi(httpRes.Header.Get("X-LLM-Prompt-Tokens"))
		return httpRes.Header.Get("X-Backend"), prompt, len(res.Data), nil
	}

	// Counted: one text, and a batch as the sum of its inputs.
	text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 5) // 50 tokens (cl100k)
	_, one, n, err := embed(openai.EmbeddingNewParamsInputUnion{OfString: openai.String(text)})
	if err != nil || n != 1 || one < 45 || one > 55 {
		t.Fatalf("one text: %v, %d vectors, %d prompt tokens counted (want about 50)", err, n, one)
	}
	_, three, n, err := embed(openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{text, text, text}})
	if err != nil || n != 3 || three != 3*one {
		t.Fatalf("a batch of three: %v, %d vectors, %d prompt tokens counted (want %d)", err, n, three, 3*one)
	}
	// Both upstreams answer 503 once: the third attempt succeeds.
	a.failNext.Store(1)
	b.failNext.Store(1)
	before := resumeCounts()
	if _, _, n, err := embed(openai.EmbeddingNewParamsInputUnion{OfString: openai.String(text)}); err != nil || n != 1 {
		t.Fatalf("after two 503s: %v, %d vectors", err, n)
	}
	awaitResumeCounted(t, "embeddings", before, resumeRetriedWhole)
	waitInflightZero(t, a.dial, b.dial)
	for _, be := range []*embeddingsBackend{a, b} {
		for len(be.arrived) > 0 {
			<-be.arrived
		}
	}

	// A batch of 200 texts (10k tokens) held at one backend; then single texts, one at a time.
	a.setHold(true)
	b.setHold(true)
	batch := make([]string, 200)
	for i := range batch {
		batch[i] = fmt.Sprintf("Document %d. %s", i, text)
	}
	bigDone := make(chan string, 1)
	go func() {
		backend, _, _, err := embed(openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: batch})
		if err != nil {
			t.Errorf("the batch: %v", err)
		}
		bigDone <- backend
	}()
	busy := waitArrival(t, a, b)
	idle := a
	if busy == a {
		idle = b
	}
	// Six single texts, each held where it lands: least_conn sees a tie (a request in flight on each) and
	// sent two of six behind the batch; llm sends them where the work is.
	var queries sync.WaitGroup
	for i := range 6 {
		queries.Add(1)
		go func() {
			defer queries.Done()
			if _, _, _, err := embed(openai.EmbeddingNewParamsInputUnion{OfString: openai.String(fmt.Sprintf("Query %d: %s", i, text))}); err != nil {
				t.Errorf("query %d: %v", i, err)
			}
		}()
		if got := waitArrival(t, a, b); got != idle {
			t.Errorf("query %d went to backend %s, which is embedding a 10k-token batch; want %s", i, got.name, idle.name)
		}
	}
	idle.release()
	busy.release()
	queries.Wait()
	if got := <-bigDone; got != busy.name {
		t.Errorf("the batch was answered by %s, held at %s", got, busy.name)
	}
	waitInflightZero(t, a.dial, b.dial)

	// A chat request is not an embeddings request: the chat pool takes it.
	res, body := post(t, tester.Client, "/v1/chat/completions", chatBody("bge-m3", 20, false))
	if res.StatusCode != http.StatusOK || !strings.Contains(body, chat.dial) {
		t.Errorf("chat request: %d %s, want the chat backend's answer", res.StatusCode, body)
	}
	if served := a.served.Load() + b.served.Load(); served != 10 {
		t.Errorf("embedding backends served %d requests, want 10", served)
	}
}

// waitArrival returns the backend that receives the next request.
func waitArrival(t *testing.T, backends ...*embeddingsBackend) *embeddingsBackend {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		for _, b := range backends {
			select {
			case <-b.arrived:
				return b
			default:
			}
		}
		select {
		case <-timeout:
			t.Fatal("no backend received the request")
		case <-time.After(time.Millisecond):
		}
	}
}
