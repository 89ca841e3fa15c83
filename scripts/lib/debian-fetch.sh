# shellcheck shell=bash
# Sourced by scripts/package and scripts/check-packages (from the repository root): Debian
# packages of this machine's or the other GPU architecture (amd64, arm64), fetched from the
# archive this system's apt sources name and unpacked with dpkg-deb -x under .tools/: nothing is
# installed, no maintainer script runs, and this system's dpkg database, apt lists and
# architectures are not changed (the apt state of these fetches is .tools/apt).
#
#   debian_fetch DIR PACKAGE[:ARCH][=VERSION]...  unpacks the packages into DIR, once (a stamp
#                                                  in DIR names them; other names, a new DIR)
#   debian_apt_cache ARGS...                       apt-cache over that state (policy, depends)

debian_fetch_state=$PWD/.tools/apt
# shellcheck disable=SC2034 # for the scripts that source this
debian_host_arch=$(dpkg --print-architecture)

debian_apt_opts() {
  printf '%s\n' -q -o "Dir::State::Lists=$debian_fetch_state/lists" -o "Dir::Cache=$debian_fetch_state/cache" \
    -o APT::Architectures::=amd64 -o APT::Architectures::=arm64 -o APT::Sandbox::User=root
}

# The package lists for both architectures, refreshed when older than a day (Debian's security
# archive keeps only the newest build of a package, so an old list names files that are gone).
debian_update() {
  local opts
  mapfile -t opts < <(debian_apt_opts)
  mkdir -p "$debian_fetch_state/lists/partial" "$debian_fetch_state/cache/archives/partial"
  if [ -n "$(find "$debian_fetch_state/lists" -maxdepth 1 -name '*Packages*' -mtime -1 -print -quit)" ] &&
    [ "${1:-}" != --force ]; then
    return 0
  fi
  echo "== apt-get update into $debian_fetch_state (amd64 and arm64 lists; the system's are not changed)"
  apt-get "${opts[@]}" update >/dev/null
}

debian_apt_cache() {
  local opts
  mapfile -t opts < <(debian_apt_opts)
  debian_update
  apt-cache "${opts[@]}" "$@"
}

debian_fetch() {
  local dir=$1 opts debs
  shift
  if [ -f "$dir/.fetched" ] && [ "$(cat "$dir/.fetched")" = "$*" ]; then return 0; fi
  mapfile -t opts < <(debian_apt_opts)
  debian_update
  echo "== fetching $* into $dir (unpacked, not installed)"
  debs=$debian_fetch_state/debs
  rm -rf "$debs" "$dir.tmp" && mkdir -p "$debs" "$dir.tmp"
  (cd "$debs" && apt-get "${opts[@]}" download "$@" >/dev/null) ||
    { debian_update --force && (cd "$debs" && apt-get "${opts[@]}" download "$@" >/dev/null); } || {
    echo "debian-fetch: apt-get download $* failed (above)" >&2
    return 1
  }
  for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$dir.tmp"; done
  echo "$*" >"$dir.tmp/.fetched"
  rm -rf "$dir" "$debs" && mv "$dir.tmp" "$dir"
}

# The Debian architecture of a Rust target triple's CPU.
debian_arch_of() {
  case "$1" in
  x86_64-*) echo amd64 ;;
  aarch64-*) echo arm64 ;;
  *) echo "debian-fetch: no Debian architecture for $1" >&2 && return 1 ;;
  esac
}
