package vllmsim

// kvCache is the simulated paged KV cache: a fixed array of blocks, a hash table of the full prompt
// blocks whose contents are known (vLLM's automatic prefix caching), and a free queue of unreferenced
// blocks in least-recently-freed order. Allocation pops the head of the free queue and evicts the hash
// of whatever that block held, so cached blocks that nobody references survive until they are the
// least recently used. It is not safe for concurrent use: Server guards it with its mutex. Every
// operation is O(1) per block touched; memory is O(NumGPUBlocks) plus one map entry per cached block.
type kvCache struct {
	blocks     []kvBlock
	cached     map[uint64]int32 // block hash -> block holding it
	head, tail int32            // free queue, -1 when empty
	free       int              // blocks in the free queue
	evictions  int64            // cached blocks whose hash was dropped to reuse the block
}

type kvBlock struct {
	hash       uint64
	hashed     bool  // hash is valid and cached[hash] == this block
	ref        int32 // running requests using the block
	prev, next int32 // free-queue links, -1 at the ends
	inFree     bool
}

func newKVCache(n int) *kvCache {
	c := &kvCache{blocks: make([]kvBlock, n), cached: make(map[uint64]int32), head: -1, tail: -1}
	for i := range c.blocks {
		c.blocks[i].prev, c.blocks[i].next = -1, -1
		c.pushFree(int32(i))
	}
	return c
}

// used is the number of blocks referenced by running requests.
func (c *kvCache) used() int { return len(c.blocks) - c.free }

// lookup counts the leading hashes that are cached, at most limit, and how many of those blocks are
// unreferenced (in the free queue, so that taking them costs free capacity).
func (c *kvCache) lookup(hashes []uint64, limit int) (hits, hitsFree int) {
	for _, h := range hashes[:min(limit, len(hashes))] {
		id, ok := c.cached[h]
		if !ok {
			break
		}
		hits++
		if c.blocks[id].ref == 0 {
			hitsFree++
		}
	}
	return hits, hitsFree
}

// take references the cached block holding h. The caller has checked with lookup that it exists.
func (c *kvCache) take(h uint64) int32 {
	id := c.cached[h]
	b := &c.blocks[id]
	if b.ref == 0 {
		c.removeFree(id)
	}
	b.ref++
	return id
}

// allocate takes the least recently used free block, evicting its cached contents. The caller has
// checked that the free queue is not empty.
func (c *kvCache) allocate() int32 {
	id := c.head
	c.removeFree(id)
	b := &c.blocks[id]
	if b.hashed {
		delete(c.cached, b.hash)
		b.hashed = false
		c.evictions++
	}
	b.ref = 1
	return id
}

// register records that block id holds the full block with hash h, unless another block already does
// (two requests prefilling the same prefix at once: the first one stays the cached copy).
func (c *kvCache) register(id int32, h uint64) {
	if _, ok := c.cached[h]; ok {
		return
	}
	b := &c.blocks[id]
	if b.hashed {
		delete(c.cached, b.hash)
	}
	b.hash, b.hashed = h, true
	c.cached[h] = id
}

// release drops one reference to each block; blocks that become unreferenced join the tail of the free
// queue in reverse order, so a sequence's last blocks are evicted before its first (shared) ones.
func (c *kvCache) release(ids []int32) {
	for i := len(ids) - 1; i >= 0; i-- {
		id := ids[i]
		b := &c.blocks[id]
		b.ref--
		if b.ref == 0 {
			c.pushFree(id)
		}
	}
}

func (c *kvCache) pushFree(id int32) {
	b := &c.blocks[id]
	b.prev, b.next, b.inFree = c.tail, -1, true
	if c.tail >= 0 {
		c.blocks[c.tail].next = id
	} else {
		c.head = id
	}
	c.tail = id
	c.free++
}

func (c *kvCache) removeFree(id int32) {
	b := &c.blocks[id]
	if b.prev >= 0 {
		c.blocks[b.prev].next = b.next
	} else {
		c.head = b.next
	}
	if b.next >= 0 {
		c.blocks[b.next].prev = b.prev
	} else {
		c.tail = b.prev
	}
	b.prev, b.next, b.inFree = -1, -1, false
	c.free--
}
