package caddyllm

import (
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/dustin/go-humanize"

	"github.com/tokenrouter/caddy-llm/selection"
)

// The Caddyfile blocks of this plugin and their options: the one list the unmarshalers' errors read,
// to suggest the nearest option name for a typo, to say which block an option of another block belongs
// in, and to check enumerated values while parsing (not only when the config runs). A new option is a
// case in its unmarshaler and its name here; an option missing here still parses, only its typos get
// poorer messages.
const (
	policyBlock = iota
	metricsBlock
	availabilityBlock
	matcherBlock
)

var caddyfileBlocks = [...]struct {
	name    string              // where the block is, as errors say it
	options []string            // its options
	enums   map[string][]string // the values an option may take, for options with a fixed set
}{
	policyBlock: {
		name: "lb_policy llm { }",
		options: []string{"mode", "tokenizer", "max_body_size", "max_message_size", "max_tokenize_size",
			"output_tokens", "conversation_header", "block_size", "route_capacity", "route_ttl",
			"guard_factor", "guard_slack", "guard_request_slack", "prefill_weight", "capacity",
			"saturation_backoff", "lora_load_time", "metrics", "fallback", "persist", "share", "availability", "tenant_header"},
		enums: map[string][]string{"mode": modeNames(), "tokenizer": tokenizerNames},
	},
	metricsBlock: {
		name: "the metrics { } block of lb_policy llm",
		options: []string{"scheme", "port", "path", "interval", "timeout", "stale_after", "model", "header",
			"request_tokens", "kv_threshold", "kv_weight"},
		enums: map[string][]string{"scheme": {"http", "https"}},
	},
	availabilityBlock: {
		name:    "the availability { } block of lb_policy llm",
		options: []string{"preference", "interval", "error_weight", "kp", "ki", "kd"},
	},
	matcherBlock: {
		name:    "the llm matcher (@name llm { })",
		options: []string{"model", "min_tokens", "max_tokens", "stream", "api", "tokenizer", "max_body_size"},
		enums: map[string][]string{"api": {"chat", "completions", "responses", "embeddings"}, "tokenizer": tokenizerNames,
			"stream": {"true", "false"}},
	},
}

// tokenizerNames are the encodings tokenize.ValidEncoding accepts.
var tokenizerNames = []string{"cl100k_base", "o200k_base", "approx"}

// modeNames are the policy's modes, as package selection names them.
func modeNames() []string {
	var names []string
	for m := selection.Mode(0); m.String() != "unknown"; m++ {
		names = append(names, m.String())
	}
	return names
}

// unrecognizedOption is the error for an option block does not have: where the option belongs when
// another block has it, else the block's nearest option name when one is close, else the block's options.
func unrecognizedOption(d *caddyfile.Dispenser, block int, option string) error {
	b := caddyfileBlocks[block]
	for i, other := range caddyfileBlocks {
		if i != block && slices.Contains(other.options, option) {
			return d.Errf("option '%s' belongs in %s, not in %s", option, other.name, b.name)
		}
	}
	if near := nearest(option, b.options); near != "" {
		return d.Errf("unrecognized option '%s' in %s (did you mean '%s'?)", option, b.name, near)
	}
	for i, other := range caddyfileBlocks {
		if near := nearest(option, other.options); i != block && near != "" {
			return d.Errf("unrecognized option '%s' in %s (did you mean '%s', an option of %s?)", option, b.name, near, other.name)
		}
	}
	return d.Errf("unrecognized option '%s' in %s (its options: %s)", option, b.name, strings.Join(b.options, ", "))
}

// unknownOr returns the unrecognized-option error when option is not one of block's, else err (an
// argument error of a known option).
func unknownOr(d *caddyfile.Dispenser, block int, option string, err error) error {
	if !slices.Contains(caddyfileBlocks[block].options, option) {
		return unrecognizedOption(d, block, option)
	}
	return err
}

// checkEnum returns an error when option of block has a fixed set of values and val is not one of them.
func checkEnum(d *caddyfile.Dispenser, block int, option, val string) error {
	allowed, ok := caddyfileBlocks[block].enums[option]
	if !ok || slices.Contains(allowed, val) {
		return nil
	}
	msg := fmt.Sprintf("%s must be %s, got '%s'", option, oneOf(allowed), val)
	if near := nearest(val, allowed); near != "" {
		msg += fmt.Sprintf(" (did you mean '%s'?)", near)
	}
	return d.Err(msg)
}

