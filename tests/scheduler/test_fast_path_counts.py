"""``fast_path_counts``: the per-phase counters of ``hscache.vllm.Scheduler`` / ``AsyncScheduler``.

A small real vLLM scheduler (built offline) steps a few requests through admission,
prefill and decode; the counters must count every ``schedule()`` call, every request
handed to ``update_from_output()``, and exactly the calls and requests the fast path
served (observed by wrapping ``hscache.vllm.step``'s entry points), with the fast
path on and off.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache.vllm import AsyncScheduler, Scheduler
from hscache.vllm import step as fast_step
from hscache.vllm.scheduler import FAST_PATH_COUNTS
from hscache_tools.testing.offline_scheduler import make_scheduler, stub_runner_output
from hscache_tools.testing.requests import init_none_hash, make_request, request_block_hasher

pytestmark = pytest.mark.vllm


class _Observed:
    """What ``fast_step.schedule`` / ``split_update`` returned, counted as the counters
    should count it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.schedule_served = 0
        self.update_served = 0
        schedule, split_update = fast_step.schedule, fast_step.split_update

        def observed_schedule(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            self.schedule_served += out is not None
            return out

        def observed_split(*args: Any, **kwargs: Any) -> Any:
            split = split_update(*args, **kwargs)
            if split is not None:
                self.update_served += len(split[1])
            return split

        monkeypatch.setattr(fast_step, "schedule", observed_schedule)
        monkeypatch.setattr(fast_step, "split_update", observed_split)


def _drive(sched: Any, steps: int, depth: int) -> tuple[int, int]:
    """Steps ``sched`` with arrivals early on (a batch queue of ``depth``, as vLLM's
    engine drives an async scheduler); returns (schedule calls, requests updated)."""
    init_none_hash("sha256")
    hasher = request_block_hasher(16, "sha256")
    calls = updated = 0
    pending: deque[tuple[Any, Any]] = deque()
    for step in range(steps):
        if step < 6:
            prompt = [(step * 37 + j) % 1000 for j in range(40)]
            sched.add_request(
                make_request(
                    f"r{step}", prompt, max_tokens=24, ignore_eos=True, block_hasher=hasher
                )
            )
        out = sched.schedule()
        calls += 1
        pending.append((out, stub_runner_output(out, lambda i: 7 + i, sched.requests)))
        if len(pending) >= depth:
            done, runner = pending.popleft()
            updated += len(done.num_scheduled_tokens)
            sched.update_from_output(done, runner)
    while pending:
        done, runner = pending.popleft()
        updated += len(done.num_scheduled_tokens)
        sched.update_from_output(done, runner)
    return calls, updated


@pytest.mark.parametrize("fast", [True, False], ids=["fast-on", "fast-off"])
@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler], ids=["sync", "async"])
def test_counts_match_what_the_fast_path_served(
    cls: type, fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    is_async = cls is AsyncScheduler
    sched = make_scheduler(cls, 256, max_num_seqs=8, async_scheduling=is_async)
    assert sched.fast_path_counts == dict.fromkeys(FAST_PATH_COUNTS, 0)
    assert list(sched.fast_path_counts) == list(FAST_PATH_COUNTS)
    sched.fast_step = fast and sched.fast_step
    observed = _Observed(monkeypatch)
    calls, updated = _drive(sched, 40, 2 if is_async else 1)
    counts = sched.fast_path_counts
    assert counts["schedule_steps"] == calls == 40
    assert counts["update_requests"] == updated > 0
    assert counts["schedule_served"] == observed.schedule_served
    assert counts["update_served"] == observed.update_served
    assert counts["update_served"] <= counts["update_requests"]
    if fast and fast_step.enabled():
        # Steady decodes follow the admissions: both phases serve some of them.
        assert 0 < counts["schedule_served"] < calls
        assert 0 < counts["update_served"] < updated
    else:
        assert counts["schedule_served"] == counts["update_served"] == 0
