"""The outside world, one module per source or store: vLLM over HTTP, the GPUs through NVML,
systemd over D-Bus, cgroups and the journal, SQLite, etcd, Prometheus, and the agent's own
metrics endpoint.
"""
