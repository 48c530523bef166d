"""Rows of the block hasher: ``hscache.vllm.block_hasher`` (its ``__all__``, and the
callable ``get_request_block_hasher`` returns, which vLLM calls with each ``Request``) and
the Rust ``RequestBlockHasher`` behind it.

The hashers are stateless; the fingerprint is what a call could change: the request's
``block_hashes`` (vLLM appends the result itself), the list handed to ``hash_new_blocks``,
and the factory ``install_block_hasher`` swaps into vLLM's engine core.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import vllm.v1.core.kv_cache_utils as kcu
import vllm.v1.engine.core as engine_core
from hscache import exceptions as hx
from hscache._core import RequestBlockHasher
from hscache.vllm import block_hasher as bh
from hscache_tools.testing.requests import init_none_hash, make_request
from vllm.utils.hashing import sha256

from . import Ctx, Surface, makers

IA, BH, TE = hx.InvalidArgumentError, hx.BlockHashError, TypeError
HUGE = 2**70
TOKENS = list(range(32))


def hasher() -> Ctx:
    init_none_hash("sha256")
    r = make_request("h", list(range(70)))
    h = bh.get_request_block_hasher(16, sha256)
    return Ctx(h, lambda: (list(r.block_hashes), engine_core.get_request_block_hasher), {"r": r})


def request_block_hasher() -> Ctx:
    init_none_hash("sha256")
    hashes = [kcu.NONE_HASH]
    return Ctx(RequestBlockHasher("sha256", 16), lambda: list(hashes), {"hashes": hashes})


def _like_request(**overrides: Any) -> Any:
    """A request-like object with every field the hasher reads, some overridden."""
    fields = {
        "block_hashes": [],
        "_all_token_ids": list(range(40)),
        "lora_request": None,
        "prompt_embeds": None,
        "mm_features": None,
        "cache_salt": None,
        **overrides,
    }
    return SimpleNamespace(**fields)


def _new_blocks(c: Ctx, *args: Any, hashes: Any = None, tokens: Any = None) -> Any:
    """``hash_new_blocks(hashes, tokens, NONE_HASH, *args)``."""
    return c.t.hash_new_blocks(
        [] if hashes is None else hashes,
        TOKENS if tokens is None else tokens,
        kcu.NONE_HASH,
        *args,
    )


H, RBH = "block hasher", "RequestBlockHasher"
R, A = makers(H, hasher)
RR, AR = makers(RBH, request_block_hasher)
grbh = bh.get_request_block_hasher

ROWS = [
    R("get_request_block_hasher", "block size 0", IA, lambda f, c: grbh(0, sha256)),
    R("get_request_block_hasher", "negative block size", IA, lambda f, c: grbh(-16, sha256)),
    R("get_request_block_hasher", "block size = 2**70", IA, lambda f, c: grbh(HUGE, sha256)),
    R("get_request_block_hasher", "block size is a str", TE, lambda f, c: grbh("16", sha256)),
    R("get_request_block_hasher", "negative lookahead", IA, lambda f, c: grbh(16, sha256, -1)),
    R("__call__", "request is None", TE, lambda f, c: c.t(None)),
    R("__call__", "request is a str", TE, lambda f, c: c.t("h")),
    R(
        "__call__",
        "lora_request without lora_name",
        TE,
        lambda f, c: c.t(_like_request(lora_request=5)),
    ),
    R(
        "__call__",
        "a parent hash that is a str",
        BH,
        lambda f, c: c.t(_like_request(block_hashes=["x"])),
    ),
    R("__call__", "mm_features is an int", IA, lambda f, c: c.t(_like_request(mm_features=5))),
    R(
        "hash_block_tokens",
        "parent hash is a str",
        BH,
        lambda f, c: bh.hash_block_tokens(sha256, "x", [1]),
    ),
    R(
        "hash_block_tokens",
        "token ids None",
        TE,
        lambda f, c: bh.hash_block_tokens(sha256, None, None),
    ),
    R("blake3", "an object cbor cannot encode", TE, lambda f, c: bh.blake3(object())),
    R("install_block_hasher", "unknown algorithm", IA, lambda f, c: bh.install_block_hasher("md5")),
    R("install_block_hasher", "algorithm is an int", IA, lambda f, c: bh.install_block_hasher(5)),
    RR("__init__", "unknown algorithm", IA, lambda f, c: RequestBlockHasher("md5", 16)),
    RR("__init__", "block size 0", IA, lambda f, c: RequestBlockHasher("sha256", 0)),
    RR("__init__", "negative block size", IA, lambda f, c: RequestBlockHasher("sha256", -1)),
    RR("__init__", "block size = 2**70", IA, lambda f, c: RequestBlockHasher("sha256", HUGE)),
    RR("__init__", "negative lookahead", IA, lambda f, c: RequestBlockHasher("sha256", 16, -1)),
    RR("hash_new_blocks", "NONE_HASH is a str", BH, lambda f, c: f([], TOKENS, "x")),
    RR("hash_new_blocks", "block_hashes is a tuple", BH, lambda f, c: _new_blocks(c, hashes=())),
    RR(
        "hash_new_blocks",
        "a parent hash that is a str",
        BH,
        lambda f, c: _new_blocks(c, hashes=["x"], tokens=list(range(48))),
    ),
    RR(
        "hash_new_blocks",
        "token ids a numpy array (the adapter hashes with vLLM's)",
        hx.UnsupportedError,
        lambda f, c: _new_blocks(c, tokens=np.arange(32)),
    ),
    RR(
        "hash_new_blocks",
        "token id past 2**32 (native path only)",
        hx.UnsupportedError,
        lambda f, c: _new_blocks(c, tokens=[2**40] * 32),
    ),
    RR("hash_new_blocks", "mm_features is an int", IA, lambda f, c: _new_blocks(c, 5)),
    RR("hash_new_blocks", "lora is a 3-tuple", IA, lambda f, c: _new_blocks(c, None, (1, 2, 3))),
    RR(
        "hash_new_blocks",
        "prompt-embeds digests not 32 bytes",
        IA,
        lambda f, c: _new_blocks(c, None, None, None, [b"x"]),
    ),
]

ACCEPTED = [
    A(
        "get_request_block_hasher",
        "an unknown hash function",
        "vLLM's own hasher, logged",
        lambda f, c: grbh(16, len),
    ),
    A(
        "__call__",
        "a 40-byte parent hash",
        "vLLM hashes any bytes parent",
        lambda f, c: c.t(_like_request(block_hashes=[b"x" * 40])),
    ),
    A(
        "__call__",
        "negative token ids",
        "vLLM hashes them (the native path falls back to vLLM's)",
        lambda f, c: c.t(make_request("n", [-1] * 40)),
    ),
    A("algo_of", "not a hash function", "None", lambda f, c: bh.algo_of(None)),
    A(
        "hash_block_tokens",
        "token ids a float64 numpy array",
        "vLLM hashes tuple(token_ids) of any iterable",
        lambda f, c: bh.hash_block_tokens(sha256, None, np.array([1.0])),
    ),
    AR(
        "hash_new_blocks",
        "non-contiguous list slice of tokens",
        "a list is a list",
        lambda f, c: _new_blocks(c, tokens=list(range(64))[::2]),
    ),
]

SURFACES = [
    Surface(
        H,
        functions=tuple(getattr(bh, name) for name in bh.__all__),
        extra=("__call__",),
        exempt={
            "algo_of": "takes any object: None for what is not one of the known functions "
            "(accepted row)",
            "uninstall_block_hasher": "no argument; idempotent (a no-op when nothing is installed)",
        },
    ),
    Surface(RBH, classes=(RequestBlockHasher,)),
]
