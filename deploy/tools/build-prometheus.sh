#!/usr/bin/env bash
# Build promtool and prometheus from the Prometheus Go module's source, once per machine.
#
#   deploy/tools/build-prometheus.sh        prints the folder holding both binaries
#
# The binaries are cached under ${VIGIL_TOOLS_DIR:-~/.cache/vigil/tools}/prometheus-<version>/,
# outside the repository; a second call prints the folder and returns at once. Several test
# sessions may call it at the same time: a lock makes the others wait for the one build
# (deploy/tools/once.sh).
#
# Why not `go install .../cmd/promtool@version`: the module's go.mod has `exclude`
# directives, which `go install pkg@version` refuses. Downloading the module and building
# inside it honours them. Both commands are built in one `go build` (they share nearly every
# package, so the second costs little), with -tags remove_all_sd: the service-discovery
# plugins (cloud SDKs) are most of the compile time and vigil's tests need only static targets.
set -euo pipefail

VERSION="${VIGIL_PROMETHEUS_VERSION:-v0.316.0}"  # Prometheus 3.x's Go module version
OUT="${VIGIL_TOOLS_DIR:-$HOME/.cache/vigil/tools}/prometheus-$VERSION"

. "$(dirname "$0")/once.sh"
once_per_machine "$OUT" "$OUT" promtool prometheus

export GOWORK=off GOFLAGS="-mod=mod"
started=$(date +%s)
dir=$(go mod download -json "github.com/prometheus/prometheus@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -n "$dir" ] || { echo "build-prometheus: go mod download gave no module folder" >&2; exit 2; }
echo "build-prometheus: building promtool and prometheus $VERSION (once per machine)" >&2
tmp=$(mktemp -d "$OUT.build.XXXXXX")
(cd "$dir" && go build -tags remove_all_sd -o "$tmp/" ./cmd/promtool ./cmd/prometheus)
mv "$tmp/promtool" "$tmp/prometheus" "$OUT/"
rmdir "$tmp"
echo "build-prometheus: built in $(( $(date +%s) - started ))s" >&2
echo "$OUT"
