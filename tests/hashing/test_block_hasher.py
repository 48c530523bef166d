"""hscache's block hashing against vLLM 0.33's own functions: equal bytes for every block.

Serializers against ``pickle.dumps(protocol=5)`` / ``cbor2.dumps(canonical=True)``
(including pickle's identity memo and frames), hash functions against
``vllm.utils.hashing``, ``hash_block_tokens`` and the request hasher against
``vllm.v1.core.kv_cache_utils`` on thousands of random requests (multimodal items,
LoRA, salts, prompt embeddings, lookahead, incremental appends), bad input, fallbacks
and the EngineCore installation. (hscache's Scheduler on the installed hasher, end to end:
``test_scheduler_hook.py``.)
"""

from __future__ import annotations

import inspect
import pickle
import random
import sys
from typing import Any

import cbor2
import pytest
import torch
import vllm.v1.core.kv_cache_utils as kcu
import vllm.v1.engine.core as engine_core
from hscache import _core
from hscache.exceptions import BlockHashError, InvalidArgumentError, UnsupportedError
from hscache.vllm import block_hasher as bh
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils import hashing
from vllm.v1.request import Request

pytestmark = pytest.mark.vllm

VLLM_ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
ALL_ALGOS = [*VLLM_ALGOS, "blake3"]


def hash_fn(algo: str) -> Any:
    return bh.blake3 if algo == "blake3" else hashing.get_hash_fn_by_name(algo)


# ---------------------------------------------------------------- serializers


def fresh(s: str) -> str:
    """An equal but distinct (non-interned) str object."""
    return "".join(list(s)) if len(s) > 1 else s


INT_EDGES = [
    0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
    2**64 - 1, 2**64, 2**64 + 1, 2**100, 2**127 - 1, -1, -2, -128, -129, -255, -256,
    -(2**31), -(2**31) - 1, -(2**63), -(2**64), -(2**64) - 1, -(2**100), -(2**127),
]  # fmt: skip


def random_value(rng: random.Random, depth: int, shared: list[Any]) -> Any:
    kind = rng.randrange(9 if depth < 4 else 7)
    if kind == 0:
        return None
    if kind == 1:
        edge = rng.choice(INT_EDGES)
        v = edge + rng.choice([0, 0, 1, -1])
        return v if -(2**127) <= v < 2**127 else edge
    if kind == 2:
        return rng.randrange(-(2**40), 2**40)
    if kind == 3:
        s = rng.choice(["", "a", "mm", "lora", "héllo", "€𝄞", "x" * 300, "id-" + str(rng.random())])
        return fresh(s) if rng.random() < 0.5 else s
    if kind == 4:
        return rng.randbytes(rng.choice([0, 1, 16, 32, 255, 256, 1000]))
    if kind == 5:
        if shared and rng.random() < 0.7:
            return rng.choice(shared)  # the same object again: a memo reference
        v = rng.choice([fresh("shared-str"), bytes(rng.randbytes(8)), (1, fresh("t"))])
        shared.append(v)
        return v
    if kind == 6:
        return sys.intern(rng.choice(["mm", "lora", "cache_salt", "prompt_embeds"]))
    n = rng.choice([0, 1, 2, 3, 4, 5, 9])
    return tuple(random_value(rng, depth + 1, shared) for _ in range(n))


def test_serializers_match_pickle_and_cbor2_on_random_values() -> None:
    rng = random.Random(1)
    for _ in range(3000):
        v = random_value(rng, 0, [])
        assert _core.serialize("pickle", v) == pickle.dumps(v, protocol=5), v
        assert _core.serialize("cbor", v) == cbor2.dumps(v, canonical=True), v


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(("mm", "mm", fresh("mm"), sys.intern("mm")), id="interned-vs-fresh"),
        pytest.param(tuple(fresh(f"s{i}") for i in range(300)) * 2, id="long-binget"),
        pytest.param((b"p" * 32, tuple(range(70000, 90000)), None), id="two-frames"),
        pytest.param((b"p" * 32, tuple(range(70000, 83100)), None), id="frame-boundary"),
        pytest.param(("s" * 70000, b"b" * 70000, "x"), id="unframed-payloads"),
        pytest.param((*range(70000, 83107), "x" * 65536), id="payload-after-frame"),
        pytest.param(((), (), ((),)), id="empty-tuples"),
        pytest.param("a", id="bare-str"),
        pytest.param(None, id="bare-none"),
    ],
)
def test_serializer_edge_cases(value: Any) -> None:
    assert _core.serialize("pickle", value) == pickle.dumps(value, protocol=5)
    assert _core.serialize("cbor", value) == cbor2.dumps(value, canonical=True)


