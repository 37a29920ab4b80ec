package caddyllm

import (
	"math"

	"github.com/tokenrouter/caddy-llm/scraper"
)

// firstTokenCheck holds how much later than predicted an upstream's first tokens come, by the backend's
// own count: vLLM's vllm:time_to_first_token_seconds and SGLang's sglang:time_to_first_token_seconds,
// observed as each first token is sampled (scraper.Snapshot.FirstTokens), against what the decision
// predicted for the requests this proxy sent there. A bare lb_policy llm sees no first token itself, and
// learns an upstream's speed from when its requests end and from busy intervals: slowly, where every
// request of a burst is sent before the first one ends. A backend that queues far more than it is
// priced at (slots it has not been seen to fill yet, a prefill speed the prior puts too high) shows it in
// the first scrape after its first tokens: in a pool of two kinds of engine, 16-slot engines without
// chunked prefill beside 256-slot ones, a bare policy priced the small ones near the prior for the first
// seconds of a run, sent them as many requests as the large ones, and their first tokens came 4-10
// times later than predicted while the large ones' came on time (the bench's mixed-pool).
//
// Which requests a scrape interval's first tokens were is not known (the proxy sees no first token);
// they were sent about their mean time to first token before, so the interval is compared with the
// predictions of this proxy's requests sent in that window, moved back by it. A scrape that shows
// other clients' requests there compares nothing: their first tokens are in the counts.
//
// It is reported (/llm/upstreams, the metrics), not priced. Added to an upstream's queue while its scrape
// showed requests waiting (the seconds its first tokens came later than the fleet's median lateness
// would have made them), it took mixed-pool's TTFT p99 to 0.93x over nine seeds and left the matrix as
// it was (315 runs), but lost hetero-5x agentic's p99 on nine seeds of nine (1.39x): lateness near 1
// wanders with the predictions it is compared with, and a wait added on that noise moved agent sessions
// off their homes (docs/bench/first-token-lateness). Priced, it wants shrinking by its own noise first.
type firstTokenCheck struct {
	sentAt   [sentRing]int64   // this proxy's recent requests there: when each was sent (unix nanoseconds)
	sentTTFT [sentRing]float64 // the time to first token the decision predicted for it, without the overrun's stretch
	sentNext int
	// The backend's first tokens and the sum of their times at the last scrape read, and its time.
	fromCount, fromSum float64
	fromAt             int64
	// logLate is the mean of log(reported / predicted) over recent intervals, each weighing its first
	// tokens; tokens is how many first tokens it rests on, at most lateMemory (older ones weigh less).
	logLate, tokens float64
}

const (
	// sentRing is how many recent requests the check remembers per upstream: it must reach back a time to
	// first token and a scrape interval (a second of first tokens 0.4 s late at 1,000 requests a second:
	// TestFirstTokenCheck); sends older than it leave an interval with nothing to compare.
	sentRing = 1024
	// lateMemory is how many first tokens the lateness is a running mean over: a backend that catches up
	// is on time again within a few scrapes.
	lateMemory = 32
	// minLateTokens is how many first tokens the lateness needs before it is reported.
	minLateTokens = 8
	// maxLate bounds one interval's ratio either way: one stall must not say a backend is late for long.
	maxLate = 30
)

// sent records a request sent at (unix nanoseconds) with the time to first token predicted for it.
func (c *firstTokenCheck) sent(at int64, ttft float64) {
	c.sentAt[c.sentNext], c.sentTTFT[c.sentNext] = at, ttft
	c.sentNext = (c.sentNext + 1) % sentRing
}

// fromScrape compares the first tokens snap reports since the last scrape read with the predictions of
// the requests sent about their mean time to first token before; foreign says the scrape shows others'
// requests there.
func (c *firstTokenCheck) fromScrape(snap *scraper.Snapshot, foreign bool) {
	at := snap.At.UnixNano()
	if at <= c.fromAt {
		return // not newer than the last one read
	}
	dCount, dSum := snap.FirstTokens-c.fromCount, snap.FirstTokenSeconds-c.fromSum
	from := c.fromAt
	c.fromCount, c.fromSum, c.fromAt = snap.FirstTokens, snap.FirstTokenSeconds, at
	if from == 0 || foreign || !(dCount >= 1) || !(dSum > 0) || math.IsInf(dSum, 0) {
		return // the first scrape, no first token since, others' requests there, or counters that went back (a restart)
	}
	mean := dSum / dCount
	lo, hi := from-seconds(mean), at-seconds(mean)
	pred, n := 0.0, 0
	for i, t := range c.sentAt {
		if t > lo && t <= hi && c.sentTTFT[i] > 0 {
			pred += c.sentTTFT[i]
			n++
		}
	}
	if n == 0 {
		return
	}
	pred /= float64(n)
	x := min(max(math.Log(mean/pred), -math.Log(maxLate)), math.Log(maxLate))
	// The interval weighs its first tokens against those the mean rests on, and at most all of it: more
	// first tokens in one interval than the memory holds replace the mean, not overshoot it (a step past
	// the new value diverged, to +Inf within a test run, and /llm/upstreams failed to encode it).
	w := min(dCount, float64(n))
	c.tokens = min(c.tokens+w, lateMemory)
	c.logLate += min(w/c.tokens, 1) * (x - c.logLate)
}

// late is how many times their predicted time the upstream's first tokens have taken lately; 0 while
// fewer than minLateTokens were compared.
func (c *firstTokenCheck) late() float64 {
	if c.tokens < minLateTokens {
		return 0
	}
	return math.Exp(c.logLate)
}
