"""Rows of the hidden-state mirror: ``hscache.hidden_states.HiddenStateCache`` (the torch
glue) and the Rust ``SlotMirror`` it drives (plan, commit, revalidate, block reads).

The state: request ``a`` wrote 11 rows into blocks 3, 7, 2 (block size 4) and a step that
schedules one more token of ``a`` is planned, not written. The fingerprint is the mirror's
counters, its request table, pending and last step, every block's version and written
rows, and the sum of the stored rows.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from hscache import exceptions as hx
from hscache._core import SlotMirror
from hscache.hidden_states import HiddenStateCache
from hscache_tools.testing.kv_cache import full_attention_config, kv_cache_config, sliding_window

from . import Ctx, Surface, makers

IA, BI, UR, TE = hx.InvalidArgumentError, hx.BlockIdError, hx.UnknownRequestError, TypeError
HUGE = 2**70
KEYS = {"h": (8, torch.float32)}


def _mirror_state(m: SlotMirror) -> Any:
    return (
        m.stats(),
        m.num_requests,
        m.pending_step,
        m.step_id,
        [m.block_state(b) for b in range(m.num_blocks)],
        m.block_table("a") if m.num_requests else None,
    )


def cache() -> Ctx:
    c = HiddenStateCache(16, 4, KEYS)
    plan = c.plan_step(new=[("a", [3, 7, 2], 0, 11)])
    reads = c.write(plan, {"h": torch.ones((11, 8))})
    pending = c.plan_step(running=[("a", [], 1)])
    other = HiddenStateCache(16, 4, KEYS)
    foreign = other.plan_step(new=[("z", [1], 0, 1)])
    return Ctx(
        c,
        lambda: (_mirror_state(c.mirror), c.tensor("h").sum().item()),
        {"plan": pending, "old_plan": plan, "reads": reads, "foreign": foreign},
    )


def mirror(pending: bool = True) -> Ctx:
    m = SlotMirror(num_blocks=16, block_size=4)
    p = m.plan(new=[("a", [3, 7, 2], 0, 11)])
    reads = m.commit(p[1], p[0])
    p2 = m.plan(running=[("a", [], 1)]) if pending else None
    other = SlotMirror(num_blocks=16, block_size=4)
    op = other.plan(new=[("z", [1], 0, 1)])
    return Ctx(
        m,
        lambda: _mirror_state(m),
        {"plan": p2, "reads": reads, "other_reads": other.commit(op[1], op[0])},
    )


def idle_mirror() -> Ctx:
    return mirror(pending=False)


def _write(c: Ctx, rows: Any, plan: Any = None) -> Any:
    return c.t.write(c.x["plan"] if plan is None else plan, {"h": rows})


def _new(c: Ctx, *entries: Any, **kw: Any) -> Any:
    """``plan_step(new=entries or [("b", [5], 0, 4)], **kw)``."""
    return c.t.plan_step(new=list(entries) or [("b", [5], 0, 4)], **kw)


def _so(**overrides: Any) -> Any:
    """A ``SchedulerOutput`` stand-in of an empty step, some fields overridden."""
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
    )
    fields = {
        "num_scheduled_tokens": {},
        "scheduled_new_reqs": [],
        "scheduled_cached_reqs": cached,
        "finished_req_ids": set(),
        "preempted_req_ids": None,
        "new_block_ids_to_zero": None,
        "kv_connector_metadata": None,
        **overrides,
    }
    return SimpleNamespace(**fields)


S, SM = "HiddenStateCache", "SlotMirror"
R, A = makers(S, cache)
RM, AM = makers(SM, mirror)
HSC = HiddenStateCache
SWA_ONLY = kv_cache_config([sliding_window(16, 64)], 32)

ROWS = [
    R("__init__", "num_blocks = 0", IA, lambda f, c: HSC(0, 4, KEYS)),
    R("__init__", "negative num_blocks", IA, lambda f, c: HSC(-1, 4, KEYS)),
    R("__init__", "num_blocks = 2**70", IA, lambda f, c: HSC(HUGE, 4, KEYS)),
    R("__init__", "num_blocks past 2**32", IA, lambda f, c: HSC(2**40, 4, KEYS)),
    R("__init__", "block_size 0", IA, lambda f, c: HSC(16, 0, KEYS)),
    R("__init__", "num_blocks is a str", TE, lambda f, c: HSC("16", 4, KEYS)),
    R("__init__", "no keys", IA, lambda f, c: HSC(16, 4, {})),
    R("__init__", "key width 0", IA, lambda f, c: HSC(16, 4, {"h": (0, torch.float32)})),
    R("__init__", "key dtype a str", IA, lambda f, c: HSC(16, 4, {"h": (8, "float32")})),
    R("__init__", "key name an int", IA, lambda f, c: HSC(16, 4, {5: (8, torch.float32)})),
    R(
        "__init__",
        "undeclared skip_layer_keys",
        IA,
        lambda f, c: HSC(16, 4, KEYS, skip_layer_keys=["x"]),
    ),
    R("__init__", "negative kv_cache_group", IA, lambda f, c: HSC(16, 4, KEYS, kv_cache_group=-1)),
    R("__init__", "unknown device", IA, lambda f, c: HSC(16, 4, KEYS, device="gpu7")),
    R(
        "from_kv_cache_config",
        "config is None",
        TE,
        lambda f, c: HSC.from_kv_cache_config(None, KEYS),
    ),
    R(
        "from_kv_cache_config",
        "no full-attention group",
        IA,
        lambda f, c: HSC.from_kv_cache_config(SWA_ONLY, KEYS),
    ),
    R(
        "from_kv_cache_config",
        "no keys",
        IA,
        lambda f, c: HSC.from_kv_cache_config(full_attention_config(8), {}),
    ),
    R("tensor", "an undeclared key", KeyError, lambda f, c: f("nope")),
    R("tensor", "key is an int", KeyError, lambda f, c: f(5)),
    R("plan_step", "negative num_computed_tokens", IA, lambda f, c: _new(c, ("b", [5], -1, 4))),
    R("plan_step", "block id past the pool", BI, lambda f, c: _new(c, ("b", [99], 0, 4))),
    R("plan_step", "block id -1", BI, lambda f, c: _new(c, ("b", [-1], 0, 4))),
    R("plan_step", "block id = 2**70", BI, lambda f, c: _new(c, ("b", [HUGE], 0, 4))),
    R("plan_step", "block ids are strs", IA, lambda f, c: _new(c, ("b", ["x"], 0, 4))),
    R("plan_step", "an entry that is not a tuple", IA, lambda f, c: f(new=["b"])),
    R("plan_step", "an entry of 3 fields", IA, lambda f, c: f(new=[("b", [5], 0)])),
    R("plan_step", "negative num_scheduled_tokens", IA, lambda f, c: _new(c, ("b", [5], 0, -1))),
    R("plan_step", "more tokens than the table holds", IA, lambda f, c: _new(c, ("b", [5], 0, 40))),
    R("plan_step", "unknown running request", UR, lambda f, c: f(running=[("nope", [], 1)])),
    R(
        "plan_step",
        "running: negative num_scheduled_tokens",
        IA,
        lambda f, c: f(running=[("a", [9], -1)]),
    ),
    R(
        "plan_step",
        "one request twice",
        IA,
        lambda f, c: _new(c, ("b", [5], 0, 4), ("b", [6], 0, 4)),
    ),
    R("plan_step", "finished id is an int", TE, lambda f, c: f(finished=[5])),
    R("plan_step", "order names an unscheduled request", IA, lambda f, c: _new(c, order=["zz"])),
    R("plan_step", "order names a request twice", IA, lambda f, c: _new(c, order=["b", "b"])),
    R("plan_step", "negative external_tokens", IA, lambda f, c: _new(c, external_tokens={"b": -1})),
    R(
        "plan_step",
        "external_tokens past the hit",
        IA,
        lambda f, c: _new(c, external_tokens={"b": 3}),
    ),
    R("plan_step", "external_tokens is a list", IA, lambda f, c: _new(c, external_tokens=[1])),
    R(
        "plan_step",
        "connector_versions: block -1",
        BI,
        lambda f, c: _new(c, connector_versions={-1: 0}),
    ),
    R("plan_step", "fresh_block_ids: block -1", BI, lambda f, c: _new(c, fresh_block_ids=[-1])),
    R(
        "plan_step",
        "negative num_prompt_tokens",
        IA,
        lambda f, c: _new(c, num_prompt_tokens={"b": -1}, fast_prefill=True),
    ),
    R(
        "plan_step",
        "negative spec_tokens",
        IA,
        lambda f, c: _new(c, spec_tokens={"b": -1}, fast_prefill=True),
    ),
    R(
        "plan_step",
        "num_reqs_padded below the requests",
        IA,
        lambda f, c: _new(c, fast_prefill=True, num_reqs_padded=0),
    ),
    R(
        "plan_step",
        "negative num_logits_padded",
        IA,
        lambda f, c: _new(c, fast_prefill=True, num_logits_padded=-1),
    ),
    R("update_from_scheduler_output", "scheduler_output is None", TE, lambda f, c: f(None)),
    R("update_from_scheduler_output", "scheduler_output is a str", TE, lambda f, c: f("step")),
    R(
        "update_from_scheduler_output",
        "num_scheduled_tokens is a list",
        IA,
        lambda f, c: f(_so(num_scheduled_tokens=[])),
    ),
    R(
        "update_from_scheduler_output",
        "no scheduled_cached_reqs",
        TE,
        lambda f, c: f(_so(scheduled_cached_reqs=None)),
    ),
    R(
        "update_from_scheduler_output",
        "new_block_ids_to_zero holds -1",
        BI,
        lambda f, c: f(_so(new_block_ids_to_zero=[-1])),
    ),
    R("write", "wrong dtype", IA, lambda f, c: _write(c, torch.zeros((1, 8), dtype=torch.int64))),
    R(
        "write",
        "numpy array instead of a tensor",
        IA,
        lambda f, c: _write(c, np.zeros((1, 8), np.float32)),
    ),
    R("write", "a list instead of a tensor", IA, lambda f, c: _write(c, [[0.0] * 8])),
    R("write", "missing key", IA, lambda f, c: f(c.x["plan"], {})),
    R("write", "too few rows", IA, lambda f, c: _write(c, torch.zeros((0, 8)))),
    R("write", "wrong width", IA, lambda f, c: _write(c, torch.zeros((1, 9)))),
    R("write", "one-dimensional rows", IA, lambda f, c: _write(c, torch.zeros(8))),
    R(
        "write",
        "a plan already written",
        IA,
        lambda f, c: _write(c, torch.zeros((11, 8)), c.x["old_plan"]),
    ),
    R(
        "write",
        "another cache's plan",
        IA,
        lambda f, c: _write(c, torch.zeros((1, 8)), c.x["foreign"]),
    ),
    R("write", "plan is None", TE, lambda f, c: f(None, {"h": torch.zeros((1, 8))})),
    R("write", "outputs is None", TE, lambda f, c: f(c.x["plan"], None)),
    R(
        "write_and_gather",
        "wrong dtype",
        IA,
        lambda f, c: f(c.x["plan"], {"h": torch.zeros((1, 8), dtype=torch.float64)}),
    ),
    R("write_and_gather", "missing key", IA, lambda f, c: f(c.x["plan"], {})),
    R(
        "write_and_gather",
        "a plan already written",
        IA,
        lambda f, c: f(c.x["old_plan"], {"h": torch.zeros((11, 8))}),
    ),
    R("commit", "plan is None", TE, lambda f, c: f(None)),
    R("commit", "a plan already written", IA, lambda f, c: f(c.x["old_plan"])),
    R("commit", "another cache's plan", IA, lambda f, c: f(c.x["foreign"])),
    R(
        "write_committed",
        "reads of another step",
        IA,
        lambda f, c: f(c.x["plan"], c.x["reads"], {"h": torch.zeros((1, 8))}),
    ),
    R(
        "write_committed",
        "reads is None",
        TE,
        lambda f, c: f(c.x["plan"], None, {"h": torch.zeros((1, 8))}),
    ),
    R("gather", "reads of another step", IA, lambda f, c: f(c.x["plan"], c.x["reads"])),
    R("gather", "reads is None", TE, lambda f, c: f(c.x["plan"], None)),
    R("gather", "plan is None", TE, lambda f, c: f(None, c.x["reads"])),
    # SlotMirror
    RM("__init__", "num_blocks = 0", IA, lambda f, c: SlotMirror(num_blocks=0, block_size=4)),
    RM("__init__", "block_size 0", IA, lambda f, c: SlotMirror(num_blocks=4, block_size=0)),
    RM(
        "__init__",
        "negative kv_cache_group",
        IA,
        lambda f, c: SlotMirror(num_blocks=4, block_size=4, kv_cache_group=-1),
    ),
    RM(
        "__init__", "num_blocks = 2**70", IA, lambda f, c: SlotMirror(num_blocks=HUGE, block_size=4)
    ),
    RM(
        "__init__",
        "num_blocks past 2**32",
        IA,
        lambda f, c: SlotMirror(num_blocks=2**40, block_size=4),
    ),
    RM("plan", "new is a str", IA, lambda f, c: f(new="abc")),
    RM("plan", "an entry of 3 fields", IA, lambda f, c: f(new=[("b", [5], 0)])),
    RM("plan", "unknown running request", UR, lambda f, c: f(running=[("zz", [], 1)])),
    RM("plan", "block id -1", BI, lambda f, c: f(new=[("b", [-1], 0, 4)])),
    RM("plan", "order holds an int", IA, lambda f, c: f(new=[("b", [5], 0, 4)], order=[5])),
    RM(
        "plan",
        "negative num_logits_padded",
        IA,
        lambda f, c: f(new=[("b", [5], 0, 4)], fast_prefill=True, num_logits_padded=-1),
    ),
    RM("plan_scheduler_output", "scheduler_output is None", TE, lambda f, c: f(None)),
    RM("plan_scheduler_output", "an object without its fields", TE, lambda f, c: f(object())),
    RM(
        "plan_scheduler_output",
        "negative num_logits_padded",
        IA,
        lambda f, c: f(_so(), fast_prefill=True, num_logits_padded=-1),
    ),
    RM("commit", "not the pending step", IA, lambda f, c: f(c.x["plan"][1] + 5, c.x["plan"][0])),
    RM("commit", "another mirror's id", IA, lambda f, c: f(c.x["plan"][1], c.x["plan"][0] + 999)),
    RM("commit", "negative step id", IA, lambda f, c: f(-1, c.x["plan"][0])),
    RM("commit", "step id is a str", TE, lambda f, c: f("1", c.x["plan"][0])),
    RM("commit", "no step pending", IA, lambda f, c: f(c.t.step_id, c.t.mirror_id), idle_mirror),
    RM("revalidate", "another mirror's reads", IA, lambda f, c: f(c.x["other_reads"])),
    RM("revalidate", "reads is None", TE, lambda f, c: f(None)),
    RM("block_state", "block id -1", BI, lambda f, c: f(-1)),
    RM("block_state", "block id past the pool", BI, lambda f, c: f(16)),
    RM("block_state", "block id = 2**70", BI, lambda f, c: f(HUGE)),
    RM("block_skip_rows", "block id past the pool", BI, lambda f, c: f(99)),
    RM("block_skip_rows", "block id is a str", TE, lambda f, c: f("1")),
    RM("block_table", "unknown request", UR, lambda f, c: f("zz")),
    RM("block_table", "request id is an int", TE, lambda f, c: f(5)),
    RM("num_computed_tokens", "unknown request", UR, lambda f, c: f("zz")),
    RM("num_computed_tokens", "request id is an int", TE, lambda f, c: f(5)),
]

ACCEPTED = [
    A(
        "write",
        "a non-contiguous tensor",
        "index_copy_ takes any layout",
        lambda f, c: _write(c, torch.zeros((8, 1)).t()),
    ),
    A(
        "write",
        "an undeclared extra key",
        "only declared keys are stored",
        lambda f, c: f(c.x["plan"], {"h": torch.zeros((1, 8)), "x": torch.zeros(1)}),
    ),
    A(
        "write",
        "more rows than planned",
        "CUDA-graph padding, cut",
        lambda f, c: _write(c, torch.zeros((4, 8))),
    ),
    A(
        "plan_step",
        "finishing an unknown request",
        "vLLM sends ids the worker never saw",
        lambda f, c: f(finished=["nope"]),
    ),
    A(
        "plan_step",
        "a new plan while one is pending",
        "the unwritten step is dropped (aborted)",
        lambda f, c: _new(c),
    ),
    AM("plan_scheduler_output", "an empty step", "nothing scheduled", lambda f, c: f(_so())),
]

_READS = "no argument; a pure read that refuses only on a mirror poisoned by an internal panic "
_READS += "(fault-injection build: tests/robustness/test_panic_python.py)"
SURFACES = [
    Surface(
        S,
        classes=(HiddenStateCache,),
        exempt={
            "stats": _READS,
            "memory_bytes": "no argument; sizes of the tensors allocated at construction",
            "bytes_per_token": "no argument; arithmetic on the declared keys",
        },
    ),
    Surface(SM, classes=(SlotMirror,), exempt={"stats": _READS}),
]
