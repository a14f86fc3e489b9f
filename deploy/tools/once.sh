# Sourced by the build-*.sh scripts: a Go tool built once per machine, outside the repository.
#
#   once_per_machine DIR PRINT FILE...
#
# When every FILE is an executable in DIR, prints PRINT and exits the calling script (0).
# Otherwise puts the Go toolchain on PATH (or exits 2 naming what is missing), takes DIR's
# lock, so that concurrent callers (parallel test sessions) wait for the one build, and looks
# again; returns to the caller, which builds while holding the lock.
once_per_machine() {
  local dir=$1 print=$2
  shift 2
  _once_built() {
    local file
    for file in "$@"; do [ -x "$dir/$file" ] || return 1; done
  }
  if _once_built "$@"; then
    echo "$print"
    exit 0
  fi
  command -v go >/dev/null 2>&1 || PATH="$PATH:/usr/local/go/bin"  # the Go toolchain's usual home
  command -v go >/dev/null 2>&1 || { echo "$(basename "$0" .sh): the Go toolchain (go 1.26+) is not on PATH" >&2; exit 2; }
  mkdir -p "$dir"
  exec 9>"$dir.lock"
  flock 9
  if _once_built "$@"; then  # another caller built it meanwhile
    echo "$print"
    exit 0
  fi
}
