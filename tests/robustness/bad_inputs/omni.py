"""Rows of ``OmniStepRules`` (``src/slots/omni_rules.rs``): the decisions of
``hscache.omni.OmniHiddenStateCache`` (live requests, first hits, spans, who is served
what, consume-once step ids).

The state: blocks of 4 tokens, at most 2 unconsumed steps. A first step (``z``) was saved
and consumed. Step 1 scheduled ``a`` (new,
8 tokens) and ``b`` (new, a 4-token hit the mirror refused: unservable) and was saved,
unconsumed; step 2 (``a`` 1 more token) is begun, not saved. The fingerprint is the
unconsumed step ids, the live count, whether a step is pending and the pending step's
layout.
"""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from hscache import exceptions as hx
from hscache._core import OmniStepRules, StepIdError, UnservableHitError

from . import Ctx, Surface, makers

IA, UR, TE, SI = hx.InvalidArgumentError, hx.UnknownRequestError, TypeError, StepIdError


def _so(new: Any = (), scheduled: Any = None, finished: Any = ()) -> Any:
    """A ``SchedulerOutput`` stand-in: ``new`` = ``(req_id, num_computed_tokens)``."""
    return NS(
        finished_req_ids=set(finished),
        scheduled_new_reqs=[NS(req_id=r, num_computed_tokens=nc) for r, nc in new],
        num_scheduled_tokens={} if scheduled is None else scheduled,
    )


def _fingerprint(t: OmniStepRules) -> Any:
    layout = None
    if t.has_pending_step:
        plan = t.lay_out(["a"], 1)
        layout = (plan.req_ids, plan.sizes)
    return (t.unconsumed_steps(), t.num_live, t.has_pending_step, layout)


def rules(limit: int = 2, pending: bool = True) -> Ctx:
    t = OmniStepRules(block_size=4, max_unconsumed_steps=limit)
    t.begin_step(_so(new=[("z", 0)], scheduled={"z": 4}))
    consumed = t.save(t.lay_out(["z"], 4))[0]
    t.materialize(consumed, ["z"])
    t.begin_step(_so(new=[("a", 0), ("b", 4)], scheduled={"a": 8, "b": 1}, finished=["z"]))
    plan = t.lay_out(["b", "a"], 9)
    step = t.save(plan, hits=[], misses=[0])[0]
    if pending:
        t.begin_step(_so(scheduled={"a": 1}))
    other = OmniStepRules(block_size=4, max_unconsumed_steps=2)
    other.begin_step(_so(scheduled={"a": 1}))
    foreign = other.lay_out(["a"], 1)
    other_step = other.save(foreign)[0]
    other.begin_step(_so(scheduled={"a": 1}))
    return Ctx(
        t,
        lambda: _fingerprint(t),
        {
            "step": step,
            "consumed": consumed,
            "saved_plan": plan,
            "foreign": other.lay_out(["a"], 1),
            "other_step": other_step,
        },
    )


def idle() -> Ctx:
    return rules(pending=False)


def full() -> Ctx:
    """One step allowed to wait, and one waiting."""
    return rules(limit=1)


S = "OmniStepRules"
R, A = makers(S, rules)
OSR = OmniStepRules

