"""Reliability checks of vkvagent: fuzzing, fault injection against a real systemd, and a
simulated week's soak. ``make reliability`` runs them at full size (``python -m reliability``)
and prints the table docs/RELIABILITY.md records; tests/test_reliability_*.py run them small."""
