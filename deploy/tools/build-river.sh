#!/usr/bin/env bash
# Build River's CLI (`river`, the peer the bench measures vigil against), once per machine.
#
#   deploy/tools/build-river.sh        prints the path of the binary
#
# The version and the hash of every module the build uses are pinned in deploy/tools/river/
# (go.mod names github.com/riverqueue/river/cmd/river as a tool; go.sum holds the h1: hashes,
# checked against Go's checksum database when they were taken). The build trusts that go.sum
# alone: -mod=readonly refuses a module it has no hash for, GOSUMDB=off keeps the checksum
# database out of it (machines may reach the module proxy without it), and the go command
# refuses any download whose hash differs. The binary is cached under
# ${VIGIL_TOOLS_DIR:-~/.cache/vigil/tools}/river-<version>/, outside the repository; a second
# call prints the path and returns at once (deploy/tools/once.sh).
set -euo pipefail

MODULE="$(cd "$(dirname "$0")/river" && pwd)"
VERSION=$(sed -n 's#^[[:space:]]*github.com/riverqueue/river/cmd/river \(v[^ ]*\).*#\1#p' "$MODULE/go.mod")
[ -n "$VERSION" ] || { echo "build-river: no version of github.com/riverqueue/river/cmd/river in $MODULE/go.mod" >&2; exit 2; }
OUT="${VIGIL_TOOLS_DIR:-$HOME/.cache/vigil/tools}/river-$VERSION"

. "$(dirname "$0")/once.sh"
once_per_machine "$OUT" "$OUT/river" river

export GOWORK=off GOFLAGS="-mod=readonly -buildvcs=false" GOSUMDB=off
started=$(date +%s)
echo "build-river: building River's CLI $VERSION (once per machine)" >&2
tmp=$(mktemp -d "$OUT.build.XXXXXX")
(cd "$MODULE" && go build -o "$tmp/river" github.com/riverqueue/river/cmd/river)
mv "$tmp/river" "$OUT/river"
rmdir "$tmp"
echo "build-river: built in $(( $(date +%s) - started ))s" >&2
echo "$OUT/river"
