package tokenize

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// Overheads of the counting rule documented in the package doc.
const (
	chatPriming       = 3    // tokens that prime the reply, counted once per chat request
	perMessage        = 3    // template tokens around each chat message
	perName           = 1    // extra for a message with a name
	partTokens        = 85   // each non-text content part (image, audio, file, ...)
	minChargeBytes    = 256  // minimum budget charge for one tokenizer call
	maxCacheLookups   = 4096 // per request; later messages bypass the cache (bounds lock traffic)
	maxSteps          = 4096 // step boundaries per request (1 MiB of text); later messages get only ends
	tokenIDBlock      = 64   // step boundaries inside a token-ID prompt, in tokens
	maxSequences      = 1024 // Request.Sequences at most (n and best_of beyond it are the backend's to refuse)
	messageHashSeed   = 0x6c6c6d2d6d736731
	boundaryHashStart = 0x6c6c6d2d62647279
)

// chain returns the hash of a prefix extended by a piece whose hash is piece. It is a fixed-seed
// xxhash of the two values, so every process computes the same chain.
func chain(prev, piece uint64) uint64 {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], prev)
	binary.LittleEndian.PutUint64(b[8:], piece)
	return xxhash.Sum64(b[:])
}

// budget tracks how many more bytes one request may tokenize, and how many more cache lookups
// it may make.
type budget struct {
	perMessage, left int
	lookups          int
}

// Requests of more than keepFirstMessages+keepLastMessages messages keep Message entries and
// boundaries only for their first keepFirstMessages and last keepLastMessages messages (see
// Request.Messages). Routing uses at most the first 64 and the last 192 boundaries anyway.
const (
	keepFirstMessages = 64
	keepLastMessages  = 192
)

// count computes token counts, message hashes and boundaries of a parsed body. Unless keepAll,
// messages in the middle of a huge request are counted and chained into the hash but get no
// Message entry and no boundaries (and their steps are not hashed, only counted against maxSteps).
func (p *parser) count(enc *encoder, opts Options, keepAll bool) *Request {
	b := budget{perMessage: opts.MaxMessageBytes, left: opts.MaxTotalBytes, lookups: maxCacheLookups}
	if b.perMessage <= 0 {
		b.perMessage = DefaultMaxMessageBytes
	}
	if b.left <= 0 {
		b.left = DefaultMaxTotalBytes
	}
	r := &Request{API: p.api, Stream: p.stream}
	if p.hasModel {
		r.Model = string(p.bytes(p.model))
	}
	if p.hasPrevious {
		r.PreviousResponseID = string(p.bytes(p.previous))
	}
	switch {
	case p.hasCompl:
		r.MaxTokens = int(p.maxCompl)
	case p.hasMax:
		r.MaxTokens = int(p.maxTokens)
	}
	r.Sequences = 1
	if p.hasN {
		r.Sequences = max(r.Sequences, int(min(p.n, maxSequences)))
	}
	if p.hasBestOf {
		r.Sequences = max(r.Sequences, int(min(p.bestOf, maxSequences)))
	}

	// Messages [midStart, midEnd) are the aggregated middle (an empty range when all are kept).
	nmsg := len(p.msgs)
	midStart, midEnd := nmsg, nmsg
	if !keepAll && nmsg > keepFirstMessages+keepLastMessages {
		midStart, midEnd = keepFirstMessages, nmsg-keepLastMessages
	}
	kept := nmsg - (midEnd - midStart)
	textBytes := 0
	for i := range p.segs {
		if p.segs[i].kind.counted() {
			textBytes += p.segs[i].sp.len()
		} else if p.segs[i].kind == segTokens {
			textBytes += p.segs[i].sp.len() * (StepBytes / tokenIDBlock)
		}
	}
	r.Messages = make([]Message, kept)
	p.stepsLeft = maxSteps
	// An encoder's input has no prefix computed alone (its attention runs both ways), hence no boundaries.
	bounded := p.api != APIEmbeddings
	if bounded {
		r.Boundaries = make([]Boundary, 0, kept+2+min(textBytes/StepBytes, maxSteps))
	}

	h := chain(boundaryHashStart, uint64(p.template()))
	pos := 0
	if p.chatLike() {
		pos = chatPriming
	}
	var hits, misses uint64
	if p.hasTools {
		raw := p.s.b[p.tools.off:p.tools.end]
		p.d.ResetWithSeed(messageHashSeed)
		writePiece(&p.d, 't', raw)
		th := p.d.Sum64()
		n, exact, hit := p.cached(enc, th, &b, func() (int, bool) {
			return b.countText(enc, raw, max(len(raw), minChargeBytes))
		})
		hits, misses = tally(hits, misses, enc, hit)
		r.Estimated = r.Estimated || !exact
		r.ToolsTokens = n
		pos += n
		h = chain(h, th)
		r.Boundaries = appendBoundary(r.Boundaries, Boundary{Tokens: pos, Hash: h})
	}
	for i := range p.msgs {
		m := &p.msgs[i]
		mh := m.hash
		if !m.hashed {
			mh = p.hashMessage(m)
		}
		var n int
		var exact, hit bool
		if p.chatLike() {
			n, exact, hit = p.cached(enc, mh, &b, func() (int, bool) { return p.countChat(enc, m, &b) })
		} else {
			n, exact, hit = p.cached(enc, mh, &b, func() (int, bool) { return p.countPrompt(enc, m, &b) })
		}
		hits, misses = tally(hits, misses, enc, hit)
		r.Estimated = r.Estimated || !exact
		if i >= midStart && i < midEnd {
			p.skipSteps(m)
			pos += n
			h = chain(h, mh)
			continue
		}
		if bounded {
			r.Boundaries = p.steps(r.Boundaries, m, h, pos, n)
		}
		pos += n
		h = chain(h, mh)
		if bounded {
			r.Boundaries = appendBoundary(r.Boundaries, Boundary{Tokens: pos, Hash: h})
		}
		j := i
		if i >= midEnd {
			j -= midEnd - midStart
		}
		r.Messages[j] = Message{Tokens: n, End: pos, Hash: mh,
			Assistant: p.chatLike() && m.hasRole && string(p.bytes(m.role)) == "assistant"}
	}
	r.PromptTokens = pos
	if hits > 0 {
		cacheHits.Add(hits)
	}
	if misses > 0 {
		cacheMisses.Add(misses)
	}
	return r
}

