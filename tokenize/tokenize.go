// Package tokenize turns an OpenAI-compatible request body (/v1/chat/completions, /v1/completions,
// the Responses API's /v1/responses or /v1/embeddings) into what token-aware routing needs: the model,
// the stream flag, the output limit, prompt token counts per message, and the prompt's boundaries with
// fixed-seed prefix hashes. It does not import Caddy.
//
// # Counting
//
// Text is counted with github.com/pkoukk/tiktoken-go (cl100k_base by default, or o200k_base), whose
// vocabularies are embedded (nothing is ever downloaded). Each encoder is built once per process,
// lazily or by Warm. A chat request counts like OpenAI's reference recipe:
//
//	PromptTokens = 3 (reply priming) + tools + Σ messages
//	message      = 3 + tokens(role) + tokens(content text) [+ tokens(name) + 1]
//	               + Σ tool calls (tokens(function name) + tokens(arguments))
//	               + 85 per non-text content part (image, audio, file, ...)
//	tools        = tokens(the "tools" array's JSON text as sent), when present
//
// so {"role":"user","content":"hello world"} counts 3+1+2+3 = 9 with cl100k_base. A response counts
// as the chat request the server renders it as: its instructions as the system message, then one
// message per input item (see Parse). Completions count the prompt text exactly (no overhead); a
// token-ID prompt counts its length. Embeddings count their input as completions count a prompt (a
// batch of inputs, the sum), and have no boundaries: an encoder's attention runs both ways, so no
// input's prefix is computed alone and cached for another.
//
// # Bounds
//
// A client controls the body, and BPE is quadratic on long runs of one character (30 KB of one
// letter costs 0.6 s whole). Text is therefore tokenized in pieces, cut where the cut provably does
// not change the count (between a non-space and a following space, or between a letter or digit and
// following punctuation), and never with more than 64 bytes between two such cut points: a longer
// run is cut at a rune boundary, which may shift the count by about one token per cut. A message
// whose text exceeds Options.MaxMessageBytes, and every message once
// Options.MaxTotalBytes have been tokenized in one request, is counted with Estimate instead
// (Request.Estimated says so; estimated counts are not cached). Each tokenizer call is charged at
// least 256 bytes against that budget, so 100k tiny messages cannot make 100k calls. A request
// makes at most 4096 cache lookups and adds at most 4096 step boundaries; JSON nesting is limited
// to 1000 levels. A request of more than 256 messages lists only its first 64 and last 192 in
// Request.Messages and Request.Boundaries. Parse's CPU cost is therefore linear in the body (about 1 ns per byte for large
// strings, about 200 ns per message) plus at most about MaxTotalBytes / 5 MB/s of tokenizing (about
// 25 ms for the default 128 KiB of never-seen text, paid only on cache misses).
//
// # Message cache
//
// Exact token counts of messages are kept in a process-global LRU of 65,536 entries keyed by
// (encoding, message hash); an entry costs about 132 bytes (measured), so the cache holds at most
// about 9 MB. A multi-turn conversation therefore only tokenizes its newest message.
//
// # Piece cache
//
// A new message is counted piece by piece, a piece being the text between two of the cut points
// above (about a word with its leading space), and each piece's count is kept in a direct-mapped,
// lock-free table of 65,536 entries per encoding (512 KiB): a piece seen before is not tokenized
// again. Since the cut points do not change the count, the sum is the whole text's exact count. On
// this repository's own docs, Go code and JSON (BenchmarkCount: new text after other text of its
// kind), 79-89% of pieces are found and counting runs 2-3x faster than the tokenizer alone; text
// of pieces never seen before (random words) costs what the tokenizer costs.
//
// # Concurrency
//
// Every exported function is safe for concurrent use. Parse does not retain body.
package tokenize

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"strings"
	"sync"
	"sync/atomic"
	"unicode/utf8"
	"unsafe"
)

// ErrMalformed is wrapped by every error Parse returns for a body that is not a valid request of
// the given API. The error text says what is wrong and is meant for an HTTP 400 answer.
var ErrMalformed = errors.New("malformed request")

// API is the OpenAI-compatible endpoint a request is for.
type API uint8

const (
	APIUnknown API = iota
	APIChat
	APICompletions
	// APIResponses is OpenAI's Responses API (POST /v1/responses), which vLLM and SGLang serve too: its
	// "instructions" and "input" items are rendered by the same chat template as chat messages.
	APIResponses
	// APIEmbeddings is POST /v1/embeddings: an "input" of one or more texts or token arrays, prefilled
	// and pooled, with no output tokens.
	APIEmbeddings
)

