"""KV events a router can trust: replaying the manager's event stream
(``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, with group ids) into an
independent index reproduces the manager's cached set, key for key and block count
for block count, after every step of a random multi-tenant trace under memory
pressure, for full attention and a hybrid (full + sliding window) layout, under the
default LRU and a non-LRU retention policy, for vLLM's exact stream and for the compact
one (``kv_events_mode="compact"``: consecutive events of a batch coalesced)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hscache.vllm import KVCacheManager
from hscache_tools.testing.kv_cache import (
    full_attention,
    full_attention_config,
    kv_cache_config,
    sliding_window,
)
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import make_request
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

Key = tuple[Any, int]

_LAYOUTS = {
    "full": lambda: full_attention_config(40),
    "full+swa": lambda: kv_cache_config([full_attention(16), sliding_window(16, 32)], 48),
}


class ReplayIndex:
    """What a router keeps: (hash, group) -> number of blocks cached under it."""

    def __init__(self) -> None:
        self.blocks: Counter[Key] = Counter()

    def apply(self, event: Any) -> None:
        if isinstance(event, BlockStored):
            assert event.group_idx is not None
            for h in event.block_hashes:
                self.blocks[(h, event.group_idx)] += 1
        elif isinstance(event, BlockRemoved):
            assert event.group_idx is not None
            for h in event.block_hashes:
                key = (h, event.group_idx)
                assert self.blocks[key] > 0, f"removal of {key} that was never stored"
                self.blocks[key] -= 1
                if not self.blocks[key]:
                    del self.blocks[key]
        elif isinstance(event, AllBlocksCleared):
            self.blocks.clear()
        else:
            raise AssertionError(f"unexpected event {event!r}")


def _cached(m: Any) -> Counter[Key]:
    out: Counter[Key] = Counter()
    for key, ids in m.block_pool.pool_core.index_items():
        out[(maybe_convert_block_hash(get_block_hash(key)), get_group_id(key))] += len(ids)
    return out


@pytest.mark.parametrize("mode", ["vllm", "compact"])
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("policy", ["lru", "slru"])
def test_replayed_events_equal_the_cached_set_after_every_step(
    layout: str, policy: str, mode: str
) -> None:
    kwargs = manager_kwargs(_LAYOUTS[layout](), enable_kv_cache_events=True)
    m = KVCacheManager(**kwargs, retention=policy, kv_events_mode=mode)
    assert m.kv_events_mode == mode
    rng = random.Random(17)
    prefixes = [[p * 10_000 + i for i in range(rng.choice((16, 32, 48)))] for p in range(4)]
    index = ReplayIndex()
    running: list[Any] = []
    removed = merged = 0
    for step in range(160):
        if running and (rng.random() < 0.45 or len(running) > 3):
            m.free(running.pop(rng.randrange(len(running))))
        elif step % 53 == 52 and not running:
            assert m.reset_prefix_cache()
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(10**6) for _ in range(rng.randrange(40))]
            req = make_request(f"s{step}", prompt)
            blocks, hit, _ = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None:
                running.append(req)
        for event in m.take_events():
            removed += isinstance(event, BlockRemoved)
            merged += isinstance(event, BlockRemoved) and len(event.block_hashes) > 1
            index.apply(event)
        assert index.blocks == _cached(m), f"step {step}"
    assert removed > 0, "the trace never evicted: no pressure"
    # vLLM's stream names one key per removal; the compact one merged some.
    assert (merged > 0) == (mode == "compact")
