"""The fast path's ``update_from_output()`` phase inside vllm-omni's AR schedulers
(``hscache.omni.OmniARScheduler`` / ``OmniARAsyncScheduler``; ``docs/fast_step.md``).

vllm-omni's ``update_from_output`` is its own loop, not vLLM's. For a steady request (its
one sampled token appended, no stop; what ``hscache.vllm.step.update`` serves) that loop
does what vLLM's does, and then builds an ``OmniEngineCoreOutput`` whose five extra fields
are ``multimodal_output`` (the runner's ``multimodal_outputs[i]``),
``pooling_output_payload`` (None without pooler output), ``is_segment_finished`` (False:
no stop), ``new_prompt_len_snapshot`` (the scheduler's snapshot for the request, set by
streaming input) and ``num_generation_tokens`` (the output token count after the append).
Everything else it adds per request is a no-op for such a request only under the step
conditions :func:`split_update` checks: no KV-transfer criteria (the prefill/special-token
triggers), no chunk transport (``chunk_transfer_adapter``), no multimodal or inter-stage
outputs, no KV-extraction acks this step, output emitted for non-stopped requests
(``_should_emit_engine_output``), no request carrying stale async tokens
(``async_tokens_to_discard``), and nothing that adds outputs after the loop (aborts since
the last step, streaming overflows, input timeouts). Then the steady requests are served
by the core, with ``OmniEngineCoreOutput`` built, and the rest go through vllm-omni's own
``update_from_output``; :func:`merge_outputs` keeps vllm-omni's order.
"""

from __future__ import annotations

from typing import Any

import vllm_omni.core.sched.omni_ar_scheduler as _omni_ar
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import RequestStatus
from vllm_omni.engine import OmniEngineCoreOutput

from hscache._core import StepUpdate
from hscache.vllm.step import update as _update

__all__ = ["merge_outputs", "split_update"]

_OMNI_STEP_UPDATE = StepUpdate(
    running=RequestStatus.RUNNING,
    output_class=OmniEngineCoreOutput,
    cache_blocks_at=_update.CACHE_BLOCKS_AT,
)

BROKEN: frozenset[str] = frozenset()
"""The omni glue's rules broken (test-only mutants, set by ``tests/omni``): empty here.
``generation_tokens``: ``num_generation_tokens`` left unset; ``kv_criteria``: a step with
KV-transfer criteria served; ``merge_order``: the outputs built put after vllm-omni's."""


def _omni_applies(sched: Any, output: Any) -> bool:
    """The step conditions under which vllm-omni's loop adds nothing to a steady request
    but the fields :func:`split_update` sets, and nothing after the loop."""
    return not (
        (sched.kv_transfer_criteria and "kv_criteria" not in BROKEN)
        or sched.chunk_transfer_adapter is not None
        or getattr(output, "kv_extracted_req_ids", None)
        or getattr(output, "multimodal_outputs", None)
        or getattr(output, "inter_stage_outputs", None)
        or sched.finished_req_ids_dict
        or sched._streaming_context_overflow
        or getattr(sched, "_pending_input_timeout_outputs", None)
        or not _omni_ar._should_emit_engine_output(
            sched.vllm_config.model_config, stopped=False, has_control=False
        )
    )


def split_update(
    sched: Any, scheduler_output: SchedulerOutput, output: Any, is_async: bool
) -> tuple[SchedulerOutput, dict[str, Any]] | None:
    """:func:`hscache.vllm.step.update.split_update` for vllm-omni's loop: the steady
    requests served, their ``OmniEngineCoreOutput`` s as vllm-omni builds them; ``None``
    (nothing changed) when the step is not served."""
    if not _omni_applies(sched, output):
        return None
    requests = sched.requests
    for req_id in scheduler_output.num_scheduled_tokens:
        if getattr(requests.get(req_id), "async_tokens_to_discard", 0):
            return None
    split = _update.split_update(
        sched, scheduler_output, output, is_async=is_async, phase=_OMNI_STEP_UPDATE
    )
    if split is None:
        return None
    rest = split[0]
    built: dict[str, Any] = split[1]  # OmniEngineCoreOutput s
    snapshots = sched._new_prompt_len_snapshot
    count = "generation_tokens" not in BROKEN
    for req_id, o in built.items():
        if count:
            o.num_generation_tokens = len(requests[req_id]._output_token_ids)
        if snapshots:
            o.new_prompt_len_snapshot = snapshots.get(req_id)
    return rest, built


def merge_outputs(
    scheduler_output: SchedulerOutput, outputs: dict[int, Any], built: dict[str, Any]
) -> dict[int, Any]:
    """vllm-omni's ``update_from_output`` result for the whole step: the outputs ``built``
    put back among vllm-omni's own in scheduling order. vllm-omni's client-0 list is its
    loop's outputs (in scheduling order) and then what it adds after the loop, all for
    requests that had a loop output (:func:`split_update` declines steps where it could
    add others), so a walk in scheduling order places both."""
    eco = outputs.get(0)
    if eco is None:
        # vllm-omni made no output for client 0; it would have made this one first.
        eco = _omni_ar.EngineCoreOutputs()
        outputs = {0: eco, **outputs}
    theirs = eco.outputs
    if "merge_order" in BROKEN:
        eco.outputs = [*theirs, *built.values()]
        return outputs
    i = 0
    merged = []
    for req_id in scheduler_output.num_scheduled_tokens:
        o = built.get(req_id)
        if o is not None:
            merged.append(o)
        elif i < len(theirs) and theirs[i].request_id == req_id:
            merged.append(theirs[i])
            i += 1
    merged.extend(theirs[i:])
    eco.outputs = merged
    return outputs
