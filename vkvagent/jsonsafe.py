"""JSON for values that may hold NaN or infinity (rates over an empty window, ratios against
zero): those become null, because JSON has no such numbers and jq, SIEMs and browsers refuse
Python's ``NaN``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float, however deeply nested, replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
