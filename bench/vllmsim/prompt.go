package vllmsim

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/cespare/xxhash/v2"
)

// bytesPerToken is the simulated tokenizer: the templated prompt is cut into pieces of this many bytes
// and every piece (the last one possibly shorter) is one token.
const bytesPerToken = 4

// errBadRequest marks request-body problems answered with 400.
var errBadRequest = errors.New("bad request")

// parsedRequest is an OpenAI completion request reduced to what the engine needs.
type parsedRequest struct {
	chat         bool
	model        string
	prompt       []byte // templated prompt text; token-ID prompts are 4 bytes per ID
	stream       bool
	includeUsage bool
	maxTokens    int
	maxTokensSet bool
	// n is how many completions of the prompt to generate (the request's n; 1 when absent): each is a
	// sequence of its own in the engine, as vLLM runs them.
	n int
	// A Responses API request's: responses is set, store whether to keep it, previous the response it
	// continues, conversation its prompt after the tools and instructions (what a continuation repeats).
	responses    bool
	store        bool
	previous     string
	conversation []byte
}

type chatBody struct {
	Model               string          `json:"model"`
	Messages            []chatMessage   `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	Stream              bool            `json:"stream"`
	StreamOptions       *streamOptions  `json:"stream_options"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	N                   *int            `json:"n"`
}

