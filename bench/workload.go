package main

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
)

// Message is one chat message of a request.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Request is one chat completion the load generator sends.
type Request struct {
	// Conversation is the X-Conversation-ID header value: the conversation (multi-turn), the
	// group sharing a system prompt (shared-prefix, hot-prefix) or the request itself (mixed).
	Conversation string
	// Messages is the whole chat so far; a multi-turn request resends its history.
	Messages []Message
	// MaxTokens is the number of tokens to generate.
	MaxTokens int
}

// Session is a sequence of requests sent one after another: each request is sent only after the
// previous one finished. A single-turn session holds one request.
type Session struct {
	Requests []Request
}

// Workload is a seeded, ordered list of sessions; sessions start at Poisson arrival times.
type Workload struct {
	Name     string
	Sessions []Session
}

// NumRequests returns the number of requests in all sessions.
func (w Workload) NumRequests() int {
	n := 0
	for _, s := range w.Sessions {
		n += len(s.Requests)
	}
	return n
}

// Requests returns every request in session order.
func (w Workload) Requests() []Request {
	var out []Request
	for _, s := range w.Sessions {
		out = append(out, s.Requests...)
	}
	return out
}

// workloadNames lists the workloads in the order they run and are reported.
var workloadNames = []string{"shared-prefix", "multi-turn", "mixed", "hot-prefix"}

// workloadSize scales a workload: quick runs are small enough for CI.
type workloadSize struct {
	quick bool
}

// generateWorkload builds the named workload deterministically from seed.
func generateWorkload(name string, seed int64, size workloadSize) (Workload, error) {
	h := fnv.New64a()
	h.Write([]byte(name))
	rng := rand.New(rand.NewPCG(uint64(seed), h.Sum64()))
	switch name {
	case "shared-prefix":
		// 64 groups as in SGLang's generated-shared-prefix; 5 prompts each as in llm-d's shared_prefix.
		// Their prefixes (96k tokens) overflow one backend's KV cache (32k) three times, but a quarter of
		// them fit: routing decides the hit rate (round robin ~20%, as SGLang measured on GPUs).
		groups, perGroup := 64, 5
		if size.quick {
			groups, perGroup = 8, 8
		}
		return sharedPrefix(rng, groups, perGroup, 1500, 100, 64), nil
	case "multi-turn":
		convs := 64
		if size.quick {
			convs = 12
		}
		return multiTurn(rng, convs, 6, 10, 500, 150, 64), nil
	case "mixed":
		n := 320
		if size.quick {
			n = 64
		}
		return mixed(rng, n, 10, 4000, 64), nil
	case "hot-prefix":
		n, others := 320, 16
		if size.quick {
			n, others = 64, 6
		}
		return hotPrefix(rng, n, 0.8, others, 1500, 100, 64), nil
	}
	return Workload{}, fmt.Errorf("unknown workload %q (known: %v)", name, workloadNames)
}

// sharedPrefix is SGLang's generated-shared-prefix shape: groups of prompts behind a long system
// prompt per group, every prompt a different question, shuffled so groups interleave.
func sharedPrefix(rng *rand.Rand, groups, perGroup, systemTokens, questionTokens, outTokens int) Workload {
	var sessions []Session
	for g := range groups {
		system := Message{Role: "system", Content: fmt.Sprintf("Group %d. ", g) + textOfTokens(rng, systemTokens)}
		for range perGroup {
			sessions = append(sessions, Session{Requests: []Request{{
				Conversation: fmt.Sprintf("group-%d", g),
				Messages:     []Message{system, {Role: "user", Content: textOfTokens(rng, questionTokens)}},
				MaxTokens:    outTokens,
			}}})
		}
	}
	rng.Shuffle(len(sessions), func(i, j int) { sessions[i], sessions[j] = sessions[j], sessions[i] })
	return Workload{Name: "shared-prefix", Sessions: sessions}
}

// multiTurn builds conversations of minTurns..maxTurns turns behind one shared system prompt;
// each turn resends the whole history. The assistant replies in the history are generated here
// (seeded), not taken from the server, so every policy sends identical bytes.
func multiTurn(rng *rand.Rand, convs, minTurns, maxTurns, systemTokens, userTokens, outTokens int) Workload {
	system := Message{Role: "system", Content: textOfTokens(rng, systemTokens)}
	var sessions []Session
	for c := range convs {
		turns := minTurns + rng.IntN(maxTurns-minTurns+1)
		history := []Message{system}
		var reqs []Request
		for range turns {
			history = append(history, Message{Role: "user", Content: textOfTokens(rng, userTokens/2+rng.IntN(userTokens+1))})
			reqs = append(reqs, Request{
				Conversation: fmt.Sprintf("conv-%d", c),
				Messages:     slices.Clip(slices.Clone(history)),
				MaxTokens:    outTokens,
			})
			history = append(history, Message{Role: "assistant", Content: textOfTokens(rng, outTokens)})
		}
		sessions = append(sessions, Session{Requests: reqs})
	}
	return Workload{Name: "multi-turn", Sessions: sessions}
}

// mixed interleaves short and long unique prompts at random, half each: request counts say
// nothing about the work, tokens do.
func mixed(rng *rand.Rand, n, shortTokens, longTokens, outTokens int) Workload {
	sessions := make([]Session, n)
	for i := range sessions {
		tokens := shortTokens
		if rng.IntN(2) == 1 {
			tokens = longTokens
		}
		sessions[i] = Session{Requests: []Request{{
			Conversation: fmt.Sprintf("req-%d", i),
			Messages:     []Message{{Role: "user", Content: textOfTokens(rng, tokens)}},
			MaxTokens:    outTokens,
		}}}
	}
	return Workload{Name: "mixed", Sessions: sessions}
}

// hotPrefix sends one system prompt in hotFraction of the requests and one of others colder system
// prompts in the rest: affinity alone would melt one backend.
func hotPrefix(rng *rand.Rand, n int, hotFraction float64, others, systemTokens, questionTokens, outTokens int) Workload {
	hot := Message{Role: "system", Content: "Hot. " + textOfTokens(rng, systemTokens)}
	cold := make([]Message, others)
	for i := range cold {
		cold[i] = Message{Role: "system", Content: fmt.Sprintf("Cold %d. ", i) + textOfTokens(rng, systemTokens)}
	}
	sessions := make([]Session, n)
	for i := range sessions {
		system, conv := hot, "group-hot"
		if rng.Float64() >= hotFraction {
			k := rng.IntN(others)
			system, conv = cold[k], fmt.Sprintf("group-%d", k)
		}
		sessions[i] = Session{Requests: []Request{{
			Conversation: conv,
			Messages:     []Message{system, {Role: "user", Content: textOfTokens(rng, questionTokens)}},
			MaxTokens:    outTokens,
		}}}
	}
	return Workload{Name: "hot-prefix", Sessions: sessions}
}
