# %post of gpu-node-agent: what %systemd_post expands to (systemd-rpm-macros, RHEL 8 and later).
# A fresh install applies the system's preset: RHEL, Rocky and Fedora presets leave a service
# they do not list disabled, so nothing starts until `systemctl enable --now gpu-node-agent`
# (packaging/cloud-init/bootstrap.sh does that after `gpu-node-agent run --once`). An image
# builder can enable it with a preset file: `enable gpu-node-agent.service` in
# /etc/systemd/system-preset/50-gpu-node-agent.preset.
if [ "$1" -eq 1 ]; then
    systemctl --no-reload preset gpu-node-agent.service >/dev/null 2>&1 || :
fi
