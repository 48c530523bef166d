"""``check_invariants()`` from Python: every invariant mutant is caught as
``InvariantError``, ``HSCACHE_CHECK_INVARIANTS`` turns the after-every-call check on
(it poisons the manager), the ``BlockPool`` view's references keep ref count == owners
exact, and ``state_digest()`` moves with the state and only with it."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache import exceptions
from hscache._core import KVCacheCore
from hscache.vllm import KVCacheManager
from hscache_tools.testing.kv_cache import full_attention_config
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import make_request


def _admit(m: KVCacheManager, rid: str, tokens: list[int]) -> None:
    req = make_request(rid, tokens)
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None


def _busy(check: bool = False) -> KVCacheManager:
    """Two requests sharing a cached prefix and one freed (cached free blocks)."""
    m = KVCacheManager(**manager_kwargs(full_attention_config(32)))
    m.check_invariants_after_ops = check
    _admit(m, "a", list(range(70)))
    _admit(m, "b", list(range(64)) + [999] * 6)
    _admit(m, "c", list(range(1000, 1040)))
    m.free(make_request("c", list(range(1000, 1040))))
    m.check_invariants()
    return m


# The invariant mutants exist only in the test-hooks extension (the `hooks` marker).
MUTANTS = getattr(KVCacheCore, "_invariant_mutants", list)()


@pytest.mark.hooks
def test_the_mutants_are_listed() -> None:
    assert len(MUTANTS) == 7, MUTANTS


@pytest.mark.hooks
@pytest.mark.parametrize("mutant", MUTANTS)
def test_every_mutant_is_caught(mutant: str) -> None:
    m = _busy()
    m._break_invariant(mutant)
    with pytest.raises(exceptions.InvariantError):
        m.check_invariants()


def test_invariant_error_is_internal_and_assertion() -> None:
    assert issubclass(exceptions.InvariantError, exceptions.InternalError)
    assert issubclass(exceptions.InvariantError, RuntimeError)
    assert issubclass(exceptions.InvariantError, AssertionError)


@pytest.mark.hooks
def test_check_after_each_call_poisons() -> None:
    m = _busy(check=True)
    m._break_invariant("missing_decrement")
    with pytest.raises(exceptions.InvariantError, match="after free"):
        m.free(make_request("a", list(range(70))))
    with pytest.raises(exceptions.InternalError, match="poisoned"):
        m.free(make_request("b", list(range(70))))


def test_block_pool_view_references_are_owners() -> None:
    m = _busy(check=True)
    pool = m.block_pool
    blocks = pool.get_new_blocks(2)
    pool.touch(blocks[:1])
    m.check_invariants()
    pool.free_blocks(blocks + blocks[:1])
    m.check_invariants()
    held = m.get_blocks("a").blocks[0][-1]
    digest = m.state_digest()
    # a table's reference freed behind its back: refused before it is dropped (checked
    # mode; vLLM takes it), and the manager keeps serving
    with pytest.raises(exceptions.InvalidArgumentError, match="block table of request"):
        pool.free_blocks([held])
    assert m.state_digest() == digest and m.poisoned is None
    m.check_invariants()
    # freed as often as referenced, the table's reference among them: the same refusal
    pool.touch([held])
    with pytest.raises(exceptions.InvalidArgumentError, match="block table of request"):
        pool.free_blocks([held, held])
    pool.free_blocks([held])  # the touch's own reference
    m.check_invariants()


def test_state_digest() -> None:
    m = _busy()
    d0 = m.state_digest()
    assert d0 == _busy().state_digest()
    with pytest.raises(exceptions.BlockIdError):
        m.block_pool.evict_blocks({-1})
    assert m.state_digest() == d0
    m.free(make_request("b", list(range(70))))
    assert m.state_digest() != d0


def test_env_variable_turns_the_check_on() -> None:
    code = (
        "from hscache_tools.testing.kv_cache import full_attention_config\n"
        "from hscache_tools.testing.manager import manager_kwargs\n"
        "from hscache.vllm import KVCacheManager\n"
        "print(KVCacheManager(**manager_kwargs(full_attention_config(8)))"
        ".check_invariants_after_ops)\n"
    )
    for value, expected in (("1", "True"), ("0", "False")):
        env = dict(os.environ, HSCACHE_CHECK_INVARIANTS=value)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected


def _stale_cases(m: KVCacheManager) -> dict[str, Any]:
    pool = m.block_pool
    a_blocks = list(m.get_blocks("a").blocks[0])
    return {
        "null block": (54, 16, m.create_kv_cache_blocks(([pool.null_block],))),
        "one block three times": (22, 48, m.create_kv_cache_blocks(([a_blocks[0]] * 3,))),
        "over-claimed tokens": (6, 64, m.create_kv_cache_blocks((a_blocks[:2],))),
    }


@pytest.mark.parametrize("case", ["null block", "one block three times", "over-claimed tokens"])
def test_checked_mode_rejects_malformed_hits(case: str) -> None:
    m = _busy(check=True)
    new, computed, hit = _stale_cases(m)[case]
    before = m.state_digest()
    with pytest.raises(exceptions.InvalidArgumentError):
        m.allocate_slots(make_request("z", list(range(70))), new, computed, hit)
    assert m.state_digest() == before
    m.check_invariants()


def test_checked_mode_rejects_a_hit_evicted_since_the_lookup() -> None:
    m = _busy(check=True)
    req = make_request("z", list(range(1000, 1040)))
    hit, num_hit, _ = m.get_computed_blocks(req)
    assert num_hit == 32
    m.evict_blocks({b.block_id for b in hit.blocks[0]})
    before = m.state_digest()
    with pytest.raises(exceptions.InvalidArgumentError, match="no longer cached"):
        m.allocate_slots(req, 40 - num_hit, num_hit, hit)
    assert m.state_digest() == before


def test_inputs_vllm_accepts() -> None:
    """``block_hashes`` as a tuple, ``copy.copy()`` of ``KVCacheBlocks``, a truthy
    non-bool ``enable_caching``; a second ``__init__`` is a typed error."""
    import copy

    m = KVCacheManager(**{**manager_kwargs(full_attention_config(32)), "enable_caching": 1})
    req = make_request("a", list(range(70)))
    req.block_hashes = tuple(req.block_hashes)  # type: ignore[assignment]
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, 70 - hit, hit, blocks) is not None
    mine = m.get_blocks("a")
    assert copy.copy(mine).get_block_ids() == mine.get_block_ids()
    with pytest.raises(exceptions.UnsupportedError):
        m.__init__(**manager_kwargs(full_attention_config(16)))  # type: ignore[misc]


def _events_manager() -> KVCacheManager:
    kwargs = {**manager_kwargs(full_attention_config(32)), "enable_kv_cache_events": True}
    return KVCacheManager(**kwargs)


def test_events_on_a_request_events_cannot_describe_raises_before_allocating() -> None:
    """A LoRA request without ``adapter_id`` or malformed multimodal features: the
    ``BlockStored`` event would fail after the blocks were cached; now the call
    raises first and nothing changes (a retry after fixing the request works)."""
    from types import SimpleNamespace

    from hscache_tools.testing.requests import lora

    m = _events_manager()
    req = make_request("a", list(range(40)), lora_request=lora("x", 1, "/p"))
    good = req.lora_request
    req.lora_request = SimpleNamespace(lora_name="x", lora_path="/p", lora_int_id=1, name="x")  # type: ignore[assignment]
    before = m.state_digest()
    with pytest.raises(exceptions.InvalidArgumentError, match="nothing was allocated"):
        m.allocate_slots(req, 40)
    assert m.state_digest() == before
    assert m.take_events() == []
    req.lora_request = good
    assert m.allocate_slots(req, 40) is not None
    assert m.take_events()


def _break_identifier(req: Any) -> None:
    req.mm_features[0].identifier = None


def _break_position(req: Any) -> None:
    req.mm_features[0].mm_position = None


def _break_feature_list(req: Any) -> None:
    req.mm_features = 5


@pytest.mark.parametrize(
    "break_request",
    [_break_identifier, _break_position, _break_feature_list],
    ids=["identifier None", "position None", "features not a list"],
)
def test_events_on_malformed_mm_features_raise_before_allocating(break_request: Any) -> None:
    """Multimodal features broken after hashing: the check before allocating (which
    reads the request without building the prompt-wide event) rejects what building
    the event rejects, with the manager unchanged."""
    from hscache._core import UnsupportedError, block_stored_fields
    from hscache_tools.testing.requests import mm_feature

    m = _events_manager()
    req = make_request("a", list(range(64)), mm_features=[mm_feature("img", 8, 16)])
    break_request(req)
    # The Rust builder cannot describe it, so the event would be vLLM's helper's...
    with pytest.raises(UnsupportedError):
        block_stored_fields(req, 0, len(req.block_hashes), 16, 0, False)
    before = m.state_digest()
    # ... which fails on it: raised, typed, before anything is allocated.
    with pytest.raises(exceptions.InvalidArgumentError, match="nothing was allocated"):
        m.allocate_slots(req, 64)
    assert m.state_digest() == before
    assert m.take_events() == []
