package affinity

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"time"
)

// Snapshot format, version 1. All integers little-endian; uvarint is encoding/binary's.
//
//	magic      "LLMR" (4 bytes)
//	version    1 byte (SnapshotVersion)
//	taken      int64: unix milliseconds when the snapshot was taken; ages below count back from it
//	upstreams  uvarint n, then n times: uvarint length, name bytes
//	routes     uvarint n, then n times (remote ones first, each tier least recently learned first):
//	             key uint64; flags byte (bit 7: remote; bits 0-2: entries, 1..4);
//	             entries times: uvarint upstream index, uvarint age in milliseconds
//	pins       uvarint n, then n times (least recently pinned first):
//	             key uint64; uvarint upstream index; uvarint age in milliseconds
//	checksum   uint32: CRC-32C of everything before it
//
// A route with one upstream costs 8+1+1+3 = 13 bytes (ages up to 35 minutes fit 3 bytes); a pin 12.
const (
	snapshotMagic = "LLMR"
	// SnapshotVersion is the version AppendSnapshot writes; Restore reads it and refuses later ones.
	SnapshotVersion = 1

	snapshotHeader = len(snapshotMagic) + 1 + 8
	flagRemote     = 0x80
	minRouteBytes  = 8 + 1 + 2
	minPinBytes    = 8 + 2
)

