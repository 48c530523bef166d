"""``hscache_tools.testing.scheduler_step`` against vLLM's real ``Scheduler``.

The emulation drives both the differential traces and the benchmark, so it must make the
manager calls vLLM 0.33's ``Scheduler.schedule()`` makes. vLLM's Scheduler (built offline)
and the emulation, each over its own vLLM ``KVCacheManager``, get the same request stream
(shared prefixes, chunked prefill under a token budget, decode, finishes, a small pool that
forces preemptions) and the same sampled tokens; after every step the scheduled token
counts, the preempted requests, the running and waiting queues and every running request's
block table must be equal.
"""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache_tools.testing.kv_cache import full_attention_config
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.offline_scheduler import make_scheduler, stub_runner_output
from hscache_tools.testing.requests import make_request
from hscache_tools.testing.scheduler_step import (
    Admit,
    Admitted,
    running_num_new_tokens,
    schedule,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
MAX_RUNNING = 8
BUDGET = 96
MAX_MODEL_LEN = 1024


class EmulatedScheduler:
    """The emulation's policy over vLLM's own manager, with vLLM's request bookkeeping."""

    def __init__(self, num_blocks: int, full_sequence_must_fit: bool) -> None:
        self.full_sequence_must_fit = full_sequence_must_fit
        self.manager = KVCacheManager(
            **manager_kwargs(
                full_attention_config(num_blocks, BLOCK_SIZE),
                max_model_len=MAX_MODEL_LEN,
                max_in_flight_tokens=BUDGET,
                enable_kv_cache_events=False,
            )
        )
        self.max_running = MAX_RUNNING
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def num_new_tokens(self, request: Request, budget: int) -> int:
        return running_num_new_tokens(request, budget, MAX_MODEL_LEN)

    def allocate_running(self, request: Request, num_new_tokens: int) -> Any:
        return self.manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=0)

    def preempt(self, request: Request) -> None:
        self.manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def admit(self, request: Request, budget: int) -> Admitted | Admit:
        computed, hit, _ = self.manager.get_computed_blocks(request)
        n = min(request.num_tokens - hit, budget)
        blocks = self.manager.allocate_slots(
            request,
            n,
            num_new_computed_tokens=hit,
            new_computed_blocks=computed,
            full_sequence_must_fit=self.full_sequence_must_fit,
            has_scheduled_reqs=bool(self.running),
        )
        if blocks is None:
            return Admit.STOP
        self.manager.record_prefix_cache_stats(request, hit)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit
        return Admitted(n)

    def step(self, sampled: dict[str, int]) -> tuple[dict[str, int], set[str]]:
        """One ``schedule()`` + ``update_from_output()``; ``sampled``: each request's token."""
        self.manager.new_step_starts()
        plan = schedule(self.running, self.waiting, BUDGET, self)
        scheduled = {s.item.request_id: s.num_new_tokens for s in plan.scheduled}
        for entry in plan.scheduled:
            req = entry.item
            req.num_computed_tokens += entry.num_new_tokens
            if req.num_computed_tokens >= req.num_tokens:
                req.append_output_token_ids(sampled[req.request_id])
                if req.num_output_tokens >= req.max_tokens:
                    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    self.manager.free(req)
                    self.running.remove(req)
        return scheduled, {r.request_id for r in plan.preempted}


def _token(step: int, request_id: str) -> int:
    return (step * 31 + int(request_id[1:]) * 7) % 1000


def _stream(seed: int, steps: int) -> list[list[tuple[str, list[int], int]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((16, 40, 64)))] for _ in range(3)]
    out: list[list[tuple[str, list[int], int]]] = []
    n = 0
    for _ in range(steps):
        batch = []
        for _ in range(rng.choice((0, 0, 1, 2))):
            prompt = rng.choice(prefixes) + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 90))
            ]
            batch.append((f"r{n}", prompt, rng.randrange(1, 30)))
            n += 1
        out.append(batch)
    return out


def _requests(batch: list[tuple[str, list[int], int]]) -> list[Request]:
    return [
        make_request(
            rid, prompt, max_tokens=max_tokens, hash_block_size=BLOCK_SIZE, ignore_eos=True
        )
        for rid, prompt, max_tokens in batch
    ]


def _tables(manager: Any, running: list[Any]) -> dict[str, Any]:
    return {r.request_id: manager.get_block_ids(r.request_id) for r in running}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_blocks", [40, 400])
@pytest.mark.parametrize("reserve_full_isl", [True, False], ids=["full-isl", "first-chunk"])
def test_emulation_makes_the_schedulers_decisions(
    model_dir: Path, seed: int, num_blocks: int, reserve_full_isl: bool
) -> None:
    """``reserve_full_isl``: vLLM's default admission check (the whole prompt must fit,
    ``full_sequence_must_fit``), or only the first chunk (what the benchmark emulates)."""
    real: Scheduler = make_scheduler(
        Scheduler,
        num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_RUNNING,
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_MODEL_LEN,
        scheduler_reserve_full_isl=reserve_full_isl,
        model_path=model_dir,
    )
    emulated = EmulatedScheduler(num_blocks, reserve_full_isl)
    preemptions = 0
    for step, batch in enumerate(_stream(seed, 80)):
        for req in _requests(batch):
            real.add_request(req)
        emulated.waiting.extend(_requests(batch))

        out = real.schedule()
        ids = list(out.num_scheduled_tokens)
        real.update_from_output(
            out,
            stub_runner_output(
                out, lambda i, ids=ids, step=step: _token(step, ids[i]), real.requests
            ),
        )
        sampled = {r.request_id: _token(step, r.request_id) for r in emulated.running}
        sampled |= {r.request_id: _token(step, r.request_id) for r in emulated.waiting}
        scheduled, preempted = emulated.step(sampled)

        assert scheduled == dict(out.num_scheduled_tokens), f"step {step}: token counts"
        assert preempted == set(out.preempted_req_ids or ()), f"step {step}: preemptions"
        assert [r.request_id for r in emulated.running] == [r.request_id for r in real.running]
        assert [r.request_id for r in emulated.waiting] == [r.request_id for r in real.waiting]
        assert _tables(emulated.manager, emulated.running) == _tables(
            real.kv_cache_manager, list(real.running)
        ), f"step {step}: block tables"
        preemptions += len(preempted)
    if num_blocks == 40:
        assert preemptions > 0, "the small pool must force preemptions"
