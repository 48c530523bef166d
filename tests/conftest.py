"""What every pytest test here shares: vLLM's CPU/offline environment, vLLM's ``NONE_HASH``
and the offline model directory.

- The environment defaults (``VLLM_TARGET_DEVICE=cpu``, ``HF_HUB_OFFLINE=1``), set before any
  test module imports vLLM.
- ``none_hash`` (autouse): every test starts from sha256's ``NONE_HASH`` (what vLLM's engine
  seeds by default; the parent hash of every first block) and vLLM's globals are restored
  after it, so a test that seeds another algorithm (the differential traces, the hasher
  tests) cannot leak it into the next.
- ``model_dir`` (session): the config-only model directory vLLM's ``Scheduler`` is built on
  (:func:`hscache.testing.offline_scheduler.model_dir`).
- The ``hooks`` marker: a test that needs the test-only switches (mutants, armed faults)
  of the test-hooks extension (``_core.TEST_HOOKS``; ``scripts/panic_python.sh`` builds it
  and runs ``pytest -m hooks``). With the release extension such tests are deselected (the
  summary says how many), never skipped: the release extension has no switch to arm.

The factories themselves (requests, KV-cache configs, manager keywords, schedulers) live in
the package, :mod:`hscache.testing`, shared with the benchmark. Not collected here:
``vllm_upstream/`` (a plugin for vLLM's own test files, run by ``scripts/test.sh`` from the
vLLM sdist) and ``vllm_diff/`` (the differential harness, driven by
``test_differential_vllm.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

collect_ignore = ["vllm_upstream", "vllm_diff"]


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
    from hscache.testing.offline_scheduler import model_dir as make

    return make()
