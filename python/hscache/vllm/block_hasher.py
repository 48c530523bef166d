"""hscache's request block hasher: vLLM's block hashes, computed natively.

Mirrors ``vllm/v1/core/kv_cache_utils.py`` (``get_request_block_hasher``,
``hash_block_tokens``) and ``vllm/utils/hashing.py`` (``sha256``, ``sha256_cbor``,
``xxhash``, ``xxhash_cbor``). Every hash is bit-identical to vLLM's: the Rust core has
its own pickle-protocol-5 and canonical-CBOR encoders, and reproduces pickle's
identity-based memo from the objects' identities (see ``src/python/hasher.rs``).
``blake3`` is hscache's own, faster algorithm (scheme in ``src/hash.rs``); pass
:func:`blake3` as ``caching_hash_fn`` or set ``HSCACHE_BLOCK_HASH_ALGO=blake3``.

How it is installed: vLLM's ``EngineCore.__init__`` (``vllm/v1/engine/core.py``)
resolves ``--scheduler-cls`` and constructs the scheduler, and only *then* builds the
hasher with ``get_request_block_hasher``, a name it imported into its own module.
:func:`install_block_hasher` rebinds that name, so calling it from the scheduler's
constructor (or any time before the engine core is constructed, in the engine-core
process) is enough.

Fallbacks, never a silent difference:

- a ``caching_hash_fn`` that is none of vLLM's four functions nor :func:`blake3`:
  vLLM's own hasher (one log line);
- a value whose bytes the core cannot reproduce (``str``/``int`` subclasses, ``bool``
  or numpy token ids, strings with lone surrogates, ints beyond 128 bits): vLLM's own
  hasher for that call (the core raises ``UnsupportedError`` before computing).

Bad input raises: a token id outside ``0..2**32`` or a malformed multimodal position
(``InvalidArgumentError``, a ``ValueError``), a parent hash that is not bytes
(``BlockHashError``, a ``ValueError``), lookahead tokens with a vLLM that has no lookahead
hashing (0.32), an unknown ``HSCACHE_BLOCK_HASH_ALGO`` (``InvalidArgumentError``), a value
:func:`blake3` cannot encode (``TypeError``), something that is not a ``Request``
(``TypeError``).

vLLM 0.32 hashes exactly as 0.33 does without lookahead (``num_hash_lookahead_tokens=0``);
its factory takes two arguments (``hscache.vllm.version``). vLLM 0.30 has the same factory
but writes its extra keys untagged (the profile's ``extra_keys_form``, handed to the core).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import vllm.v1.core.kv_cache_utils as _kcu
from vllm.logger import init_logger
from vllm.utils import hashing as _hashing
from vllm.v1.core.kv_cache_utils import get_request_block_hasher as _vllm_request_block_hasher
from vllm.v1.request import Request

from hscache._core import RequestBlockHasher, blake3_block, blake3_digest, hash_object
from hscache._core import hash_block_tokens as _hash_block_tokens
from hscache.exceptions import InvalidArgumentError, UnsupportedError
from hscache.vllm.version import require

_PROFILE = require()
_UNTAGGED = _PROFILE.extra_keys_form == "untagged"
logger = init_logger(__name__)

__all__ = [
    "algo_of",
    "blake3",
    "get_request_block_hasher",
    "hash_block_tokens",
    "install_block_hasher",
    "uninstall_block_hasher",
]

#: Environment variable that makes :func:`install_block_hasher` use this algorithm
#: (``blake3``, or one of vLLM's names) instead of ``--prefix-caching-hash-algo``.
ALGO_ENV = "HSCACHE_BLOCK_HASH_ALGO"


def blake3(input: Any) -> bytes:
    """hscache's BLAKE3 hash function, usable wherever vLLM takes a ``caching_hash_fn``.

    A block value ``(parent: bytes, tokens: tuple[int, ...], extra_keys)`` gets the
    keyed BLAKE3 block scheme of ``src/hash.rs``, any other value (``init_none_hash``'s
    seed) ``BLAKE3(cbor2.dumps(value, canonical=True))``: 32 bytes.
    """
    try:
        return hash_object("blake3", input)
    except UnsupportedError:
        return _blake3_slow(input)


def _blake3_slow(value: Any) -> bytes:
    """:func:`blake3` for values the core cannot convert: cbor2 encodes, the core hashes."""
    if (
        type(value) is tuple
        and len(value) == 3
        and type(value[0]) is bytes
        and type(value[1]) is tuple
        and all(isinstance(t, int) and 0 <= t < 2**32 for t in value[1])
    ):
        parent, tokens, extra_keys = value
        extras_cbor = None if extra_keys is None else cbor2.dumps(extra_keys, canonical=True)
        return blake3_block(parent, [int(t) for t in tokens], extras_cbor)
    try:
        encoded = cbor2.dumps(value, canonical=True)
    except cbor2.CBOREncodeError as e:  # cbor2's own class is neither TypeError nor ValueError
        raise TypeError(f"blake3 cannot hash a {type(value).__name__}: {e}") from e
    return blake3_digest(encoded)


_ALGO_OF_FN: dict[Callable[[Any], bytes], str] = {
    _hashing.sha256: "sha256",
    _hashing.sha256_cbor: "sha256_cbor",
    _hashing.xxhash: "xxhash",
    _hashing.xxhash_cbor: "xxhash_cbor",
    blake3: "blake3",
}
_FN_OF_ALGO = {name: fn for fn, name in _ALGO_OF_FN.items()}


def algo_of(hash_fn: Callable[[Any], bytes]) -> str | None:
    """The algorithm name of one of vLLM's hash functions or :func:`blake3`, else None."""
    try:
        return _ALGO_OF_FN.get(hash_fn)
    except TypeError:  # an unhashable callable
        return None


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: bytes | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """vLLM's ``hash_block_tokens``, natively for the known hash functions.

    ``NONE_HASH`` is read from ``vllm.v1.core.kv_cache_utils`` at call time.
    """
    algo = algo_of(hash_function)
    if algo is not None:
        try:
            return _hash_block_tokens(
                algo, parent_block_hash or _kcu.NONE_HASH, curr_block_token_ids, extra_keys
            )
        except UnsupportedError:
            pass
    return _kcu.hash_block_tokens(
        hash_function,
        parent_block_hash,  # type: ignore[arg-type]
        curr_block_token_ids,
        extra_keys,
    )


