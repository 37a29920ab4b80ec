package caddyllm

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/tokenrouter/caddy-llm/bench/vllmsim/caddysim"
)

var update = flag.Bool("update", false, "rewrite the golden JSON of the examples")

// TestExamplesAdapt adapts every Caddyfile in examples/ and compares it with its JSON twin
// (examples/NAME.json for examples/NAME.Caddyfile, examples/Caddyfile.json for examples/Caddyfile), so
// the documented examples always load and the JSON pair shows exactly what each one means.
// Run with -update after changing an example.
func TestExamplesAdapt(t *testing.T) {
	files, err := filepath.Glob("examples/*Caddyfile")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples found: %v", err)
	}
	adapter := caddyconfig.GetAdapter("caddyfile")
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			input, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			adapted, warnings, err := adapter.Adapt(input, map[string]any{"filename": file})
			if err != nil {
				t.Fatalf("adapting: %v", err)
			}
			for _, w := range warnings {
				t.Errorf("warning: %s", w.String())
			}
			var pretty bytes.Buffer
			if err := json.Indent(&pretty, adapted, "", "\t"); err != nil {
				t.Fatal(err)
			}
			pretty.WriteByte('\n')
			golden := strings.TrimSuffix(file, ".Caddyfile") + ".json"
			if filepath.Base(file) == "Caddyfile" {
				golden = file + ".json"
			}
			if *update {
				if err := os.WriteFile(golden, pretty.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("reading golden JSON (run go test -run TestExamplesAdapt -update): %v", err)
			}
			if !bytes.Equal(pretty.Bytes(), want) {
				t.Errorf("%s adapts to\n%s\nwant (%s)\n%s", file, pretty.Bytes(), golden, want)
			}
		})
	}
}

// TestDemoStaysLocal: the demo (examples/Caddyfile) listens on 127.0.0.1 only, admin API included, and
// writes no autosave of its config. Issue 13 found it on every interface.
func TestDemoStaysLocal(t *testing.T) {
	input, err := os.ReadFile("examples/Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	adapted, _, err := caddyconfig.GetAdapter("caddyfile").Adapt(input, map[string]any{"filename": "examples/Caddyfile"})
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Admin struct {
			Listen string `json:"listen"`
			Config *struct {
				Persist *bool `json:"persist"`
			} `json:"config"`
		} `json:"admin"`
		Apps struct {
			HTTP struct {
				Servers map[string]struct {
					Listen []string `json:"listen"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(adapted, &cfg); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(cfg.Admin.Listen, "localhost:") && !strings.HasPrefix(cfg.Admin.Listen, "127.0.0.1:") {
		t.Errorf("admin listens on %q, want localhost", cfg.Admin.Listen)
	}
	if cfg.Admin.Config == nil || cfg.Admin.Config.Persist == nil || *cfg.Admin.Config.Persist {
		t.Errorf("the demo autosaves its config, want persist_config off")
	}
	if len(cfg.Apps.HTTP.Servers) == 0 {
		t.Fatal("no servers in the demo")
	}
	for name, srv := range cfg.Apps.HTTP.Servers {
		for _, addr := range srv.Listen {
			if !strings.HasPrefix(addr, "127.0.0.1:") {
				t.Errorf("server %s listens on %q, want 127.0.0.1 only", name, addr)
			}
		}
	}
}
