"""No refused hit is fatal: a first hit whose rows cannot be served is recomputed.

hscache's KV-cache manager grants a prefix hit on blocks whose hidden-state rows the
runner's slot mirror may not vouch for (the blocks of a step planned and never saved, the
blocks a KV connector loaded). vllm-omni 0.30's runners treat an exception from
``materialize`` as fatal: every request on the stage would die for one request's hit. The
Rust rules (``src/slots/omni_rules.rs``, recomputation on) instead hand out the request's
rows of the step and name, per such request, the first block of its hit whose rows were
not written (``OmniHiddenStateCache.take_invalid_blocks``). This module carries those
blocks to the scheduler through the channel vLLM offers for blocks that cannot be used,
``KVConnectorOutput.invalid_block_ids`` of the step's ``ModelRunnerOutput``: vLLM's
scheduler (and vllm-omni's ``OmniARScheduler``, which keeps vLLM's handling) skips that
request's output of the step (so its rows of the step never reach the next stage), rolls
its ``num_computed_tokens`` back to the first reported block and recomputes from there
(its default ``kv_load_failure_policy``, ``recompute``; with a KV connector configured
``fail``, it fails that request only). The request's next step is served ``[cached prefix
| rows]`` as a first hit, the mirror re-reading its rows. Nothing else changes: no other
request's output is dropped unless it holds the reported block among its computed ones
(then it is rolled back too, as vLLM does for blocks shared in a batch).

:func:`install_on_runner` wraps vllm-omni's ``GPUARModelRunner``
``_build_omni_model_runner_output_from_snapshot`` (the one builder of a step's output,
synchronous or on the async output thread), once per process; hscache's switch calls it
when it builds hscache's cache, and turns recomputation on only where it succeeded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from hscache.omni.prefix_cache import OmniHiddenStateCache

__all__ = ["BUILDER", "install_on_runner", "report_invalid_blocks"]

logger = logging.getLogger(__name__)

BUILDER = "_build_omni_model_runner_output_from_snapshot"
"""The vllm-omni 0.30 ``GPUARModelRunner`` method that builds a step's output."""


def report_invalid_blocks(output: Any, blocks: Iterable[int]) -> None:
    """Adds ``blocks`` to ``output.kv_connector_output.invalid_block_ids`` (a new
    ``KVConnectorOutput`` when the step has none; a connector's own set is not changed
    in place)."""
    blocks = set(blocks)
    if not blocks:
        return
    kvo = getattr(output, "kv_connector_output", None)
    if kvo is None:
        from vllm.v1.outputs import KVConnectorOutput

        output.kv_connector_output = KVConnectorOutput(invalid_block_ids=blocks)
        return
    kvo.invalid_block_ids = set(kvo.invalid_block_ids or ()) | blocks


def _reporting(original: Callable[..., Any]) -> Callable[..., Any]:
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        cache = getattr(self, "omni_prefix_cache", None)
        step_id = kwargs.get("prefix_cache_step_id")
        if step_id is not None and isinstance(cache, OmniHiddenStateCache):
            blocks = cache.take_invalid_blocks(step_id)
            if blocks:
                logger.warning(
                    "hscache: step %d: hits on blocks %s had rows not written; the "
                    "scheduler recomputes those requests",
                    step_id,
                    sorted(blocks),
                )
                report_invalid_blocks(output, blocks)
        return output

    build.hscache_original = original  # type: ignore[attr-defined]
    return build


def install_on_runner() -> bool:
    """Puts the report into vllm-omni's AR runner (once per process); returns whether it
    is there. False without vllm-omni's runner or its builder: the cache then refuses
    such hits (``UnservableHitError``) as before."""
    try:
        from vllm_omni.worker import gpu_ar_model_runner
    except Exception:  # no vllm-omni runner in this process
        return False
    cls = getattr(gpu_ar_model_runner, "GPUARModelRunner", None)
    current = getattr(cls, BUILDER, None)
    if cls is None or current is None:
        return False
    if not hasattr(current, "hscache_original"):
        setattr(cls, BUILDER, _reporting(current))
    return True
