"""The ``schedule()`` phase of the steady decode step's fast path
(``hscache.vllm.Scheduler``; ``docs/fast_step.md``).

:func:`schedule` serves a whole step, or nothing (returns ``None`` before changing
anything): no connector, speculative decoding, LoRA, pipeline parallelism, deferred frees
or priority policy, every running request a plain decode (one known token to compute, no
encoder inputs, no structured output, no placeholders, within ``max_model_len``) that the
token budget does not bind, and no request waiting unless vLLM's waiting loop stops
before it looks at one (the running decodes fill the seats or spend the budget:
:func:`_queue_blocked`). The per-request rule
(``src/step/schedule.rs``) and the allocations are one core call per step
(``hscache._core.StepSchedule``, ``src/python/step_schedule.rs``); preemption under pool
pressure follows vLLM's FCFS rule with vLLM's own ``_preempt_request``; the
``SchedulerOutput`` carries every field vLLM sets. The rules applied here are
:data:`hscache.vllm.step.rules.GLUE_RULES`.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import Request

from hscache._core import KVCacheCore, StepSchedule
from hscache.vllm.step import rules as _rules
from hscache.vllm.version import require

__all__ = ["schedule"]

_PROFILE = require()


def _step_schedule(sched: Any, is_async: bool) -> StepSchedule:
    """The scheduler's ``StepSchedule`` (its constants, read once)."""
    phase: StepSchedule | None = sched.__dict__.get("_hscache_step_schedule")
    if phase is None or phase.is_async != is_async:
        phase = StepSchedule(
            is_async=is_async,
            max_model_len=sched.max_model_len,
            num_sampled_tokens_per_step=sched.num_sampled_tokens_per_step,
            num_lookahead_tokens=sched.num_lookahead_tokens,
        )
        sched._hscache_step_schedule = phase
    return phase


def _nothing_waiting(sched: Any) -> bool:
    """No request in any of the version's waiting queues."""
    if _PROFILE.kv_holding_queues:
        return not (sched.waiting or sched.kv_holding_waiting or sched.deferred_waiting)
    return not (sched.waiting or sched.skipped_waiting)


def _queue_blocked(sched: Any, n: int) -> bool:
    """Whether vLLM's waiting loop, entered after ``n`` running decodes were scheduled
    (one token each, no drafts, unpaused), leaves at its first checks, before it looks at
    a waiting request: the token budget or the input budget spent
    (``while token_budget > 0``, ``input_budget <= draft_slots``), or the running requests
    and the streaming sessions filling the admission seats (the profile's
    ``waiting_loop_seats``: ``max_num_active_reqs`` in 0.33 / 0.32,
    ``max_num_running_reqs`` in 0.30). It then admits nothing and changes nothing (the
    step's queue, its order, the deferred set and every waiting request stay as they
    are). A preemption skips that loop whatever this says (:func:`schedule`)."""
    seats: int = getattr(sched, _PROFILE.waiting_loop_seats)
    if "queue_seats" in _rules.BROKEN:
        seats -= 1  # mutant: one seat free counts as full
    spent = n
    if "queue_budget" in _rules.BROKEN:
        spent += 1  # mutant: one token left counts as spent
    return bool(
        n + sched.num_waiting_for_streaming_input >= seats
        or spent >= sched.max_num_scheduled_tokens
        or spent >= sched.scheduler_config.max_num_batched_tokens
    )


def _step_applies(sched: Any) -> bool:
    """The step-level conditions of :func:`schedule` (cheap attribute reads); the
    waiting side is :func:`schedule`'s, once the step's decodes are counted."""
    return (
        bool(sched.running)
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
    the allocations are one core call (``StepSchedule.decodes``), which stops at
    the first request that does not fit; this function preempts from the tail with
    vLLM's ``_preempt_request`` and resumes the call from that request."""
    if not _step_applies(sched):
        return None
    running: list[Request] = sched.running
    n = len(running)
    if "budget" not in _rules.BROKEN and (
        n > sched.max_num_scheduled_tokens or n > sched.scheduler_config.max_num_batched_tokens
    ):
        return None
    # A queue vLLM's waiting loop could admit from: vLLM's step (unless a preemption
    # would skip that loop, which only the allocations can tell).
    if (
        "waiting" not in _rules.BROKEN
        and not _nothing_waiting(sched)
        and not _queue_blocked(sched, n)
    ):
        return None
    step = sched.current_step + 1
    manager = sched.kv_cache_manager
    lookahead = sched.num_lookahead_tokens
    phase = _step_schedule(sched, is_async)
    if isinstance(manager, KVCacheCore):
        decided = phase.decodes(manager, running, 0, step)
        if decided is None:
            return None
        done, new_block_ids, num_computed_tokens, num_output_tokens = decided
    else:
        counts = phase.plain_decodes(running, step)
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
    while done < len(running) and "preempt" not in _rules.BROKEN:
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
            resumed = phase.decodes(manager, running, done, step)
            if resumed is None:  # pragma: no cover (a resuming call only allocates)
                raise RuntimeError("StepSchedule.decodes refused a resumed step")
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

    # vLLM's admission loop admits nothing (the queues are empty, or it stops before
    # looking at a request: `_queue_blocked`), and records whether admissions were
    # capacity-bound on a step it does not defer.
    if not preempted and not defer_prefills and "capacity_bound" not in _rules.BROKEN:
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
        if "all_token_ids" not in _rules.BROKEN:
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
    count_in_flight = "in_flight" not in _rules.BROKEN
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
    if "output_placeholders" in _rules.BROKEN:
        per_step = 0
    next_step = sched.current_step + 1 if sched.use_v2_model_runner else None
    for r in scheduled:
        r.num_output_placeholders += per_step
        r.spec_token_ids = placeholders
        if next_step is not None:
            r.next_decode_eligible_step = next_step
