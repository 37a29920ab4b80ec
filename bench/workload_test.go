package main

import (
	"fmt"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestWorkloadsAreDeterministic(t *testing.T) {
	for _, name := range knownWorkloads {
		t.Run(name, func(t *testing.T) {
			a, err := generateWorkload(name, 42, workloadSize{quick: true})
			if err != nil {
				t.Fatal(err)
			}
			b, _ := generateWorkload(name, 42, workloadSize{quick: true})
			if !reflect.DeepEqual(a, b) {
				t.Errorf("generateWorkload(%q, 42) differs between calls", name)
			}
			c, _ := generateWorkload(name, 43, workloadSize{quick: true})
			if reflect.DeepEqual(a, c) {
				t.Errorf("generateWorkload(%q) is the same for seeds 42 and 43", name)
			}
			if a.NumRequests() == 0 {
				t.Errorf("generateWorkload(%q) has no requests", name)
			}
		})
	}
}

func TestUnknownWorkload(t *testing.T) {
	if _, err := generateWorkload("nope", 1, workloadSize{}); err == nil {
		t.Error("generateWorkload(nope) = nil error, want an error")
	}
}

func TestSharedPrefixShape(t *testing.T) {
	w, _ := generateWorkload("shared-prefix", 1, workloadSize{})
	systems := map[string]int{}
	groups := map[string]string{}
	for _, r := range w.Requests() {
		if len(r.Messages) != 2 || r.Messages[0].Role != "system" || r.Messages[1].Role != "user" {
			t.Fatalf("request messages = %d (%s...), want system + user", len(r.Messages), r.Messages[0].Role)
		}
		sys := r.Messages[0].Content
		systems[sys]++
		if g, ok := groups[sys]; ok && g != r.Conversation {
			t.Errorf("one system prompt in groups %s and %s", g, r.Conversation)
		}
		groups[sys] = r.Conversation
		if n := templatedTokens(r.Messages[:1]); n < 1400 || n > 1700 {
			t.Errorf("system prompt has %d tokens, want ~1500", n)
		}
	}
	if len(systems) != 64 {
		t.Errorf("distinct system prompts = %d, want 64", len(systems))
	}
	for _, n := range systems {
		if n != 5 {
			t.Errorf("prompts per group = %d, want 5", n)
		}
	}
	// groups interleave: the first 32 requests are not all from one group
	first := map[string]bool{}
	for _, r := range w.Requests()[:32] {
		first[r.Conversation] = true
	}
	if len(first) < 8 {
		t.Errorf("the first 32 requests come from %d groups, want them shuffled", len(first))
	}
}

func TestMultiTurnResendsGrowingHistory(t *testing.T) {
	w, _ := generateWorkload("multi-turn", 1, workloadSize{quick: true})
	system := w.Sessions[0].Requests[0].Messages[0]
	for i, s := range w.Sessions {
		if n := len(s.Requests); n < 6 || n > 10 {
			t.Errorf("session %d has %d turns, want 6-10", i, n)
		}
		for k, r := range s.Requests {
			if r.Messages[0] != system {
				t.Fatalf("session %d turn %d does not start with the shared system prompt", i, k)
			}
			if want := 2 + 2*k; len(r.Messages) != want {
				t.Fatalf("session %d turn %d has %d messages, want %d", i, k, len(r.Messages), want)
			}
			if last := r.Messages[len(r.Messages)-1]; last.Role != "user" {
				t.Errorf("session %d turn %d ends with %s, want user", i, k, last.Role)
			}
			if k > 0 {
				prev := s.Requests[k-1].Messages
				if !reflect.DeepEqual(r.Messages[:len(prev)], prev) {
					t.Errorf("session %d turn %d does not resend turn %d's messages", i, k, k-1)
				}
				if r.Messages[len(prev)].Role != "assistant" {
					t.Errorf("session %d turn %d: history lacks the assistant reply", i, k)
				}
			}
			if r.Conversation != s.Requests[0].Conversation {
				t.Errorf("session %d changes conversation ID", i)
			}
		}
	}
}

func TestMixedShape(t *testing.T) {
	w, _ := generateWorkload("mixed", 1, workloadSize{})
	short, long := 0, 0
	for _, r := range w.Requests() {
		switch n := templatedTokens(r.Messages); {
		case n < 30:
			short++
		case n > 3800 && n < 4200:
			long++
		default:
			t.Errorf("prompt of %d tokens, want ~10 or ~4000", n)
		}
	}
	if short < w.NumRequests()/3 || long < w.NumRequests()/3 {
		t.Errorf("short/long = %d/%d, want both about half", short, long)
	}
}

func TestHotPrefixShape(t *testing.T) {
	w, _ := generateWorkload("hot-prefix", 1, workloadSize{})
	hot := 0
	for _, r := range w.Requests() {
		if strings.HasPrefix(r.Messages[0].Content, "Hot. ") {
			hot++
		}
	}
	if frac := float64(hot) / float64(w.NumRequests()); frac < 0.7 || frac > 0.9 {
		t.Errorf("hot system prompt in %.2f of requests, want ~0.8", frac)
	}
}

func TestTextOfTokens(t *testing.T) {
	w, _ := generateWorkload("mixed", 3, workloadSize{quick: true})
	for _, r := range w.Requests() {
		c := r.Messages[0].Content
		if strings.ContainsAny(c, "\"\\\n") {
			t.Fatalf("generated text contains characters needing escapes")
		}
	}
}

func TestEstimateCapacity(t *testing.T) {
	shared, _ := generateWorkload("shared-prefix", 1, workloadSize{})
	mixedW, _ := generateWorkload("mixed", 1, workloadSize{})
	s := estimateCapacity(shared, uniformCluster(4, defaultSim))
	m := estimateCapacity(mixedW, uniformCluster(4, defaultSim))
	if !(s.MeanUncached < s.MeanPrompt/3) {
		t.Errorf("shared-prefix: ideal uncached %.0f of %.0f tokens, want most of the prompt shared", s.MeanUncached, s.MeanPrompt)
	}
	if m.MeanUncached != m.MeanPrompt {
		t.Errorf("mixed: ideal uncached %.0f, want all %.0f (no sharing)", m.MeanUncached, m.MeanPrompt)
	}
	if two := estimateCapacity(shared, uniformCluster(2, defaultSim)); two.ClusterRPS*2 < s.ClusterRPS*0.999 || two.ClusterRPS*2 > s.ClusterRPS*1.001 {
		t.Errorf("capacity with 2 backends = %.2f, want half of 4 backends' %.2f", two.ClusterRPS, s.ClusterRPS)
	}
	// the formula by hand for a single request of 100 uncached tokens and 10 output tokens
	one := Workload{Sessions: []Session{{Requests: []Request{{Messages: []Message{{Role: "user", Content: strings.Repeat("abcd", 100-3)}}, MaxTokens: 10}}}}}
	e := estimateCapacity(one, uniformCluster(1, defaultSim))
	step := defaultSim.DecodeStep.Seconds() + defaultSim.DecodeStepPerSeq.Seconds()*e.Batch
	want := 1 / (100/defaultSim.PrefillTokensPerSec + 10*step/e.Batch)
	if e.MeanPrompt != 100 || e.PerBackendRPS < want*0.999 || e.PerBackendRPS > want*1.001 {
		t.Errorf("estimateCapacity(one) = %+v, want prompt 100 and %.3f req/s", e, want)
	}
}

// TestEstimateCapacityCachedSessions: when the KV caches cannot hold the context of every session in
// flight between turns, the estimate re-prefills the history of those it cannot hold (at the fixed point
// where the rate it sustains keeps that many sessions in flight); when they can, it is the ideal one.
func TestEstimateCapacityCachedSessions(t *testing.T) {
	system := Message{Role: "system", Content: strings.Repeat("s", 4000)} // shared by every session
	var w Workload
	for i := range 8 {
		first := []Message{system, {Role: "user", Content: fmt.Sprintf("%04d", i) + strings.Repeat("u", 11996)}}
		second := append(slices.Clone(first), Message{Role: "assistant", Content: strings.Repeat("a", 400)}, Message{Role: "user", Content: strings.Repeat("v", 4000)})
		w.Sessions = append(w.Sessions, Session{Requests: []Request{
			{Messages: first, MaxTokens: 100},
			{Messages: second, MaxTokens: 100, Think: 20 * time.Second},
		}})
	}
	sim := defaultSim
	sim.MaxNumSeqs = 1 // a batch of one whatever the cache: only the cached sessions differ
	big, small := sim, sim
	big.NumGPUBlocks = 100000
	small.NumGPUBlocks = 6000 / small.BlockSize // room for one session's context (~4.1k tokens)
	ideal := estimateCapacity(w, uniformCluster(2, big))
	got := estimateCapacity(w, uniformCluster(2, small))
	shape := measureWorkload(w, sim.BlockSize)
	if ideal.CachedSessions != 0 || ideal.MeanUncached != shape.uncached {
		t.Errorf("large caches: %+v, want the ideal estimate (%.0f tokens to prefill)", ideal, shape.uncached)
	}
	if !(shape.uncached < shape.uncachedAlone) {
		t.Fatalf("workload shape %+v: want more to prefill without the session's own history", shape)
	}
	h := got.CachedSessions
	if !(h > 0 && h < 1) || !(got.MeanUncached > shape.uncached && got.MeanUncached < shape.uncachedAlone) || !(got.ClusterRPS < ideal.ClusterRPS) {
		t.Fatalf("small caches: %+v, want a fraction of the sessions cached and less capacity than %.2f req/s", got, ideal.ClusterRPS)
	}
	// The fixed point by hand: at the rate the estimate sustains, Little's law puts n sessions in
	// flight, of which the caches (one context each) hold 2: h = 2/n.
	latency := got.MeanUncached/sim.PrefillTokensPerSec + shape.output*(sim.DecodeStep.Seconds()+sim.DecodeStepPerSeq.Seconds())
	n := got.ClusterRPS / 2 * (20 + 2*latency)
	if math.Abs(h-2/n) > 1e-6 {
		t.Errorf("cached fraction %.4f, want 2 held / %.2f in flight = %.4f", h, n, 2/n)
	}
}

func TestMultiTurnThinkShape(t *testing.T) {
	w, _ := generateWorkload("multi-turn-think", 1, workloadSize{matrix: true})
	var thinks []float64
	for _, s := range w.Sessions {
		if len(s.Requests) < 3 || len(s.Requests) > 6 {
			t.Errorf("session of %d turns, want 3-6", len(s.Requests))
		}
		for i, r := range s.Requests {
			if i == 0 && r.Think != 0 {
				t.Errorf("first turn thinks %v, want 0", r.Think)
			}
			if i > 0 {
				thinks = append(thinks, r.Think.Seconds())
			}
		}
	}
	if m := mean(thinks); m < 1.5 || m > 2.5 {
		t.Errorf("mean think time %.2f s, want about 2 s", m)
	}
}

func TestAgenticShape(t *testing.T) {
	for _, c := range []struct {
		size     workloadSize
		sessions int
	}{{workloadSize{quick: true}, 8}, {workloadSize{matrix: true}, 24}, {workloadSize{}, 12}} {
		w, _ := generateWorkload("agentic", 1, c.size)
		if len(w.Sessions) != c.sessions {
			t.Errorf("%+v: %d sessions, want %d", c.size, len(w.Sessions), c.sessions)
		}
	}
	w, _ := generateWorkload("agentic", 1, workloadSize{matrix: true})
	system := w.Sessions[0].Requests[0].Messages[0].Content
	for i, s := range w.Sessions {
		if s.Requests[0].Messages[0].Content != system {
			t.Errorf("session %d has another system prompt, want one shared by every session", i)
		}
		prev := 0
		for j, r := range s.Requests {
			n := templatedTokens(r.Messages)
			if j == 0 && (n < 19000 || n > 21000) {
				t.Errorf("session %d first prompt %d tokens, want ~20k", i, n)
			}
			if j > 0 {
				if grow := n - prev; grow < 1000 || grow > 3200 {
					t.Errorf("session %d turn %d grew by %d tokens, want a reply and a 1-3k tool result", i, j, grow)
				}
				if !reflect.DeepEqual(r.Messages[:len(s.Requests[j-1].Messages)], s.Requests[j-1].Messages) {
					t.Errorf("session %d turn %d does not extend the previous turn's messages", i, j)
				}
			}
			if n+r.MaxTokens > 40000 {
				t.Errorf("session %d turn %d: %d tokens, want at most 40k", i, j, n+r.MaxTokens)
			}
			prev = n
		}
	}
}
