#!/bin/bash
# Bootstraps gpu-node-agent on a new GPU node, before the kubelet joins (cloud-init runcmd, an
# image build, or by hand as root):
#
#   1. installs the package: a .deb or .rpm given by URL or path, or `gpu-node-agent` from the
#      apt/dnf repositories already configured on the node;
#   2. writes a config drop-in from GNA_CONFIG / GNA_CONFIG_FILE, or keeps what is there (the
#      packaged /etc/gpu-node-agent/config.toml and any drop-in cloud-init's write_files put in
#      /etc/gpu-node-agent/config.d/), and checks the result with `gpu-node-agent config check`;
#   3. runs `gpu-node-agent run --once`: driver, container runtime, MIG layout, CDI spec;
#   4. enables the service, and starts it where systemd runs (not in a chroot image build).
#
# Usage: bootstrap.sh [PACKAGE]     (PACKAGE overrides GNA_PACKAGE)
#
# Environment:
#   GNA_PACKAGE          URL (http/https) or local path of gpu-node-agent_*.deb / *.rpm; empty:
#                        install gpu-node-agent from the configured repositories
#   GNA_PACKAGE_SHA256   sha256 the package file must have (checked when set)
#   GNA_VERSION          version to install from the repositories (empty: the newest)
#   GNA_CONFIG           TOML text written to /etc/gpu-node-agent/config.d/50-bootstrap.toml
#   GNA_CONFIG_FILE      a file copied there instead
#   GNA_BUSY_RETRIES     how often `run --once` is retried while GPU work blocks a change (3)
#   GNA_BUSY_WAIT        seconds between those tries (60)
#   GNA_START_ON_FAILURE 1 (default): enable and start the service even when a stage failed, so
#                        the daemon retries it with backoff; 0: leave the service disabled
#
# Exit status: 0 the node is configured and the service enabled; 1 a stage failed (the agent's
# status is printed; cloud-init reports the failure); 64 invalid configuration (the service is not
# started); 75 GPU work still blocked a change after the retries (the service is enabled and
# finishes it when the work is gone); 2 usage or installation errors.
set -euo pipefail

readonly DROP_IN=/etc/gpu-node-agent/config.d/50-bootstrap.toml
readonly UNIT=gpu-node-agent.service

log() { printf 'gpu-node-agent bootstrap: %s\n' "$*" >&2; }
die() {
	log "$*"
	exit 2
}

usage() {
	sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

case "${1:-}" in
-h | --help)
	usage
	exit 0
	;;
