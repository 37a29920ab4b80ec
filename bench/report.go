package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
)

// WorkloadResult is every policy's figures on one workload.
type WorkloadResult struct {
	Workload string `json:"workload"`
	Requests int    `json:"requests"`
	Warmup   int    `json:"warmup_requests"`
	// CapacityRPS is the estimated cluster capacity in requests per simulated second and
	// RateRPS the offered request rate (load x capacity); see capacity.go for the formula.
	CapacityRPS float64   `json:"capacity_rps"`
	BackendRPS  []float64 `json:"backend_capacity_rps,omitempty"`
	RateRPS     float64   `json:"rate_rps"`
	Policies    []Summary `json:"policies"`
	Notes       []string  `json:"notes,omitempty"`
}

// Results is the content of results.json.
type Results struct {
	Command   string           `json:"command"`
	Started   string           `json:"started"`
	Machine   string           `json:"machine"`
	Seed      int64            `json:"seed"`
	Backends  int              `json:"backends"`
	Load      float64          `json:"load"`
	BypassRPS float64          `json:"bypass_rps,omitempty"`
	Sim       simSettings      `json:"sim"`
	Workloads []WorkloadResult `json:"workloads"`
	Overhead  *OverheadResult  `json:"overhead,omitempty"`
	Notes     []string         `json:"notes,omitempty"`
}

// baseline returns the baseline policy's summary on a workload, if it ran.
func (w WorkloadResult) baseline() (Summary, bool) {
	for _, s := range w.Policies {
		if s.Policy == baselinePolicy && s.Skipped == "" {
			return s, true
		}
	}
	return Summary{}, false
}

// ratio formats a/b as "0.45x", or "-" when it is undefined.
func ratio(a, b float64) string {
	if b == 0 || math.IsNaN(a) || math.IsNaN(b) {
		return "-"
	}
	return fmt.Sprintf("%.2fx", a/b)
}

// tableHeader names the columns of the per-workload table.
var tableHeader = []string{"policy", "TTFT p50", "p90", "p99", "E2E p50", "p99", "mean", "TPOT p50",
	"out tok/s", "hit rate", "failed", "| vs least_conn: TTFT p50", "TTFT p99", "E2E mean", "tok/s"}

// tableRows returns a workload's table, one row per policy, numbers in ms.
func tableRows(w WorkloadResult) [][]string {
	base, hasBase := w.baseline()
	var rows [][]string
	for _, s := range w.Policies {
		if s.Skipped != "" {
			rows = append(rows, []string{s.Policy, "skipped: " + s.Skipped})
			continue
		}
		row := []string{s.Policy,
			f0(s.TTFTP50), f0(s.TTFTP90), f0(s.TTFTP99), f0(s.E2EP50), f0(s.E2EP99), f0(s.E2EMean),
			f1(s.TPOTP50), f0(s.OutputTokensPerS), fmt.Sprintf("%.1f%%", 100*s.CacheHitRate),
			fmt.Sprintf("%d/%d", s.Failed, s.Requests)}
		if hasBase {
			row = append(row, "| "+ratio(s.TTFTP50, base.TTFTP50), ratio(s.TTFTP99, base.TTFTP99),
				ratio(s.E2EMean, base.E2EMean), ratio(s.OutputTokensPerS, base.OutputTokensPerS))
		}
		rows = append(rows, row)
	}
	return rows
}

func f0(x float64) string { return fmt.Sprintf("%.0f", x) }
func f1(x float64) string { return fmt.Sprintf("%.1f", x) }

// verdict is a workload's one-line verdict: its sample size and llm's TTFT against the best stock
// policy, judged as a matrix cell is (judgeCell).
func (w WorkloadResult) verdict() string {
	c := judgeCell("", w.Workload, []MatrixRun{{Requests: w.Requests, Warmup: w.Warmup, BackendRPS: w.BackendRPS, Policies: w.Policies}})
	head := fmt.Sprintf("%s: %d measured requests per policy (1 seed)", w.Workload, w.Requests-w.Warmup)
	if !c.Judged {
		return head + fmt.Sprintf("; not judged (needs %s and one of %s)", judgedPolicy, strings.Join(stockPolicies, "/"))
	}
	llm, _ := c.policy(judgedPolicy)
	return head + fmt.Sprintf("; %s TTFT p50 %.2fx the best stock (%s), p99 %.2fx (%s), hit rate %.0f%%: %s",
		judgedPolicy, c.P50Ratio, c.BestP50Policy, c.P99Ratio, c.BestP99Policy, 100*llm.HitRate, c.verdictWord())
}

// writeVerdicts prints one verdict line per workload.
func writeVerdicts(out io.Writer, workloads []WorkloadResult, prefix string) {
	for _, w := range workloads {
		fmt.Fprintf(out, "%s%s\n", prefix, w.verdict())
	}
}

// writeTable prints a workload's table as aligned text.
func writeTable(out io.Writer, w WorkloadResult) {
	fmt.Fprintf(out, "\n== %s: %d requests (%d warm-up), %.1f req/s offered = load x capacity %.1f req/s (simulated time, ms)\n",
		w.Workload, w.Requests, w.Warmup, w.RateRPS, w.CapacityRPS)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join(tableHeader, "\t")+"\t")
	for _, r := range tableRows(w) {
		fmt.Fprintln(tw, strings.Join(r, "\t")+"\t")
	}
	_ = tw.Flush()
	var lags, cpu, spread []string
	for _, s := range w.Policies {
		if s.Skipped == "" {
			lags = append(lags, fmt.Sprintf("%s %.1f", s.Policy, s.LagP99))
			cpu = append(cpu, fmt.Sprintf("%s %.0f%%", s.Policy, s.CPUPercent))
			spread = append(spread, fmt.Sprintf("%s %v", s.Policy, s.BackendRequests))
		}
	}
	fmt.Fprintf(out, "  scheduling lag p99 (wall ms): %s\n", strings.Join(lags, ", "))
	fmt.Fprintf(out, "  process CPU (of one core): %s\n", strings.Join(cpu, ", "))
	fmt.Fprintf(out, "  requests per backend: %s\n", strings.Join(spread, ", "))
	for _, n := range w.Notes {
		fmt.Fprintf(out, "  note: %s\n", n)
	}
}

