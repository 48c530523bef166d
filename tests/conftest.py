"""What every pytest test here shares: vLLM's CPU/offline environment, vLLM's ``NONE_HASH``
and the offline model directory.

- The environment defaults (``VLLM_TARGET_DEVICE=cpu``, ``HF_HUB_OFFLINE=1``), set before any
  test module imports vLLM; and this checkout's ``tools/`` (``hscache_tools``, not in the
  wheel) first on ``PYTHONPATH``, so that a test's subprocess imports the tools as the test
  does (pytest's ``pythonpath`` setting covers this process only).
- ``none_hash`` (autouse): every test starts from sha256's ``NONE_HASH`` (what vLLM's engine
  seeds by default; the parent hash of every first block) and vLLM's globals are restored
  after it, so a test that seeds another algorithm (the differential traces, the hasher
  tests) cannot leak it into the next.
- ``model_dir`` (session): the config-only model directory vLLM's ``Scheduler`` is built on
  (:func:`hscache_tools.testing.offline_scheduler.model_dir`).
- The ``hooks`` marker: a test that needs the test-only switches (mutants, armed faults)
  of the test-hooks extension (``_core.TEST_HOOKS``; ``scripts/panic_python.sh`` builds it
  and runs ``pytest -m hooks``). With the release extension such tests are deselected (the
  summary says how many), never skipped: the release extension has no switch to arm.

- Under ``CI=true`` a skip whose reason ``EXPECTED_SKIPS`` does not name fails the run
  (a test that skips for a reason nobody expected, e.g. the vLLM sdist missing, passes no
  check); locally skips only show in the summary.

The factories themselves (requests, KV-cache configs, manager keywords, schedulers) live in
the package, :mod:`hscache_tools.testing`, shared with the benchmark. Not collected here:
``vllm_upstream/`` (a plugin for vLLM's own test files, run by ``scripts/test.sh`` from the
vLLM sdist) and ``vllm_diff/`` (the differential harness, driven by
``test_differential_vllm.py``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_TOOLS = str(Path(__file__).resolve().parents[1] / "tools")
if _TOOLS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_TOOLS, os.environ.get("PYTHONPATH")) if p
    )

collect_ignore = ["vllm_upstream", "vllm_diff"]

# Regexes over a skip's reason: the skips some environment of scripts/test.sh has by design.
# Under CI=true any other skip fails the session.
EXPECTED_SKIPS = [
    r"needs a CUDA device",  # the gpu variants (no GPU in CI)
    r"needs vllm-omni 0\.30",  # tests/omni outside the vLLM 0.30 + vllm-omni environment
    r"HSCACHE_OMNI_E2E_RESULTS not set",  # tests/omni_e2e outside scripts/omni_e2e.sh
    r"omni_e2e/results/\S+\.json was not run",  # omni_e2e arms of --sync / --talker only
    r"needs a fault-injection build",  # test_panic_python.py outside scripts/panic_python.sh
    r"vLLM 0\.32 has no lookahead hashing",  # version-specific features and layouts
    r"this vLLM \(0\.30\) computes the cacheable tokens inline",
    r"Mamba layouts stay on this vLLM's manager \(0\.30\)",
    r"vLLM 0\.30's Mamba rules are not built",
]
_skips: list[tuple[str, str]] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def pytest_runtest_logreport(report: Any) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        _skips.append((report.nodeid, str(reason)))


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    unexpected = [(n, r) for n, r in _skips if not any(re.search(p, r) for p in EXPECTED_SKIPS)]
    if not unexpected or not _in_ci():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for node, reason in unexpected:
        line = f"UNEXPECTED SKIP under CI=true: {node}: {reason}"
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects the ``hooks`` tests unless the extension is the test-hooks build."""
    from hscache import _core

    if _core.TEST_HOOKS:
        return
    hooks = [item for item in items if item.get_closest_marker("hooks") is not None]
    if hooks:
        config.hook.pytest_deselected(items=hooks)
        items[:] = [item for item in items if item.get_closest_marker("hooks") is None]


@pytest.fixture(autouse=True)
def none_hash() -> Iterator[None]:
    """Seed sha256's ``NONE_HASH`` for the test; restore vLLM's globals after it."""
    from vllm.utils import hashing
    from vllm.v1.core import kv_cache_utils as kcu

    saved = (getattr(kcu, "NONE_HASH", None), kcu._NONE_HASH_SEED)
    kcu.init_none_hash(hashing.sha256)
    yield
    if saved[0] is not None:
        kcu.NONE_HASH = saved[0]
    kcu._NONE_HASH_SEED = saved[1]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The config-only model directory of offline vLLM ``Scheduler``s."""
    from hscache_tools.testing.offline_scheduler import model_dir as make

    return make()