ROWS = [
    R("__init__", "block_size 0", IA, lambda f, c: OSR(block_size=0, max_unconsumed_steps=2)),
    R(
        "__init__",
        "negative block_size",
        IA,
        lambda f, c: OSR(block_size=-4, max_unconsumed_steps=2),
    ),
    R(
        "__init__",
        "block_size is a str",
        TE,
        lambda f, c: OSR(block_size="4", max_unconsumed_steps=2),
    ),
    R(
        "__init__",
        "max_unconsumed_steps 0",
        IA,
        lambda f, c: OSR(block_size=4, max_unconsumed_steps=0),
    ),
    R(
        "__init__",
        "max_unconsumed_steps = 2**70",
        IA,
        lambda f, c: OSR(block_size=4, max_unconsumed_steps=2**70),
    ),
    R("set_recompute_refused", "not a bool", TE, lambda f, c: f("yes")),
    R("begin_step", "scheduler_output is None", TE, lambda f, c: f(None)),
    R(
        "begin_step",
        "a hit not block aligned",
        IA,
        lambda f, c: f(_so(new=[("c", 6)], scheduled={"c": 2})),
    ),
    R(
        "begin_step",
        "negative num_computed_tokens",
        IA,
        lambda f, c: f(_so(new=[("c", -4)], scheduled={"c": 2})),
    ),
    R(
        "begin_step",
        "num_scheduled_tokens is a list",
        IA,
        lambda f, c: f(_so(scheduled=[("c", 2)])),
    ),
    R("begin_step", "negative num_scheduled_tokens", IA, lambda f, c: f(_so(scheduled={"c": -1}))),
    R(
        "begin_step",
        "a request id that is an int",
        IA,
        lambda f, c: f(_so(new=[(5, 0)], scheduled={"c": 1})),
    ),
    R(
        "begin_step",
        "a finished id that is an int",
        IA,
        lambda f, c: f(_so(finished=[5], scheduled={})),
    ),
    R("lay_out", "a scheduled request missing from the batch", IA, lambda f, c: f([], 0)),
    R("lay_out", "num_tokens is not the step's", IA, lambda f, c: f(["a"], 3)),
    R("lay_out", "the batch names a request twice", IA, lambda f, c: f(["a", "a"], 2)),
    R("lay_out", "negative num_tokens", IA, lambda f, c: f(["a"], -1)),
    R("lay_out", "batch is None", TE, lambda f, c: f(None, 1)),
    R("lay_out", "no step begun", IA, lambda f, c: f(["a"], 1), idle),
    R("save", "another cache's plan", IA, lambda f, c: f(c.x["foreign"])),
    R("save", "a plan saved already", IA, lambda f, c: f(c.x["saved_plan"])),
    R("save", "plan is None", TE, lambda f, c: f(None)),
    R("save", "a hit past the step", IA, lambda f, c: f(c.t.lay_out(["a"], 1), hits=[5])),
    R(
        "save",
        "a miss at a negative position",
        IA,
        lambda f, c: f(c.t.lay_out(["a"], 1), misses=[-1]),
    ),
    R("save", "no room for another step", SI, lambda f, c: f(c.t.lay_out(["a"], 1)), full),
    R("check_room", "no room for another step", SI, lambda f, c: f(), full),
    R("materialize", "a request not in the step", UR, lambda f, c: f(c.x["step"], ["a", "zz"])),
    R(
        "materialize",
        "an unservable hit",
        UnservableHitError,
        lambda f, c: f(c.x["step"], ["a", "b"]),
    ),
    R("materialize", "another cache's step id", SI, lambda f, c: f(c.x["other_step"], ["a"])),
    R("materialize", "a step id never issued", SI, lambda f, c: f(2**62, ["a"])),
    R("materialize", "step id True", SI, lambda f, c: f(True, ["a"])),
    R("materialize", "step id is a str", SI, lambda f, c: f(str(c.x["step"]), ["a"])),
    R("materialize", "negative step id", SI, lambda f, c: f(-1, ["a"])),
    R("materialize", "step id = 2**70", SI, lambda f, c: f(2**70, ["a"])),
    R("materialize", "req_ids holds an int", IA, lambda f, c: f(c.x["step"], [5])),
    R("materialize", "a step id consumed already", SI, lambda f, c: f(c.x["consumed"], ["z"])),
    R("discard", "a step id consumed already", SI, lambda f, c: f(c.x["consumed"])),
    R("discard", "a step id never issued", SI, lambda f, c: f(2**62)),
    R("discard", "another cache's step id", SI, lambda f, c: f(c.x["other_step"])),
    R("discard", "step id is None", SI, lambda f, c: f(None)),
]

ACCEPTED = [
    A(
        "materialize",
        "no request ids",
        "consumes the step, as vllm-omni's materialize of an empty batch",
        lambda f, c: f(c.x["step"], []),
    ),
    A(
        "begin_step",
        "a finished id never seen",
        "vLLM finishes requests the worker never saw",
        lambda f, c: f(_so(finished=["nobody"], scheduled={"a": 1})),
    ),
    A(
        "begin_step",
        "num_computed_tokens None",
        "vLLM leaves it unset for a request without a hit: no hit",
        lambda f, c: f(_so(new=[("c", None)], scheduled={"c": 1})),
    ),
]

SURFACES = [
    Surface(
        S,
        classes=(OmniStepRules,),
        exempt={
            "unconsumed_steps": "no argument; a pure read of the outstanding step ids",
            "recomputing": "no argument; a pure read of the requests sent back",
            "take_invalid_blocks": "any step id is accepted: one with nothing to report "
            "(never saved, taken already, not an int) returns []",
        },
    ),
]
