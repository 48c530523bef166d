"""Rows of the encoder-cache managers (``hscache.vllm.encoder_cache_manager``):
``EncoderCacheManager`` (multimodal decoders) and ``EncoderDecoderCacheManager``, with
their Rust bases, and the module's ``compute_mm_encoder_budget``.

The ``core_*`` accessors are internal (the read-only views ``cached``, ``freeable``, ...
are built from them). The fingerprint is a snapshot of every public field. An input id
past the request's inputs is ``IndexError``, as in vLLM (``mm_features[input_id]``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hscache import exceptions as hx
from hscache.vllm.encoder_cache_manager import (
    EncoderCacheManager,
    EncoderDecoderCacheManager,
    compute_mm_encoder_budget,
)
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

from . import Ctx, Surface, makers

IA, TE = hx.InvalidArgumentError, TypeError
HUGE = 2**70


class Req:
    """What the encoder caches read: ``request_id``, ``mm_features``, embed counts."""

    def __init__(self, request_id: Any, sizes: list[int], ids: list[Any] | None = None) -> None:
        self.request_id = request_id
        self.sizes = sizes
        self.mm_features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=f"img{i}" if ids is None else ids[i],
                mm_position=PlaceholderRange(offset=0, length=n),
            )
            for i, n in enumerate(sizes)
        ]

    def get_num_encoder_embeds(self, input_id: int) -> Any:
        return self.sizes[input_id]


def _snapshot(m: Any) -> Any:
    if isinstance(m, EncoderDecoderCacheManager):
        return (m.cache_size, m.num_free_slots, m.allocated, m.to_free)
    return (
        m.cache_size,
        m.num_free_slots,
        m.num_freeable_slots,
        {k: set(v) for k, v in m.cached.items()},
        dict(m.num_embeds_by_hash),
        list(m.freeable.items()),
        {k: list(v) for k, v in m.request_cached_ids.items()},
        list(m.freed),
    )


def _build(cls: type) -> Ctx:
    """A cache of 100 embeddings; request ``r``'s input 0 (10 embeddings) allocated."""
    m = cls(cache_size=100)
    r = Req("r", [10, 20])
    assert m.can_allocate(r, 0, 100, 0)
    m.allocate(r, 0)
    return Ctx(m, lambda: _snapshot(m), {"r": r})


def encoder() -> Ctx:
    return _build(EncoderCacheManager)


def encoder_decoder() -> Ctx:
    return _build(EncoderDecoderCacheManager)


def _config(**overrides: Any) -> Any:
    """A ``SchedulerConfig`` stand-in with what the budget reads."""
    return SimpleNamespace(
        **{
            "max_num_encoder_input_tokens": 100,
            "encoder_cache_size": 100,
            "max_num_batched_tokens": 8192,
            "disable_chunked_mm_input": False,
            **overrides,
        }
    )


E, D = "EncoderCacheManager", "EncoderDecoderCacheManager"
R, A = makers(E, encoder)
RD, AD = makers(D, encoder_decoder)
NEG = Req("q", [-5])  # a request whose embed count is negative
BIG = Req("q", [500], ["big"])  # an input larger than the whole cache
STR = Req("q", ["5"])  # an embed count that is a str

# Both encoder caches take these the same way (vLLM's two managers share the methods).
SHARED: list[tuple[str, str, type[BaseException], Any]] = [
    ("check_and_update_cache", "input id is a str", TE, lambda f, c: f(c.x["r"], "0")),
    ("can_allocate", "request is None", TE, lambda f, c: f(None, 1, 100, 0)),
    ("can_allocate", "budget is a str", TE, lambda f, c: f(c.x["r"], 1, "100", 0)),
    ("allocate", "request is None", TE, lambda f, c: f(None, 0)),
    ("allocate", "input id past the request's inputs", IndexError, lambda f, c: f(c.x["r"], 9)),
    ("allocate", "the request reports negative embeds", IA, lambda f, c: f(NEG, 0)),
    ("free_encoder_input", "request is None", TE, lambda f, c: f(None, 0)),
    (
        "free_encoder_input",
        "input id past the request's inputs",
        IndexError,
        lambda f, c: f(c.x["r"], 9),
    ),
    ("free", "request is None", TE, lambda f, c: f(None)),
    ("free", "request is a str", TE, lambda f, c: f("r")),
    ("get_cached_input_ids", "request is None", TE, lambda f, c: f(None)),
    ("get_cached_input_ids", "request is a str", TE, lambda f, c: f("r")),
    (
        "can_allocate",
        "input id past the request's inputs",
        IndexError,
        lambda f, c: f(c.x["r"], 7, 100, 0),
    ),
]

