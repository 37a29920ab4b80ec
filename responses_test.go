package caddyllm

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
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
	"github.com/openai/openai-go/v3/responses"

	"github.com/tokenrouter/caddy-llm/share/redistest"
)

// responsesBackend answers POST /v1/responses as vLLM does, whole or as a stream of typed events, with
// "Sunny." and a usage; a response's id names the backend. It stores every response it produces, and
// answers 404 to a request continuing one it did not (previous_response_id), as vLLM does. It has no
// /metrics, as an OpenAI-compatible server other than vLLM or SGLang.
type responsesBackend struct {
	name      string
	served    atomic.Int64
	stored    sync.Map     // response ids it produced
	failNext  atomic.Int64 // answer this many requests 503 first
	cutNext   atomic.Int64 // cut this many streams after their first delta
	retrieved atomic.Int64 // stored responses retrieved or deleted
}

func (b *responsesBackend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if id, ok := strings.CutPrefix(r.URL.Path, "/v1/responses/"); ok && (r.Method == http.MethodGet || r.Method == http.MethodDelete) {
		// A stored response's retrieval or deletion: 404 unless it was stored here.
		if _, ok := b.stored.Load(id); !ok {
			http.Error(w, `{"error":{"message":"not found","code":404}}`, http.StatusNotFound)
			return
		}
		b.retrieved.Add(1)
		w.Header().Set("Content-Type", "application/json")
		if r.Method == http.MethodDelete {
			b.stored.Delete(id)
			fmt.Fprintf(w, `{"id":%q,"object":"response.deleted","deleted":true}`, id)
			return
		}
		fmt.Fprintf(w, `{"id":%q,"object":"response","created_at":1,"status":"completed","model":"sim-model","output":[]}`, id)
		return
	}
	if r.Method != http.MethodPost || r.URL.Path != "/v1/responses" {
		http.NotFound(w, r)
		return
	}
	var req struct {
		Stream   bool   `json:"stream"`
		Previous string `json:"previous_response_id"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if b.failNext.Add(-1) >= 0 {
		http.Error(w, `{"error":{"message":"busy"}}`, http.StatusServiceUnavailable)
		return
	}
	b.failNext.Store(0)
	if _, ok := b.stored.Load(req.Previous); req.Previous != "" && !ok {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprintf(w, `{"error":{"message":"Response with id '%s' not found.","type":"invalid_request_error","param":null,"code":404}}`, req.Previous)
		return
	}
	n := b.served.Add(1)
	id := fmt.Sprintf("resp_%s_%d", b.name, n)
	b.stored.Store(id, true)
	const usage = `{"input_tokens":50,"input_tokens_details":{"cached_tokens":0},"output_tokens":2,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":52}`
	done := fmt.Sprintf(`{"id":%q,"object":"response","created_at":1,"status":"completed","model":"sim-model",`+
		`"output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Sunny.","annotations":[]}]}],`+
		`"parallel_tool_calls":true,"tool_choice":"auto","tools":[],"usage":%s}`, id, usage)
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, done)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	event := func(typ, data string) {
		fmt.Fprintf(w, "event: %s\ndata: {\"type\":%q,%s}\n\n", typ, typ, data)
	}
	event("response.created", fmt.Sprintf(`"sequence_number":0,"response":{"id":%q,"object":"response","created_at":1,"status":"in_progress","model":"sim-model","output":[]}`, id))
	for i, delta := range []string{"Sun", "ny."} {
		event("response.output_text.delta", fmt.Sprintf(`"sequence_number":%d,"item_id":"msg_1","output_index":0,"content_index":0,"delta":%q,"logprobs":[]`, i+1, delta))
		if i == 0 && b.cutNext.Load() > 0 {
			b.cutNext.Add(-1)
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler) // the connection drops mid-stream
		}
	}
	event("response.completed", `"sequence_number":3,"response":`+done)
}