def test_same_tuple_object_twice_is_a_memo_reference() -> None:
    t = ("mm", fresh("img"), 3)
    for v in [(t, t), (t, (t,)), ((b"x",) * 3)]:
        assert _core.serialize("pickle", v) == pickle.dumps(v, protocol=5)


def test_vllm_tag_literals_are_the_interned_strings() -> None:
    # The core memoizes tags by the identity of the interned string; vLLM's literals
    # must be exactly those objects.
    consts = set()
    for fn in (
        kcu._gen_mm_extra_hash_keys,
        kcu._gen_lora_extra_hash_keys,
        kcu.generate_block_hash_extra_keys,
        kcu._gen_prompt_embeds_extra_hash_keys,
    ):
        consts |= {c for c in fn.__code__.co_consts if isinstance(c, str)}
    for tag in ["mm", "lora", "cache_salt", "prompt_embeds"]:
        literal = next(c for c in consts if c == tag)
        assert literal is sys.intern(fresh(tag))


# ------------------------------------------------------------- hash functions


@pytest.mark.parametrize("algo", VLLM_ALGOS)
def test_hash_object_matches_vllm_hash_functions(algo: str) -> None:
    fn = hashing.get_hash_fn_by_name(algo)
    rng = random.Random(algo)
    for _ in range(500):
        v = random_value(rng, 0, [])
        assert _core.hash_object(algo, v) == fn(v)


