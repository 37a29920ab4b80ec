package selection

import "testing"

func withAdapter(cs []Candidate, load, wait []float64) []Candidate {
	for i := range cs {
		cs[i].AdapterLoad, cs[i].AdapterWait = load[i], wait[i]
	}
	return cs
}

// The adapter terms are in the same seconds as the rest of the cost: a resident adapter is worth its
// load time, a full upstream costs its slot wait, and both give way to a long enough queue.
func TestChooseLoRA(t *testing.T) {
	cfg := DefaultConfig()
	leastTokens := cfg
	leastTokens.Mode = LeastTokens
	tests := []struct {
		name  string
		cands []Candidate
		req   Request
		cfg   Config
		want  int
	}{
		{
			// 1000 tokens: 0.1 s of prefill anywhere; the first must load the adapter (0.5 s).
			name:  "resident adapter wins",
			cands: withAdapter(cands(0, 0), []float64{0.5, 0}, []float64{0, 0}),
			req:   Request{PromptTokens: 1000}, cfg: cfg, want: 1,
		},
		{
			name:  "resident adapter wins in least_tokens mode too (it is load, not cache)",
			cands: withAdapter(cands(0, 0), []float64{0.5, 0}, []float64{0, 0}),
			req:   Request{PromptTokens: 1000}, cfg: leastTokens, want: 1,
		},
		{
			name:  "resident adapter loses to a queue longer than the load it saves",
			cands: withAdapter(cands(0, 0.8), []float64{0.5, 0}, []float64{0, 0}),
			req:   Request{PromptTokens: 1000}, cfg: cfg, want: 0,
		},
		{
			// A new adapter loads everywhere; the first's slots are full, so it would also wait 1 s.
			name:  "new adapter avoids full slots",
			cands: withAdapter(cands(0, 0), []float64{0.5, 0.5}, []float64{1, 0}),
			req:   Request{PromptTokens: 1000}, cfg: cfg, want: 1,
		},
		{
			name:  "full slots beat a longer queue",
			cands: withAdapter(cands(0, 1.5), []float64{0.5, 0.5}, []float64{1, 0}),
			req:   Request{PromptTokens: 1000}, cfg: cfg, want: 0,
		},
		{
			// Equal loads: the busier upstream (6 of its 8 slots taken) adds its slot wait.
			name:  "a load costs more where more requests run",
			cands: withAdapter(withRequests(cands(0, 0), 6, 0), []float64{0.3, 0.3}, []float64{0, 0}),
			req:   Request{PromptTokens: 10}, cfg: cfg, want: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Choose(tt.cands, tt.req, tt.cfg, first, nil)
			if got.Index != tt.want {
				t.Errorf("Choose() = %d, want %d", got.Index, tt.want)
			}
		})
	}
}

func TestCostLoRATerms(t *testing.T) {
	c := Candidate{Service: svc, Requests: 10} // 8 slots: 2 waiting for one
	base, baseWait, baseTTFT := Cost(&c, Request{PromptTokens: 1000}, 0)
	c.AdapterLoad, c.AdapterWait = 0.5, 1
	cost, wait, ttft := Cost(&c, Request{PromptTokens: 1000}, 0)
	if d := wait - baseWait; !near(d, 1) {
		t.Errorf("wait grows by %v, want the slot wait 1", d)
	}
	if d := ttft - baseTTFT; !near(d, 1.5) {
		t.Errorf("TTFT grows by %v, want load + slot wait 1.5", d)
	}
	// The load also delays the 2 requests waiting for the batch's slots.
	if d := cost - base; !near(d, 1.5+2*0.5) {
		t.Errorf("cost grows by %v, want 2.5", d)
	}
}

func near(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 }
