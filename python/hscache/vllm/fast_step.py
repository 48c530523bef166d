"""The steady decode step's fast path inside ``hscache.vllm.Scheduler`` (vLLM 0.33, 0.32, 0.30).

vLLM's ``Scheduler`` spends ~10 µs of Python per running request per step in the
``schedule()`` loop body, ``_make_cached_request_data``, ``_update_after_schedule`` and
``update_from_output``'s loop. In a steady decode step almost all of it decides nothing:
every running request schedules its one decode token. This module serves those steps
with a short loop per phase, over vLLM's own ``Request`` objects (which stay
authoritative: every field ends as vLLM's code leaves it) and vLLM's own helpers for the
rare events (preemption, stats), and hands everything else to vLLM's code unchanged:

- :func:`schedule` serves a whole step, or nothing (returns ``None`` before changing
  anything): no request waiting, no connector, speculative decoding, LoRA, pipeline
  parallelism, deferred frees or priority policy, and every running request a plain
  decode (one known token to compute, no encoder inputs, no structured output, no
  placeholders, within ``max_model_len``) that the token budget does not bind. The
  per-request rule (``src/step/schedule.rs``) and the allocations are one core call
  (``KVCacheCore.schedule_decodes``). Preemption under pool pressure follows vLLM's
  FCFS rule with vLLM's own ``_preempt_request``.
- :func:`split_update` takes, out of a step's ``update_from_output``, the requests whose
  sampled token certainly does not stop them (the negation of vLLM's ``check_stop`` for
  one token) and that need nothing but the token appended (no logprobs, placeholders,
  drafts, stale output, encoder inputs, grammar, pooling, prefill stats), and appends
  their tokens, in one core call (``hscache._core.StepUpdate``; the rules are
  ``src/step/update.rs``); :func:`merge_outputs` puts their ``EngineCoreOutput`` s back
  in vLLM's order. The other requests (finishing ones included) go through vLLM's
  ``update_from_output``.

``HSCACHE_FAST_STEP=0`` turns it off; it is on only for the vLLM versions whose profile
says so (``VllmProfile.fast_step``: the versions whose differential,
``tests/scheduler/test_scheduler_fast_path.py``, passes), and only where the vLLM code it
mirrors is the code tested, exact version and fingerprint, unoverridden by the scheduler
or request class in use (``hscache.vllm.mirror``); what those versions' schedulers
do differently comes from the profile's fields (``docs/fast_step.md``). ``BROKEN_RULES``
is the test-only switch that breaks one rule at a time (the mutants the differential must
catch).
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus

from hscache._core import KVCacheCore, StepUpdate, plain_decodes
from hscache.vllm import mirror
from hscache.vllm.version import require

__all__ = [
    "BROKEN_RULES",
    "RULES",
    "enabled",
    "merge_outputs",
    "schedule",
    "split_update",
]

_PROFILE = require()

RULES = (
    "waiting",  # a step with waiting requests is not served
    "plain_decode",  # every running request has exactly one known token to compute
    "budget",  # the token budget does not bind
    "preempt",  # pool pressure preempts from the tail (vLLM's FCFS rule)
    "all_token_ids",  # requests not scheduled last step carry their tokens (MRV1)
    "capacity_bound",  # the step records whether admissions were capacity-bound
    "in_flight",  # scheduling counts the token in flight
    "stop_eos",  # a sampled EOS stops the request: vLLM's code serves it
    "stop_token_ids",  # a sampled stop token id stops the request
    "stop_length",  # max_tokens / max_model_len stop the request
    "repetition",  # repetition detection is vLLM's to decide
    "logprobs",  # a request asking for logprobs is vLLM's to serve
    # AsyncScheduler only:
    "output_placeholders",  # scheduling adds the token's output placeholder
    "async_last_step",  # a request sure to reach max_tokens is not scheduled again
    "resolve_placeholder",  # a sampled token resolves its output placeholder
)

BROKEN_RULES: set[str] = set()
"""Test only: the rules (names of :data:`RULES`) the fast path breaks, for mutants."""

# update_from_output's steady requests, served by the core (src/python/step_update.rs):
# vLLM's objects it compares with and builds, and where this version's async
# cache_blocks call caches up to.
_STEP_UPDATE = StepUpdate(
    running=RequestStatus.RUNNING,
    output_class=EngineCoreOutput,
    cache_blocks_at="in_flight" if _PROFILE.async_cache_blocks_in_scheduler else "placeholders",
)


def enabled() -> bool:
    """Whether the fast path serves steps: the version's profile says it was proven,
    ``HSCACHE_FAST_STEP`` is not ``0``, and the installed vLLM's mirrored code is the code
    tested (``hscache.vllm.mirror.proven``: exact version, fingerprint)."""
    flag = os.environ.get("HSCACHE_FAST_STEP", "1").lower()
    return (
        _PROFILE.fast_step
        and flag not in ("0", "false", "no", "off")
        and mirror.proven(EngineCoreOutput)
    )


def _nothing_waiting(sched: Any) -> bool:
    """No request in any of the version's waiting queues."""
    if _PROFILE.kv_holding_queues:
        return not (sched.waiting or sched.kv_holding_waiting or sched.deferred_waiting)
    return not (sched.waiting or sched.skipped_waiting)