func tally(hits, misses uint64, enc *encoder, hit bool) (uint64, uint64) {
	switch {
	case enc.tk == nil:
	case hit:
		hits++
	default:
		misses++
	}
	return hits, misses
}

// appendBoundary appends b if it advances the token position.
func appendBoundary(bs []Boundary, b Boundary) []Boundary {
	if len(bs) > 0 && bs[len(bs)-1].Tokens >= b.Tokens {
		return bs
	}
	return append(bs, b)
}

// cached returns a message's count from the cache, or computes it and caches exact counts.
func (p *parser) cached(enc *encoder, h uint64, b *budget, compute func() (int, bool)) (n int, exact, hit bool) {
	if enc.tk == nil {
		n, _ = compute()
		return n, false, false
	}
	if b.lookups <= 0 {
		n, exact = compute()
		return n, exact, false
	}
	b.lookups--
	key := cacheKey{enc: enc.id, hash: h}
	if v, ok := msgCache.Get(key); ok {
		return int(v), true, true
	}
	n, exact = compute()
	if exact && n >= 0 && n <= 1<<32-1 {
		msgCache.Add(key, uint32(n))
	}
	return n, exact, false
}

// countText counts one text exactly if the encoder and budget allow, else estimates it.
func (b *budget) countText(enc *encoder, text []byte, charge int) (int, bool) {
	if enc.tk == nil || len(text) > b.perMessage || charge > b.left {
		return estimate(text), false
	}
	b.left -= charge
	return enc.count(text), true
}

// countChat counts a chat message by the rule in the package doc.
func (p *parser) countChat(enc *encoder, m *msg, b *budget) (int, bool) {
	role := p.bytes(m.role)
	var roleTokens int
	var roleKnown bool
	if i := roleIndex(role); i >= 0 && enc.tk != nil {
		roleTokens, roleKnown = enc.roleTokens[i], true
	}
	// Decide once per message whether it is tokenized, so that a message's count is either exact
	// (and cacheable) or estimated as a whole.
	textBytes, charge := 0, 0
	addCharge := func(n int) {
		if n > 0 {
			textBytes += n
			charge += max(n, minChargeBytes)
		}
	}
	if !roleKnown {
		addCharge(len(role))
	}
	if m.hasName {
		addCharge(m.name.len())
	}
	if m.hashed {
		textBytes, charge = textBytes+m.text, charge+m.charge
	} else {
		for _, sg := range p.segs[m.segStart:m.segEnd] {
			if !sg.dead && sg.kind.counted() {
				addCharge(sg.sp.len())
			}
		}
	}
	exact := enc.tk != nil && textBytes <= b.perMessage && charge <= b.left
	if exact {
		b.left -= charge
	}
	tok := func(text []byte) int {
		if len(text) == 0 {
			return 0
		}
		if exact {
			return enc.count(text)
		}
		return estimate(text)
	}
	n := perMessage
	if roleKnown {
		n += roleTokens
	} else {
		n += tok(role)
	}
	if m.hasName {
		n += perName + tok(p.bytes(m.name))
	}
	for _, sg := range p.segs[m.segStart:m.segEnd] {
		switch {
		case sg.dead:
		case sg.kind.counted():
			n += tok(p.bytes(sg.sp))
		case sg.kind == segPart:
			n += partTokens
		}
	}
	return n, exact
}