// TestResponsesAPI drives lb_policy llm and the llm matcher with the official OpenAI Go client's
// Responses API, as agents send it (store false, the whole history in every request): a conversation's
// instructions and input items are read and counted, each later turn goes where its history was sent
// (its prefix found cached there), whole and streamed, with function calls and their outputs in the
// history; the matcher's api responses matches it; and llm_resume relays its typed events as they are
// (a stream of them ends without chat's [DONE]).
func TestResponsesAPI(t *testing.T) {
	dials, backends := responsesBackends(t, 3)
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	@responses llm {
		api responses
	}
	header @responses X-Responses-Matched yes
	llm_resume
	reverse_proxy %s {
		lb_policy llm
		header_down X-LLM-API {http.llm.api}
		header_down X-LLM-Prompt-Tokens {http.llm.prompt_tokens}
		header_down X-LLM-Matched {http.llm.matched_tokens}
		flush_interval -1
	}
}
`, site, strings.Join(dials, " ")), "caddyfile")
	client := openai.NewClient(option.WithBaseURL(proxyURL+"/v1/"), option.WithAPIKey("test"), option.WithMaxRetries(0))
	ctx := context.Background()
	instructions := "You are a weather assistant. " + strings.Repeat("Answer in one short sentence. ", 30)

	// history is conversation conv's input items before its turn (0-2): the user's long question, then
	// the function call the model made and its output, then the model's answer and a new question.
	history := func(conv, turn int) responses.ResponseInputParam {
		question := fmt.Sprintf("Conversation %d. %s What is the weather in Paris?", conv,
			strings.Repeat(fmt.Sprintf("Context line %d of conversation %d. ", conv, conv), 80))
		items := responses.ResponseInputParam{responses.ResponseInputItemParamOfMessage(question, responses.EasyInputMessageRoleUser)}
		if turn >= 1 {
			call := responses.ResponseInputItemParamOfFunctionCall(`{"city":"Paris"}`, fmt.Sprintf("call_%d", conv), "get_weather")
			output := responses.ResponseInputItemParamOfFunctionCallOutput("18C, cloudy")
			output.OfFunctionCallOutput.CallID = openai.String(fmt.Sprintf("call_%d", conv))
			items = append(items, call, output)
		}
		if turn >= 2 {
			items = append(items,
				responses.ResponseInputItemParamOfMessage("It is 18C and cloudy.", responses.EasyInputMessageRoleAssistant),
				responses.ResponseInputItemParamOfMessage("And tomorrow?", responses.EasyInputMessageRoleUser))
		}
		return items
	}
	// ask sends one turn and returns the backend that answered, the prompt tokens the policy counted and
	// the cached tokens it predicted.
	ask := func(t *testing.T, conv, turn int, stream bool) (backend string, prompt, matched int) {
		t.Helper()
		params := responses.ResponseNewParams{
			Model:           "sim-model",
			Instructions:    openai.String(instructions),
			Input:           responses.ResponseNewParamsInputUnion{OfInputItemList: history(conv, turn)},
			MaxOutputTokens: openai.Int(16),
			Store:           openai.Bool(false),
		}
		var httpRes *http.Response
		var id, text string
		if stream {
			s := client.Responses.NewStreaming(ctx, params, option.WithResponseInto(&httpRes))
			completed := false
			for s.Next() {
				switch ev := s.Current(); ev.Type {
				case "response.output_text.delta":
					text += ev.Delta
				case "response.completed":
					completed, id = true, ev.Response.ID
				}
			}
			if err := s.Err(); err != nil {
				t.Fatal(err)
			}
			s.Close()
			if !completed {
				t.Fatal("the stream ended without response.completed")
			}
		} else {
			res, err := client.Responses.New(ctx, params, option.WithResponseInto(&httpRes))
			if err != nil {
				t.Fatal(err)
			}
			id, text = res.ID, res.OutputText()
			if res.Usage.OutputTokens != 2 {
				t.Errorf("usage %+v, want the backend's", res.Usage)
			}
		}
		if text != "Sunny." {
			t.Errorf("answer %q, want Sunny.", text)
		}
		h := httpRes.Header
		if h.Get("X-LLM-API") != "responses" || h.Get("X-Responses-Matched") != "yes" {
			t.Errorf("api placeholder %q, matcher header %q: want responses, yes", h.Get("X-LLM-API"), h.Get("X-Responses-Matched"))
		}
		prompt, _ = strconv.Atoi(h.Get("X-LLM-Prompt-Tokens"))
		matched, _ = strconv.Atoi(h.Get("X-LLM-Matched"))
		parts := strings.Split(id, "_")
		if len(parts) != 3 || backends[parts[1]] == nil {
			t.Fatalf("response id %q names no backend", id)
		}
		return parts[1], prompt, matched
	}

	for conv := range 4 {
		home, first, _ := ask(t, conv, 0, conv%2 == 1)
		if first < 900 {
			t.Errorf("conversation %d: first turn counted %d prompt tokens, want the instructions and the long question (900+)", conv, first)
		}
		last := first
		for turn := 1; turn <= 2; turn++ {
			got, prompt, matched := ask(t, conv, turn, (conv+turn)%2 == 1)
			if got != home {
				t.Errorf("conversation %d turn %d went to backend %s, its history to %s", conv, turn, got, home)
			}
			if prompt <= last || matched < first-64 {
				t.Errorf("conversation %d turn %d: %d prompt tokens (the turn before %d), %d predicted cached: want more, and the history found", conv, turn, prompt, last, matched)
			}
			last = prompt
		}
	}
	if n := servedTotal(backends); n != 12 {
		t.Errorf("backends answered %d requests, want 12", n)
	}
}

// TestResumeRetriesResponses: behind llm_resume, a Responses API request whose upstream answers 503 is
// sent again, whole and streamed, and the client gets one answer; a continuation of a stored response
// is sent again to the upstream that stores it (any other would answer 404); a stream that breaks after
// it started is not sent again (its events went to the client as they came: a second response would
// follow the first's half), and the client sees it broken, as without the handler.
func TestResumeRetriesResponses(t *testing.T) {
	dials, backends := responsesBackends(t, 2)
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	llm_resume
	reverse_proxy %s {
		lb_policy llm
		transport llm
		flush_interval -1
	}
}
`, site, strings.Join(dials, " ")), "caddyfile")
	client := openai.NewClient(option.WithBaseURL(proxyURL+"/v1/"), option.WithAPIKey("test"), option.WithMaxRetries(0))
	ctx := context.Background()
	params := func(input, previous string) responses.ResponseNewParams {
		p := responses.ResponseNewParams{Model: "sim-model", Input: responses.ResponseNewParamsInputUnion{OfString: openai.String(input)}}
		if previous != "" {
			p.PreviousResponseID = openai.String(previous)
		}
		return p
	}
	stream := func(input, previous string) (id, text string, err error) {
		s := client.Responses.NewStreaming(ctx, params(input, previous))
		defer s.Close()
		for s.Next() {
			switch ev := s.Current(); ev.Type {
			case "response.output_text.delta":
				text += ev.Delta
			case "response.completed":
				id = ev.Response.ID
			}
		}
		return id, text, s.Err()
	}
	failAll := func(n int64) {
		for _, b := range backends {
			b.failNext.Store(n)
		}
	}

	// Both upstreams answer their next request 503: the first attempt fails on one, the second on the
	// other, the third succeeds.
	before := resumeCounts()
	failAll(1)
	res, err := client.Responses.New(ctx, params("What is the weather?", ""))
	if err != nil {
		t.Fatalf("whole response after two 503s: %v", err)
	}
	if res.OutputText() != "Sunny." {
		t.Errorf("whole response after two 503s: answer %q, want Sunny.", res.OutputText())
	}
	awaitResumeCounted(t, "whole", before, resumeRetriedWhole)
	before = resumeCounts()
	failAll(1)
	if id, text, err := stream("And tomorrow?", ""); err != nil || text != "Sunny." || id == "" {
		t.Fatalf("streamed response after two 503s: %v (answer %q, id %q)", err, text, id)
	}
	awaitResumeCounted(t, "stream", before, resumeRetriedWhole)
	for name, b := range backends {
		if n := b.failNext.Load(); n > 0 {
			t.Errorf("backend %s was not tried (%d failures left): the request was not re-sent", name, n)
		}
	}

	// A continuation goes home again after a 503 there, twice.
	home := backendOf(res.ID)
	backends[home].failNext.Store(2)
	before = resumeCounts()
	next, err := client.Responses.New(ctx, params("And the day after?", res.ID))
	if err != nil || backendOf(next.ID) != home {
		t.Fatalf("continuation after two 503s at its home %s: %v", home, err)
	}
	awaitResumeCounted(t, "continuation", before, resumeRetriedWhole)

	// A stream cut after its first delta is not sent again.
	served := servedTotal(backends)
	for _, b := range backends {
		b.cutNext.Store(1)
	}
	before = resumeCounts()
	_, text, err := stream("Will it rain?", "")
	if err == nil && text == "Sunny." {
		t.Errorf("a stream cut after its first delta reached the client whole (%q)", text)
	}
	if text != "Sun" {
		t.Errorf("the cut stream gave the client %q, want its first delta only (Sun)", text)
	}
	if n := servedTotal(backends) - served; n != 1 {
		t.Errorf("the cut stream's request was served %d times, want once", n)
	}
	time.Sleep(50 * time.Millisecond) // the handler counts after it returns the answer: give it the time
	if after := resumeCounts(); after != before {
		t.Errorf("resume counts moved from %v to %v for a request that was not resumed", before, after)
	}
}

