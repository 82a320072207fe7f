"""Acting on the unit: the one restart path (preflight, drain, drop-in, restart, readiness,
attestation, rollback) and what each step leaves in the ledger.
"""
