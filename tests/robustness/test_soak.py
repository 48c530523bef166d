"""The soak test in small (``python -m hscache soak`` runs the long one): 200 k
scheduler-like operations on one manager with preemption, resets and KV events; RSS and live
Python objects must stay within the stated bounds after the warm-up, and every periodic
``check_invariants()`` must pass (see :mod:`hscache_tools.soak`)."""

from __future__ import annotations

import os

import pytest
from hscache_tools.soak import run_soak

pytestmark = pytest.mark.slow

OPS = int(os.environ.get("HSCACHE_SOAK_OPS", "200000"))


def test_soak_small() -> None:
    res = run_soak(OPS, check_every=10_000, samples=40)
    print("\n" + res.summary())
    assert res.ops >= OPS
    assert res.checks >= OPS // 10_000
    assert res.preemptions > 0 and res.resets > 0 and res.hit_tokens > 0 and res.events > 0
    assert not res.failures(), res.failures()
