"""What vkvagent knows and the formats it reads and writes: vLLM's flags, command line and metrics;
systemd's drop-ins and hardening; its own configuration, events and status. Nothing here talks
to the outside world but to read or write a file it is handed.
"""