// Sentinel errors of Restore.
var (
	// ErrSnapshotVersion: the snapshot was written by a later version of this package.
	ErrSnapshotVersion = errors.New("snapshot version not supported")
	// ErrSnapshotCorrupt: the snapshot is truncated, damaged or not a snapshot at all.
	ErrSnapshotCorrupt = errors.New("snapshot corrupt")
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// tableCopy is a table's content copied under the lock, to be encoded without it.
type tableCopy struct {
	taken      int64 // unix nanoseconds
	names      []string
	remoteKeys []uint64
	remote     []route
	localKeys  []uint64
	local      []route
	pinKeys    []uint64
	pins       []pin
}

// AppendSnapshot appends a snapshot of the table's live routes (local and remote) and pins to buf in the
// format above and returns it. Only the copy of the entries (O(routes + pins) memory, about 56 bytes a
// route) is made under the shared lock; encoding, and whatever the caller does with the bytes (storage
// I/O), happens without it, so Learn waits at most for a memory copy.
func (t *Table) AppendSnapshot(buf []byte) []byte {
	t.mu.RLock()
	c := tableCopy{
		taken:      t.cfg.Now().UnixNano(),
		names:      make([]string, len(t.ups.slots)),
		remoteKeys: t.remote.Keys(),
		remote:     t.remote.Values(),
		localKeys:  t.routes.Keys(),
		local:      t.routes.Values(),
		pinKeys:    t.pins.Keys(),
		pins:       t.pins.Values(),
	}
	for id, s := range t.ups.slots {
		if s.live {
			c.names[id] = s.name
		}
	}
	ttl, pinTTL := int64(t.cfg.TTL), int64(t.cfg.ConversationTTL)
	t.mu.RUnlock()
	return c.appendTo(buf, ttl, pinTTL)
}

func (c *tableCopy) appendTo(buf []byte, ttl, pinTTL int64) []byte {
	start := len(buf)
	takenMs := c.taken / int64(time.Millisecond)
	buf = append(buf, snapshotMagic...)
	buf = append(buf, SnapshotVersion)
	buf = binary.LittleEndian.AppendUint64(buf, uint64(takenMs))

	// Index the names in use; index 0.. in order of first use.
	index := make(map[uint32]uint64)
	var names []string
	use := func(id uint32) uint64 {
		i, ok := index[id]
		if !ok {
			i = uint64(len(names))
			index[id] = i
			names = append(names, c.names[id])
		}
		return i
	}
	liveEntry := func(id uint32, seen, ttl int64) bool {
		return id != 0 && c.names[id] != "" && c.taken-seen <= ttl
	}
	age := func(seen int64) uint64 { return uint64(max(takenMs-seen/int64(time.Millisecond), 0)) }

	var body []byte
	nRoutes := 0
	for tier, keys := range [2][]uint64{c.remoteKeys, c.localKeys} {
		values := c.remote
		var flags byte = flagRemote
		if tier == 1 {
			values, flags = c.local, 0
		}
		for i, key := range keys {
			r := values[i]
			n := 0
			for e, id := range r.ids {
				if liveEntry(id, r.seen[e], ttl) {
					n++
				}
			}
			if n == 0 {
				continue
			}
			nRoutes++
			body = binary.LittleEndian.AppendUint64(body, key)
			body = append(body, flags|byte(n))
			for e, id := range r.ids {
				if liveEntry(id, r.seen[e], ttl) {
					body = binary.AppendUvarint(body, use(id))
					body = binary.AppendUvarint(body, age(r.seen[e]))
				}
			}
		}
	}
	var pinBody []byte
	nPins := 0
	for i, key := range c.pinKeys {
		p := c.pins[i]
		if !liveEntry(p.id, p.seen, pinTTL) {
			continue
		}
		nPins++
		pinBody = binary.LittleEndian.AppendUint64(pinBody, key)
		pinBody = binary.AppendUvarint(pinBody, use(p.id))
		pinBody = binary.AppendUvarint(pinBody, age(p.seen))
	}

	buf = binary.AppendUvarint(buf, uint64(len(names)))
	for _, name := range names {
		buf = binary.AppendUvarint(buf, uint64(len(name)))
		buf = append(buf, name...)
	}
	buf = binary.AppendUvarint(buf, uint64(nRoutes))
	buf = append(buf, body...)
	buf = binary.AppendUvarint(buf, uint64(nPins))
	buf = append(buf, pinBody...)
	return binary.LittleEndian.AppendUint32(buf, crc32.Checksum(buf[start:], castagnoli))
}

// snapshotReader decodes a snapshot, failing with ErrSnapshotCorrupt on any inconsistency.
type snapshotReader struct {
	b   []byte
	err error
}

func (r *snapshotReader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.err = ErrSnapshotCorrupt
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *snapshotReader) uint64() uint64 {
	if r.err != nil || len(r.b) < 8 {
		r.err = ErrSnapshotCorrupt
		return 0
	}
	v := binary.LittleEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

func (r *snapshotReader) byte() byte {
	if r.err != nil || len(r.b) < 1 {
		r.err = ErrSnapshotCorrupt
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

// count reads an element count, refusing one that the remaining bytes cannot hold (so a damaged count
// never makes Restore allocate much).
func (r *snapshotReader) count(minBytes int) int {
	n := r.uvarint()
	if r.err == nil && n > uint64(len(r.b)/minBytes) {
		r.err = ErrSnapshotCorrupt
	}
	return int(n)
}

// Restore merges a snapshot written by AppendSnapshot (here or by another process) into the table, as
// Import does: per route and upstream the later time wins, entries past their TTL at the current time are
// skipped, remote routes stay remote, and LRU order is reproduced. It returns how many routes and pins
// it restored. A snapshot that is truncated or damaged returns ErrSnapshotCorrupt and one of a later
// format ErrSnapshotVersion; either way the table is left unchanged. Decoding happens before taking the
// exclusive lock, which is then held for O(routes + pins).
func (t *Table) Restore(data []byte) (routes, pins int, err error) {
	if len(data) < snapshotHeader+4 || string(data[:len(snapshotMagic)]) != snapshotMagic {
		return 0, 0, ErrSnapshotCorrupt
	}
	if v := data[len(snapshotMagic)]; v != SnapshotVersion {
		if v > SnapshotVersion {
			return 0, 0, fmt.Errorf("%w: version %d, this build reads %d", ErrSnapshotVersion, v, SnapshotVersion)
		}
		return 0, 0, ErrSnapshotCorrupt
	}
	body, sum := data[:len(data)-4], binary.LittleEndian.Uint32(data[len(data)-4:])
	if crc32.Checksum(body, castagnoli) != sum {
		return 0, 0, ErrSnapshotCorrupt
	}
	r := snapshotReader{b: body[len(snapshotMagic)+1:]}
	takenMs := int64(r.uint64())
	names := make([]string, r.count(1))
	for i := range names {
		n := r.uvarint()
		if r.err != nil || n == 0 || n > uint64(len(r.b)) {
			return 0, 0, ErrSnapshotCorrupt
		}
		names[i] = string(r.b[:n])
		r.b = r.b[n:]
	}
	seenAt := func(age uint64) int64 {
		return (takenMs - int64(min(age, 1<<40))) * int64(time.Millisecond)
	}
	type entry struct {
		key    uint64
		flags  byte
		ups    [MaxUpstreamsLimit]uint32 // name index + 1
		seen   [MaxUpstreamsLimit]int64
		isPin  bool
		remote bool
	}
	var entries []entry
	readEntry := func(e *entry, n int) {
		for i := range n {
			idx := r.uvarint()
			if idx >= uint64(len(names)) {
				r.err = ErrSnapshotCorrupt
				return
			}
			e.ups[i] = uint32(idx) + 1
			e.seen[i] = seenAt(r.uvarint())
		}
	}
	nRoutes := r.count(minRouteBytes)
	entries = make([]entry, 0, nRoutes)
	for range nRoutes {
		e := entry{key: r.uint64()}
		e.flags = r.byte()
		n := int(e.flags & 0x7)
		if n == 0 || n > MaxUpstreamsLimit || e.flags&^(flagRemote|0x7) != 0 {
			r.err = ErrSnapshotCorrupt
		}
		e.remote = e.flags&flagRemote != 0
		readEntry(&e, n)
		if r.err != nil {
			return 0, 0, r.err
		}
		entries = append(entries, e)
	}
	nPins := r.count(minPinBytes)
	for range nPins {
		e := entry{key: r.uint64(), isPin: true}
		readEntry(&e, 1)
		if r.err != nil {
			return 0, 0, r.err
		}
		entries = append(entries, e)
	}
	if r.err != nil || len(r.b) != 0 {
		return 0, 0, ErrSnapshotCorrupt
	}

	t.mu.Lock()
	defer t.mu.Unlock()
	t.stats.Changes++
	now := t.cfg.Now().UnixNano()
	ttl, pinTTL := int64(t.cfg.TTL), int64(t.cfg.ConversationTTL)
	ids := make([]uint32, len(names)) // interned lazily; held until the end so none is reclaimed mid-way
	id := func(idx uint32) uint32 {
		if ids[idx-1] == 0 {
			ids[idx-1] = t.ups.intern(names[idx-1])
			t.ups.ref(ids[idx-1])
		}
		return ids[idx-1]
	}
	for _, e := range entries {
		if e.isPin {
			if now-e.seen[0] <= pinTTL {
				t.importPinLocked(e.key, id(e.ups[0]), min(e.seen[0], now), now)
				pins++
			}
			continue
		}
		restored := false
		for i := MaxUpstreamsLimit - 1; i >= 0; i-- { // oldest first, so that ties keep the order
			if e.ups[i] == 0 || now-e.seen[i] > ttl {
				continue
			}
			t.mergeLocked(e.key, id(e.ups[i]), min(e.seen[i], now), now, e.remote, false)
			restored = true
		}
		if restored {
			routes++
		}
	}
	for _, x := range ids {
		if x != 0 {
			t.ups.unref(x)
		}
	}
	return routes, pins, nil
}