ROWS = [
    R("__init__", "negative cache_size", IA, lambda f, c: EncoderCacheManager(cache_size=-1)),
    R("__init__", "cache_size = 2**70", IA, lambda f, c: EncoderCacheManager(cache_size=HUGE)),
    R("__init__", "cache_size past 2**40", IA, lambda f, c: EncoderCacheManager(cache_size=2**41)),
    R("__init__", "cache_size is a str", TE, lambda f, c: EncoderCacheManager(cache_size="1")),
    R("create_manager", "negative cache_size", IA, lambda f, c: f(cache_size=-1, vllm_config=None)),
    R("create_manager", "positional arguments", TE, lambda f, c: f(100, None)),
    R(
        "check_and_update_cache",
        "input id past the request's inputs",
        IndexError,
        lambda f, c: f(c.x["r"], 7),
    ),
    R("check_and_update_cache", "request is None", TE, lambda f, c: f(None, 0)),
    R("check_and_update_cache", "input id = 2**70", IA, lambda f, c: f(c.x["r"], HUGE)),
    R("get_cached_num_encoder_embeds", "request is None", TE, lambda f, c: f(None, 0)),
    R(
        "get_cached_num_encoder_embeds",
        "input id past the request's inputs",
        IndexError,
        lambda f, c: f(c.x["r"], 7),
    ),
    R("can_allocate", "budget = 2**70", IA, lambda f, c: f(c.x["r"], 1, HUGE, 0)),
    R("can_allocate", "the request reports negative embeds", IA, lambda f, c: f(NEG, 0, 100, 0)),
    R("can_allocate", "the request reports embeds as a str", TE, lambda f, c: f(STR, 0, 100, 0)),
    R("allocate", "negative input id", IA, lambda f, c: f(c.x["r"], -1)),
    R(
        "allocate",
        "without room (can_allocate skipped)",
        hx.EncoderCacheFullError,
        lambda f, c: f(BIG, 0),
    ),
    R(
        "allocate",
        "embeds differ from the cached entry's",
        IA,
        lambda f, c: f(Req("q", [11], ["img0"]), 0),
    ),
    R("allocate", "request id is an int", IA, lambda f, c: f(Req(5, [5]), 0)),
    R("allocate", "identifier is an int", IA, lambda f, c: f(Req("q", [5], [7]), 0)),
    R("free_encoder_input", "input id is a str", TE, lambda f, c: f(c.x["r"], "0")),
    R("free_encoder_input", "negative input id", IA, lambda f, c: f(c.x["r"], -1)),
    R(
        "compute_mm_encoder_budget",
        "scheduler_config is None",
        TE,
        lambda f, c: compute_mm_encoder_budget(None, {"image": 5}),
    ),
    R(
        "compute_mm_encoder_budget",
        "items are a list",
        TE,
        lambda f, c: compute_mm_encoder_budget(_config(), [5]),
    ),
    R(
        "compute_mm_encoder_budget",
        "an item's tokens are a str",
        TE,
        lambda f, c: compute_mm_encoder_budget(_config(), {"image": "5"}),
    ),
    R(
        "compute_mm_encoder_budget",
        "an item past the batch with chunked input off",
        IA,
        lambda f, c: compute_mm_encoder_budget(
            _config(disable_chunked_mm_input=True), {"image": 10**5}
        ),
    ),
    *(R(*row) for row in SHARED),
    # EncoderDecoderCacheManager: a scheduling budget only (nothing is shared or kept)
    RD(
        "__init__",
        "negative cache_size",
        IA,
        lambda f, c: EncoderDecoderCacheManager(cache_size=-1),
    ),
    RD(
        "__init__",
        "cache_size = 2**70",
        IA,
        lambda f, c: EncoderDecoderCacheManager(cache_size=HUGE),
    ),
    RD(
        "create_manager", "negative cache_size", IA, lambda f, c: f(cache_size=-1, vllm_config=None)
    ),
    *(RD(*row) for row in SHARED),
]

ACCEPTED = [
    A(
        "check_and_update_cache",
        "negative input id of an uncached input",
        "vLLM: mm_features[-1], a miss",
        lambda f, c: f(c.x["r"], -1),
    ),
    A("free", "unknown request", "vLLM: a no-op", lambda f, c: f(Req("zz", [10]))),
    A(
        "free_encoder_input",
        "an input never allocated",
        "vLLM: a no-op",
        lambda f, c: f(c.x["r"], 1),
    ),
    A(
        "can_allocate",
        "negative budget",
        "vLLM: False (the item does not fit)",
        lambda f, c: f(c.x["r"], 1, -1, 0),
    ),
    AD("check_and_update_cache", "request is None", "vLLM: always False", lambda f, c: f(None, 0)),
    AD(
        "allocate",
        "without room",
        "vLLM: the budget goes negative, checked by can_allocate",
        lambda f, c: f(BIG, 0),
    ),
]

_ZERO_ARG = (
    "no argument; refuses only on a cache poisoned by an internal panic, which needs the "
    "fault-injection build (tests/robustness/test_panic_python.py)"
)
SURFACES = [
    Surface(
        E,
        classes=(EncoderCacheManager,),
        functions=(compute_mm_encoder_budget,),
        internal={"core_": "accessors the read-only views (cached, freeable, ...) are built from"},
        exempt={
            "reset": _ZERO_ARG,
            "get_freed_mm_hashes": _ZERO_ARG,
            "get_manager_metadata": "no argument; always None, as vLLM's",
        },
    ),
    Surface(
        D,
        classes=(EncoderDecoderCacheManager,),
        exempt={
            "reset": _ZERO_ARG,
            "get_freed_mm_hashes": _ZERO_ARG,
            "get_manager_metadata": "no argument; always None, as vLLM's",
        },
    ),
]
