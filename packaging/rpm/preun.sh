# %preun of gpu-node-agent: what %systemd_preun expands to, then the node's configuration taken
# out. Removal (not upgrade) disables and stops the agent (its SIGTERM handling withdraws the
# device plugins from the kubelet), then `gpu-node-agent runtime unconfigure` puts back the
# engines' files as they were before the agent, removes the CDI specs it wrote, its /dev/char
# links and, when its DRA driver was on, its ResourceSlices: they name /usr/bin/gpu-node-agent
# and /usr/bin/gpu-node-agent-cdi-hook, which the erase deletes. Engines whose files change are
# restarted when systemd runs the machine (not in a chroot or under rpm --root); run
# `gpu-node-agent runtime unconfigure --no-restart` first to choose when they restart.
# If the unconfigure fails, the erase fails and the package stays (the agent enabled and
# started again as it was); GNA_FORCE_REMOVE=1 erases it anyway, leaving the agent's changes
# and their backups in /var/lib/gpu-node-agent/runtime.
if [ "$1" -eq 0 ]; then
    was_enabled=
    was_active=
    systemctl --quiet is-enabled gpu-node-agent.service >/dev/null 2>&1 && was_enabled=yes
    systemctl --quiet is-active gpu-node-agent.service >/dev/null 2>&1 && was_active=yes
    systemctl --no-reload disable --now gpu-node-agent.service >/dev/null 2>&1 || :
    if [ -d /run/systemd/system ]; then
        set -- /usr/bin/gpu-node-agent runtime unconfigure
    else
        set -- /usr/bin/gpu-node-agent runtime unconfigure --no-restart
    fi
    echo "gpu-node-agent: taking the agent's configuration off the node: $*"
    if ! "$@"; then
        if [ "${GNA_FORCE_REMOVE:-}" = 1 ]; then
            echo "gpu-node-agent: GNA_FORCE_REMOVE=1: erasing the package although the unconfigure failed (above); the engines' files and CDI specs that name its programs stay, and so do their backups in /var/lib/gpu-node-agent/runtime" >&2
            exit 0
        fi
        [ -z "$was_enabled" ] || systemctl --no-reload enable gpu-node-agent.service >/dev/null 2>&1 || :
        [ -z "$was_active" ] || systemctl start gpu-node-agent.service >/dev/null 2>&1 || :
        cat >&2 <<EOF
gpu-node-agent: the package is NOT erased: \`$*\` failed (above).
The container engines' files and the CDI specs the agent wrote still name its programs, which
erasing the package would delete, so GPU containers started afterwards would fail.
Fix what it reports and erase the package again (run \`gpu-node-agent runtime unconfigure\` to
try by hand), or erase it anyway, leaving those files as the agent wrote them and their
backups in /var/lib/gpu-node-agent/runtime:
  GNA_FORCE_REMOVE=1 dnf remove gpu-node-agent    (or rpm -e)
EOF
        exit 1
    fi
fi
