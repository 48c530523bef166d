"""Hidden-state output cache: per-token model outputs of prefix-cached tokens, in torch tensors.

A multi-stage (omni) model's second stage needs the first stage's hidden states for the
*whole* prompt, but on a prefix-cache hit vLLM only computes the uncached tail. This module
keeps one row per KV slot for each declared key (``slot = block_id * block_size + offset``)
in a tensor preallocated once, writes every computed row after the forward pass, and serves a
hit request's full rows (cached prefix + this step's rows) from it.

Every index comes from the Rust :class:`hscache._core.SlotMirror` (``src/slots.rs``), which
is fed the step's facts from vLLM's ``SchedulerOutput`` and decides what may be read:

- each block has an epoch, bumped when the block is assigned fresh, and a count of leading
  rows written in that epoch; a hit is served only if every row it reads was written in its
  block's current epoch, otherwise it is a reported miss (``StepRows.misses``) and none of
  its cached rows are returned: never zeros, never another request's rows;
- the step's writes are counted before its reads are validated, so a same-step hit (B hits
  blocks that A computes in this very step) is served from A's rows;
- the cached span ends at a block boundary and the step's computed span starts at the same
  boundary: for a non-aligned hit (external KV) ``StepPlan.compute_start`` is *before*
  vLLM's ``num_computed_tokens`` and the caller's forward pass recomputes the gap;
- reads can be deferred (``write`` now, ``gather`` later): each read remembers its blocks'
  epochs, and a block reassigned in between turns the read into a miss.

Per step the hot path is one ``plan`` crossing into Rust, one ``index_copy_`` per key, one
``commit`` crossing, and, when the step has hits, one ``index_select`` per key for all of
them; a request's rows are a slice of that gather (no per-request ``torch.cat``). Slot
mappings come back from Rust as int64 buffers that become tensors without a copy. On CUDA the
indices go through pinned memory with ``non_blocking`` copies and nothing synchronizes.

Usage, one step::

    cache = HiddenStateCache(num_blocks, block_size, keys={"hidden": (2048, torch.bfloat16)},
                             device="cuda")
    plan = cache.update_from_scheduler_output(scheduler_output, order=input_batch_req_ids)
    # forward: rows for positions plan.compute_start[i] .. plan.num_tokens[i] of every
    # request i, laid out at plan.query_start_loc[i]
    rows = cache.write_and_gather(plan, {"hidden": hidden_states})
    for req_id in rows.req_ids:
        full = rows.rows(req_id, "hidden")  # positions rows.start(req_id) .. num_tokens
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from hscache._core import SlotMirror, SlotReads
from hscache.exceptions import InvalidArgumentError, UnknownRequestError

if TYPE_CHECKING:
    from hscache._core import SlotPlan

__all__ = ["HiddenStateCache", "KeySpec", "StepPlan", "StepRows"]

KeySpec = tuple[int, torch.dtype]
"""``(width, dtype)`` of one cached key: one row of ``width`` elements per token."""

_EMPTY_INDEX = torch.empty(0, dtype=torch.int64)


def _index_view(buf: bytearray) -> torch.Tensor:
    # torch.frombuffer rejects an empty buffer; it keeps `buf` alive otherwise.
    if not buf:
        return _EMPTY_INDEX
    return torch.frombuffer(buf, dtype=torch.int64)


class StepPlan:
    """One planned step: which rows the forward pass must produce and where they go.

    Request ``i`` (``req_ids[i]``) computes positions ``compute_start[i]`` to
    ``num_tokens[i] - 1``; its rows sit at ``query_start_loc[i]:query_start_loc[i + 1]`` of
    the step's outputs. ``compute_start`` is block aligned on a hit, so for a non-aligned
    (external) hit it lies before vLLM's ``num_computed_tokens``: recompute the gap.
    ``write_slots`` is the int64 slot of every row, in the same layout.
    """

    __slots__ = (
        "_index",
        "compute_start",
        "num_tokens",
        "query_start_loc",
        "req_ids",
        "step_id",
        "write_slots",
    )

    def __init__(self, raw: SlotPlan) -> None:
        step_id, req_ids, spans, slots = raw
        n = len(req_ids)
        view = np.frombuffer(spans, dtype=np.int64)
        self.step_id: int = step_id
        self.req_ids: list[str] = req_ids
        self.compute_start: npt.NDArray[np.int64] = view[:n]
        self.num_tokens: npt.NDArray[np.int64] = view[n : 2 * n]
        self.query_start_loc: npt.NDArray[np.int64] = view[2 * n :]
        self.write_slots: torch.Tensor = _index_view(slots)
        self._index: dict[str, int] | None = None

    def __repr__(self) -> str:
        return (
            f"StepPlan(step_id={self.step_id}, requests={len(self.req_ids)}, rows={self.num_rows})"
        )

    @property
    def num_rows(self) -> int:
        """Rows the forward pass produces for this step (all requests)."""
        return int(self.query_start_loc[-1])

    def index(self, req_id: str) -> int:
        """Position of ``req_id`` in ``req_ids``."""
        if self._index is None:
            self._index = {r: i for i, r in enumerate(self.req_ids)}
        try:
            return self._index[req_id]
        except KeyError:
            raise UnknownRequestError(f"request {req_id!r} is not in step {self.step_id}") from None


class StepRows:
    """The rows of one step, per request.

    A request whose hit was served gets its full rows, positions ``0`` to ``num_tokens - 1``
    (``start`` is 0); every other request gets the rows computed this step, from
    ``compute_start`` (a missed hit is listed in ``misses`` and has only those rows).
    """

    __slots__ = ("_gathered", "_loc", "_outputs", "hits", "misses", "plan", "reads")

    def __init__(
        self,
        plan: StepPlan,
        reads: SlotReads,
        gathered: Mapping[str, torch.Tensor],
        outputs: Mapping[str, torch.Tensor] | None,
    ) -> None:
        self.plan = plan
        self.reads = reads
        self._gathered = gathered
        self._outputs = outputs
        self.hits: list[str] = [plan.req_ids[i] for i in reads.plan_indices]
        """Requests whose full rows (cached prefix included) were served."""
        self.misses: list[str] = [plan.req_ids[i] for i in reads.misses]
        """Requests with a hit whose cached rows could not be validated (never served)."""
        self._loc: dict[int, tuple[int, int]] | None = None

    @property
    def req_ids(self) -> list[str]:
        return self.plan.req_ids

    def _served(self) -> dict[int, tuple[int, int]]:
        if self._loc is None:
            loc: dict[int, tuple[int, int]] = {}
            offset = 0
            for i, n in zip(self.reads.plan_indices, self.reads.num_tokens, strict=True):
                loc[i] = (offset, n)
                offset += n
            self._loc = loc
        return self._loc

    def start(self, req_id: str) -> int:
        """Position of the first row returned for ``req_id``."""
        i = self.plan.index(req_id)
        return 0 if i in self._served() else int(self.plan.compute_start[i])

    def rows(self, req_id: str, key: str) -> torch.Tensor:
        """Rows of ``req_id`` for ``key``: positions ``start(req_id)`` to ``num_tokens - 1``."""
        i = self.plan.index(req_id)
        served = self._served().get(i)
        if served is not None:
            offset, n = served
            return self._gathered[key].narrow(0, offset, n)
        if self._outputs is None:
            raise UnknownRequestError(f"request {req_id!r}: no rows were read from the cache")
        q = self.plan.query_start_loc
        begin = int(q[i])
        return self._outputs[key].narrow(0, begin, int(q[i + 1]) - begin)

    def items(self, key: str) -> Iterator[tuple[str, int, torch.Tensor]]:
        """``(req_id, start, rows)`` for every request of the step, in plan order."""
        for req_id in self.plan.req_ids:
            yield req_id, self.start(req_id), self.rows(req_id, key)


class HiddenStateCache:
    """Per-token outputs (hidden states, captured layers) of prefix-cached tokens.

    ``keys`` declares every cached quantity as ``name -> (width, dtype)``; each gets one
    ``(num_blocks * block_size, width)`` tensor on ``device``, allocated once. Every step
    writes all declared keys.
    ``kv_cache_group`` picks the (full-attention) KV-cache group whose block tables index the
    rows; one group suffices because hidden states are one row per token.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        keys: Mapping[str, KeySpec],
        device: torch.device | str = "cpu",
        *,
        kv_cache_group: int = 0,
    ) -> None:
        if not keys:
            raise InvalidArgumentError("declare at least one key: keys={'hidden': (D, dtype)}")
        specs: dict[str, KeySpec] = {}
        for name, spec in keys.items():
            if not isinstance(name, str):
                raise InvalidArgumentError(f"key names must be str, got {name!r}")
            if (
                not isinstance(spec, tuple)
                or len(spec) != 2
                or not isinstance(spec[1], torch.dtype)
                or isinstance(spec[0], bool)
                or not isinstance(spec[0], int)
                or spec[0] <= 0
            ):
                raise InvalidArgumentError(
                    f"key {name!r}: expected (width > 0, torch.dtype), got {spec!r}"
                )
            specs[name] = (spec[0], spec[1])
        self._mirror = SlotMirror(
            num_blocks=num_blocks, block_size=block_size, kv_cache_group=kv_cache_group
        )
        self._device = torch.device(device)
        self._specs = specs
        num_slots = num_blocks * block_size
        self._tensors: dict[str, torch.Tensor] = {
            # Zeroed, i.e. committed now: no first-touch page faults on the hot path and
            # no out-of-memory mid-serving. Zeros are never served: validity is tracked.
            name: torch.zeros((num_slots, width), dtype=dtype, device=self._device)
            for name, (width, dtype) in specs.items()
        }
        # "cuda" -> "cuda:N": the device the storage landed on, as tensors report it.
        self._device = next(iter(self._tensors.values())).device
        self._cuda = self._device.type == "cuda"

    # ------------------------------------------------------------------ properties

    @property
    def num_blocks(self) -> int:
        return self._mirror.num_blocks

    @property
    def block_size(self) -> int:
        return self._mirror.block_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def keys(self) -> Mapping[str, KeySpec]:
        return dict(self._specs)

    @property
    def mirror(self) -> SlotMirror:
        """The Rust slot mirror (epochs, tables, counters)."""
        return self._mirror

    def tensor(self, key: str) -> torch.Tensor:
        """The ``(num_blocks * block_size, width)`` storage of ``key``."""
        return self._tensors[key]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of storage per key."""
        return {k: t.numel() * t.element_size() for k, t in self._tensors.items()}

    def bytes_per_token(self) -> int:
        """Bytes one cached token costs, all keys together."""
        return sum(w * d.itemsize for w, d in self._specs.values())

    def stats(self) -> dict[str, int]:
        """The mirror's counters (steps, reads served, misses, stale reads, ...)."""
        return self._mirror.stats()

    # ------------------------------------------------------------------ planning

    def update_from_scheduler_output(
        self, scheduler_output: Any, order: Iterable[str] | None = None
    ) -> StepPlan:
        """Plans a step from vLLM's ``SchedulerOutput``.

        New requests and resumed ones (``resumed_req_ids``, or re-added by the v2 model
        runner) take their whole block table and their hit from ``num_computed_tokens``;
        running ones append ``new_block_ids``; ``finished_req_ids`` and ``preempted_req_ids``
        are forgotten; ``new_block_ids_to_zero``, when sent, marks fresh blocks. Rows are
        laid out new requests first, then cached ones, unless ``order`` (the model runner's
        batch order) lists the scheduled request ids.
        """
        return StepPlan(self._mirror.plan_scheduler_output(scheduler_output, order))

    def plan_step(
        self,
        *,
        new: Iterable[tuple[str, Sequence[int], int, int]] = (),
        running: Iterable[tuple[str, Sequence[int], int]] = (),
        finished: Iterable[str] = (),
        fresh_block_ids: Iterable[int] | None = None,
        order: Iterable[str] | None = None,
    ) -> StepPlan:
        """Plans a step from plain ids.

        ``new``: ``(req_id, block_ids, num_computed_tokens, num_scheduled_tokens)`` for
        first schedules (resumed requests too: the table is replaced). ``running``:
        ``(req_id, new_block_ids, num_scheduled_tokens)``. ``finished``: ids to forget first.
        """
        return StepPlan(
            self._mirror.plan(
                new=list(new),
                running=list(running),
                finished=list(finished),
                fresh_block_ids=None if fresh_block_ids is None else list(fresh_block_ids),
                order=order,
            )
        )

    # ------------------------------------------------------------------ data movement

    def _to_device(self, index: torch.Tensor) -> torch.Tensor:
        if not self._cuda:
            return index
        if index.numel() == 0:
            return index.to(self._device)
        # Pinned staging (torch's caching host allocator keeps it alive until the copy
        # has run), then an asynchronous H2D copy: no host sync.
        pinned = torch.empty(index.numel(), dtype=torch.int64, pin_memory=True)
        pinned.copy_(index)
        return pinned.to(self._device, non_blocking=True)

    def _checked_rows(
        self, plan: StepPlan, outputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        n = plan.num_rows
        rows: dict[str, torch.Tensor] = {}
        for key, (width, dtype) in self._specs.items():
            t = outputs.get(key)
            if t is None:
                raise InvalidArgumentError(f"outputs lack declared key {key!r}")
            if t.dim() != 2 or t.shape[1] != width or t.shape[0] < n:
                raise InvalidArgumentError(
                    f"outputs[{key!r}] has shape {tuple(t.shape)}; expected ({n}, {width})"
                )
            if t.dtype != dtype:
                raise InvalidArgumentError(f"outputs[{key!r}] is {t.dtype}; key is {dtype}")
            if t.shape[0] != n:
                t = t.narrow(0, 0, n)  # CUDA-graph padding
            if t.device != self._device:
                t = t.to(self._device, non_blocking=self._cuda)
            rows[key] = t
        return rows

    def write(self, plan: StepPlan, outputs: Mapping[str, torch.Tensor]) -> SlotReads:
        """Writes the step's rows (one ``index_copy_`` per key), then commits the step in the
        mirror and returns its validated reads (gather them now or later with ``gather``).

        ``outputs[key]`` holds ``plan.num_rows`` rows (more are ignored: padding) laid out by
        ``plan.query_start_loc``. Everything is checked before the first write.
        """
        if self._mirror.pending_step != plan.step_id:
            raise InvalidArgumentError(
                f"step {plan.step_id} is not the pending step "
                f"({self._mirror.pending_step}); plans are written once, in order"
            )
        rows = self._checked_rows(plan, outputs)
        if plan.num_rows:
            index = self._to_device(plan.write_slots)
            for key, t in rows.items():
                self._tensors[key].index_copy_(0, index, t)
        return self._mirror.commit(plan.step_id)

    def _gather(self, reads: SlotReads) -> dict[str, torch.Tensor]:
        if not reads.num_rows:
            return {}
        index = self._to_device(_index_view(reads.slots()))
        return {k: torch.index_select(t, 0, index) for k, t in self._tensors.items()}

    def gather(
        self,
        plan: StepPlan,
        reads: SlotReads,
        outputs: Mapping[str, torch.Tensor] | None = None,
    ) -> StepRows:
        """Serves ``reads`` (from ``write(plan, ...)``) with one ``index_select`` per key.

        The reads are revalidated first: if a block was reassigned since ``write`` (a
        delayed gather), the read becomes a miss. ``outputs`` (the step's rows) lets
        ``StepRows.rows`` also return the requests that read nothing.
        """
        if reads.step_id != plan.step_id:
            raise InvalidArgumentError(f"reads of step {reads.step_id} with plan {plan.step_id}")
        self._mirror.revalidate(reads)
        return StepRows(plan, reads, self._gather(reads), outputs)

    def write_and_gather(self, plan: StepPlan, outputs: Mapping[str, torch.Tensor]) -> StepRows:
        """``write`` then ``gather`` in one call: the hot path of a step."""
        reads = self.write(plan, outputs)
        return StepRows(plan, reads, self._gather(reads), outputs)
