"""Stateful fuzzing: a Hypothesis ``RuleBasedStateMachine`` drives vLLM's own
``KVCacheManager`` and hscache's ``hscache.vllm.KVCacheManager`` with the same operations.

Each rule is a scheduler-like step (a new request; admission with a prefix-cache lookup and
``allocate_slots`` with the hit; a decode or prefill-chunk step that caches blocks; finish;
preemption = free + re-admission with a fresh lookup; ``reset_prefix_cache``;
``evict_blocks``; ``take_events``; usage and stats probes). Every call goes through the
differential harness's :class:`vllm_diff.Pair`, which compares the return values (block ids
and identities), the KV events after every call, the pool, free queue and block tables after
every call, and every block, the prefix-cache index and the running stats every few calls.
After every rule hscache's ``check_invariants()`` runs too.

The machine runs on the full-attention layout and on hybrid layouts (full attention +
sliding window; full attention + Mamba in align mode), each with another hash algorithm.
The cost is bounded for CI (~60-90 s for all); ``HSCACHE_STATEFUL_EXAMPLES`` (examples per
layout) and ``HSCACHE_STATEFUL_STEPS`` (rules per example) make a long run. Every operation
executed (manager calls and request updates, on the pair) is counted; the total is printed
(``pytest -s``) and written to ``$HSCACHE_STATEFUL_REPORT`` when that is set.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests import vllm_diff as diff
from tests.vllm_diff import mutants

pytestmark = pytest.mark.vllm

EXAMPLES = int(os.environ.get("HSCACHE_STATEFUL_EXAMPLES", "0"))
STEPS = int(os.environ.get("HSCACHE_STATEFUL_STEPS", "120"))
PLACEHOLDER = 9999  # multimodal placeholder token

# layout, hash algorithm, pool size, CI examples (the cheap full-attention case runs most)
LAYOUTS = [
    ("fa:4", "sha256", 24, 400),
    ("fa:4+swa:4:w=8", "xxhash", 32, 250),
    ("fa:4+mamba:4:mode=align", "sha256_cbor", 32, 150),
]

OPS: dict[str, int] = {}

# Prompts share system prefixes, so that lookups hit (and salts / LoRA / images split them).
SYSTEM_PROMPTS = [list(range(100, 112)), list(range(200, 206)), list(range(100, 104))]


def _report() -> None:
    total = sum(OPS.values())
    print(f"\nstateful ops executed: {total} ({OPS})")
    path = os.environ.get("HSCACHE_STATEFUL_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"total": total, "per_layout": OPS}, f)


class ManagerPair(RuleBasedStateMachine):
    """Both managers under the same scheduler-like operations (see the module doc)."""

    layout = "fa:4"
    hash_fn = "sha256"
    num_blocks = 24
    mamba = False
    candidate: type | None = None  # None: hscache's manager (vllm_diff.load_candidate)

    def __init__(self) -> None:
        super().__init__()
        cfg = diff.TraceConfig(
            layout=self.layout,
            num_blocks=self.num_blocks,
            max_model_len=48,
            hash_fn=self.hash_fn,
            p_external=0.0,
            enable_events=True,
            events_every_call=True,
            deep_every=3,
        )
        self.cfg = cfg
        self.p = diff.Pair(cfg, self.candidate or diff.load_candidate(), seed="hypothesis")
        self.sbs = cfg.sched_block
        self.next_id = 0
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.max_tokens: dict[str, int] = {}
        self.actions_seen = 0

    # -- helpers --------------------------------------------------------------------------
    def _set(self, rid: str, attr: str, value: Any) -> None:
        self.p.do(["set", rid, attr, value])

    def _count(self) -> None:
        n = len(self.p.actions)
        OPS[self.layout] = OPS.get(self.layout, 0) + n - self.actions_seen
        self.actions_seen = n

    def _chunk(self, rid: str, n: int, hit: int = 0) -> int:
        """Mamba align mode schedules prefill chunks in whole blocks (as the Scheduler)."""
        req = self.p.req(rid)
        if not self.mamba or req.num_computed_tokens + hit + n >= req.num_tokens:
            return n
        return (n // self.sbs) * self.sbs

    def _release(self, rid: str, status: str) -> None:
        self._set(rid, "status", status)
        self.p.call("free", rid=rid)

    def _advance(self, rid: str, n: int) -> None:
        """The model ran ``n`` tokens of ``rid``: advance, sample a token, stop checks."""
        req = self.p.req(rid)
        new_c = req.num_computed_tokens + n
        self._set(rid, "num_computed_tokens", new_c)
        if new_c < req.num_tokens:
            return  # a prefill chunk
        self.p.do(["append", rid, [300 + (self.next_id * 7 + new_c) % 50]])
        if req.num_tokens >= self.cfg.max_model_len or req.num_output_tokens >= req.max_tokens:
            self.running.remove(rid)
            self._release(rid, "FINISHED_LENGTH_CAPPED")

    # -- rules ----------------------------------------------------------------------------
    @precondition(lambda self: len(self.waiting) + len(self.running) < 6)
    @rule(
        system=st.sampled_from([None, 0, 1, 2]),
        suffix=st.lists(st.integers(1, 12), max_size=10),
        salt=st.sampled_from([None, None, None, "s1", "s2"]),
        lora=st.sampled_from([None, None, None, ("loraA", 1, "/a"), ("loraB", 2, "/b")]),
        image=st.sampled_from([None, None, "img_a", "img_b"]),
        max_tokens=st.integers(1, 12),
    )
    def new_request(
        self,
        system: int | None,
        suffix: list[int],
        salt: str | None,
        lora: tuple | None,
        image: str | None,
        max_tokens: int,
    ) -> None:
        prompt = (SYSTEM_PROMPTS[system] if system is not None else []) + suffix
        if not prompt:
            prompt = [1]
        rid = f"r{self.next_id}"
        self.next_id += 1
        spec: dict[str, Any] = {"rid": rid, "prompt": prompt, "arrival": float(self.next_id)}
        if salt:
            spec["salt"] = salt
        if lora:
            spec["lora"] = lora
        if image and len(prompt) >= 4:
            spec["mm"] = [("image", image, 1, 3)]
            spec["prompt"] = [prompt[0], PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, *prompt[4:]]
        spec["max_tokens"] = max(1, min(max_tokens, self.cfg.max_model_len - len(prompt)))
        self.p.do(["new", spec])
        self.waiting.append(rid)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), budget=st.integers(1, 24))
    def admit(self, data: st.DataObject, budget: int) -> None:
        rid = data.draw(st.sampled_from(self.waiting))
        req = self.p.req(rid)
        _, hit, boundary = self.p.call("get_computed_blocks", rid=rid)
        if boundary != req.shared_prefix_boundary:
            self._set(rid, "shared_prefix_boundary", boundary)
        n = self._chunk(rid, min(req.num_tokens - hit, budget), hit)
        if n == 0:
            return
        kw = {"num_new_computed_tokens": hit, "has_scheduled_reqs": bool(self.running)}
        if self.p.call("allocate_slots", rid=rid, n=n, hit="hit", kw=kw) is None:
            return  # stays waiting
        self.p.call("record_prefix_cache_stats", rid=rid, hits=hit)
        self.waiting.remove(rid)
        self.running.append(rid)
        if hit:
            self._set(rid, "num_computed_tokens", hit)
        self._set(rid, "status", "RUNNING")
        self._advance(rid, n)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), budget=st.integers(1, 24))
    def step(self, data: st.DataObject, budget: int) -> None:
        """One scheduled step of a running request (decode, or the next prefill chunk);
        no room preempts it, as the Scheduler preempts (here: the request itself)."""
        rid = data.draw(st.sampled_from(self.running))
        req = self.p.req(rid)
        n = self._chunk(rid, min(req.num_tokens - req.num_computed_tokens, budget))
        if n == 0:
            return
        if self.p.call("allocate_slots", rid=rid, n=n) is None:
            self._preempt(rid)
            return
        self._advance(rid, n)

    def _preempt(self, rid: str) -> None:
        self.running.remove(rid)
        self.p.call("free", rid=rid)
        self._set(rid, "status", "PREEMPTED")
        self._set(rid, "num_computed_tokens", 0)
        self._set(rid, "num_preemptions", self.p.req(rid).num_preemptions + 1)
        self.waiting.insert(0, rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._preempt(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), aborted=st.booleans())
    def finish(self, data: st.DataObject, aborted: bool) -> None:
        rid = data.draw(st.sampled_from(self.running))
        self.running.remove(rid)
        self._release(rid, "FINISHED_ABORTED" if aborted else "FINISHED_STOPPED")

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(rid)
        self._release(rid, "FINISHED_ABORTED")

    @rule(preempt_all=st.booleans())
    def reset_prefix_cache(self, preempt_all: bool) -> None:
        if preempt_all:  # reset_prefix_cache(reset_running_requests=True)
            for rid in list(reversed(self.running)):
                self._preempt(rid)
        self.p.call("reset_prefix_cache")

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        hashed = [
            b.block_id
            for b in self.p.ref.mgr.block_pool.blocks
            if b.block_hash is not None and not b.is_null
        ]
        any_id = st.integers(1, self.num_blocks - 1)
        ids = data.draw(
            st.lists(st.sampled_from(hashed) if hashed else any_id, max_size=3)
            | st.lists(any_id, max_size=2)
        )
        self.p.call("evict_blocks", ids=sorted(set(ids)))

    @rule(
        what=st.sampled_from(["take_events", "usage", "make_prefix_cache_stats", "new_step_starts"])
    )
    def probe(self, what: str) -> None:
        self.p.call(what)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def probe_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.running))
        what = data.draw(
            st.sampled_from(
                [
                    "get_block_ids",
                    "get_blocks",
                    "estimate_cached_tokens",
                    "get_num_common_prefix_blocks",
                ]
            )
        )
        self.p.call(what, rid=rid)

    # -- after every rule -------------------------------------------------------------
    def _check(self) -> None:
        self.p.check_state(deep=True)
        check = getattr(self.p.cand.mgr, "check_invariants", None)  # mutants: vLLM's, none
        if self.candidate is None or check is not None:
            self.p.cand.mgr.check_invariants()
        self._count()

    @invariant()
    def same_state_and_invariants(self) -> None:
        self._check()

    def teardown(self) -> None:
        for rid in list(self.running):
            self.running.remove(rid)
            self._release(rid, "FINISHED_ABORTED")
        self._check()


@pytest.mark.parametrize(("layout", "hash_fn", "num_blocks", "examples"), LAYOUTS)
def test_stateful_pair(layout: str, hash_fn: str, num_blocks: int, examples: int) -> None:
    machine = type(
        "ManagerPair_" + layout.replace(":", "_").replace("+", "_").replace("=", ""),
        (ManagerPair,),
        {
            "layout": layout,
            "hash_fn": hash_fn,
            "num_blocks": num_blocks,
            "mamba": "mamba" in layout,
        },
    )
    before = OPS.get(layout, 0)
    t0 = time.perf_counter()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES or examples,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=os.environ.get("HSCACHE_STATEFUL_RANDOM") != "1",
        ),
    )
    ops = OPS.get(layout, 0) - before
    print(f"\n{layout} [{hash_fn}]: {ops} ops in {time.perf_counter() - t0:.1f} s")
    _report()
    assert ops > 0


@pytest.mark.parametrize(
    "mutant",
    [
        mutants.FreeForwardOrder,
        mutants.HitOneBlockShort,
        mutants.DropRemovedEvents,
        mutants.EvictIsNoop,
        mutants.StatsIgnorePreemption,
    ],
    ids=lambda m: m.__name__,
)
def test_stateful_machine_catches_mutants(mutant: type) -> None:
    """The machine notices a deliberately wrong manager (vLLM's, with one bug)."""
    machine = type("ManagerPair_" + mutant.__name__, (ManagerPair,), {"candidate": mutant})
    with pytest.raises(diff.Divergence):
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=200,
                stateful_step_count=STEPS,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                database=None,
                derandomize=True,
                phases=[Phase.generate],
            ),
        )
