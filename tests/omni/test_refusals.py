"""``hscache.omni.refusals``: the blocks of a first hit sent back for recomputation reach
vLLM's scheduler with the step's output (``KVConnectorOutput.invalid_block_ids``), through
vllm-omni 0.30's own output builder, and the switch turns recomputation on only where that
hook is in. What the scheduler then does (drop the request's output, roll it back, serve
its next step from position 0) is the differential's ``test_unsaved_steps``. Skipped
without vllm-omni 0.30."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest

gpu_ar_model_runner = pytest.importorskip(
    "vllm_omni.worker.gpu_ar_model_runner",
    reason="needs vllm-omni 0.30 (the environment of scripts/vllm030_env.sh)",
)


from hscache.omni import OmniHiddenStateCache, OmniSettings, refusals, switch  # noqa: E402  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from tests.omni.test_bad_inputs import View, rows, sched, step  # noqa: E402


@pytest.fixture(autouse=True)
def _builder_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-omni's output builder is put back after each test."""
    cls = gpu_ar_model_runner.GPUARModelRunner
    current = getattr(cls, refusals.BUILDER)
    monkeypatch.setattr(cls, refusals.BUILDER, getattr(current, "hscache_original", current))


def _sent_back() -> tuple[OmniHiddenStateCache, int]:
    """A cache with recomputation on whose last saved step sent ``d`` back (block 4)."""
    view = View()
    cache = OmniHiddenStateCache(
        NS(num_blocks=8, block_size=4),
        view,
        settings=OmniSettings(storage="cpu"),
        recompute_refused=True,
    )
    a = rows(8, 0.0)
    cache.materialize(step(cache, view, sched(new=(("a", [1, 2], 0, 8),)), a), ["a"])
    cache.new_step_starts(sched(new=(("c", [4, 5], 0, 8),), finished=("a",)))  # never saved
    sid = step(cache, view, sched(new=(("d", [4, 5, 6], 8, 1),), finished=("c",)), rows(1, 7.0))
    return cache, sid


def test_blocks_are_added_to_the_outputs_connector_output() -> None:
    out = NS(kv_connector_output=None)
    refusals.report_invalid_blocks(out, [4, 4])
    assert isinstance(out.kv_connector_output, KVConnectorOutput)
    assert out.kv_connector_output.invalid_block_ids == {4}
    mine = {9}
    out = NS(kv_connector_output=KVConnectorOutput(invalid_block_ids=mine))
    refusals.report_invalid_blocks(out, [4])
    assert out.kv_connector_output.invalid_block_ids == {4, 9}
    assert mine == {9}, "a connector's own set is not changed in place"
    out = NS(kv_connector_output=None)
    refusals.report_invalid_blocks(out, [])
    assert out.kv_connector_output is None


def test_the_builder_hook_reports_the_steps_blocks_once() -> None:
    assert refusals.install_on_runner()
    cls = gpu_ar_model_runner.GPUARModelRunner
    hooked = getattr(cls, refusals.BUILDER)
    assert hasattr(hooked, "hscache_original")
    assert refusals.install_on_runner()
    assert getattr(cls, refusals.BUILDER) is hooked, "installed once"

    calls: list[dict[str, Any]] = []

    def builder(self: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return NS(kv_connector_output=None)

    build = refusals._reporting(builder)
    cache, sid = _sent_back()
    cache.materialize(sid, ["d"])
    runner = NS(omni_prefix_cache=cache)
    out = build(runner, prefix_cache_step_id=sid)
    assert out.kv_connector_output.invalid_block_ids == {4}
    assert build(runner, prefix_cache_step_id=sid).kv_connector_output is None, "taken once"
    # No step saved, or vllm-omni's own cache: nothing added.
    assert build(runner, prefix_cache_step_id=None).kv_connector_output is None
    other = NS(omni_prefix_cache=object())
    assert build(other, prefix_cache_step_id=sid).kv_connector_output is None
    assert len(calls) == 4


def test_the_switch_builds_a_recomputing_cache() -> None:
    build = switch._build_manager(lambda *a, **k: pytest.fail("vllm-omni's own"), lambda: True)
    cache = build(NS(num_blocks=8, block_size=4), View())
    assert isinstance(cache, OmniHiddenStateCache)
    assert cache.recompute_refused
    assert hasattr(
        getattr(gpu_ar_model_runner.GPUARModelRunner, refusals.BUILDER), "hscache_original"
    )
    # Without the hook (no vllm-omni runner to put it in), refusals stay refusals.
    cache = OmniHiddenStateCache(NS(num_blocks=8, block_size=4), View())
    assert not cache.recompute_refused
