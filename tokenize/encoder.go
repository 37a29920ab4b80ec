package tokenize

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unicode"
	"unicode/utf8"
	"unsafe"

	"github.com/cespare/xxhash/v2"
	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/pkoukk/tiktoken-go"
	tiktoken_loader "github.com/pkoukk/tiktoken-go-loader"
)

func init() {
	// The loader setter is an unsynchronised global of tiktoken-go: set it once, before any
	// encoder is built, so that vocabularies come from the embedded files and never the network.
	tiktoken.SetBpeLoader(tiktoken_loader.NewOfflineLoader())
}

// encoder is one tokenizer vocabulary, built at most once per process. A nil tk means "approx".
type encoder struct {
	id   uint8 // part of the message cache key
	name string

	once       sync.Once
	tk         *tiktoken.Tiktoken
	roleTokens [len(roles)]int // token counts of the usual roles, so they are never tokenized per request
	pieces     *pieceCache     // token counts of recently seen pieces (see count)
	err        error
}

var (
	approxEncoder = &encoder{id: 0, name: "approx"}
	encoders      = [...]*encoder{
		{id: 1, name: "cl100k_base"},
		{id: 2, name: "o200k_base"},
	}
)

// ValidEncoding reports whether name is an encoding Options.Encoding accepts ("" included).
func ValidEncoding(name string) bool {
	if name == "" || name == approxEncoder.name {
		return true
	}
	for _, e := range encoders {
		if e.name == name {
			return true
		}
	}
	return false
}

// Warm builds the encoder for an encoding now, so that the first request does not pay for it
// (cl100k_base: 90-200 ms and about 21 MB; o200k_base: 160-300 ms and about 42 MB). It is cheap
// after the first call and safe for concurrent use.
func Warm(encoding string) error {
	_, err := encoderFor(encoding)
	return err
}

func encoderFor(name string) (*encoder, error) {
	if name == "" {
		name = DefaultEncoding
	}
	if name == approxEncoder.name {
		return approxEncoder, nil
	}
	for _, e := range encoders {
		if e.name == name {
			e.once.Do(e.build)
			return e, e.err
		}
	}
	return nil, fmt.Errorf("unknown tokenizer encoding %q (want cl100k_base, o200k_base or approx)", name)
}

func (e *encoder) build() {
	tk, err := tiktoken.GetEncoding(e.name)
	if err != nil {
		e.err = fmt.Errorf("building tokenizer %s: %w", e.name, err)
		return
	}
	e.tk = tk
	e.pieces = new(pieceCache)
	for i, r := range roles {
		e.roleTokens[i] = len(tk.EncodeOrdinary(r))
	}
}

// roles are the usual roles, whose token counts each encoder knows; roleIndex finds one.
var roles = [...]string{"system", "user", "assistant", "tool", "developer", "function"}

func roleIndex(role []byte) int {
	switch string(role) {
	case "system":
		return 0
	case "user":
		return 1
	case "assistant":
		return 2
	case "tool":
		return 3
	case "developer":
		return 4
	case "function":
		return 5
	}
	return -1
}

// maxRun bounds what one BPE call sees (see the package doc): bytes between two exact cut points before a
// forced cut.
const maxRun = 64

// count returns the number of tokens in text: the sum of its pieces' counts (nextPiece), each looked
// up in the encoder's piece cache and tokenized alone when it is not there. Cutting at the pieces' cut
// points gives exactly the tokens of the whole text (TestChunkingIsExact, TestPieceCountsMatchWhole).
// Most words recur, so most of a new message is counted without the tokenizer, whose call costs about
// 1 us a piece (regexp2 pre-tokenizing, then BPE) against about 30 ns for a lookup.
func (e *encoder) count(text []byte) int {
	n := 0
	for len(text) > 0 {
		k, _ := nextPiece(text)
		n += e.countPiece(text[:k])
		text = text[k:]
	}
	return n
}