// String returns "chat", "completions", "responses", "embeddings" or "unknown".
func (a API) String() string {
	switch a {
	case APIChat:
		return "chat"
	case APICompletions:
		return "completions"
	case APIResponses:
		return "responses"
	case APIEmbeddings:
		return "embeddings"
	default:
		return "unknown"
	}
}

// APIForPath reports which API a URL path is: a path ending in "/chat/completions" is APIChat, one
// ending in "/completions" otherwise is APICompletions, one ending in "/responses" APIResponses, one
// ending in "/embeddings" APIEmbeddings (so /v1/..., /openai/v1/... work; /v1/responses/{id} and its
// sub-paths are not requests to route by their body); any other path reports false.
func APIForPath(path string) (API, bool) {
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		return APIChat, true
	case strings.HasSuffix(path, "/completions"):
		return APICompletions, true
	case strings.HasSuffix(path, "/responses"):
		return APIResponses, true
	case strings.HasSuffix(path, "/embeddings"):
		return APIEmbeddings, true
	default:
		return APIUnknown, false
	}
}

// Defaults used when the Options fields are zero.
const (
	DefaultEncoding        = "cl100k_base"
	DefaultMaxMessageBytes = 32 << 10
	DefaultMaxTotalBytes   = 128 << 10
)

// StepBytes is the distance, in bytes of a message's text, between the step boundaries Parse adds
// inside long messages.
const StepBytes = 256

// Options controls counting. The zero value means cl100k_base with the default budgets.
type Options struct {
	// Encoding is "cl100k_base" (the default when empty), "o200k_base", or "approx" (no
	// tokenizer: every count is an Estimate).
	Encoding string
	// MaxMessageBytes: a message (or prompt string) whose text is longer than this is estimated,
	// not tokenized. Default 32 KiB.
	MaxMessageBytes int
	// MaxTotalBytes: after this many bytes have been tokenized in one request, the remaining
	// messages are estimated. Cache hits cost nothing. Default 128 KiB.
	MaxTotalBytes int
}

// Request is what routing needs from a request body.
type Request struct {
	API    API
	Model  string
	Stream bool
	// MaxTokens is max_completion_tokens (a response's max_output_tokens) if present, else max_tokens; 0
	// when absent.
	MaxTokens int
	// Sequences is how many sequences the backend generates for the request: its n (chat, completions) or a
	// completion's best_of, whichever is larger; 1 when absent (and for the Responses API and
	// embeddings). Each takes a slot of the batch and its own output's KV cache; they share the prompt.
	Sequences int
	// PreviousResponseID is a response's previous_response_id: the stored response it continues, whose
	// history the server prepends to its input (and which only the server that stored it has).
	PreviousResponseID string
	// PromptTokens is the whole prompt's count (see the package doc for the overhead rule).
	PromptTokens int
	// ToolsTokens is the part of PromptTokens spent on the request's "tools" definitions, which
	// are counted as a pseudo-message before the first message (so Messages[0].End includes them).
	ToolsTokens int
	// Messages has one entry per chat message; for completions (embeddings), one per prompt (input)
	// string or token array; for a response, one for its instructions (first, as the system message the server makes
	// of them) and one per input item (a string input is one user message). A request of more than
	// 256 messages keeps only the entries of its first 64 and its last 192 messages (in order;
	// Σ Tokens is then less than PromptTokens): the messages between are counted and hashed into
	// every later boundary but not listed.
	Messages []Message
	// Boundaries are the points where a cached prefix may end, in strictly increasing Tokens
	// order: the end of the tools pseudo-message and of every message, plus a step every
	// StepBytes bytes inside long messages (token position interpolated proportionally). A point
	// that would not advance Tokens is left out. When Messages is capped, so are the Boundaries:
	// those inside or at the end of an unlisted message are left out (later ones have the hashes
	// of a full list).
	Boundaries []Boundary
	// Estimated is true if any part of the count was estimated instead of tokenized.
	Estimated bool
}

// Message is one chat message (or completions prompt) of a Request.
type Message struct {
	// Tokens of this message including its overhead.
	Tokens int
	// End is the running token position at the end of this message (PromptTokens for the last).
	End int
	// Hash is a fixed-seed xxhash of the message's canonical content: role, name, content text
	// and non-text parts, tool calls (id, function name, arguments) and tool_call_id. Key order
	// and JSON escaping do not change it.
	Hash uint64
	// Assistant is true for a chat message (or a response's input item) of role "assistant": usually the
	// answer a backend generated to the prompt before it, which that backend then holds in its cache too.
	Assistant bool
}

