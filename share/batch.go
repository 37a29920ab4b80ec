package share

import (
	"encoding/binary"
	"errors"
	"time"

	"github.com/tokenrouter/caddy-llm/affinity"
)

// Batch format, version 1 (little-endian; uvarint is encoding/binary's):
//
//	version   1 byte (batchVersion)
//	instance  uint64: the publishing instance's random ID
//	base      int64: unix milliseconds when the batch was encoded; ages count back from it
//	upstreams uvarint n, then n times: uvarint length, dial address bytes
//	changes   uvarint n, then n times: key uint64; uvarint upstream index<<1 | pin; uvarint age in ms
//
// A change is 10 bytes when its upstream index is under 64 and its age under 128ms (the usual case at a
// 100ms flush interval), 11 otherwise.
const batchVersion = 1

var errBatch = errors.New("undecodable batch")

func appendBatch(buf []byte, instance uint64, now time.Time, changes []affinity.Change) []byte {
	base := now.UnixMilli()
	buf = append(buf, batchVersion)
	buf = binary.LittleEndian.AppendUint64(buf, instance)
	buf = binary.LittleEndian.AppendUint64(buf, uint64(base))
	var names []string // a handful of upstreams: a linear search beats a map
	index := func(name string) uint64 {
		for i, n := range names {
			if n == name {
				return uint64(i)
			}
		}
		names = append(names, name)
		return uint64(len(names) - 1)
	}
	idx := make([]uint64, len(changes))
	for i, c := range changes {
		idx[i] = index(c.Upstream)
	}
	buf = binary.AppendUvarint(buf, uint64(len(names)))
	for _, n := range names {
		buf = binary.AppendUvarint(buf, uint64(len(n)))
		buf = append(buf, n...)
	}
	buf = binary.AppendUvarint(buf, uint64(len(changes)))
	for i, c := range changes {
		buf = binary.LittleEndian.AppendUint64(buf, c.Key)
		v := idx[i] << 1
		if c.Pin {
			v |= 1
		}
		buf = binary.AppendUvarint(buf, v)
		buf = binary.AppendUvarint(buf, uint64(max(base-c.Seen/int64(time.Millisecond), 0)))
	}
	return buf
}

// decodeBatch appends the changes of a batch to dst. Anything inconsistent is errBatch, with no partial
// result.
func decodeBatch(b []byte, dst []affinity.Change) (instance uint64, _ []affinity.Change, _ error) {
	if len(b) < 17 || b[0] != batchVersion {
		return 0, dst, errBatch
	}
	instance = binary.LittleEndian.Uint64(b[1:])
	base := int64(binary.LittleEndian.Uint64(b[9:]))
	b = b[17:]
	uvarint := func() (uint64, bool) {
		v, n := binary.Uvarint(b)
		if n <= 0 {
			return 0, false
		}
		b = b[n:]
		return v, true
	}
	nNames, ok := uvarint()
	if !ok || nNames > uint64(len(b)) {
		return 0, dst, errBatch
	}
	names := make([]string, nNames)
	for i := range names {
		n, ok := uvarint()
		if !ok || n == 0 || n > uint64(len(b)) {
			return 0, dst, errBatch
		}
		names[i] = string(b[:n])
		b = b[n:]
	}
	n, ok := uvarint()
	if !ok || n > uint64(len(b)/10) {
		return 0, dst, errBatch
	}
	start := len(dst)
	for range n {
		if len(b) < 8 {
			return 0, dst[:start], errBatch
		}
		c := affinity.Change{Key: binary.LittleEndian.Uint64(b)}
		b = b[8:]
		v, ok1 := uvarint()
		age, ok2 := uvarint()
		if !ok1 || !ok2 || v>>1 >= nNames {
			return 0, dst[:start], errBatch
		}
		c.Upstream = names[v>>1]
		c.Pin = v&1 == 1
		c.Seen = (base - int64(min(age, 1<<40))) * int64(time.Millisecond)
		dst = append(dst, c)
	}
	if len(b) != 0 {
		return 0, dst[:start], errBatch
	}
	return instance, dst, nil
}
