package caddyllm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/packages/ssestream"
	"github.com/openai/openai-go/v3/shared"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

// toolBackend is a simulated vLLM backend that also calls tools: a chat request that offers tools and
// whose last message is the user's is answered with a call of the first tool, {"city":"Paris"}, whole or
// streamed in vLLM's chunk shape (the arguments in two pieces, then the usage chunk when asked for).
// Everything else goes to the simulator, which reads tool calls and tool results in the history.
type toolBackend struct {
	sim      *vllmsim.Server
	requests chan struct{} // one value per completion request answered, tool calls included
}

func (tb *toolBackend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/chat/completions" {
		tb.sim.ServeHTTP(w, r)
		return
	}
	body, _ := io.ReadAll(r.Body)
	var req struct {
		Tools []struct {
			Function struct{ Name string } `json:"function"`
		} `json:"tools"`
		Messages      []struct{ Role string } `json:"messages"`
		Stream        bool                    `json:"stream"`
		StreamOptions struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	tb.requests <- struct{}{}
	if json.Unmarshal(body, &req) != nil || len(req.Tools) == 0 || len(req.Messages) == 0 || req.Messages[len(req.Messages)-1].Role != "user" {
		r.Body = io.NopCloser(bytes.NewReader(body))
		tb.sim.ServeHTTP(w, r)
		return
	}
	name := req.Tools[0].Function.Name
	const usage = `{"prompt_tokens":42,"completion_tokens":9,"total_tokens":51}`
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"chatcmpl-tool1","object":"chat.completion","created":1,"model":"sim-model","choices":[{"index":0,`+
			`"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":%q,"arguments":"{\"city\":\"Paris\"}"}}]},`+
			`"finish_reason":"tool_calls"}],"usage":%s}`, name, usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	chunk := func(choice string) {
		fmt.Fprintf(w, `data: {"id":"chatcmpl-tool2","object":"chat.completion.chunk","created":1,"model":"sim-model","choices":[%s]}`+"\n\n", choice)
	}
	chunk(`{"index":0,"delta":{"role":"assistant","content":null},"finish_reason":null}`)
	chunk(fmt.Sprintf(`{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_2","type":"function","function":{"name":%q,"arguments":""}}]},"finish_reason":null}`, name))
	chunk(`{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]},"finish_reason":null}`)
	chunk(`{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Paris\"}"}}]},"finish_reason":null}`)
	chunk(`{"index":0,"delta":{},"finish_reason":"tool_calls"}`)
	if req.StreamOptions.IncludeUsage {
		fmt.Fprintf(w, `data: {"id":"chatcmpl-tool2","object":"chat.completion.chunk","created":1,"model":"sim-model","choices":[],"usage":%s}`+"\n\n", usage)
	}
	io.WriteString(w, "data: [DONE]\n\n")
}

// clientBackends starts n tool-calling simulated backends and returns their dials and backends.
func clientBackends(t *testing.T, n int) ([]string, map[string]*toolBackend) {
	t.Helper()
	dials := make([]string, n)
	backends := make(map[string]*toolBackend)
	for i := range n {
		sim, err := vllmsim.New(vllmsim.Config{TimeScale: 100, Seed: int64(i + 1)})
		if err != nil {
			t.Fatal(err)
		}
		tb := &toolBackend{sim: sim, requests: make(chan struct{}, 1000)}
		srv := httptest.NewServer(tb)
		t.Cleanup(func() {
			srv.CloseClientConnections()
			sim.Close()
			srv.Close()
		})
		dials[i] = strings.TrimPrefix(srv.URL, "http://")
		backends[dials[i]] = tb
	}
	return dials, backends
}

// servedBy returns the one backend that answered since the last call (and fails unless exactly one
// request was answered, by exactly one backend).
func servedBy(t *testing.T, backends map[string]*toolBackend) string {
	t.Helper()
	served := ""
	for dial, tb := range backends {
		for n := len(tb.requests); n > 0; n-- {
			<-tb.requests
			if served != "" {
				t.Fatalf("more than one request answered: %s and %s", served, dial)
			}
			served = dial
		}
	}
	if served == "" {
		t.Fatal("no backend answered")
	}
	return served
}

