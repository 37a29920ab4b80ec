package tokenize

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// TestResponsesAsChat checks that a response's instructions and input items are counted and hashed as
// the chat messages the server renders them as: the same prompt tokens, messages and boundaries as the
// equivalent chat request, whatever the keys' order, so a conversation moving between the two APIs keeps
// its prefix (the backend has the same blocks cached for both).
func TestResponsesAsChat(t *testing.T) {
	long := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 40) // step boundaries inside
	tests := []struct {
		name            string
		responses, chat string
	}{
		{
			"string input, instructions after it",
			`{"input":"Hello there","model":"m","instructions":"You are terse. ` + long + `"}`,
			`{"model":"m","messages":[{"role":"system","content":"You are terse. ` + long + `"},{"role":"user","content":"Hello there"}]}`,
		},
		{
			"message items with input_text and output_text parts",
			`{"model":"m","input":[
				{"role":"developer","content":"Be brief."},
				{"type":"message","role":"user","content":[{"type":"input_text","text":"` + long + `"},{"type":"input_image","image_url":"data:x"}]},
				{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Sure.","annotations":[]}]},
				{"role":"user","content":"And then?"}]}`,
			`{"model":"m","messages":[
				{"role":"developer","content":"Be brief."},
				{"role":"user","content":[{"type":"text","text":"` + long + `"},{"type":"input_image","image_url":"data:x"}]},
				{"role":"assistant","content":[{"type":"text","text":"Sure."}]},
				{"role":"user","content":"And then?"}]}`,
		},
		{
			"function call and its output, keys in any order",
			`{"instructions":"Use tools.","input":[
				{"role":"user","content":"Weather in Paris?"},
				{"arguments":"{\"city\":\"Paris\"}","call_id":"call_1","name":"get_weather","type":"function_call","id":"fc_9","status":"completed"},
				{"type":"function_call_output","output":"18C, cloudy","call_id":"call_1"}],
			 "tools":[{"type":"function","name":"get_weather","parameters":{}}]}`,
			`{"tools":[{"type":"function","name":"get_weather","parameters":{}}],"messages":[
				{"role":"system","content":"Use tools."},
				{"role":"user","content":"Weather in Paris?"},
				{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},
				{"role":"tool","tool_call_id":"call_1","content":"18C, cloudy"}]}`,
		},
		{
			"empty instructions make no system message",
			`{"instructions":"","input":"Hi"}`,
			`{"messages":[{"role":"user","content":"Hi"}]}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, enc := range []string{"", "approx"} {
				resp := mustParse(t, tt.responses, APIResponses, Options{Encoding: enc})
				chat := mustParse(t, tt.chat, APIChat, Options{Encoding: enc})
				if resp.API != APIResponses {
					t.Errorf("API = %v, want responses", resp.API)
				}
				if resp.PromptTokens != chat.PromptTokens || resp.ToolsTokens != chat.ToolsTokens {
					t.Errorf("%s: prompt %d (tools %d), chat's %d (%d)", enc, resp.PromptTokens, resp.ToolsTokens, chat.PromptTokens, chat.ToolsTokens)
				}
				if !slices.Equal(resp.Messages, chat.Messages) {
					t.Errorf("%s: messages\n %+v\nchat's\n %+v", enc, resp.Messages, chat.Messages)
				}
				if !slices.Equal(resp.Boundaries, chat.Boundaries) {
					t.Errorf("%s: %d boundaries differ from chat's %d", enc, len(resp.Boundaries), len(chat.Boundaries))
				}
			}
		})
	}
}

func TestParseResponses(t *testing.T) {
	r := mustParse(t, `{"model":"gpt-x","stream":true,"max_output_tokens":300,"input":[
		{"role":"user","content":"What did I ask?"},
		{"type":"reasoning","id":"rs_1","summary":[{"type":"summary_text","text":"The user asks about the past."}]},
		{"type":"item_reference","id":"msg_7"}]}`, APIResponses, Options{})
	if r.Model != "gpt-x" || !r.Stream || r.MaxTokens != 300 {
		t.Errorf("model %q stream %v max tokens %d, want gpt-x true 300", r.Model, r.Stream, r.MaxTokens)
	}
	if len(r.Messages) != 3 {
		t.Fatalf("%d messages, want 3 (one per item)", len(r.Messages))
	}
	// Items of other types are counted by their JSON: a reasoning summary is far more than an
	// item reference, and both are more than the template's overhead.
	reasoning, ref := r.Messages[1].Tokens, r.Messages[2].Tokens
	if reasoning <= ref || ref <= perMessage+1 {
		t.Errorf("reasoning item %d tokens, item reference %d: want the reasoning's JSON counted as more", reasoning, ref)
	}
	// The same items in another key order and spacing hash alike except the raw JSON items.
	again := mustParse(t, `{"input":[{"content":"What did I ask?","role":"user"}],"model":"gpt-x"}`, APIResponses, Options{})
	if again.Messages[0].Hash != r.Messages[0].Hash {
		t.Error("a message item's hash depends on its key order")
	}
	// max_tokens is not a Responses field but is read as for the other APIs; max_output_tokens wins.
	if r := mustParse(t, `{"input":"x","max_output_tokens":"40","max_tokens":90}`, APIResponses, Options{}); r.MaxTokens != 40 {
		t.Errorf("MaxTokens = %d, want 40", r.MaxTokens)
	}
	if r := mustParse(t, `{"previous_response_id":"resp_42","input":"and then?"}`, APIResponses, Options{}); r.PreviousResponseID != "resp_42" {
		t.Errorf("PreviousResponseID = %q, want resp_42", r.PreviousResponseID)
	}
	if r := mustParse(t, `{"previous_response_id":null,"input":"x"}`, APIResponses, Options{}); r.PreviousResponseID != "" {
		t.Errorf("PreviousResponseID = %q for null, want none", r.PreviousResponseID)
	}
	// A repeated input replaces the earlier one.
	if r := mustParse(t, `{"input":[{"role":"user","content":"a"},{"role":"user","content":"b"}],"input":"c"}`, APIResponses, Options{}); len(r.Messages) != 1 {
		t.Errorf("%d messages after a repeated input, want 1", len(r.Messages))
	}
}

func TestParseResponsesMalformed(t *testing.T) {
	tests := []struct{ body, want string }{
		{`{"model":"m"}`, "input is required"},
		{`{"input":[]}`, "input must not be empty"},
		{`{"input":null}`, "input must be a string or an array of input items, not null"},
		{`{"input":42}`, "input must be a string or an array of input items, not a number"},
		{`{"input":["hi"]}`, "input[0] must be an object, not a string"},
		{`{"input":[{"content":"hi"}]}`, "input[0] must have a string role"},
		{`{"input":[{"role":"user","content":"a"},{"role":7}]}`, "input[1].role must be a string"},
		{`{"input":[{"role":"user","content":[{"type":"input_text"}]}]}`, "input[0].content[0] of type input_text must have a string text"},
		{`{"input":[{"role":"user","content":[{"text":"x"}]}]}`, "input[0].content[0] must have a string type"},
		{`{"input":[{"type":"function_call_output","call_id":"c","output":5}]}`, "input[0].output must be a string, an array of content parts, or null"},
		{`{"input":[{"type":"function_call","arguments":{}}]}`, "input[0].arguments must be a string"},
		{`{"input":[{"type":3}]}`, "input[0].type must be a string"},
		{`{"input":"x","instructions":["a"]}`, "instructions must be a string"},
		{`{"input":"x","previous_response_id":7}`, "previous_response_id must be a string"},
	}
	for _, tt := range tests {
		_, err := Parse([]byte(tt.body), APIResponses, Options{})
		if err == nil || !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Parse(%s) error = %v, want ErrMalformed containing %q", tt.body, err, tt.want)
		}
	}
	// The chat API's messages keep their own name in errors.
	if _, err := Parse([]byte(`{"messages":[{"role":"user","content":[{"text":"x"}]}]}`), APIChat, Options{}); err == nil ||
		!strings.Contains(err.Error(), "messages[0].content[0] must have a string type") {
		t.Errorf("chat error = %v, want it to name messages[0].content[0]", err)
	}
}
