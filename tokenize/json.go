package tokenize

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/bits"
	"unicode/utf16"
	"unicode/utf8"
)

// maxDepth bounds JSON nesting. Python's json module, which the OpenAI-compatible servers (vLLM,
// SGLang) use, fails at about 1000 levels too, so deeper bodies would be rejected upstream anyway.
// Skipping is recursive, so this also bounds the stack a hostile body can make Parse use.
const maxDepth = 1000

// scanner is a minimal validating JSON reader over a byte slice. It never allocates on success:
// strings are reported as spans of the input and decoded only when they contain escapes.
// It accepts exactly RFC 8259 JSON (the caller has already checked that the input is UTF-8).
type scanner struct {
	b []byte
	i int
}

// errorf returns an ErrMalformed error that says what is wrong and where.
func (s *scanner) errorf(format string, args ...any) error {
	return fmt.Errorf("%w: %s at offset %d", ErrMalformed, fmt.Sprintf(format, args...), s.i)
}

// syntax reports an unexpected byte or end of input while reading what.
func (s *scanner) syntax(what string) error {
	if s.i >= len(s.b) {
		return fmt.Errorf("%w: invalid JSON: unexpected end of input in %s", ErrMalformed, what)
	}
	c := s.b[s.i]
	if c >= 0x20 && c < 0x7f {
		return s.errorf("invalid JSON: unexpected %q in %s", c, what)
	}
	return s.errorf("invalid JSON: unexpected byte 0x%02x in %s", c, what)
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// peek skips whitespace and returns the next byte, or 0 at the end of input.
func (s *scanner) peek() byte {
	s.ws()
	if s.i < len(s.b) {
		return s.b[s.i]
	}
	return 0
}

// strSpecial marks the bytes that end the fast path of a string scan.
var strSpecial = func() (t [256]bool) {
	for c := 0; c < 0x20; c++ {
		t[c] = true
	}
	t['"'], t['\\'] = true, true
	return t
}()

// str reads a string starting at the opening quote and returns the span of its raw contents
// (without quotes) and whether it contains escapes.
func (s *scanner) str() (start, end int, esc bool, err error) {
	if s.i >= len(s.b) || s.b[s.i] != '"' {
		return 0, 0, false, s.syntax("string")
	}
	s.i++
	start = s.i
	b := s.b
	i := s.i
	for {
		i = scanPlain(b, i)
		if i >= len(b) {
			s.i = i
			return 0, 0, false, s.syntax("string")
		}
		switch c := b[i]; {
		case c == '"':
			s.i = i + 1
			return start, i, esc, nil
		case c == '\\':
			esc = true
			if i+1 >= len(b) {
				s.i = i + 1
				return 0, 0, false, s.syntax("string escape")
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(b) || !isHex4(b[i+2:i+6]) {
					s.i = i
					return 0, 0, false, s.errorf("invalid JSON: bad \\u escape in string")
				}
				i += 6
			default:
				s.i = i
				return 0, 0, false, s.errorf("invalid JSON: bad escape in string")
			}
		default:
			s.i = i
			return 0, 0, false, s.errorf("invalid JSON: control character 0x%02x in string", c)
		}
	}
}

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// scanPlain returns the index of the first byte at or after i that is a quote, a backslash or a
// control character (or len(b)). It tests eight bytes at a time: a byte x is flagged when x-n
// borrows and x had its high bit clear, which is exact for the lowest flagged byte.
func scanPlain(b []byte, i int) int {
	for i+8 <= len(b) {
		w := binary.LittleEndian.Uint64(b[i:])
		q := w ^ (lsb * '"')
		e := w ^ (lsb * '\\')
		t := ((w - lsb*0x20) & ^w) | ((q - lsb) & ^q) | ((e - lsb) & ^e)
		if t &= msb; t != 0 {
			return i + bits.TrailingZeros64(t)/8
		}
		i += 8
	}
	for i < len(b) && !strSpecial[b[i]] {
		i++
	}
	return i
}

func isHex4(b []byte) bool {
	for _, c := range b[:4] {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
			return false
		}
	}
	return true
}

func hexVal(b []byte) rune {
	var r rune
	for _, c := range b[:4] {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c - 'a' + 10)
		default:
			r |= rune(c - 'A' + 10)
		}
	}
	return r
}

