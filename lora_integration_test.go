package caddyllm

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/tokenrouter/caddy-llm/bench/vllmsim"
)

// TestLoRARoutingThroughCaddy: three simulated vLLM backends serve the adapters fin, legal and med with
// one adapter slot each. Another client keeps fin running on A and legal on B (streams sent to them
// directly), which their /metrics report. Through Caddy, requests for a new adapter (med) go to C, the
// only backend with a free slot, and requests for fin go to A, where it is loaded, although A is busier.
func TestLoRARoutingThroughCaddy(t *testing.T) {
	cfg := func(seed int64) vllmsim.Config {
		return vllmsim.Config{TimeScale: 10, Seed: seed, LoRAAdapters: []string{"fin", "legal", "med"}, MaxLoRAs: 1}
	}
	simA, a := simBackend(t, cfg(1))
	simB, b := simBackend(t, cfg(2))
	simC, c := simBackend(t, cfg(3))
	sims := map[string]*vllmsim.Server{a: simA, b: simB, c: simC}

	tester := caddytest.NewTester(t)
	tester.InitServer(globalOptions+fmt.Sprintf(`
%s {
	reverse_proxy %s %s %s {
		lb_policy llm {
			lora_load_time 2s
			metrics {
				interval 100ms
				stale_after 1m
			}
		}
	}
}
`, site, a, b, c), "caddyfile")

	// Scrapes are trusted for a minute (stale_after): a busy machine that delays one must not make the
	// policy ignore what the backends report.
	// Another client holds fin on A and legal on B: one long stream each (about a minute at this time
	// scale; cancelled at the end of the test).
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	for dial, adapter := range map[string]string{a: "fin", b: "legal"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := `{"model":"` + adapter + `","stream":true,"max_tokens":20000,"messages":[{"role":"user","content":"hold"}]}`
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+dial+"/v1/chat/completions", strings.NewReader(body))
			if res, err := http.DefaultClient.Do(req); err == nil {
				io.Copy(io.Discard, res.Body)
				res.Body.Close()
			}
		}()
	}
	// Any request makes the policy scrape every upstream; then wait until the scrapes show the adapters.
	sendCounting(t, tester.Client, chatBody("sim-model", 3, false), sims)
	waitFor(t, "the scrapes to show fin on A, legal on B and a free slot on C", func() bool {
		ups := adminUpstreams(t)
		lora := func(dial string) *loraReport {
			if m := ups[dial].Metrics; m != nil && m.Fresh {
				return m.LoRA
			}
			return nil
		}
		la, lb, lc := lora(a), lora(b), lora(c)
		return la != nil && slices.Equal(la.Running, []string{"fin"}) && lb != nil && slices.Equal(lb.Running, []string{"legal"}) &&
			lc != nil && lc.MaxLoRA == 1 && len(lc.Running) == 0
	})

	for i := range 5 {
		if got := sendCounting(t, tester.Client, chatBody("med", 5+i, false), sims); got != c {
			t.Fatalf("med request %d went to %s, want %s (A %s and B %s have their only slot taken)", i, got, c, a, b)
		}
	}
	for i := range 5 {
		if got := sendCounting(t, tester.Client, chatBody("fin", 5+i, false), sims); got != a {
			t.Fatalf("fin request %d went to %s, want %s where fin is loaded", i, got, a)
		}
	}
	if got := simC.ResidentLoRAs(); !slices.Equal(got, []string{"med"}) {
		t.Errorf("C's adapters = %v, want [med]", got)
	}
	if n := simA.State().LoRALoads + simB.State().LoRALoads + simC.State().LoRALoads; n != 3 {
		t.Errorf("adapter loads = %d, want 3 (fin on A, legal on B, med on C, once each)", n)
	}
}
