package tokenize

// Boundary is a point in the prompt where a cached prefix may end: every message end, plus block steps
// inside long messages. Tokens is the number of prompt tokens before this point; Hash is a fixed-seed
// chained hash of everything before it, identical across processes so that independent proxies agree.
// Slices of boundaries are in increasing Tokens order. Step marks a step inside a message (the last
// boundary of a prompt is never one): where only a prompt sharing part of that message ends, so a route
// table may refresh it less often than the message ends a conversation continues from.
type Boundary struct {
	Tokens int
	Hash   uint64
	Step   bool
}
