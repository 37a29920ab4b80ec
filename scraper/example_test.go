package scraper_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/tokenrouter/caddy-llm/scraper"
)

func Example() {
	vllm := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, `vllm:num_requests_waiting{engine="0",model_name="llama"} 3`)
		fmt.Fprintln(w, `vllm:num_requests_waiting{engine="1",model_name="llama"} 2`)
		fmt.Fprintln(w, `vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5`)
	}))
	defer vllm.Close()

	reg := scraper.NewRegistry()
	h := reg.Acquire(scraper.Target{URL: vllm.URL + "/metrics", Model: "llama"}, scraper.Options{Interval: 2 * time.Second})
	defer h.Release() // exactly one Release per Acquire

	if err := h.ScrapeOnce(context.Background()); err != nil {
		fmt.Println(err)
		return
	}
	s, fresh := h.Load() // lock-free; safe on the request path
	fmt.Println(s.Flavor, s.Waiting, s.KVUsage, fresh)
	// Output: vllm 5 0.5 true
}
