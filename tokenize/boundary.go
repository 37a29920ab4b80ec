package tokenize

// Boundary is a point in the prompt where a cached prefix may end: every message end, plus block steps
// inside long messages. Tokens is the number of prompt tokens before this point; Hash is a fixed-seed
// chained hash of everything before it, identical across processes so that independent proxies agree.
// Slices of boundaries are in increasing Tokens order.
type Boundary struct {
	Tokens int
	Hash   uint64
}
