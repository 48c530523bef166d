"""Rows of ``hscache._core.StepSchedule``: the ``schedule()`` phase of the steady decode
step (``hscache.vllm.step.schedule``).

The target is a synchronous ``StepSchedule``; ``decodes`` runs on the manager of
``manager.manager()`` (request ``a`` holds 5 blocks), whose fingerprint is the rows'.
"""

from __future__ import annotations

from typing import Any

from hscache import exceptions as hx
from hscache._core import StepSchedule

from . import Ctx, Surface, makers, needs_hooks
from . import manager as _manager

IA, UR, TE = hx.InvalidArgumentError, hx.UnknownRequestError, TypeError
S = "StepSchedule"
_ARGS = {"is_async": False, "max_model_len": 1000, "num_sampled_tokens_per_step": 1}


def _on(ctx: Ctx) -> Ctx:
    return Ctx(StepSchedule(**_ARGS), ctx.fingerprint, {**ctx.x, "manager": ctx.t})


def target() -> Ctx:
    return _on(_manager.manager())


@needs_hooks
def poisoned() -> Ctx:
    return _on(_manager.poisoned())


def _decode(rid: str) -> Any:
    """Request ``rid`` (``PROMPT``) with all but its last token computed."""
    r = _manager._req(rid)
    r.num_computed_tokens = len(_manager.PROMPT) - 1
    return r


def _with(r: Any, **fields: Any) -> Any:
    for name, value in fields.items():
        setattr(r, name, value)
    return r


def _decodes(c: Ctx, running: Any = None, start: Any = 0, step: Any = 1, **kw: Any) -> Any:
    """``decodes`` for ``running`` (default: request ``a``, a plain decode that fits in
    the blocks it holds) at step 1."""
    if running is None:
        running = [_decode("a")]
    return c.t.decodes(kw.get("manager", c.x["manager"]), running, start, step)


R, A = makers(S, target)

ROWS = [
    R(
        "__init__",
        "negative max_model_len",
        IA,
        lambda f, c: StepSchedule(**{**_ARGS, "max_model_len": -1}),
    ),
    R(
        "__init__",
        "negative num_sampled_tokens_per_step",
        IA,
        lambda f, c: StepSchedule(**{**_ARGS, "num_sampled_tokens_per_step": -1}),
    ),
    R(
        "__init__",
        "negative num_lookahead_tokens",
        IA,
        lambda f, c: StepSchedule(**_ARGS, num_lookahead_tokens=-1),
    ),
    R(
        "__init__",
        "max_model_len is a str",
        TE,
        lambda f, c: StepSchedule(**{**_ARGS, "max_model_len": "9"}),
    ),
    R(
        "decodes",
        "the manager is not a KVCacheCore",
        TE,
        lambda f, c: _decodes(c, manager=object()),
    ),
    R("decodes", "running is a tuple", TE, lambda f, c: _decodes(c, (_decode("a"),))),
    R("decodes", "running holds None", TE, lambda f, c: _decodes(c, [None])),
    R(
        "decodes",
        "a request unknown to the core",
        UR,
        lambda f, c: _decodes(c, [_decode("a"), _decode("q")]),
    ),
    R("decodes", "negative start", IA, lambda f, c: _decodes(c, start=-1)),
    R("decodes", "start past the end", IA, lambda f, c: _decodes(c, start=2)),
    R("decodes", "start is a str", TE, lambda f, c: _decodes(c, start="0")),
    R(
        "decodes",
        "a resumed call whose later request's num_computed_tokens is a str",
        TE,
        lambda f, c: _decodes(
            c, [_decode("a"), _decode("a"), _with(_decode("a"), num_computed_tokens="x")], start=1
        ),
    ),
    R("decodes", "step is None", TE, lambda f, c: _decodes(c, step=None)),
    R(
        "decodes",
        "num_computed_tokens is a str",
        TE,
        lambda f, c: _decodes(c, [_with(_decode("a"), num_computed_tokens="69")]),
    ),
    R(
        "decodes",
        "negative num_computed_tokens",
        IA,
        lambda f, c: _decodes(c, [_with(_decode("a"), num_computed_tokens=-1)]),
    ),
    R("decodes", "on a poisoned manager", hx.InternalError, lambda f, c: _decodes(c), poisoned),
    R("plain_decodes", "running is None", TE, lambda f, c: f(None, 1)),
    R("plain_decodes", "running holds an int", TE, lambda f, c: f([5], 1)),
    R("plain_decodes", "step is a str", TE, lambda f, c: f([_decode("a")], "1")),
]

ACCEPTED = [
    A(
        "decodes",
        "a request that is not a plain decode",
        "the step is vLLM's to serve: None, nothing changed",
        lambda f, c: _decodes(c, [c.x["a"]]),
    ),
    A(
        "decodes",
        "start at the end",
        "a resumed call with nothing left to allocate",
        lambda f, c: _decodes(c, start=1),
    ),
]

SURFACES = [Surface(S, classes=(StepSchedule,))]
