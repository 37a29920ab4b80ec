package vllmsim

import (
	"context"
	"errors"
	"math"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
)

// TestEmbeddings drives the simulator's embeddings with the official Go client: one vector per input,
// unit length, as floats and as base64 (the encoding the OpenAI clients ask for by default), the prompt
// tokens in the usage, the engine running each request as a prefill that finishes it (one finished
// request, nothing found or left in the prefix cache), and a 400 for an unknown encoding.
func TestEmbeddings(t *testing.T) {
	s, ts := newTestServer(t, Config{Model: "sim-embed"})
	client := openai.NewClient(option.WithBaseURL(ts.URL+"/v1/"), option.WithAPIKey("x"), option.WithMaxRetries(0))
	ctx := context.Background()
	text := strings.Repeat("abcd", 100) // 100 simulated tokens
	for _, format := range []openai.EmbeddingNewParamsEncodingFormat{openai.EmbeddingNewParamsEncodingFormatFloat, openai.EmbeddingNewParamsEncodingFormatBase64} {
		for _, tc := range []struct {
			name   string
			input  openai.EmbeddingNewParamsInputUnion
			inputs int
			tokens int64
		}{
			{"one text", openai.EmbeddingNewParamsInputUnion{OfString: openai.String(text)}, 1, 100},
			{"three texts", openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{text, text, text}}, 3, 300},
			{"token IDs", openai.EmbeddingNewParamsInputUnion{OfArrayOfTokens: []int64{1, 2, 3, 4, 5}}, 1, 5},
			{"token arrays", openai.EmbeddingNewParamsInputUnion{OfArrayOfTokenArrays: [][]int64{{1, 2}, {3}}}, 2, 3},
		} {
			before := s.State()
			res, err := client.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "sim-embed", Input: tc.input, EncodingFormat: format})
			if err != nil {
				t.Fatalf("%s, %s: %v", tc.name, format, err)
			}
			if len(res.Data) != tc.inputs || res.Usage.PromptTokens != tc.tokens || res.Usage.TotalTokens != tc.tokens {
				t.Errorf("%s, %s: %d vectors, usage %+v: want %d vectors and %d tokens", tc.name, format, len(res.Data), res.Usage, tc.inputs, tc.tokens)
			}
			for i, d := range res.Data {
				norm := 0.0
				for _, x := range d.Embedding {
					norm += x * x
				}
				if d.Index != int64(i) || len(d.Embedding) != embeddingDims || math.Abs(norm-1) > 1e-4 {
					t.Errorf("%s, %s: vector %d (index %d) has %d values of norm %v: want %d of norm 1", tc.name, format, i, d.Index, len(d.Embedding), math.Sqrt(norm), embeddingDims)
				}
			}
			after := s.State()
			if after.Finished-before.Finished != 1 || after.PrefixHits != before.PrefixHits || after.CachedBlocks != 0 {
				t.Errorf("%s, %s: %d requests finished, prefix hits %d -> %d, %d blocks cached: want one prefill, nothing cached",
					tc.name, format, after.Finished-before.Finished, before.PrefixHits, after.PrefixHits, after.CachedBlocks)
			}
		}
	}
	_, err := client.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "sim-embed", Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String("x")}, EncodingFormat: "int8"})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusBadRequest {
		t.Errorf("encoding_format int8: %v, want a 400", err)
	}
}
