package caddyllm

import "net/http"

// The hooks llm_resume calls as a stream's tokens pass through it. Stubs: replaced by the policy's phase
// accounting (a request is "prefilling" until its first token, then decoding).

// noteFirstToken is called when the first content chunk of an attempt's stream reaches the client.
func noteFirstToken(r *http.Request) {}

// noteToken is called for every later content chunk, with the tokens it carries (1 when unknown).
func noteToken(r *http.Request, tokens int) {}
