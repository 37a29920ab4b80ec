package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// openAINodeEnv names the directory where the official `openai` npm package is installed
// (`npm install --prefix "$dir" openai@6.49.0`; .ci/run does this). 6.49.0 is the newest release that
// runs on Node 20, the CI machine's; openai 7 requires Node 22.
const openAINodeEnv = "CADDY_LLM_OPENAI_NODE"

// openAINode returns node's path and the package directory, or skips the test - or fails it under CI,
// where a missing client must not pass silently.
func openAINode(t *testing.T) (node, dir string) {
	t.Helper()
	missing := func(format string, args ...any) {
		t.Helper()
		msg := fmt.Sprintf(format, args...) + fmt.Sprintf("; to run it: npm install --prefix DIR openai@6.49.0 && %s=DIR go test ./cmd/caddy", openAINodeEnv)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	node, err := exec.LookPath("node")
	if err != nil {
		missing("node is not installed")
	}
	dir = os.Getenv(openAINodeEnv)
	if dir == "" {
		missing("%s is not set", openAINodeEnv)
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "openai", "package.json")); err != nil {
		missing("the openai npm package is not installed in %s: %v", dir, err)
	}
	return node, dir
}

// TestDemoWithOpenAINodeClient runs the official `openai` npm package against the demo config
// (examples/Caddyfile): a non-streamed and a streamed chat completion through lb_policy llm to the
// simulated backends, with usage, and a stored response continued by previous_response_id for three
// turns and retrieved, which only the backend that stored it can answer.
func TestDemoWithOpenAINodeClient(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy and node")
	}
	node, dir := openAINode(t)
	home := t.TempDir()
	for _, v := range []string{"HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME"} {
		t.Setenv(v, home)
	}
	config, admin, proxy := demoConfig(t)
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	tester.InitServer(config, "caddyfile")
	if t.Failed() {
		t.FailNow()
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	script, err := filepath.Abs(filepath.Join("testdata", "openai_client.cjs"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, node, script)
	cmd.Env = append(os.Environ(),
		"NODE_PATH="+filepath.Join(dir, "node_modules"),
		fmt.Sprintf("OPENAI_BASE_URL=http://127.0.0.1:%d/v1", proxy))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("node %s: %v\nstdout:\n%s\nstderr:\n%s", script, err, stdout.Bytes(), stderr.Bytes())
	}

	type usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	}
	type result struct {
		Kind         string `json:"kind"`
		Model        string `json:"model"`
		Content      string `json:"content"`
		FinishReason string `json:"finish_reason"`
		Usage        *usage `json:"usage"`
		Chunks       int    `json:"chunks"`
		IDs          int    `json:"ids"`
		// The Responses API's
		ResponseUsage *struct {
			InputTokens  int `json:"input_tokens"`
			OutputTokens int `json:"output_tokens"`
		} `json:"response_usage"`
		Retrieved bool `json:"retrieved"`
		// Embeddings': the length of the second vector
		EmbeddingNorm float64 `json:"embedding_norm"`
	}
	results := map[string]result{}
	printed := stdout.String()
	sc := bufio.NewScanner(&stdout)
	for sc.Scan() {
		var r result
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("node printed %q: %v", sc.Text(), err)
		}
		results[r.Kind] = r
	}
	t.Logf("node client printed:\n%s", printed)

	// The simulator's output tokens are 4-byte words.
	whole, ok := results["whole"]
	switch {
	case !ok:
		t.Error("no non-streamed completion reported")
	case len(whole.Content) != 4*12 || whole.FinishReason != "length" || whole.Model != "sim-model":
		t.Errorf("non-streamed completion %+v, want 12 tokens of sim-model ending by length", whole)
	case whole.Usage == nil || whole.Usage.CompletionTokens != 12 || whole.Usage.PromptTokens == 0 ||
		whole.Usage.TotalTokens != whole.Usage.PromptTokens+12:
		t.Errorf("non-streamed usage %+v, want 12 completion tokens and a prompt", whole.Usage)
	}
	stream, ok := results["stream"]
	switch {
	case !ok:
		t.Error("no streamed completion reported")
	case len(stream.Content) != 4*20 || stream.FinishReason != "length" || stream.Chunks < 20 || stream.IDs != 1:
		t.Errorf("streamed completion %+v, want 20 tokens in at least 20 chunks of one id, ending by length", stream)
	case stream.Usage == nil || stream.Usage.CompletionTokens != 20 || stream.Usage.PromptTokens == 0:
		t.Errorf("streamed usage %+v, want 20 completion tokens and a prompt", stream.Usage)
	}

	resp, ok := results["responses"]
	switch {
	case !ok:
		t.Error("no stored response continued")
	case resp.IDs != 4 || resp.Chunks != 8 || len(resp.Content) != 4*8 || !resp.Retrieved:
		t.Errorf("responses %+v: want 4 responses, the streamed one of 8 tokens, the last retrieved", resp)
	case resp.ResponseUsage == nil || resp.ResponseUsage.OutputTokens != 8 || resp.ResponseUsage.InputTokens == 0:
		t.Errorf("response usage %+v, want 8 output tokens and a prompt", resp.ResponseUsage)
	}

	emb, ok := results["embeddings"]
	switch {
	case !ok:
		t.Error("no embeddings reported")
	case emb.IDs != 2 || emb.Chunks != 8 || math.Abs(emb.EmbeddingNorm-1) > 1e-3:
		t.Errorf("embeddings %+v: want 2 vectors of 8 values, unit length (decoded from base64)", emb)
	case emb.Usage == nil || emb.Usage.PromptTokens == 0 || emb.Usage.TotalTokens != emb.Usage.PromptTokens:
		t.Errorf("embeddings usage %+v, want the inputs' tokens", emb.Usage)
	}

	// They went through lb_policy llm: it learned their prompt's prefixes.
	res, err := http.Get(fmt.Sprintf("http://localhost:%d/llm/upstreams", admin))
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var report struct {
		Routes struct{ Routes int } `json:"routes"`
	}
	if err := json.NewDecoder(res.Body).Decode(&report); err != nil {
		t.Fatal(err)
	}
	if report.Routes.Routes == 0 {
		t.Error("the policy learned no route: the requests did not go through lb_policy llm")
	}
}