// appendUnescaped appends the decoded form of a raw string span already validated by str.
// Lone surrogates become U+FFFD, as in encoding/json.
func appendUnescaped(dst, raw []byte) []byte {
	for i := 0; i < len(raw); {
		c := raw[i]
		if c != '\\' {
			j := bytes.IndexByte(raw[i:], '\\')
			if j < 0 {
				return append(dst, raw[i:]...)
			}
			dst = append(dst, raw[i:i+j]...)
			i += j
			continue
		}
		switch raw[i+1] {
		case 'b':
			dst = append(dst, '\b')
		case 'f':
			dst = append(dst, '\f')
		case 'n':
			dst = append(dst, '\n')
		case 'r':
			dst = append(dst, '\r')
		case 't':
			dst = append(dst, '\t')
		case 'u':
			r := hexVal(raw[i+2:])
			i += 6
			if utf16.IsSurrogate(r) {
				r2 := utf8.RuneError
				if i+6 <= len(raw) && raw[i] == '\\' && raw[i+1] == 'u' {
					r2 = hexVal(raw[i+2:])
				}
				if d := utf16.DecodeRune(r, r2); d != utf8.RuneError {
					i += 6
					r = d
				} else {
					r = utf8.RuneError
				}
			}
			dst = utf8.AppendRune(dst, r)
			continue
		default: // '"', '\\', '/'
			dst = append(dst, raw[i+1])
		}
		i += 2
	}
	return dst
}

// literal reads true, false or null.
func (s *scanner) literal(lit string) error {
	if len(s.b)-s.i < len(lit) || string(s.b[s.i:s.i+len(lit)]) != lit {
		return s.syntax("literal")
	}
	s.i += len(lit)
	return nil
}

// number reads a JSON number and returns its span.
func (s *scanner) number() (start, end int, err error) {
	b := s.b
	i := s.i
	start = i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	default:
		s.i = i
		return 0, 0, s.syntax("number")
	}
	if i < len(b) && b[i] == '.' {
		i++
		d := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == d {
			s.i = i
			return 0, 0, s.syntax("number")
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		d := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == d {
			s.i = i
			return 0, 0, s.syntax("number")
		}
	}
	s.i = i
	return start, i, nil
}

// integer parses a number span as a non-negative integer; ok is false for fractions, exponents,
// negative numbers and values above max.
func integer(b []byte, max int64) (v int64, ok bool) {
	if len(b) == 0 {
		return 0, false
	}
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		v = v*10 + int64(c-'0')
		if v > max {
			return 0, false
		}
	}
	return v, true
}

// skip validates and skips one value of any type. depth is the nesting level of the value.
func (s *scanner) skip(depth int) error {
	switch s.peek() {
	case '{':
		return s.object(depth, func(_ []byte, _ bool) error { return s.skip(depth + 1) })
	case '[':
		return s.array(depth, func() error { return s.skip(depth + 1) })
	case '"':
		_, _, _, err := s.str()
		return err
	case 't':
		return s.literal("true")
	case 'f':
		return s.literal("false")
	case 'n':
		return s.literal("null")
	default:
		_, _, err := s.number()
		return err
	}
}

// object reads an object whose opening brace is next, calling member for each key with the
// scanner positioned before the value; member must consume the value. The key is the raw span
// (esc reports escapes; use key() to compare).
func (s *scanner) object(depth int, member func(key []byte, esc bool) error) error {
	if depth >= maxDepth {
		return s.errorf("JSON nested too deeply (more than %d levels)", maxDepth)
	}
	if s.peek() != '{' {
		return s.syntax("object")
	}
	s.i++
	if s.peek() == '}' {
		s.i++
		return nil
	}
	for {
		if s.peek() != '"' {
			return s.syntax("object key")
		}
		ks, ke, esc, err := s.str()
		if err != nil {
			return err
		}
		if s.peek() != ':' {
			return s.syntax("object (expected ':')")
		}
		s.i++
		s.ws()
		if err := member(s.b[ks:ke], esc); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case '}':
			s.i++
			return nil
		default:
			return s.syntax("object (expected ',' or '}')")
		}
	}
}

// array reads an array whose opening bracket is next, calling elem with the scanner positioned
// before each element; elem must consume it.
func (s *scanner) array(depth int, elem func() error) error {
	if depth >= maxDepth {
		return s.errorf("JSON nested too deeply (more than %d levels)", maxDepth)
	}
	if s.peek() != '[' {
		return s.syntax("array")
	}
	s.i++
	if s.peek() == ']' {
		s.i++
		return nil
	}
	for {
		s.ws()
		if err := elem(); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case ']':
			s.i++
			return nil
		default:
			return s.syntax("array (expected ',' or ']')")
		}
	}
}

// typeErr reports a value of the wrong type, appending ", not <kind>" to the message; when the next
// byte cannot start any JSON value it reports invalid JSON instead.
func (s *scanner) typeErr(format string, args ...any) error {
	switch c := s.peek(); {
	case c == '{' || c == '[' || c == '"' || c == 't' || c == 'f' || c == 'n' || c == '-' || c >= '0' && c <= '9':
		return s.errorf(format+", not %s", append(args, s.kind())...)
	}
	return s.syntax("value")
}

// kind names the JSON type of the next value, for error messages.
func (s *scanner) kind() string {
	switch s.peek() {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	case 0:
		return "missing"
	default:
		return "a number"
	}
}
