package vllmsim

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"testing"
)

// TestConcurrentLoadLeavesNoLeak runs many concurrent requests with shared prefixes, a small KV cache
// and client cancellations, then checks that the idle engine holds no blocks and that its counters add
// up.
func TestConcurrentLoadLeavesNoLeak(t *testing.T) {
	s, ts := newTestServer(t, Config{NumGPUBlocks: 300, MaxNumSeqs: 8, TokensPerChunk: 2, MaxNumBatchedTokens: 512})
	const n = 120
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			system := longText(fmt.Sprintf("system prompt %d ", i%4), 1500)
			body := chatBodyJSON(t, system, fmt.Sprintf("question %d", i), 5+i%20, i%2 == 0)
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+"/v1/chat/completions", bytes.NewReader(body))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			if i%7 == 3 { // cancel some mid-way
				buf := make([]byte, 64)
				_, _ = resp.Body.Read(buf)
				cancel()
				return
			}
			if _, err := io.Copy(io.Discard, resp.Body); err != nil {
				t.Error(err)
			}
			if resp.StatusCode != 200 {
				t.Errorf("status %d", resp.StatusCode)
			}
		}()
	}
	wg.Wait()
	waitFor(t, "the engine to go idle", func() bool {
		st := s.State()
		return st.Running == 0 && st.Waiting == 0
	})
	st := s.State()
	if st.UsedBlocks != 0 || st.PendingPrefillTokens != 0 {
		t.Errorf("idle engine leaks: %+v", st)
	}
	if st.Requests != n || st.PrefixHits == 0 || st.PrefixHits > st.PrefixQueries {
		t.Errorf("counters: %+v", st)
	}
	checkKV(t, s)
}
