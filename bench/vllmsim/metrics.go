package vllmsim

import (
	"bytes"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// serveMetrics writes the engine's gauges and counters in the Prometheus text format, named like the
// configured engine flavour. MetricsDelay (wall-clock, not scaled) and MetricsFail apply first.
func (s *Server) serveMetrics(w http.ResponseWriter, r *http.Request) {
	f := s.faults.Load()
	if f.MetricsDelay > 0 {
		t := time.NewTimer(f.MetricsDelay)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return
		}
	}
	if f.MetricsFail {
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = w.Write([]byte("simulated metrics failure\n"))
		return
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = w.Write(s.metricsText())
}

// metricsText renders the current State in the configured flavour.
func (s *Server) metricsText() []byte {
	st := s.State()
	var b bytes.Buffer
	usage := 0.0
	if st.NumBlocks > 0 {
		usage = float64(st.UsedBlocks) / float64(st.NumBlocks)
	}
	model := `"` + labelEscaper.Replace(s.cfg.Model) + `"`
	metric := func(name, typ, help, labels string, v float64) {
		if labels != "" {
			labels = "{" + labels + "}"
		}
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n%s%s %s\n", name, help, name, typ, name, labels,
			strconv.FormatFloat(v, 'g', -1, 64))
	}
	// histogram writes a histogram with only its +Inf bucket, its sum and its count.
	histogram := func(name, help, labels string, count int64, sum float64) {
		bucket, series := `le="+Inf"`, ""
		if labels != "" {
			bucket, series = labels+","+bucket, "{"+labels+"}"
		}
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s histogram\n%s_bucket{%s} %d\n%s_sum%s %s\n%s_count%s %d\n",
			name, help, name, name, bucket, count, name, series, strconv.FormatFloat(sum, 'f', -1, 64), name, series, count)
	}
	// The counters every flavour exports, read together under one lock.
	s.mu.Lock()
	started := s.started
	promptTotal, outputTotal, finished, finishedPrompt, finishedOutput := s.promptTotal, s.outputTotal, s.finished, s.finishedPrompt, s.finishedOutput
	prefilled := s.prefilled
	firstTokens, firstTokenSeconds := s.firstTokens, s.firstTokenSeconds
	prefillSeconds, computed := s.finishedPrefillSeconds, s.finishedComputed
	s.mu.Unlock()
	if s.cfg.Metrics != MetricsLlamaCpp && s.cfg.Metrics != MetricsTGI {
		// Like prometheus_client's process collector, which vLLM, SGLang and NIM export (llama.cpp's C++
		// server and TGI's Rust router do not).
		fmt.Fprintf(&b, "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds %s\n",
			strconv.FormatFloat(float64(started.UnixNano())/1e9, 'f', -1, 64))
	}
	switch s.cfg.Metrics {
	case MetricsLlamaCpp:
		// Like llama-server: one model, no labels; requests_processing counts busy slots and
		// requests_deferred the tasks waiting for one; n_decode_total counts llama_decode() calls (steps);
		// prompt_tokens_total the prompt tokens evaluated (not those its cache held), added as each
		// prompt's prefill ends.
		metric("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", "", float64(prefilled))
		metric("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.", "", float64(outputTotal))
		metric("llamacpp:n_decode_total", "counter", "Total number of llama_decode() calls", "", float64(st.Steps))
		metric("llamacpp:requests_processing", "gauge", "Number of requests processing", "", float64(st.Running))
		metric("llamacpp:requests_deferred", "gauge", "Number of requests deferred", "", float64(st.Waiting))
	case MetricsTGI:
		// Like TGI's router: one model, no labels; the batch running and the queue behind it, forward
		// passes counted per method (the simulator's steps all as decode), and the tokens each request
		// generated, observed as it finishes.
		metric("tgi_batch_current_size", "gauge", "Current batch size", "", float64(st.Running))
		metric("tgi_queue_size", "gauge", "Current queue size", "", float64(st.Waiting))
		fmt.Fprintf(&b, "# HELP tgi_batch_inference_count Inference calls per method (prefill or decode)\n# TYPE tgi_batch_inference_count counter\n"+
			"tgi_batch_inference_count{method=\"prefill\"} 0\ntgi_batch_inference_count{method=\"decode\"} %d\n", st.Steps)
		histogram("tgi_request_generated_tokens", "Generated tokens per request", "", finished, float64(finishedOutput))
	case MetricsNIM:
		labels := "model_name=" + model
		metric("num_requests_running", "gauge", "Number of requests currently running on GPU.", labels, float64(st.Running))
		metric("num_requests_waiting", "gauge", "Number of requests waiting to be processed.", labels, float64(st.Waiting))
		metric("num_request_max", "gauge", "Max number of concurrently running requests.", labels, float64(s.cfg.MaxNumSeqs))
		metric("gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage.", labels, usage)
		metric("prompt_tokens_total", "counter", "Number of prefill tokens processed.", labels, float64(promptTotal))
		metric("generation_tokens_total", "counter", "Number of generation tokens processed.", labels, float64(outputTotal))
		histogram("request_prompt_tokens", "Histogram of number of prefill tokens processed.", labels, finished, float64(finishedPrompt))
	case MetricsSGLang:
		labels := "model_name=" + model
		metric("sglang:num_running_reqs", "gauge", "The number of running requests.", labels, float64(st.Running))
		metric("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", labels, float64(st.Waiting))
		metric("sglang:token_usage", "gauge", "The token usage.", labels, usage)
		hitRate := 0.0
		if st.PrefixQueries > 0 {
			hitRate = float64(st.PrefixHits) / float64(st.PrefixQueries)
		}
		metric("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", labels, hitRate)
		metric("sglang:cache_config_info", "gauge", "Information of the cache config.",
			fmt.Sprintf("model_name=%s,page_size=\"%d\",num_pages=\"%d\"", model, s.cfg.BlockSize, st.NumBlocks), 1)
		// Like SGLang's tokenizer manager: a request and its prompt tokens are counted when it finishes.
		metric("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", labels, float64(finishedPrompt))
		metric("sglang:num_requests_total", "counter", "Number of requests processed.", labels, float64(finished))
		metric("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.", labels, float64(outputTotal))
		histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels, firstTokens, firstTokenSeconds)
	default:
		labels := "engine=\"0\",model_name=" + model
		metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", labels, float64(st.Running))
		metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", labels, float64(st.Waiting))
		prefix := "vllm:"
		if s.cfg.Metrics == MetricsVLLMLegacy {
			prefix = "vllm:gpu_"
			metric("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage.", labels, usage)
		} else {
			metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", labels, usage)
		}
		metric(prefix+"prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", labels, float64(st.PrefixQueries))
		metric(prefix+"prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", labels, float64(st.PrefixHits))
		metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", labels, float64(st.Preemptions))
		metric("vllm:request_success_total", "counter", "Count of successfully processed requests.", labels, float64(st.Finished))
		metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", labels, float64(promptTotal))
		metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", labels, float64(outputTotal))
		// Like vLLM: a histogram of the tokens each engine step processed, one observation a step
		// (only its count and sum here, with the +Inf bucket).
		histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels, st.Steps, float64(promptTotal+outputTotal))
		// Like vLLM: each finished request's prompt tokens (count and sum only, with the +Inf bucket).
		histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels, finished, float64(finishedPrompt))
		// Like vLLM: each request's time to first token, observed at the token (count and sum only).
		histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels, firstTokens, firstTokenSeconds)
		// Like vLLM: each finished request's time from its first scheduling to its first token, and the
		// prompt tokens it computed, its prefix-cache hits not counted (count and sum only).
		histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", labels, finished, prefillSeconds)
		histogram("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill (excluding cached tokens).", labels, finished, float64(computed))
		metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.",
			fmt.Sprintf("block_size=\"%d\",engine=\"0\",model_name=%s,num_gpu_blocks=\"%d\"", s.cfg.BlockSize, model, st.NumBlocks), 1)
		if len(s.cfg.LoRAAdapters) > 0 {
			s.mu.Lock()
			running, waiting := s.loraListsLocked()
			s.mu.Unlock()
			// Like vLLM: an info gauge whose value is the time its labels were set.
			metric("vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
				fmt.Sprintf("max_lora=\"%d\",running_lora_adapters=\"%s\",waiting_lora_adapters=\"%s\"", s.cfg.MaxLoRAs, running, waiting),
				float64(time.Now().UnixNano())/1e9)
		}
	}
	return b.Bytes()
}

// labelEscaper escapes a Prometheus text-format label value.
var labelEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)