// countPrompt counts a completions prompt: its text exactly (no overhead), or its token IDs.
func (p *parser) countPrompt(enc *encoder, m *msg, b *budget) (int, bool) {
	n, exact := 0, true
	for _, sg := range p.segs[m.segStart:m.segEnd] {
		switch sg.kind {
		case segTokens:
			n += sg.sp.len()
		case segText:
			text := p.bytes(sg.sp)
			if len(text) == 0 {
				continue
			}
			c, ok := b.countText(enc, text, max(len(text), minChargeBytes))
			n += c
			exact = exact && ok
		}
	}
	return n, exact
}

// writePiece feeds a tagged, length-prefixed piece to a digest, so that concatenations of pieces
// cannot collide.
func writePiece(d *xxhash.Digest, tag byte, b []byte) {
	var hdr [9]byte
	hdr[0] = tag
	binary.LittleEndian.PutUint64(hdr[1:], uint64(len(b)))
	d.Write(hdr[:])
	d.Write(b)
}

// pieceBuf collects the pieces of one message hash. A message whose pieces fit in buf (most
// messages) is hashed in one call of xxSum64Seed; a larger one spills into the digest. Either way
// the hash is that of writePiece calls on a digest reset with messageHashSeed.
type pieceBuf struct {
	n       int
	spilled bool // the digest holds the bytes before buf[:n]
	buf     [256]byte
}

// piece is writePiece through the buffer.
func (w *pieceBuf) piece(d *xxhash.Digest, tag byte, b []byte) {
	if w.n+9+len(b) > len(w.buf) {
		w.spill(d)
		if 9+len(b) > len(w.buf) {
			writePiece(d, tag, b)
			return
		}
	}
	w.buf[w.n] = tag
	binary.LittleEndian.PutUint64(w.buf[w.n+1:], uint64(len(b)))
	w.n += 9 + copy(w.buf[w.n+9:], b)
}

// spill moves the buffered bytes into the digest, which it resets first if it is not in use yet.
func (w *pieceBuf) spill(d *xxhash.Digest) {
	if !w.spilled {
		d.ResetWithSeed(messageHashSeed)
		w.spilled = true
	}
	d.Write(w.buf[:w.n])
	w.n = 0
}

func (w *pieceBuf) sum(d *xxhash.Digest) uint64 {
	if !w.spilled {
		return xxSum64Seed(messageHashSeed, w.buf[:w.n])
	}
	w.spill(d)
	return d.Sum64()
}

// hashMessage returns the fixed-seed hash of a message's canonical content.
func (p *parser) hashMessage(m *msg) uint64 {
	d, w := &p.d, &p.pb
	w.n, w.spilled = 0, false
	m.text, m.charge = 0, 0
	if p.chatLike() {
		w.piece(d, 'r', p.bytes(m.role))
		if m.hasName {
			w.piece(d, 'n', p.bytes(m.name))
		}
		if m.hasCallID {
			w.piece(d, 'i', p.bytes(m.callID))
		}
	}
	// Content first, then tool calls, whatever the key order in the JSON. (Completions segments
	// have field 0.)
	segs := p.segs[m.segStart:m.segEnd]
	for _, field := range [...]uint8{0, fieldContent, fieldToolCalls} {
		for _, sg := range segs {
			if sg.field != field {
				continue
			}
			switch {
			case sg.dead:
			case sg.absent:
				w.piece(d, '0'+byte(sg.kind), nil)
			case sg.kind == segTokens:
				w.spill(d)
				p.hashIDs(d, p.ids[sg.sp.off:sg.sp.end])
			default:
				w.piece(d, 'a'+byte(sg.kind), p.bytes(sg.sp))
				if n := sg.sp.len(); n > 0 && sg.kind.counted() {
					m.text += n
					m.charge += max(n, minChargeBytes)
				}
			}
		}
	}
	return w.sum(d)
}