type completionBody struct {
	Model         string          `json:"model"`
	Prompt        json.RawMessage `json:"prompt"`
	Stream        bool            `json:"stream"`
	StreamOptions *streamOptions  `json:"stream_options"`
	MaxTokens     *int            `json:"max_tokens"`
	N             *int            `json:"n"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type chatMessage struct {
	Role      string          `json:"role"`
	Content   rawContent      `json:"content"`
	ToolCalls json.RawMessage `json:"tool_calls"`
}

// rawContent keeps a message's content as raw JSON (already validated by the enclosing decode) so
// that plain strings can be copied without a second validating pass.
type rawContent []byte

// UnmarshalJSON implements json.Unmarshaler.
func (c *rawContent) UnmarshalJSON(b []byte) error {
	*c = b
	return nil
}

type contentPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// parseRequest decodes a chat (chat=true) or text completion body and renders its prompt with the
// simulated chat template: optional "<|tools|>\n" + tools JSON + "\n", then per message
// "<|role|>\n" + content + tool calls JSON + "\n". Errors wrap errBadRequest.
func parseRequest(body []byte, chat bool) (parsedRequest, error) {
	p := parsedRequest{chat: chat}
	var maxTokens, n *int
	if chat {
		var b chatBody
		if err := json.Unmarshal(body, &b); err != nil {
			return p, fmt.Errorf("%w: decoding chat completion request: %w", errBadRequest, err)
		}
		if len(b.Messages) == 0 {
			return p, fmt.Errorf("%w: messages: field required", errBadRequest)
		}
		var buf bytes.Buffer
		buf.Grow(len(body))
		appendTools(&buf, b.Tools)
		for i, m := range b.Messages {
			if m.Role == "" {
				return p, fmt.Errorf("%w: messages[%d].role: field required", errBadRequest, i)
			}
			buf.WriteString("<|")
			buf.WriteString(m.Role)
			buf.WriteString("|>\n")
			if err := appendContent(&buf, m.Content); err != nil {
				return p, fmt.Errorf("%w: messages[%d].content: %w", errBadRequest, i, err)
			}
			if len(m.ToolCalls) > 0 && !bytes.Equal(m.ToolCalls, []byte("null")) {
				buf.Write(m.ToolCalls)
			}
			buf.WriteByte('\n')
		}
		p.model, p.prompt, p.stream = b.Model, buf.Bytes(), b.Stream
		p.includeUsage = b.StreamOptions != nil && b.StreamOptions.IncludeUsage
		maxTokens = b.MaxTokens
		if b.MaxCompletionTokens != nil {
			maxTokens = b.MaxCompletionTokens
		}
		n = b.N
	} else {
		var b completionBody
		if err := json.Unmarshal(body, &b); err != nil {
			return p, fmt.Errorf("%w: decoding completion request: %w", errBadRequest, err)
		}
		prompt, err := renderPrompt(b.Prompt)
		if err != nil {
			return p, fmt.Errorf("%w: prompt: %w", errBadRequest, err)
		}
		p.model, p.prompt, p.stream = b.Model, prompt, b.Stream
		p.includeUsage = b.StreamOptions != nil && b.StreamOptions.IncludeUsage
		maxTokens = b.MaxTokens
		n = b.N
	}
	if err := p.setN(n); err != nil {
		return p, err
	}
	err := p.setMaxTokens("max_tokens", maxTokens)
	return p, err
}

// maxN is the most completions one request may ask for: each is a sequence in the engine, and the
// simulator's memory is bounded by the sequences it holds.
const maxN = 128

// setN sets how many completions to generate from the request's n, 1 when it is absent.
func (p *parsedRequest) setN(n *int) error {
	p.n = 1
	if n == nil {
		return nil
	}
	if *n < 1 {
		return fmt.Errorf("%w: n must be at least 1, got %d", errBadRequest, *n)
	}
	if *n > maxN {
		return fmt.Errorf("%w: n must be at most %d, got %d", errBadRequest, maxN, *n)
	}
	p.n = *n
	return nil
}

// appendTools writes a request's tools, when it has some: "<|tools|>\n" + their JSON + "\n".
func appendTools(buf *bytes.Buffer, tools json.RawMessage) {
	if len(tools) > 0 && !bytes.Equal(tools, []byte("null")) {
		buf.WriteString("<|tools|>\n")
		buf.Write(tools)
		buf.WriteByte('\n')
	}
}

// setMaxTokens sets the output limit from the request's field (name, for the error), or the default
// when it is absent.
func (p *parsedRequest) setMaxTokens(name string, maxTokens *int) error {
	p.maxTokens = defaultMaxTokens
	if maxTokens != nil {
		if *maxTokens < 1 {
			return fmt.Errorf("%w: %s must be at least 1, got %d", errBadRequest, name, *maxTokens)
		}
		p.maxTokens, p.maxTokensSet = *maxTokens, true
	}
	return nil
}

// appendContent writes a message's content: a string, null, or an array of parts whose text parts are
// written as text and other parts (images, audio) as their JSON.
func appendContent(buf *bytes.Buffer, raw rawContent) error {
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil
	}
	switch raw[0] {
	case '"':
		if bytes.IndexByte(raw, '\\') < 0 {
			// Valid JSON (the decoder checked) without escapes: the bytes between the quotes are the text.
			buf.Write(raw[1 : len(raw)-1])
			return nil
		}
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return err
		}
		buf.WriteString(s)
		return nil
	case '[':
		var parts []json.RawMessage
		if err := json.Unmarshal(raw, &parts); err != nil {
			return err
		}
		for _, part := range parts {
			var cp contentPart
			if err := json.Unmarshal(part, &cp); err != nil {
				return err
			}
			if cp.Type == "text" || cp.Type == "input_text" || cp.Type == "output_text" {
				buf.WriteString(cp.Text)
			} else {
				buf.Write(part)
			}
		}
		return nil
	}
	return errors.New("must be a string, an array of content parts or null")
}

// renderPrompt turns a completions prompt (a string, an array of strings, an array of token IDs or an
// array of such arrays) into bytes; token IDs become 4 bytes each, so one ID is one simulated token.
func renderPrompt(raw json.RawMessage) ([]byte, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, errors.New("field required")
	}
	var out []byte
	var walk func(raw json.RawMessage, depth int) error
	walk = func(raw json.RawMessage, depth int) error {
		switch {
		case raw[0] == '"':
			var s string
			if err := json.Unmarshal(raw, &s); err != nil {
				return err
			}
			out = append(out, s...)
		case raw[0] == '[' && depth < 2:
			var items []json.RawMessage
			if err := json.Unmarshal(raw, &items); err != nil {
				return err
			}
			for _, it := range items {
				if err := walk(bytes.TrimSpace(it), depth+1); err != nil {
					return err
				}
			}
		case depth > 0 && (raw[0] == '-' || raw[0] >= '0' && raw[0] <= '9'):
			var id uint32
			if err := json.Unmarshal(raw, &id); err != nil {
				return err
			}
			out = binary.LittleEndian.AppendUint32(out, id)
		default:
			return errors.New("must be a string, an array of strings or an array of token IDs")
		}
		return nil
	}
	if err := walk(raw, 0); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("prompt is empty")
	}
	return out, nil
}

// promptTokens is the simulated token count of a rendered prompt.
func promptTokens(prompt []byte) int { return (len(prompt) + bytesPerToken - 1) / bytesPerToken }

// blockHashes returns the chained hashes of the prompt's full blocks: hash i = xxhash(hash i-1 as
// 8 little-endian bytes, the block's blockSize 4-byte pieces). It costs one pass over the prompt.
func blockHashes(prompt []byte, blockSize int) []uint64 {
	blockBytes := blockSize * bytesPerToken
	n := len(prompt) / blockBytes
	if n == 0 {
		return nil
	}
	hashes := make([]uint64, n)
	d := xxhash.New()
	var prev [8]byte
	var h uint64
	for i := range n {
		d.Reset()
		binary.LittleEndian.PutUint64(prev[:], h)
		_, _ = d.Write(prev[:])
		_, _ = d.Write(prompt[i*blockBytes : (i+1)*blockBytes])
		h = d.Sum64()
		hashes[i] = h
	}
	return hashes
}
