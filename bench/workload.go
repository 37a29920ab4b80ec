package main

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
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
	// Think is the simulated time the client waits after the previous turn of its session ended
	// before it sends this one (a user reading and typing, a tool running); zero for a first turn.
	Think time.Duration
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

// workloadNames lists the workloads a plain run runs, in the order they run and are reported.
var workloadNames = []string{"shared-prefix", "multi-turn", "mixed", "hot-prefix"}

// matrixWorkloads lists the workloads of -matrix, in report order.
var matrixWorkloads = []string{"shared-prefix", "hot-prefix", "multi-turn-think", "mixed", "agentic"}

// knownWorkloads lists every workload generateWorkload knows.
var knownWorkloads = []string{"shared-prefix", "multi-turn", "mixed", "hot-prefix", "multi-turn-think", "agentic"}

// workloadSize scales a workload: quick runs are small enough for CI, matrix runs small enough
// that 525 of them fit in about 40 minutes on 2 cores (116-335 requests a run).
type workloadSize struct {
	quick, matrix bool
	length        int // with matrix: sessions multiplied by this (0 and 1: the matrix's own size)
}

// times returns n scaled by a matrix run's length.
func (s workloadSize) times(n int) int { return n * max(s.length, 1) }

// generateWorkload builds the named workload deterministically from seed.
func generateWorkload(name string, seed int64, size workloadSize) (Workload, error) {
	h := fnv.New64a()
	h.Write([]byte(name))
	rng := rand.New(rand.NewPCG(uint64(seed), h.Sum64()))
	switch name {
	case "shared-prefix":
		if size.matrix {
			// A longer run has more prompts per group, not more groups: the same prefixes in play at once.
			return sharedPrefix(rng, 16, size.times(8), 1500, 100, 64), nil
		}
		// 64 groups as in SGLang's generated-shared-prefix; 5 prompts each as in llm-d's shared_prefix.
		// Their prefixes (96k tokens) overflow one backend's KV cache (32k) three times, but a quarter of
		// them fit: routing decides the hit rate (round robin ~20%, as SGLang measured on GPUs).
		groups, perGroup := 64, 5
		if size.quick {
			groups, perGroup = 8, 8
		}
		return sharedPrefix(rng, groups, perGroup, 1500, 100, 64), nil
	case "multi-turn-think":
		// 3-6 turns behind a 500-token system prompt, a think time of mean 2 s (simulated) before
		// each follow-up: sessions overlap less, a conversation's cache may age out in between. A
		// session lasts ~10 s, so reaching the offered rate takes many sessions in flight: with
		// fewer, the think time, not the arrival rate, would set the load (36 sessions reached
		// only 0.16 of the default regime's capacity).
		convs := 120
		switch {
		case size.matrix:
			convs = size.times(80)
		case size.quick:
			convs = 80
		}
		w := multiTurn(rng, convs, 3, 6, 500, 150, 64)
		addThinkTime(rng, &w, 2*time.Second)
		w.Name = "multi-turn-think"
		return w, nil
	case "agentic":
		// A coding agent: a 20k-token first prompt (system prompt, tools, files), then turns that each
		// append the agent's reply and a 1-3k-token tool result, up to 40k tokens; a tool runs for a
		// mean 1 s (simulated) between turns. Few sessions, long contexts. The matrix runs 24 sessions
		// (~140 requests, as many as its other workloads): with 8 (44 measured requests) a run was
		// mostly the ramp up and down, its p99 was its worst request, and two runs of one binary on
		// the same seeds differed by 0.6-1.5x per cell.
		sessions, minTurns, maxTurns := 12, 6, 10
		switch {
		case size.quick:
			sessions, minTurns, maxTurns = 8, 5, 8
		case size.matrix:
			sessions, minTurns, maxTurns = size.times(24), 5, 8
		}
		return agentic(rng, sessions, minTurns, maxTurns, 20000, 1000, 3000, 40000, 64, time.Second), nil
	case "multi-turn":
		convs := 64
		if size.quick {
			convs = 12
		}
		return multiTurn(rng, convs, 6, 10, 500, 150, 64), nil
	case "mixed":
		n := 320
		switch {
		case size.matrix:
			n = size.times(144)
		case size.quick:
			n = 64
		}
		return mixed(rng, n, 10, 4000, 64), nil
	case "hot-prefix":
		n, others := 320, 16
		switch {
		case size.matrix:
			n, others = size.times(144), 8
		case size.quick:
			n, others = 64, 6
		}
		return hotPrefix(rng, n, 0.8, others, 1500, 100, 64), nil
	}
	return Workload{}, fmt.Errorf("unknown workload %q (known: %s)", name, strings.Join(knownWorkloads, ","))
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

// addThinkTime gives every follow-up turn of w an exponentially distributed think time of the
// given mean.
func addThinkTime(rng *rand.Rand, w *Workload, mean time.Duration) {
	for _, s := range w.Sessions {
		for i := 1; i < len(s.Requests); i++ {
			s.Requests[i].Think = time.Duration(rng.ExpFloat64() * float64(mean)).Round(time.Millisecond)
		}
	}
}

// agentic builds agent sessions: a firstTokens-token prompt (a shared system prompt with tool
// definitions, then the session's task and files), then minTurns..maxTurns turns, each appending the agent's previous reply and a tool
// result of minTool..maxTool tokens, and sent after the tool's run time (exponential, mean
// toolTime). A session stops growing before its context would pass maxContext tokens.
func agentic(rng *rand.Rand, sessions, minTurns, maxTurns, firstTokens, minTool, maxTool, maxContext, outTokens int, toolTime time.Duration) Workload {
	// Every session starts with the same system prompt and tool definitions (a quarter of the
	// first prompt), then its own task and files.
	system := Message{Role: "system", Content: textOfTokens(rng, firstTokens/4)}
	out := make([]Session, sessions)
	for i := range out {
		history := []Message{system, {Role: "user", Content: fmt.Sprintf("Task %d. ", i) + textOfTokens(rng, firstTokens-firstTokens/4)}}
		turns := minTurns + rng.IntN(maxTurns-minTurns+1)
		conv := fmt.Sprintf("agent-%d", i)
		var reqs []Request
		for t := range turns {
			req := Request{Conversation: conv, Messages: slices.Clip(slices.Clone(history)), MaxTokens: outTokens}
			if t > 0 {
				req.Think = time.Duration(rng.ExpFloat64() * float64(toolTime)).Round(time.Millisecond)
			}
			reqs = append(reqs, req)
			reply := Message{Role: "assistant", Content: textOfTokens(rng, outTokens)}
			tool := Message{Role: "tool", Content: textOfTokens(rng, minTool+rng.IntN(maxTool-minTool+1))}
			if templatedTokens(append(slices.Clip(history), reply, tool))+outTokens > maxContext {
				break
			}
			history = append(history, reply, tool)
		}
		out[i] = Session{Requests: reqs}
	}
	return Workload{Name: "agentic", Sessions: out}
}
