"""``OmniHiddenStateCache``: vllm-omni's prefix-cache interface on hscache's hidden-state cache.

vllm-omni 0.30's runners (``PrefixCacheRunnerMixin``) build their cache as
``cls(PrefixCacheConfig, FullAttentionGroupView)``, call ``register_policy`` once, and per
real step: ``new_step_starts(scheduler_output)`` before the runner drops finished requests,
the forward pass, ``save_outputs(hidden_states, mm_outputs, num_tokens_unpadded=,
num_tokens_padded=)`` which returns a step id, then exactly one of ``materialize(step_id,
req_ids)`` (possibly a step late, on the async output thread) or ``discard_step(step_id)``.

What ``materialize`` returns, per request of the saved step (vllm-omni's contract, which this
class keeps so that a runner's payloads are identical): a request on its first schedule
(``scheduled_new_reqs``, not yet live) with a prefix hit gets ``[cached prefix | this
step's rows]``, positions ``0 .. num_computed + num_scheduled``; every other request (no hit,
a later prefill chunk, a decode step, a request resumed after preemption) gets this step's
rows only. Per-token outputs are the hidden states (``__hidden_states__``, unless the
model's policy opts out) and every multimodal output whose first dimension is the step's
token count (vllm-omni's JOIN_NEXT_STEP and JOIN_ON_FINISH keys alike: both are readable by
hits from the step that saved them, so both are written at save); other multimodal outputs
are passed through per request as vllm-omni does.

Each row is handed out once, in order (``deliver_once``, on by default): vllm-omni's runners
append every materialized request's rows to its payload for the next stage
(``accumulate_full_payload_output``), and a request preempted and resumed recomputes its
rows from its hit (or 0), which vllm-omni 0.30 hands on again after the ones it had
delivered (with its own cache, and with none). A per-request delivery watermark (the
furthest position handed out) trims a resumed request's materializes to the rows past the
watermark it had when it was resumed; a first hit sent back for recomputation hands out
nothing (the scheduler drops that output, and its
next step is served its prefix). ``deliver_once=False`` keeps vllm-omni's contract above
exactly. The watermark is this class's (Python, under its lock), not the Rust rules'.

Who decides what: hscache's Rust slot mirror (``src/slots/``) takes the step's facts from
the ``SchedulerOutput`` itself (new requests' tables and hits, running requests' new
blocks, resumptions, finishes and preemptions), bumps the version of every block assigned
fresh, lays out and checks the step's write slots, counts the rows written and validates
every hit against the versions: a hit whose rows were not all written in their blocks'
current versions is a miss, never served (no zeros, no other request's rows): with
recomputation on (``recompute_refused``, as hscache's switch builds it) the request is
sent back to the scheduler for recomputation (:meth:`take_invalid_blocks`,
:mod:`hscache.omni.refusals`), otherwise reported as :class:`UnservableHitError`. The
Rust ``OmniStepRules`` (``src/slots/omni_rules.rs``) takes the rest: the live requests,
which new requests are first hits (block aligned, else ``InvalidArgumentError``), a step
begun and never saved,
the step's spans in the runner's batch order, which requests of a saved step are served
their prefix, refused (with the reason) or served this step's rows, which step ids
(issued here, not consumed yet, at most ``max_unconsumed_steps`` waiting) and request ids
a ``materialize`` may ask for. This class keeps the tensors: it splits the outputs, writes
them through the mirror's plan and keeps, per saved step, the gathered full rows of the
prefix requests and one host copy of the other requests' rows (the runner reuses its
output buffers; the rows of a prefix request are in its gathered rows, a refused
request's rows are never handed out, so neither is copied again).
Hits are gathered when the step is saved,
after its writes (same-step hits read the rows this step wrote), so a materialize one step
late is unaffected by blocks reused in between.

Storage (:class:`hscache.omni.settings.OmniSettings`): the cache is allocated on the first
saved step with rows, one ``(num_blocks * block_size, width)`` tensor per per-token key, in
pinned host memory, on the outputs' device, or in pageable host memory;
``bytes_per_token`` is the memory one KV slot costs. Results are host tensors, as vllm-omni's.

No synchronous device -> host copy on the step: rows on a CUDA device bound for host storage
(``pinned``, the default) are copied into pinned memory with ``non_blocking`` copies on a
copy stream that waits for the current stream, one event per step; the step's host work
(the rows into the storage, the hits' gather, the rows kept for ``materialize``) is queued
and runs in step order when that step (or a later one) is materialized or discarded, after
waiting for its event; the next ``new_step_starts`` makes the current stream wait for the
copies on the device (the next forward may overwrite the runner's buffers), never the host.
The mirror's decisions are taken at save all the same (``HiddenStateCache.commit``). On host
tensors the same code path runs with no copy and no event, and the host work runs before
``save_outputs`` returns (the runner reuses its buffers). ``device`` storage keeps its
synchronous host copies of the rows handed out.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from hscache._core import OmniSavePlan, OmniStepRules
from hscache.exceptions import InvalidArgumentError
from hscache.hidden_states.cache import HiddenStateCache
from hscache.hidden_states.steps import StepPlan, StepRows, index_view
from hscache.omni.errors import StepIdError, UnsupportedOutputError
from hscache.omni.settings import OmniSettings

__all__ = ["HIDDEN_KEY", "OmniHiddenStateCache", "StageOutputs"]

HIDDEN_KEY = "__hidden_states__"
"""The hidden states' key, vllm-omni's name for it."""


class StageOutputs(NamedTuple):
    """What ``materialize`` returns (the fields of vllm-omni's ``StageCacheOutputs``)."""

    hidden_states: dict[str, torch.Tensor] | None
    """``req_id -> rows``, or None when the model's policy does not cache hidden states."""
    mm_outputs: dict[str, dict[str, Any]]
    """``key -> req_id -> rows`` (per-token keys) or the request's element (the others)."""


@dataclass
class _Key:
    """One per-token output: its cache key, the trailing shape of a row, its dtype."""

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def width(self) -> int:
        return math.prod(self.row_shape)


class _Step(NamedTuple):
    """A begun step: its ``SchedulerOutput``, the recomputed requests whose rows the
    mirror reads again (the rules' ``begin_step``), and the requests resumed in it."""

    output: Any
    rereads: list[str]
    resumed: frozenset[str] = frozenset()


@dataclass
class _SavedStep:
    """A saved step's tensors, until materialized or discarded (what each request is
    served, and which ids may be asked for, is the Rust rules' record of the step)."""

    req_ids: list[str]
    """The step's requests in row order (vllm-omni's batch order at save)."""
    sizes: list[int]
    """Rows of each request, in row order."""
    plain: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    """``key -> per plain request`` (the rules' plain order): views of one host copy of
    the plain requests' rows, the only rows of the step kept."""
    prefix: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per request served its prefix (the rules' prefix order): ``key -> full rows``."""
    leftover: dict[str, Any] = field(default_factory=dict)
    """Outputs that are not one row per token, passed through."""
    recomputed: frozenset[str] = frozenset()
    """Requests whose first hit this step sent back for recomputation."""
    resumed: frozenset[str] = frozenset()
    """Requests resumed after preemption in this step."""
    starts: list[int] = field(default_factory=list)
    """Position of each request's first row of this step (its ``num_computed_tokens``;
    a request served its prefix starts at 0), in row order."""


def _split(
    hidden_states: torch.Tensor | None,
    mm_outputs: Mapping[str, Any] | None,
    n: int,
    padded: int,
    cache_hidden: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(per-token outputs, the rest)``; per-token ones cut to the step's ``n`` rows."""
    rows: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {}
    if cache_hidden and hidden_states is not None and n > 0:
        if not isinstance(hidden_states, torch.Tensor):
            raise InvalidArgumentError(
                f"hidden_states is a {type(hidden_states).__name__}; expected a torch.Tensor"
            )
        if hidden_states.ndim < 2 or hidden_states.shape[0] < n:
            raise InvalidArgumentError(
                f"hidden_states has shape {tuple(hidden_states.shape)}; expected ({n}, width)"
            )
        rows[HIDDEN_KEY] = hidden_states[:n]
    for key, val in (mm_outputs or {}).items():
        if not isinstance(key, str) or key == HIDDEN_KEY:
            raise InvalidArgumentError(f"multimodal output key {key!r} is not a flat name")
        if (
            n > 0
            and isinstance(val, torch.Tensor)
            and val.ndim >= 2
            and int(val.shape[0]) in (n, padded)
        ):
            rows[key] = val[:n]
        else:
            rest[key] = val
    return rows, rest


def _starts(scheduler_output: Any, req_ids: Sequence[str]) -> list[int]:
    """Each request's ``num_computed_tokens`` in the step (the position of its first
    scheduled row), from vLLM's ``SchedulerOutput``, in ``req_ids``' order."""
    computed: dict[str, int] = {}
    for nr in scheduler_output.scheduled_new_reqs:
        computed[nr.req_id] = int(nr.num_computed_tokens or 0)
    cached = scheduler_output.scheduled_cached_reqs
    for r, nc in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        computed.setdefault(r, int(nc))
    try:
        return [computed[r] for r in req_ids]
    except KeyError as e:
        raise InvalidArgumentError(
            f"request {e.args[0]!r} has rows in the step but is not scheduled in it"
        ) from None


def _resumed(scheduler_output: Any, delivered: Mapping[str, int]) -> frozenset[str]:
    """The requests a step resumes after preemption: vLLM's ``resumed_req_ids`` (its V1
    runner), and requests scheduled new again after rows of theirs were handed out (its
    V2 runner resends a resumed request there)."""
    cached = scheduler_output.scheduled_cached_reqs
    found = set(getattr(cached, "resumed_req_ids", None) or ())
    if delivered:
        found.update(
            nr.req_id for nr in scheduler_output.scheduled_new_reqs if nr.req_id in delivered
        )
    return frozenset(found)


def _host_copy(val: Any, stream: Any = None) -> Any:
    """A host copy of every tensor in ``val`` (the runner reuses its output buffers);
    with a CUDA ``stream``, device tensors are copied into pinned memory without blocking
    on it (the caller waits for the stream's event before reading them)."""
    if isinstance(val, torch.Tensor):
        if stream is not None and val.is_cuda:
            return _pinned_copy(val, stream)
        return val.detach().to("cpu", copy=True)
    if isinstance(val, Mapping):
        return {k: _host_copy(v, stream) for k, v in val.items()}
    if isinstance(val, list):
        return [_host_copy(v, stream) for v in val]
    if isinstance(val, tuple):
        return tuple(_host_copy(v, stream) for v in val)
    return val


def _pinned_copy(t: torch.Tensor, stream: Any) -> torch.Tensor:
    """A non-blocking copy of device tensor ``t`` into pinned host memory, enqueued on
    ``stream`` (the current stream); ``t``'s memory is kept from reuse until it ran."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t.detach(), non_blocking=True)
    t.record_stream(stream)
    return out


class OmniHiddenStateCache:
    """vllm-omni's prefix-cache manager interface served by :class:`HiddenStateCache`.

    ``config`` has ``num_blocks`` and ``block_size`` (vllm-omni's ``PrefixCacheConfig``);
    ``view`` has ``batch_req_ids()``, the runner's batch order after its state update
    (vllm-omni's ``FullAttentionGroupView``). ``eager`` is accepted for vllm-omni's signature
    and ignored (the device copies are asynchronous whenever rows leave a CUDA device).
    ``settings`` default to the environment.
    ``kv_cache_group``: the KV-cache group whose block tables index the rows, the one that
    carries full-attention positions (:func:`hscache.hidden_states.full_attention_group`);
    vllm-omni knows group 0 of a one-group model only, hscache serves hybrid layouts too
    (``config.block_size`` is then that group's block size). ``recompute_refused``: a
    first hit whose rows cannot be served is sent back for recomputation instead of
    refused (:meth:`take_invalid_blocks`; on where those blocks reach the scheduler, as
    the runner hook :mod:`hscache.omni.refusals` does).
    """

    def __init__(
        self,
        config: Any,
        view: Any,
        *,
        eager: bool | None = None,
        settings: OmniSettings | None = None,
        kv_cache_group: int = 0,
        recompute_refused: bool = False,
        deliver_once: bool = True,
    ) -> None:
        del eager
        self._kv_cache_group = kv_cache_group
        self._num_blocks = int(config.num_blocks)
        self._block_size = int(config.block_size)
        if self._num_blocks <= 0 or self._block_size <= 0:
            raise InvalidArgumentError(
                f"num_blocks={self._num_blocks}, block_size={self._block_size}: both must be > 0"
            )
        if not callable(getattr(view, "batch_req_ids", None)):
            raise InvalidArgumentError("view must have batch_req_ids() (the runner's batch)")
        self._view = view
        self._settings = settings or OmniSettings.from_env()
        self._cache_hidden = True
        self._cache: HiddenStateCache | None = None
        self._keys: dict[str, _Key] = {}
        # SchedulerOutputs seen before the cache exists (it is built on the first saved
        # step with rows, when the outputs' widths are known); replayed into its mirror.
        self._backlog: list[_Step] = []
        # The first saved step with rows had no per-token output: nothing is ever cached
        # (and no backlog kept).
        self._keyless = False
        # This step's SchedulerOutput, planned in the mirror at save (the batch order is
        # known then).
        self._pending: _Step | None = None
        # Every decision (live requests, first hits, spans, who is served what, which
        # step ids and request ids may be consumed) is the Rust rules'; `_steps` holds
        # the saved steps' tensors.
        self._rules = OmniStepRules(
            block_size=self._block_size,
            max_unconsumed_steps=self._settings.max_unconsumed_steps,
        )
        self._rules.set_recompute_refused(bool(recompute_refused))
        # materialize / discard_step may run on vllm-omni's async output thread while the
        # engine thread saves the next step: the rules' step record and `_steps` change
        # under this lock (materialize reads only the step's own tensors, never the
        # mirror or the storage).
        self._lock = threading.Lock()
        self._consumed = threading.Condition(self._lock)
        self._savers_waiting = 0  # notify only when a save waits for room
        self._steps: dict[int, _SavedStep] = {}
        self._saving: set[int] = set()  # step ids issued, their rows not kept yet
        # Host work of saved steps (write into the storage, gather the hits, keep the
        # rows handed out), in step order; run at once unless the step's rows are still
        # being copied off the device (then when the step, or a later one, is consumed).
        self._jobs: deque[tuple[int, Callable[[], None]]] = deque()
        self._jobs_lock = threading.Lock()
        self._copy_streams: dict[torch.device, Any] = {}
        self._last_copy: tuple[torch.device, Any] | None = None
        # Rows moved per key by the saves: into the cache, gathered for the hits, and
        # kept as the host copy of the plain requests' rows (``row_copies()``).
        self._rows_moved = {"written": 0, "gathered": 0, "kept": 0}
        # The delivery watermark (``deliver_once``): per request, the next position
        # whose rows no materialize has handed out yet. Requests finished while a
        # saved step of theirs is unconsumed are retired when the last one is.
        self._deliver_once = bool(deliver_once)
        self._delivered: dict[str, int] = {}
        # Per resumed request still recomputing rows it had handed out: the position its
        # rows are handed out from again.
        self._floors: dict[str, int] = {}
        self._retiring: set[str] = set()

    # ------------------------------------------------------------------ properties

    @property
    def cache(self) -> HiddenStateCache | None:
        """The hidden-state cache (None until the first saved step with rows)."""
        return self._cache

    @property
    def rules(self) -> OmniStepRules:
        """The Rust rules: live requests, first hits, saved steps (``src/slots/omni_rules.rs``)."""
        return self._rules

    def bytes_per_token(self) -> int:
        """Bytes one KV slot costs, all per-token keys together (0 before the cache exists)."""
        return 0 if self._cache is None else self._cache.bytes_per_token()

    def row_copies(self) -> dict[str, int]:
        """Rows (per key) the saves copied so far: ``written`` into the cache, ``gathered``
        for the hits (cached prefix and this step's rows), ``kept`` as the host copy of
        the plain requests' rows (the rows a hit or a refused request would otherwise
        have copied once more are ``written + gathered - kept`` short of ``2 * written +
        gathered``)."""
        return dict(self._rows_moved)

    @property
    def recompute_refused(self) -> bool:
        """Whether a first hit the mirror refuses is sent back for recomputation."""
        return self._rules.recompute_refused

    def set_recompute_refused(self, on: bool) -> None:
        """Turns recomputation of refused first hits on (where :meth:`take_invalid_blocks`
        reaches the scheduler) or off (such a hit raises ``UnservableHitError``)."""
        self._rules.set_recompute_refused(bool(on))

    def take_invalid_blocks(self, step_id: int) -> list[int]:
        """The blocks to report with saved step ``step_id``'s output as vLLM's
        ``KVConnectorOutput.invalid_block_ids`` (taken once): per first hit of the step
        sent back for recomputation, the first block whose rows were not written. vLLM's
        scheduler then drops that request's output of the step and recomputes it from
        that block (or fails it, under a connector's ``kv_load_failure_policy='fail'``);
        its next step is served ``[cached prefix | rows]`` as a first hit."""
        with self._lock:
            return self._rules.take_invalid_blocks(step_id)

    def unconsumed_steps(self) -> list[int]:
        """Saved step ids not yet materialized or discarded."""
        return self._rules.unconsumed_steps()

    # ------------------------------------------------------------------ interface

    def register_policy(self, policy: Any) -> None:
        """Takes the model's ``ModelCachePolicy``: whether hidden states are cached
        (``needs_full_hidden_states``). Its ``deferred_keys`` (JOIN_ON_FINISH) need nothing
        different here: they are written at save like every per-token key."""
        cache_hidden = bool(getattr(policy, "needs_full_hidden_states", True))
        if self._cache is not None and cache_hidden != self._cache_hidden:
            raise InvalidArgumentError("register_policy after the first saved step")
        self._cache_hidden = cache_hidden

    def new_step_starts(self, scheduler_output: Any) -> None:
        """Takes one step's ``SchedulerOutput`` (before the runner updates its batch)."""
        # The rules check the step (first hits block aligned), then take it; a step
        # never saved is planned without a write (its rows count as never written)
        # before this one.
        unsaved, rereads = self._rules.begin_step(scheduler_output)
        if self._last_copy is not None:
            # The next forward may overwrite the runner's output buffers: it waits (on
            # the device, the host does not) for the last step's copies out of them.
            torch.cuda.current_stream(self._last_copy[0]).wait_event(self._last_copy[1])
            self._last_copy = None
        resumed = _resumed(scheduler_output, self._delivered) if self._deliver_once else None
        previous, self._pending = (
            self._pending,
            _Step(scheduler_output, rereads, resumed or frozenset()),
        )
        if unsaved and previous is not None:
            self._plan_unsaved(previous)
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished and self._deliver_once:
            self._retire(finished)

    def save_outputs(
        self,
        hidden_states: torch.Tensor | None,
        mm_outputs: Mapping[str, Any] | None,
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
    ) -> int:
        """Writes this step's rows, serves its hits; returns the step id to consume."""
        # One piece: the order is the contract (every check before any state changes, the rules'
        # bookkeeping under the lock, the copies unlocked, the host work queued last); split,
        # that order would be spread over helpers.
        n = int(num_tokens_unpadded)
        plan = self._rules.lay_out(self._view.batch_req_ids(), n)
        so = self._pending
        if so is None:  # the rules refused the plan above: never reached
            raise InvalidArgumentError("save_outputs without new_step_starts for this step")
        self._wait_for_room()
        rows, rest = _split(
            hidden_states, mm_outputs, n, int(num_tokens_padded), self._cache_hidden
        )
        keys = self._check_keys(rows) if n else {}
        # Everything checked: change state.
        saved = _SavedStep(
            req_ids=plan.req_ids,
            sizes=plan.sizes,
            starts=_starts(so.output, plan.req_ids) if self._deliver_once else [],
            resumed=so.resumed,
        )
        if n and not keys and self._cache is None and not self._keyless:
            self._keyless = True
            self._backlog.clear()
        if not n or not keys:
            saved.leftover = _host_copy(rest)
            self._plan_unsaved(so)
            self._pending = None
            with self._lock:  # room was checked above; consumers only make more
                step_id = self._rules.save(plan)[0]
                self._steps[step_id] = saved
            return step_id
        if self._cache is None:
            self._build(keys, rows)
        assert self._cache is not None
        flat = {name: t.reshape(t.shape[0], -1) for name, t in rows.items()}
        self._pending = None
        cache = self._cache
        try:
            step = self._plan(so, plan)
            # The step's writes are counted and its reads validated now; the rows go into
            # the storage with the step's host work (below), before any later step's.
            reads = cache.commit(step)
        except BaseException:
            # The mirror may have planned the step, which is then never committed (its
            # rows count as never written): the rules drop it too (saved without rows,
            # consumed at once), so that no later step plans it again.
            with self._lock:
                self._rules.discard(self._rules.save(plan)[0])
            raise
        with self._lock:
            step_id, prefix, plain_rows, plain_sizes = self._rules.save(
                plan, hits=reads.plan_indices, misses=reads.misses, miss_blocks=reads.miss_blocks
            )
            self._saving.add(step_id)
        # The copies run unlocked (the output thread may materialize an older step
        # meanwhile); nobody knows `step_id` before it is returned.
        moved = self._rows_moved
        moved["written"] += plan.num_rows
        moved["gathered"] += reads.num_rows
        moved["kept"] += sum(plain_sizes)
        # Device rows bound for host storage: non-blocking copies into pinned memory on a
        # copy stream, the host work deferred until the step is consumed (its event
        # waited then); otherwise (host rows, device storage) the host work runs now.
        try:
            staged, copied, saved.leftover = self._stage(flat, rest)
        except BaseException:
            with self._lock:
                self._saving.discard(step_id)
                self._rules.discard(step_id)
            raise

        def host_work() -> None:
            if copied is not None:
                copied.synchronize()
            step_rows = cache.write_committed(step, reads, staged)
            self._keep(
                saved, step_rows, staged, prefix, plain_rows, plain_sizes, copied is not None
            )

        if self._deliver_once:
            recomputing = self._rules.recomputing()
            if recomputing:
                saved.recomputed = frozenset(recomputing).intersection(plan.req_ids)
        with self._lock:
            self._saving.discard(step_id)
            self._steps[step_id] = saved
        with self._jobs_lock:
            self._jobs.append((step_id, host_work))
        if copied is None:
            self._drain(None)
        return step_id

    def materialize(self, step_id: int, req_ids: Sequence[str]) -> StageOutputs:
        """Per-request rows of a saved step (see the module doc); consumes ``step_id``."""
        req_ids = list(req_ids)
        self._drain(step_id)
        with self._lock:
            # The rules refuse (StepIdError, UnknownRequestError, UnservableHitError)
            # before consuming anything.
            self._refuse_saving(step_id)
            index, prefix = self._rules.materialize(step_id, req_ids)
            saved = self._steps.pop(step_id)
            skips = self._deliver(saved, req_ids, prefix) if self._deliver_once else None
            if self._savers_waiting:
                self._consumed.notify_all()
        hidden: dict[str, torch.Tensor] | None = None
        mm: dict[str, dict[str, Any]] = {}
        for name, key in self._keys.items():
            plain = saved.plain.get(name)
            if plain is None:
                continue
            flat = len(key.row_shape) == 1
            per_req: dict[str, torch.Tensor] = {}
            for j, (r, i, full) in enumerate(zip(req_ids, index, prefix, strict=True)):
                t = saved.prefix[i][name] if full else plain[i]
                if skips is not None and skips[j]:
                    t = t[skips[j] :]
                per_req[r] = t if flat else t.reshape(t.shape[0], *key.row_shape)
            if name == HIDDEN_KEY:
                hidden = per_req
            else:
                mm[name] = per_req
        if saved.leftover:
            self._pass_through(saved, req_ids, mm)
        return StageOutputs(hidden_states=hidden, mm_outputs=mm)

    def discard_step(self, step_id: int) -> None:
        """Consumes ``step_id`` without reading it (its rows stay cached)."""
        self._drain(step_id)
        with self._lock:
            self._refuse_saving(step_id)
            self._rules.discard(step_id)
            saved = self._steps.pop(step_id)
            if self._retiring:
                self._retire_after(saved)
            if self._savers_waiting:
                self._consumed.notify_all()

    def shutdown(self) -> None:
        """Nothing runs in the background; kept for vllm-omni's interface."""

    # ------------------------------------------------------------------ internals

    def _deliver(
        self, saved: _SavedStep, req_ids: list[str], prefix: Sequence[bool]
    ) -> list[int] | None:
        """The delivery watermark (under the lock): per requested id, how many of the rows
        this materialize would hand out were handed out already, and the watermark moved
        past the rest. vllm-omni's runners append every materialized request's rows to
        the request's payload for the next stage (``accumulate_full_payload_output``), so
        the rows of a request recomputed after preemption (positions from its hit, or 0)
        would follow the rows it had delivered before: from its resumption on, its rows
        below the furthest position handed out before it are not handed out again. A
        first hit sent back for recomputation hands out nothing (the scheduler drops that
        output; its next step is served its prefix), the watermark unmoved. Outside a
        resumption every row is handed out as vllm-omni hands it out (a rejected draft's
        row, and the real token's at its position after it, alike: vllm-omni's drafting
        payload, which the ``hscache_spec`` arm compares; the watermark then follows the
        rollback). None: nothing skipped."""
        delivered, floors = self._delivered, self._floors
        if not (saved.resumed or saved.recomputed or floors) and req_ids == saved.req_ids:
            # The common step: nothing to hold back; the watermarks move to the rows' ends.
            delivered.update(zip(req_ids, map(int.__add__, saved.starts, saved.sizes), strict=True))
            if self._retiring:
                self._retire_after(saved)
            return None
        pos = {r: i for i, r in enumerate(saved.req_ids)}
        skips: list[int] = []
        for r, full in zip(req_ids, prefix, strict=True):
            i = pos[r]
            first = 0 if full else saved.starts[i]
            end = saved.starts[i] + saved.sizes[i]
            if r in saved.resumed:
                # Steps are consumed in order: every row before the preemption was handed
                # out (or its step discarded) by now.
                floors[r] = delivered.get(r, 0)
            if r in saved.recomputed:  # its output is dropped; its next step is served
                skips.append(end - first)
                continue
            floor = floors.get(r, 0)
            skips.append(max(0, min(floor, end) - first))
            if floor and end >= floor:
                del floors[r]
            if end > delivered.get(r, 0):  # a resumed request recomputing below it
                delivered[r] = end
        if self._retiring:
            self._retire_after(saved)
        return skips

    def _retire(self, finished: Any) -> None:
        """Forgets finished requests' watermarks, once no unconsumed step has their rows."""
        with self._lock:
            waiting: set[str] = set()
            for saved in self._steps.values():
                waiting.update(saved.req_ids)
            for r in finished:
                if r in waiting:  # its rows are still to be handed out (a step late)
                    self._retiring.add(r)
                else:
                    self._delivered.pop(r, None)
                    self._floors.pop(r, None)

    def _retire_after(self, consumed: _SavedStep) -> None:
        """Under the lock, ``consumed`` gone from ``_steps``: retires its finished requests
        that no other unconsumed step has."""
        done = self._retiring.intersection(consumed.req_ids)
        if not done:
            return
        for saved in self._steps.values():
            done.difference_update(saved.req_ids)
        for r in done:
            self._retiring.discard(r)
            self._delivered.pop(r, None)
            self._floors.pop(r, None)

    def _wait_for_room(self) -> None:
        """Waits (up to ``step_wait_s``) until fewer than ``max_unconsumed_steps`` saved
        steps are unconsumed: the async output thread may be a step behind."""
        deadline = time.monotonic() + self._settings.step_wait_s
        with self._consumed:
            while True:
                try:
                    self._rules.check_room()
                    return
                except StepIdError as e:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StepIdError(
                            f"{e} (waited {self._settings.step_wait_s} s for a "
                            "materialize or discard_step)"
                        ) from None
                    self._savers_waiting += 1
                    try:
                        self._consumed.wait(left)
                    finally:
                        self._savers_waiting -= 1

    def _refuse_saving(self, step_id: object) -> None:
        """``StepIdError`` for a step id issued but still being saved (its rows are not
        kept yet); called under the lock, before the rules consume anything."""
        if isinstance(step_id, int) and step_id in self._saving:
            raise StepIdError(f"step {step_id} is still being saved")

    def _plan_unsaved(self, so: _Step) -> None:
        """Applies a step nothing was saved for: its tables count, its rows do not."""
        if self._keyless:
            return
        if self._cache is None:
            self._backlog.append(so)
        else:
            self._cache.update_from_scheduler_output(so.output, rereads=so.rereads)

    def _check_keys(self, rows: Mapping[str, torch.Tensor]) -> dict[str, _Key]:
        """The step's per-token keys, checked against the cache's (same names, row
        shapes and dtypes)."""
        known = self._keys
        if (
            self._cache is not None
            and rows.keys() == known.keys()
            and all(
                t.shape[1:] == known[name].row_shape and t.dtype == known[name].dtype
                for name, t in rows.items()
            )
        ):
            return known  # the steady case: the first saved step's keys again
        found = {
            name: _Key(name, tuple(int(d) for d in t.shape[1:]), t.dtype)
            for name, t in rows.items()
        }
        if self._keyless and found:
            raise UnsupportedOutputError(
                f"per-token outputs {sorted(found)}; the first saved step had none, so "
                "this cache holds none"
            )
        if self._cache is None:
            return found
        if found.keys() != self._keys.keys():
            raise UnsupportedOutputError(
                f"per-token outputs {sorted(found)}; the cache holds {sorted(self._keys)} "
                "(every step must carry the keys of the first saved step)"
            )
        for name, key in found.items():
            want = self._keys[name]
            if key.row_shape != want.row_shape or key.dtype != want.dtype:
                raise InvalidArgumentError(
                    f"outputs[{name!r}]: rows {key.row_shape} {key.dtype}; the cache holds "
                    f"{want.row_shape} {want.dtype}"
                )
        return found

    def _build(self, keys: dict[str, _Key], rows: Mapping[str, torch.Tensor]) -> None:
        storage = self._settings.storage
        device = next(iter(rows.values())).device
        pin = False
        if storage == "device":
            where: torch.device = device
        else:
            where = torch.device("cpu")
            pin = storage == "pinned" and torch.cuda.is_available()
        cache = HiddenStateCache(
            self._num_blocks,
            self._block_size,
            {k.name: (k.width, k.dtype) for k in keys.values()},
            where,
            kv_cache_group=self._kv_cache_group,
            pin_memory=pin,
        )
        for so in self._backlog:
            cache.update_from_scheduler_output(so.output, rereads=so.rereads)
        self._backlog.clear()
        self._cache = cache
        self._keys = keys

    def _plan(self, so: _Step, plan: OmniSavePlan) -> StepPlan:
        """Plans the step in the mirror (its rows in the rules' layout)."""
        cache = self._cache
        assert cache is not None
        step = cache.update_from_scheduler_output(so.output, order=plan.req_ids, rereads=so.rereads)
        if step.num_rows != plan.num_rows:
            raise InvalidArgumentError(
                f"the step has {plan.num_rows} rows; the mirror planned {step.num_rows}"
            )
        return step

    def _stage(
        self, flat: Mapping[str, torch.Tensor], rest: Mapping[str, Any]
    ) -> tuple[Mapping[str, torch.Tensor], Any, dict[str, Any]]:
        """``(rows, copied event or None, pass-through outputs on the host)``. Rows on a
        CUDA device bound for host storage are copied into pinned memory without blocking,
        on a copy stream that waits for the current stream (the forward that made them);
        the event marks the copies' end. Everything else: the rows as they are, no event
        (the caller's host work runs at once), the pass-through outputs copied now."""
        cache = self._cache
        assert cache is not None
        device = next(iter(flat.values())).device
        if device.type != "cuda" or cache.device.type == "cuda":
            return flat, None, _host_copy(rest)
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            staged = {name: _pinned_copy(t, stream) for name, t in flat.items()}
            leftover = _host_copy(rest, stream)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(stream)
        self._last_copy = (device, copied)
        return staged, copied, leftover

    def _drain(self, upto: object) -> None:
        """Runs the saved steps' host work in order, up to step ``upto`` (every step's
        for None; nothing for an id that is not an int: the rules refuse it after)."""
        if upto is not None and not isinstance(upto, int):
            return
        while True:
            with self._jobs_lock:
                if not self._jobs or (upto is not None and self._jobs[0][0] > upto):
                    return
                step_id, work = self._jobs[0]
                try:
                    work()
                except BaseException:
                    # The step's rows never reached the storage or its kept copies: it
                    # is consumed here, so that nothing hands them out.
                    self._jobs.popleft()
                    with self._lock:
                        self._steps.pop(step_id, None)
                        try:
                            self._rules.discard(step_id)
                        except StepIdError:
                            pass
                    raise
                self._jobs.popleft()

    @staticmethod
    def _keep(
        saved: _SavedStep,
        step_rows: StepRows,
        flat: Mapping[str, torch.Tensor],
        prefix: list[int],
        plain_rows: bytearray | None,
        plain_sizes: list[int],
        private: bool = False,
    ) -> None:
        """Keeps what the step's materialize may hand out, in host memory: the full rows
        of the requests served their prefix (the mirror's gather), and one copy of the
        plain requests' rows (the runner reuses its output buffers). Rows of the prefix
        requests and of refused hits are not copied again."""
        req_ids = saved.req_ids
        saved.prefix = [
            {name: step_rows.rows(req_ids[i], name).cpu() for name in flat} for i in prefix
        ]
        if plain_rows is None:  # every request plain: the whole step
            copies = (
                dict(flat)  # a private host copy already (staged off the device)
                if private
                else {name: t.detach().to("cpu", copy=True) for name, t in flat.items()}
            )
        elif plain_sizes:
            idx = index_view(plain_rows)
            copies = {name: t.index_select(0, idx.to(t.device)).cpu() for name, t in flat.items()}
        else:  # nothing plain: nothing of the step's own rows is ever handed out
            saved.plain = {name: () for name in flat}
            return
        # One split per key for the whole batch (views), not a slice per request.
        saved.plain = {name: torch.split(t, plain_sizes) for name, t in copies.items()}

    def _pass_through(
        self, saved: _SavedStep, req_ids: list[str], mm: dict[str, dict[str, Any]]
    ) -> None:
        """The outputs that are not one row per token, per request, as vllm-omni splits them."""
        try:
            from vllm_omni.utils.mm_outputs import to_payload_element
        except ImportError:  # without vllm-omni: the whole value for every request
            for key, val in saved.leftover.items():
                mm[key] = dict.fromkeys(req_ids, val)
            return
        order = saved.req_ids
        starts = [0]
        for n in saved.sizes:
            starts.append(starts[-1] + n)
        total = starts[-1]
        for key, val in saved.leftover.items():
            mm[key] = {}
            for r in req_ids:
                i = order.index(r)
                mm[key][r] = to_payload_element(
                    val,
                    i,
                    start=starts[i],
                    end=starts[i + 1],
                    pass_lists_through=True,
                    seq_len=total,
                )
