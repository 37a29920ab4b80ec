package scraper

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	prommodel "github.com/prometheus/common/model"
)

// Flavors reported in Snapshot.Flavor.
const (
	FlavorVLLM     = "vllm"
	FlavorSGLang   = "sglang"
	FlavorLlamaCpp = "llamacpp"
	FlavorNIM      = "nim"
	FlavorTGI      = "tgi"
)

// ErrNoMetrics is returned by Parse (wrapped) when the text parsed but carries none of the load
// gauges it knows (running, waiting, KV usage), for instance because the model filter excluded every
// series or the target is not a server it knows (vLLM, SGLang, llama.cpp, NVIDIA NIM, TGI).
var ErrNoMetrics = errors.New("no known load metrics")

// Snapshot is the last good scrape of one target. It is a plain value, safe to copy.
type Snapshot struct {
	// Running and Waiting count requests, summed over all matching series (vLLM data-parallel
	// engines, SGLang data-parallel ranks).
	Running, Waiting float64
	// KVUsage is the KV-cache usage in [0, 1]: vllm:kv_cache_usage_perc, or the legacy
	// vllm:gpu_cache_usage_perc, or sglang:token_usage. It is the mean over engines (a ratio does not
	// add up), clamped to [0, 1].
	KVUsage float64
	// KVReported says the target reports its KV-cache usage; llama.cpp's builds since 2025 do not, and
	// their KVUsage is 0 for unknown, not for empty.
	KVReported bool
	// PrefixHits and PrefixQueries are the vLLM prefix-cache counters in tokens
	// (vllm:prefix_cache_{hits,queries}_total or the older vllm:gpu_prefix_cache_*), summed over
	// engines. Zero for SGLang. See HitRate for a ratio between two snapshots.
	PrefixHits, PrefixQueries float64
	// PrefilledTokens is the prompt tokens the target computed, not those its cache answered, for a
	// target without prefix-cache counters that counts them: llama.cpp's prompt_tokens_total (a prompt's
	// evaluated tokens, added when its prefill ends). Zero when absent; for vLLM, PrefixQueries less
	// PrefixHits is the same figure.
	PrefilledTokens float64
	// GenerationTokens is the output tokens the target has generated (vllm:generation_tokens_total,
	// sglang:generation_tokens_total; TGI counts a request's as it finishes), summed over engines; zero
	// when absent. With the prefix-cache
	// counters it tells how much prefill and decode work the target did between two snapshots.
	GenerationTokens float64
	// Steps is how many engine steps the target has run: the count of vLLM's vllm:iteration_tokens_total
	// histogram (one observation a step), llama.cpp's llama_decode() calls or TGI's forward passes
	// (prefill and decode), summed over engines; zero when absent.
	Steps float64
	// FinishedRequests and FinishedPrompt are how many requests the target has finished and their prompt
	// tokens, in the backend's tokenizer: the count and the sum of vLLM's vllm:request_prompt_tokens
	// histogram, or SGLang's sglang:num_requests_total and sglang:prompt_tokens_total counters (both
	// counted as a request finishes), summed over engines; zero when absent (vLLM before the histogram,
	// SGLang before the request counter) or when a series is not a finite number. Against the prompts of
	// the requests this proxy saw end there, they tell how many of the backend's tokens one of this
	// proxy's count is.
	FinishedRequests, FinishedPrompt float64
	// PrefilledPrompt is the prompt tokens of the requests whose prefill the target has completed, in the
	// backend's tokens: vLLM's vllm:prompt_tokens_total, which its v1 engine counts a request's whole
	// prompt into at the request's first token. Less FinishedPrompt, it is the prompt tokens of the
	// requests decoding there at the scrape. Zero when absent, and for SGLang, whose
	// sglang:prompt_tokens_total counts a prompt when its request finishes (FinishedPrompt).
	PrefilledPrompt float64
	// BlockSize is the KV block (vLLM) or page (SGLang) size in tokens and NumBlocks the number of
	// blocks summed over engines, from the labels of vllm:cache_config_info
	// {block_size,num_gpu_blocks} or sglang:cache_config_info{page_size,num_pages} (SGLang's
	// sglang:page_size and sglang:num_pages gauges are accepted too, and its
	// sglang:max_total_num_tokens, the pool in tokens). Zero when unknown.
	// BlockSize*NumBlocks is the target's KV capacity in tokens.
	BlockSize, NumBlocks int
	// Model is the model_name label of the load series (vLLM serves one base model, under its first
	// served name); "" when they carry none or disagree.
	Model string
	// LoRA is the adapter residency vLLM reports in vllm:lora_requests_info; its zero value (MaxLoRA 0)
	// when the target does not report it (LoRA disabled, SGLang, older versions).
	LoRA LoRA
	// MaxRunning is the most requests the target runs at once, as it reports it itself (NVIDIA NIM's
	// num_request_max, summed over the matching series); zero when it does not. The others' slot counts
	// are learned from their running and waiting counts.
	MaxRunning float64
	// StartTime is the backend process's start (process_start_time_seconds, Unix seconds, the largest
	// if several processes report one); zero when absent. A change means the backend restarted, and
	// with it its KV cache is empty and its counters start again from zero.
	StartTime float64
	// Flavor is FlavorVLLM, FlavorSGLang, FlavorLlamaCpp (llama.cpp's llama-server, started with
	// --metrics), FlavorNIM (NVIDIA NIM for LLMs, at /v1/metrics) or FlavorTGI (Hugging Face's
	// text-generation-inference). A text carrying several families is read as the first of these.
	Flavor string
	// FirstTokens and FirstTokenSeconds are how many requests the target has sampled a first token for
	// and their times to first token summed, in seconds from their arrival at the engine (its queue
	// included): the count and sum of vLLM's vllm:time_to_first_token_seconds histogram or SGLang's
	// sglang:time_to_first_token_seconds, both observed as each first token is sampled, summed over
	// engines; zeros when absent. Between two snapshots they give the mean time to first token of the
	// requests that got one, as the backend measured it.
	FirstTokens, FirstTokenSeconds float64
	// PrefillRequests, PrefillSeconds and PrefillComputed are how many requests the target has finished
	// and, summed, their times from first being scheduled to their first token and the prompt tokens
	// their prefill computed (prefix-cache hits not counted): the counts and sums of vLLM's
	// vllm:request_prefill_time_seconds and vllm:request_prefill_kv_computed_tokens histograms, both
	// observed as each request finishes, summed over engines. Their growth between two snapshots is the
	// engine's own prefill speed, whatever else it was doing; a request prefilled in the steps of others
	// counts their time too, so it errs slow. Zeros when either is absent or their counts differ.
	PrefillRequests, PrefillSeconds, PrefillComputed float64
	// At is when the scrape that produced this snapshot started (Parse leaves it zero).
	At time.Time
}

