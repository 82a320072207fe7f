"""A vLLM stand-in for tests, the demo and benchmarks: real-format metrics, vLLM's flags, and
the degradations operators see in production. Nothing here runs in the agent itself."""
