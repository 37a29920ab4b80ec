package scraper

import (
	"bytes"
	"fmt"
	"go/ast"
	goparser "go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// parseUnfiltered is Parse without filterText: the whole text through the parser.
func parseUnfiltered(text []byte, model string) (Snapshot, error) {
	families, err := parseText(bytes.NewReader(text))
	if err != nil {
		return Snapshot{}, err
	}
	return extract(families, model)
}

// samePage checks that filtering text changes nothing Parse returns for model: the same snapshot, or an
// error for both (filtered text may also parse where the whole did not: the filter drops lines of
// families Parse does not read, malformed ones included).
func samePage(t *testing.T, text []byte, model string) {
	t.Helper()
	whole, errWhole := parseUnfiltered(text, model)
	got, err := Parse(bytes.NewReader(text), model)
	switch {
	case errWhole != nil:
		return
	case err != nil:
		t.Errorf("Parse(model %q) = error %v; the whole text parses to %+v", model, err, whole)
	case got != whole:
		t.Errorf("Parse(model %q) =\n%+v\nthe whole text parses to\n%+v", model, got, whole)
	}
}

func TestFilterKeepsWhatParseReads(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "*.txt"))
	if err != nil || len(files) < 10 {
		t.Fatalf("testdata: %v, %d files", err, len(files))
	}
	for _, file := range files {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, model := range []string{"", "meta-llama/Llama-3.1-8B-Instruct", "mistral"} {
			t.Run(filepath.Base(file)+"/"+model, func(t *testing.T) {
				samePage(t, text, model)
			})
		}
	}
}

func TestKeepLine(t *testing.T) {
	tests := []struct {
		line string
		keep bool
	}{
		{"vllm:num_requests_running{engine=\"0\"} 7\n", true},
		{"vllm:num_requests_running 7", true},
		{"  \tvllm:num_requests_waiting\t3\n", true},
		{"# HELP vllm:num_requests_running Number of requests.\n", true},
		{"#TYPE vllm:num_requests_running gauge\n", true},
		{"vllm:iteration_tokens_total_count{engine=\"0\"} 8\n", true},
		{"vllm:iteration_tokens_total_sum 120\n", true},
		{"vllm:iteration_tokens_total_bucket{le=\"+Inf\"} 8\n", false},
		{"vllm:time_to_first_token_seconds_bucket{le=\"0.1\"} 3\n", false},
		{"vllm:time_to_first_token_seconds_count 3\n", true},
		{"# HELP vllm:time_to_first_token_seconds Histogram of time to first token.\n", true},
		{"vllm:e2e_request_latency_seconds_count 3\n", false},
		{"# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency.\n", false},
		{"# TYPE python_gc_objects_collected_total counter\n", false},
		{"python_info{implementation=\"CPython\" 1\n", false}, // malformed, in a family not read
		{"# a plain comment\n", false},
		{"#\n", false},
		{"\n", false},
		{"", false},
		{"process_start_time_seconds 1.7e+09\n", true},
		{"sglang:num_queue_reqs{tp_rank=\"0\"} 2\n", true},
		{"llamacpp:requests_deferred 1\n", true},
		{"num_requests_waiting 1\n", true}, // NIM's
		{"tgi_request_generated_tokens_sum 90\n", true},
		// What it cannot classify is kept, so that it fails to parse as before.
		{"<html><body>502 Bad Gateway</body></html>\n", true},
		{"{\"error\":\"not found\"}\n", true},
		{"{\"vllm:num_requests_running\",engine=\"0\"} 7\n", true},
		{"# HELP {\"a.b\"} quoted\n", true},
		{"vllm:num_requests_running\r\n", true},
		{"9lives 1\n", true},
		{"\x00\x01\x02\xff\xfe", true},
	}
	for _, tt := range tests {
		if got := keepLine([]byte(tt.line)); got != tt.keep {
			t.Errorf("keepLine(%q) = %v, want %v", tt.line, got, tt.keep)
		}
	}
}

func TestFilterTextInPlace(t *testing.T) {
	text := []byte("# HELP python_gc gc\npython_gc 1\nvllm:num_requests_running 2\n\nvllm:num_requests_waiting 3")
	got := filterText(text)
	if want := "vllm:num_requests_running 2\nvllm:num_requests_waiting 3"; string(got) != want {
		t.Errorf("filterText() = %q, want %q", got, want)
	}
	if len(filterText(nil)) != 0 || len(filterText([]byte("python_gc 1\n"))) != 0 {
		t.Error("filterText kept a line of an unread family")
	}
}

