package caddyllm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
)

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "llm",
		Usage: "upstreams [--address <interface>] [--config <path> [--adapter <name>]]",
		Short: "Shows what the llm load balancer sees",
		Long: `
Commands for the llm load-balancing policy (caddy-llm).

  caddy llm upstreams   every upstream's in-flight requests and tokens, learned
                        routes and scraped backend metrics, as a table

They use the admin API of the running Caddy: its address comes from --address,
else from the given --config, else Caddy's default (localhost:2019).
`,
		CobraFunc: func(cmd *cobra.Command) {
			cmd.AddCommand(upstreamsCommand())
		},
	})
}

// upstreamsCommand is `caddy llm upstreams`.
func upstreamsCommand() *cobra.Command {
	c := &cobra.Command{
		Use:   "upstreams [--address <interface>] [--config <path> [--adapter <name>]]",
		Short: "Prints the upstreams the llm policy balances, as a table",
		Long: strings.TrimSpace(`
Prints GET /llm/upstreams of the running Caddy as a table, one row per upstream:

  REQS, TOKENS  requests and tokens (prompt + expected output) in flight
  PREFILL, DECODE
                in-flight requests by phase
  TO_PREFILL, QUEUED
                prompt tokens still to prefill, and how long that takes
  SATURATED     yes while the upstream is in its 429 backoff
  IDLE          time since a request last began or ended there ("-" while
                requests are in flight): a backend dropped from the pool
                keeps its row, idle ever longer
  ROUTES        learned prefix routes pointing at it
  RUNNING, WAITING, KV
                the backend's own scraped numbers (metrics { }): running and
                queued requests, KV-cache usage
  SCRAPE        metrics flavor and the age of the last good scrape, "stale"
                when too old to be trusted, "never" before the first one

Fields the table does not know are shown too: numbers at the top level as
extra columns, nested objects as a table of their own.
`),
		RunE: caddycmd.WrapCommandFuncForCobra(func(fl caddycmd.Flags) (int, error) {
			return cmdUpstreams(fl, os.Stdout)
		}),
	}
	c.Flags().StringP("config", "c", "", "Configuration file to read the admin address from, if --address is not used")
	c.Flags().StringP("adapter", "a", "", "Name of config adapter to apply (when --config is used)")
	c.Flags().String("address", "", "The address of the admin API endpoint, if not the default")
	return c
}

