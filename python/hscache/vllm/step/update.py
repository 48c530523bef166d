"""The ``update_from_output()`` phase of the steady decode step's fast path
(``hscache.vllm.Scheduler``; ``docs/fast_step.md``).

:func:`split_update` takes, out of a step's ``update_from_output``, the requests whose
sampled token certainly does not stop them (the negation of vLLM's ``check_stop`` for one
token) and that need nothing but the token appended (no logprobs, placeholders, drafts,
stale output, encoder inputs, grammar, pooling, prefill stats), and appends their tokens,
in one core call (``hscache._core.StepUpdate``, ``src/python/step_update.rs``; the rules
are ``src/step/update.rs``); :func:`merge_outputs` puts their ``EngineCoreOutput`` s back
in vLLM's order. The other requests (finishing ones included) go through vLLM's
``update_from_output``.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from hscache._core import StepUpdate
from hscache.vllm.version import require

__all__ = ["merge_outputs", "split_update"]

_PROFILE = require()

# update_from_output's steady requests, served by the core (src/python/step_update.rs):
# vLLM's objects it compares with and builds, and where this version's async
# cache_blocks call caches up to.
OUTPUT_CLASS = EngineCoreOutput
"""The class the core builds (bound at import: vllm-omni's patch rebinds the name
``EngineCoreOutput`` in this module, not ``OUTPUT_CLASS``)."""
CACHE_BLOCKS_AT = "in_flight" if _PROFILE.async_cache_blocks_in_scheduler else "placeholders"
_STEP_UPDATE = StepUpdate(
    running=RequestStatus.RUNNING, output_class=OUTPUT_CLASS, cache_blocks_at=CACHE_BLOCKS_AT
)


def _update_applies(sched: Any, output: Any) -> bool:
    """The step-level conditions of :func:`split_update`."""
    return (
        output.kv_connector_output is None
        and output.ec_connector_output is None
        and output.pooler_output is None
        and not output.num_nans_in_logits
        and not sched.grammar_compile_error_reqs
        and not (_PROFILE.encoder_cache_mismatch and sched.encoder_cache_mismatch_reqs)
        and sched.ec_connector is None
        and sched.connector is None
        and (not _PROFILE.aux_output_connector or sched.aux_output_connector is None)
        and not (_PROFILE.routed_experts_in_scheduler and sched.enable_return_routed_experts)
        and not sched.return_sampling_mask
        and not sched.defer_block_free
        and not sched.num_spec_tokens
        and not sched.is_mm_encoder_only
        and not (sched.perf_metrics and sched.perf_metrics.is_enabled())
        and not (sched.finished_req_ids_dict and set(sched.finished_req_ids_dict) - {0})
    )


def split_update(
    sched: Any,
    scheduler_output: SchedulerOutput,
    output: Any,
    is_async: bool = False,
    phase: StepUpdate | None = None,
) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]] | None:
    """Serves the steady requests of ``update_from_output``: appends each one's sampled
    token and builds its ``EngineCoreOutput``. Returns the ``SchedulerOutput`` that
    vLLM's ``update_from_output`` must still process (the others), and the outputs
    built, by request id; ``None`` (nothing changed) when the step is not served.

    The decisions and the writes are one core call (``StepUpdate.split``,
    ``src/python/step_update.rs`` over ``src/step/update.rs``): a request is steady when
    its token needs nothing but appending and certainly does not stop it (the negation
    of vLLM's ``check_stop`` for one token); every request must belong to client 0.

    ``is_async`` (an ``AsyncScheduler``): a steady request's output also resolves its
    placeholder and caches its blocks, as vLLM does per request in scheduling order;
    so that the manager sees those calls in vLLM's order, only the steady requests
    before the first one vLLM must serve are taken.

    ``phase``: the core's ``StepUpdate`` (default: this module's; ``hscache.omni.fast``
    passes one that builds vllm-omni's ``OmniEngineCoreOutput``)."""
    if not _update_applies(sched, output):
        return None
    sampled = output.sampled_token_ids
    if not sampled:
        return None
    split = (phase or _STEP_UPDATE).split(
        sched.requests,
        scheduler_output.num_scheduled_tokens,
        sampled,
        output.req_id_to_index,
        drafts=scheduler_output.scheduled_spec_decode_tokens,
        prompt_logprobs=(
            output.prompt_logprobs_dict,
            output.prompt_token_id_logprobs_dict if _PROFILE.prompt_token_id_logprobs else {},
        ),
        has_logprobs=output.logprobs is not None,
        max_model_len=sched.max_model_len,
        is_async=is_async,
        cache_blocks=sched.kv_cache_manager.cache_blocks,
    )
    if split is None:
        return None
    built, rest = split
    remaining = copy.copy(scheduler_output)
    remaining.num_scheduled_tokens = rest
    return remaining, built


def merge_outputs(
    scheduler_output: SchedulerOutput,
    outputs: dict[int, EngineCoreOutputs],
    built: dict[str, EngineCoreOutput],
) -> dict[int, EngineCoreOutputs]:
    """vLLM's ``update_from_output`` result for the whole step: the outputs ``built`` by
    :func:`split_update` put back among vLLM's own, in scheduling order (all client 0;
    vLLM's were appended in the same order, and no error outputs follow them)."""
    eco = outputs.get(0)
    if eco is None:
        # vLLM made no output for client 0; it would have made this one first.
        eco = EngineCoreOutputs()
        outputs = {0: eco, **outputs}
    theirs = {o.request_id: o for o in eco.outputs}
    merged = []
    for req_id in scheduler_output.num_scheduled_tokens:
        o = built.get(req_id)
        if o is None:
            o = theirs.get(req_id)
        if o is not None:
            merged.append(o)
    eco.outputs = merged
    return outputs
