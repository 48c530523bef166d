"""The scheduler-like generator of differential traces.

A seeded generator that emulates what vLLM's ``Scheduler`` / ``AsyncScheduler`` do with the
manager: admission with prefix-cache lookup and chunked prefill under a token budget, decode
with spec/lookahead tokens, async-scheduling placeholders, preemption on pool exhaustion,
finish with immediate or deferred free, sync and async KV-connector loads incl. failed loads
and invalid blocks, streaming-input sessions, resets, evictions, stats and events. It
produces actions (:mod:`.actions`) *online*, through a :class:`~.pair.Pair`: its decisions
depend on the reference manager's answers, which are only used after they were found equal
to the candidate's.

A schedule step's two loops (running requests with preemption from the tail, then FCFS
admission) are :mod:`hscache_tools.testing.scheduler_step`'s, shared with the benchmark; this class
is their policy (:meth:`Generator.num_new_tokens`, :meth:`Generator.allocate_running`,
:meth:`Generator.preempt`, :meth:`Generator.admit`) and adds everything random around them.

Layout-specific Scheduler rules (see :mod:`.layouts`): encoder-decoder admissions pass
``num_encoder_tokens``; Mamba ``align`` layouts clip every prefill chunk with vLLM's own
``Scheduler._mamba_block_aligned_split`` (called on a stub holding the engine settings it
reads, as vLLM's tests do) and free the copy-on-write retentions that
``take_kv_cache_block_copies`` hands over each step; connector loads keep a local partial
tail only when the remote hit does not exceed it; a failed connector load of a
multi-group layout drops the request's blocks (vLLM refuses block-level failures there).

Why this file is over ~600 lines: it is one class whose methods share the generator's queues
(waiting, running, remote, parked, deferred frees, pins) and one random stream; splitting
it would spread one state machine over files without making any part readable alone.
"""

from __future__ import annotations

import random
from collections import deque
from types import SimpleNamespace
from typing import Any

