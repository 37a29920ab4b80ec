package caddyllm

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
)

// upstreamsTable is testdata/upstreams.json as `caddy llm upstreams` prints it. The fixture has
// fields the table does not name (model, cache, weight, a list): they show generically.
const upstreamsTable = `UPSTREAM        REQS  PREFILL  DECODE  TOKENS  TO_PREFILL  QUEUED  SATURATED  IDLE  ROUTES  RUNNING  WAITING  KV     SCRAPE                      WEIGHT
127.0.0.1:8001  3     1        2       4219    3100        388ms   no         -     81      3        0        2.1%   vllm 400ms                  1.5
127.0.0.1:8002  0     0        0       0       0           0s      yes        1h6m  0       0        12       97.0%  sglang stale 12s, 3 errors  -
10.0.0.9:8000   1     -        -       12      -           -       no         -     -       -        -        -      never, 1 error              -

MODEL
UPSTREAM        PREFILL_TOKENS_PER_SEC  OVERHEAD_MS  MS_PER_OUTPUT_TOKEN  SLOTS  MEAN_REQUEST_SECONDS
127.0.0.1:8001  8124                    30.2         30.5                 64     2.12
127.0.0.1:8002  0                       0            0                    -      0
10.0.0.9:8000   -                       -            -                    -      -

CACHE
UPSTREAM        PREDICTED_HIT_RATE  OBSERVED_HIT_RATE  CORRECTIONS
127.0.0.1:8001  0.823               0.79               3
127.0.0.1:8002  0                   -                  0
10.0.0.9:8000   -                   -                  -

Last scrape errors:
  127.0.0.1:8002: scraping 127.0.0.1:8002: connection refused (4.2s ago)

Routes: routes 81, conversation pins 2, evictions 0, expired 5, upstreams known 3
`

func TestRenderUpstreams(t *testing.T) {
	fixture, err := os.ReadFile("testdata/upstreams.json")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		body string
		want string
	}{
		{name: "fixture with unknown fields", body: string(fixture), want: upstreamsTable},
		{
			name: "no policy loaded",
			body: `{"upstreams":null,"routes":{"routes":0,"conversation_pins":0,"evictions":0,"expired":0,"upstreams_known":0,"provisioned":false}}`,
			want: "No loaded config uses lb_policy llm.\n\nRoutes: routes 0, conversation pins 0, evictions 0, expired 0, upstreams known 0\n",
		},
		{
			name: "no upstreams yet",
			body: `{"upstreams":[],"routes":{"routes":0,"provisioned":true}}`,
			want: "No upstreams yet.\n\nRoutes: routes 0\n",
		},
		{
			// The adapter lists are for the JSON report; the table leaves them (and max_lora) out.
			name: "scraped LoRA adapters",
			body: `{"upstreams":[{"upstream":"a:1","inflight_tokens":7,"inflight_requests":1,"saturated":false,` +
				`"metrics":{"flavor":"vllm","running":1,"waiting":0,"kv_cache_usage":0.5,"age_seconds":0.2,"fresh":true,"errors":0,` +
				`"lora":{"running":["fin"],"waiting":[],"max_lora":2}}}]}`,
			want: "UPSTREAM  REQS  PREFILL  DECODE  TOKENS  TO_PREFILL  QUEUED  SATURATED  IDLE  ROUTES  RUNNING  WAITING  KV     SCRAPE\n" +
				"a:1       1     -        -       7       -           -       no         -     -       1        0        50.0%  vllm 200ms\n",
		},
		{
			// The demo's first scrape goes out before its in-process backends listen: an error that a
			// later scrape superseded is history, and says so.
			name: "an error scraped since",
			body: `{"upstreams":[{"upstream":"a:1","inflight_tokens":0,"inflight_requests":0,"saturated":false,"idle_seconds":0,` +
				`"metrics":{"flavor":"vllm","running":0,"waiting":0,"kv_cache_usage":0,"age_seconds":0.5,"fresh":true,"errors":1,` +
				`"last_error":"scraping http://a:1/metrics: connection refused","last_error_age_seconds":15}}]}`,
			want: "UPSTREAM  REQS  PREFILL  DECODE  TOKENS  TO_PREFILL  QUEUED  SATURATED  IDLE  ROUTES  RUNNING  WAITING  KV    SCRAPE\n" +
				"a:1       0     -        -       0       -           -       no         0s    -       0        0        0.0%  vllm 500ms, 1 error\n" +
				"\nLast scrape errors:\n  a:1: scraping http://a:1/metrics: connection refused (15s ago; scraped since)\n",
		},
		{
			name: "before scraping, no routes object",
			body: `{"upstreams":[{"upstream":"a:1","inflight_tokens":7,"inflight_requests":1,"saturated":false}]}`,
			want: "UPSTREAM  REQS  PREFILL  DECODE  TOKENS  TO_PREFILL  QUEUED  SATURATED  IDLE  ROUTES  RUNNING  WAITING  KV  SCRAPE\n" +
				"a:1       1     -        -       7       -           -       no         -     -       -        -        -   -\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			if err := renderUpstreams(&out, []byte(tt.body)); err != nil {
				t.Fatalf("renderUpstreams() error = %v", err)
			}
			if got := out.String(); got != tt.want {
				t.Errorf("renderUpstreams() =\n%s\nwant\n%s", got, tt.want)
			}
		})
	}
}