// accumulate reads a streamed completion to its end, failing the test on a chunk the client's
// accumulator rejects or a stream error, and returns the accumulator and how many chunks came.
func accumulate(t *testing.T, stream *ssestream.Stream[openai.ChatCompletionChunk]) (acc openai.ChatCompletionAccumulator, chunks int) {
	t.Helper()
	defer stream.Close()
	for stream.Next() {
		chunks++
		if !acc.AddChunk(stream.Current()) {
			t.Errorf("accumulator rejected chunk %s", stream.Current().RawJSON())
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	return acc, chunks
}

// TestOpenAIGoClient drives lb_policy llm with the official OpenAI Go client, as applications do:
// non-streaming and streaming completions with usage, tool calls whole and streamed with the tool
// result sent back, and a conversation pinned by its header across turns.
func TestOpenAIGoClient(t *testing.T) {
	dials, backends := clientBackends(t, 3)
	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy %s {
		lb_policy llm {
			conversation_header X-Conversation-ID
		}
		flush_interval -1
	}
}
`, site, strings.Join(dials, " ")), "caddyfile")
	client := openai.NewClient(option.WithBaseURL(proxyURL+"/v1/"), option.WithAPIKey("test"), option.WithMaxRetries(0))
	ctx := context.Background()

	t.Run("non-streaming with usage", func(t *testing.T) {
		c, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model:     "sim-model",
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("Be brief."), openai.UserMessage("Say something.")},
			MaxTokens: openai.Int(12),
		})
		if err != nil {
			t.Fatal(err)
		}
		servedBy(t, backends)
		if len(c.Choices) != 1 || len(c.Choices[0].Message.Content) != 4*12 || c.Choices[0].FinishReason != "length" {
			t.Errorf("completion = %+v, want one choice of 12 tokens ending by length", c.Choices)
		}
		if c.Usage.CompletionTokens != 12 || c.Usage.PromptTokens == 0 || c.Usage.TotalTokens != c.Usage.PromptTokens+12 {
			t.Errorf("usage = %+v, want 12 completion tokens and a prompt", c.Usage)
		}
	})

	t.Run("streaming with usage requested", func(t *testing.T) {
		stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
			Model:         "sim-model",
			Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Stream something.")},
			MaxTokens:     openai.Int(20),
			StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
		})
		acc, chunks := accumulate(t, stream)
		servedBy(t, backends)
		if chunks < 20 || len(acc.Choices) != 1 || len(acc.Choices[0].Message.Content) != 4*20 {
			t.Errorf("%d chunks accumulated into %+v, want 20 tokens streamed", chunks, acc.Choices)
		}
		if acc.Usage.CompletionTokens != 20 || acc.Usage.PromptTokens == 0 {
			t.Errorf("streamed usage = %+v, want 20 completion tokens and a prompt", acc.Usage)
		}
	})

	t.Run("streaming without usage", func(t *testing.T) {
		stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
			Model:     "sim-model",
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("No usage please.")},
			MaxTokens: openai.Int(5),
		})
		acc, _ := accumulate(t, stream)
		servedBy(t, backends)
		if len(acc.Choices) != 1 || len(acc.Choices[0].Message.Content) != 4*5 || acc.Usage.TotalTokens != 0 {
			t.Errorf("accumulated %+v, usage %+v: want 5 tokens and no usage", acc.Choices, acc.Usage)
		}
	})

	// n asks for several completions of one prompt: one request through the proxy, that many sequences
	// on the backend (each its own choice), the usage counting every one's output.
	t.Run("several choices", func(t *testing.T) {
		params := openai.ChatCompletionNewParams{
			Model:         "sim-model",
			Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Three ways to say it.")},
			MaxTokens:     openai.Int(8),
			N:             openai.Int(3),
			StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
		}
		whole, err := client.Chat.Completions.New(ctx, params)
		if err != nil {
			t.Fatal(err)
		}
		servedBy(t, backends)
		acc, _ := accumulate(t, client.Chat.Completions.NewStreaming(ctx, params))
		servedBy(t, backends)
		for name, c := range map[string]openai.ChatCompletion{"whole": *whole, "streamed": acc.ChatCompletion} {
			if len(c.Choices) != 3 || c.Usage.CompletionTokens != 3*8 {
				t.Fatalf("%s: %d choices, usage %+v; want 3 choices and 24 completion tokens", name, len(c.Choices), c.Usage)
			}
			for i, ch := range c.Choices {
				if ch.Index != int64(i) || len(ch.Message.Content) != 4*8 || ch.FinishReason != "length" {
					t.Errorf("%s: choice %d = index %d, %q, %q; want 8 tokens ending by length", name, i, ch.Index, ch.Message.Content, ch.FinishReason)
				}
			}
		}
	})

	weather := openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{
		Name:        "get_weather",
		Description: openai.String("The weather in a city"),
		Parameters: shared.FunctionParameters{
			"type":       "object",
			"properties": map[string]any{"city": map[string]string{"type": "string"}},
			"required":   []string{"city"},
		},
	})
	// toolRound checks a tool call, answers it, and checks the model's answer to the result.
	toolRound := func(t *testing.T, stream bool, conversation string) {
		params := openai.ChatCompletionNewParams{
			Model:     "sim-model",
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("You can look up the weather."), openai.UserMessage("Weather in Paris?")},
			Tools:     []openai.ChatCompletionToolUnionParam{weather},
			MaxTokens: openai.Int(8),
		}
		opts := []option.RequestOption{option.WithHeader("X-Conversation-ID", conversation)}
		var msg openai.ChatCompletionMessage
		if stream {
			params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
			s := client.Chat.Completions.NewStreaming(ctx, params, opts...)
			var acc openai.ChatCompletionAccumulator
			finished := 0
			for s.Next() {
				acc.AddChunk(s.Current())
				if tc, ok := acc.JustFinishedToolCall(); ok {
					finished++
					if tc.Name != "get_weather" || tc.Arguments != `{"city":"Paris"}` {
						t.Errorf("streamed tool call = %+v", tc)
					}
				}
			}
			if err := s.Err(); err != nil {
				t.Fatal(err)
			}
			s.Close()
			if finished != 1 || acc.Usage.CompletionTokens != 9 {
				t.Errorf("%d tool calls finished, usage %+v: want one, and the usage chunk", finished, acc.Usage)
			}
			msg = acc.Choices[0].Message
		} else {
			c, err := client.Chat.Completions.New(ctx, params, opts...)
			if err != nil {
				t.Fatal(err)
			}
			msg = c.Choices[0].Message
			if c.Choices[0].FinishReason != "tool_calls" {
				t.Errorf("finish reason %q, want tool_calls", c.Choices[0].FinishReason)
			}
		}
		if len(msg.ToolCalls) != 1 || msg.ToolCalls[0].Function.Name != "get_weather" || msg.ToolCalls[0].Function.Arguments != `{"city":"Paris"}` {
			t.Fatalf("message %+v, want one call of get_weather for Paris", msg)
		}
		home := servedBy(t, backends)

		// The application runs the tool and sends the result back with the history.
		params.Messages = append(params.Messages, msg.ToParam(), openai.ToolMessage(`{"celsius":21}`, msg.ToolCalls[0].ID))
		params.StreamOptions = openai.ChatCompletionStreamOptionsParam{}
		c, err := client.Chat.Completions.New(ctx, params, opts...)
		if err != nil {
			t.Fatal(err)
		}
		if len(c.Choices) != 1 || len(c.Choices[0].Message.Content) != 4*8 || len(c.Choices[0].Message.ToolCalls) != 0 {
			t.Errorf("answer to the tool result = %+v, want 8 tokens of text", c.Choices)
		}
		if got := servedBy(t, backends); got != home {
			t.Errorf("the tool result went to %s, want %s where the conversation is pinned", got, home)
		}
	}
	t.Run("tool call", func(t *testing.T) { toolRound(t, false, "tools-whole") })
	t.Run("tool call streamed", func(t *testing.T) { toolRound(t, true, "tools-streamed") })

	t.Run("conversation header", func(t *testing.T) {
		// Five conversations of four turns each, every turn resending the history: each stays where its
		// first turn went.
		for conv := range 5 {
			id := fmt.Sprintf("conversation-%d", conv)
			history := []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(strings.Repeat("You are a patient tutor. ", 30))}
			home := ""
			for turn := range 4 {
				history = append(history, openai.UserMessage(fmt.Sprintf("Conversation %d, question %d: %s", conv, turn, strings.Repeat("why? ", 20))))
				c, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
					Model: "sim-model", Messages: history, MaxTokens: openai.Int(6),
				}, option.WithHeader("X-Conversation-ID", id))
				if err != nil {
					t.Fatal(err)
				}
				got := servedBy(t, backends)
				if home == "" {
					home = got
				} else if got != home {
					t.Errorf("%s turn %d went to %s, want %s", id, turn, got, home)
				}
				history = append(history, c.Choices[0].Message.ToParam())
			}
		}
	})
}