@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_none_hash_seeds_like_init_none_hash(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    fn = hash_fn(algo)
    kcu.init_none_hash(fn)
    assert kcu.NONE_HASH == _core.hash_object(algo, "1234") == fn("1234")


def random_extra_keys(rng: random.Random) -> Any:
    keys: list[Any] = []
    if rng.random() < 0.3:
        keys.append(("lora", fresh("adapter"), fresh("/path")))
    for _ in range(rng.choice([0, 0, 1, 2, 3])):
        keys.append(("mm", rng.choice(["a", fresh("img-1"), "mm"]), rng.randrange(-40, 40)))
    if rng.random() < 0.2:
        keys.append(("cache_salt", fresh("salt")))
    if rng.random() < 0.2:
        keys.append(("prompt_embeds", rng.randbytes(32)))
    return tuple(keys) or None


@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_hash_block_tokens_matches_vllm(algo: str) -> None:
    fn = hash_fn(algo)
    rng = random.Random(algo)
    for i in range(400):
        parent = None if i % 5 == 0 else rng.randbytes(32 if "xx" not in algo else 16)
        tokens = [
            rng.randrange(2**32) if rng.random() < 0.1 else rng.randrange(70000)
            for _ in range(rng.randrange(0, 40))
        ]
        extra = random_extra_keys(rng)
        want = kcu.hash_block_tokens(fn, parent, tokens, extra)
        assert bh.hash_block_tokens(fn, parent, tokens, extra) == want


def _blake3_scheme(parent: bytes, tokens: list[int], extra: Any) -> bytes:
    """The ``blake3`` block scheme of ``src/hash.rs``'s module docs, written again with the
    independent ``blake3`` package (a dependency of vLLM) and ``cbor2``."""
    import blake3 as ref

    k0 = parent if len(parent) == 32 else ref.blake3(parent).digest()
    key = k0
    if extra is not None:
        cbor = cbor2.dumps(extra, canonical=True)
        k = next(k for k in range(1, 5) if (len(cbor) + k) % 4 == 1)
        key = ref.blake3(cbor + bytes(k - 1) + bytes([k]), key=k0).digest()
    data = b"".join(t.to_bytes(4, "little") for t in tokens)
    return ref.blake3(data, key=key).digest()


def test_blake3_matches_an_independent_implementation() -> None:
    """Golden values: hscache's BLAKE3 (digests and the block scheme, with and without
    extra keys, 16- and 32-byte parents) against the ``blake3`` package."""
    import blake3 as ref

    rng = random.Random("blake3")
    for n in [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 4097, 100_000]:
        data = rng.randbytes(n)
        assert _core.blake3_digest(data) == ref.blake3(data).digest()
    for _ in range(300):
        parent = rng.randbytes(rng.choice([16, 32]))
        tokens = [rng.randrange(2**32) for _ in range(rng.randrange(0, 70))]
        extra = random_extra_keys(rng)
        want = _blake3_scheme(parent, tokens, extra)
        assert _core.hash_block_tokens("blake3", parent, tokens, extra) == want
        cbor = None if extra is None else cbor2.dumps(extra, canonical=True)
        assert _core.blake3_block(parent, tokens, cbor) == want


def test_blake3_chain_properties() -> None:
    parent = bytes(32)
    h = _core.hash_block_tokens("blake3", parent, [1, 2, 3])
    assert len(h) == 32
    assert h != _core.hash_block_tokens("blake3", parent, [1, 2, 4])
    assert h != _core.hash_block_tokens("blake3", b"\x01" * 32, [1, 2, 3])
    assert h != _core.hash_block_tokens("blake3", parent, [1, 2, 3], ())
    assert h != _core.hash_block_tokens("blake3", parent, [1, 2, 3], (("cache_salt", "s"),))
    # A 16-byte parent (xxhash NONE_HASH) is first hashed to a 32-byte key.
    assert len(_core.hash_block_tokens("blake3", b"\x02" * 16, [1])) == 32
    # The cbor2 fallback of the marker function equals the native scheme.
    extra = (("mm", "img", -3), ("lora", "a", "/p"))
    assert bh._blake3_slow((parent, (5, 6), extra)) == bh.blake3((parent, (5, 6), extra))
    assert bh._blake3_slow((parent, (5, 6), None)) == bh.blake3((parent, (5, 6), None))
    assert bh._blake3_slow("seed") == bh.blake3("seed")


# ----------------------------------------------------------- request hasher

ID_POOL = ["img-0", "img-1", "a", "", "mm", "lora"]


def pick_identifier(rng: random.Random, used: list[str]) -> str:
    r = rng.random()
    if used and r < 0.25:
        return rng.choice(used)  # the same object at two positions
    if r < 0.4:
        return sys.intern(rng.choice(ID_POOL))  # interned / singleton strings, tags
    if r < 0.6:
        return fresh(rng.choice(ID_POOL))  # equal values, distinct objects
    return f"hash-{rng.randrange(10**9)}"


def random_features(rng: random.Random, num_prompt: int) -> list[MultiModalFeatureSpec]:
    feats: list[MultiModalFeatureSpec] = []
    used: list[str] = []
    pos = rng.randrange(0, 6)
    overlapping = rng.random() < 0.1  # interleaved audio-in-video placeholders
    while pos < num_prompt and rng.random() < 0.75:
        length = (
            rng.choice([0, 1, 1, 2, 3, 5, 8, 17, 40])
            if rng.random() < 0.05
            else rng.randrange(1, 30)
        )
        ident = pick_identifier(rng, used)
        used.append(ident)
        feats.append(
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=ident,
                mm_position=PlaceholderRange(offset=pos, length=length),
            )
        )
        step = (
            rng.randrange(0, length + 1) if overlapping else length + rng.choice([0, 0, 1, 7, 20])
        )
        pos += max(step, 0 if length else 1)
    return feats


