"""HiSparse layouts, differentially: vLLM's ``KVCacheManager`` bound to vLLM's
``HiSparseCoordinator`` against hscache's, on the same seeded random traces.

A trace plays a Scheduler plus a HiSparse connector over a small device pool and a
smaller host pool: admissions with prefix hits (shared prompt prefixes), chunked
prefills, decode steps, external host imports that finish or fail, the connector's
per-step calls (``advance_scheduled``, ``build_offload_command``, residency updates,
row mirrors, ``all_context_pages_resident``), worker acknowledgements (partial, several
workers), finished and preempted requests (freed at once or deferred through
``pop_blocks_for_free``), device-pool pressure that reuses unpinned pages, evictions on
both pools and prefix-cache resets, with KV events on. After every call the test
compares its answer and everything observable: per-group block tables, residency rows,
both pools' free-queue orders, ref counts and hashes, KV events, prefix-cache stats and
the coordinator's state (request states, pending spills, GPU copies, hot requirements,
pending work).

``HSCACHE_HISPARSE_TRACES`` / ``HSCACHE_HISPARSE_OPS`` scale the run.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from hscache.vllm import KVCacheManager
from hscache_tools.testing import kv_cache as kc
from hscache_tools.testing.manager import build_manager
from hscache_tools.testing.requests import init_none_hash, make_request
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
from vllm.v1.request import Request, RequestStatus

pytestmark = pytest.mark.vllm

BS = 16
NUM_TRACES = int(os.environ.get("HSCACHE_HISPARSE_TRACES", "24"))
NUM_OPS = int(os.environ.get("HSCACHE_HISPARSE_OPS", "160"))


class Side:
    """One manager, its HiSparse coordinator, and its own request objects."""

    def __init__(self, cls: type, config: Any, **kwargs: Any) -> None:
        self.manager = build_manager(cls, config, hash_block_size=BS, **kwargs)
        self.coord = get_hisparse_coordinator(self.manager)
        self.requests: dict[str, Request] = {}
        self.held: list[Any] = []
        self.deferred: list[list[Any]] = []
        self.importing: dict[str, int] = {}
        self.lookups: dict[str, Any] = {}

    # -- observation ------------------------------------------------------------------

    def observe(self) -> dict[str, Any]:
        m, c = self.manager, self.coord
        host = c.get_host_block_pool()
        out: dict[str, Any] = {
            "free": [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()],
            "host_free": [b.block_id for b in host.free_block_queue.get_all_free_blocks()],
            "ref": [b.ref_cnt for b in m.block_pool.blocks],
            "hash": [b.block_hash for b in m.block_pool.blocks],
            "host_ref": [b.ref_cnt for b in host.blocks],
            "host_hash": [b.block_hash for b in host.blocks],
            "usage": m.usage,
            "tables": {rid: m.get_block_ids(rid) for rid in sorted(self.requests)},
            "rows": {
                rid: [[b.block_id for b in r.get_residency_row(rid)] for r in c.resident_managers]
                for rid in sorted(self.requests)
            },
            "hot_required": [sorted(h.hot_required) for h in c.hot_managers],
            "states": {rid: _state(s) for rid, s in sorted(c.request_states.items())},
            "pending": {
                i: (
                    p.page,
                    p.host_block.block_id,
                    [b.block_id for b in p.resident_blocks],
                    p.restore,
                    p.expected_worker_completions,
                    p.worker_completions,
                    p.enqueue_applied,
                    None if p.request_state is None else _state(p.request_state),
                )
                for i, p in c.pending_spills.items()
            },
            "copies": {k: [b.block_id for b in v] for k, v in c.copies.items()},
            "work": c.has_pending_work(),
            "reclaim": c.has_pending_reclamation(),
            "next_spill": c.next_spill_id,
        }
        return out

    def events(self) -> list[Any]:
        return list(self.manager.take_events())

    def stats(self) -> Any:
        s = self.manager.make_prefix_cache_stats()
        return None if s is None else (s.requests, s.queries, s.hits, s.preempted_requests)


def _state(s: Any) -> tuple[Any, ...]:
    p = s.publication
    pub = None
    if p is not None:
        detached = None if p.detached_blocks is None else [b.block_id for b in p.detached_blocks]
        pub = (p.num_computed_tokens, p.num_pages, detached, p.num_cached_blocks)
    return (
        sorted(s.valid_pages),
        s.ready_prefix_pages,
        dict(s.pending_pages),
        s.copies_recorded_blocks,
        sorted(s.pinned_clean),
        sorted(s.unpinned_pages),
        s.pages_to_adopt,
        s.synced_pages,
        sorted(s.stale_pages),
        pub,
    )


def _ids(result: Any) -> Any:
    """A call's answer with block objects replaced by their ids."""
    if result is None or isinstance(result, (bool, int, float, str)):
        return result
    if hasattr(result, "get_block_ids"):
        return result.get_block_ids()
    if hasattr(result, "block_id"):
        return result.block_id
    if hasattr(result, "page_transfers"):
        return [_ids(t) for t in result.page_transfers]
    if isinstance(result, dict):
        return {k: _ids(v) for k, v in result.items()}
    if isinstance(result, (list, tuple)):
        return [_ids(x) for x in result]
    return result


