# %postun of gpu-node-agent: what %systemd_postun_with_restart expands to, with the daemon-reload
# that RHEL 8's systemd file triggers also do (harmless twice). An upgrade restarts a running
# agent with the new binary; a stopped one stays stopped. State under /var/lib/gpu-node-agent is
# kept, as RPM packages keep data. The package owns /etc/gpu-node-agent and its config.d/, so
# rpm removes them on erase when nothing is left in them (an edited config.toml is kept as
# config.toml.rpmsave, drop-ins stay).
systemctl daemon-reload >/dev/null 2>&1 || :
if [ "$1" -ge 1 ]; then
    systemctl try-restart gpu-node-agent.service >/dev/null 2>&1 || :
fi