func (p *parser) hashIDs(d *xxhash.Digest, ids []uint32) {
	var hdr [9]byte
	hdr[0] = 'T'
	binary.LittleEndian.PutUint64(hdr[1:], uint64(len(ids)))
	d.Write(hdr[:])
	var buf [256]byte
	for len(ids) > 0 {
		k := min(len(ids), len(buf)/4)
		for j, id := range ids[:k] {
			binary.LittleEndian.PutUint32(buf[4*j:], id)
		}
		d.Write(buf[:4*k])
		ids = ids[k:]
	}
}

// steps appends the step boundaries inside a message that starts at token position start with
// prefix hash h and has n tokens. A step's hash chains, from h, the message header (role and
// name) and then every StepBytes-byte block of the message's text (its counted pieces
// concatenated in canonical order); its position is interpolated proportionally.
func (p *parser) steps(bs []Boundary, m *msg, h uint64, start, n int) []Boundary {
	if p.stepsLeft <= 0 {
		return bs
	}
	total := 0
	for _, sg := range p.segs[m.segStart:m.segEnd] {
		switch {
		case sg.dead:
		case sg.kind.counted():
			total += sg.sp.len()
		case sg.kind == segTokens:
			return p.tokenSteps(bs, m, h, start)
		}
	}
	if total <= StepBytes {
		return bs
	}
	d := &p.d
	d.ResetWithSeed(messageHashSeed)
	if p.chatLike() {
		writePiece(d, 'r', p.bytes(m.role))
		if m.hasName {
			writePiece(d, 'n', p.bytes(m.name))
		}
	}
	h = chain(h, d.Sum64())
	d.ResetWithSeed(messageHashSeed)
	fill, done := 0, 0 // bytes in the current block; bytes of text before it
	for _, field := range [...]uint8{0, fieldContent, fieldToolCalls} {
		for _, sg := range p.segs[m.segStart:m.segEnd] {
			if sg.field != field || sg.dead || !sg.kind.counted() {
				continue
			}
			text := p.bytes(sg.sp)
			for len(text) > 0 {
				k := min(len(text), StepBytes-fill)
				d.Write(text[:k])
				text, fill = text[k:], fill+k
				if fill < StepBytes {
					continue
				}
				done += StepBytes
				if done >= total {
					return bs // the message end is a boundary of its own
				}
				h = chain(h, d.Sum64())
				d.ResetWithSeed(messageHashSeed)
				fill = 0
				bs = appendBoundary(bs, Boundary{Tokens: start + int(int64(n)*int64(done)/int64(total)), Hash: h, Step: true})
				if p.stepsLeft--; p.stepsLeft <= 0 {
					return bs
				}
			}
		}
	}
	return bs
}

// skipSteps charges against stepsLeft the step boundaries steps would add inside m, without
// hashing them, so that the boundaries of later messages are those of a full count.
func (p *parser) skipSteps(m *msg) {
	if p.stepsLeft <= 0 {
		return
	}
	if m.hashed { // a chat message: text segments only
		if m.text > StepBytes {
			p.stepsLeft -= min((m.text-1)/StepBytes, p.stepsLeft)
		}
		return
	}
	total, tokenSteps := 0, 0
	for _, sg := range p.segs[m.segStart:m.segEnd] {
		switch {
		case sg.dead:
		case sg.kind.counted():
			total += sg.sp.len()
		case sg.kind == segTokens:
			tokenSteps += max(sg.sp.len()-1, 0) / tokenIDBlock
		}
	}
	n := tokenSteps
	if tokenSteps == 0 && total > StepBytes {
		n = (total - 1) / StepBytes
	}
	p.stepsLeft -= min(n, p.stepsLeft)
}

// tokenSteps appends a boundary every tokenIDBlock tokens of a token-ID prompt; positions are exact.
func (p *parser) tokenSteps(bs []Boundary, m *msg, h uint64, start int) []Boundary {
	d := &p.d
	for _, sg := range p.segs[m.segStart:m.segEnd] {
		ids := p.ids[sg.sp.off:sg.sp.end]
		for off := tokenIDBlock; off < len(ids); off += tokenIDBlock {
			d.ResetWithSeed(messageHashSeed)
			p.hashIDs(d, ids[off-tokenIDBlock:off])
			h = chain(h, d.Sum64())
			bs = appendBoundary(bs, Boundary{Tokens: start + off, Hash: h, Step: true})
			if p.stepsLeft--; p.stepsLeft <= 0 {
				return bs
			}
		}
	}
	return bs
}
