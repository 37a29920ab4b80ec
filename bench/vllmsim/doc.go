// Package vllmsim is a simulated vLLM server for benchmarks and demos: an http.Handler that speaks
// the OpenAI completion API and /metrics like vLLM (or SGLang) and reproduces the engine behaviour that
// load balancing affects, on a 2-core machine without a GPU.
//
// The engine is one goroutine running continuous batching on a simulated clock: up to MaxNumSeqs
// running sequences, a FIFO waiting queue with head-of-line blocking, chunked prefill whose cost is
// proportional to the uncached prompt tokens, and decode steps whose time grows with the batch. The KV
// cache is paged (BlockSize tokens per block, NumGPUBlocks blocks) with vLLM-style automatic prefix
// caching: full prompt blocks are identified by a chained xxhash, reused by later requests that share
// the prefix, and evicted least-recently-used when unreferenced blocks are needed.
//
// The Responses API (POST /v1/responses) is served as vLLM serves it: instructions and input items are
// templated as chat messages, a response is stored (unless "store": false) on this server alone, a
// request continuing one (previous_response_id) prefills its conversation and is answered 404 by any
// other server, and GET and DELETE /v1/responses/{id} retrieve and delete it.
//
// A completion request with n > 1 runs n sequences of the prompt, each a request of the engine's own (a
// slot, its KV blocks, its output), as vLLM runs them, and is answered with n choices: whole, or streamed
// with each chunk carrying its choice's index; the usage counts the prompt once and every sequence's
// output.
//
// Embeddings (POST /v1/embeddings) are prefilled in the batch like any request, without the prefix cache
// (an encoder's input has no prefix computed alone), and answered with one unit vector per input, as
// floats or base64.
//
// LoRA adapters (Config.LoRAAdapters) are served under their own model names from MaxLoRAs slots: the
// step that admits a request whose adapter is not resident lasts LoRALoadTime longer, the least recently
// used idle adapter is evicted for it, a request whose adapter finds no free slot is skipped until one
// frees (as vLLM's scheduler does), and /metrics exports vllm:lora_requests_info.
//
// Tokenization is deliberately cheap: the templated prompt (per chat message "<|role|>\n" + content +
// "\n") is cut into 4-byte pieces, one token each. Output tokens are 4-byte words.
//
// Every simulated duration is divided by Config.TimeScale and slept on a real timer, so a realistic
// configuration runs many times faster than real time with the same shape of results.
package vllmsim
