package main

import (
	"fmt"
	"html"
	"io"
	"math"
	"slices"
)

// Heat-map geometry, in SVG user units.
const (
	heatCellW, heatCellH = 120, 56
	heatLeft, heatTop    = 150, 86 // room for the regime names and axis title, the title and workload names
	heatRight, heatBot   = 24, 70  // room for the colour scale
)

// ratioColor maps a ratio to a diverging colour on a log2 scale: green below 1 (llm better than
// the best stock policy), pale yellow at 1, red above; saturated at 0.5x and 2x.
func ratioColor(r float64) string {
	if !(r > 0) || math.IsInf(r, 0) {
		return "#dddddd"
	}
	t := math.Max(-1, math.Min(1, math.Log2(r)))
	green, mid, red := [3]float64{26, 152, 80}, [3]float64{255, 255, 191}, [3]float64{215, 48, 39}
	from, to, f := mid, red, t
	if t < 0 {
		to, f = green, -t
	}
	var c [3]int
	for i := range c {
		c[i] = int(math.Round(from[i] + (to[i]-from[i])*f))
	}
	return fmt.Sprintf("#%02x%02x%02x", c[0], c[1], c[2])
}

// writeHeatMap draws the matrix: regimes down, workloads across, each cell coloured by llm's
// TTFT p99 ratio to the best stock policy and labelled with it, the p50 ratio and the verdict.
func writeHeatMap(out io.Writer, cells []MatrixCell, seeds int) {
	var regimes, workloads []string
	at := map[[2]string]MatrixCell{}
	for _, c := range cells {
		if !slices.Contains(regimes, c.Regime) {
			regimes = append(regimes, c.Regime)
		}
		if !slices.Contains(workloads, c.Workload) {
			workloads = append(workloads, c.Workload)
		}
		at[[2]string{c.Regime, c.Workload}] = c
	}
	w := heatLeft + heatCellW*len(workloads) + heatRight
	h := heatTop + heatCellH*len(regimes) + heatBot
	fmt.Fprintf(out, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="11">`+"\n", w, h, w, h)
	fmt.Fprintf(out, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(out, `<text x="%d" y="20" font-size="14" text-anchor="middle">llm TTFT p99 / best stock policy's (median of %d seed(s)); green: llm better</text>`+"\n", w/2, seeds)
	gridW := heatCellW * len(workloads)
	fmt.Fprintf(out, `<text x="%d" y="44" font-size="12" font-weight="bold" text-anchor="middle">workload</text>`+"\n", heatLeft+gridW/2)
	for j, wl := range workloads {
		fmt.Fprintf(out, `<text x="%d" y="%d" text-anchor="middle">%s</text>`+"\n", heatLeft+j*heatCellW+heatCellW/2, heatTop-8, html.EscapeString(wl))
	}
	gridH := heatCellH * len(regimes)
	fmt.Fprintf(out, `<text x="18" y="%d" font-size="12" font-weight="bold" text-anchor="middle" transform="rotate(-90 18 %d)">backend regime</text>`+"\n", heatTop+gridH/2, heatTop+gridH/2)
	for i, rg := range regimes {
		fmt.Fprintf(out, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", heatLeft-8, heatTop+i*heatCellH+heatCellH/2+4, html.EscapeString(rg))
		for j, wl := range workloads {
			x, y := heatLeft+j*heatCellW, heatTop+i*heatCellH
			c, ok := at[[2]string{rg, wl}]
			fill, label, sub := "#dddddd", "n/a", ""
			if ok && c.Judged {
				fill = ratioColor(c.P99Ratio)
				label = fmt.Sprintf("%.2fx", c.P99Ratio)
				sub = fmt.Sprintf("p50 %.2fx %s", c.P50Ratio, c.verdictWord())
			}
			fmt.Fprintf(out, `<rect class="cell" x="%d" y="%d" width="%d" height="%d" fill="%s" stroke="white" stroke-width="2"/>`+"\n", x, y, heatCellW, heatCellH, fill)
			fmt.Fprintf(out, `<text x="%d" y="%d" font-size="15" text-anchor="middle">%s</text>`+"\n", x+heatCellW/2, y+heatCellH/2, label)
			if sub != "" {
				fmt.Fprintf(out, `<text x="%d" y="%d" font-size="10" text-anchor="middle">%s</text>`+"\n", x+heatCellW/2, y+heatCellH/2+16, sub)
			}
		}
	}
	// colour scale
	sy := heatTop + gridH + 24
	const steps = 40
	sw := float64(gridW) / steps
	for k := range steps {
		r := math.Pow(2, -1+2*(float64(k)+0.5)/steps)
		fmt.Fprintf(out, `<rect x="%.1f" y="%d" width="%.1f" height="12" fill="%s"/>`+"\n", float64(heatLeft)+float64(k)*sw, sy, sw+0.5, ratioColor(r))
	}
	for _, tick := range []float64{0.5, 0.71, 1, 1.41, 2} {
		x := float64(heatLeft) + (math.Log2(tick)+1)/2*float64(gridW)
		fmt.Fprintf(out, `<text x="%.1f" y="%d" text-anchor="middle">%gx</text>`+"\n", x, sy+26, tick)
	}
	fmt.Fprintf(out, `<text x="%d" y="%d" text-anchor="middle">p99 ratio (log scale; PASS also needs p50 ratio &lt;= %.2f)</text>`+"\n", heatLeft+gridW/2, sy+42, passP50Ratio)
	fmt.Fprintln(out, "</svg>")
}