// metric names, newest first where a signal was renamed.
var (
	vllmRunning       = []string{"vllm:num_requests_running"}
	vllmWaiting       = []string{"vllm:num_requests_waiting"}
	vllmKV            = []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}
	vllmPrefixHits    = []string{"vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits"}
	vllmPrefixQueries = []string{"vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries"}
	sglangRunning     = []string{"sglang:num_running_reqs"}
	sglangWaiting     = []string{"sglang:num_queue_reqs"}
	sglangKV          = []string{"sglang:token_usage"}
	vllmLoRAInfo      = "vllm:lora_requests_info"
	vllmGenerated     = []string{"vllm:generation_tokens_total", "vllm:generation_tokens"}
	vllmSteps         = []string{"vllm:iteration_tokens_total"}
	vllmRequestPrompt = "vllm:request_prompt_tokens"
	vllmPrefilled     = []string{"vllm:prompt_tokens_total", "vllm:prompt_tokens"}
	vllmCacheConfig   = "vllm:cache_config_info"
	vllmFirstToken    = "vllm:time_to_first_token_seconds"
	vllmPrefillTime   = "vllm:request_prefill_time_seconds"
	vllmPrefillKV     = "vllm:request_prefill_kv_computed_tokens"
	sglangFirstToken  = "sglang:time_to_first_token_seconds"
	sglangGenerated   = []string{"sglang:generation_tokens_total", "sglang:generation_tokens"}
	sglangFinished    = []string{"sglang:num_requests_total", "sglang:num_requests"}
	sglangPrompt      = []string{"sglang:prompt_tokens_total", "sglang:prompt_tokens"}
	sglangCacheConfig = "sglang:cache_config_info"
	sglangPageSize    = "sglang:page_size"
	sglangNumPages    = []string{"sglang:num_pages"}
	sglangPoolTokens  = []string{"sglang:max_total_num_tokens"}
	// llama-server: its busy slots, the requests deferred until one frees, the KV-cache ratio (builds of
	// 2024-2025 only), the tokens it generated and its llama_decode() calls (one per batch: a step).
	llamacppRunning   = []string{"llamacpp:requests_processing"}
	llamacppWaiting   = []string{"llamacpp:requests_deferred"}
	llamacppKV        = []string{"llamacpp:kv_cache_usage_ratio"}
	llamacppGenerated = []string{"llamacpp:tokens_predicted_total"}
	llamacppPrefilled = []string{"llamacpp:prompt_tokens_total"}
	llamacppSteps     = []string{"llamacpp:n_decode_total"}
	// NVIDIA NIM for LLMs: vLLM's names without the prefix.
	nimRunning       = []string{"num_requests_running"}
	nimWaiting       = []string{"num_requests_waiting"}
	nimKV            = []string{"gpu_cache_usage_perc"}
	nimGenerated     = []string{"generation_tokens_total"}
	nimRequestPrompt = "request_prompt_tokens"
	nimMaxRunning    = []string{"num_request_max"}
	// Hugging Face text-generation-inference (its router's metrics): the batch running, the queue
	// behind it, its forward passes (one counter per method, prefill and decode: steps), and the tokens
	// each request generated, observed as it finishes.
	tgiRunning   = []string{"tgi_batch_current_size"}
	tgiWaiting   = []string{"tgi_queue_size"}
	tgiSteps     = []string{"tgi_batch_inference_count"}
	tgiGenerated = "tgi_request_generated_tokens"
	// Every server's: the process's start, which tells a restart.
	processStartTime = "process_start_time_seconds"
)

