"""One step of the hidden-state cache: ``StepPlan`` (what the forward pass must produce and
where it goes) and ``StepRows`` (every request's rows after the step).

Both are views over buffers the Rust mirror (``src/slots/``) filled; numpy and torch views
are made on first use, so a decode step that only writes pays for the write slots alone.
:class:`hscache.hidden_states.HiddenStateCache` makes them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from hscache.exceptions import UnknownRequestError
from hscache.hidden_states.prefill_skip import PrefillSkip, RawSkip

if TYPE_CHECKING:
    from hscache._core import SlotPlan, SlotReads

__all__ = ["StepPlan", "StepRows"]

_EMPTY_INDEX = torch.empty(0, dtype=torch.int64)


def index_view(buf: bytearray) -> torch.Tensor:
    """An int64 tensor over ``buf`` (no copy; it keeps ``buf`` alive)."""
    # torch.frombuffer rejects an empty buffer.
    if not buf:
        return _EMPTY_INDEX
    return torch.frombuffer(buf, dtype=torch.int64)


class StepPlan:
    """One planned step: which rows the forward pass must produce and where they go.

    Request ``i`` (``req_ids[i]``) computes positions ``compute_start[i]`` to
    ``num_tokens[i] - 1``; its rows sit at ``query_start_loc[i]:query_start_loc[i + 1]`` of
    the step's outputs. ``compute_start`` is block aligned on a hit, so for a non-aligned
    (external) hit it lies before vLLM's ``num_computed_tokens``: recompute the gap.
    ``write_slots`` is the int64 slot of every row, in the same layout. With fast prefill,
    ``prefill_skip`` is the skip layers' reduced batch over this layout and ``kept[i]`` the
    number of request ``i``'s last rows those layers compute (``kept_write_slots`` their
    slots); otherwise every row is kept.
    """

    __slots__ = (
        "_index",
        "_kept_slots",
        "_skip_raw",
        "_spans",
        "_views",
        "device",
        "mirror_id",
        "num_rows",
        "req_ids",
        "step_id",
        "write_slots",
    )

    def __init__(self, raw: SlotPlan, device: torch.device) -> None:
        mirror_id, step_id, req_ids, spans, slots, kept_slots, skip = raw
        self.mirror_id: int = mirror_id
        self.step_id: int = step_id
        self.req_ids: list[str] = req_ids
        self.write_slots: torch.Tensor = index_view(slots)
        self.num_rows: int = len(slots) // 8
        self.device = device
        self._spans = spans
        self._kept_slots = kept_slots
        self._skip_raw: RawSkip | PrefillSkip | None = skip
        self._views: npt.NDArray[np.int64] | None = None
        self._index: dict[str, int] | None = None

    def _spans_view(self) -> npt.NDArray[np.int64]:
        if self._views is None:
            self._views = np.frombuffer(self._spans, dtype=np.int64)
        return self._views

    @property
    def compute_start(self) -> npt.NDArray[np.int64]:
        """First computed position of every request."""
        n = len(self.req_ids)
        return self._spans_view()[:n]

    @property
    def num_tokens(self) -> npt.NDArray[np.int64]:
        """One past the last computed position of every request."""
        n = len(self.req_ids)
        return self._spans_view()[n : 2 * n]

    @property
    def query_start_loc(self) -> npt.NDArray[np.int64]:
        """Where every request's rows start in the step's outputs (``n + 1`` entries)."""
        n = len(self.req_ids)
        return self._spans_view()[2 * n : 3 * n + 1]

    @property
    def kept(self) -> npt.NDArray[np.int64]:
        """How many of every request's last rows the skip layers compute."""
        n = len(self.req_ids)
        return self._spans_view()[3 * n + 1 :]

    @property
    def num_kept(self) -> int:
        """Rows the skip layers compute in this step (``num_rows`` without fast prefill)."""
        return self.num_rows if self._kept_slots is None else len(self._kept_slots) // 8

    @property
    def kept_write_slots(self) -> torch.Tensor:
        """The slots of the rows the skip layers compute, in plan order."""
        return self.write_slots if self._kept_slots is None else index_view(self._kept_slots)

    @property
    def prefill_skip(self) -> PrefillSkip | None:
        """The skip layers' reduced batch (planned with ``fast_prefill=True``), else None."""
        if self._skip_raw is not None and not isinstance(self._skip_raw, PrefillSkip):
            self._skip_raw = PrefillSkip(self._skip_raw, self.device)
        return self._skip_raw

    def __repr__(self) -> str:
        return (
            f"StepPlan(step_id={self.step_id}, requests={len(self.req_ids)}, rows={self.num_rows})"
        )

    def index(self, req_id: str) -> int:
        """Position of ``req_id`` in ``req_ids``."""
        if self._index is None:
            self._index = {r: i for i, r in enumerate(self.req_ids)}
        try:
            return self._index[req_id]
        except KeyError:
            raise UnknownRequestError(f"request {req_id!r} is not in step {self.step_id}") from None


