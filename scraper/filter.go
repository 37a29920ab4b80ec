package scraper

import "bytes"

// readFamilies is every metric family Parse reads, by the names the extract functions look up. A
// histogram among them is read by its _count and _sum series only.
var readFamilies = func() map[string]bool {
	set := make(map[string]bool)
	for _, names := range [][]string{
		vllmRunning, vllmWaiting, vllmKV, vllmPrefixHits, vllmPrefixQueries, vllmGenerated, vllmSteps, vllmPrefilled,
		{vllmRequestPrompt, vllmLoRAInfo, vllmCacheConfig, vllmFirstToken, vllmPrefillTime, vllmPrefillKV},
		sglangRunning, sglangWaiting, sglangKV, sglangGenerated, sglangFinished, sglangPrompt,
		{sglangCacheConfig, sglangPageSize, sglangFirstToken}, sglangNumPages, sglangPoolTokens,
		llamacppRunning, llamacppWaiting, llamacppKV, llamacppGenerated, llamacppPrefilled, llamacppSteps,
		nimRunning, nimWaiting, nimKV, nimGenerated, {nimRequestPrompt}, nimMaxRunning,
		tgiRunning, tgiWaiting, tgiSteps, {tgiGenerated},
		{processStartTime},
	} {
		for _, name := range names {
			set[name] = true
		}
	}
	return set
}()

// filterText removes from text, in place, the lines that cannot change what Parse extracts, and returns
// the rest: the samples and HELP/TYPE lines of families it does not read, the _bucket series of the
// histograms it does (it reads their counts and sums), plain comments and blank lines. A vLLM page is
// mostly histogram buckets and families no router reads (latency histograms, per-finish-reason
// counters, Python's gc and process figures), and the text parser costs about a microsecond a line
// and allocates for every label it reads. Any line it cannot classify as one of those (a name it
// cannot read, UTF-8 quoted names, HTML, JSON, binary) is kept, so that text which is not Prometheus
// exposition still fails to parse; what the filter forgives is a malformed line in a family Parse does
// not read.
func filterText(text []byte) []byte {
	w := 0
	for r := 0; r < len(text); {
		end := bytes.IndexByte(text[r:], '\n')
		next := len(text)
		if end >= 0 {
			next = r + end + 1
		}
		if keepLine(text[r:next]) {
			w += copy(text[w:], text[r:next]) // w <= r: the copy moves the line down, never over unread text
		}
		r = next
	}
	return text[:w]
}

// keepLine reports whether a line of exposition text (with its newline, if any) is kept by filterText.
func keepLine(line []byte) bool {
	line = bytes.TrimLeft(bytes.TrimRight(line, "\n"), " \t")
	if len(line) == 0 {
		return false
	}
	if line[0] == '#' {
		// "# HELP name ..." or "# TYPE name ...": kept for a family read; other comments the parser skips.
		keyword, rest := blankToken(bytes.TrimLeft(line[1:], " \t"))
		if string(keyword) != "HELP" && string(keyword) != "TYPE" {
			return false
		}
		name, ok := metricName(bytes.TrimLeft(rest, " \t"))
		return !ok || readFamilies[string(name)]
	}
	name, ok := metricName(line)
	if !ok || readFamilies[string(name)] {
		return true
	}
	for _, suffix := range [...][]byte{[]byte("_count"), []byte("_sum")} {
		if base, found := bytes.CutSuffix(name, suffix); found && readFamilies[string(base)] {
			return true
		}
	}
	return false
}

// blankToken splits b at its first blank or tab.
func blankToken(b []byte) (token, rest []byte) {
	i := bytes.IndexAny(b, " \t")
	if i < 0 {
		return b, nil
	}
	return b[:i], b[i:]
}

// metricName reads the classic metric name ([a-zA-Z_:][a-zA-Z0-9_:]*) that b starts with; ok only when
// a label set, a blank, a tab or the end of b follows it, the shapes whose family is certain.
func metricName(b []byte) (name []byte, ok bool) {
	i := 0
	for i < len(b) && (b[i] >= 'a' && b[i] <= 'z' || b[i] >= 'A' && b[i] <= 'Z' || b[i] == '_' || b[i] == ':' || i > 0 && b[i] >= '0' && b[i] <= '9') {
		i++
	}
	if i == 0 || i < len(b) && b[i] != '{' && b[i] != ' ' && b[i] != '\t' {
		return nil, false
	}
	return b[:i], true
}