const modelLabel = "model_name"

// Parse reads Prometheus text exposition (format 0.0.4, as served by vLLM's, SGLang's, llama.cpp's,
// NVIDIA NIM's and TGI's metrics endpoints)
// with expfmt's text parser and extracts the load signals into a Snapshot. Metric and label names
// are validated with the UTF-8 scheme, so names with ':' parse. Only the families it reads reach the
// parser (see filterText): a malformed line of another family is no error.
//
// model, when not empty, keeps only series whose model_name label equals it; series without a
// model_name label (such as vllm:cache_config_info) always count. Non-finite samples are ignored.
//
// Parse returns an error wrapping the parser's (or r's) error for malformed input, and one wrapping
// ErrNoMetrics when no running, waiting or KV-usage series matched. It is safe for concurrent use;
// it reads the whole of r into memory, so bound r.
func Parse(r io.Reader, model string) (Snapshot, error) {
	buf := textBuffers.Get().(*bytes.Buffer)
	defer putTextBuffer(buf)
	buf.Reset()
	if _, err := buf.ReadFrom(r); err != nil {
		return Snapshot{}, fmt.Errorf("parsing metrics text: %w", err)
	}
	families, err := parseText(bytes.NewReader(filterText(buf.Bytes())))
	if err != nil {
		return Snapshot{}, fmt.Errorf("parsing metrics text: %w", err)
	}
	return extract(families, model)
}

// textBuffers holds the buffers Parse reads a scrape into; one larger than maxPooledText is dropped
// instead, so that one huge page does not stay in memory.
var textBuffers = sync.Pool{New: func() any { return new(bytes.Buffer) }}

const maxPooledText = 1 << 20

func putTextBuffer(buf *bytes.Buffer) {
	if buf.Cap() <= maxPooledText {
		textBuffers.Put(buf)
	}
}

// extract reads the load signals of the first server flavor whose families are there.
func extract(families map[string]*dto.MetricFamily, model string) (Snapshot, error) {
	var s Snapshot
	if ok := extractVLLM(families, model, &s); ok {
		s.Flavor = FlavorVLLM
	} else if ok := extractSGLang(families, model, &s); ok {
		s.Flavor = FlavorSGLang
	} else if ok := extractLlamaCpp(families, model, &s); ok {
		s.Flavor = FlavorLlamaCpp
	} else if ok := extractNIM(families, model, &s); ok {
		s.Flavor = FlavorNIM
	} else if ok := extractTGI(families, model, &s); ok {
		s.Flavor = FlavorTGI
	} else {
		if model != "" {
			return Snapshot{}, fmt.Errorf("parsing metrics text for model %q: %w", model, ErrNoMetrics)
		}
		return Snapshot{}, fmt.Errorf("parsing metrics text: %w", ErrNoMetrics)
	}
	s.Running = clampCount(s.Running)
	s.Waiting = clampCount(s.Waiting)
	s.PrefixHits = clampCount(s.PrefixHits)
	s.PrefixQueries = clampCount(s.PrefixQueries)
	s.GenerationTokens = clampCount(s.GenerationTokens)
	s.PrefilledTokens = clampCount(s.PrefilledTokens)
	s.Steps = clampCount(s.Steps)
	s.FinishedRequests = clampCount(s.FinishedRequests)
	s.FinishedPrompt = clampCount(s.FinishedPrompt)
	s.PrefilledPrompt = clampCount(s.PrefilledPrompt)
	s.MaxRunning = clampCount(s.MaxRunning)
	s.KVUsage = math.Min(math.Max(s.KVUsage, 0), 1)
	if start, ok := maxValue(families[processStartTime], ""); ok && start > 0 && !math.IsInf(start, 0) {
		s.StartTime = start
	}
	return s, nil
}