class Trace:
    """Both sides in lock-step (see module docs)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        r = self.rng
        self.num_blocks = r.choice([14, 20, 28, 40])
        self.host_blocks = r.choice([8, 12, 18, 30])
        self.groups = r.choice([1, 1, 2])
        config_args = dict(num_resident_groups=self.groups, blocks_per_request=r.choice([1, 2]))
        kwargs = dict(
            max_model_len=r.choice([128, 192]),
            max_in_flight_tokens=r.choice([None, 4 * BS, 8 * BS]),
            enable_caching=r.random() < 0.85,
            num_prefill_lookahead=r.choice([0, 0, 3]),
            enable_kv_cache_events=True,
            log_stats=True,
        )
        self.max_model_len = kwargs["max_model_len"]
        self.sides = [
            Side(
                cls,
                kc.hisparse_config(self.num_blocks, self.host_blocks, **config_args),
                **kwargs,
            )
            for cls in (VllmKVCacheManager, KVCacheManager)
        ]
        self.prefixes = [[r.randrange(1000) for _ in range(r.choice([16, 32, 48]))] for _ in "ab"]
        self.next_id = 0
        # rid -> "running" | "importing" (imports wait for finish_host_import)
        self.status: dict[str, str] = {}
        self.transfers: list[int] = []
        self.log: list[str] = []

    # -- lock-step ------------------------------------------------------------------

    def both(self, what: str, fn: Any) -> Any:
        """``fn(side)`` on both sides (never drawing from the trace's random stream);
        answers (or exception types) must agree. The answer, block ids for blocks."""
        self.log.append(what)
        answers = []
        for side in self.sides:
            try:
                answers.append(("ok", _ids(fn(side))))
            except Exception as e:
                answers.append(("raise", f"{type(e).__name__}: {e}"))
        assert answers[0] == answers[1], self._where(f"{what}: {answers[0]} != {answers[1]}")
        status, value = answers[0]
        assert status == "ok", self._where(f"{what} raised {value} on both sides")
        return value

    def check(self) -> None:
        a, b = (s.observe() for s in self.sides)
        for key in a:
            assert a[key] == b[key], self._where(f"{key}: vLLM {a[key]} != hscache {b[key]}")
        ea, eb = (s.events() for s in self.sides)
        assert ea == eb, self._where(f"events: vLLM {ea} != hscache {eb}")
        sa, sb = (s.stats() for s in self.sides)
        assert sa == sb, self._where(f"stats: {sa} != {sb}")

    def _where(self, msg: str) -> str:
        return msg + "\nlast calls:\n  " + "\n  ".join(self.log[-12:])

    def req(self, side: Side, rid: str) -> Request:
        return side.requests[rid]

    # -- operations -------------------------------------------------------------------

    def admit(self) -> None:
        r = self.rng
        waiting = [rid for rid, s in self.status.items() if s == "waiting"]
        if waiting and r.random() < 0.5:
            rid = r.choice(waiting)
        else:
            rid = f"r{self.next_id}"
            self.next_id += 1
            tokens = list(r.choice(self.prefixes)) if r.random() < 0.7 else []
            tokens += [r.randrange(1000) for _ in range(r.randrange(1, 3 * BS))]
            tokens = tokens[: self.max_model_len - 8]
            for side in self.sides:
                side.requests[rid] = make_request(rid, tokens, max_tokens=64, hash_block_size=BS)
            self.status[rid] = "waiting"

        def lookup(s: Side) -> Any:
            s.lookups[rid] = s.manager.get_computed_blocks(self.req(s, rid))
            return s.lookups[rid]

        num_local = self.both(f"get_computed_blocks({rid})", lookup)[1]
        num_tokens = self.req(self.sides[0], rid).num_tokens
        remaining = num_tokens - num_local
        if r.random() < 0.25 and remaining > 1:
            ext = r.randrange(1, remaining)
            got = self.both(
                f"import({rid}, local={num_local}, ext={ext})",
                lambda s: s.manager.allocate_slots(
                    self.req(s, rid),
                    0,
                    num_new_computed_tokens=num_local,
                    new_computed_blocks=s.lookups[rid][0],
                    num_external_computed_tokens=ext,
                    delay_cache_blocks=True,
                    full_sequence_must_fit=True,
                ),
            )
            if got is not None:
                self.status[rid] = "importing"
                self._record_stats(rid, num_local)
                for side in self.sides:
                    side.importing[rid] = num_local + ext
            return
        chunk = min(remaining, r.choice([BS, 2 * BS, 3 * BS, remaining]))
        must_fit = r.random() < 0.3
        got = self.both(
            f"allocate_slots({rid}, new={chunk}, local={num_local})",
            lambda s: s.manager.allocate_slots(
                self.req(s, rid),
                chunk,
                num_new_computed_tokens=num_local,
                new_computed_blocks=s.lookups[rid][0],
                full_sequence_must_fit=must_fit,
            ),
        )
        if got is None:
            return
        self.status[rid] = "running"
        self._record_stats(rid, num_local)
        self._scheduled([(rid, num_local, chunk)])

    def _record_stats(self, rid: str, num_local: int) -> None:
        self.both(
            f"record_prefix_cache_stats({rid}, {num_local})",
            lambda s: s.manager.record_prefix_cache_stats(self.req(s, rid), num_local),
        )

    def _scheduled(self, entries: list[tuple[str, int, int]]) -> None:
        """The requests a step scheduled: `(rid, computed before, scheduled)`."""
        for side in self.sides:
            for rid, start, count in entries:
                req = self.req(side, rid)
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = start + count
        pairs = [
            (rid, min(start + count, self.req(self.sides[0], rid).num_tokens))
            for rid, start, count in entries
        ]
        self.both(f"advance_scheduled({pairs})", lambda s: s.coord.advance_scheduled(pairs))
        triples = [(rid, start, count) for rid, start, count in entries]
        self.both(
            "all_context_pages_resident", lambda s: s.coord.all_context_pages_resident(triples)
        )
        self.both(
            "build_row_mirrors",
            lambda s: [
                (m.source_starts, m.destination_start, m.num_rows)
                for m in s.coord.build_row_mirrors(triples)
            ],
        )
        rids = [rid for rid, _, _ in entries]
        self.both(
            "take_residency_updates",
            lambda s: {
                k: (u.pages, [list(x) for x in u.block_ids])
                for k, u in s.coord.take_residency_updates(rids).items()
            },
        )
        command = self.both("build_offload_command", lambda s: s.coord.build_offload_command())
        if command:
            self.transfers.extend(t.transfer_id for t in command)
        # Decode: a request that computed its whole sequence samples a token.
        token = self.rng.randrange(1000)
        for rid, _, _ in entries:
            req0 = self.req(self.sides[0], rid)
            full = req0.num_computed_tokens == req0.num_tokens
            if full and req0.num_tokens < self.max_model_len - 8:
                for side in self.sides:
                    self.req(side, rid).append_output_token_ids(token)

    def step(self) -> None:
        r = self.rng
        running = [rid for rid, s in self.status.items() if s == "running"]
        if not running:
            return
        entries = []
        for rid in r.sample(running, r.randint(1, len(running))):
            req0 = self.req(self.sides[0], rid)
            todo = req0.num_tokens - req0.num_computed_tokens
            if todo <= 0:
                continue
            n = min(todo, r.choice([1, BS, 2 * BS]))
            fits = req0.num_computed_tokens + n + 2 <= self.max_model_len
            la = r.choice([0, 0, 2]) if fits else 0
            start = req0.num_computed_tokens
            got = self.both(
                f"allocate_slots({rid}, new={n}, lookahead={la})",
                lambda s, rid=rid, n=n, la=la: s.manager.allocate_slots(
                    self.req(s, rid), n, num_lookahead_tokens=la
                ),
            )
            if got is None:
                self.finish(rid, preempt=True)
                continue
            entries.append((rid, start, n))
        if entries:
            self._scheduled(entries)

    def ack(self) -> None:
        r = self.rng
        if not self.transfers:
            return
        picked = r.sample(self.transfers, r.randint(1, len(self.transfers)))
        workers = r.choice([1, 1, 2])
        enqueued = {t: workers for t in picked}
        completed = {t: r.choice([workers, workers, workers - 1]) for t in picked}
        completed = {t: n for t, n in completed.items() if n}
        self.both(
            f"update_spills({enqueued}, {completed})",
            lambda s: s.coord.update_spills(enqueued, completed),
        )
        done = {t for t in picked if completed.get(t, 0) >= workers}
        self.transfers = [t for t in self.transfers if t not in done]
        if r.random() < 0.5:
            late = {t: workers - completed.get(t, 0) for t in picked if t not in done}
            if late:
                self.both(f"update_spills(late {late})", lambda s: s.coord.update_spills({}, late))
                self.transfers = [t for t in self.transfers if t not in late]

    def finish_import(self) -> None:
        r = self.rng
        importing = [rid for rid, s in self.status.items() if s == "importing"]
        if not importing:
            return
        rid = r.choice(importing)
        failed = r.random() < 0.25
        self.both(
            f"finish_host_import({rid}, failed={failed})",
            lambda s: s.coord.finish_host_import(rid, failed=failed),
        )
        if failed:
            self.finish(rid, preempt=False)
            return
        for side in self.sides:
            req = self.req(side, rid)
            req.num_computed_tokens = min(side.importing.pop(rid), req.num_tokens - 1)
        n = self.req(self.sides[0], rid).num_computed_tokens
        self.both(
            f"cache_blocks({rid}, {n})", lambda s: s.manager.cache_blocks(self.req(s, rid), n)
        )
        self.status[rid] = "running"

    def finish(self, rid: str | None = None, preempt: bool | None = None) -> None:
        r = self.rng
        if rid is None:
            live = [x for x, s in self.status.items() if s in ("running", "importing")]
            if not live:
                return
            rid = r.choice(live)
        if preempt is None:
            preempt = r.random() < 0.4
        deferred = r.random() < 0.3
        for side in self.sides:
            req = self.req(side, rid)
            req.status = RequestStatus.PREEMPTED if preempt else RequestStatus.FINISHED_STOPPED
            side.importing.pop(rid, None)
        if deferred:
            got = self.both(
                f"pop_blocks_for_free({rid})",
                lambda s: (
                    s.deferred.append(s.manager.pop_blocks_for_free(self.req(s, rid)))
                    or s.deferred[-1]
                ),
            )
            assert got is not None
        else:
            self.both(f"free({rid})", lambda s: s.manager.free(self.req(s, rid)))
        for side in self.sides:
            self.req(side, rid).num_computed_tokens = 0
        if preempt:
            self.status[rid] = "waiting"
        else:
            del self.status[rid]
            for side in self.sides:
                del side.requests[rid]

    def flush_deferred(self) -> None:
        if not self.sides[0].deferred:
            return
        self.both(
            "block_pool.free_blocks(reversed(deferred))",
            lambda s: s.manager.block_pool.free_blocks(reversed(s.deferred.pop(0))),
        )

    def pressure(self) -> None:
        r = self.rng
        side0 = self.sides[0]
        free = side0.manager.block_pool.get_num_free_blocks()
        if side0.held and (r.random() < 0.5 or free == 0):
            self.both("free(held)", lambda s: s.manager.block_pool.free_blocks(s.held))
            for side in self.sides:
                side.held = []
        elif free:
            k = r.randint(1, free)
            self.both(
                f"get_new_blocks({k})",
                lambda s: s.held.extend(s.manager.block_pool.get_new_blocks(k)),
            )

    def evict(self) -> None:
        r = self.rng
        host = r.random() < 0.5
        n = self.host_blocks if host else self.num_blocks
        ids = {r.randrange(1, n) for _ in range(r.randint(1, 3))}
        if host:
            self.both(
                f"host evict {ids}", lambda s: s.coord.get_host_block_pool().evict_blocks(ids)
            )
        else:
            self.both(f"evict {ids}", lambda s: s.manager.evict_blocks(ids))

    def misc(self) -> None:
        r = self.rng
        choice = r.random()
        running = [rid for rid, s in self.status.items() if s == "running"]
        if choice < 0.3:
            self.both("reset_prefix_cache", lambda s: s.manager.reset_prefix_cache())
        elif choice < 0.6 and running:
            rid = r.choice(running)
            self.both(
                f"require_hot({rid})", lambda s: [h.require_hot(rid) for h in s.coord.hot_managers]
            )
        elif running:
            rid = r.choice(running)
            self.both(f"update_residency({rid})", lambda s: s.coord.update_residency(rid))

    def run(self, num_ops: int) -> None:
        ops = [
            (self.admit, 5),
            (self.step, 7),
            (self.ack, 6),
            (self.finish_import, 2),
            (self.finish, 2),
            (self.flush_deferred, 1),
            (self.pressure, 2),
            (self.evict, 1),
            (self.misc, 1),
        ]
        fns, weights = zip(*ops, strict=True)
        self.check()
        for _ in range(num_ops):
            self.rng.choices(fns, weights)[0]()
            self.check()


@pytest.mark.parametrize("seed", range(NUM_TRACES))
def test_random_hisparse_traces_match_vllm(seed: int) -> None:
    init_none_hash("sha256")
    Trace(seed).run(NUM_OPS)


def test_hisparse_layouts_are_served_and_bound_at_construction() -> None:
    """The core serves the layout and builds its coordinator with the manager:
    ``get_hisparse_coordinator`` returns it (an instance of vLLM's class), every time."""
    from vllm.distributed.kv_events import MEDIUM_CPU
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator

    m = build_manager(KVCacheManager, kc.hisparse_config(16, 8), hash_block_size=BS)
    assert type(m) is KVCacheManager
    coordinator = get_hisparse_coordinator(m)
    assert isinstance(coordinator, HiSparseCoordinator)
    assert get_hisparse_coordinator(m) is coordinator
    assert coordinator.host_manager.block_pool.medium == MEDIUM_CPU
    assert coordinator.get_host_block_pool().num_gpu_blocks == 8
    assert m.retained_hit_group_ids == (0,)


def _reorder(config: Any) -> Any:
    groups = config.kv_cache_groups
    config.kv_cache_groups = [groups[2], groups[0], groups[1], groups[3]]
    return config


def _no_host_blocks(config: Any) -> Any:
    config.hisparse_host_num_blocks = None
    return config


@pytest.mark.parametrize(
    "mutate, hash_block_size, reason",
    [
        (_reorder, BS, "host group after a resident group"),
        (_no_host_blocks, BS, "without hisparse_host_num_blocks"),
        (lambda c: c, BS // 2, "partial host entries"),
    ],
    ids=["resident-first", "no-host-pool", "finer-hashes"],
)
def test_layouts_the_core_does_not_serve_fall_back_to_vllm(
    mutate: Any, hash_block_size: int, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layouts vLLM's coordinator refuses to bind stay vLLM's (so vLLM raises, at the
    same call), as does a source group hashed finer than its blocks."""
    from hscache.vllm import kv_cache_manager as module
    from hscache_tools.testing.manager import manager_kwargs

    said: list[str] = []
    monkeypatch.setattr(module.logger, "info", lambda msg, *a: said.append(msg % a))
    config = mutate(kc.hisparse_config(16, 8))
    kwargs = manager_kwargs(config, hash_block_size=hash_block_size, scheduler_block_size=BS)
    m = KVCacheManager(**kwargs)
    assert type(m) is VllmKVCacheManager
    assert len(said) == 1 and reason in said[0]