// respond creates a whole response of input through client, continuing previous unless it is "", and
// returns its id; an error (a 404 from a backend that does not hold previous) fails the test.
func respond(t *testing.T, client openai.Client, input, previous string) string {
	t.Helper()
	params := responses.ResponseNewParams{Model: "sim-model", Input: responses.ResponseNewParamsInputUnion{OfString: openai.String(input)}}
	if previous != "" {
		params.PreviousResponseID = openai.String(previous)
	}
	res, err := client.Responses.New(context.Background(), params)
	if err != nil {
		t.Fatalf("continuing %q: %v", previous, err)
	}
	return res.ID
}

// backendOf returns the name of the responsesBackend that produced the response id.
func backendOf(id string) string { return strings.Split(id, "_")[1] }

// servedTotal returns how many responses the backends produced.
func servedTotal(backends map[string]*responsesBackend) int64 {
	n := int64(0)
	for _, b := range backends {
		n += b.served.Load()
	}
	return n
}

// responsesBackends starts n responsesBackends and returns their dials and the backends by name.
func responsesBackends(t *testing.T, n int) ([]string, map[string]*responsesBackend) {
	t.Helper()
	backends := map[string]*responsesBackend{}
	var dials []string
	for i := range n {
		b := &responsesBackend{name: strconv.Itoa(i)}
		srv := httptest.NewServer(b)
		t.Cleanup(srv.Close)
		dials = append(dials, strings.TrimPrefix(srv.URL, "http://"))
		backends[b.name] = b
	}
	return dials, backends
}

