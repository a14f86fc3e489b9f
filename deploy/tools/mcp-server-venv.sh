#!/usr/bin/env bash
# Install an MCP server from PyPI into a virtual environment of its own, once per machine.
#
#   deploy/tools/mcp-server-venv.sh NAME REQUIREMENT...    prints the venv's bin folder
#
# e.g. `mcp-server-venv.sh sqlite mcp-server-sqlite==2025.4.25 'mcp<2'`: the server's own
# `mcp` (1.x here) lives in its venv, beside the worker's 2.x, and VIGIL_MCP_SERVERS names
# `<bin folder>/mcp-server-sqlite` as its command (docs/agent.md, "An MCP server"). The venv
# is kept under ${VIGIL_TOOLS_DIR:-~/.cache/vigil/tools}/mcp-NAME-<hash of the requirements>/,
# outside the repository; a second call prints the folder and returns at once. Several
# callers at once: a lock makes the others wait for the one install. With uv on PATH (or
# VIGIL_UV naming it) the install is uv's (seconds instead of half a minute), else pip's.
set -euo pipefail

[ $# -ge 2 ] || { echo "usage: $0 NAME REQUIREMENT..." >&2; exit 2; }
name=$1
shift
hash=$(printf '%s\n' "$@" | sha256sum | cut -c1-12)
OUT="${VIGIL_TOOLS_DIR:-$HOME/.cache/vigil/tools}/mcp-$name-$hash"
PYTHON="${VIGIL_MCP_PYTHON:-python3}"
UV="${VIGIL_UV:-$(command -v uv || true)}"

if [ -e "$OUT/.done" ]; then
  echo "$OUT/bin"
  exit 0
fi
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
flock 9
if [ -e "$OUT/.done" ]; then  # another caller installed it meanwhile
  echo "$OUT/bin"
  exit 0
fi
rm -rf "$OUT"
echo "mcp-server-venv: installing $* into $OUT (once per machine)" >&2
if [ -n "$UV" ]; then
  "$PYTHON" -m venv --without-pip "$OUT"
  "$UV" pip install -q --python "$OUT/bin/python" "$@" >&2
else
  "$PYTHON" -m venv "$OUT"
  "$OUT/bin/pip" install -q --disable-pip-version-check "$@" >&2
fi
touch "$OUT/.done"
echo "$OUT/bin"
