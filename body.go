package caddyllm

import (
	"errors"
	"io"
	"math/bits"
	"sync"
	"sync/atomic"
)

// Request bodies are read into buffers taken from size-class pools and given back when nothing can read
// them any more: a 4,000-token prompt is a 16 KB buffer a request, which without reuse is most of what
// the policy allocates and a share of the proxy's garbage collection.
//
// Giving a buffer back while anything can still read it would send one client's prompt in another's
// request, so a buffer's life is counted (pooledBody.refs):
//   - the request holds one reference until its context ends (context.AfterFunc: when the handler has
//     returned, or the client has gone, after which nothing is proxied for it);
//   - code on the request's goroutine that reads the bytes (the matcher, Select, llm_resume) holds one
//     for as long as it reads them, between llmRequest.hold and llmRequest.drop;
//   - a reader given to the transport holds one from its first Read until it reaches the end or is
//     closed, whichever comes first; a reader that is never read holds none, and one read halfway and
//     then dropped without Close keeps its buffer from the pool (the garbage collector takes it).
//
// A reference is taken only while the count is above zero: once a buffer is released nothing can take
// it again, and what tries (a retry after the client has gone) fails cleanly instead.

// The pooled sizes: bodies up to maxPooledBody bytes, in power-of-two classes from minPooledBody.
const (
	minPooledBodyBits = 10 // 1 KiB
	maxPooledBodyBits = 20 // 1 MiB
	maxPooledBody     = 1 << maxPooledBodyBits
)

var bodyPools [maxPooledBodyBits - minPooledBodyBits + 1]sync.Pool

// bodyClass returns the pool class of a buffer of at least n bytes, or -1 when n is not pooled.
func bodyClass(n int) int {
	if n <= 0 || n > maxPooledBody {
		return -1
	}
	return max(bits.Len(uint(n-1))-minPooledBodyBits, 0)
}

// getBodyBuffer returns a buffer of length n from the pools (its old contents not cleared), or nil when
// n is not pooled.
func getBodyBuffer(n int) *[]byte {
	c := bodyClass(n)
	if c < 0 {
		return nil
	}
	if p, ok := bodyPools[c].Get().(*[]byte); ok {
		*p = (*p)[:n]
		return p
	}
	b := make([]byte, n, 1<<(c+minPooledBodyBits))
	return &b
}

// putBodyBuffer gives a buffer from getBodyBuffer back.
func putBodyBuffer(p *[]byte) {
	if c := bodyClass(cap(*p)); c >= 0 && cap(*p) == 1<<(c+minPooledBodyBits) {
		bodyPools[c].Put(p)
	}
}

// pooledBody is one request's body buffer and the count of what may still read it.
type pooledBody struct {
	buf  *[]byte
	refs atomic.Int32
	put  func(*[]byte) // putBodyBuffer; tests count releases
}

// pooledBodies counts the request bodies read into pooled buffers since the process started, and the
// bytes of the buffers not yet released (caddy_llm_request_bodies_total,
// caddy_llm_request_body_bytes_held): the held bytes follow the requests in flight and their bodies'
// sizes, and fall back to zero when the proxy is idle; one that only grows is a leak.
var pooledBodies struct{ taken, bytes atomic.Int64 }

// newPooledBody returns buf with one reference: the request's own.
func newPooledBody(buf *[]byte) *pooledBody {
	b := &pooledBody{buf: buf, put: putBodyBuffer}
	b.refs.Store(1)
	pooledBodies.taken.Add(1)
	pooledBodies.bytes.Add(int64(cap(*buf)))
	return b
}

// hold takes a reference, unless the buffer was already released.
func (b *pooledBody) hold() bool {
	for {
		n := b.refs.Load()
		if n <= 0 {
			return false
		}
		if b.refs.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// drop gives a reference back, releasing the buffer with the last one.
func (b *pooledBody) drop() {
	if b.refs.Add(-1) == 0 {
		pooledBodies.bytes.Add(-int64(cap(*b.buf)))
		b.put(b.buf)
	}
}

// errBodyReleased is what reading a request's body gives once the request has ended (its client gone).
var errBodyReleased = errors.New("request body released: the request has ended")

// errBodyClosed is what reading a closed body gives.
var errBodyClosed = errors.New("read on closed request body")

// pooledReader reads a pooled body for one attempt. The transport may read it on its own goroutine while
// another closes it, hence the lock: once Close has returned, no Read touches the buffer.
type pooledReader struct {
	mu   sync.Mutex
	body *pooledBody // nil once the reader is done with it
	rest []byte      // what is left to read; its bytes are body's
	held bool        // a reference is held: reading has started and not ended
	err  error       // what Read returns once body is nil: io.EOF, errBodyClosed or errBodyReleased
}

func newPooledReader(body *pooledBody, b []byte) *pooledReader {
	return &pooledReader{body: body, rest: b}
}

func (r *pooledReader) Read(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.body == nil {
		return 0, r.err
	}
	if !r.held {
		if !r.body.hold() {
			r.finish(errBodyReleased)
			return 0, r.err
		}
		r.held = true
	}
	n := copy(p, r.rest)
	r.rest = r.rest[n:]
	if len(r.rest) == 0 {
		r.finish(io.EOF)
		return n, io.EOF
	}
	return n, nil
}

func (r *pooledReader) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.body != nil {
		r.finish(errBodyClosed)
	}
	return nil
}

// finish gives back what the reader holds; Read returns err from now on.
func (r *pooledReader) finish(err error) {
	if r.held {
		r.body.drop()
	}
	r.body, r.rest, r.held, r.err = nil, nil, false, err
}
