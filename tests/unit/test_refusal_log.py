"""Refused calls are logged once per interval for each kind, with the count of those not logged."""

from __future__ import annotations

import logging
import time

import pytest

from auraed.server import authz
from auraed.server.authz import RefusalLog

INTERVAL = 0.3  # seconds: short, so the test sees an interval pass; long enough for six calls


def test_repeats_are_counted_and_reported_after_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    refusals = RefusalLog(INTERVAL)
    with caplog.at_level(logging.WARNING, logger=authz.__name__):
        for _ in range(5):
            refusals.refused("identity reader", "/a.B/C", "not allowed")
        refusals.refused("identity other", "/a.B/C", "not allowed")
        time.sleep(INTERVAL * 2)
        refusals.refused("identity reader", "/a.B/C", "not allowed")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "refused /a.B/C for identity reader: not allowed",
        "refused /a.B/C for identity other: not allowed",
        "refused /a.B/C for identity reader: not allowed (4 more like it since the last report)",
    ]


def test_the_refusals_tracked_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(authz, "MAX_REFUSALS_TRACKED", 3)
    refusals = RefusalLog(INTERVAL)
    for index in range(10):
        refusals.refused(f"identity {index}", "/a.B/C", "not allowed")
    assert len(refusals._seen) == 3