esac
[ $# -le 1 ] || die "at most one argument (the package); see --help"
package=${1:-${GNA_PACKAGE:-}}
busy_retries=${GNA_BUSY_RETRIES:-3}
busy_wait=${GNA_BUSY_WAIT:-60}
start_on_failure=${GNA_START_ON_FAILURE:-1}

[ "$(id -u)" = 0 ] || die "must run as root"

# The node's package manager: apt (Debian, Ubuntu) or dnf/yum (RHEL, Rocky, Alma, Fedora, Amazon
# Linux). A package file must match it.
if command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then
	family=deb
elif command -v dnf >/dev/null 2>&1; then
	family=rpm pm=dnf
elif command -v yum >/dev/null 2>&1; then
	family=rpm pm=yum
else
	die "neither apt-get nor dnf/yum found: install the package by hand"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# A URL is downloaded first; the file keeps its name (apt and dnf tell packages by extension).
fetch() {
	local url=$1 out
	out="$tmp/$(basename "${url%%\?*}")"
	log "downloading $url"
	if command -v curl >/dev/null 2>&1; then
		curl -fsSL --retry 5 --retry-delay 3 -o "$out" "$url" || die "cannot download $url"
	elif command -v wget >/dev/null 2>&1; then
		wget -q --tries=5 -O "$out" "$url" || die "cannot download $url"
	else
		die "neither curl nor wget to download $url"
	fi
	printf '%s\n' "$out"
}

install_package() {
	local file=$1
	if [ -n "$file" ]; then
		case "$file" in
		http://* | https://*) file=$(fetch "$file") ;;
		esac
		[ -f "$file" ] || die "no package file $file"
		if [ -n "${GNA_PACKAGE_SHA256:-}" ]; then
			local sum
			sum=$(sha256sum "$file" | cut -d' ' -f1)
			[ "$sum" = "$GNA_PACKAGE_SHA256" ] || die "$file has sha256 $sum, expected $GNA_PACKAGE_SHA256"
		fi
		case "$family:$file" in
		deb:*.deb | rpm:*.rpm) ;;
		*) die "$file is not a .$family package, which this node's package manager installs" ;;
		esac
		# A path with a slash makes apt-get and dnf install the file and resolve its dependencies.
		case "$file" in
		*/*) ;;
		*) file=./$file ;;
		esac
	fi
	log "installing ${file:-gpu-node-agent${GNA_VERSION:+ $GNA_VERSION} from the repositories}"
	if [ "$family" = deb ]; then
		export DEBIAN_FRONTEND=noninteractive
		if [ -z "$file" ]; then
			apt-get update -q
			file=gpu-node-agent${GNA_VERSION:+=$GNA_VERSION}
		fi
		# --force-confold: a config.toml already edited on this node is kept, never prompted for.
		apt-get install -y -q -o Dpkg::Options::=--force-confold "$file" || die "apt-get install $file failed"
	else
		[ -n "$file" ] || file=gpu-node-agent${GNA_VERSION:+-$GNA_VERSION}
		"$pm" install -y "$file" || die "$pm install $file failed"
	fi
}

install_package "$package"
command -v gpu-node-agent >/dev/null 2>&1 || die "gpu-node-agent is not on PATH after the installation"

# Config: a drop-in beside the packaged config.toml, which the package manager keeps as the
# administrator's file; `config check` exits 64 naming the file, line and key of an error.
if [ -n "${GNA_CONFIG:-}" ] || [ -n "${GNA_CONFIG_FILE:-}" ]; then
	mkdir -p "$(dirname "$DROP_IN")"
	if [ -n "${GNA_CONFIG_FILE:-}" ]; then
		install -m 0644 "$GNA_CONFIG_FILE" "$DROP_IN"
	else
		printf '%s\n' "$GNA_CONFIG" >"$DROP_IN.tmp"
		chmod 0644 "$DROP_IN.tmp"
		mv "$DROP_IN.tmp" "$DROP_IN"
	fi
	log "wrote $DROP_IN"
fi
if ! gpu-node-agent config check >"$tmp/effective.toml"; then
	log "invalid configuration (see above): not running the agent"
	exit 64
fi

systemd_running() { [ -d /run/systemd/system ]; }

# One agent at a time: a service left running by an earlier bootstrap is stopped for the pass.
if systemd_running && systemctl is-active --quiet "$UNIT"; then
	log "stopping the running $UNIT for the bootstrap pass"
	systemctl stop "$UNIT"
fi

# One reconcile pass. 75: GPU work blocks a MIG or driver change, nothing was changed; retried.
run_once() {
	local tries=0 rc
	while :; do
		rc=0
		gpu-node-agent run --once || rc=$?
		[ "$rc" = 75 ] || return "$rc"
		tries=$((tries + 1))
		[ "$tries" -le "$busy_retries" ] || return 75
		log "GPU work is running, nothing was changed; trying again in ${busy_wait}s ($tries/$busy_retries)"
		sleep "$busy_wait"
	done
}

log "gpu-node-agent run --once"
rc=0
run_once || rc=$?
case "$rc" in
0) log "the node is configured" ;;
64)
	log "invalid configuration: the service is not enabled"
	exit 64
	;;
75) log "GPU work still blocks a change: the service finishes it once the work is gone" ;;
*)
	log "run --once exited $rc: a stage failed; the agent's status:"
	gpu-node-agent status >&2 || true
	if [ "$start_on_failure" != 1 ]; then
		log "GNA_START_ON_FAILURE=$start_on_failure: the service is left disabled"
		exit "$rc"
	fi
	log "enabling the service anyway: it retries the failed stage with backoff"
	;;
esac

if systemd_running; then
	systemctl enable --now "$UNIT"
	log "$UNIT enabled and started"
else
	# A chroot or image build: enabled now, started on the image's first boot.
	systemctl enable "$UNIT"
	log "$UNIT enabled (systemd is not running here: it starts on boot)"
fi

case "$rc" in
0) exit 0 ;;
75) exit 75 ;;
*) exit 1 ;;
esac