from hscache_tools.testing.scheduler_step import (
    Admit,
    Admitted,
    StepSchedule,
    running_num_new_tokens,
    schedule_running,
    schedule_waiting,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from .config import MAMBA_PREFIX_ATTR
from .errors import HarnessError
from .pair import Pair

PLACEHOLDER_TOKEN = 9999
VOCAB = 500


class Generator:
    def __init__(self, pair: Pair, rng: random.Random):
        self.p = pair
        self.cfg = pair.cfg
        self.rng = rng
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        self.remote: list[str] = []  # WAITING_FOR_REMOTE_KVS (async load in flight)
        self.deferred: list[tuple[str, str]] = []  # popped blocks pending block_pool.free_blocks
        self.specs: dict[str, dict] = {}
        self.finished: list[str] = []
        self.fail_count: dict[str, int] = {}
        self.pending: list[tuple[str, int, int, bool]] = []  # async: outputs in flight
        self.epoch: dict[str, int] = {}
        self.parked: list[str] = []  # sessions waiting for their next input chunk
        self.pins: list[str] = []  # keys of blocks a "connector" holds
        self.next_id = 0
        self.info = self.cfg.info
        self.sbs = self.cfg.sched_block  # the Scheduler's block size
        self.hbs = self.cfg.hash_block
        self._split_stub = self._mamba_split_stub() if self.info.mamba_align else None
        B = self.sbs
        self.sys_prompts = [
            [rng.randint(1, VOCAB) for _ in range(rng.randint(1, 6) * B + rng.randint(0, B))]
            for _ in range(3)
        ]
        self.sys_prompts = [s[: max(1, self.cfg.max_prompt - 1)] for s in self.sys_prompts]

    def _mamba_split_stub(self) -> SimpleNamespace:
        """What ``Scheduler._mamba_block_aligned_split`` reads of the Scheduler."""
        cfg, ref = self.cfg, self.p.ref.mgr
        mamba = self.info.mamba
        assert mamba is not None
        partial = self.hbs < self.sbs and bool(ref.coordinator.enable_partial_hash_hits)
        return SimpleNamespace(
            block_size=self.sbs,
            cache_config=SimpleNamespace(block_size=self.sbs),
            use_eagle_block_drop=cfg.use_eagle,
            num_hash_lookahead_tokens=cfg.hash_lookahead,
            max_num_scheduled_tokens=cfg.token_budget,
            scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
            mamba_partial_cache_hit=partial,
            mamba_shared_prefix_checkpoint=partial and bool(getattr(ref, MAMBA_PREFIX_ATTR)),
            hash_block_size=self.hbs,
            mamba_has_prefill_checkpoint_blocks=mamba.ckpt_blocks > 0,
            mamba_prefill_checkpoint_alignment=mamba.ckpt_align,
        )

    def mamba_split(self, rid: str, n: int, local: int = 0, external: int = 0) -> int:
        """vLLM's Mamba ``align`` chunk clipping (identity for other layouts)."""
        if self._split_stub is None or n <= 0:
            return n
        return int(
            Scheduler._mamba_block_aligned_split(
                self._split_stub,  # type: ignore[arg-type]
                self.p.req(rid),
                n,
                local,
                external,
            )
        )

    # ----------------------------------------------------------------- requests
    def _tok(self) -> int:
        return self.rng.randint(1, VOCAB)

    def new_spec(self) -> dict:
        rng, cfg = self.rng, self.cfg
        rid = f"r{self.next_id}"
        self.next_id += 1
        deferred_rids = {r for r, _ in self.deferred}
        reusable = [
            r for r in self.finished[-10:] if r not in deferred_rids and r not in self.p.live
        ]
        if reusable and rng.random() < 0.05:
            rid = rng.choice(reusable)  # a client reusing a finished request id
            self.finished.remove(rid)
            self.p._bump("request_id_reused")
        r = rng.random()
        spec: dict[str, Any]
        if r < cfg.p_dup and self.specs:
            base = self.specs[rng.choice(list(self.specs))]
            spec = dict(base)
        elif r < cfg.p_dup + cfg.p_conv and self.finished:
            base_rid = rng.choice(self.finished[-8:])
            base = self.specs[base_rid]
            spec = dict(base)
            toks = list(self.p.req(base_rid).all_token_ids)
            if base.get("embeds_seed") is not None:
                toks = list(base["prompt"])
            spec["prompt"] = toks + [self._tok() for _ in range(rng.randint(0, 3))]
        else:
            prefix = list(rng.choice(self.sys_prompts)) if rng.random() < 0.7 else []
            if rng.random() < 0.3 and prefix:
                prefix = prefix[: rng.randint(1, len(prefix))]
            suffix_len = rng.randint(1, max(1, cfg.max_prompt // 2))
            spec = {"prompt": prefix + [self._tok() for _ in range(suffix_len)]}
            if rng.random() < cfg.p_lora:
                spec["lora"] = rng.choice((("loraA", 1, "/a"), ("loraB", 2, "/b")))
            if rng.random() < cfg.p_salt:
                spec["salt"] = rng.choice(("s1", "s2"))
            if rng.random() < cfg.p_logprobs:
                spec["logprobs"] = True
            if rng.random() < cfg.p_report_full:
                spec["report_full"] = True
            if rng.random() < cfg.p_session:
                spec["session"] = rng.choice(("sess1", "sess2"))
            if rng.random() < cfg.p_embeds:
                spec["embeds_seed"] = rng.randint(0, 2)
            elif rng.random() < cfg.p_resumable:
                spec["resumable"] = True
            prompt = spec["prompt"][: cfg.max_prompt]
            if rng.random() < cfg.p_mm and len(prompt) >= 2 and not spec.get("embeds_seed"):
                spec["mm"] = self._mm_items(prompt)
        prompt = spec["prompt"][: cfg.max_prompt]
        if not prompt:
            prompt = [self._tok()]
        spec["prompt"] = prompt
        if spec.get("mm"):
            # placeholders carry the image token
            prompt = list(prompt)
            for _, _, off, length in spec["mm"]:
                if off + length > len(prompt):
                    spec["mm"] = None
                    break
                prompt[off : off + length] = [PLACEHOLDER_TOKEN] * length
            spec["prompt"] = prompt
        if not spec.get("mm"):
            spec.pop("mm", None)
        room = cfg.max_model_len - len(prompt)
        if rng.random() < 0.1:
            spec["max_tokens"] = max(1, room)  # runs into max_model_len
        else:
            spec["max_tokens"] = max(1, min(room, rng.randint(1, cfg.max_out)))
        if self.info.has_cross and "enc" not in spec:
            spec["enc"] = rng.randint(1, 6 * self.sbs)  # encoder tokens (Whisper: audio)
        spec["rid"] = rid
        spec["arrival"] = float(self.next_id)
        return spec

    def _mm_items(self, prompt: list[int]) -> list:
        rng = self.rng
        n = len(prompt)
        items = []
        pos = rng.randint(0, max(0, n // 3))
        for _ in range(rng.randint(1, 3)):
            if pos >= n - 1:
                break
            length = rng.randint(1, max(1, min(3 * self.sbs, n - pos - 1)))
            ident = rng.choice(("img_a", "img_b", "img_c"))
            items.append(("image", ident, pos, length))
            pos += length + rng.randint(0, max(1, self.sbs))
        return items

    def add_requests(self, k: int) -> None:
        for _ in range(k):
            spec = self.new_spec()
            self.specs[spec["rid"]] = spec
            self.fail_count.pop(spec["rid"], None)
            self.p.do(["new", spec])
            self.waiting.append(spec["rid"])

    # ----------------------------------------------------------------- helpers
    def set(self, rid: str, attr: str, value: Any) -> None:
        self.p.do(["set", rid, attr, value])

    def release(self, rid: str, allow_defer: bool = True) -> None:
        """Free a request's blocks now, or pop them for a deferred free."""
        if allow_defer and self.rng.random() < self.cfg.p_deferred_free:
            key = f"{rid}@{len(self.p.actions)}"
            self.p.call("pop_blocks_for_free", rid=rid, key=key)
            self.deferred.append((rid, key))
        else:
            self.p.call("free", rid=rid)

    def preempt(self, rid: str) -> None:
        if rid in self.running:
            self.running.remove(rid)
        self._drop_in_flight(rid)
        self.release(rid)
        req = self.p.req(rid)
        self.set(rid, "status", "PREEMPTED")
        self.set(rid, "num_computed_tokens", 0)
        if req.spec_token_ids:
            self.set(rid, "spec_token_ids", [])
        self.set(rid, "num_preemptions", req.num_preemptions + 1)
        self.waiting.appendleft(rid)

    def finish(self, rid: str, status: str = "FINISHED_STOPPED") -> None:
        for q in (self.running, self.remote, self.parked):
            if rid in q:
                q.remove(rid)
        self._drop_in_flight(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)
        self.set(rid, "status", status)
        if self.rng.random() < 0.15 and rid in self.p.live:
            self.p.call("estimate_cached_tokens", rid=rid)
        if self.cfg.p_external and rid in self.p.live and self.rng.random() < 0.5:
            self.connector_finished(rid)
        self.release(rid)
        self.finished.append(rid)

    def connector_finished(self, rid: str) -> None:
        """Scheduler._connector_finished: a producer's partial tails, the out-of-window
        blocks freed on the processed-token basis, the block ids handed to the connector."""
        p, req = self.p, self.p.req(rid)
        if self.rng.random() < 0.5:  # a KV producer
            p.call("finalize_partial_tail_offloads", rid=rid)
        p.call(
            "remove_skipped_blocks",
            rid=rid,
            n=max(0, req.num_computed_tokens - req.num_in_flight_tokens),
        )
        p.call("get_block_ids_for_computed_tokens", rid=rid, n=req.num_computed_tokens)

    def flush_deferred(self, k: int | None = None) -> None:
        k = len(self.deferred) if k is None else k
        for _ in range(min(k, len(self.deferred))):
            rid, key = self.deferred.pop(0)
            if rid:
                self.p.call("free_popped", rid=rid, key=key)
            else:  # copy-on-write retentions (freed in the order they were handed over)
                self.p.call("block_pool.free_blocks", key=key)

    # ----------------------------------------------------------------- scheduling
    # The policy of hscache_tools.testing.scheduler_step's loops.
    @property
    def max_running(self) -> int:
        return self.cfg.max_running

    def num_new_tokens(self, rid: str, budget: int) -> int:
        n = running_num_new_tokens(self.p.req(rid), budget, self.cfg.max_model_len)
        return self.mamba_split(rid, n)

    def allocate_running(self, rid: str, n: int) -> Any:
        kw = {"num_lookahead_tokens": self.cfg.num_lookahead_tokens}
        return self.p.call("allocate_slots", rid=rid, n=n, kw=kw)

    def admit(self, rid: str, budget: int) -> Admitted | Admit:
        """Admit the head of the waiting queue like Scheduler.schedule's waiting loop:
        lookup (local, connector, capped), external tokens, async loads, allocation."""
        cfg, rng, p = self.cfg, self.rng, self.p
        req = p.req(rid)
        N = req.num_tokens
        did_lookup = req.num_computed_tokens == 0
        if did_lookup and req.resumable and cfg.hash_lookahead:
            p.do(["rehash", rid])
        ext = 0
        load_async = False
        if did_lookup:
            diverged = False
            if rng.random() < 0.1:
                res = p.call("get_computed_blocks_for_connector", rid=rid)
                _, hit, boundary, diverged = res
            elif rng.random() < cfg.p_max_hit_len:
                max_len = rng.randint(0, N - 1)
                _, hit, boundary = p.call("get_computed_blocks", rid=rid, max_len=max_len)
            else:
                _, hit, boundary = p.call("get_computed_blocks", rid=rid)
            if boundary != req.shared_prefix_boundary:
                self.set(rid, "shared_prefix_boundary", boundary)
            sbs = self.sbs
            if hit >= sbs and rng.random() < 0.08:
                # connector path: present a shorter, block-aligned local hit
                hit = rng.randint(0, hit // sbs) * sbs
                p.call("truncate_computed_blocks", rid=rid, n=hit)
                diverged = False
            if rng.random() < cfg.p_external:
                # connector.get_num_new_matched_tokens(request, block_aligned_local)
                partial_tail = hit % sbs
                aligned = hit - partial_tail
                if aligned < N - 1:
                    matched = rng.randint(1, N - 1 - aligned)
                    load_async = rng.random() < cfg.p_async_load
                    if partial_tail and matched > partial_tail:
                        # the remote hit supersedes the local sub-block tail
                        p.call("truncate_computed_blocks", rid=rid, n=aligned)
                        hit, ext = aligned, matched
                    elif partial_tail:
                        load_async = False  # keep the local tail, load nothing
                    else:
                        ext = matched
            if diverged and ext == 0:
                # no external tokens back the deeper local hit: look up again
                _, hit, boundary = p.call("get_computed_blocks", rid=rid)
                if boundary != req.shared_prefix_boundary:
                    self.set(rid, "shared_prefix_boundary", boundary)
            computed = hit + ext
            hit_mode = "hit"
        else:
            hit = 0
            computed = req.num_computed_tokens
            hit_mode = "empty"
        if load_async:
            n = 0
        else:
            n = min(N - computed, budget)
            if did_lookup:
                n = self.mamba_split(rid, n, hit, ext)
            else:
                n = self.mamba_split(rid, n)
            if n == 0:
                return self._not_admitted(rid)  # no aligned chunk fits the budget
        kw: dict[str, Any] = {
            "num_new_computed_tokens": hit,
            "num_lookahead_tokens": 0 if load_async else cfg.num_lookahead_tokens,
            "num_external_computed_tokens": ext,
            "delay_cache_blocks": load_async,
            "full_sequence_must_fit": cfg.full_sequence_must_fit,
            "reserved_blocks": self._reserved_blocks() if load_async else 0,
            "has_scheduled_reqs": bool(self.running),
        }
        if self.info.has_cross and computed == 0:
            # encoder-decoder: the encoder inputs are scheduled with the first chunk
            kw["num_encoder_tokens"] = self.specs[rid]["enc"]
        if load_async and rng.random() < 0.5:
            kw["skip_zeroing_group_ids"] = sorted(
                rng.sample(range(self.info.num_groups), rng.randint(1, self.info.num_groups))
            )
        new_blocks = p.call("allocate_slots", rid=rid, n=n, hit=hit_mode, kw=kw)
        if new_blocks is None:
            return self._not_admitted(rid)
        self.fail_count.pop(rid, None)
        if did_lookup:
            p.call("record_prefix_cache_stats", rid=rid, hits=hit)
        p.call("get_blocks", rid=rid)
        if load_async:
            self.waiting.popleft()
            self.set(rid, "num_computed_tokens", computed)
            self.set(rid, "status", "WAITING_FOR_REMOTE_KVS")
            self.remote.append(rid)
            return Admit.NEXT
        if computed != req.num_computed_tokens:
            self.set(rid, "num_computed_tokens", computed)
        self.set(rid, "status", "RUNNING")
        return Admitted(n)

    def _not_admitted(self, rid: str) -> Admit:
        self.fail_count[rid] = self.fail_count.get(rid, 0) + 1
        if not self.running and not self.remote and self.fail_count[rid] >= 3:
            # would never fit: the real scheduler would stall; abort it instead
            self.finish(rid, "FINISHED_ABORTED")
            return Admit.NEXT
        return Admit.STOP

    def _reserved_blocks(self) -> int:
        """Scheduler._inflight_prefill_reserved_blocks() + _spec_decode_step_blocks."""
        cfg, p = self.cfg, self.p
        extra = 1 + cfg.num_spec_tokens + cfg.num_lookahead_tokens if cfg.num_spec_tokens else 0
        total = 0
        inflight = self.remote + [
            r for r in self.running if p.req(r).num_computed_tokens < p.req(r).num_tokens
        ]
        for rid in inflight:
            total += p.call("coordinator.get_num_blocks_to_allocate", rid=rid, extra=extra)
        spec_step = 0
        if cfg.num_spec_tokens:  # Scheduler._spec_decode_step_blocks (Mamba groups aside)
            tokens = 1 + cfg.num_spec_tokens + cfg.num_lookahead_tokens
            spec_step = sum(-(-tokens // g.block_size) for g in self._non_mamba_managers())
        return total + spec_step + self.rng.randint(0, 1)

    def _non_mamba_managers(self) -> list:
        return [
            m
            for m in self.p.ref.mgr.coordinator.single_type_managers
            if not hasattr(m.kv_cache_spec, "mamba_cache_mode")
        ]

    def schedule_step(self) -> None:
        """One Scheduler.schedule() + update_from_output() (sync), or, with
        ``async_sched``, schedule(t+1) before update_from_output(t) like AsyncScheduler."""
        cfg, rng, p = self.cfg, self.rng, self.p
        p.call("new_step_starts")
        step: StepSchedule[str] = StepSchedule()
        budget = schedule_running(self.running, cfg.token_budget, self, step)
        if not step.preempted:
            schedule_waiting(self.waiting, self.running, budget, self, step)
        scheduled = [(entry.item, entry.num_new_tokens) for entry in step.scheduled]
        # the end of Scheduler.schedule(): hand-offs to the worker and the connector
        if self.info.mamba_align or rng.random() < 0.1:
            p.call("take_boundary_state_offloads")
            key = f"cow@{len(p.actions)}"
            copies, _ = p.call("take_kv_cache_block_copies", key=key)
            if rng.random() < cfg.p_deferred_free:
                self.deferred.append(("", key))
            else:
                p.call("block_pool.free_blocks", key=key)
            if copies:
                p._bump("cow_copies", len(copies))
        p.call("take_new_block_ids")
        if cfg.async_sched:
            self._outputs_async(scheduled)
        else:
            self._outputs_sync(scheduled)
        if rng.random() < 0.2:
            p.call("make_prefix_cache_stats")
        if not cfg.events_every_call and rng.random() < 0.3:
            p.call("take_events")
        if self.deferred and rng.random() < 0.5:
            self.flush_deferred(rng.randint(1, len(self.deferred)))

    def _after_token(self, rid: str) -> bool:
        """Stop checks after new output tokens; returns True if the request left running."""
        cfg, p = self.cfg, self.p
        req = p.req(rid)
        if req.num_tokens >= cfg.max_model_len:
            self.finish(rid, "FINISHED_LENGTH_CAPPED")
            return True
        if req.num_output_tokens >= req.max_tokens:
            if self.specs[rid].get("resumable") and self.rng.random() < 0.8:
                self.park_session(rid)
            else:
                self.finish(rid, "FINISHED_LENGTH_CAPPED")
            return True
        return False

    def _outputs_sync(self, scheduled: list[tuple[str, int]]) -> None:
        """The model ran: advance computed tokens, sample outputs, accept drafts."""
        cfg, rng, p = self.cfg, self.rng, self.p
        for rid, n in scheduled:
            req = p.req(rid)
            old_c, old_n = req.num_computed_tokens, req.num_tokens
            new_c = old_c + n
            if new_c < old_n:  # a non-final prefill chunk
                self.set(rid, "num_computed_tokens", new_c)
                continue
            n_spec = max(0, new_c - old_n)
            accepted = rng.randint(0, n_spec) if n_spec else 0
            drafts = list(req.spec_token_ids)
            self.set(rid, "num_computed_tokens", new_c - (n_spec - accepted))
            if drafts:
                self.set(rid, "spec_token_ids", [])
            toks = [*drafts[:accepted], self._tok()]
            p.do(["append", rid, toks])
            if cfg.num_spec_tokens:
                # update_from_output: cache_blocks(request, C - num_in_flight_tokens)
                p.call(
                    "cache_blocks", rid=rid, n=req.num_computed_tokens - req.num_in_flight_tokens
                )
            if self._after_token(rid):
                continue
            if cfg.num_spec_tokens:
                k = min(cfg.num_spec_tokens, cfg.max_model_len - req.num_tokens - 1)
                if k > 0:
                    self.set(rid, "spec_token_ids", [self._tok() for _ in range(k)])

    def _outputs_async(self, scheduled: list[tuple[str, int]]) -> None:
        """AsyncScheduler: computed tokens advance at schedule time (placeholders for the
        tokens being sampled); the previous step's outputs arrive afterwards."""
        p = self.p
        new_pending = []
        for rid, n in scheduled:
            req = p.req(rid)
            self.set(rid, "num_computed_tokens", req.num_computed_tokens + n)
            self.set(rid, "num_in_flight_tokens", req.num_in_flight_tokens + n)
            sampled = req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders
            if sampled:
                self.set(rid, "num_output_placeholders", req.num_output_placeholders + 1)
            new_pending.append((rid, self.epoch.get(rid, 0), n, sampled))
        for rid, epoch, n, sampled in self.pending:
            if self.epoch.get(rid, 0) != epoch or rid not in self.running:
                continue  # preempted or finished since: the stale output is dropped
            req = p.req(rid)
            self.set(rid, "num_in_flight_tokens", req.num_in_flight_tokens - n)
            if not sampled:
                continue
            self.set(rid, "num_output_placeholders", req.num_output_placeholders - 1)
            p.do(["append", rid, [self._tok()]])
            p.call("cache_blocks", rid=rid, n=req.num_computed_tokens - req.num_in_flight_tokens)
            self._after_token(rid)
        self.pending = new_pending

    def _drop_in_flight(self, rid: str) -> None:
        """Forget in-flight async work of a request leaving the running set."""
        req = self.p.req(rid)
        self.epoch[rid] = self.epoch.get(rid, 0) + 1
        if req.num_in_flight_tokens:
            self.set(rid, "num_in_flight_tokens", 0)
        if req.num_output_placeholders:
            self.set(rid, "num_output_placeholders", 0)

    # ----------------------------------------------------------------- sessions
    def park_session(self, rid: str) -> None:
        """A resumable (streaming-input) request ends its turn: it keeps its blocks and waits
        for more input (Scheduler._handle_stopped_request)."""
        req = self.p.req(rid)
        frontier = req.num_computed_tokens - req.num_output_placeholders
        self.running.remove(rid)
        self._drop_in_flight(rid)
        self.set(rid, "num_computed_tokens", frontier)
        if req.spec_token_ids:
            self.set(rid, "spec_token_ids", [])
        self.set(rid, "status", "WAITING_FOR_STREAMING_REQ")
        self.parked.append(rid)

    def resume_session(self) -> None:
        """The next input chunk of a parked session arrives
        (Scheduler._update_request_as_session): the last sampled token is dropped, its block
        hashes are truncated in place, the new tokens extend the prompt."""
        rng, p, cfg = self.rng, self.p, self.cfg
        rid = rng.choice(self.parked)
        req = p.req(rid)
        room = cfg.max_model_len - req.num_tokens  # num_tokens - 1 kept, +new, +1 output
        if room < 1:
            self.parked.remove(rid)
            self.finish(rid, "FINISHED_LENGTH_CAPPED")
            return
        toks = [self._tok() for _ in range(rng.randint(1, min(room, 2 * self.sbs + 3)))]
        max_tokens = rng.randint(1, max(1, min(cfg.max_out, room - len(toks) + 1)))
        self.parked.remove(rid)
        p.do(["session_update", rid, toks, max_tokens])
        self.waiting.appendleft(rid)

    # ----------------------------------------------------------------- misc ops
    def complete_remote(self) -> None:
        rng, p = self.rng, self.p
        rid = rng.choice(self.remote)
        self.remote.remove(rid)
        req = p.req(rid)
        if rng.random() < 0.25 and self.info.num_groups > 1:
            # load failure of a multi-group layout: reported per request
            # (failed_recving, recompute policy): nothing is valid, the blocks go back
            self.set(rid, "num_computed_tokens", 0)
            p.call("free", rid=rid)
        elif rng.random() < 0.25:
            # load failure: only a prefix is valid; invalid blocks are evicted
            B = self.sbs
            valid = rng.randint(0, req.num_computed_tokens) // B * B
            ids = p.call("get_block_ids", rid=rid)[0]
            bad = ids[valid // B :]
            if bad:
                p.call("evict_blocks", ids=sorted(set(bad))[: rng.randint(1, len(bad))])
            self.set(rid, "num_computed_tokens", valid)
            if valid:
                p.call("cache_blocks", rid=rid, n=valid)
                if self.cfg.zeroing:
                    p.call("record_blocks_for_zeroing", rid=rid, n=valid)
            else:
                p.call("free", rid=rid)
        else:
            p.call("cache_blocks", rid=rid, n=req.num_computed_tokens)
        self.set(rid, "status", "WAITING" if req.num_preemptions == 0 else "PREEMPTED")
        self.waiting.appendleft(rid)

    def invalid_blocks(self) -> None:
        """A KV connector reports blocks of a running request as invalid (failed sync load):
        Scheduler._update_requests_with_invalid_blocks rewinds num_computed_tokens to the
        first invalid block and evicts it and everything after it."""
        rng, p, B = self.rng, self.p, self.sbs
        if self.info.num_groups > 1:
            return  # vLLM raises: block ids are not unique across groups
        candidates = [
            r
            for r in self.running
            if p.req(r).num_computed_tokens >= B and not p.req(r).num_output_placeholders
        ]
        if not candidates:
            return
        rid = rng.choice(candidates)
        req = p.req(rid)
        ids = p.call("get_block_ids", rid=rid)[0]
        n_blocks = min(len(ids), -(-req.num_computed_tokens // B))
        idx = rng.randrange(n_blocks)
        self.set(rid, "num_computed_tokens", idx * B)
        if req.spec_token_ids:
            self.set(rid, "spec_token_ids", [])
        p.call("evict_blocks", ids=sorted(set(ids[idx:])))
        p._bump("invalid_blocks")

    def connector_blocks(self) -> None:
        """An offloading connector pins cached blocks (touch) or takes scratch blocks, and
        releases them later through block_pool.free_blocks."""
        rng, p = self.rng, self.p
        if self.pins and rng.random() < 0.5:
            key = self.pins.pop(rng.randrange(len(self.pins)))
            p.call("block_pool.free_blocks", key=key)
            return
        key = f"pin@{len(p.actions)}"
        ref_pool = p.ref.mgr.block_pool
        if rng.random() < 0.8:
            rids = [r for r in p.ref.reqs if p.req(r).block_hashes]
            if not rids:
                return
            rid = rng.choice(rids)
            hashes = p.req(rid).block_hashes
            gids = [rng.randrange(self.info.num_groups)]
            idx = [
                i
                for i in range(len(hashes))
                if ref_pool.get_cached_block(hashes[i], gids) is not None
            ]
            if not idx:
                return
            idx = sorted(rng.sample(idx, rng.randint(1, min(3, len(idx)))))
            p.call("block_pool.touch", rid=rid, idx=idx, key=key, gids=gids)
        else:
            n = rng.randint(1, 2)
            if ref_pool.get_num_free_blocks() < n:
                return
            p.call("block_pool.get_new_blocks", n=n, key=key)
        self.pins.append(key)

    def abort_random(self) -> None:
        pool = list(self.waiting) + self.running + self.remote + self.parked
        if pool:
            self.finish(self.rng.choice(pool), "FINISHED_ABORTED")

    def reset(self) -> None:
        if self.rng.random() < 0.3:
            # Scheduler.reset_prefix_cache(reset_running_requests=True)
            for rid in list(reversed(self.running)):
                self.preempt(rid)
            self.flush_deferred()
        self.p.call("reset_prefix_cache")

    def evict(self) -> None:
        rng, ref = self.rng, self.p.ref.mgr
        hashed = [
            b.block_id for b in ref.block_pool.blocks if b.block_hash is not None and not b.is_null
        ]
        if hashed and rng.random() < 0.8:
            ids = rng.sample(hashed, rng.randint(1, min(3, len(hashed))))
        else:
            ids = [rng.randint(1, self.cfg.num_blocks - 1) for _ in range(rng.randint(0, 2))]
        self.p.call("evict_blocks", ids=sorted(set(ids)))

    def probe(self) -> None:
        rng, p, cfg = self.rng, self.p, self.cfg
        live = list(p.live)
        r = rng.random()
        if live and r < 0.2:
            rid = rng.choice(live)
            p.call(
                rng.choice(
                    (
                        "get_block_ids",
                        "get_blocks",
                        "get_num_common_prefix_blocks",
                        "finalize_partial_tail_offloads",
                    )
                ),
                rid=rid,
            )
        elif live and r < 0.3:
            rid = rng.choice(live)
            p.call("get_block_ids_for_computed_tokens", rid=rid, n=p.req(rid).num_computed_tokens)
        elif live and r < 0.35:
            rid = rng.choice(live)
            req = p.req(rid)  # on the processed-token basis, as the Scheduler does
            n = max(0, req.num_computed_tokens - req.num_in_flight_tokens)
            p.call("remove_skipped_blocks", rid=rid, n=n)
        elif live and r < 0.45:
            rid = rng.choice([x for x in live if x in self.p.ref.reqs])
            if p.req(rid).status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                p.call("estimate_cached_tokens", rid=rid)
        elif self.running and r < 0.6:
            rid = rng.choice(self.running)
            req = p.req(rid)
            if self.info.mamba_align:
                # what the Scheduler passes (update_from_output): the processed tokens. A
                # count below them would re-key a Mamba state the request has moved past,
                # which no Scheduler path does (vLLM's own manager then fails an assert).
                n = max(0, req.num_computed_tokens - req.num_in_flight_tokens)
            else:  # below the cached blocks: a no-op the managers must agree on
                n = rng.randint(0, req.num_computed_tokens)
            p.call("cache_blocks", rid=rid, n=n)
        elif r < 0.75 and (self.waiting or self.running):
            rid = rng.choice(list(self.waiting) + self.running)
            _, hit, _ = p.call("get_computed_blocks", rid=rid)
            if hit and rng.random() < 0.5:
                B = self.sbs
                p.call("truncate_computed_blocks", rid=rid, n=rng.randint(0, hit // B) * B)
            if rng.random() < 0.3:
                p.call("prefix_cache_lookup_enabled", rid=rid)
            hashes = p.req(rid).block_hashes
            if hashes and rng.random() < 0.5:
                gids = sorted(rng.sample(range(self.info.num_groups), 1))
                p.call(
                    "block_pool.get_cached_block",
                    rid=rid,
                    i=rng.randrange(len(hashes)),
                    gids=gids,
                )
            if rng.random() < 0.3:
                p.call("block_pool.is_block_writable", id=rng.randrange(cfg.num_blocks))
        elif r < 0.85:
            p.call(
                rng.choice(
                    (
                        "usage",
                        "take_boundary_state_offloads",
                        "take_new_block_ids",
                    )
                )
            )
        elif self.running:
            # invalid call the manager must reject the same way
            p.call("allocate_slots", rid=rng.choice(self.running), n=0, expect_raise=True)

    # ----------------------------------------------------------------- main loop
    def run(self) -> None:
        cfg, rng, p = self.cfg, self.rng, self.p
        guard = 0
        while p.ncalls < cfg.num_ops:
            guard += 1
            if guard > cfg.num_ops * 50:
                raise HarnessError(f"generator made no progress (seed={p.seed})")
            active = len(self.waiting) + len(self.running) + len(self.remote)
            r = rng.random()
            if active == 0 or (r < 0.14 and len(self.waiting) < 6):
                self.add_requests(rng.randint(1, 3))
            elif r < 0.66:
                self.schedule_step()
            elif r < 0.70:
                self.abort_random()
            elif r < 0.74:
                if self.running:
                    self.preempt(rng.choice(self.running))
            elif r < 0.78:
                if self.remote and (not self.parked or rng.random() < 0.5):
                    self.complete_remote()
                elif self.parked:
                    self.resume_session()
            elif r < 0.81:
                if self.deferred:
                    self.flush_deferred(rng.randint(1, len(self.deferred)))
            elif r < 0.83:
                self.reset()
            elif r < 0.84:
                self.evict()
            elif r < 0.85:
                self.connector_blocks()
            elif r < 0.86:
                self.invalid_blocks()
            elif r < 0.96:
                self.probe()
            elif r < 0.98:
                p.call("make_prefix_cache_stats")
            else:
                p.call("take_events")
        self.finalize()

    def finalize(self) -> None:
        p = self.p
        for rid in list(self.running) + list(self.remote) + list(self.waiting) + list(self.parked):
            self.finish(rid, "FINISHED_ABORTED")
        self.flush_deferred()
        for key in self.pins:
            p.call("block_pool.free_blocks", key=key)
        self.pins.clear()
        p.check_state(deep=True)
        p.call("take_events")
        p.call("make_prefix_cache_stats")
        if not p.call("reset_prefix_cache"):
            # every request finished and every hand-off returned: a block still in use
            # means the generator lost one (both managers agree on it, so nothing
            # else would notice)
            raise HarnessError(f"blocks still in use after the trace (seed={p.seed})")
        p.call("take_events")
        p.check_state(deep=True)
