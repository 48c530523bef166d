"""Rows of ``hscache._core.StepUpdate``: the steady requests of a step's
``update_from_output`` (``hscache.vllm.step.update.split_update``).

The target holds no state; the fingerprint is what a call could write: every request's
tokens, block hashes, counters and events. The requests are running decodes, the first
of which is steady, so a bad input met on a later request proves the call reads every
request before it writes any.
"""

from __future__ import annotations

from typing import Any

from hscache import exceptions as hx
from hscache._core import StepUpdate
from hscache_tools.testing.requests import init_none_hash, make_request, request_block_hasher
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.request import RequestStatus

from . import Ctx, Surface, makers

IA, TE = hx.InvalidArgumentError, TypeError


def _step_update() -> StepUpdate:
    return StepUpdate(
        running=RequestStatus.RUNNING, output_class=EngineCoreOutput, cache_blocks_at="in_flight"
    )


def target() -> Ctx:
    init_none_hash("sha256")
    hasher = request_block_hasher(16, "sha256")
    requests = {}
    for rid in ("a", "b"):
        r = make_request(rid, list(range(100, 131)), max_tokens=50, block_hasher=hasher)
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = r.num_tokens
        r.num_in_flight_tokens = 1
        r.prefill_stats = None  # vLLM's first update_from_output takes them
        requests[rid] = r

    def fingerprint() -> Any:
        return [
            (
                r.request_id,
                list(r._all_token_ids),
                list(r._output_token_ids),
                list(r.block_hashes),
                r.num_in_flight_tokens,
                r.num_output_placeholders,
                r.num_computed_tokens,
                list(r.events),
            )
            for r in requests.values()
        ]

    return Ctx(_step_update(), fingerprint, {"requests": requests})


def _split(c: Ctx, **overrides: Any) -> Any:
    """``split`` of a step that schedules ``a`` and ``b`` one token each, with
    ``overrides`` of its arguments."""
    args: dict[str, Any] = {
        "requests": c.x["requests"],
        "num_scheduled_tokens": {"a": 1, "b": 1},
        "sampled_token_ids": [[7], [8]],
        "req_id_to_index": {"a": 0, "b": 1},
        "drafts": {},
        "prompt_logprobs": ({}, {}),
        "has_logprobs": False,
        "max_model_len": 4096,
        "is_async": False,
        "cache_blocks": None,
    }
    args.update(overrides)
    return c.t.split(
        args.pop("requests"),
        args.pop("num_scheduled_tokens"),
        args.pop("sampled_token_ids"),
        args.pop("req_id_to_index"),
        **args,
    )


def with_b(**fields: Any) -> Any:
    """The target with ``fields`` set on request ``b`` (read after ``a``, steady)."""

    def build() -> Ctx:
        c = target()
        for name, value in fields.items():
            setattr(c.x["requests"]["b"], name, value)
        return c

    return build


def without_b(name: str) -> Any:
    """The target with request ``b``'s field ``name`` gone (read after ``a``, steady)."""

    def build() -> Ctx:
        c = target()
        delattr(c.x["requests"]["b"], name)
        return c

    return build


S = "StepUpdate"
R, A = makers(S, target)

ROWS = [
    R(
        "__init__",
        "unknown cache_blocks_at",
        IA,
        lambda f, c: StepUpdate(
            running=RequestStatus.RUNNING, output_class=EngineCoreOutput, cache_blocks_at="x"
        ),
    ),
    R(
        "__init__",
        "output_class not callable",
        TE,
        lambda f, c: StepUpdate(
            running=RequestStatus.RUNNING, output_class=5, cache_blocks_at="in_flight"
        ),
    ),
    R("split", "requests is a list", TE, lambda f, c: _split(c, requests=[])),
    R(
        "split",
        "num_scheduled_tokens is a list",
        TE,
        lambda f, c: _split(c, num_scheduled_tokens=["a"]),
    ),
    R("split", "sampled_token_ids is a tuple", TE, lambda f, c: _split(c, sampled_token_ids=())),
    R(
        "split",
        "a request id missing from req_id_to_index",
        KeyError,
        lambda f, c: _split(c, req_id_to_index={"a": 0}),
    ),
    R(
        "split",
        "an index past sampled_token_ids",
        IA,
        lambda f, c: _split(c, req_id_to_index={"a": 0, "b": 5}),
    ),
    R(
        "split",
        "a negative index",
        IA,
        lambda f, c: _split(c, req_id_to_index={"a": 0, "b": -1}),
    ),
    R(
        "split",
        "a sampled token that is a str",
        TE,
        lambda f, c: _split(c, sampled_token_ids=[[7], ["x"]]),
    ),
    R(
        "split",
        "a scheduled count that is a str",
        TE,
        lambda f, c: _split(c, num_scheduled_tokens={"a": 1, "b": "1"}),
    ),
    R(
        "split",
        "a request that is not a Request",
        TE,
        lambda f, c: _split(c, requests={**c.x["requests"], "b": object()}),
    ),
    R(
        "split",
        "_output_token_ids a tuple",
        TE,
        lambda f, c: _split(c),
        with_b(_output_token_ids=()),
    ),
    R("split", "client_index a str", TE, lambda f, c: _split(c), with_b(client_index="0")),
    R(
        "split",
        "num_in_flight_tokens at -2**63 (a count out of range)",
        IA,
        lambda f, c: _split(c),
        with_b(num_in_flight_tokens=-(2**63)),
    ),
    R(
        "split",
        "a placeholder to resolve without cache_blocks",
        IA,
        lambda f, c: _split(c, is_async=True),
        with_b(num_output_placeholders=1),
    ),
    R(
        "split",
        "b without num_nans_in_logits (a steady before it)",
        TE,
        lambda f, c: _split(c),
        without_b("num_nans_in_logits"),
    ),
    R(
        "split",
        "b's request_id a list (a steady before it)",
        TE,
        lambda f, c: _split(c),
        with_b(request_id=[1]),
    ),
    R("split", "max_model_len a str", TE, lambda f, c: _split(c, max_model_len="4096")),
    R("split", "max_model_len = 2**70", IA, lambda f, c: _split(c, max_model_len=2**70)),
]

ACCEPTED = [
    A(
        "split",
        "a scheduled request unknown to the scheduler",
        "vLLM skips requests finished meanwhile: it is left to vLLM's loop",
        lambda f, c: _split(
            c,
            num_scheduled_tokens={"a": 1, "gone": 1},
            req_id_to_index={"a": 0, "gone": 1},
        ),
    ),
]

SURFACES = [Surface(S, classes=(StepUpdate,))]