def _step_applies(sched: Any) -> bool:
    """The step-level conditions of :func:`schedule` (cheap attribute reads)."""
    return (
        bool(sched.running)
        and ("waiting" in BROKEN_RULES or _nothing_waiting(sched))
        and sched._pause_state == PauseState.UNPAUSED
        and sched.connector is None
        and sched.ec_connector is None
        and (not _PROFILE.aux_output_connector or sched.aux_output_connector is None)
        and not (_PROFILE.routed_experts_in_scheduler and sched.enable_return_routed_experts)
        and sched.vllm_config.speculative_config is None
        and sched.num_lookahead_tokens == 0
        and sched.num_prefill_lookahead == 0
        and sched.dynamic_sd_lookup is None
        and not sched.need_mamba_block_aligned_split
        and sched.lora_config is None
        and not sched.use_pp
        and not sched.defer_block_free
        and sched.policy == SchedulingPolicy.FCFS
        and not sched.num_waiting_for_streaming_input
    )


def _allocate_each(
    manager: Any, running: list[Request], start: int, lookahead: int
) -> tuple[int, list[Any]]:
    """``allocate_slots(request, 1)`` for ``running[start:]`` through a manager that is
    not the core (parity mode, vLLM's own manager), up to the first that does not fit:
    ``(its index, the new block ids of the others)``."""
    allocate = manager.allocate_slots
    new_block_ids: list[Any] = []
    for i in range(start, len(running)):
        blocks = allocate(running[i], 1, num_lookahead_tokens=lookahead)
        if blocks is None:
            return i, new_block_ids
        new_block_ids.append(blocks.get_block_ids(allow_none=True))
    return len(running), new_block_ids


