package scraper

import (
	"strings"
	"testing"
)

func TestParseLoRA(t *testing.T) {
	const load = "vllm:num_requests_running{model_name=\"base\"} 1\n"
	tests := []struct {
		name string
		text string
		want LoRA
	}{
		{name: "not reported", text: load},
		{
			name: "one series",
			text: load + `vllm:lora_requests_info{max_lora="1",running_lora_adapters="fin",waiting_lora_adapters=""} 1.7e9` + "\n",
			want: LoRA{Running: "fin", MaxLoRA: 1},
		},
		{
			name: "the newest sample wins, not the last line",
			text: load + `vllm:lora_requests_info{max_lora="2",running_lora_adapters="b,a",waiting_lora_adapters="c"} 200
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 100
`,
			want: LoRA{Running: "a,b", Waiting: "c", MaxLoRA: 2},
		},
		{
			name: "duplicates, blanks and spaces are cleaned",
			text: load + `vllm:lora_requests_info{max_lora="4",running_lora_adapters="b, a,,b",waiting_lora_adapters=" "} 1` + "\n",
			want: LoRA{Running: "a,b", MaxLoRA: 4},
		},
		{
			name: "no slots: not reported, whatever the lists say",
			text: load + `vllm:lora_requests_info{max_lora="0",running_lora_adapters="a",waiting_lora_adapters=""} 1` + "\n",
		},
		{
			name: "garbage max_lora",
			text: load + `vllm:lora_requests_info{max_lora="None",running_lora_adapters="a",waiting_lora_adapters=""} 1` + "\n",
		},
		{
			name: "NaN sample ignored",
			text: load + `vllm:lora_requests_info{max_lora="1",running_lora_adapters="a",waiting_lora_adapters=""} NaN` + "\n",
		},
		{
			name: "an over-long name is dropped",
			text: load + `vllm:lora_requests_info{max_lora="1",running_lora_adapters="` + strings.Repeat("x", maxAdapterName+1) + `,ok",waiting_lora_adapters=""} 1` + "\n",
			want: LoRA{Running: "ok", MaxLoRA: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(strings.NewReader(tt.text), "")
			if err != nil {
				t.Fatal(err)
			}
			if got.LoRA != tt.want {
				t.Errorf("Parse().LoRA = %+v, want %+v", got.LoRA, tt.want)
			}
			if got.Model != "base" {
				t.Errorf("Parse().Model = %q, want base", got.Model)
			}
		})
	}
}

func TestLoRAMembership(t *testing.T) {
	l := LoRA{Running: "a,bb,c", Waiting: "d", MaxLoRA: 4}
	tests := []struct {
		adapter          string
		running, waiting bool
	}{
		{"a", true, false}, {"bb", true, false}, {"b", false, false}, {"c", true, false},
		{"d", false, true}, {"", false, false}, {"a,bb", false, false},
	}
	for _, tt := range tests {
		if got := l.IsRunning(tt.adapter); got != tt.running {
			t.Errorf("IsRunning(%q) = %v, want %v", tt.adapter, got, tt.running)
		}
		if got := l.IsWaiting(tt.adapter); got != tt.waiting {
			t.Errorf("IsWaiting(%q) = %v, want %v", tt.adapter, got, tt.waiting)
		}
	}
	if n := l.RunningCount(); n != 3 {
		t.Errorf("RunningCount() = %d, want 3", n)
	}
	if n := (LoRA{}).RunningCount(); n != 0 {
		t.Errorf("RunningCount() of nothing = %d, want 0", n)
	}
}

func TestParseModelName(t *testing.T) {
	tests := []struct{ text, want string }{
		{"vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 1\nvllm:num_requests_running{model_name=\"m\",engine=\"1\"} 1\n", "m"},
		{"vllm:num_requests_running{model_name=\"m\"} 1\nvllm:num_requests_running{model_name=\"n\"} 1\n", ""},
		{"vllm:num_requests_running 1\n", ""},
	}
	for _, tt := range tests {
		got, err := Parse(strings.NewReader(tt.text), "")
		if err != nil {
			t.Fatal(err)
		}
		if got.Model != tt.want {
			t.Errorf("Parse(%q).Model = %q, want %q", tt.text, got.Model, tt.want)
		}
	}
}
