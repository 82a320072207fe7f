"""vkvagent: keeps self-hosted vLLM servers fast; restarts or re-tunes them only when it helps."""

__version__ = "0.1.0"