// oneOf says "a, b or c".
func oneOf(names []string) string {
	if len(names) == 1 {
		return names[0]
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// nearest returns the name closest to s by edit distance, if it is close enough to be a typo of it
// (at most a third of s's length, and at least one edit, away), else "".
func nearest(s string, names []string) string {
	best, bestDist := "", max(1, len(s)/3)+1
	for _, name := range names {
		if d := editDistance(s, name); d < bestDist {
			best, bestDist = name, d
		}
	}
	return best
}

// editDistance is the edit distance between a and b in bytes, counting an insertion, a deletion, a
// substitution or a swap of two adjacent bytes as one edit (Levenshtein with transpositions: "modle" is
// one edit from "model"). O(len(a)*len(b)) time, O(len(b)) memory.
func editDistance(a, b string) int {
	before := make([]int, len(b)+1) // row i-2
	prev := make([]int, len(b)+1)   // row i-1
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], before[j-2]+1)
			}
		}
		before, prev, cur = prev, cur, before
	}
	return prev[len(b)]
}

// UnmarshalCaddyfile sets up the policy from Caddyfile tokens. Syntax:
//
//	lb_policy llm {
//		mode                <combined|least_tokens|prefix>
//		tokenizer           <cl100k_base|o200k_base|approx>
//		max_body_size       <size>
//		max_message_size    <size>
//		max_tokenize_size   <size>
//		output_tokens       <n>
//		conversation_header <field>
//		block_size          <tokens>
//		route_capacity      <n>
//		route_ttl           <duration>
//		capacity            <dial> <relative speed>
//		saturation_backoff  <duration>
//		lora_load_time      <duration>
//		metrics off
//		metrics {
//			scheme         <http|https>
//			port           <port>
//			path           <path>
//			interval       <duration>
//			timeout        <duration>
//			stale_after    <duration>
//			model          <model_name>
//			header         <field> <value>
//		}
//		availability off
//		availability {
//			interval     <duration>
//			error_weight <n>
//			kp           <gain>
//			ki           <gain>
//			kd           <gain>
//			preference   <dial...>
//		}
//		tenant_header       <field>
//		fallback            <policy> [<args...>] [{ ... }]
//		persist             [<interval>] {
//			key <name>
//		}
//		share               <redis-url> {
//			prefix         <key prefix>
//			flush_interval <duration>
//			max_batch      <changes>
//		}
//	}
//
// capacity may be repeated, once per upstream. Metrics are scraped by default (every upstream's /metrics
// on its own port); "metrics off" turns that off. The old options guard_factor, guard_slack,
// guard_request_slack, prefill_weight and the metrics block's request_tokens, kv_threshold and kv_weight
// are still accepted and ignored.
func (s *LLMSelection) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume policy name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		option := d.Val()
		switch option {
		case "fallback":
			if !d.NextArg() {
				return d.ArgErr()
			}
			if s.FallbackRaw != nil {
				return d.Err("fallback selection policy already specified")
			}
			mod, err := loadFallbackPolicy(d)
			if err != nil {
				return err
			}
			s.FallbackRaw = mod
			continue
		case "metrics":
			if s.Metrics != nil {
				return d.Err("metrics already specified")
			}
			s.Metrics = new(MetricsConfig)
			if d.NextArg() {
				if d.Val() != "off" || d.NextArg() {
					return d.Errf("metrics takes no argument but 'off', got '%s'", d.Val())
				}
				s.Metrics.Off = true
				continue
			}
			if err := s.Metrics.unmarshalCaddyfile(d); err != nil {
				return err
			}
			continue
		case "persist":
			if err := s.parsePersist(d); err != nil {
				return err
			}
			continue
		case "share":
			if err := s.parseShare(d); err != nil {
				return err
			}
			continue
		case "availability":
			if s.Availability != nil {
				return d.Err("availability already specified")
			}
			s.Availability = new(AvailabilityConfig)
			if d.NextArg() {
				if d.Val() != "off" || d.NextArg() {
					return d.Errf("availability takes no argument but 'off', got '%s'", d.Val())
				}
				s.Availability.Off = true
				continue
			}
			if err := s.Availability.unmarshalCaddyfile(d); err != nil {
				return err
			}
			continue
		case "capacity":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.ArgErr()
			}
			c, err := strconv.ParseFloat(args[1], 64)
			if err != nil || c <= 0 {
				return d.Errf("capacity must be a positive number, got '%s'", args[1])
			}
			if s.Capacities == nil {
				s.Capacities = make(map[string]float64)
			}
			s.Capacities[args[0]] = c
			continue
		}
		val, err := oneArg(d)
		if err != nil {
			return unknownOr(d, policyBlock, option, err)
		}
		if err := checkEnum(d, policyBlock, option, val); err != nil {
			return err
		}
		switch option {
		case "mode":
			s.Mode = val
		case "tokenizer":
			s.Tokenizer = val
		case "max_body_size":
			s.MaxBodyBytes, err = parseSize(d, option, val)
		case "max_message_size":
			var n int64
			n, err = parseSize(d, option, val)
			s.MaxMessageBytes = int(n)
		case "max_tokenize_size":
			var n int64
			n, err = parseSize(d, option, val)
			s.MaxTokenizeBytes = int(n)
		case "output_tokens":
			s.OutputTokens, err = parseCount(d, option, val)
		case "conversation_header":
			s.ConversationHeader = val
		case "tenant_header":
			s.TenantHeader = val
		case "block_size":
			s.BlockSize, err = parseCount(d, option, val)
		case "route_capacity":
			s.RouteCapacity, err = parseCount(d, option, val)
		case "route_ttl":
			s.RouteTTL, err = parseDuration(d, option, val)
		case "saturation_backoff":
			s.SaturationBackoff, err = parseDuration(d, option, val)
		case "lora_load_time":
			s.LoRALoadTime, err = parseDuration(d, option, val)
		case "guard_factor":
			s.GuardFactor, err = strconv.ParseFloat(val, 64)
			if err != nil || s.GuardFactor <= 0 {
				return d.Errf("guard_factor must be a positive number, got '%s'", val)
			}
		case "prefill_weight":
			s.PrefillWeight, err = strconv.ParseFloat(val, 64)
			if err != nil || s.PrefillWeight <= 0 {
				return d.Errf("prefill_weight must be a positive number, got '%s'", val)
			}
		case "guard_slack":
			var n int
			n, err = parseCount(d, option, val)
			s.GuardSlack = int64(n)
		case "guard_request_slack":
			var n int
			n, err = parseCount(d, option, val)
			s.GuardRequestSlack = int64(n)
		default:
			return unrecognizedOption(d, policyBlock, option)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the matcher from Caddyfile tokens. Syntax:
//
//	@name llm {
//		model         <glob...>
//		min_tokens    <n>
//		max_tokens    <n>
//		stream        <true|false>
//		api           <chat|completions...>
//		tokenizer     <cl100k_base|o200k_base|approx>
//		max_body_size <size>
//	}
func (m *MatchLLM) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	for d.Next() { // a matcher may be used more than once in a set: the uses are concatenated
		if d.NextArg() {
			return d.ArgErr()
		}
		for d.NextBlock(0) {
			option := d.Val()
			args := d.RemainingArgs()
			if len(args) == 0 {
				return unknownOr(d, matcherBlock, option, d.ArgErr())
			}
			for _, arg := range args {
				if err := checkEnum(d, matcherBlock, option, arg); err != nil {
					return err
				}
			}
			switch option {
			case "model":
				m.Models = append(m.Models, args...)
				continue
			case "api":
				m.APIs = append(m.APIs, args...)
				continue
			}
			if len(args) != 1 {
				return d.ArgErr()
			}
			val := args[0]
			var err error
			switch option {
			case "min_tokens":
				m.MinTokens, err = parseCount(d, option, val)
			case "max_tokens":
				m.MaxTokens, err = parseCount(d, option, val)
			case "stream":
				b, perr := strconv.ParseBool(val)
				if perr != nil {
					return d.Errf("stream must be true or false, got '%s'", val)
				}
				m.Stream = &b
			case "tokenizer":
				m.Tokenizer = val
			case "max_body_size":
				m.MaxBodyBytes, err = parseSize(d, option, val)
			default:
				return unrecognizedOption(d, matcherBlock, option)
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the error responder from Caddyfile tokens. Syntax:
//
//	llm_errors
func (*LLMErrors) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	if d.NextBlock(0) {
		return d.Err("llm_errors takes no options")
	}
	return nil
}

func parseLLMErrors(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	e := new(LLMErrors)
	return e, e.UnmarshalCaddyfile(h.Dispenser)
}

func (m *MetricsConfig) unmarshalCaddyfile(d *caddyfile.Dispenser) error {
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		option := d.Val()
		if option == "header" {
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.Err("header takes a field name and a value: header <field> <value>")
			}
			if m.Headers == nil {
				m.Headers = make(http.Header)
			}
			m.Headers.Add(args[0], args[1])
			continue
		}
		val, err := oneArg(d)
		if err != nil {
			return unknownOr(d, metricsBlock, option, err)
		}
		if err := checkEnum(d, metricsBlock, option, val); err != nil {
			return err
		}
		switch option {
		case "scheme":
			m.Scheme = val
		case "port":
			m.Port = val
		case "path":
			m.Path = val
		case "model":
			m.Model = val
		case "interval":
			m.Interval, err = parseDuration(d, option, val)
		case "timeout":
			m.Timeout, err = parseDuration(d, option, val)
		case "stale_after":
			m.StaleAfter, err = parseDuration(d, option, val)
		case "request_tokens":
			var n int
			n, err = parseCount(d, option, val)
			m.RequestTokens = int64(n)
		case "kv_weight":
			var n int
			n, err = parseCount(d, option, val)
			m.KVWeight = int64(n)
		case "kv_threshold":
			m.KVThreshold, err = strconv.ParseFloat(val, 64)
			if err != nil || m.KVThreshold <= 0 || m.KVThreshold >= 1 {
				return d.Errf("kv_threshold must be a number between 0 and 1, got '%s'", val)
			}
		default:
			return unrecognizedOption(d, metricsBlock, option)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (c *AvailabilityConfig) unmarshalCaddyfile(d *caddyfile.Dispenser) error {
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		option := d.Val()
		if option == "preference" {
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			c.Preference = append(c.Preference, args...)
			continue
		}
		val, err := oneArg(d)
		if err != nil {
			return err
		}
		switch option {
		case "interval":
			c.Interval, err = parseDuration(d, option, val)
		case "error_weight":
			c.ErrorWeight, err = strconv.ParseFloat(val, 64)
			if err != nil || c.ErrorWeight <= 0 {
				return d.Errf("error_weight must be a positive number, got '%s'", val)
			}
		case "kp", "ki", "kd":
			g, perr := strconv.ParseFloat(val, 64)
			if perr != nil || g < 0 {
				return d.Errf("%s must be a number of at least 0, got '%s'", option, val)
			}
			switch option {
			case "kp":
				c.Kp = &g
			case "ki":
				c.Ki = &g
			default:
				c.Kd = &g
			}
		default:
			return d.Errf("unrecognized availability option '%s'", option)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// oneArg returns the single argument of the current option.
func oneArg(d *caddyfile.Dispenser) (string, error) {
	if !d.NextArg() {
		return "", d.ArgErr()
	}
	val := d.Val()
	if d.NextArg() {
		return "", d.ArgErr()
	}
	return val, nil
}

// parseDuration parses a duration such as 10m or 1d.
func parseDuration(d *caddyfile.Dispenser, option, val string) (caddy.Duration, error) {
	dur, err := caddy.ParseDuration(val)
	if err != nil || dur <= 0 {
		return 0, d.Errf("%s must be a positive duration such as 10m, got '%s'", option, val)
	}
	return caddy.Duration(dur), nil
}

// parseSize parses a size such as 4MiB or 512KB.
func parseSize(d *caddyfile.Dispenser, option, val string) (int64, error) {
	size, err := humanize.ParseBytes(val)
	if err != nil || size == 0 || size > 1<<40 {
		return 0, d.Errf("%s must be a size such as 4MiB, got '%s'", option, val)
	}
	return int64(size), nil
}

// parseCount parses a positive whole number.
func parseCount(d *caddyfile.Dispenser, option, val string) (int, error) {
	n, err := strconv.Atoi(val)
	if err != nil || n <= 0 {
		return 0, d.Errf("%s must be a positive whole number, got '%s'", option, val)
	}
	return n, nil
}

// loadFallbackPolicy reads a nested selection policy, as reverse_proxy's own policies do (its version is
// unexported).
func loadFallbackPolicy(d *caddyfile.Dispenser) ([]byte, error) {
	name := d.Val()
	modID := "http.reverse_proxy.selection_policies." + name
	unm, err := caddyfile.UnmarshalModule(d, modID)
	if err != nil {
		return nil, err
	}
	sel, ok := unm.(reverseproxy.Selector)
	if !ok {
		return nil, d.Errf("module %s (%T) is not a reverseproxy.Selector", modID, unm)
	}
	return caddyconfig.JSONModuleObject(sel, "policy", name, nil), nil
}

// UnmarshalCaddyfile sets up the transport from Caddyfile tokens. Syntax:
//
//	transport llm {
//		<any option of transport http>
//	}
func (t *LLMTransport) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return t.HTTPTransport.UnmarshalCaddyfile(d)
}

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*LLMSelection)(nil)
	_ caddyfile.Unmarshaler = (*MatchLLM)(nil)
	_ caddyfile.Unmarshaler = (*LLMErrors)(nil)
	_ caddyfile.Unmarshaler = (*LLMTransport)(nil)
)
