"""The checked mode's hash check of hits handed back to ``allocate_slots``: a hit
found for another request, or one whose blocks were reassigned since the lookup, is
refused with ``InvalidArgumentError`` and the state digest unchanged; legit hits in
hybrid layouts (full + sliding window, full + Mamba ``align``) are accepted. The
default mode trusts hits as vLLM does (vLLM's own tests hand-craft them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache import exceptions
from hscache.vllm import KVCacheManager
from hscache_tools.testing.kv_cache import (
    full_attention,
    full_attention_config,
    kv_cache_config,
    mamba,
    sliding_window,
)
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import make_request

A = list(range(70))
B = list(range(500, 570))


def _manager(config: Any = None, *, check: bool = True, **kwargs: Any) -> KVCacheManager:
    m = KVCacheManager(**manager_kwargs(config or full_attention_config(32), **kwargs))
    m.check_invariants_after_ops = check
    return m


def _admit(m: KVCacheManager, rid: str, tokens: Sequence[int], **kw: Any) -> Any:
    req = make_request(rid, tokens, **kw)
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    return req


def _refused(m: KVCacheManager, req: Any, hit: Any, num_hit: int) -> None:
    before = m.state_digest()
    with pytest.raises(exceptions.InvalidArgumentError, match="not cached under request"):
        m.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
    assert m.state_digest() == before
    m.check_invariants()
    assert m.poisoned is None


def test_a_hit_of_another_request_is_refused() -> None:
    m = _manager()
    a = _admit(m, "a", A)
    m.free(a)
    hit, num_hit, _ = m.get_computed_blocks(make_request("a2", A))
    assert num_hit == 64
    # B's prompt differs from the first token: A's cached blocks are not B's.
    _refused(m, make_request("b", B), hit, num_hit)
    # The rightful owner still takes it.
    a2 = make_request("a2", A)
    assert m.allocate_slots(a2, a2.num_tokens - num_hit, num_hit, hit) is not None


def test_a_hit_diverging_after_the_first_block_is_refused() -> None:
    m = _manager()
    m.free(_admit(m, "a", A))
    hit, num_hit, _ = m.get_computed_blocks(make_request("a2", A))
    # Same first block, different second: the second hit block is not B's.
    _refused(m, make_request("b", A[:16] + B[16:]), hit, num_hit)


def test_a_hit_reassigned_since_the_lookup_is_refused() -> None:
    m = _manager(full_attention_config(9))
    m.free(_admit(m, "a", A))
    z = make_request("z", A)
    hit, num_hit, _ = m.get_computed_blocks(z)
    assert num_hit == 64
    # Another prompt takes (evicts) every free block and caches its own hashes there.
    _admit(m, "b", list(range(500, 628)))
    held = {b.block_id for b in m.get_blocks("b").blocks[0]}
    assert held & {b.block_id for b in hit.blocks[0]}
    _refused(m, z, hit, num_hit)


def test_a_hit_stale_after_reset_prefix_cache_is_refused() -> None:
    m = _manager(full_attention_config(9))
    m.free(_admit(m, "a", A))
    z = make_request("z", A)
    hit, num_hit, _ = m.get_computed_blocks(z)
    assert m.reset_prefix_cache()
    _admit(m, "b", list(range(500, 628)))
    _refused(m, z, hit, num_hit)


def test_the_default_mode_trusts_hits_as_vllm_does() -> None:
    m = _manager(check=False)
    m.free(_admit(m, "a", A))
    hit, num_hit, _ = m.get_computed_blocks(make_request("a2", A))
    b = make_request("b", B)
    assert m.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit) is not None


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param([full_attention(16), sliding_window(16, 32)], id="full+swa"),
        pytest.param([full_attention(16), mamba(16, mode="align")], id="full+mamba-align"),
    ],
)
def test_legit_hybrid_hits_are_accepted(layout: list[Any]) -> None:
    m = _manager(kv_cache_config(layout, 64))
    tokens = list(range(100))
    # Prefill in block-aligned chunks (Mamba "align" keeps a state at each chunk end).
    a = make_request("a", tokens)
    assert m.allocate_slots(a, 96) is not None
    a.num_computed_tokens = 96
    assert m.allocate_slots(a, 4) is not None
    m.free(a)
    z = make_request("z", tokens)
    hit, num_hit, _ = m.get_computed_blocks(z)
    assert num_hit == 96
    # No refusal (Mamba "align" then declines this 4-token step, as vLLM's manager does).
    m.allocate_slots(z, z.num_tokens - num_hit, num_hit, hit)
    m.check_invariants()
    m.free(z)
    # The same hit on another prompt is refused (each group's blocks carry A's hashes).
    hit, num_hit, _ = m.get_computed_blocks(make_request("z2", tokens))
    _refused(m, make_request("other", B + B[:30]), hit, num_hit)