// cmdUpstreams fetches /llm/upstreams from the admin API found the way `caddy reload` finds it and
// writes the table to w.
func cmdUpstreams(fl caddycmd.Flags, w io.Writer) (int, error) {
	addr, err := caddycmd.DetermineAdminAPIAddress(fl.String("address"), nil, fl.String("config"), fl.String("adapter"))
	if err != nil {
		return caddy.ExitCodeFailedStartup, fmt.Errorf("determining admin API address: %w", err)
	}
	resp, err := caddycmd.AdminAPIRequest(addr, http.MethodGet, "/llm/upstreams", nil, nil)
	if err != nil {
		return caddy.ExitCodeFailedStartup, fmt.Errorf("requesting /llm/upstreams: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return caddy.ExitCodeFailedStartup, fmt.Errorf("reading /llm/upstreams: %w", err)
	}
	if err := renderUpstreams(w, body); err != nil {
		return caddy.ExitCodeFailedStartup, err
	}
	return caddy.ExitCodeSuccess, nil
}

// field is one scalar of a JSON object, named by its dotted path (`metrics.kv_cache_usage`).
type field struct {
	path  string
	value any // json.Number, string, bool or nil
}

// fields is an upstream's JSON object flattened, in the server's order.
type fields []field

func (fs fields) get(path string) (any, bool) {
	for _, f := range fs {
		if f.path == path {
			return f.value, true
		}
	}
	return nil, false
}

// upstreamColumn is a column of the main table. value renders it from the upstream's fields ("" when
// it does not apply); uses lists the paths it shows, which the generic columns then leave out.
type upstreamColumn struct {
	header string
	uses   []string
	value  func(fields) string
}

// plain is a column showing one field as it is.
func plain(header, path string) upstreamColumn {
	return upstreamColumn{header, []string{path}, func(fs fields) string {
		v, _ := fs.get(path)
		return formatValue(v)
	}}
}

// scraped is a column showing a scraped backend number; empty before the first good scrape, when
// the report's zeros mean "not known yet".
func scraped(c upstreamColumn) upstreamColumn {
	value := c.value
	c.value = func(fs fields) string {
		if age, ok := number(fs, "metrics.age_seconds"); ok && age < 0 {
			return ""
		}
		return value(fs)
	}
	return c
}

// upstreamColumns are the main table. Adding a field the report gains is one line here; a field not
// listed still shows, under its JSON name.
var upstreamColumns = []upstreamColumn{
	plain("UPSTREAM", "upstream"),
	plain("REQS", "inflight_requests"),
	plain("PREFILL", "prefilling"),
	plain("DECODE", "decoding"),
	plain("TOKENS", "inflight_tokens"),
	plain("TO_PREFILL", "prefill_tokens"),
	{"QUEUED", []string{"queued_prefill_seconds"}, func(fs fields) string {
		if f, ok := number(fs, "queued_prefill_seconds"); ok {
			return formatSeconds(f)
		}
		return ""
	}},
	plain("SATURATED", "saturated"),
	{"IDLE", []string{"idle_seconds"}, func(fs fields) string {
		f, ok := number(fs, "idle_seconds")
		switch {
		case !ok:
			return ""
		case f == 0:
			if n, _ := number(fs, "inflight_requests"); n > 0 {
				return "-"
			}
		}
		return formatSeconds(f)
	}},
	plain("ROUTES", "learned_routes"),
	scraped(plain("RUNNING", "metrics.running")),
	scraped(plain("WAITING", "metrics.waiting")),
	scraped(upstreamColumn{"KV", []string{"metrics.kv_cache_usage"}, func(fs fields) string {
		f, ok := number(fs, "metrics.kv_cache_usage")
		if !ok {
			return ""
		}
		return strconv.FormatFloat(100*f, 'f', 1, 64) + "%"
	}}),
	{"SCRAPE", []string{"metrics.flavor", "metrics.fresh", "metrics.age_seconds", "metrics.errors", "metrics.last_error", "metrics.last_error_age_seconds"}, scrapeStatus},
}

// hiddenFields are reported but left out of the table: the backend's fixed cache geometry.
var hiddenFields = []string{"metrics.block_size", "metrics.num_blocks", "metrics.lora.max_lora"}

// scrapeStatus summarizes the metrics block: "vllm 0.4s", "vllm stale 12s, 3 errors", "never".
func scrapeStatus(fs fields) string {
	age, ok := number(fs, "metrics.age_seconds")
	if !ok {
		return ""
	}
	var parts []string
	if v, ok := fs.get("metrics.flavor"); ok {
		parts = append(parts, formatValue(v))
	}
	switch fresh, _ := fs.get("metrics.fresh"); {
	case age < 0:
		parts = append(parts, "never")
	case fresh == false:
		parts = append(parts, "stale "+formatSeconds(age))
	default:
		parts = append(parts, formatSeconds(age))
	}
	s := strings.Join(parts, " ")
	switch n, _ := number(fs, "metrics.errors"); {
	case n == 1:
		s += ", 1 error"
	case n > 1:
		s += ", " + formatFloat(n) + " errors"
	}
	return s
}

// renderUpstreams writes the /llm/upstreams report in body as tables: the main one, one per nested
// object the main one does not know, scrape errors, and the route table's counters.
func renderUpstreams(w io.Writer, body []byte) error {
	var report struct {
		Upstreams []json.RawMessage `json:"upstreams"`
		Routes    json.RawMessage   `json:"routes"`
	}
	if err := json.Unmarshal(body, &report); err != nil {
		return fmt.Errorf("decoding /llm/upstreams: %w", err)
	}
	rows := make([]fields, 0, len(report.Upstreams))
	for _, raw := range report.Upstreams {
		fs, err := flatten(raw)
		if err != nil {
			return fmt.Errorf("decoding /llm/upstreams: %w", err)
		}
		rows = append(rows, fs)
	}
	routes, err := flatten(report.Routes)
	if err != nil {
		return fmt.Errorf("decoding /llm/upstreams: %w", err)
	}

	if len(rows) == 0 {
		if provisioned, _ := routes.get("provisioned"); provisioned == false {
			fmt.Fprintln(w, "No loaded config uses lb_policy llm.")
		} else {
			fmt.Fprintln(w, "No upstreams yet.")
		}
	} else {
		writeTables(w, rows)
	}
	if len(routes) > 0 {
		var parts []string
		for _, f := range routes {
			if f.path != "provisioned" {
				parts = append(parts, strings.ReplaceAll(f.path, "_", " ")+" "+formatValue(f.value))
			}
		}
		fmt.Fprintf(w, "\nRoutes: %s\n", strings.Join(parts, ", "))
	}
	return nil
}

// writeTables writes the main table, then a table per unknown nested object ("cache", "model"), in
// the order their fields first appear, then the last scrape error of each upstream that has one.
func writeTables(w io.Writer, rows []fields) {
	known := map[string]bool{}
	for _, c := range upstreamColumns {
		for _, p := range c.uses {
			known[p] = true
		}
	}
	for _, p := range hiddenFields {
		known[p] = true
	}
	// Fields no column knows, grouped by their first path element; "" is the top level.
	var groups []string
	extra := map[string][]string{}
	for _, fs := range rows {
		for _, f := range fs {
			if known[f.path] {
				continue
			}
			known[f.path] = true
			group, _, nested := strings.Cut(f.path, ".")
			if !nested {
				group = ""
			}
			if _, ok := extra[group]; !ok {
				groups = append(groups, group)
			}
			extra[group] = append(extra[group], f.path)
		}
	}

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	var header []string
	for _, c := range upstreamColumns {
		header = append(header, c.header)
	}
	for _, p := range extra[""] {
		header = append(header, columnHeader(p))
	}
	writeRow(tw, header)
	for _, fs := range rows {
		var cells []string
		for _, c := range upstreamColumns {
			cells = append(cells, c.value(fs))
		}
		for _, p := range extra[""] {
			v, _ := fs.get(p)
			cells = append(cells, formatValue(v))
		}
		writeRow(tw, cells)
	}
	tw.Flush()

	for _, group := range groups {
		if group == "" {
			continue
		}
		fmt.Fprintf(w, "\n%s\n", strings.ToUpper(group))
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		header := []string{"UPSTREAM"}
		for _, p := range extra[group] {
			header = append(header, columnHeader(strings.TrimPrefix(p, group+".")))
		}
		writeRow(tw, header)
		for _, fs := range rows {
			name, _ := fs.get("upstream")
			cells := []string{formatValue(name)}
			for _, p := range extra[group] {
				v, _ := fs.get(p)
				cells = append(cells, formatValue(v))
			}
			writeRow(tw, cells)
		}
		tw.Flush()
	}

	first := true
	for _, fs := range rows {
		msg, ok := fs.get("metrics.last_error")
		if !ok || msg == "" {
			continue
		}
		if first {
			fmt.Fprintln(w, "\nLast scrape errors:")
			first = false
		}
		name, _ := fs.get("upstream")
		when := ""
		if age, ok := number(fs, "metrics.last_error_age_seconds"); ok {
			since := ""
			// A scrape that succeeded after it (the demo's first scrape, sent before its in-process
			// backends listened) makes the error history, not the upstream's state.
			if last, ok := number(fs, "metrics.age_seconds"); ok && last >= 0 && last < age {
				since = "; scraped since"
			}
			when = " (" + formatSeconds(age) + " ago" + since + ")"
		}
		fmt.Fprintf(w, "  %s: %s%s\n", formatValue(name), formatValue(msg), when)
	}
}

func writeRow(w io.Writer, cells []string) {
	for i, c := range cells {
		if c == "" {
			cells[i] = "-"
		}
	}
	fmt.Fprintln(w, strings.Join(cells, "\t"))
}

// columnHeader turns a JSON name into a header: "observed_hit_rate" -> "OBSERVED_HIT_RATE".
func columnHeader(path string) string { return strings.ToUpper(path) }

// flatten lists the scalars of a JSON object by dotted path, in document order. Arrays are left out:
// a table cell has no room for a list. Empty input gives no fields.
func flatten(raw json.RawMessage) (fields, error) {
	if len(bytes.TrimSpace(raw)) == 0 {
		return nil, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var out fields
	var walk func(path string) error
	walk = func(path string) error {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		delim, ok := tok.(json.Delim)
		if !ok {
			if path != "" {
				out = append(out, field{path, tok})
			}
			return nil
		}
		switch delim {
		case '{':
			for dec.More() {
				key, err := dec.Token()
				if err != nil {
					return err
				}
				name, _ := key.(string)
				if path != "" {
					name = path + "." + name
				}
				if err := walk(name); err != nil {
					return err
				}
			}
		case '[':
			for dec.More() {
				var skip json.RawMessage
				if err := dec.Decode(&skip); err != nil {
					return err
				}
			}
		default:
			return errors.New("unexpected " + delim.String())
		}
		_, err = dec.Token() // the closing delimiter
		return err
	}
	return out, walk("")
}

// number returns a numeric field as a float64.
func number(fs fields, path string) (float64, bool) {
	v, ok := fs.get(path)
	if !ok {
		return 0, false
	}
	n, ok := v.(json.Number)
	if !ok {
		return 0, false
	}
	f, err := n.Float64()
	return f, err == nil
}

// formatValue renders a scalar for a cell: numbers compactly, booleans as yes/no, null as nothing.
func formatValue(v any) string {
	switch v := v.(type) {
	case json.Number:
		f, err := v.Float64()
		if err != nil {
			return v.String()
		}
		return formatFloat(f)
	case bool:
		if v {
			return "yes"
		}
		return "no"
	case string:
		return v
	case nil:
		return ""
	default:
		return fmt.Sprint(v)
	}
}

// formatFloat renders whole numbers without decimals and others with three significant decimals at
// most: 4219, 0.823, 12.5.
func formatFloat(f float64) string {
	if f == math.Trunc(f) && math.Abs(f) < 1e15 {
		return strconv.FormatInt(int64(f), 10)
	}
	prec := 3
	if a := math.Abs(f); a >= 100 {
		prec = 0
	} else if a >= 10 {
		prec = 1
	} else if a >= 1 {
		prec = 2
	}
	s := strconv.FormatFloat(f, 'f', prec, 64)
	if strings.Contains(s, ".") {
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	return s
}

// formatSeconds renders a duration in seconds: "0s", "42ms", "3.4s", "12s", "3m5s".
func formatSeconds(s float64) string {
	switch {
	case s == 0:
		return "0s"
	case s < 1:
		return strconv.FormatFloat(1000*s, 'f', 0, 64) + "ms"
	case s < 10:
		return strconv.FormatFloat(s, 'f', 1, 64) + "s"
	case s < 60:
		return strconv.FormatFloat(s, 'f', 0, 64) + "s"
	case s < 3600:
		m := int(s) / 60
		return fmt.Sprintf("%dm%ds", m, int(s)-60*m)
	default:
		h := int(s) / 3600
		return fmt.Sprintf("%dh%dm", h, (int(s)-3600*h)/60)
	}
}