def random_request_args(rng: random.Random, max_prompt: int) -> dict[str, Any]:
    num_prompt = rng.randrange(0, max_prompt)
    args: dict[str, Any] = {"mm_features": None, "lora_request": None, "cache_salt": None}
    if rng.random() < 0.15:
        args["prompt_token_ids"] = None
        args["prompt_embeds"] = torch.randn(max(num_prompt, 1), 3)
    else:
        hi = rng.choice([256, 65536, 2**31, 2**32])
        args["prompt_token_ids"] = [rng.randrange(hi) for _ in range(num_prompt)]
        args["mm_features"] = random_features(rng, num_prompt) or None
    ident_pool = [f.identifier for f in args["mm_features"] or []]
    if rng.random() < 0.3:
        name = (
            rng.choice([*ident_pool, sys.intern("mm"), "a", fresh("adapter")])
            if rng.random() < 0.3
            else f"lora-{rng.randrange(9)}"
        )
        path = name if name and rng.random() < 0.2 else rng.choice(["/x", fresh("/adapters/x")])
        args["lora_request"] = LoRARequest(name, rng.randrange(1, 5), path)
    if rng.random() < 0.3:
        pool = [*ident_pool, "", "a", fresh("salt"), f"salt-{rng.random()}"]
        if args["lora_request"] is not None:
            pool.append(args["lora_request"].lora_name)
        args["cache_salt"] = rng.choice(pool)
    return args


def make_request(args: dict[str, Any], hasher: Any) -> Request:
    return Request(
        request_id="r",
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        block_hasher=hasher,
        **args,
    )


def _fell_back(request: Request) -> list[bytes]:
    raise AssertionError("hscache fell back to vLLM's hasher")


def native_hasher(hbs: int, fn: Any, lookahead: int = 0) -> Any:
    """hscache's hasher with its fallback replaced by a failure: proves the native path.

    The fallback is the factory ``block_hasher`` bound at import, so that name is the
    one replaced (replacing ``kcu.get_request_block_hasher`` would not reach it)."""
    saved = bh._vllm_request_block_hasher
    bh._vllm_request_block_hasher = lambda *args: _fell_back
    try:
        return bh.get_request_block_hasher(hbs, fn, lookahead)
    finally:
        bh._vllm_request_block_hasher = saved


def vllm_hasher(hbs: int, fn: Any, lookahead: int = 0) -> Any:
    """The installed vLLM's own request hasher (the lookahead argument only where given:
    vLLM 0.32 and 0.30 take two arguments)."""
    return kcu.get_request_block_hasher(hbs, fn, *((lookahead,) if lookahead else ()))


def drive_pair(
    rng: random.Random, algo: str, hbs: int, lookahead: int, args: dict[str, Any]
) -> int:
    """One random request hashed by hscache and by the installed vLLM, through appends
    and the Scheduler's resets; the number of blocks compared at the end."""
    fn = hash_fn(algo)
    ours = make_request(args, native_hasher(hbs, fn, lookahead))
    ref = make_request(args, vllm_hasher(hbs, fn, lookahead))
    assert ours.block_hashes == ref.block_hashes
    for _ in range(rng.randrange(0, 6)):
        out = [rng.randrange(2**32) for _ in range(rng.choice([1, 1, 1, 2, hbs, 3 * hbs + 1]))]
        ours.append_output_token_ids(list(out))
        ref.append_output_token_ids(list(out))
        assert ours.block_hashes == ref.block_hashes
        if rng.random() < 0.2:  # the Scheduler's resets: clear, or truncate, then rehash
            keep = rng.randrange(0, len(ref.block_hashes) + 1)
            for r in (ours, ref):
                del r.block_hashes[keep:]
                r.update_block_hashes()
            assert ours.block_hashes == ref.block_hashes
    return len(ref.block_hashes)


