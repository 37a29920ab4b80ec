package vllmsim

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/cespare/xxhash/v2"
)

// embeddingDims is the length of every simulated embedding vector.
const embeddingDims = 8

// embeddingsBody is an embeddings request.
type embeddingsBody struct {
	Model          string          `json:"model"`
	Input          json.RawMessage `json:"input"`
	EncodingFormat string          `json:"encoding_format"`
}

// serveEmbeddings answers POST /v1/embeddings as a vLLM pooling model does: the input (a string, strings,
// token IDs or arrays of them; a batch is prefilled as one request) is prefilled in the engine's batch
// like any request, without the prefix cache (an encoder's input has no prefix computed alone), and
// answered whole once prefilled, with one vector of embeddingDims values per input (floats, or base64 of
// little-endian float32s when encoding_format is base64, as the OpenAI clients ask by default) and the
// usage. X-Sim-Status answers that status, as for completions.
func (s *Server) serveEmbeddings(w http.ResponseWriter, r *http.Request) {
	body, ok := s.readPost(w, r)
	if !ok {
		return
	}
	var b embeddingsBody
	if err := json.Unmarshal(body, &b); err != nil {
		s.writeError(w, http.StatusBadRequest, "decoding embeddings request: "+err.Error())
		return
	}
	if f := b.EncodingFormat; f != "" && f != "float" && f != "base64" {
		s.writeError(w, http.StatusBadRequest, fmt.Sprintf("encoding_format must be float or base64, got %q", f))
		return
	}
	prompt, err := renderPrompt(b.Input)
	if err != nil {
		s.writeError(w, http.StatusBadRequest, "input: "+err.Error())
		return
	}
	p := parsedRequest{model: b.Model, prompt: prompt, maxTokens: 1} // done when prefilled
	req := s.newRequest(p)
	req.hashes = nil
	if !s.admit(w, p.model, req) {
		return
	}
	defer s.abort(req)
	if !s.await(w, r, req) {
		return
	}
	model := s.modelJSON
	if req.adapter != "" {
		model = appendJSONString(nil, req.adapter)
	}
	out := fmt.Appendf(nil, `{"id":"embd-sim%08x%08x","object":"list","created":%d,"model":%s,"data":[`,
		s.idBase, s.nextID.Add(1), time.Now().Unix(), model)
	seed := xxhash.Sum64(b.Input)
	for i, n := 0, embeddingInputs(b.Input); i < n; i++ {
		if i > 0 {
			out = append(out, ',')
		}
		out = fmt.Appendf(out, `{"index":%d,"object":"embedding","embedding":`, i)
		out = appendEmbedding(out, seed^uint64(i)*0x9e3779b97f4a7c15, b.EncodingFormat == "base64")
		out = append(out, '}')
	}
	tokens := req.promptTokens
	out = fmt.Appendf(out, `],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":0,"prompt_tokens_details":null}}`, tokens, tokens)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(out)))
	_, _ = w.Write(out)
}

// embeddingInputs is how many inputs an embeddings input holds: one for a string or an array of token
// IDs, else the array's length.
func embeddingInputs(raw json.RawMessage) int {
	var items []json.RawMessage
	if json.Unmarshal(raw, &items) != nil || len(items) == 0 {
		return 1
	}
	if first := bytes.TrimSpace(items[0]); len(first) > 0 && (first[0] == '-' || first[0] >= '0' && first[0] <= '9') {
		return 1 // token IDs: one input
	}
	return len(items)
}

// appendEmbedding appends a unit vector of embeddingDims values drawn from seed, as a JSON array of floats
// or as a base64 string of little-endian float32s.
func appendEmbedding(out []byte, seed uint64, b64 bool) []byte {
	var v [embeddingDims]float32
	norm := 0.0
	for i := range v {
		seed = seed*6364136223846793005 + 1442695040888963407
		v[i] = float32(int64(seed>>11)%2001-1000) / 1000
		norm += float64(v[i]) * float64(v[i])
	}
	norm = math.Sqrt(max(norm, 1e-12))
	if b64 {
		raw := make([]byte, 0, 4*embeddingDims)
		for _, x := range v {
			raw = binary.LittleEndian.AppendUint32(raw, math.Float32bits(float32(float64(x)/norm)))
		}
		out = append(out, '"')
		out = base64.StdEncoding.AppendEncode(out, raw)
		return append(out, '"')
	}
	out = append(out, '[')
	for i, x := range v {
		if i > 0 {
			out = append(out, ',')
		}
		out = strconv.AppendFloat(out, float64(x)/norm, 'g', 7, 32)
	}
	return append(out, ']')
}