// countPiece returns the number of tokens of one piece, from the cache when it was seen before.
func (e *encoder) countPiece(piece []byte) int {
	h := xxhash.Sum64(piece)
	if n, ok := e.pieces.get(h); ok {
		return n
	}
	n := len(e.tk.EncodeOrdinary(unsafe.String(&piece[0], len(piece))))
	tokenizerCallCount.Add(1)
	e.pieces.put(h, n)
	return n
}

// pieceCache maps a piece's hash to its token count: direct-mapped, pieceSlots entries of one word
// each (512 KiB an encoder), lock-free. An entry holds the hash's top 56 bits and the count (at most
// maxRun, one byte); a piece whose slot holds another is tokenized and takes the slot. Two pieces
// would have to share a slot and those 56 bits to be confused.
type pieceCache [pieceSlots]atomic.Uint64

const pieceSlots = 1 << 16

func (c *pieceCache) get(h uint64) (int, bool) {
	v := c[h%pieceSlots].Load()
	if v == 0 || v>>8 != h>>8 {
		return 0, false
	}
	return int(v & 0xff), true
}

func (c *pieceCache) put(h uint64, n int) {
	if n > 0 && n <= 0xff {
		c[h%pieceSlots].Store(h&^0xff | uint64(n))
	}
}

// nextPiece returns the length of the first piece of s (not empty): s up to its first cut point (isCut),
// about a word with its leading space or a run of punctuation; or, where a run goes on for maxRun bytes
// without one, up to the rune boundary there (exact false: the cut may shift the count by about a
// token).
func nextPiece(s []byte) (n int, exact bool) {
	prev, size := utf8.DecodeRune(s)
	for i := size; i < len(s); i += size {
		var r rune
		var cut bool
		if c := s[i]; c < utf8.RuneSelf && prev < utf8.RuneSelf {
			r, size = rune(c), 1
			cut = asciiCuts[prev][c/64]&(1<<(c%64)) != 0 // isCut(prev, r), read off its table
		} else {
			r, size = utf8.DecodeRune(s[i:])
			cut = isCut(prev, r)
		}
		if cut {
			return i, true
		}
		if i >= maxRun {
			return i, false // a rune boundary
		}
		prev = r
	}
	return len(s), true
}

// asciiCuts is isCut over ASCII: bit r of asciiCuts[prev] is isCut(prev, r). Most text is ASCII, and a
// table lookup takes the rune decoding and the unicode class checks off each of its bytes.
var asciiCuts = func() (cuts [utf8.RuneSelf][2]uint64) {
	for prev := range rune(utf8.RuneSelf) {
		for r := range rune(utf8.RuneSelf) {
			if isCut(prev, r) {
				cuts[prev][r/64] |= 1 << (r % 64)
			}
		}
	}
	return cuts
}()

// isCut reports whether tokenizing the text before and after the point between runes prev and r
// separately gives exactly the tokens of tokenizing it whole, for the cl100k_base and o200k_base
// pre-tokenizer patterns. No pattern alternative continues past a non-space into a following space
// or tab, nor past a letter or digit into a following punctuation or space character (the
// contraction suffixes start with an apostrophe and marks can belong to letters in o200k_base, so
// neither counts as punctuation); and neither pattern looks behind.
func isCut(prev, r rune) bool {
	switch {
	case r == ' ' || r == '\t':
		return !unicode.IsSpace(prev)
	case r == '\'' || r >= utf8.RuneSelf && (unicode.IsMark(r) || r == utf8.RuneError):
		return false
	case unicode.IsLetter(r) || unicode.IsNumber(r):
		return false
	default: // punctuation, symbols, other whitespace
		return unicode.IsLetter(prev) || unicode.IsNumber(prev)
	}
}

// The message cache maps (encoding, message hash) to the message's exact token count. An entry of
// golang-lru/v2 with a 16-byte key and a 4-byte value costs about 132 bytes (list element, map slot
// and key copies; measured with runtime.MemStats), so the cache holds at most about 9 MB.
const cacheSize = 65536

type cacheKey struct {
	enc  uint8
	hash uint64
}

var msgCache = func() *lru.Cache[cacheKey, uint32] {
	c, err := lru.New[cacheKey, uint32](cacheSize)
	if err != nil {
		panic(err) // only for a non-positive size
	}
	return c
}()
