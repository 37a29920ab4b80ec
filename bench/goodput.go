package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
)

// goodputSLOMS is the TTFT p99 (simulated ms) a load step must stay under to count as goodput.
const goodputSLOMS = 2000

// goodputLoads are the load multipliers -goodput steps through, lowest first.
var goodputLoads = []float64{0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3}

// GoodputStep is one policy at one load: the median over seeds of TTFT p99.
type GoodputStep struct {
	Load    float64 `json:"load"`
	RateRPS float64 `json:"rate_rps"`
	TTFTP99 float64 `json:"ttft_p99_ms"`
	Failed  int     `json:"failed"`
	OK      bool    `json:"within_slo"`
}

// GoodputCurve is every policy's steps in one regime and the highest rate each sustained.
type GoodputCurve struct {
	Regime   string                   `json:"regime"`
	Workload string                   `json:"workload"`
	Steps    map[string][]GoodputStep `json:"steps"`
	// Goodput is each policy's highest offered rate (req/s simulated) within the SLO, 0 if none.
	Goodput map[string]float64 `json:"goodput_rps"`
	Order   []string           `json:"policies"`
}

// runGoodput steps the load on shared-prefix for each selected regime and policy, stopping a
// policy at the first step that misses the SLO (latency grows with load; a policy past its knee
// does not come back).
func runGoodput(ctx context.Context, o options, mr *MatrixResults) ([]GoodputCurve, error) {
	name := o.workloads[0]
	var ws []Workload
	perStep := 0
	for _, seed := range mr.Seeds {
		w, err := generateWorkload(name, seed, o.size())
		if err != nil {
			return nil, err
		}
		ws = append(ws, w)
		perStep += w.NumRequests()
	}
	prog := newProgress(os.Stderr, perStep*len(goodputLoads)*len(o.policies)*len(o.regimes))
	defer prog.finish()
	var curves []GoodputCurve
	for _, rg := range o.regimes {
		c := GoodputCurve{Regime: rg.Name, Workload: name, Steps: map[string][]GoodputStep{}, Goodput: map[string]float64{}}
		for _, p := range o.policies {
			c.Order = append(c.Order, p.Name)
			op := o
			op.policies = []policy{p}
			for li, load := range goodputLoads {
				var runs []MatrixRun
				for i, w := range ws {
					if err := ctx.Err(); err != nil {
						return nil, err
					}
					run := runMatrixJob(ctx, op, matrixJob{regime: rg, workload: w, seed: mr.Seeds[i], load: load}, prog)
					runs = append(runs, run)
					mr.Runs = append(mr.Runs, run)
				}
				step := goodputStep(load, runs)
				c.Steps[p.Name] = append(c.Steps[p.Name], step)
				if !step.OK {
					for range goodputLoads[li+1:] {
						prog.add(perStep)
					}
					break
				}
				c.Goodput[p.Name] = step.RateRPS
			}
		}
		curves = append(curves, c)
	}
	return curves, nil
}

// goodputStep summarises one policy's runs (one per seed) at one load.
func goodputStep(load float64, runs []MatrixRun) GoodputStep {
	var p99, rates []float64
	failed := 0
	for _, r := range runs {
		rates = append(rates, r.RateRPS)
		for _, s := range r.Policies {
			if s.Skipped != "" {
				continue
			}
			p99 = append(p99, s.TTFTP99)
			failed += s.Failed
		}
	}
	st := GoodputStep{Load: load, RateRPS: round3(median(rates)), TTFTP99: round3(median(p99)), Failed: failed}
	st.OK = len(p99) > 0 && st.TTFTP99 < goodputSLOMS && failed == 0
	return st
}

// ratio returns goodput(a) / goodput(b), 0 when b sustained nothing.
func (c GoodputCurve) ratio(a, b string) float64 {
	if c.Goodput[b] == 0 {
		return 0
	}
	return c.Goodput[a] / c.Goodput[b]
}

// describe is the one-line summary of a curve.
func (c GoodputCurve) describe() string {
	var parts []string
	for _, p := range c.Order {
		at := ""
		if st := c.Steps[p]; len(st) == len(goodputLoads) && st[len(st)-1].OK {
			at = ">= " // within the SLO at the top of the ladder: a lower bound
		}
		parts = append(parts, fmt.Sprintf("%s %s%.1f req/s", p, at, c.Goodput[p]))
	}
	s := fmt.Sprintf("goodput (%s, %s; highest offered rate with TTFT p99 < %d ms): %s", c.Regime, c.Workload, goodputSLOMS, strings.Join(parts, ", "))
	if r := c.ratio(judgedPolicy, baselinePolicy); r > 0 {
		s += fmt.Sprintf("; %s/%s = %.2fx", judgedPolicy, baselinePolicy, r)
	}
	return s
}

// writeGoodputMarkdown writes a curve's section of report.md.
func writeGoodputMarkdown(out io.Writer, c GoodputCurve) {
	fmt.Fprintf(out, "## Goodput: %s, %s\n\n%s\n\n| policy | load | offered req/s | TTFT p99 ms | failed | within %d ms |\n|---|---|---|---|---|---|\n",
		c.Regime, c.Workload, c.describe(), goodputSLOMS)
	for _, p := range c.Order {
		for _, st := range c.Steps[p] {
			fmt.Fprintf(out, "| %s | %.2f | %.1f | %.0f | %d | %v |\n", p, st.Load, st.RateRPS, st.TTFTP99, st.Failed, st.OK)
		}
	}
	fmt.Fprintln(out)
}
