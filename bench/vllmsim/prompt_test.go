package vllmsim

import (
	"testing"
)

func TestParseRequestTemplate(t *testing.T) {
	tests := []struct {
		name, body string
		chat       bool
		wantPrompt string
		wantMax    int
	}{
		{"plain chat", `{"messages":[{"role":"system","content":"S"},{"role":"user","content":"U"}]}`, true,
			"<|system|>\nS\n<|user|>\nU\n", defaultMaxTokens},
		{"escaped content", `{"messages":[{"role":"user","content":"a\nb\u00e9"}],"max_tokens":3}`, true,
			"<|user|>\na\nb\u00e9\n", 3},
		{"content parts", `{"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"text","text":"y"}]}],"max_completion_tokens":9,"max_tokens":2}`, true,
			"<|user|>\nxy\n", 9},
		{"tools and tool calls", `{"tools":[{"type":"function"}],"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}`, true,
			"<|tools|>\n[{\"type\":\"function\"}]\n<|assistant|>\n[{\"id\":\"1\"}]\n", defaultMaxTokens},
		{"text prompt", `{"prompt":"hello","max_tokens":1}`, false, "hello", 1},
		{"prompt list", `{"prompt":["ab","cd"]}`, false, "abcd", defaultMaxTokens},
		{"token ids", `{"prompt":[1,2]}`, false, "\x01\x00\x00\x00\x02\x00\x00\x00", defaultMaxTokens},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := parseRequest([]byte(tt.body), tt.chat)
			if err != nil {
				t.Fatalf("parseRequest() error = %v", err)
			}
			if string(p.prompt) != tt.wantPrompt || p.maxTokens != tt.wantMax {
				t.Errorf("parseRequest() = %q max %d, want %q max %d", p.prompt, p.maxTokens, tt.wantPrompt, tt.wantMax)
			}
		})
	}
}

func TestPromptTokens(t *testing.T) {
	for n, want := range map[int]int{1: 1, 4: 1, 5: 2, 64: 16, 65: 17} {
		if got := promptTokens(make([]byte, n)); got != want {
			t.Errorf("promptTokens(%d bytes) = %d, want %d", n, got, want)
		}
	}
}