// parseText decodes r with expfmt's text parser. Parse is where a scrape target's text enters the
// library: a panic in the parser is a parse error. prometheus/common v0.71.0 panicked on "#HELP x \n{}"
// (a nil dereference in startLabelName, found by FuzzParse, the input kept in testdata/fuzz); v0.73.1
// returns an error for it, and the recover stays for the next such input.
func parseText(r io.Reader) (families map[string]*dto.MetricFamily, err error) {
	defer func() {
		if v := recover(); v != nil {
			families, err = nil, fmt.Errorf("the text parser failed on malformed input: %v", v)
		}
	}()
	p := expfmt.NewTextParser(prommodel.UTF8Validation)
	return p.TextToMetricFamilies(r)
}

func extractVLLM(families map[string]*dto.MetricFamily, model string, s *Snapshot) bool {
	running, okR := sum(families, vllmRunning, model)
	waiting, okW := sum(families, vllmWaiting, model)
	kv, okK := mean(families, vllmKV, model)
	if !okR && !okW && !okK {
		return false
	}
	s.Running, s.Waiting, s.KVUsage, s.KVReported = running, waiting, kv, okK
	s.PrefixHits, _ = sum(families, vllmPrefixHits, model)
	s.PrefixQueries, _ = sum(families, vllmPrefixQueries, model)
	s.GenerationTokens, _ = sum(families, vllmGenerated, model)
	s.Steps, _ = sum(families, vllmSteps, model)
	s.FinishedRequests, s.FinishedPrompt = histogramTotals(families[vllmRequestPrompt], model)
	s.FirstTokens, s.FirstTokenSeconds = histogramTotals(families[vllmFirstToken], model)
	if n, secs := histogramTotals(families[vllmPrefillTime], model); n > 0 {
		if m, tokens := histogramTotals(families[vllmPrefillKV], model); m == n {
			s.PrefillRequests, s.PrefillSeconds, s.PrefillComputed = n, secs, tokens
		}
	}
	s.PrefilledPrompt, _ = sum(families, vllmPrefilled, model)
	s.BlockSize, s.NumBlocks = geometryFromLabels(families[vllmCacheConfig], model, "block_size", "num_gpu_blocks")
	s.Model = modelName(families, vllmRunning[0], model)
	s.LoRA = loraFromLabels(families[vllmLoRAInfo], model)
	return true
}

// extractLlamaCpp reads llama.cpp's llama-server. It serves one model and labels no series with it, so a
// model filter keeps them all; its prompt counter counts the tokens it evaluated (PrefilledTokens), with
// no count of those its prompt cache answered, so there are no prefix-cache counters to check
// predictions against.
func extractLlamaCpp(families map[string]*dto.MetricFamily, model string, s *Snapshot) bool {
	running, okR := sum(families, llamacppRunning, model)
	waiting, okW := sum(families, llamacppWaiting, model)
	if !okR && !okW {
		return false
	}
	s.Running, s.Waiting = running, waiting
	s.KVUsage, s.KVReported = mean(families, llamacppKV, model)
	s.GenerationTokens, _ = sum(families, llamacppGenerated, model)
	s.PrefilledTokens, _ = sum(families, llamacppPrefilled, model)
	s.Steps, _ = sum(families, llamacppSteps, model)
	return true
}

