"""Internal panics seen from Python: with a ``fault-injection`` build of the extension
(``hscache._core._arm_fault``), a panic injected inside the KV-cache manager, the encoder
cache, the block hasher and the hidden-state slot mirror surfaces as
``hscache.exceptions.InternalError`` (a ``RuntimeError``), the process lives on, the
object that panicked refuses every later call saying it is poisoned (the hasher holds no
state: its next call simply works), and other objects keep working.

Skipped with the ordinary build; ``scripts/test.sh`` (step ``panic-safety``) builds the
feature into a separate directory and runs this file against it
(``scripts/panic_python.sh``)."""

from __future__ import annotations

from typing import Any

import pytest
from hscache import _core, exceptions
from hscache_tools.testing.kv_cache import full_attention_config
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import make_request, mm_feature

pytestmark = pytest.mark.skipif(
    not hasattr(_core, "_arm_fault"),
    reason="needs a fault-injection build of hscache._core (scripts/panic_python.sh)",
)


def _arm(site: str) -> None:
    _core._arm_fault(site)  # type: ignore[attr-defined]  # feature builds only


def _manager() -> Any:
    from hscache.vllm import KVCacheManager

    return KVCacheManager(**manager_kwargs(full_attention_config(32)))


def test_the_manager_is_poisoned_and_others_work() -> None:
    m, other = _manager(), _manager()
    req = make_request("a", list(range(40)))
    _arm("allocate_slots.adopted")
    with pytest.raises(exceptions.InternalError, match="internal panic in allocate_slots"):
        m.allocate_slots(req, 40)
    assert issubclass(exceptions.InternalError, RuntimeError)
    assert m.poisoned is not None
    for call in (
        lambda: m.allocate_slots(make_request("b", list(range(8))), 8),
        lambda: m.free(req),
        lambda: m.get_blocks("a"),
        lambda: m.usage,
        lambda: m.block_pool.get_num_free_blocks(),
        lambda: m.block_pool.get_new_blocks(1),
    ):
        with pytest.raises(exceptions.InternalError, match="poisoned"):
            call()
    ok = make_request("a", list(range(40)))
    assert other.allocate_slots(ok, 40) is not None
    other.free(ok)
    other.check_invariants()


def _mm_request(rid: str) -> Any:
    return make_request(rid, list(range(32)), mm_features=[mm_feature(f"img-{rid}", 0, 8)])


def test_the_encoder_cache_is_poisoned_and_others_work() -> None:
    from hscache.vllm import EncoderCacheManager

    cache, other = EncoderCacheManager(cache_size=64), EncoderCacheManager(cache_size=64)
    req = _mm_request("a")
    _arm("encoder_cache.allocate")
    with pytest.raises(exceptions.InternalError, match="internal panic in allocate"):
        cache.allocate(req, 0)
    for call in (
        lambda: cache.allocate(req, 0),
        lambda: cache.check_and_update_cache(req, 0),
        lambda: cache.free(req),
        lambda: cache.num_free_slots,
    ):
        with pytest.raises(exceptions.InternalError, match="encoder cache is poisoned"):
            call()
    assert other.can_allocate(req, 0, 64, 0)
    other.allocate(req, 0)
    assert other.check_and_update_cache(req, 0)
    assert other.num_free_slots == 56


def test_the_hasher_raises_and_keeps_working() -> None:
    hasher = _core.RequestBlockHasher("sha256", 16)
    none_hash = b"\x00" * 32
    _arm("hasher.hash_new_blocks")
    with pytest.raises(exceptions.InternalError, match="internal panic in hash_new_blocks"):
        hasher.hash_new_blocks([], list(range(32)), none_hash)
    # No state to poison: the next call hashes as before, equal to a fresh hasher's.
    again = hasher.hash_new_blocks([], list(range(32)), none_hash)
    fresh = _core.RequestBlockHasher("sha256", 16).hash_new_blocks([], list(range(32)), none_hash)
    assert again == fresh
    assert len(again) == 2


def test_the_slot_mirror_is_poisoned_and_others_work() -> None:
    mirror = _core.SlotMirror(num_blocks=16, block_size=4)
    other = _core.SlotMirror(num_blocks=16, block_size=4)
    _arm("slot_mirror.plan")
    with pytest.raises(exceptions.InternalError, match="internal panic in plan"):
        mirror.plan(new=[("r", [1, 2], 0, 8)])
    for call in (
        lambda: mirror.plan(new=[("r", [1, 2], 0, 8)]),
        lambda: mirror.step_id,
        lambda: mirror.block_state(1),
    ):
        with pytest.raises(exceptions.InternalError, match="slot mirror is poisoned"):
            call()
    assert mirror.poisoned is not None
    plan = other.plan(new=[("r", [1, 2], 0, 8)])
    other.commit(plan[1], plan[0])
    assert other.block_state(1) == (other.block_state(1)[0], 4)
