#!/usr/bin/env bash
# Builds Caddy with this plugin the way `xcaddy build --with
# github.com/tokenrouter/caddy-llm@v0.0.0-00010101000000-000000000000=<checkout>` does, without xcaddy (it
# is not on the module proxy CI reaches): a temporary module outside the repository that requires the
# plugin with a replace to this checkout, a generated main with Caddy's standard modules and the plugin,
# go mod tidy, go build. Then checks what users get: list-modules shows the plugin's modules and not the
# simulator (vllm_sim belongs to this repository's cmd/caddy only), and `caddy llm upstreams` answers
# from a running instance.
#
#   .ci/xcaddy-build.sh            build in a temporary directory, check, remove it
#   KEEP=1 .ci/xcaddy-build.sh     keep the directory (and the binary) and print its path
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
plugin=github.com/tokenrouter/caddy-llm
caddy_version=$(cd "$repo" && go list -m -f '{{.Version}}' github.com/caddyserver/caddy/v2)

work=$(mktemp -d)
caddy_pid=
cleanup() {
	if [ -n "$caddy_pid" ]; then kill "$caddy_pid" 2>/dev/null || true; fi
	if [ "${KEEP:-}" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
cd "$work"

# The repository's CI runs with -mod=readonly; a fresh module needs go get and go mod tidy to write
# go.mod and go.sum, as xcaddy's does. Other flags are kept.
GOFLAGS="$(printf '%s' "${GOFLAGS:-}" | sed -E 's/(^| )-mod=[a-z]+//g') -mod=mod"
export GOFLAGS

# quiet runs a go command, showing its output only when it fails.
quiet() {
	"$@" >"$work/go.log" 2>&1 || { cat "$work/go.log"; echo "failed: $*"; return 1; }
}

cat >main.go <<EOF
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
	_ "$plugin"
)

func main() {
	caddycmd.Main()
}
EOF
go mod init caddy >/dev/null 2>&1
# The checksums of the dependencies the plugin already verified, so no checksum database is needed.
cp "$repo/go.sum" go.sum
# xcaddy's steps: the replace first, then `go get` pins Caddy and each plugin. The plugin is unpublished,
# so it is pinned at the zero pseudo-version, which Go resolves through the replace (README, Building).
go mod edit -replace="$plugin=$repo"
quiet go get "github.com/caddyserver/caddy/v2@$caddy_version"
quiet go get "$plugin@v0.0.0-00010101000000-000000000000" "github.com/caddyserver/caddy/v2@$caddy_version"
if [ "$(go list -m -f '{{.Version}}' "$plugin")" != v0.0.0-00010101000000-000000000000 ]; then
	echo "go.mod does not require the plugin at the zero pseudo-version:"; cat go.mod; exit 1
fi
quiet go mod tidy
quiet go build -o caddy .

modules=$(./caddy list-modules)
for want in http.reverse_proxy.selection_policies.llm http.matchers.llm admin.api.llm; do
	if ! grep -qx "$want" <<<"$modules"; then
		echo "list-modules lacks $want"; exit 1
	fi
done
if grep -q vllm_sim <<<"$modules"; then
	echo "list-modules shows the simulator, which must stay out of a plugin build:"
	grep vllm_sim <<<"$modules"; exit 1
fi
./caddy list-modules --versions | grep "llm" | sed "s/^/  /"

# The command, against a running instance; admin and site on unix sockets, so no port can collide.
cat >Caddyfile <<EOF
{
	admin unix/$work/admin.sock
	persist_config off
	auto_https off
}
http:// {
	bind unix/$work/http.sock
	reverse_proxy 127.0.0.1:9 {
		lb_policy llm
	}
}
EOF
HOME=$work XDG_DATA_HOME=$work XDG_CONFIG_HOME=$work ./caddy run --config Caddyfile >caddy.log 2>&1 &
caddy_pid=$!
# Ready once the report lists the configured upstream (the admin socket comes up before the config).
for _ in $(seq 100); do
	if out=$(./caddy llm upstreams --address "unix/$work/admin.sock" 2>&1) && grep -q '^127\.0\.0\.1:9 ' <<<"$out"; then
		break
	fi
	sleep 0.1
done
echo "$out" | sed 's/^/  /'
if ! grep -q '^UPSTREAM ' <<<"$out" || ! grep -q '^127\.0\.0\.1:9 ' <<<"$out" || ! grep -q '^Routes: ' <<<"$out"; then
	echo "caddy llm upstreams did not print the configured upstream and the route counters"; cat caddy.log; exit 1
fi
./caddy stop --address "unix/$work/admin.sock" >/dev/null 2>&1
wait "$caddy_pid" || true
caddy_pid=
echo "ok: a plugin build has the llm modules and command, and no simulator"