// TestResponsesContinueWhereStored: with transport llm, a request continuing a stored response
// (previous_response_id) goes to the upstream that produced it, whole and streamed, every turn of several
// conversations; any other upstream would answer 404. The decision is reported as the conversation's.
// A retry after that upstream failed goes there again, the only one that can answer, and so do the
// stored response's retrieval and deletion.
func TestResponsesContinueWhereStored(t *testing.T) {
	dials, backends := responsesBackends(t, 3)
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy llm
		transport llm
		lb_retries 1
		lb_retry_match {
			expression `+"`{rp.status_code} == 503`"+`
		}
		header_down X-LLM-Reason {http.llm.upstream_reason}
		flush_interval -1
	}
}
`, site, strings.Join(dials, " ")), "caddyfile")
	client := openai.NewClient(option.WithBaseURL(proxyURL+"/v1/"), option.WithAPIKey("test"), option.WithMaxRetries(0))
	ctx := context.Background()
	send := func(t *testing.T, input, previous string, stream bool) (id, reason string) {
		t.Helper()
		params := responses.ResponseNewParams{
			Model: "sim-model",
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String(input)},
		}
		if previous != "" {
			params.PreviousResponseID = openai.String(previous)
		}
		var httpRes *http.Response
		if !stream {
			res, err := client.Responses.New(ctx, params, option.WithResponseInto(&httpRes))
			if err != nil {
				t.Fatalf("continuing %q: %v", previous, err)
			}
			return res.ID, httpRes.Header.Get("X-LLM-Reason")
		}
		s := client.Responses.NewStreaming(ctx, params, option.WithResponseInto(&httpRes))
		for s.Next() {
			if ev := s.Current(); ev.Type == "response.completed" {
				id = ev.Response.ID
			}
		}
		if err := s.Err(); err != nil {
			t.Fatalf("continuing %q: %v", previous, err)
		}
		s.Close()
		return id, httpRes.Header.Get("X-LLM-Reason")
	}
	homes := map[string]bool{}
	for conv := range 6 {
		id, _ := send(t, fmt.Sprintf("Conversation %d: %s", conv, strings.Repeat("some context ", 50)), "", conv%2 == 0)
		home := backendOf(id)
		homes[home] = true
		for turn := 1; turn <= 3; turn++ {
			if turn == 2 {
				backends[home].failNext.Store(1) // the first attempt fails; the retry must go home again
			}
			next, reason := send(t, fmt.Sprintf("Turn %d of conversation %d: and then?", turn, conv), id, (conv+turn)%2 == 0)
			if backendOf(next) != home || reason != "conversation" {
				t.Errorf("conversation %d turn %d answered by backend %s (reason %q), its stored response by %s", conv, turn, backendOf(next), reason, home)
			}
			id = next
		}
		if res, err := client.Responses.Get(ctx, id, responses.ResponseGetParams{}); err != nil || res.ID != id {
			t.Errorf("retrieving %s: %v", id, err)
		}
		if err := client.Responses.Delete(ctx, id); err != nil {
			t.Errorf("deleting %s: %v", id, err)
		}
	}
	if len(homes) < 2 {
		t.Errorf("the conversations started on %d backend(s): want them spread, so that staying is not chance", len(homes))
	}
	if n := servedTotal(backends); n != 24 {
		t.Errorf("backends answered %d requests, want 24", n)
	}
	retrieved := int64(0)
	for _, b := range backends {
		retrieved += b.retrieved.Load()
	}
	if retrieved != 12 {
		t.Errorf("%d retrievals and deletions answered, want 12", retrieved)
	}
}

func TestResponseIDInPath(t *testing.T) {
	for path, want := range map[string]string{
		"/v1/responses/resp_1":             "resp_1",
		"/openai/v1/responses/resp_1":      "resp_1",
		"/v1/responses/resp_1/cancel":      "resp_1",
		"/v1/responses/resp_1/input_items": "resp_1",
		"/v1/responses/resp_1/other":       "",
		"/v1/responses":                    "",
		"/v1/chat/completions":             "",
	} {
		if got := responseIDInPath(path); got != want {
			t.Errorf("responseIDInPath(%q) = %q, want %q", path, got, want)
		}
	}
}

func TestResponseID(t *testing.T) {
	long := strings.Repeat("x", maxResponseIDLen+1)
	tests := []struct {
		name  string
		body  string
		event bool
		want  string
	}{
		{"created event", `data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_abc","object":"response"}}`, true, "resp_abc"},
		{"another event", `data: {"type":"response.output_text.delta","item_id":"msg_1","delta":"x"}`, true, ""},
		{"created event, id after other fields", `data: {"type":"response.created","response":{"object":"response","id":"resp_9"}}`, true, "resp_9"},
		{"whole answer", `{"id":"resp_1","object":"response","output":[{"id":"msg_1"}]}`, false, "resp_1"},
		{"escaped id", `{"id":"resp_\u0041","object":"response"}`, false, ""},
		{"too long", `{"id":"` + long + `"}`, false, ""},
		{"no id", `{"object":"response"}`, false, ""},
		{"empty id", `{"id":""}`, false, ""},
	}
	for _, tt := range tests {
		if got := responseID([]byte(tt.body), tt.event); got != tt.want {
			t.Errorf("%s: responseID = %q, want %q", tt.name, got, tt.want)
		}
	}
}

