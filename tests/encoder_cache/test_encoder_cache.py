"""hscache's ``EncoderCacheManager`` and ``EncoderDecoderCacheManager`` against vLLM 0.33's.

* Differential traces: the same seeded random calls go to vLLM's Python manager and to
  hscache's; every return value (or the fact that both raise), the counters, and every
  one of vLLM's dicts (``cached``, ``num_embeds_by_hash``, ``freeable`` in LRU order,
  ``request_cached_ids`` in iteration order, ``request_hash_refs``, ``freed`` in order) are
  compared after every call. Requests carry up to 65 inputs (input ids 0..64), so the
  iteration order of vLLM's per-request Python ``set`` (which decides the free order, hence
  the eviction order) goes through collisions, dummies and resizes; the Scheduler's
  ``_free_encoder_inputs`` (iterate ``get_cached_input_ids``, free some) is one of the calls.
  ``get_freed_mm_hashes`` is one of the random calls (draining after every call would hide
  the "evicted, then cached again in the same pass" rule).
* vLLM's own ``tests/v1/core/test_encoder_cache_manager.py`` (from the sdist cached under
  ``$HOME/.cache/hscache``) run with hscache's classes in place of vLLM's.
* Error paths, ``create_manager``, ``compute_mm_encoder_budget`` and real ``Request`` objects.
"""

from __future__ import annotations

import importlib.util
import os
import random
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hscache.exceptions import InvalidArgumentError
from hscache.vllm.encoder_cache_manager import (
    EncoderCacheManager,
    EncoderDecoderCacheManager,
    compute_mm_encoder_budget,
)
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core import encoder_cache_manager as vllm_ecm
from vllm.v1.request import Request

pytestmark = pytest.mark.vllm

BIG = 10**9


class FakeRequest:
    """The fields a manager reads: ``request_id``, ``mm_features``, ``get_num_encoder_embeds``."""

    def __init__(self, request_id: str, identifiers: list[str], sizes: list[int]) -> None:
        self.request_id = request_id
        self.mm_features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=ident,
                mm_position=PlaceholderRange(offset=0, length=size),
            )
            for ident, size in zip(identifiers, sizes, strict=True)
        ]
        self.sizes = sizes

    def get_num_encoder_embeds(self, input_id: int) -> int:
        return self.sizes[input_id]


def snapshot(m: Any) -> dict[str, Any]:
    """Everything vLLM's manager exposes, in comparable form (``freeable`` and ``freed``
    keep their order)."""
    return {
        "cache_size": m.cache_size,
        "num_free_slots": m.num_free_slots,
        "num_freeable_slots": m.num_freeable_slots,
        "cached": {k: set(v) for k, v in m.cached.items()},
        "num_embeds_by_hash": dict(m.num_embeds_by_hash),
        "freeable": list(m.freeable.items()),
        # Lists: the iteration order is vLLM's free order.
        "request_cached_ids": {k: list(v) for k, v in m.request_cached_ids.items()},
        "request_hash_refs": {k: dict(v) for k, v in m.request_hash_refs.items()},
        "freed": list(m.freed),
    }


class Diverged(AssertionError):
    pass