def schedule(sched: Any, throttle_prefills: bool, is_async: bool = False) -> SchedulerOutput | None:
    """vLLM's ``schedule()`` for a steady decode step, or ``None`` (nothing changed)
    when the step is not one. ``is_async``: ``sched`` is an ``AsyncScheduler`` (its
    ``_update_after_schedule`` adds output placeholders).

    The per-request rule (``src/step/schedule.rs``: every running request a plain
    decode, with async scheduling's last-step rule and the ``max_model_len`` room) and
    the allocations are one core call (``KVCacheCore.schedule_decodes``), which stops at
    the first request that does not fit; this function preempts from the tail with
    vLLM's ``_preempt_request`` and resumes the call from that request."""
    if not _step_applies(sched):
        return None
    running: list[Request] = sched.running
    n = len(running)
    if "budget" not in BROKEN_RULES and (
        n > sched.max_num_scheduled_tokens or n > sched.scheduler_config.max_num_batched_tokens
    ):
        return None
    step = sched.current_step + 1
    manager = sched.kv_cache_manager
    lookahead = sched.num_lookahead_tokens
    broken = BROKEN_RULES or None
    if isinstance(manager, KVCacheCore):
        decided = manager.schedule_decodes(
            running,
            0,
            step,
            is_async,
            sched.max_model_len,
            sched.num_sampled_tokens_per_step,
            lookahead,
            broken,
        )
        if decided is None:
            return None
        done, new_block_ids, num_computed_tokens, num_output_tokens = decided
    else:
        counts = plain_decodes(
            running, step, is_async, sched.max_model_len, sched.num_sampled_tokens_per_step, broken
        )
        if counts is None:
            return None
        num_computed_tokens, num_output_tokens = counts
        manager.new_step_starts()
        done, new_block_ids = _allocate_each(manager, running, 0, lookahead)

    # From here on the step is served: the same state changes as vLLM's, in its order
    # (the manager's step has started and the requests before `done` are allocated).
    sched.current_step = step
    timestamp = time.monotonic()
    # Every running request is a decode, so "any running decode" is "any running".
    defer_prefills = throttle_prefills and not sched.prefill_capacity_bound
    if (
        _PROFILE.prefill_cadence
        and not defer_prefills
        and sched.local_prefill_interval > 1
        and not sched.prefill_capacity_bound
        and (sched.num_executed_steps + 1) - sched.last_prefill_step < sched.local_prefill_interval
    ):
        defer_prefills = True

    # Pool pressure: `running[done]` did not fit. vLLM preempts from the tail and
    # retries it, until it fits or is itself the victim.
    preempted = False
    while done < len(running) and "preempt" not in BROKEN_RULES:
        request = running[done]
        victim = running[-1]
        if not sched._request_blocks_can_be_freed(victim):
            break
        running.pop()
        sched._preempt_request(victim, timestamp, drop_stale_output=sched.requires_kv_delivery)
        preempted = True
        if victim is request:
            break
        if isinstance(manager, KVCacheCore):
            resumed = manager.schedule_decodes(
                running,
                done,
                step,
                is_async,
                sched.max_model_len,
                sched.num_sampled_tokens_per_step,
                lookahead,
                broken,
            )
            if resumed is None:  # pragma: no cover (a resuming call only allocates)
                raise RuntimeError("schedule_decodes refused a resumed step")
            done, more, _, _ = resumed
        else:
            done, more = _allocate_each(manager, running, done, lookahead)
        new_block_ids += more
    scheduled = running[:done]
    if done < n:
        num_computed_tokens = num_computed_tokens[:done]
        num_output_tokens = num_output_tokens[:done]

    skip_drafts = _PROFILE.skip_drafts
    drafts_needed = not skip_drafts or not sched.can_skip_drafts
    if not drafts_needed:
        for r in scheduled:
            if not sched._drafts_unused(r, r.num_computed_tokens, 1):
                drafts_needed = True
                break

    # The waiting queues are empty: vLLM's admission loop admits nothing, and records
    # whether admissions were capacity-bound on a step it does not defer.
    if not preempted and not defer_prefills and "capacity_bound" not in BROKEN_RULES:
        if _PROFILE.kv_holding_queues:
            _, num_waiting = sched.get_request_counts()
            sched.prefill_capacity_bound = num_waiting > len(sched.deferred_waiting)
        else:
            sched.prefill_capacity_bound = bool(sched.waiting)

    total = len(scheduled)
    if total > 0 and _PROFILE.prefill_cadence:
        sched.num_executed_steps += 1

    req_ids = [r.request_id for r in scheduled]
    num_scheduled_tokens = dict.fromkeys(req_ids, 1)
    all_token_ids: dict[str, list[int]] = {}
    if not sched.use_v2_model_runner:
        prev = sched.prev_step_scheduled_req_ids
        if "all_token_ids" not in BROKEN_RULES:
            for r in scheduled:
                if r.request_id not in prev:
                    all_token_ids[r.request_id] = r.all_token_ids.copy()
        prev.clear()
        prev.update(req_ids)
    cached = CachedRequestData(
        req_ids=req_ids,
        resumed_req_ids=set(),
        new_token_ids=[],
        all_token_ids=all_token_ids,
        new_block_ids=new_block_ids,
        num_computed_tokens=num_computed_tokens,
        num_output_tokens=num_output_tokens,
    )
    # The fields only some versions' SchedulerOutput has.
    extra: dict[str, Any] = {}
    if _PROFILE.counts_common_prefix_blocks:
        extra["num_common_prefix_blocks"] = (
            manager.get_num_common_prefix_blocks(running[0].request_id)
            if running
            else [0] * len(sched.kv_cache_config.kv_cache_groups)
        )
    if skip_drafts:
        extra["skip_drafts"] = not drafts_needed
    manager.take_boundary_state_offloads()
    copies, retained = manager.take_kv_cache_block_copies()
    if copies:
        sched._free_cow_retained_blocks(retained, sched.sched_step_seq + 1)
    encoder_input_stats = None
    if sched.log_stats and sched.observability_config.enable_logging_iteration_details:
        encoder_input_stats = sched._make_scheduled_encoder_input_stats({})
    encoder_cache = sched.encoder_cache_manager
    # vLLM's order: freed hashes, encoder input updates, blocks to zero.
    freed_mm_hashes = encoder_cache.get_freed_mm_hashes()
    if _PROFILE.encoder_input_updates:
        extra["encoder_input_updates"] = sched._get_encoder_input_updates(
            num_scheduled_tokens, [], {}
        )
    out = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled_tokens,
        total_num_scheduled_tokens=total,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        scheduled_encoder_input_stats=encoder_input_stats,
        preempted_req_ids=sched.reset_preempted_req_ids,
        finished_req_ids=sched.finished_req_ids,
        free_encoder_mm_hashes=freed_mm_hashes,
        new_block_ids_to_zero=sched._get_new_block_ids_to_zero(),
        has_sync_kv_loads=False,
        kv_cache_block_copies=copies or None,
        kv_connector_block_state=None,
        num_spec_tokens_to_schedule=sched.num_spec_tokens,
        ec_manager_metadata=encoder_cache.get_manager_metadata(),
        **extra,
    )

    # vLLM's _update_after_schedule for one decode token each.
    count_in_flight = "in_flight" not in BROKEN_RULES
    inflight_prefills = sched._inflight_prefills
    for r in scheduled:
        r.num_computed_tokens += 1
        if count_in_flight:
            r.num_in_flight_tokens += 1
        r.is_prefill_chunk = False
        if inflight_prefills:
            inflight_prefills.discard(r)
    if is_async:
        _async_after_schedule(sched, scheduled, out)
    sched.finished_req_ids = set()
    sched.reset_preempted_req_ids = set()
    return out


def _async_after_schedule(sched: Any, scheduled: list[Request], out: SchedulerOutput) -> None:
    """``AsyncScheduler._update_after_schedule``'s part for decodes: each gets the
    placeholder of the token it samples, and the step's (empty) draft placeholders.
    Without pipeline parallelism (a step condition) the decode stagger is 1."""
    placeholders: list[int] = [-1] * out.num_spec_tokens_to_schedule
    sched._spec_token_placeholders = placeholders
    per_step = sched.num_sampled_tokens_per_step
    if "output_placeholders" in BROKEN_RULES:
        per_step = 0
    next_step = sched.current_step + 1 if sched.use_v2_model_runner else None
    for r in scheduled:
        r.num_output_placeholders += per_step
        r.spec_token_ids = placeholders
        if next_step is not None:
            r.next_decode_eligible_step = next_step


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
    sched: Any, scheduler_output: SchedulerOutput, output: Any, is_async: bool = False
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
    before the first one vLLM must serve are taken."""
    if not _update_applies(sched, output):
        return None
    sampled = output.sampled_token_ids
    if not sampled:
        return None
    split = _STEP_UPDATE.split(
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
        broken=BROKEN_RULES,
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