def _prompt_embeds_digests(
    request: Request, start: int, count: int, window: int, size: int
) -> list[bytes]:
    # vLLM's own per-block digest (SHA-256 of the rows [s, s + window)), memoized on
    # the request exactly as vLLM memoizes it; its key is ("prompt_embeds", digest),
    # or the bare digest where keys are untagged.
    gen = _kcu._gen_prompt_embeds_extra_hash_keys
    keys: list[Any] = [
        gen(request, s, s + window)[0] for s in range(start, start + count * size, size)
    ]
    return keys if _UNTAGGED else [k[1] for k in keys]


def get_request_block_hasher(
    hash_block_size: int,
    caching_hash_fn: Callable[[Any], bytes],
    num_hash_lookahead_tokens: int = 0,
) -> Callable[[Request], list[Any]]:
    """vLLM's ``get_request_block_hasher``: same signature, same hashes.

    The returned callable hashes a request's new full blocks (vLLM appends the result
    to ``request.block_hashes``) in one core call.
    """
    # vLLM's own factory, bound at import: tools that swap the module's name for this
    # function (vLLM's test plugin does) must not make it call itself.
    if _PROFILE.hash_lookahead:
        vllm_hasher = _vllm_request_block_hasher(
            hash_block_size, caching_hash_fn, num_hash_lookahead_tokens
        )
    elif num_hash_lookahead_tokens:
        raise InvalidArgumentError(
            f"num_hash_lookahead_tokens={num_hash_lookahead_tokens!r}: vLLM "
            f"{_PROFILE.version} has no lookahead block hashing (it must be 0)"
        )
    else:
        vllm_hasher = _vllm_request_block_hasher(hash_block_size, caching_hash_fn)
    algo = algo_of(caching_hash_fn)
    if algo is None:
        logger.info(
            "hscache: block hash function %r is not one of vLLM's; using vLLM's block hasher",
            caching_hash_fn,
        )
        return vllm_hasher

    hash_new_blocks = RequestBlockHasher(
        algo, hash_block_size, num_hash_lookahead_tokens, extra_keys=_PROFILE.extra_keys_form
    ).hash_new_blocks
    size = hash_block_size
    window = hash_block_size + num_hash_lookahead_tokens
    kcu = _kcu

    def request_block_hasher(request: Request) -> list[Any]:
        try:
            block_hashes = request.block_hashes
            token_ids = request._all_token_ids
            start = len(block_hashes) * size
            num_tokens = len(token_ids)
            if start + window > num_tokens:
                return []
            lora = request.lora_request
            lora_key = (lora.lora_name, lora.lora_path) if lora else None
            mm_features = request.mm_features
            cache_salt = request.cache_salt
            digests = None
            if request.prompt_embeds is not None:
                count = (num_tokens - window - start) // size + 1
                digests = _prompt_embeds_digests(request, start, count, window, size)
        except AttributeError as e:  # a typed error for the wrong kind of object
            raise TypeError(f"expected a vLLM Request, got {type(request).__name__}: {e}") from e
        try:
            return hash_new_blocks(
                block_hashes,  # type: ignore[arg-type]
                token_ids,
                kcu.NONE_HASH,
                mm_features,
                lora_key,
                cache_salt,
                digests,
            )
        except UnsupportedError:
            return vllm_hasher(request)

    request_block_hasher.hscache_algo = algo  # type: ignore[attr-defined]
    # Read by the fast path's update (src/python/step_update.rs): with these it knows
    # when a call would return nothing (no new full block), and skips it.
    request_block_hasher.hscache_hash_window = (  # type: ignore[attr-defined]
        size,
        num_hash_lookahead_tokens,
    )
    return request_block_hasher


