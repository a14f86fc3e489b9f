#!/usr/bin/env bash
# Build a Go command with `go install MODULE@VERSION`, once per machine.
#
#   deploy/tools/build-go-install.sh NAME MODULE VERSION      prints the path of the binary
#
# e.g. `build-go-install.sh kube-score github.com/zegl/kube-score/cmd/kube-score v1.20.0`.
# The binary is cached under ${VIGIL_TOOLS_DIR:-~/.cache/vigil/tools}/NAME-VERSION/NAME,
# outside the repository; a second call prints the path and returns at once, and concurrent
# callers (`make tools` in the background, a test that needs the tool) wait for the one build
# (deploy/tools/once.sh).
set -euo pipefail

[ $# -eq 3 ] || { echo "usage: $0 NAME MODULE VERSION" >&2; exit 2; }
name=$1 module=$2 version=$3
OUT="${VIGIL_TOOLS_DIR:-$HOME/.cache/vigil/tools}/$name-$version"

. "$(dirname "$0")/once.sh"
once_per_machine "$OUT" "$OUT/$name" "$name"

started=$(date +%s)
echo "build-go-install: building $name $version (once per machine)" >&2
GOBIN="$OUT" go install "$module@$version"
echo "build-go-install: $name built in $(( $(date +%s) - started ))s" >&2
echo "$OUT/$name"
