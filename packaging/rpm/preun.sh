# %preun of gpu-node-agent: what %systemd_preun expands to. Removal (not upgrade) disables and
# stops the agent; its SIGTERM handling withdraws the device plugins from the kubelet. The
# container runtime configuration it wrote stays: run `gpu-node-agent runtime unconfigure` first
# to put the previous files back.
if [ "$1" -eq 0 ]; then
    systemctl --no-reload disable --now gpu-node-agent.service >/dev/null 2>&1 || :
fi
