package affinity

import "strings"

// upstreamTable interns upstream dial addresses so that route and pin entries hold a 4-byte ID instead of a
// string. IDs are reference counted: a slot is reclaimed as soon as no route entry, pin or in-progress call
// refers to it, so the table never holds more than 1 + MaxUpstreamsLimit*Capacity + ConversationCapacity
// slots (in practice: the number of distinct upstreams with live state). ID 0 is never issued; it marks an
// empty route entry.
//
// Forget marks a slot dead instead of freeing it: the name leaves byName at once (so Match, Pinned and
// RouteCount stop seeing it, and a re-added upstream of the same name gets a fresh ID), and the slot is
// reclaimed when its last reference goes. Not safe for concurrent use; the Table's lock guards it.
type upstreamTable struct {
	byName map[string]uint32
	slots  []upstreamSlot // index 0 unused
	free   []uint32
}

type upstreamSlot struct {
	name   string
	refs   int32 // route entries + pins + holds
	routes int32 // route entries only (RouteCount)
	live   bool  // false once forgotten
}

func newUpstreamTable() upstreamTable {
	return upstreamTable{byName: make(map[string]uint32), slots: make([]upstreamSlot, 1)}
}

// intern returns the live ID of name, issuing one if needed. A fresh ID has no references: the caller must
// ref or hold it before anything can evict.
func (u *upstreamTable) intern(name string) uint32 {
	if id, ok := u.byName[name]; ok {
		return id
	}
	var id uint32
	if n := len(u.free); n > 0 {
		id = u.free[n-1]
		u.free = u.free[:n-1]
	} else {
		id = uint32(len(u.slots))
		u.slots = append(u.slots, upstreamSlot{})
	}
	name = strings.Clone(name) // do not retain a caller's larger buffer
	u.slots[id] = upstreamSlot{name: name, live: true}
	u.byName[name] = id
	return id
}

// lookup returns the live ID of name, or 0. It does not allocate.
func (u *upstreamTable) lookup(name string) uint32 { return u.byName[name] }

func (u *upstreamTable) live(id uint32) bool { return u.slots[id].live }

func (u *upstreamTable) ref(id uint32) { u.slots[id].refs++ }

func (u *upstreamTable) refRoute(id uint32) {
	u.slots[id].refs++
	u.slots[id].routes++
}

func (u *upstreamTable) unrefRoute(id uint32) {
	u.slots[id].routes--
	u.unref(id)
}

// unref drops one reference and reclaims the slot when it was the last one.
func (u *upstreamTable) unref(id uint32) {
	s := &u.slots[id]
	s.refs--
	if s.refs > 0 {
		return
	}
	if s.live {
		delete(u.byName, s.name)
	}
	*s = upstreamSlot{}
	u.free = append(u.free, id)
}

// forget takes name out of service; returns its former ID, or 0 if it was unknown.
func (u *upstreamTable) forget(name string) uint32 {
	id, ok := u.byName[name]
	if !ok {
		return 0
	}
	delete(u.byName, name)
	u.slots[id].live = false
	return id
}

// inUse is the number of slots currently issued (live or forgotten but still referenced).
func (u *upstreamTable) inUse() int { return len(u.slots) - 1 - len(u.free) }