@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_request_hasher_matches_vllm_on_random_requests(algo: str) -> None:
    rng = random.Random(f"req-{algo}")
    kcu.init_none_hash(hash_fn(algo))
    blocks = 0
    for i in range(700):
        hbs = rng.choice([1, 2, 3, 4, 5, 8, 16, 17, 32])
        lookahead = (0, 1, 2)[i % 3]
        args = random_request_args(rng, max_prompt=rng.choice([8, 40, 120]))
        blocks += drive_pair(rng, algo, hbs, lookahead, args)
    assert blocks > 5000


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_pickle_identity_cases_in_requests(algo: str) -> None:
    same = fresh("img-x")
    cases = [
        [("img-x", 0, 2), ("img-x", 2, 2)],  # equal literal strings: one interned object
        [(same, 0, 2), (same, 2, 2)],  # the same object twice in one block
        [(fresh("img-x"), 0, 2), (fresh("img-x"), 2, 2)],  # equal but distinct
        [(sys.intern("mm"), 0, 2), (fresh("mm"), 2, 2)],  # identifier *is* the tag
        [("a", 0, 1), ("a", 1, 1), ("", 2, 1)],  # singleton 1-char and empty strings
    ]
    for feats in cases:
        for lora in [
            None,
            LoRARequest(feats[0][0], 1, feats[0][0] or "/p"),
            LoRARequest("mm", 1, "/p"),
        ]:
            args = {
                "prompt_token_ids": list(range(16)),
                "mm_features": [
                    MultiModalFeatureSpec(
                        data=None,
                        modality="image",
                        identifier=i,
                        mm_position=PlaceholderRange(offset=o, length=n),
                    )
                    for i, o, n in feats
                ],
                "lora_request": lora,
                "cache_salt": feats[-1][0] or None,
            }
            fn = hash_fn(algo)
            ours = make_request(args, native_hasher(4, fn))
            ref = make_request(args, kcu.get_request_block_hasher(4, fn))
            assert ours.block_hashes == ref.block_hashes, (feats, lora)


def test_long_prompt_frames_and_large_blocks() -> None:
    rng = random.Random(7)
    for algo in VLLM_ALGOS:
        args = {
            "prompt_token_ids": [rng.randrange(2**32) for _ in range(40000)],
            "mm_features": None,
            "lora_request": None,
            "cache_salt": "s",
        }
        for hbs in (13107, 16384):
            fn = hash_fn(algo)
            assert (
                make_request(args, native_hasher(hbs, fn)).block_hashes
                == make_request(args, kcu.get_request_block_hasher(hbs, fn)).block_hashes
            )


# ------------------------------------------------------ bad input, fallbacks


def core_hasher(algo: str = "sha256", hbs: int = 2) -> Any:
    return _core.RequestBlockHasher(algo, hbs)


def test_token_ids_outside_u32_take_vllms_path_with_vllms_hashes() -> None:
    """vLLM hashes any int (its tests use -1 placeholders): the core declines such ids
    (UnsupportedError) and the drop-in hashes that call with vLLM's own hasher."""
    for bad in (-1, 2**32, 2**70):
        with pytest.raises(UnsupportedError, match=r"outside 0\.\.2"):
            core_hasher().hash_new_blocks([], [1, bad, 3, 4], kcu.NONE_HASH)
        with pytest.raises(UnsupportedError):
            _core.hash_block_tokens("sha256", kcu.NONE_HASH, [bad])
        assert bh.hash_block_tokens(hashing.sha256, None, [1, bad]) == kcu.hash_block_tokens(
            hashing.sha256, None, [1, bad]
        )
        ours = bh.get_request_block_hasher(2, hashing.sha256)
        theirs = kcu.get_request_block_hasher(2, hashing.sha256)
        req = make_request({"prompt_token_ids": [5, bad, 7, 8, 9]}, None)
        assert ours(req) == theirs(req)


def test_non_bytes_parent_raises() -> None:
    with pytest.raises(BlockHashError):
        core_hasher().hash_new_blocks(["not bytes"], [1, 2, 3, 4], kcu.NONE_HASH)
    with pytest.raises(BlockHashError):
        core_hasher().hash_new_blocks([], [1, 2], "none")
    with pytest.raises(BlockHashError):
        bh.hash_block_tokens(hashing.sha256, "parent", [1, 2])


class _Pos:
    def __init__(self, offset: Any, length: Any) -> None:
        self.offset, self.length = offset, length