// extractNIM reads NVIDIA NIM for LLMs: its running and waiting requests, KV-cache usage, generated
// tokens and finished prompts under vLLM's names without the "vllm:" prefix, and the slot count it
// reports (num_request_max). It reports no prefix-cache counters.
func extractNIM(families map[string]*dto.MetricFamily, model string, s *Snapshot) bool {
	running, okR := sum(families, nimRunning, model)
	waiting, okW := sum(families, nimWaiting, model)
	if !okR || !okW {
		return false // both, as NIM serves them: one alone is too generic a name to go by
	}
	s.Running, s.Waiting = running, waiting
	s.KVUsage, s.KVReported = mean(families, nimKV, model)
	s.GenerationTokens, _ = sum(families, nimGenerated, model)
	s.FinishedRequests, s.FinishedPrompt = histogramTotals(families[nimRequestPrompt], model)
	s.MaxRunning, _ = sum(families, nimMaxRunning, model)
	s.Model = modelName(families, nimRunning[0], model)
	return true
}

// extractTGI reads Hugging Face's text-generation-inference. It serves one model and labels no series
// with it, so a model filter keeps them all; it reports neither its KV-cache usage nor prefix-cache
// counters.
func extractTGI(families map[string]*dto.MetricFamily, model string, s *Snapshot) bool {
	running, okR := sum(families, tgiRunning, model)
	waiting, okW := sum(families, tgiWaiting, model)
	if !okR && !okW {
		return false
	}
	s.Running, s.Waiting = running, waiting
	s.Steps, _ = sum(families, tgiSteps, model)
	_, s.GenerationTokens = histogramTotals(families[tgiGenerated], model)
	return true
}

func extractSGLang(families map[string]*dto.MetricFamily, model string, s *Snapshot) bool {
	running, okR := sum(families, sglangRunning, model)
	waiting, okW := sum(families, sglangWaiting, model)
	kv, okK := mean(families, sglangKV, model)
	if !okR && !okW && !okK {
		return false
	}
	s.Running, s.Waiting, s.KVUsage, s.KVReported = running, waiting, kv, okK
	s.GenerationTokens, _ = sum(families, sglangGenerated, model)
	s.FirstTokens, s.FirstTokenSeconds = histogramTotals(families[sglangFirstToken], model)
	// SGLang counts a request and its prompt tokens in these two when the request finishes (its tokenizer
	// manager's observe_one_finished_request): what vLLM's prompt histogram counts.
	finished, okF := finiteTotal(families, sglangFinished, model)
	prompt, okP := finiteTotal(families, sglangPrompt, model)
	if okF && okP {
		s.FinishedRequests, s.FinishedPrompt = finished, prompt
	}
	s.BlockSize, s.NumBlocks = geometryFromLabels(families[sglangCacheConfig], model, "page_size", "num_pages")
	if s.BlockSize == 0 || s.NumBlocks == 0 {
		// Newer SGLang versions export the geometry as plain gauges.
		pageSize, okP := maxValue(families[sglangPageSize], model)
		numPages, okN := sum(families, sglangNumPages, model)
		if okP && okN {
			s.BlockSize, s.NumBlocks = toBlocks(pageSize), toBlocks(numPages)
		} else if tokens, ok := sum(families, sglangPoolTokens, model); ok {
			// Or only the pool's size in tokens (a constant it sets at startup): pages of one token,
			// SGLang's default, unless the page size is there too.
			size := 1
			if okP && toBlocks(pageSize) > 0 {
				size = toBlocks(pageSize)
			}
			s.BlockSize, s.NumBlocks = size, toBlocks(tokens/float64(size))
		}
	}
	return true
}

// sum adds the values of every matching series of the first family in names that has one.
func sum(families map[string]*dto.MetricFamily, names []string, model string) (float64, bool) {
	total, n := total(families, names, model)
	return total, n > 0
}

// mean averages the values of every matching series of the first family in names that has one.
func mean(families map[string]*dto.MetricFamily, names []string, model string) (float64, bool) {
	total, n := total(families, names, model)
	if n == 0 {
		return 0, false
	}
	return total / float64(n), true
}

// total adds the values of every matching series of the first family in names that has one, and says
// how many there were (0: none of the families had a matching series).
func total(families map[string]*dto.MetricFamily, names []string, model string) (float64, int) {
	for _, name := range names {
		var total float64
		var n int
		for _, m := range families[name].GetMetric() {
			if v, ok := sampleValue(m, model); ok {
				total += v
				n++
			}
		}
		if n > 0 {
			return total, n
		}
	}
	return 0, 0
}

