// Command caddy is Caddy with the standard modules and the caddy-llm plugin: the same main that
// `xcaddy build --with github.com/tokenrouter/caddy-llm` generates, so a clone can run
// `go run ./cmd/caddy run --config examples/Caddyfile` without installing xcaddy.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	// The simulated vLLM backend for the demo and the benchmark; not part of the plugin.
	_ "github.com/tokenrouter/caddy-llm/bench/vllmsim/caddysim"

	_ "github.com/tokenrouter/caddy-llm"
)

func main() {
	caddycmd.Main()
}