class _Feat:
    def __init__(self, offset: Any, length: Any, identifier: Any = "x") -> None:
        self.mm_position, self.identifier = _Pos(offset, length), identifier


@pytest.mark.parametrize(
    "feature",
    [_Feat(-1, 2), _Feat(0, -2), _Feat("0", 2), _Feat(0, None), object(), _Feat(0, 2, None)],
)
def test_malformed_multimodal_positions_raise(feature: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        core_hasher().hash_new_blocks([], [1, 2, 3, 4], kcu.NONE_HASH, [feature])


def test_bad_configuration_raises() -> None:
    with pytest.raises(InvalidArgumentError):
        _core.RequestBlockHasher("md5", 16)
    with pytest.raises(InvalidArgumentError):
        _core.RequestBlockHasher("sha256", 0)
    with pytest.raises(InvalidArgumentError):
        _core.RequestBlockHasher("sha256", 16, -1)


def test_unknown_hash_function_uses_vllms_hasher() -> None:
    def custom(x: Any) -> bytes:
        return hashing.sha256(("custom", x))

    args = {
        "prompt_token_ids": list(range(10)),
        "mm_features": None,
        "lora_request": None,
        "cache_salt": None,
    }
    hasher = bh.get_request_block_hasher(4, custom)
    assert not hasattr(hasher, "hscache_algo")
    assert (
        make_request(args, hasher).block_hashes
        == make_request(args, kcu.get_request_block_hasher(4, custom)).block_hashes
    )


class _Str(str):
    pass


@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_values_the_core_cannot_reproduce_fall_back_to_vllm(algo: str) -> None:
    for value in [(True,), (1.5,), (2**127,), (_Str("s"),), ("\udcff",)]:
        with pytest.raises(UnsupportedError):
            _core.hash_object(algo, value)
    fn = hash_fn(algo)
    variants = [
        {"prompt_token_ids": [True, 2, 3, 4, 5, 6]},  # bool token ids
        {"prompt_token_ids": list(range(6)), "cache_salt": _Str("salt")},  # str subclass
        {"prompt_token_ids": list(range(6)), "cache_salt": "\udcff"},  # lone surrogate
    ]
    for v in variants:
        args = {"mm_features": None, "lora_request": None, "cache_salt": None, **v}
        if algo not in ("sha256", "xxhash") and args["cache_salt"] == "\udcff":
            continue  # cbor2 itself cannot encode lone surrogates
        assert (
            make_request(args, bh.get_request_block_hasher(2, fn)).block_hashes
            == make_request(args, kcu.get_request_block_hasher(2, fn)).block_hashes
        )


# --------------------------------------------------------------- installation


def test_engine_core_builds_the_hasher_after_the_scheduler() -> None:
    # install_block_hasher relies on this order in EngineCore.__init__.
    src = inspect.getsource(engine_core.EngineCore.__init__)
    assert (
        src.index("get_scheduler_cls()")
        < src.index("Scheduler(")
        < src.index("get_request_block_hasher(")
    )


def test_install_block_hasher_patches_engine_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's own factory (an hscache Scheduler built earlier in this process may already
    # have installed hscache's).
    original = bh._vllm_request_block_hasher
    bh.uninstall_block_hasher()
    assert engine_core.get_request_block_hasher is original
    try:
        bh.install_block_hasher()
        bh.install_block_hasher()  # idempotent
        hasher = engine_core.get_request_block_hasher(16, hashing.sha256_cbor, 0)
        assert hasher.hscache_algo == "sha256_cbor"
        bh.install_block_hasher("blake3")
        assert engine_core.get_request_block_hasher(16, hashing.sha256).hscache_algo == "blake3"
        monkeypatch.setenv(bh.ALGO_ENV, "xxhash")
        bh.install_block_hasher()
        assert engine_core.get_request_block_hasher(16, hashing.sha256).hscache_algo == "xxhash"
        with pytest.raises(ValueError):
            bh.install_block_hasher("md5")
    finally:
        bh.uninstall_block_hasher()
    assert engine_core.get_request_block_hasher is original