// finiteTotal adds the values of the matching series of the first family in names that has one; false
// when none matches, or when a matching series is not a finite, non-negative number (a total that left
// one out would not match the count read beside it).
func finiteTotal(families map[string]*dto.MetricFamily, names []string, model string) (float64, bool) {
	for _, name := range names {
		var total float64
		found := false
		for _, m := range families[name].GetMetric() {
			if !matchesModel(m, model) {
				continue
			}
			v, ok := rawValue(m)
			if !ok {
				continue
			}
			if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
				return 0, false
			}
			total += v
			found = true
		}
		if found {
			return total, true
		}
	}
	return 0, false
}

// histogramTotals adds up the sample counts and sums of mf's histogram series that pass the model
// filter; zeros when there are none, or when a sum is not a finite number.
func histogramTotals(mf *dto.MetricFamily, model string) (count, total float64) {
	for _, m := range mf.GetMetric() {
		h := m.GetHistogram()
		if h == nil || !matchesModel(m, model) {
			continue
		}
		v := h.GetSampleSum()
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return 0, 0
		}
		count += float64(h.GetSampleCount())
		total += v
	}
	return count, total
}

func maxValue(mf *dto.MetricFamily, model string) (float64, bool) {
	best, found := 0.0, false
	for _, m := range mf.GetMetric() {
		if v, ok := sampleValue(m, model); ok && (!found || v > best) {
			best, found = v, true
		}
	}
	return best, found
}

// sampleValue returns the value of a gauge, counter or untyped series, or the sample count of a
// histogram, that passes the model filter.
func sampleValue(m *dto.Metric, model string) (float64, bool) {
	if !matchesModel(m, model) {
		return 0, false
	}
	v, ok := rawValue(m)
	if !ok || math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, false
	}
	return v, true
}

// rawValue returns the value of a gauge, counter or untyped series, or the sample count of a histogram;
// false for a series of another type.
func rawValue(m *dto.Metric) (float64, bool) {
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue(), true
	case m.Counter != nil:
		return m.GetCounter().GetValue(), true
	case m.Untyped != nil:
		return m.GetUntyped().GetValue(), true
	case m.Histogram != nil:
		return float64(m.GetHistogram().GetSampleCount()), true
	}
	return 0, false
}

func matchesModel(m *dto.Metric, model string) bool {
	if model == "" {
		return true
	}
	for _, lp := range m.GetLabel() {
		if lp.GetName() == modelLabel {
			return lp.GetValue() == model
		}
	}
	return true
}

// geometryFromLabels reads an info-style gauge: block size from the first series with a valid one,
// block count summed over series (one per engine).
func geometryFromLabels(mf *dto.MetricFamily, model, sizeLabel, countLabel string) (blockSize, numBlocks int) {
	for _, m := range mf.GetMetric() {
		if !matchesModel(m, model) {
			continue
		}
		var size, count int
		for _, lp := range m.GetLabel() {
			switch lp.GetName() {
			case sizeLabel:
				size = parseCount(lp.GetValue())
			case countLabel:
				count = parseCount(lp.GetValue())
			}
		}
		if size > 0 && blockSize == 0 {
			blockSize = size
		}
		numBlocks = int(min(int64(numBlocks)+int64(count), maxBlocks))
	}
	return blockSize, numBlocks
}

// maxBlocks bounds geometry values so that they fit an int everywhere and BlockSize*NumBlocks
// cannot overflow an int64.
const maxBlocks = math.MaxInt32

// parseCount parses a positive integer label value; "None" and garbage give 0.
func parseCount(s string) int {
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		return int(max(0, min(n, maxBlocks)))
	}
	if f, err := strconv.ParseFloat(s, 64); err == nil {
		return toBlocks(f)
	}
	return 0
}

// toBlocks converts a gauge value to a block count in [0, maxBlocks].
func toBlocks(f float64) int {
	if !(f > 0) {
		return 0
	}
	return int(min(f, maxBlocks))
}

// clampCount keeps a summed count finite and non-negative.
func clampCount(v float64) float64 {
	switch {
	case !(v > 0):
		return 0
	case v > math.MaxFloat64:
		return math.MaxFloat64
	}
	return v
}

// HitRate returns the prefix-cache hit ratio between two snapshots of the same target: the growth of
// PrefixHits over the growth of PrefixQueries. ok is false when no query happened in between, when the
// counters went backwards (a restarted server) or when cur is not newer than prev.
func HitRate(prev, cur Snapshot) (rate float64, ok bool) {
	dq := cur.PrefixQueries - prev.PrefixQueries
	dh := cur.PrefixHits - prev.PrefixHits
	if !cur.At.After(prev.At) || !(dq > 0) || dh < 0 {
		return 0, false
	}
	return math.Min(dh/dq, 1), true
}
