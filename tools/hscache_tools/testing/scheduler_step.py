"""The one emulation of vLLM 0.33's ``Scheduler.schedule()`` as a ``KVCacheManager`` sees it.

vLLM's ``Scheduler.schedule()`` (``vllm/v1/core/sched/scheduler.py``) makes the manager's
decisions matter in two loops, and both of hscache's harnesses need exactly those loops:
the differential generator (``tests/vllm_diff/generator.py``: random traces, every call
compared) and the benchmark driver (:mod:`hscache_tools.bench.driver`: timed calls). This module
holds the loops; a *policy* object supplied by each harness makes the calls (timed, recorded,
randomized) and keeps its own request state:

1. **Running requests**, in order, while the token budget lasts: each gets
   :func:`running_num_new_tokens` tokens (``policy.num_new_tokens``; 0 skips it), then
   ``policy.allocate_running``. On ``None`` the *last* running request is preempted
   (removed from the running list, ``policy.preempt``) and the allocation retried, until it
   fits or the request preempted itself.
2. **Waiting requests**, first come first served, only if nothing was preempted, while the
   budget lasts and fewer than ``policy.max_running`` run: ``policy.admit`` does the lookup
   and allocation and answers with an :class:`Admitted` (the request moves from the waiting
   queue to the running list), :data:`Admit.STOP` (it does not fit: stop admitting) or
   :data:`Admit.NEXT` (the policy moved it elsewhere itself, e.g. aborted it or parked it
   waiting for a KV transfer: go on with the next).

What a step does after the model ran (token appends, finishes, speculative-token acceptance,
async placeholders) differs between the harnesses and stays with them. Items are whatever the
harness queues (``Request`` objects, request ids). No vLLM import: the policy owns the calls.

Key properties (vLLM's, kept here once): the budget counts scheduled tokens, not blocks; a
preempted request goes back to its harness (``preempt``), never to the scheduled list; the
waiting loop never runs in a step that preempted.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "NEW",
    "RESUMED",
    "RUNNING",
    "Admit",
    "Admitted",
    "Scheduled",
    "SchedulerPolicy",
    "StepSchedule",
    "running_num_new_tokens",
    "schedule",
    "schedule_running",
    "schedule_waiting",
]

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)

# What a scheduled entry is (``Scheduled.kind``): a running request's next chunk or decode
# step, a new request's first chunk, a preempted request's first chunk after resuming.
RUNNING, NEW, RESUMED = 0, 1, 2


class Admit(enum.Enum):
    """``policy.admit`` outcomes other than :class:`Admitted`."""

    STOP = "stop"
    """The request does not fit: stop admitting in this step."""
    NEXT = "next"
    """The policy took the request out of the waiting queue itself: try the next one."""


@dataclass(slots=True)
class Admitted:
    """A waiting request was allocated ``num_new_tokens`` tokens' slots."""

    num_new_tokens: int
    blocks: Any = None
    """What the harness wants to keep of the allocation (e.g. ``get_blocks``'s answer)."""
    kind: int = NEW


@dataclass(slots=True)
class Scheduled(Generic[T]):
    """One entry of the step: ``item`` computes ``num_new_tokens`` tokens."""

    item: T
    num_new_tokens: int
    blocks: Any
    """``allocate_slots``'s answer (running) or :attr:`Admitted.blocks` (admitted)."""
    kind: int


@dataclass(slots=True)
class StepSchedule(Generic[T]):
    """What :func:`schedule` decided."""

    scheduled: list[Scheduled[T]] = field(default_factory=list)
    preempted: list[T] = field(default_factory=list)
    budget: int = 0
    """Tokens of the budget left over."""


class SchedulerPolicy(Protocol[T_contra]):
    """The harness side of a step: the manager calls and the harness's own bookkeeping."""

    @property
    def max_running(self) -> int:
        """vLLM's ``max_num_seqs``."""
        ...

    def num_new_tokens(self, item: T_contra, budget: int) -> int:
        """Tokens to schedule for a running item (0 or less: skip it this step)."""
        ...

    def allocate_running(self, item: T_contra, num_new_tokens: int) -> Any:
        """``allocate_slots`` for a running item; None when it does not fit."""
        ...

    def preempt(self, item: T_contra) -> None:
        """Free a preempted item (already removed from the running list) and requeue it."""
        ...

    def admit(self, item: T_contra, budget: int) -> Admitted | Admit:
        """Look up and allocate the first waiting item (still at the head of the queue)."""
        ...


def running_num_new_tokens(request: Any, token_budget: int, max_model_len: int) -> int:
    """Tokens vLLM 0.33's Scheduler schedules for a running ``Request`` (0: skip it).

    Its spec tokens and async placeholders included, capped by the budget and by
    ``max_model_len - 1`` computed tokens; 0 when async scheduling already scheduled the step
    that reaches ``max_tokens`` (the Scheduler skips the request then). No long-prefill
    threshold (vLLM's default, 0)."""
    placeholders: int = request.num_output_placeholders
    computed: int = request.num_computed_tokens
    if (
        placeholders > 0
        and computed + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens
    ):
        return 0
    n: int = request.num_tokens_with_spec + placeholders - computed
    return min(n, token_budget, max_model_len - 1 - computed)


def schedule_running(
    running: list[T], budget: int, policy: SchedulerPolicy[T], step: StepSchedule[T]
) -> int:
    """The running loop (1. above); appends to ``step`` and returns the budget left."""
    i = 0
    while i < len(running) and budget > 0:
        item = running[i]
        n = policy.num_new_tokens(item, budget)
        if n <= 0:
            i += 1
            continue
        while True:
            blocks = policy.allocate_running(item, n)
            if blocks is not None:
                break
            victim = running.pop()
            policy.preempt(victim)
            step.preempted.append(victim)
            if victim is item:
                break
        if blocks is None:
            break
        step.scheduled.append(Scheduled(item, n, blocks, RUNNING))
        budget -= n
        i += 1
    return budget


def schedule_waiting(
    waiting: deque[T],
    running: list[T],
    budget: int,
    policy: SchedulerPolicy[T],
    step: StepSchedule[T],
) -> int:
    """The waiting loop (2. above); appends to ``step`` and returns the budget left."""
    while budget > 0 and waiting and len(running) < policy.max_running:
        item = waiting[0]
        outcome = policy.admit(item, budget)
        if outcome is Admit.STOP:
            break
        if outcome is Admit.NEXT:
            continue
        waiting.popleft()
        running.append(item)
        step.scheduled.append(Scheduled(item, outcome.num_new_tokens, outcome.blocks, outcome.kind))
        budget -= outcome.num_new_tokens
    return budget


def schedule(
    running: list[T], waiting: deque[T], token_budget: int, policy: SchedulerPolicy[T]
) -> StepSchedule[T]:
    """One ``Scheduler.schedule()``: the running loop, then the waiting loop unless it
    preempted. ``running`` and ``waiting`` are updated in place."""
    step: StepSchedule[T] = StepSchedule()
    budget = schedule_running(running, token_budget, policy, step)
    if not step.preempted:
        budget = schedule_waiting(waiting, running, budget, policy, step)
    step.budget = budget
    return step
