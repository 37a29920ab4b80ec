package main

import (
	"fmt"
	"html"
	"io"
	"math"
	"strings"
)

// palette gives each policy (in allPolicies order) a distinguishable colour.
var palette = []string{"#7f7f7f", "#1f77b4", "#bcbd22", "#8c564b", "#17becf", "#ff7f0e", "#d62728", "#2ca02c", "#9467bd", "#e377c2"}

// policyColor returns the colour of a policy by its position in allPolicies.
func policyColor(name string) string {
	for i, p := range allPolicies {
		if p.Name == name {
			return palette[i%len(palette)]
		}
	}
	return "#000000"
}

// Chart geometry, in SVG user units.
const (
	panelW, panelH = 600, 330
	plotL, plotR   = 60, 200 // margins left of and right of the plot (legend on the right)
	plotT, plotB   = 36, 46
	chartCols      = 2
	maxCDFPoints   = 240
)

// writeChart draws one panel per workload: the cumulative distribution of TTFT per policy on a
// logarithmic time axis (further left and steeper is better; the p99 is where a curve reaches
// 0.99).
func writeChart(out io.Writer, workloads []WorkloadResult) {
	rows := max(1, (len(workloads)+chartCols-1)/chartCols)
	w, h := chartCols*panelW, rows*panelH+30
	fmt.Fprintf(out, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="11">`+"\n", w, h, w, h)
	fmt.Fprintf(out, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(out, `<text x="%d" y="20" font-size="15" text-anchor="middle">TTFT cumulative distribution per policy (simulated ms, log scale)</text>`+"\n", w/2)
	for i, wl := range workloads {
		x0, y0 := (i%chartCols)*panelW, 30+(i/chartCols)*panelH
		writePanel(out, wl, x0, y0)
	}
	fmt.Fprintln(out, "</svg>")
}

// writePanel draws one workload's CDFs with its top-left corner at (x0, y0).
func writePanel(out io.Writer, wl WorkloadResult, x0, y0 int) {
	lo, hi := math.Inf(1), 0.0
	for _, s := range wl.Policies {
		for _, v := range s.ttft {
			if v > 0 {
				lo, hi = math.Min(lo, v), math.Max(hi, v)
			}
		}
	}
	left, top := float64(x0+plotL), float64(y0+plotT)
	width, height := float64(panelW-plotL-plotR), float64(panelH-plotT-plotB)
	fmt.Fprintf(out, `<text x="%.0f" y="%d" font-size="13" font-weight="bold">%s</text>`+"\n", left, y0+22, html.EscapeString(wl.Workload))
	fmt.Fprintf(out, `<rect x="%.0f" y="%.0f" width="%.0f" height="%.0f" fill="none" stroke="#444"/>`+"\n", left, top, width, height)
	if math.IsInf(lo, 1) {
		fmt.Fprintf(out, `<text x="%.0f" y="%.0f" text-anchor="middle">no data</text>`+"\n", left+width/2, top+height/2)
		return
	}
	lmin, lmax := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if lmax <= lmin {
		lmax = lmin + 1
	}
	xOf := func(v float64) float64 { return left + (math.Log10(v)-lmin)/(lmax-lmin)*width }
	yOf := func(q float64) float64 { return top + (1-q)*height }
	// grid and ticks
	for e := lmin; e <= lmax; e++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, e)
			if math.Log10(v) > lmax+1e-9 {
				continue
			}
			x := xOf(v)
			fmt.Fprintf(out, `<line x1="%.1f" y1="%.0f" x2="%.1f" y2="%.0f" stroke="#ddd"/>`+"\n", x, top, x, top+height)
			fmt.Fprintf(out, `<text x="%.1f" y="%.0f" text-anchor="middle">%s</text>`+"\n", x, top+height+14, tickLabel(v))
		}
	}
	// 1 is the frame's top edge, too close to 0.99 to label.
	for _, q := range []float64{0, 0.25, 0.5, 0.75, 0.9, 0.99} {
		y := yOf(q)
		fmt.Fprintf(out, `<line x1="%.0f" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#eee"/>`+"\n", left, y, left+width, y)
		fmt.Fprintf(out, `<text x="%.0f" y="%.1f" text-anchor="end">%g</text>`+"\n", left-4, y+4, q)
	}
	fmt.Fprintf(out, `<text x="%.0f" y="%.0f" text-anchor="middle">TTFT (simulated ms, log scale)</text>`+"\n", left+width/2, top+height+32)
	yMid := top + height/2
	fmt.Fprintf(out, `<text class="y-title" x="%.0f" y="%.0f" text-anchor="middle" transform="rotate(-90 %.0f %.0f)">fraction of requests (cumulative)</text>`+"\n", left-38, yMid, left-38, yMid)
	// curves and legend
	ly := top + 6
	for _, s := range wl.Policies {
		if len(s.ttft) == 0 {
			continue
		}
		color := policyColor(s.Policy)
		// Caddy's own policies dashed, this plugin's and the oracle solid
		dash := ""
		if !strings.HasPrefix(s.Policy, "llm") && s.Policy != "oracle" {
			dash = ` stroke-dasharray="5,3"`
		}
		fmt.Fprintf(out, `<polyline fill="none" stroke="%s" stroke-width="1.6"%s points="`, color, dash)
		n := len(s.ttft)
		step := max(1, n/maxCDFPoints)
		for i := 0; i < n; i += step {
			v := math.Max(s.ttft[i], math.Pow(10, lmin))
			fmt.Fprintf(out, "%.1f,%.1f ", xOf(v), yOf(float64(i+1)/float64(n)))
		}
		fmt.Fprintf(out, "%.1f,%.1f\"/>\n", xOf(math.Max(s.ttft[n-1], math.Pow(10, lmin))), yOf(1))
		fmt.Fprintf(out, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="%s" stroke-width="3"%s/>`+"\n", left+width+8, ly, left+width+24, ly, color, dash)
		fmt.Fprintf(out, `<text x="%.0f" y="%.0f">%s p50 %s</text>`+"\n", left+width+28, ly+4, html.EscapeString(s.Policy), tickLabel(s.TTFTP50))
		ly += 16
	}
}

// tickLabel formats a millisecond value compactly: 2, 50, 1k, 20k.
func tickLabel(v float64) string {
	switch {
	case v >= 1000:
		return fmt.Sprintf("%gk", math.Round(v/100)/10)
	case v >= 10:
		return fmt.Sprintf("%.0f", v)
	default:
		return fmt.Sprintf("%.2g", v)
	}
}