// writeMarkdown writes report.md: the run's settings, one table per workload and the chart.
func writeMarkdown(out io.Writer, res Results) {
	fmt.Fprintf(out, "# caddy-llm benchmark\n\n`%s`  \n%s, %s  \n", res.Command, res.Started, res.Machine)
	fmt.Fprintf(out, "%d simulated vLLM backends (%s), load %.2f of estimated capacity, seed %d",
		res.Backends, res.Sim.describe(), res.Load, res.Seed)
	if res.BypassRPS > 0 {
		fmt.Fprintf(out, ", plus %.1f req/s sent straight to backend 0 (bypassing Caddy)", res.BypassRPS)
	}
	fmt.Fprintf(out, ".\n\nLatencies are in simulated milliseconds (wall time x time scale %.0f); the first %.0f%% of requests are warm-up and not counted. "+
		"Ratios are to `%s`; hit rate is the backends' own prefix-cache hits / queries.\n\n", res.Sim.TimeScale, 100*warmupFraction, baselinePolicy)
	fmt.Fprintf(out, "Method: fresh backends (cold caches) and a fresh in-process Caddy for every policy; sessions arrive open-loop (Poisson) at load x capacity, "+
		"where capacity = backends / (U/P + out x (D0 + Dseq x B) / B) with U the mean prompt tokens left to prefill under an ideal cluster-wide prefix cache, "+
		"P the prefill rate, out the output tokens, D0 + Dseq x B the decode step at batch B (max_num_seqs, or fewer if the KV cache cannot hold them): "+
		"a policy that recomputes shared prefixes saturates below load 1. Multi-turn sessions send each turn when the previous one ends. "+
		"TTFT is the first chunk with content, TPOT (e2e - TTFT) / (output tokens - 1). The oracle routes on the simulators' true cache and queues, greedily per request.\n\n")
	if len(res.Workloads) > 0 {
		fmt.Fprintf(out, "Verdicts (%s against the best of %s; PASS when TTFT p99 <= %.2fx and p50 <= %.2fx; small samples are noisy, see `-matrix` for medians over seeds):\n\n",
			judgedPolicy, strings.Join(stockPolicies, "/"), passP99Ratio, passP50Ratio)
		writeVerdicts(out, res.Workloads, "- ")
		fmt.Fprintln(out)
	}
	fmt.Fprintf(out, "![TTFT distribution](ttft.svg)\n\n")
	for _, w := range res.Workloads {
		fmt.Fprintf(out, "## %s\n\n%d requests (%d warm-up), offered %.1f req/s (capacity estimate %.1f req/s)\n\n",
			w.Workload, w.Requests, w.Warmup, w.RateRPS, w.CapacityRPS)
		rows := append([][]string{slices.Clone(tableHeader)}, tableRows(w)...)
		for _, r := range rows {
			for i := range r {
				r[i] = strings.TrimPrefix(r[i], "| ")
			}
		}
		writeMarkdownTable(out, rows)
		fmt.Fprintln(out)
		for _, s := range w.Policies {
			if s.Skipped == "" && s.LagP99 > lagRerunMS {
				fmt.Fprintf(out, "- %s: scheduling lag p99 %.1f ms (wall) even after re-runs: the machine was busy, read this row with care\n", s.Policy, s.LagP99)
			}
		}
		for _, n := range w.Notes {
			fmt.Fprintf(out, "- %s\n", n)
		}
		fmt.Fprintln(out)
	}
	if res.Overhead != nil {
		fmt.Fprintf(out, "## Overhead\n\n%s\n\n", res.Overhead.describe())
	}
	for _, n := range res.Notes {
		fmt.Fprintf(out, "- %s\n", n)
	}
}

// writeOutputs writes results.json, report.md and ttft.svg into dir.
func writeOutputs(dir string, res Results) error {
	var chart func(*strings.Builder)
	if len(res.Workloads) > 0 {
		chart = func(svg *strings.Builder) { writeChart(svg, res.Workloads) }
	}
	return writeResultFiles(dir, res, func(md *strings.Builder) { writeMarkdown(md, res) }, "ttft.svg", chart)
}

// writeResultFiles writes v as results.json, the markdown report as report.md and, when chart is not
// nil, the chart as svgName into dir: the files every kind of run leaves.
func writeResultFiles(dir string, v any, markdown func(*strings.Builder), svgName string, chart func(*strings.Builder)) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("creating output dir: %w", err)
	}
	js, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding results: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), append(js, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing results.json: %w", err)
	}
	var md strings.Builder
	markdown(&md)
	if err := os.WriteFile(filepath.Join(dir, "report.md"), []byte(md.String()), 0o644); err != nil {
		return fmt.Errorf("writing report.md: %w", err)
	}
	if chart == nil {
		return nil
	}
	var svg strings.Builder
	chart(&svg)
	if err := os.WriteFile(filepath.Join(dir, svgName), []byte(svg.String()), 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", svgName, err)
	}
	return nil
}
