"""This host's traffic profile (engine/traffic.py): one value a minute per local hour, in
quarter-octave bins, kept small."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from tests.test_policy import UTC, history
from vkvagent.engine.traffic import (
    PROFILE_MAX_VALUES,
    PROFILE_MIN_VALUES,
    TrafficProfile,
    bin_top,
    rate_bin,
)


def test_the_traffic_profile_keeps_one_value_a_minute_per_local_hour_and_stays_small() -> None:
    zone = ZoneInfo("Europe/Paris")
    at = datetime(2025, 3, 4, 2, 0, 30, tzinfo=UTC)  # 03:00:30 in Paris
    profile = TrafficProfile().record(2.0, at, zone)
    assert profile.hours == {3: {rate_bin(2.0): 1.0}} and profile.last == at.timestamp()
    assert profile.record(9.0, at + timedelta(seconds=59), zone) is profile
    assert profile.record(9.0, at + timedelta(seconds=60), zone).count(3) == 2
    # Quarter-octave bins: a rate is at most its bin's top, and the top is under 19 % above.
    for rate in (0.02, 0.5, 1.0, 3.3, 700.0):
        assert rate <= bin_top(rate_bin(rate)) < rate * 1.19
    assert rate_bin(0.0) == rate_bin(0.001) == -1
    # Weeks of history: an hour's counts are halved at the cap, so the profile stays small.
    long = history([1.0, 2.0] * 3000)
    assert PROFILE_MIN_VALUES <= long.count(3) < PROFILE_MAX_VALUES
    assert len(long.hours[3]) == 2
    data = json.loads(json.dumps(long.to_json()))
    assert TrafficProfile.from_json(data) == long
    for bad in ({}, {"last": None, "hours": {"24": {}}}, {"last": "x", "hours": {}},
                {"last": None, "hours": {"3": {"0": -1}}}):  # fmt: skip
        with pytest.raises(ValueError, match=r"^traffic profile: "):
            TrafficProfile.from_json(bad)