class Pair:
    """vLLM's manager and hscache's, driven together."""

    def __init__(self, cache_size: int) -> None:
        self.ref = vllm_ecm.EncoderCacheManager(cache_size=cache_size)
        self.ours = EncoderCacheManager(cache_size=cache_size)
        self.calls = 0
        self.log: list[str] = []

    def call(self, name: str, *args: Any) -> tuple[bool, Any]:
        """Calls ``name`` on both; returns ``(ok, result)``; ``ok`` is False when both
        raised (the trace must stop: vLLM may have mutated half-way)."""
        self.calls += 1
        self.log.append(f"{name}{_show(args)}")
        try:
            expected = getattr(self.ref, name)(*args)
            ref_exc = None
        except (AssertionError, KeyError) as e:
            expected, ref_exc = None, e
        try:
            got = getattr(self.ours, name)(*args)
            our_exc = None
        except (ValueError, KeyError) as e:
            got, our_exc = None, e
        if (ref_exc is None) != (our_exc is None):
            raise Diverged(f"{self._where()}: vLLM raised {ref_exc!r}, hscache {our_exc!r}")
        if ref_exc is not None:
            if isinstance(ref_exc, KeyError) != isinstance(our_exc, KeyError):
                raise Diverged(f"{self._where()}: vLLM {ref_exc!r}, hscache {our_exc!r}")
            return False, None
        if isinstance(expected, set):
            # The Scheduler iterates it: the order matters, not just the members.
            expected, got = list(expected), list(got)
        if got != expected:
            raise Diverged(f"{self._where()}: vLLM returned {expected!r}, hscache {got!r}")
        self.check()
        return True, got

    def clear_cached(self) -> None:
        self.log.append("cached = {}")
        self.ref.cached = {}
        self.ours.cached = {}
        self.check()

    def check(self) -> None:
        a, b = snapshot(self.ref), snapshot(self.ours)
        if a != b:
            diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
            raise Diverged(f"{self._where()}: state differs (vLLM, hscache): {diff}")
        # The core's own replay of CPython's set table (which `free` iterates) agrees.
        for rid, ids in a["request_cached_ids"].items():
            if self.ours.core_input_id_order(rid) != ids:
                raise Diverged(f"{self._where()}: core set order of {rid} differs from {ids}")

    def free_processed(self, req: FakeRequest, rng: random.Random) -> bool:
        """The Scheduler's ``_free_encoder_inputs``: iterate ``get_cached_input_ids`` and
        free the inputs whose placeholders were computed (here: a random subset)."""
        ok, ids = self.call("get_cached_input_ids", req)
        if not ok:
            return False
        keep = rng.random()
        return all(
            self.call("free_encoder_input", req, i)[0] for i in list(ids) if rng.random() > keep
        )

    def _where(self) -> str:
        return f"call {self.calls}; last calls: {self.log[-8:]}"


def _show(args: tuple[Any, ...]) -> str:
    return (
        "(" + ", ".join(a.request_id if isinstance(a, FakeRequest) else repr(a) for a in args) + ")"
    )