// TestStoredResponsesPersist: the response ids are pins of the route table, so persist carries them over
// a restart of the proxy: continuations after it still reach the backends that stored the responses.
func TestStoredResponsesPersist(t *testing.T) {
	dir := t.TempDir()
	dials, backends := responsesBackends(t, 3)
	config := strings.Replace(globalOptions, "{", "{\n\tstorage file_system "+dir, 1) + fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy llm {
			persist 1h
		}
		transport llm
	}
}
`, site, strings.Join(dials, " "))
	tester := caddytest.NewTester(t)
	tester.InitServer(config, "caddyfile")
	client := openai.NewClient(option.WithBaseURL(proxyURL+"/v1/"), option.WithAPIKey("test"), option.WithMaxRetries(0))
	var ids []string
	for conv := range 6 {
		ids = append(ids, respond(t, client, fmt.Sprintf("Conversation %d: %s", conv, strings.Repeat("context ", 40)), ""))
	}
	// Unload (the table is dropped after its last snapshot), then start again from the snapshot.
	tester.InitServer(globalOptions+site+" {\n\trespond ok\n}\n", "caddyfile")
	if len(allRoutes()) != 0 {
		t.Fatal("the route table outlived the last config using it")
	}
	tester.InitServer(config, "caddyfile")
	t.Cleanup(func() { tester.InitServer(globalOptions+site+" {\n\trespond ok\n}\n", "caddyfile") })
	if p := adminState(t, adminURL).Tables[0].Persist; p == nil || p.RestoredPins < 6 {
		t.Fatalf("persist after restart = %+v, want the 6 response ids restored as pins", p)
	}
	for conv, id := range ids {
		next := respond(t, client, fmt.Sprintf("Turn 2 of conversation %d", conv), id)
		if home, got := backendOf(id), backendOf(next); got != home {
			t.Errorf("conversation %d continued on backend %s after the restart, stored on %s", conv, got, home)
		}
	}
	if n := servedTotal(backends); n != 12 {
		t.Errorf("backends answered %d requests, want 12", n)
	}
}

// TestStoredResponsesShared runs two Caddy processes sharing through redis-server: a response created
// through one is continued through the other, which learned where it is stored from the pin the first
// published (the continuation would get a 404 from any other backend).
func TestStoredResponsesShared(t *testing.T) {
	srv := redistest.Start(t)
	dials, backends := responsesBackends(t, 3)
	cfg := strings.NewReplacer("UPSTREAMS", strings.Join(dials, " "),
		"OPTIONS", "share "+srv.URL()+" {\n\t\t\t\tflush_interval 20ms\n\t\t\t}",
		"header_down X-LLM-Reason", "transport llm\n\t\theader_down X-LLM-Reason").Replace(processCaddyfile)
	a, b := startCaddyProcess(t, t.TempDir(), cfg), startCaddyProcess(t, t.TempDir(), cfg)
	for _, c := range []*caddyProcess{a, b} {
		waitState(t, c, "connected", func(s stateResponse) bool { return s.Tables[0].Share.Connected })
	}
	clientOf := func(c *caddyProcess) openai.Client {
		return openai.NewClient(option.WithBaseURL(c.URL+"/v1/"), option.WithAPIKey("test"), option.WithMaxRetries(0))
	}
	ca, cb := clientOf(a), clientOf(b)
	for conv := range 6 {
		pins := adminState(t, b.Admin).Tables[0].Pins
		first := respond(t, ca, fmt.Sprintf("Conversation %d: %s", conv, strings.Repeat("context ", 40)), "")
		waitState(t, b, "the response's pin", func(s stateResponse) bool { return s.Tables[0].Pins > pins })
		next := respond(t, cb, fmt.Sprintf("Turn 2 of conversation %d", conv), first)
		if home, got := backendOf(first), backendOf(next); got != home {
			t.Errorf("conversation %d continued on backend %s, stored on %s", conv, got, home)
		}
	}
	if n := servedTotal(backends); n != 12 {
		t.Errorf("backends answered %d requests, want 12", n)
	}
}