// Parse parses body as a request of the given API and counts its prompt.
//
// Validation follows the OpenAI API: the body must be one JSON object (RFC 8259, UTF-8, nesting
// under 1000 levels, nothing but whitespace after it); chat needs a non-empty "messages" array of
// objects with a string "role", "content" a string, null or an array of typed parts; completions
// need "prompt" as a string, an array of strings, an array of token IDs or an array of non-empty
// token-ID arrays; responses need "input" as a non-empty string or a non-empty array of item objects
// (a message item has a string "role" and content as in chat, with "input_text" and "output_text"
// parts counted as text; a "function_call" item is counted as the assistant's tool call, a
// "function_call_output" item as the tool's message, and any other item by its raw JSON), and
// "instructions" (optional) a string; embeddings need "input" as completions need "prompt"; "model"
// (optional) must be a string. "stream", "max_tokens", "max_completion_tokens", "n", a completion's
// "best_of" and a response's "max_output_tokens" are only routing hints and are read as vLLM's pydantic
// models read them (true, 1 or "yes"; 100, 100.0 or "100"); any other value leaves them absent, for the
// backend to judge. Unknown fields are ignored; a repeated key's last value wins.
// Errors for bodies that are not valid requests wrap ErrMalformed and say what is wrong and where
// ("messages[1].content must be a string, an array of content parts, or null, not a number at
// offset 57"); an unknown opts.Encoding or an encoder that cannot be built is another error.
//
// Parse is safe for concurrent use; encoders and the message cache are process-global. Its cost
// is linear in len(body) plus the bounded tokenizing described in the package doc; with a warm
// cache a 20-message, 4k-token chat request takes a few tens of microseconds and four allocations.
func Parse(body []byte, api API, opts Options) (*Request, error) {
	if api != APIChat && api != APICompletions && api != APIResponses && api != APIEmbeddings {
		return nil, fmt.Errorf("%w: unsupported API %q", ErrMalformed, api)
	}
	enc, err := encoderFor(opts.Encoding)
	if err != nil {
		return nil, err
	}
	if len(body) == 0 {
		return nil, fmt.Errorf("%w: empty body", ErrMalformed)
	}
	if len(body) >= math.MaxInt32 {
		return nil, fmt.Errorf("%w: body of %d bytes is too large", ErrMalformed, len(body))
	}
	if !utf8.Valid(body) {
		return nil, fmt.Errorf("%w: body is not valid UTF-8 (at offset %d)", ErrMalformed, invalidUTF8At(body))
	}
	return parse(body, api, enc, opts, false)
}

// parse is Parse after the checks of its arguments; keepAll disables the cap on Messages and
// Boundaries (for tests that compare a capped parse with a full one).
func parse(body []byte, api API, enc *encoder, opts Options, keepAll bool) (*Request, error) {
	p := parserPool.Get().(*parser)
	defer p.release()
	p.reset(body, api)
	if err := p.parseBody(); err != nil {
		return nil, err
	}
	return p.count(enc, opts, keepAll), nil
}

func invalidUTF8At(b []byte) int {
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r == utf8.RuneError && n == 1 {
			return i
		}
		i += n
	}
	return len(b)
}

// Estimate is the tokenizer-free count used for the "approx" encoding and for fallbacks: one token
// per 4 ASCII bytes (rounded up) plus one per non-ASCII rune. On the measured corpora it is within
// about 20% of cl100k_base for prose and code, 10% low for Chinese and ~40% low for JSON. It costs
// about 1 ns per byte and does not allocate.
func Estimate(text string) int {
	return estimate(unsafe.Slice(unsafe.StringData(text), len(text)))
}

func estimate(b []byte) int {
	ascii, other := 0, 0
	// Eight bytes at a time: high bits mark non-ASCII bytes, high bits that also have the next bit
	// set mark lead bytes (0xC0 and above).
	for len(b) >= 8 {
		w := binary.LittleEndian.Uint64(b)
		hi := w & msb
		ascii += 8 - bits.OnesCount64(hi)
		other += bits.OnesCount64(hi & (w << 1))
		b = b[8:]
	}
	for _, c := range b {
		switch {
		case c < 0x80:
			ascii++
		case c >= 0xC0: // a rune's lead byte
			other++
		}
	}
	return (ascii+3)/4 + other
}

// CacheStats reports the process-global message cache's hits and misses since start, and the number
// of tokenizer calls made. Safe for concurrent use.
func CacheStats() (hits, misses, tokenizerCalls uint64) {
	return cacheHits.Load(), cacheMisses.Load(), tokenizerCallCount.Load()
}

var (
	cacheHits          atomic.Uint64
	cacheMisses        atomic.Uint64
	tokenizerCallCount atomic.Uint64
)

var parserPool = sync.Pool{New: func() any { return new(parser) }}
