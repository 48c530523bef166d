"""``hscache.vllm.Scheduler`` / ``AsyncScheduler``: vLLM's real schedulers on hscache's manager.

Runs vLLM's unchanged ``Scheduler`` twice on the same randomized request stream (shared
prefixes, chunked prefill under a token budget, decode, finishes, pool pressure with
preemption): once as shipped, once as ``hscache.vllm.Scheduler``. Every step's
``SchedulerOutput`` (scheduled requests, their block ids and computed tokens, preemptions)
and every step's stats must be identical.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import hscache.vllm
import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
import vllm.v1.core.kv_cache_utils as kcu
import vllm.v1.engine.core as engine_core
from hscache.vllm import block_hasher as bh
from hscache.vllm.parity import prefix_cache_stats_key
from hscache_tools.testing.offline_scheduler import make_scheduler as _make_scheduler
from hscache_tools.testing.offline_scheduler import stub_runner_output
from hscache_tools.testing.offline_scheduler import summarize_output as output_summary
from hscache_tools.testing.requests import make_request
from vllm.utils import hashing
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

BLOCK_SIZE = 16
SMALL_POOL = 40  # blocks: small enough that the streams preempt


def make_scheduler(
    cls: type, model_dir: Path, num_blocks: int, async_scheduling: bool = False
) -> Any:
    return _make_scheduler(
        cls,
        num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=2048,
        async_scheduling=async_scheduling,
        model_path=model_dir,
    )


def run_stream(
    cls: type, model_dir: Path, seed: int, num_blocks: int, async_scheduling: bool = False
) -> list[Any]:
    rng = random.Random(seed)
    sched = make_scheduler(cls, model_dir, num_blocks, async_scheduling)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([16, 40, 64]))] for _ in range(3)]
    trace: list[Any] = []
    next_id = 0
    for step in range(60):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(prefixes) + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 90))
            ]
            req = make_request(
                f"r{next_id}",
                prompt,
                hash_block_size=BLOCK_SIZE,
                max_tokens=rng.randrange(1, 30),
                ignore_eos=True,
            )
            next_id += 1
            sched.add_request(req)
        out = sched.schedule()
        trace.append(output_summary(out))
        sched.update_from_output(
            out, stub_runner_output(out, lambda i, step=step: (step * 7 + i) % 1000)
        )
        stats = sched.make_stats()
        if stats is not None:
            trace.append((stats.kv_cache_usage, prefix_cache_stats_key(stats.prefix_cache_stats)))
    return trace


def assert_same_streams(want: list[Any], got: list[Any], seed: int, num_blocks: int) -> None:
    """Equal step records, on streams that exercise what matters: prefix hits, and
    preemption on small pools."""
    outputs = [r for r in want if len(r) == 6]
    assert any(any(ct > 0 for _, _, ct in r[0]) for r in outputs), "no prefix hit"
    if num_blocks <= SMALL_POOL:
        assert any(r[5] or r[4] for r in outputs), "no preemption or resumption"
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"step record {i} differs (seed {seed}, {num_blocks} blocks)"


def test_scheduler_subclass_installs_the_hscache_manager(model_dir: Path) -> None:
    sched = make_scheduler(hscache.vllm.Scheduler, model_dir, 256)
    assert isinstance(sched.kv_cache_manager, hscache.vllm.KVCacheManager)
    assert isinstance(sched.encoder_cache_manager, hscache.vllm.EncoderCacheManager)
    assert isinstance(sched, VllmScheduler)
    sched_async = make_scheduler(hscache.vllm.AsyncScheduler, model_dir, 256, True)
    assert isinstance(sched_async.kv_cache_manager, hscache.vllm.KVCacheManager)
    # The name vLLM's module binds is restored after construction.
    import vllm.v1.core.sched.scheduler as m

    assert m.KVCacheManager is not hscache.vllm.KVCacheManager


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [SMALL_POOL, 400])
def test_same_scheduler_outputs_as_vllm(model_dir: Path, seed: int, num_blocks: int) -> None:
    want = run_stream(VllmScheduler, model_dir, seed, num_blocks)
    got = run_stream(hscache.vllm.Scheduler, model_dir, seed, num_blocks)
    assert_same_streams(want, got, seed, num_blocks)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_blocks", [SMALL_POOL, 400])
def test_same_async_scheduler_outputs_as_vllm(model_dir: Path, seed: int, num_blocks: int) -> None:
    """vLLM's ``AsyncScheduler`` (output placeholders, one step ahead) against
    ``hscache.vllm.AsyncScheduler`` on the same stream."""
    want = run_stream(VllmAsyncScheduler, model_dir, seed, num_blocks, async_scheduling=True)
    got = run_stream(hscache.vllm.AsyncScheduler, model_dir, seed, num_blocks, True)
    assert_same_streams(want, got, seed, num_blocks)


def test_hscache_scheduler_end_to_end_with_the_installed_hasher(model_dir: Path) -> None:
    """EngineCore's sequence: install, build the hasher by the patched name, attach it to
    every request, schedule. hscache's Scheduler on hscache's hashes makes vLLM's
    decisions (same prefix-cache hits) on vLLM's hashes, step for step."""
    bh.install_block_hasher()
    try:
        ours = engine_core.get_request_block_hasher(16, hashing.sha256_cbor, 0)
    finally:
        bh.uninstall_block_hasher()
    assert ours.hscache_algo == "sha256_cbor"
    kcu.init_none_hash(hashing.sha256_cbor)
    ref = kcu.get_request_block_hasher(16, hashing.sha256_cbor)  # 2 arguments: any vLLM

    def run(cls: type, hasher: Any) -> tuple[list[Any], list[list[bytes]], int]:
        rng = random.Random(5)
        sched = _make_scheduler(
            cls, 96, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
            model_path=model_dir,
        )  # fmt: skip
        prefixes = [[rng.randrange(1000) for _ in range(n)] for n in (40, 64)]
        trace, requests, hits = [], [], 0
        for step in range(40):
            if rng.random() < 0.5:
                prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(20)]
                req = make_request(
                    f"r{len(requests)}",
                    prompt,
                    max_tokens=rng.randrange(1, 20),
                    cache_salt=rng.choice([None, None, "tenant"]),
                    block_hasher=hasher,
                )
                requests.append(req)
                sched.add_request(req)
            out = sched.schedule()
            trace.append(output_summary(out))
            hits += sum(r.num_computed_tokens > 0 for r in out.scheduled_new_reqs)
            sched.update_from_output(
                out,
                stub_runner_output(out, lambda i, step=step: (step * 7 + i) % 1000),
            )
        return trace, [list(r.block_hashes) for r in requests], hits

    ref_trace, ref_hashes, ref_hits = run(VllmScheduler, ref)
    our_trace, our_hashes, our_hits = run(hscache.vllm.Scheduler, ours)
    assert our_hashes == ref_hashes
    assert our_trace == ref_trace
    assert our_hits == ref_hits > 0