func TestParseForgivesFamiliesItDoesNotRead(t *testing.T) {
	page := append(readTestdata(t, "vllm_v1_two_engines.txt"), "python_info{implementation=\"CPython\" 1\nvllm:time_to_first_token_seconds_bucket{le=} x\n"...)
	if _, err := parseUnfiltered(page, ""); err == nil {
		t.Fatal("the parser accepts the malformed lines: the test proves nothing")
	}
	got, err := Parse(bytes.NewReader(page), "")
	if err != nil {
		t.Fatalf("Parse() error = %v; the malformed lines are in families it does not read", err)
	}
	if got.Running != 12 || got.Waiting != 4 || got.Flavor != FlavorVLLM {
		t.Errorf("Parse() = %+v, want vLLM's 12 running and 4 waiting", got)
	}
	// A malformed line in a family it reads is still an error.
	if _, err := Parse(strings.NewReader("vllm:num_requests_running{engine=\"0\" 7\n"), ""); err == nil {
		t.Error("Parse() of a malformed running series = nil error")
	}
}

// vllmPage is a vLLM v1 page of engines engines as a production server serves it: the recorded page's
// families, and the latency and size histograms vLLM exports, each with its buckets (~20 a histogram,
// 15 histograms an engine with the two recorded).
func vllmPage(tb testing.TB, engines int) []byte {
	page := bytes.Clone(readTestdata(tb, "vllm_v1_two_engines.txt"))
	for _, h := range []string{"inter_token_latency_seconds", "time_per_output_token_seconds",
		"request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
		"request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
		"request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens"} {
		page = fmt.Appendf(page, "# HELP vllm:%s Histogram.\n# TYPE vllm:%s histogram\n", h, h)
		for e := range engines {
			labels := fmt.Sprintf(`engine="%d",model_name="meta-llama/Llama-3.1-8B-Instruct"`, e)
			for b := range 20 {
				page = fmt.Appendf(page, "vllm:%s_bucket{%s,le=\"%d.0\"} %d.0\n", h, labels, 1<<b, 10*b)
			}
			page = fmt.Appendf(page, "vllm:%s_bucket{%s,le=\"+Inf\"} 200.0\nvllm:%s_count{%s} 200.0\nvllm:%s_sum{%s} 4321.0\n", h, labels, h, labels, h, labels)
		}
	}
	return page
}

func TestVLLMPageParses(t *testing.T) {
	page := vllmPage(t, 2)
	samePage(t, page, "")
	s, err := Parse(bytes.NewReader(page), "")
	if err != nil || s.Steps != 400 || s.FinishedRequests != 400 || s.FinishedPrompt != 2*4321 {
		t.Errorf("Parse() = %+v, %v; want the added histograms' counts and sums", s, err)
	}
}

// BenchmarkParsePage parses a production-sized vLLM page (two engines, 80 KB, 4 KB of it read), and the same page
// without filterText: what the filter saves a scrape.
func BenchmarkParsePage(b *testing.B) {
	page := vllmPage(b, 2)
	b.Run("filtered", func(b *testing.B) {
		b.SetBytes(int64(len(page)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := Parse(bytes.NewReader(page), ""); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("whole", func(b *testing.B) {
		b.SetBytes(int64(len(page)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := parseUnfiltered(page, ""); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestReadFamiliesListsEveryName: every metric name parse.go declares (its package-level string and
// []string vars) is in readFamilies, so that a family an extract function starts to read is not
// filtered away before it (the pages in testdata show only the families they have).
func TestReadFamiliesListsEveryName(t *testing.T) {
	file, err := goparser.ParseFile(token.NewFileSet(), "parse.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	names := 0
	for _, decl := range file.Decls {
		gen, ok := decl.(*ast.GenDecl)
		if !ok || gen.Tok != token.VAR {
			continue
		}
		for _, spec := range gen.Specs {
			for _, value := range spec.(*ast.ValueSpec).Values {
				var lits []*ast.BasicLit
				switch v := value.(type) {
				case *ast.BasicLit:
					lits = append(lits, v)
				case *ast.CompositeLit:
					for _, elt := range v.Elts {
						if lit, ok := elt.(*ast.BasicLit); ok {
							lits = append(lits, lit)
						}
					}
				}
				for _, lit := range lits {
					if lit.Kind != token.STRING {
						continue
					}
					name, err := strconv.Unquote(lit.Value)
					if err != nil {
						t.Fatal(err)
					}
					names++
					if !readFamilies[name] {
						t.Errorf("parse.go declares the metric name %q, which readFamilies does not list: filterText drops it", name)
					}
				}
			}
		}
	}
	if names < 40 {
		t.Errorf("found %d metric names in parse.go's vars, want the ~50 it declares", names)
	}
}