def run_trace(seed: int) -> int:
    """One random trace; returns the number of calls compared."""
    rng = random.Random(seed)
    cache_size = rng.choice([0, 1, 6, 16, 32, 64, 100])
    items = [f"s{seed}-mm{k}" for k in range(rng.randint(1, 14))]
    top = max(1, cache_size)
    sizes = {}
    for it in items:
        roll = rng.random()
        if roll < 0.05:
            sizes[it] = 0  # an item whose placeholders hold no embedding
        elif roll < 0.10:
            sizes[it] = top + rng.randint(1, 5)  # larger than the cache: never fits
        else:
            sizes[it] = rng.randint(1, max(1, top // rng.choice([1, 2, 4])))
    poke_cached = seed % 10 == 0
    pair = Pair(cache_size)
    live: dict[str, FakeRequest] = {}
    next_req = 0

    def new_request() -> FakeRequest:
        nonlocal next_req
        next_req += 1
        # Input ids up to 64: past the 8-slot table, CPython's set order is no longer sorted.
        n = rng.choice([rng.randint(1, 6), rng.randint(1, 65)])
        idents = [rng.choice(items) for _ in range(n)]
        if n > 1 and rng.random() < 0.3:
            idents[-1] = idents[0]  # the same item twice in one request
        req = FakeRequest(f"req{next_req}", idents, [sizes[i] for i in idents])
        live[req.request_id] = req
        return req

    def pick() -> tuple[FakeRequest, int]:
        if not live or (len(live) < 8 and rng.random() < 0.15):
            req = new_request()
        else:
            req = live[rng.choice(sorted(live))]
        return req, rng.randrange(len(req.mm_features))

    def budget() -> int:
        return rng.choice([BIG, BIG, top, max(0, top // 2), rng.randint(0, top)])

    def schedule(req: FakeRequest) -> bool:
        """What the Scheduler's ``_try_schedule_encoder_inputs`` asks for one request."""
        n_inputs = len(req.mm_features)
        lo = rng.randrange(n_inputs)
        hi = rng.randint(lo + 1, min(n_inputs, lo + 24))
        compute, to_schedule = budget(), 0
        scheduled: dict[str, int] = {}
        to_alloc, dups = [], []
        for i in range(lo, hi):
            ident = req.mm_features[i].identifier
            if ident in scheduled:
                dups.append(i)
                continue
            ok, _ = pair.call("get_cached_num_encoder_embeds", req, i)
            ok, hit = pair.call("check_and_update_cache", req, i) if ok else (False, None)
            if not ok:
                return False
            if hit:
                continue
            ok, fits = pair.call("can_allocate", req, i, compute, to_schedule)
            if not ok:
                return False
            if not fits:
                break
            n = req.sizes[i]
            to_schedule += n
            compute -= n
            scheduled[ident] = n
            to_alloc.append(i)
        for i in to_alloc:
            if not pair.call("allocate", req, i)[0]:
                return False
        return all(pair.call("check_and_update_cache", req, i)[0] for i in dups)

    ops = ["step"] * 6 + ["check", "can_allocate", "allocate"] + ["free_input"] * 3
    ops += ["free", "free", "drain", "drain", "query", "free_processed", "free_processed"]
    for _ in range(rng.randint(40, 160)):
        op = rng.choice(ops)
        if rng.random() < 0.01:
            op = "reset"
        if poke_cached and rng.random() < 0.02:
            op = "clear_cached"
        req, i = pick()
        if op == "step":
            ok = all(schedule(live[r]) for r in rng.sample(sorted(live), min(3, len(live))))
            ok = ok and pair.call("get_freed_mm_hashes")[0]
        elif op == "check":
            ok = pair.call("check_and_update_cache", req, i)[0]
        elif op == "can_allocate":
            ok = pair.call("can_allocate", req, i, budget(), rng.choice([0, 0, 1, top // 2]))[0]
        elif op == "allocate":
            # Without can_allocate (as vLLM's tests do), only where vLLM would not assert.
            ident, n, ref = req.mm_features[i].identifier, req.sizes[i], pair.ref
            if (
                ref.num_embeds_by_hash.get(ident, n) == n
                and min(ref.num_free_slots, ref.num_freeable_slots) >= n
            ):
                ok = pair.call("allocate", req, i)[0]
            else:
                ok = True
        elif op == "free_input":
            ok = pair.call("free_encoder_input", req, i)[0]
        elif op == "free":
            ok = pair.call("free", req)[0]
            if rng.random() < 0.7:
                live.pop(req.request_id)  # finished
        elif op == "drain":
            ok = pair.call("get_freed_mm_hashes")[0]
        elif op == "query":
            ok = pair.call("get_cached_input_ids", req)[0]
        elif op == "free_processed":
            ok = pair.free_processed(req, rng)
        elif op == "reset":
            ok = pair.call("reset")[0]
        else:
            pair.clear_cached()
            ok = True
        if not ok:
            break  # both raised where vLLM itself fails (only after ``cached = {}``)
    return pair.calls


SEED_BLOCKS = 12
SEEDS_PER_BLOCK = 25
DIFFERENTIAL_CALLS: dict[int, int] = {}


@pytest.mark.parametrize("block", range(SEED_BLOCKS))
def test_differential_random_traces(block: int) -> None:
    calls = 0
    for seed in range(block * SEEDS_PER_BLOCK, (block + 1) * SEEDS_PER_BLOCK):
        calls += run_trace(seed)
    DIFFERENTIAL_CALLS[block] = calls
    assert calls > 20 * SEEDS_PER_BLOCK


@pytest.mark.parametrize("seed", range(20))
def test_free_order_of_many_inputs(seed: int) -> None:
    """Up to 65 inputs cached in a random order, some freed one by one (dummies), then the
    rest freed at once: exactly vLLM's ``freeable`` order, for every input id."""
    rng = random.Random(seed)
    n = rng.randint(9, 65)
    ids = [f"img{i}" for i in range(n)]
    pair = Pair(cache_size=10_000)
    req = FakeRequest("r", ids, [1 + i % 4 for i in range(n)])
    order = rng.sample(range(n), rng.randint(1, n))
    for i in order:
        pair.call("allocate", req, i)
    for i in rng.sample(order, len(order) // 3):
        pair.call("free_encoder_input", req, i)
    for i in rng.sample(range(n), rng.randint(0, n // 2)):
        pair.call("check_and_update_cache", req, i)
    pair.call("get_cached_input_ids", req)
    pair.call("free", req)
    assert len(pair.ours.freeable) > 0


def test_set_order_differs_from_sorted_and_still_matches() -> None:
    """A case where vLLM's order is not ascending: {9, 1, 17} iterates as inserted."""
    pair = Pair(cache_size=100)
    req = FakeRequest("r", [f"i{k}" for k in range(18)], [1] * 18)
    for i in (9, 1, 17):
        pair.call("allocate", req, i)
    assert list(pair.ours.get_cached_input_ids(req)) == [9, 1, 17]
    pair.call("free", req)
    assert list(pair.ours.freeable) == ["i9", "i1", "i17"]


# ---- vLLM's own test file, with hscache's class swapped in -----------------------------

UPSTREAM = (
    Path(os.environ.get("HSCACHE_CACHE", Path.home() / ".cache" / "hscache"))
    / "vllm-0.33.0-src/tests/v1/core/test_encoder_cache_manager.py"
)


def _load_upstream() -> Any:
    if not UPSTREAM.exists():
        return None
    spec = importlib.util.spec_from_file_location("_vllm_upstream_test_ecm", UPSTREAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    originals = vllm_ecm.EncoderCacheManager, vllm_ecm.EncoderDecoderCacheManager
    vllm_ecm.EncoderCacheManager = EncoderCacheManager  # type: ignore[misc]
    vllm_ecm.EncoderDecoderCacheManager = EncoderDecoderCacheManager  # type: ignore[misc]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its unregistered `cpu_test` mark
            spec.loader.exec_module(module)
    finally:
        vllm_ecm.EncoderCacheManager, vllm_ecm.EncoderDecoderCacheManager = originals  # type: ignore[misc]
    return module


_UPSTREAM = _load_upstream()
_UPSTREAM_TESTS = sorted(n for n in dir(_UPSTREAM) if n.startswith("test_")) if _UPSTREAM else []


@pytest.mark.skipif(_UPSTREAM is None, reason=f"vLLM sdist tests not cached at {UPSTREAM}")
@pytest.mark.parametrize("name", _UPSTREAM_TESTS or ["(none)"])
def test_vllm_upstream_encoder_cache_manager(name: str) -> None:
    assert _UPSTREAM.EncoderCacheManager is EncoderCacheManager
    assert _UPSTREAM.EncoderDecoderCacheManager is EncoderDecoderCacheManager
    getattr(_UPSTREAM, name)()


# ---- targeted cases -------------------------------------------------------------------


def test_allocate_misuse_raises_before_mutating() -> None:
    m = EncoderCacheManager(cache_size=10)
    a4 = FakeRequest("r1", ["a"], [4])
    a5 = FakeRequest("r2", ["a"], [5])
    big = FakeRequest("r3", ["b"], [7])
    m.allocate(a4, 0)
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match="holds 4 embeddings"):
        m.allocate(a5, 0)
    with pytest.raises(ValueError, match="cannot hold 7"):
        m.allocate(big, 0)
    with pytest.raises(InvalidArgumentError):
        m.check_and_update_cache(a4, -1)
    assert snapshot(m) == before
    # vLLM asserts in both cases, after creating the entry.
    ref = vllm_ecm.EncoderCacheManager(cache_size=10)
    ref.allocate(a4, 0)
    for req in (a5, big):
        with pytest.raises(AssertionError):
            ref.allocate(req, 0)


def test_eviction_of_an_entry_missing_from_cached_is_a_key_error() -> None:
    """After ``cached = {}`` (vLLM's scheduler tests do it) both managers fail the same way."""
    pair = Pair(cache_size=8)
    a, b = FakeRequest("ra", ["a"], [6]), FakeRequest("rb", ["b"], [6])
    pair.call("allocate", a, 0)
    pair.call("free", a)
    pair.clear_cached()
    assert pair.call("check_and_update_cache", a, 0) == (True, False)
    assert pair.call("can_allocate", b, 0, BIG, 0) == (False, None)
    with pytest.raises(TypeError):
        pair.ours.cached = {"a": set()}


def test_methods_can_be_shadowed_per_instance() -> None:
    """vLLM's scheduler tests replace ``can_allocate`` on the instance, then ``del`` it."""
    m = EncoderCacheManager(cache_size=10)
    req = FakeRequest("r", ["a"], [4])
    m.can_allocate = lambda *a, **k: False  # type: ignore[method-assign]
    assert not m.can_allocate(req, 0, BIG, 0)
    del m.can_allocate
    assert m.can_allocate(req, 0, BIG, 0)


def test_counters_are_assignable_like_vllm_attributes() -> None:
    """vLLM's scheduler tests assign ``cache_size`` / ``num_free_slots`` to force evictions."""
    pair = Pair(cache_size=100)
    a, b = FakeRequest("ra", ["a"], [40]), FakeRequest("rb", ["b"], [60])
    pair.call("allocate", a, 0)
    pair.call("free", a)
    for m in (pair.ref, pair.ours):
        m.num_free_slots = 50
    pair.check()
    assert pair.call("can_allocate", b, 0, BIG, 0) == (True, True)
    assert pair.call("get_freed_mm_hashes") == (True, ["a"])
    with pytest.raises(InvalidArgumentError):
        pair.ours.cache_size = -1


def test_create_manager() -> None:
    decoder_only = SimpleNamespace(model_config=SimpleNamespace(is_encoder_decoder=False))
    m = EncoderCacheManager.create_manager(cache_size=12, vllm_config=decoder_only)  # type: ignore[arg-type]
    assert type(m) is EncoderCacheManager and m.cache_size == 12
    assert m.get_manager_metadata() is None
    enc_dec = SimpleNamespace(model_config=SimpleNamespace(is_encoder_decoder=True))
    m2 = EncoderCacheManager.create_manager(cache_size=12, vllm_config=enc_dec)  # type: ignore[arg-type]
    assert type(m2) is EncoderDecoderCacheManager and m2.cache_size == 12
    # The plug-in point vLLM's Scheduler uses (``--ec-manager-config``).
    from vllm.config.ec_manager_config import EncoderCacheManagerConfig

    cfg = EncoderCacheManagerConfig(
        encoder_cache_manager_cls="hscache.vllm.encoder_cache_manager.EncoderCacheManager"
    )
    assert cfg.get_encoder_cache_manager_obj() is EncoderCacheManager


@pytest.mark.parametrize("seed", range(40))
def test_compute_mm_encoder_budget_matches_vllm(seed: int) -> None:
    rng = random.Random(seed)
    cfg = SimpleNamespace(
        max_num_encoder_input_tokens=rng.choice([0, 512, 8192]),
        encoder_cache_size=rng.choice([0, 512, 8192]),
        max_num_batched_tokens=rng.choice([256, 2048, 8192]),
        disable_chunked_mm_input=rng.random() < 0.5,
    )
    per_item = {m: rng.randint(1, 10000) for m in rng.sample(["image", "audio", "video"], seed % 4)}
    try:
        expected = vllm_ecm.compute_mm_encoder_budget(cfg, per_item)  # type: ignore[arg-type]
    except ValueError:
        with pytest.raises(ValueError, match="Chunked MM input disabled"):
            compute_mm_encoder_budget(cfg, per_item)  # type: ignore[arg-type]
        return
    assert compute_mm_encoder_budget(cfg, per_item) == expected  # type: ignore[arg-type]


def test_real_requests_with_embedding_masks() -> None:
    """vLLM ``Request`` objects; ``is_embed`` masks make embeddings fewer than tokens."""

    def request(rid: str, items: list[tuple[str, list[bool]]]) -> Request:
        feats = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=ident,
                mm_position=PlaceholderRange(
                    offset=4 * k, length=len(mask), is_embed=torch.tensor(mask)
                ),
            )
            for k, (ident, mask) in enumerate(items)
        ]
        return Request(rid, list(range(64)), SamplingParams(max_tokens=4), None, mm_features=feats)

    mask_a = [False, True, True, False, True]  # 3 embeddings
    mask_b = [True] * 6
    r1 = request("r1", [("a", mask_a), ("b", mask_b), ("a", mask_a)])
    r2 = request("r2", [("b", mask_b)])
    pair = Pair(cache_size=9)
    for i in range(3):
        if not pair.call("check_and_update_cache", r1, i)[1]:
            assert pair.call("can_allocate", r1, i, BIG, 0)[1]
            pair.call("allocate", r1, i)
    assert pair.ours.num_free_slots == 0
    assert pair.call("check_and_update_cache", r2, 0) == (True, True)
    pair.call("free", r1)
    assert pair.ours.freeable == {"a": 3}
    pair.call("free", r2)
    assert pair.call("can_allocate", r2, 0, BIG, 0) == (True, True)  # evicts both
    assert pair.call("get_freed_mm_hashes") == (True, ["a", "b"])


# ---- EncoderDecoderCacheManager ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_encoder_decoder_differential(seed: int) -> None:
    """vLLM's ``EncoderDecoderCacheManager`` and hscache's on the same random calls: every
    return value, ``num_free_slots``, ``allocated`` and ``to_free`` after each."""
    rng = random.Random(seed)
    size = rng.choice([0, 8, 64, 500])
    ref = vllm_ecm.EncoderDecoderCacheManager(cache_size=size)
    ours = EncoderDecoderCacheManager(cache_size=size)
    reqs = [
        FakeRequest(f"r{k}", [f"a{k}-{i}" for i in range(n)], [rng.randint(0, 40)] * n)
        for k, n in enumerate(rng.choices(range(1, 6), k=8))
    ]
    for _ in range(200):
        req = rng.choice(reqs)
        i = rng.randrange(len(req.mm_features))
        name, args = rng.choice(
            [
                ("can_allocate", (req, i, rng.choice([BIG, 10, 0]), rng.randint(0, 20))),
                ("allocate", (req, i)),
                ("allocate", (req, i)),
                ("free_encoder_input", (req, i)),
                ("free", (req,)),
                ("get_freed_mm_hashes", ()),
                ("get_cached_input_ids", (req,)),
                ("check_and_update_cache", (req, i)),
                ("reset", ()) if rng.random() < 0.05 else ("get_freed_mm_hashes", ()),
            ]
        )
        want = getattr(ref, name)(*args)
        got = getattr(ours, name)(*args)
        assert got == want, (name, got, want)
        state = [(m.num_free_slots, list(m.allocated), list(m.to_free)) for m in (ref, ours)]
        assert state[0] == state[1], name
    assert ours.get_manager_metadata() is None
    assert EncoderDecoderCacheManager.create_manager(cache_size=3, vllm_config=None).cache_size == 3