class StepRows:
    """The rows of one step, per request and key.

    A request whose hit was served gets its full rows, positions ``0`` to ``num_tokens - 1``
    (``start`` is 0); every other request gets the rows computed this step, from
    ``compute_start`` (a missed hit is listed in ``misses`` and has only those rows). Keys of
    the KV-sharing skip layers are served from the cache only where every row was computed
    by those layers (``partial`` lists the hits served without them); otherwise they return
    the rows those layers computed this step: the request's last ``kept`` rows.
    """

    __slots__ = (
        "_gathered",
        "_loc",
        "_outputs",
        "_reduced",
        "_skip_keys",
        "plan",
        "reads",
    )

    def __init__(
        self,
        plan: StepPlan,
        reads: SlotReads,
        gathered: Mapping[str, torch.Tensor],
        outputs: Mapping[str, torch.Tensor] | None,
        skip_keys: Collection[str] = (),
        reduced: Collection[str] = (),
    ) -> None:
        self.plan = plan
        self.reads = reads
        self._gathered = gathered
        self._outputs = outputs
        self._skip_keys = skip_keys
        self._reduced = reduced
        self._loc: tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]] | None = None

    @property
    def hits(self) -> list[str]:
        """Requests whose full rows (cached prefix included) were served."""
        ids = self.plan.req_ids
        return [ids[i] for i in self.reads.plan_indices]

    @property
    def misses(self) -> list[str]:
        """Requests with a hit whose cached rows could not be validated (never served)."""
        ids = self.plan.req_ids
        return [ids[i] for i in self.reads.misses]

    @property
    def partial(self) -> list[str]:
        """Hits served without the skip-layer keys (their rows were never computed)."""
        ids = self.plan.req_ids
        r = self.reads
        return [ids[i] for i, s in zip(r.plan_indices, r.skip_layers, strict=True) if not s]

    @property
    def req_ids(self) -> list[str]:
        return self.plan.req_ids

    def _served(self, key: str | None) -> dict[int, tuple[int, int]]:
        """``plan index -> (offset in the gather, rows)`` for the keys of every layer
        (``key`` None or not a skip key) or for the skip-layer keys."""
        if self._loc is None:
            every: dict[int, tuple[int, int]] = {}
            skip: dict[int, tuple[int, int]] = {}
            offset = offset_skip = 0
            for i, n, s in zip(
                self.reads.plan_indices,
                self.reads.num_tokens,
                self.reads.skip_layers,
                strict=True,
            ):
                every[i] = (offset, n)
                offset += n
                if s:
                    skip[i] = (offset_skip, n)
                    offset_skip += n
            self._loc = (every, skip)
        return self._loc[1] if key is not None and key in self._skip_keys else self._loc[0]

    def start(self, req_id: str, key: str | None = None) -> int:
        """Position of the first row returned for ``req_id`` (and ``key``: a skip-layer key
        may start later)."""
        i = self.plan.index(req_id)
        if i in self._served(key):
            return 0
        if key is not None and key in self._skip_keys:
            return int(self.plan.num_tokens[i] - self.plan.kept[i])
        return int(self.plan.compute_start[i])

    def rows(self, req_id: str, key: str) -> torch.Tensor:
        """Rows of ``req_id`` for ``key``: positions ``start(req_id, key)`` to the last."""
        i = self.plan.index(req_id)
        served = self._served(key).get(i)
        if served is not None:
            offset, n = served
            return self._gathered[key].narrow(0, offset, n)
        if self._outputs is None:
            raise UnknownRequestError(f"request {req_id!r}: no rows were read from the cache")
        q = self.plan.query_start_loc
        end = int(q[i + 1])
        if key in self._skip_keys:
            kept = int(self.plan.kept[i])
            if key in self._reduced:
                # The skip layers' own output: only the kept rows, request after request.
                begin = int(self.plan.kept[:i].sum())
                return self._outputs[key].narrow(0, begin, kept)
            return self._outputs[key].narrow(0, end - kept, kept)
        begin = int(q[i])
        return self._outputs[key].narrow(0, begin, end - begin)

    def items(self, key: str) -> Iterator[tuple[str, int, torch.Tensor]]:
        """``(req_id, start, rows)`` for every request of the step, in plan order."""
        for req_id in self.plan.req_ids:
            yield req_id, self.start(req_id, key), self.rows(req_id, key)