_vllm_get_request_block_hasher: Callable[..., Any] | None = None


def install_block_hasher(algo: str | None = None) -> None:
    """Make vLLM's ``EngineCore`` build its request block hasher with hscache's.

    Rebinds ``vllm.v1.engine.core.get_request_block_hasher``, which ``EngineCore``
    calls after constructing the scheduler; idempotent. ``algo`` (or the
    ``HSCACHE_BLOCK_HASH_ALGO`` environment variable) overrides
    ``--prefix-caching-hash-algo``, e.g. ``"blake3"``; by default vLLM's choice stays.
    """
    global _vllm_get_request_block_hasher
    import vllm.v1.engine.core as engine_core

    override = algo or os.environ.get(ALGO_ENV) or None
    if override is not None and override not in _FN_OF_ALGO:
        raise InvalidArgumentError(
            f"unknown block hash algorithm {override!r}: expected one of {sorted(_FN_OF_ALGO)}"
        )
    if _vllm_get_request_block_hasher is None:
        _vllm_get_request_block_hasher = getattr(engine_core, "get_request_block_hasher")  # noqa: B009

    def hscache_get_request_block_hasher(
        hash_block_size: int,
        caching_hash_fn: Callable[[Any], bytes],
        num_hash_lookahead_tokens: int = 0,
    ) -> Callable[[Request], list[Any]]:
        fn = _FN_OF_ALGO[override] if override is not None else caching_hash_fn
        return get_request_block_hasher(hash_block_size, fn, num_hash_lookahead_tokens)

    setattr(engine_core, "get_request_block_hasher", hscache_get_request_block_hasher)  # noqa: B010


def uninstall_block_hasher() -> None:
    """Undoes :func:`install_block_hasher`."""
    global _vllm_get_request_block_hasher
    if _vllm_get_request_block_hasher is None:
        return
    import vllm.v1.engine.core as engine_core

    setattr(engine_core, "get_request_block_hasher", _vllm_get_request_block_hasher)  # noqa: B010
    _vllm_get_request_block_hasher = None
