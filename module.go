// Package caddyllm is a Caddy plugin that load-balances OpenAI-compatible LLM inference servers.
package caddyllm

import (
	_ "github.com/caddyserver/caddy/v2/caddytest"
	_ "github.com/cespare/xxhash/v2"
	_ "github.com/hashicorp/golang-lru/v2"
	_ "github.com/pkoukk/tiktoken-go"
	_ "github.com/pkoukk/tiktoken-go-loader"
	_ "github.com/prometheus/common/expfmt"
	_ "go.uber.org/zap"
)