func TestRenderUpstreamsErrors(t *testing.T) {
	for name, body := range map[string]string{
		"not JSON":           `<html>`,
		"upstreams a string": `{"upstreams":"x"}`,
		"truncated upstream": `{"upstreams":[{"upstream":"a:1",}]}`,
	} {
		t.Run(name, func(t *testing.T) {
			if err := renderUpstreams(&bytes.Buffer{}, []byte(body)); err == nil {
				t.Errorf("renderUpstreams(%s) = nil error, want one", body)
			}
		})
	}
}

func TestFormatFloat(t *testing.T) {
	for f, want := range map[float64]string{
		0: "0", 4219: "4219", -3: "-3", 0.82345: "0.823", 0.5: "0.5", 1.5: "1.5", 12.34: "12.3", 8123.7: "8124",
	} {
		if got := formatFloat(f); got != want {
			t.Errorf("formatFloat(%v) = %q, want %q", f, got, want)
		}
	}
}

// runUpstreams runs `caddy llm upstreams` with args against whatever answers, returning its output.
func runUpstreams(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := upstreamsCommand()
	if err := cmd.Flags().Parse(args); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	_, err := cmdUpstreams(caddycmd.Flags{FlagSet: cmd.Flags()}, &out)
	return out.String(), err
}

func TestUpstreamsCommand(t *testing.T) {
	fixture, err := os.ReadFile("testdata/upstreams.json")
	if err != nil {
		t.Fatal(err)
	}
	admin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet || r.URL.Path != "/llm/upstreams" {
			http.Error(w, "unexpected "+r.Method+" "+r.URL.Path, http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write(fixture)
	}))
	defer admin.Close()
	addr := strings.TrimPrefix(admin.URL, "http://")

	t.Run("--address", func(t *testing.T) {
		out, err := runUpstreams(t, "--address", addr)
		if err != nil {
			t.Fatalf("caddy llm upstreams --address %s: %v", addr, err)
		}
		if out != upstreamsTable {
			t.Errorf("output =\n%s\nwant\n%s", out, upstreamsTable)
		}
	})

	t.Run("admin address from --config", func(t *testing.T) {
		config := filepath.Join(t.TempDir(), "Caddyfile")
		if err := os.WriteFile(config, []byte("{\n\tadmin "+addr+"\n}\n:8080 {\n\trespond ok\n}\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		out, err := runUpstreams(t, "--config", config, "--adapter", "caddyfile")
		if err != nil {
			t.Fatalf("caddy llm upstreams --config: %v", err)
		}
		if out != upstreamsTable {
			t.Errorf("output =\n%s\nwant\n%s", out, upstreamsTable)
		}
	})

	t.Run("admin error", func(t *testing.T) {
		notFound := httptest.NewServer(http.NotFoundHandler())
		defer notFound.Close()
		if _, err := runUpstreams(t, "--address", strings.TrimPrefix(notFound.URL, "http://")); err == nil {
			t.Error("a 404 from the admin API gave no error")
		}
	})

	t.Run("nothing listening", func(t *testing.T) {
		closed := httptest.NewServer(http.NotFoundHandler())
		closed.Close()
		if _, err := runUpstreams(t, "--address", strings.TrimPrefix(closed.URL, "http://")); err == nil {
			t.Error("an unreachable admin API gave no error")
		}
	})
}

func TestFormatSeconds(t *testing.T) {
	for s, want := range map[float64]string{0: "0s", 0.0421: "42ms", 0.4: "400ms", 3.42: "3.4s", 12.3: "12s", 185: "3m5s", 3599: "59m59s", 3600: "1h0m", 90061: "25h1m"} {
		if got := formatSeconds(s); got != want {
			t.Errorf("formatSeconds(%v) = %q, want %q", s, got, want)
		}
	}
}
