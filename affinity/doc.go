// Package affinity learns where each prompt prefix is probably held in an upstream's KV cache, and which
// upstream each client conversation was pinned to, in a Table of bounded size.
//
// # Routes
//
// Learn is called after a request has been routed, with the prompt's boundaries (message ends and block
// steps inside long messages, from package tokenize) and the upstream that received it. Each boundary is
// aligned down to the engine's cache block size (an engine caches whole blocks only); boundaries that
// align to the same block collapse into one route keyed by the earliest of them, so a request that
// shares only the first of those messages still matches the block. The steps inside a message
// (Boundary.Step) are learned with its end only when that end is news on the upstream (not listed, or
// last learned in an earlier TTL/8 interval): a repeated 16 KB system prompt costs a request two route
// updates, not 64, and a prompt sharing part of the message still matches its steps. A route's key is
// RouteKey(ModelHash(model), boundary hash): a fixed-seed hash of the whole prefix, scoped by model. The
// route lists up to MaxUpstreamsPerRoute (4) upstreams with the time each was last sent that prefix; the
// older holders of a prefix learned on more upstreams than that (a popular system prompt across a pool of
// 8 or 16) move to its overflow routes, ordinary routes under keys derived from the route's and the
// upstream's name (Config.OverflowRoutes), which Match probes for the candidates a full route does not
// list. Without them, a pool of 16 matched a hot prefix on its 4 most recent holders only, priced the
// others as full prefills of it, and piled the prefix onto those 4.
//
// Match answers, for each candidate upstream, the aligned length of the longest learned prefix of the
// request on that upstream. Because a route exists for every block-aligned message boundary, a continuing
// conversation matches its previous request, a branch matches the shared system prompt, and a
// conversation resumed from its middle matches the history it shares. Routes older than TTL are not
// trusted: the engine has probably evicted them. Nor is a route of an upstream that the prompt's first
// block's route does not list: an engine's block hashes chain, so it never hits blocks past one it has
// evicted. Learn keeps a prompt's first block its most recently learned route, so the LRU evicts a
// prefix from its end too, and Match settles the upstreams that hold nothing of a prompt in one probe
// instead of one a boundary. Only the candidates passed in are considered, so an
// upstream that left the pool never matches; Forget also drops its state.
//
// Deciding between cache and load is not done here: see package selection.
//
// # Conversation pins
//
// Pin and Pinned map a client-sent conversation ID (hashed with the model; never stored) to the upstream
// that last served it, with their own TTL and capacity. A pin is a preference for the selector to weigh,
// never a reason to send work to an unhealthy upstream.
//
// # Memory
//
// Routes and pins live in two hashicorp/golang-lru/v2 LRUs of fixed capacity, so traffic with endless
// unique prefixes (or conversation IDs) cannot grow memory past the caps: it only evicts. A route value
// is 48 bytes with no pointers (four 4-byte upstream IDs and four int64 timestamps); upstream dial
// addresses are interned in a reference-counted table whose slots are reclaimed when the last route
// entry or pin referring to them goes, so it holds at most as many names as upstreams with live state.
//
// Measured with runtime.MemStats around filling a table (Go 1.26, amd64, see BenchmarkLearn and
// TestBytesPerRoute): 142 heap bytes per route at 10k routes, 150 at 1M, 159 at 100k with churn
// (the LRU element is 112 bytes, the rest is the hash map). A pin costs about 118 bytes. The default
// Capacity of 100_000 routes therefore costs about 15 MB, and the default 100_000 pins about 12 MB.
//
// Sizing: a route is a block-aligned message boundary an upstream was sent, not a cache block. One GPU
// holds roughly 10^5 to 10^6 tokens of KV cache, i.e. a few hundred to a few thousand conversations of a
// few thousand tokens with one route per message; 100_000 routes covers tens of such GPUs before the LRU
// evicts anything the engines would still hold. Size Capacity to the cluster's real KV capacity
// (approximate indexes that outlive the engine's cache predict hits that are not there).
//
// # Concurrency and cost
//
// A Table is safe for concurrent use. Match, Pinned, RouteCount, Stats and Export share a read lock
// and do not modify the table (Match does not refresh recency: the Learn after every routed request does);
// Learn, Pin, Forget, Clear, Expire, Import, ImportChanges, Restore, DrainFeed and Reconfigure take the
// exclusive lock; AppendSnapshot holds the shared lock only to copy. Learn is
// O(len(bounds)) LRU operations; Match is O(len(bounds)) map lookups (each compared with the few
// candidates) and does not allocate; Forget and Export are O(routes + pins). Since recency is the order of
// the last Learn, the expired routes are exactly a tail of the LRU: each Learn removes a bounded number
// of them and Expire removes all of them.
//
// # Reloads, snapshots and sharing
//
// Reconfigure changes the shape of a live Table, so a config reload keeps what was learned. Keys use
// fixed seeds, so two proxies compute the same key for the same prefix or conversation.
//
// AppendSnapshot writes the live routes and pins in a versioned, checksummed binary format (about 11-13
// bytes a route, see snapshot.go) after copying them under the shared lock, so storage I/O never holds
// it; Restore merges one back, skipping what its TTL has expired, and refuses a damaged or later-version
// snapshot (ErrSnapshotCorrupt, ErrSnapshotVersion) without changing the table.
//
// For sharing between instances, EnableFeed makes Learn and Pin record what they learn in a bounded
// buffer that DrainFeed empties (a full feed drops, it never blocks); a peer applies the Changes with
// ImportChanges. Routes known only from peers live in a second, remote LRU: Match consults both, a
// remote route learned here becomes local, and when the table is full remote routes are evicted before
// any local one - this instance's observations are ground truth, a peer's are second-hand. Pins are
// global: the latest pin of a conversation wins wherever it was made. Capacity bounds local plus remote
// routes. Export and Import move RouteRecords (names and times, no encoding) for callers that want them.
package affinity
