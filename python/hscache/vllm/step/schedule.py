"""The ``schedule()`` phase of the fast path (``hscache.vllm.Scheduler``;
``docs/fast_step.md``).

:func:`schedule` serves a whole step that admits nothing, or nothing (returns ``None``
before changing anything): no connector, speculative decoding, LoRA, pipeline
parallelism, deferred frees or priority policy; every running request a decode (one
known token to compute) or a prefill chunk (the rest of its prompt), with no encoder
inputs, no structured output and no placeholders beyond async scheduling's one, within
``max_model_len``; no step that defers prefill chunks beside a decode (the DP throttle,
the local prefill cadence); and no request waiting unless vLLM's waiting loop stops
before it looks at one (the running requests fill the seats, :func:`_seats_full`, or
spend the token budget). Each request's tokens (capped by the step's
``long_prefill_token_threshold``, the budget in running order and the room
``max_model_len`` leaves; ``src/step/schedule.rs``) and the allocations are one core
call per step (``hscache._core.StepSchedule``, ``src/python/step_schedule.rs``);
preemption under pool pressure follows vLLM's FCFS rule with vLLM's own
``_preempt_request``; the ``SchedulerOutput`` carries every field vLLM sets. The rules
applied here are :data:`hscache.vllm.step.rules.GLUE_RULES`.
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


def _seats_full(sched: Any) -> bool:
    """Whether vLLM's waiting loop, entered after the running requests were scheduled
    (no drafts, unpaused), leaves at its seat check, before it looks at a waiting
    request: the running requests and the streaming sessions fill the admission seats
    (the profile's ``waiting_loop_seats``: ``max_num_active_reqs`` in 0.33 / 0.32,
    ``max_num_running_reqs`` in 0.30). Its other early exit, a spent token or input
    budget (``while token_budget > 0``, ``input_budget <= draft_slots``), only the plan
    can tell: ``StepSchedule``'s ``queue_left``. Either way it then admits nothing and
    changes nothing (the step's queue, its order, the deferred set and every waiting
    request stay as they are). A preemption skips that loop whatever this says
    (:func:`schedule`)."""
    seats: int = getattr(sched, _PROFILE.waiting_loop_seats)
    if "queue_seats" in _rules.BROKEN:
        seats -= 1  # mutant: one seat free counts as full
    return bool(len(sched.running) + sched.num_waiting_for_streaming_input >= seats)


def _long_prefill_threshold(sched: Any) -> int:
    """The step's effective ``long_prefill_token_threshold`` (0: none), as the top of
    vLLM's ``schedule()`` computes it: in 0.33 / 0.32 only with more than one request
    running or waiting, floored at a fair share of the input budget when adaptive
    (the profile's ``long_prefill_eligibility``); 0.30 takes the configured value."""
    config = sched.scheduler_config
    threshold: int = config.long_prefill_token_threshold
    if threshold <= 0 or not _PROFILE.long_prefill_eligibility:
        return threshold
    num_running, num_waiting = sched.get_request_counts()
    eligible = num_running + num_waiting
    if eligible <= 1:
        return 0
    if sched.adaptive_long_prefill_threshold:
        threshold = max(threshold, config.max_num_batched_tokens // eligible)
    return threshold


def _throttled(sched: Any, throttle_prefills: bool) -> bool:
    """Whether the step holds prefill chunks back when a decode runs: the DP throttle
    without a capacity bound, or the local prefill cadence's hold (0.33)."""
    if sched.prefill_capacity_bound:
        return False
    return throttle_prefills or bool(
        _PROFILE.prefill_cadence
        and sched.local_prefill_interval > 1
        and (sched.num_executed_steps + 1) - sched.last_prefill_step < sched.local_prefill_interval
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
    manager: Any, running: list[Request], start: int, lookahead: int, tokens: list[int]
) -> tuple[int, list[Any]]:
    """``allocate_slots(request, tokens[i])`` for the planned ``running[start:]``
    through a manager that is not the core (parity mode, vLLM's own manager), up to the
    first that does not fit: ``(its index, the new block ids of the others)``."""
    allocate = manager.allocate_slots
    new_block_ids: list[Any] = []
    end = min(len(tokens), len(running))
    for i in range(start, end):
        if not tokens[i]:  # skipped by vLLM's loop
            new_block_ids.append(None)
            continue
        blocks = allocate(running[i], tokens[i], num_lookahead_tokens=lookahead)
        if blocks is None:
            return i, new_block_ids
        new_block_ids.append(blocks.get_block_ids(allow_none=True))
    return end, new_block_ids


def schedule(sched: Any, throttle_prefills: bool, is_async: bool = False) -> SchedulerOutput | None:
    """vLLM's ``schedule()`` for a step that admits nothing, or ``None`` (nothing
    changed) when the step is not one. ``is_async``: ``sched`` is an ``AsyncScheduler``
    (its ``_update_after_schedule`` adds output placeholders).

    The per-request rule (``src/step/schedule.rs``: each running request's tokens, a
    decode's one or a prefill's chunk, under the threshold, the budget in running order
    and the ``max_model_len`` room, with async scheduling's last-step rule) and the
    allocations are one core call (``StepSchedule.decodes``), which stops at the first
    request that does not fit; :func:`_preempt_until_fits` preempts from the tail with
    vLLM's ``_preempt_request`` and resumes the call from that request."""
    if not _step_applies(sched):
        return None
    running: list[Request] = sched.running
    budget = min(sched.max_num_scheduled_tokens, sched.scheduler_config.max_num_batched_tokens)
    if budget <= 0:
        return None
    # A queue vLLM's waiting loop could admit from: vLLM's step, unless the plan spends
    # the budget (or a preemption skips that loop, which only the allocations can tell).
    queue_left: int | None = None
    if "waiting" not in _rules.BROKEN and not _nothing_waiting(sched) and not _seats_full(sched):
        queue_left = 1 if "queue_budget" in _rules.BROKEN else 0
    throttle = _throttled(sched, throttle_prefills)
    step = sched.current_step + 1
    phase = _step_schedule(sched, is_async)
    decided = _plan_and_allocate(sched, phase, step, budget, throttle, queue_left)
    if decided is None:
        return None
    done, new_block_ids, num_computed_tokens, num_output_tokens, tokens, first_chunk, any_decode = (
        decided
    )

    # From here on the step is served: the same state changes as vLLM's, in its order
    # (the manager's step has started and the requests before `done` are allocated).
    sched.current_step = step
    done, preempted = _preempt_until_fits(sched, phase, step, done, tokens, new_block_ids)
    scheduled = running[:done]
    if done < len(tokens):
        num_computed_tokens = num_computed_tokens[:done]
        num_output_tokens = num_output_tokens[:done]
        tokens = tokens[:done]
    if 0 in tokens and "skip" not in _rules.BROKEN:
        # The requests vLLM's loop skipped (`continue`) are not in the step.
        keep = [i for i, k in enumerate(tokens) if k]
        scheduled = [scheduled[i] for i in keep]
        num_computed_tokens = [num_computed_tokens[i] for i in keep]
        num_output_tokens = [num_output_tokens[i] for i in keep]
        new_block_ids = [new_block_ids[i] for i in keep]
        tokens = [tokens[i] for i in keep]

    skip_drafts = _PROFILE.skip_drafts
    drafts_needed = not skip_drafts or not sched.can_skip_drafts
    if not drafts_needed:
        for r, k in zip(scheduled, tokens, strict=True):
            if not sched._drafts_unused(r, r.num_computed_tokens, k):
                drafts_needed = True
                break

    total = sum(tokens)
    _record_step(
        sched,
        preempted=preempted,
        defer_prefills=throttle and any_decode,
        prefill_scheduled=first_chunk is not None and first_chunk < done,
        total=total,
    )
    extra: dict[str, Any] = {}
    if skip_drafts:
        extra["skip_drafts"] = not drafts_needed
    out = _scheduler_output(
        sched, scheduled, tokens, new_block_ids, num_computed_tokens, num_output_tokens, extra
    )
    _update_after_schedule(sched, scheduled, tokens, out, is_async)
    return out


def _plan_and_allocate(
    sched: Any,
    phase: StepSchedule,
    step: int,
    budget: int,
    throttle: bool,
    queue_left: int | None,
) -> tuple[int, list[Any], list[int], list[int], list[int], int | None, bool] | None:
    """The step's plan and its allocations (the core's one call, or the plan and a
    manager that is not the core allocating per request): ``(done, new_block_ids,
    num_computed_tokens, num_output_tokens, tokens, first_chunk, any_decode)``, ``done``
    the first planned request that did not fit; ``None`` (nothing changed) when the step
    is not the fast path's."""
    running: list[Request] = sched.running
    manager = sched.kv_cache_manager
    threshold = _long_prefill_threshold(sched)
    if isinstance(manager, KVCacheCore):
        return phase.decodes(
            manager,
            running,
            0,
            step,
            token_budget=budget,
            long_prefill_token_threshold=threshold,
            throttle=throttle,
            queue_left=queue_left,
        )
    plan = phase.plain_decodes(
        running,
        step,
        token_budget=budget,
        long_prefill_token_threshold=threshold,
        throttle=throttle,
        queue_left=queue_left,
    )
    if plan is None:
        return None
    num_computed_tokens, num_output_tokens, tokens, first_chunk, any_decode = plan
    manager.new_step_starts()
    done, new_block_ids = _allocate_each(manager, running, 0, sched.num_lookahead_tokens, tokens)
    return (
        done,
        new_block_ids,
        num_computed_tokens,
        num_output_tokens,
        tokens,
        first_chunk,
        any_decode,
    )


def _preempt_until_fits(
    sched: Any,
    phase: StepSchedule,
    step: int,
    done: int,
    tokens: list[int],
    new_block_ids: list[Any],
) -> tuple[int, bool]:
    """Pool pressure: ``running[done]``, planned, did not fit. vLLM preempts from the
    tail and retries it, until it fits or is itself the victim; the allocations resume
    from it (their block ids appended to ``new_block_ids``). ``(done, preempted)``."""
    running: list[Request] = sched.running
    manager = sched.kv_cache_manager
    timestamp = time.monotonic()
    preempted = False
    while done < min(len(tokens), len(running)) and "preempt" not in _rules.BROKEN:
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
            resumed = phase.decodes(manager, running, done, step, tokens=tokens)
            if resumed is None:  # pragma: no cover (a resuming call only allocates)
                raise RuntimeError("StepSchedule.decodes refused a resumed step")
            done, more = resumed[0], resumed[1]
        else:
            done, more = _allocate_each(manager, running, done, sched.num_lookahead_tokens, tokens)
        new_block_ids += more
    return done, preempted


def _record_step(
    sched: Any, *, preempted: bool, defer_prefills: bool, prefill_scheduled: bool, total: int
) -> None:
    """What vLLM's step records besides the output: whether admissions were
    capacity-bound, and 0.33's executed steps and local prefill cadence."""
    # vLLM's admission loop admits nothing (the queues are empty, or it stops before
    # looking at a request: `_queue_blocked`), and records whether admissions were
    # capacity-bound on a step it does not defer.
    if not preempted and not defer_prefills and "capacity_bound" not in _rules.BROKEN:
        if _PROFILE.kv_holding_queues:
            _, num_waiting = sched.get_request_counts()
            sched.prefill_capacity_bound = num_waiting > len(sched.deferred_waiting)
        else:
            sched.prefill_capacity_bound = bool(sched.waiting)
    if _PROFILE.prefill_cadence:
        if total > 0:
            sched.num_executed_steps += 1
        # The cadence restarts from a step that carried a running prefill chunk.
        if (
            sched.local_prefill_interval > 1
            and prefill_scheduled
            and "last_prefill_step" not in _rules.BROKEN
        ):
            sched.last_prefill_step = sched.num_executed_steps


def _scheduler_output(
    sched: Any,
    scheduled: list[Request],
    tokens: list[int],
    new_block_ids: list[Any],
    num_computed_tokens: list[int],
    num_output_tokens: list[int],
    extra: dict[str, Any],
) -> SchedulerOutput:
    """The step's ``SchedulerOutput`` with every field vLLM sets, its side effects in
    vLLM's order (MRV1's ``all_token_ids`` and last step's ids, CoW copies, freed
    encoder hashes, encoder input updates, blocks to zero); ``extra``: the fields only
    some versions have."""
    manager = sched.kv_cache_manager
    running: list[Request] = sched.running
    req_ids = [r.request_id for r in scheduled]
    num_scheduled_tokens = dict(zip(req_ids, tokens, strict=True))
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
    if _PROFILE.counts_common_prefix_blocks:
        extra["num_common_prefix_blocks"] = (
            manager.get_num_common_prefix_blocks(running[0].request_id)
            if running
            else [0] * len(sched.kv_cache_config.kv_cache_groups)
        )
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
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled_tokens,
        total_num_scheduled_tokens=sum(tokens),
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


def _update_after_schedule(
    sched: Any, scheduled: list[Request], tokens: list[int], out: SchedulerOutput, is_async: bool
) -> None:
    """vLLM's ``_update_after_schedule``: each request's tokens computed and in flight,
    and whether it is still prefilling; the step's finished and preempted sets reset."""
    count_in_flight = "in_flight" not in _rules.BROKEN
    chunk_flag = "prefill_chunk" not in _rules.BROKEN
    inflight_prefills = sched._inflight_prefills
    for r, k in zip(scheduled, tokens, strict=True):
        r.num_computed_tokens += k
        if count_in_flight:
            r.num_in_flight_tokens += k
        chunk = chunk_flag and r.num_computed_tokens < len(r._all_token_ids) + (
            r.num_output_placeholders
        )
        r.is_prefill_chunk = chunk
        if inflight_prefills and not chunk:
            inflight_prefills.discard(r)
    if is_async:
        _async_after_schedule(sched, scheduled, out)
    sched.finished_req_ids = set()
    sched.reset_preempted_req_ids = set()


def _async_after_schedule(sched: Any, scheduled: list[Request], out: SchedulerOutput) -> None:
    """``AsyncScheduler._update_after_schedule``'s part without drafts: each request
    that samples this step (not a prefill chunk that ends mid-prompt) gets the
    placeholder of the token it samples, and the step's (empty) draft placeholders.
    Without pipeline parallelism (a step condition) the decode stagger is 1."""
    placeholders: list[int] = [-1] * out.num_spec_tokens_to_schedule
    sched._spec_token_placeholders = placeholders
    per_step = sched.num_sampled_tokens_per_step
    if "output_placeholders" in _rules.BROKEN:
        per_step = 0
    every = "chunk_placeholders" in _rules.BROKEN  # mutant: a mid-prompt chunk samples
    next_step = sched.current_step + 1 if sched.use_v2_model_runner else None
    for r in scheduled:
        if r.is_prefill_chunk and not every:
            continue
        r.num_output_placeholders += per_step
        r.spec_token_ids = placeholders
        if next_step is not None:
            r.next_decode_eligible_step = next_step
