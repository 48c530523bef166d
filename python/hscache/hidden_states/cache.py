"""Hidden-state output cache: per-token model outputs of prefix-cached tokens, in torch tensors.

A multi-stage (omni) model's second stage needs the first stage's hidden states for the
*whole* prompt, but on a prefix-cache hit vLLM only computes the uncached tail. This module
keeps one row per KV slot for each declared key (``slot = block_id * block_size + offset``)
in a tensor preallocated once, writes every computed row after the forward pass, and serves a
hit request's full rows (cached prefix + this step's rows) from it.

Every index comes from the Rust :class:`hscache._core.SlotMirror` (``src/slots/``), which is
fed the step's facts from vLLM's ``SchedulerOutput`` and decides what may be read:

- each block has a version, bumped when the block is assigned fresh or loaded by a KV
  connector, and counts of leading rows written in that version; a hit is served only if
  every row it reads was written in its block's current version, otherwise it is a reported
  miss (``StepRows.misses``) and none of its cached rows are returned: never zeros, never
  another request's rows;
- the step's writes are counted before its reads are validated, so a same-step hit (B hits
  blocks that A computes in this very step) is served from A's rows; a planned step that is
  never written (an aborted request) writes nothing;
- keys produced by KV-sharing skip layers (``skip_layer_keys``, vLLM's
  ``--kv-sharing-fast-prefill``) are written only for the tokens those layers computed; a
  hit over rows they skipped is served without those keys (``StepRows.partial``);
- the cached span ends at a block boundary and the step's computed span starts at the same
  boundary: for a non-aligned hit (external KV) ``StepPlan.compute_start`` is *before*
  vLLM's ``num_computed_tokens`` and the caller's forward pass recomputes the gap;
- reads can be deferred (``write`` now, ``gather`` later): each read remembers its blocks'
  versions, and a block reassigned in between turns the read into a miss.

The mirror follows one KV-cache group: :func:`full_attention_group` picks the group that
carries full-attention positions in vLLM's ``KVCacheConfig`` (sliding-window and Mamba
groups drop positions), and :meth:`HiddenStateCache.from_kv_cache_config` uses it.

Per step the hot path is one ``plan`` crossing into Rust, one ``index_copy_`` per key, one
``commit`` crossing, and, when the step has hits, one ``index_select`` per key for all of
them; a request's rows are a slice of that gather (no per-request ``torch.cat``). Slot
mappings come back from Rust as int64 buffers that become tensors without a copy. On CUDA the
indices go through pinned memory with ``non_blocking`` copies and nothing synchronizes.

Usage, one step::

    cache = HiddenStateCache.from_kv_cache_config(
        kv_cache_config, keys={"hidden": (2048, torch.bfloat16)}, device="cuda")
    plan = cache.update_from_scheduler_output(scheduler_output, order=input_batch_req_ids)
    # forward: rows for positions plan.compute_start[i] .. plan.num_tokens[i] of every
    # request i, laid out at plan.query_start_loc[i]
    rows = cache.write_and_gather(plan, {"hidden": hidden_states})
    for req_id in rows.req_ids:
        full = rows.rows(req_id, "hidden")  # positions rows.start(req_id) .. num_tokens
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch

from hscache._core import SlotMirror, SlotReads
from hscache.exceptions import InvalidArgumentError
from hscache.hidden_states.steps import StepPlan, StepRows, index_view

__all__ = [
    "HiddenStateCache",
    "KeySpec",
    "StepPlan",
    "StepRows",
    "full_attention_group",
]

KeySpec = tuple[int, torch.dtype]
"""``(width, dtype)`` of one cached key: one row of ``width`` elements per token."""


def full_attention_group(kv_cache_config: Any) -> int:
    """The index of the KV-cache group that carries full-attention positions (every token
    of a request maps to its own block), the group a hidden-state cache follows.

    The first group whose spec is vLLM's ``FullAttentionSpec`` (MLA and attention sinks
    included) without a sliding window, chunking or R-SWA eviction, and that is neither an
    EAGLE draft group nor host resident. Sliding-window, chunked-local and Mamba groups put
    the null block where they dropped positions, cross-attention groups index encoder tokens.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, RSWASpec, UniformTypeKVCacheSpecs

    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None:
        raise TypeError(f"expected vLLM's KVCacheConfig, got {type(kv_cache_config).__name__}")
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.first_spec
        if (
            isinstance(spec, FullAttentionSpec)
            and not isinstance(spec, RSWASpec)
            and spec.sliding_window is None
            and spec.attention_chunk_size is None
            and not getattr(group, "is_eagle_group", False)
            and not getattr(group, "host_resident", False)
        ):
            return i
    kinds = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
    raise InvalidArgumentError(
        f"no KV-cache group carries full-attention positions ({kinds}); the hidden-state "
        "cache needs one"
    )


class HiddenStateCache:
    """Per-token outputs (hidden states, captured layers) of prefix-cached tokens.

    ``keys`` declares every cached quantity as ``name -> (width, dtype)``; each gets one
    ``(num_blocks * block_size, width)`` tensor on ``device``, allocated once (a failed
    allocation raises ``MemoryError``). ``skip_layer_keys`` names the keys produced by
    KV-sharing skip layers (written only for the tokens those layers computed under fast
    prefill). ``kv_cache_group`` picks the KV-cache group whose block tables index the rows
    (:func:`full_attention_group`); one group suffices because hidden states are one row per
    token. ``pin_memory`` (a CPU ``device`` only) page-locks the storage, so that rows move
    between it and an accelerator without a bounce buffer.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        keys: Mapping[str, KeySpec],
        device: torch.device | str = "cpu",
        *,
        kv_cache_group: int = 0,
        skip_layer_keys: Collection[str] = (),
        pin_memory: bool = False,
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
        unknown = set(skip_layer_keys) - set(specs)
        if unknown:
            raise InvalidArgumentError(f"skip_layer_keys {sorted(unknown)} are not declared keys")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:  # torch's own words for an unknown device
            raise InvalidArgumentError(f"device {device!r}: {e}") from e
        self._mirror = SlotMirror(
            num_blocks=num_blocks, block_size=block_size, kv_cache_group=kv_cache_group
        )
        self._mirror_id = self._mirror.mirror_id
        self._specs = specs
        self._skip_keys = frozenset(skip_layer_keys)
        num_slots = num_blocks * block_size
        try:
            self._tensors: dict[str, torch.Tensor] = {
                # Zeroed, i.e. committed now: no first-touch page faults on the hot path
                # and no out-of-memory mid-serving. Zeros are never served.
                name: torch.zeros(
                    (num_slots, width), dtype=dtype, device=device, pin_memory=pin_memory
                )
                for name, (width, dtype) in specs.items()
            }
        except RuntimeError as e:  # torch's CPU and CUDA allocation failures
            if "memory" not in str(e).lower() and "alloc" not in str(e).lower():
                raise
            raise MemoryError(
                f"hidden-state cache: {num_slots} rows x {self.bytes_per_token()} bytes "
                f"on {device}: {e}"
            ) from e
        # "cuda" -> "cuda:N": the device the storage landed on, as tensors report it.
        self._device = next(iter(self._tensors.values())).device
        self._cuda = self._device.type == "cuda"
        # Per key: (tensor, width, dtype, is a skip-layer key), for the hot path.
        self._write_specs = [
            (name, self._tensors[name], w, d, name in self._skip_keys)
            for name, (w, d) in specs.items()
        ]

    @classmethod
    def from_kv_cache_config(
        cls,
        kv_cache_config: Any,
        keys: Mapping[str, KeySpec],
        device: torch.device | str = "cpu",
        *,
        skip_layer_keys: Collection[str] = (),
    ) -> HiddenStateCache:
        """A cache sized and indexed by vLLM's ``KVCacheConfig``: its pool's blocks, the
        block size of the group that carries full-attention positions, that group's tables."""
        group = full_attention_group(kv_cache_config)
        spec = kv_cache_config.kv_cache_groups[group].kv_cache_spec
        return cls(
            kv_cache_config.num_blocks,
            spec.block_size,
            keys,
            device,
            kv_cache_group=group,
            skip_layer_keys=skip_layer_keys,
        )

    # ------------------------------------------------------------------ properties

    @property
    def num_blocks(self) -> int:
        return self._mirror.num_blocks

    @property
    def block_size(self) -> int:
        return self._mirror.block_size

    @property
    def kv_cache_group(self) -> int:
        return self._mirror.kv_cache_group

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def keys(self) -> Mapping[str, KeySpec]:
        return dict(self._specs)

    @property
    def skip_layer_keys(self) -> frozenset[str]:
        return self._skip_keys

    @property
    def mirror(self) -> SlotMirror:
        """The Rust slot mirror (versions, tables, counters)."""
        return self._mirror

    def tensor(self, key: str) -> torch.Tensor:
        """The ``(num_blocks * block_size, width)`` storage of ``key`` (``KeyError`` for
        an undeclared key)."""
        t = self._tensors.get(key) if isinstance(key, str) else None
        if t is None:
            raise KeyError(f"{key!r} is not a declared key ({sorted(self._tensors)})")
        return t

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of storage per key."""
        return {k: t.numel() * t.element_size() for k, t in self._tensors.items()}

    def bytes_per_token(self) -> int:
        """Bytes one cached token costs, all keys together."""
        return sum(w * d.itemsize for w, d in self._specs.values())

    def stats(self) -> dict[str, int]:
        """The mirror's counters (steps, reads served, misses, partial and stale reads, ...)."""
        return self._mirror.stats()

    # ------------------------------------------------------------------ planning

    def update_from_scheduler_output(
        self,
        scheduler_output: Any,
        order: Iterable[str] | None = None,
        *,
        external_tokens: Mapping[str, int] | None = None,
        connector_versions: Mapping[int, int] | None = None,
        fast_prefill: bool = False,
        num_reqs_padded: int | None = None,
        num_logits_padded: int = 0,
        rereads: Collection[str] | None = None,
    ) -> StepPlan:
        """Plans a step from vLLM's ``SchedulerOutput``.

        New requests and resumed ones (``resumed_req_ids``, or re-added by the v2 model
        runner) take their whole block table and their hit from ``num_computed_tokens``;
        running ones append ``new_block_ids``; ``finished_req_ids`` and ``preempted_req_ids``
        are forgotten; ``new_block_ids_to_zero``, when sent, marks fresh blocks. Rows are
        laid out new requests first, then cached ones, unless ``order`` (the model runner's
        batch order) lists the scheduled request ids.

        KV connectors: ``external_tokens[req_id]`` is how many of a new request's computed
        tokens a connector loaded (the tail of its hit); their blocks count as unwritten
        unless ``connector_versions`` (``block -> version`` from ``mirror.block_state``)
        vouches for them. With a connector (``kv_connector_metadata`` set) and no
        ``external_tokens``, every hit is treated as loaded.

        ``fast_prefill``: also plan the KV-sharing skip layers' reduced batch over this
        plan's layout (``StepPlan.prefill_skip``; a request samples once its prompt is
        complete; drafts from ``scheduled_spec_decode_tokens``).

        ``rereads``: running requests that read their rows ``[0, end)`` again, their
        tables unchanged: a first hit the mirror refused, which vLLM's scheduler rolled
        back to a block boundary (its ``num_computed_tokens`` here) and recomputes.
        """
        return StepPlan(
            self._mirror.plan_scheduler_output(
                scheduler_output,
                order,
                external_tokens=external_tokens,
                connector_versions=connector_versions,
                fast_prefill=fast_prefill,
                num_reqs_padded=num_reqs_padded,
                num_logits_padded=num_logits_padded,
                rereads=frozenset(rereads) if rereads else None,
            ),
            self._device,
        )

    def plan_step(
        self,
        *,
        new: Iterable[tuple[str, Sequence[int], int, int]] = (),
        running: Iterable[tuple[str, Sequence[int], int]] = (),
        finished: Iterable[str] = (),
        fresh_block_ids: Iterable[int] | None = None,
        order: Iterable[str] | None = None,
        external_tokens: Mapping[str, int] | None = None,
        connector_versions: Mapping[int, int] | None = None,
        num_prompt_tokens: Mapping[str, int] | None = None,
        spec_tokens: Mapping[str, int] | None = None,
        fast_prefill: bool = False,
        num_reqs_padded: int | None = None,
        num_logits_padded: int = 0,
    ) -> StepPlan:
        """Plans a step from plain ids.

        ``new``: ``(req_id, block_ids, num_computed_tokens, num_scheduled_tokens)`` for
        first schedules (resumed requests too: the table is replaced). ``running``:
        ``(req_id, new_block_ids, num_scheduled_tokens)``. ``finished``: ids to forget first.
        ``num_prompt_tokens`` (new requests) and ``spec_tokens`` (draft counts) feed fast
        prefill; the other options are those of :meth:`update_from_scheduler_output`.
        """
        return StepPlan(
            self._mirror.plan(
                new=list(new),
                running=list(running),
                finished=list(finished),
                fresh_block_ids=None if fresh_block_ids is None else list(fresh_block_ids),
                order=order,
                external_tokens=external_tokens,
                connector_versions=connector_versions,
                num_prompt_tokens=num_prompt_tokens,
                spec_tokens=spec_tokens,
                fast_prefill=fast_prefill,
                num_reqs_padded=num_reqs_padded,
                num_logits_padded=num_logits_padded,
            ),
            self._device,
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
    ) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor, bool]], set[str]]:
        """``(key, storage, rows, skip-layer key)`` per key, and the skip keys given reduced."""
        n = plan.num_rows
        kept = plan.num_kept if self._skip_keys else n
        cuda = self._cuda
        out: list[tuple[str, torch.Tensor, torch.Tensor, bool]] = []
        reduced: set[str] = set()
        if not isinstance(outputs, Mapping):
            raise TypeError(f"outputs must map key -> tensor, got {type(outputs).__name__}")
        for key, storage, width, dtype, skip in self._write_specs:
            t = outputs.get(key)
            if t is None:
                raise InvalidArgumentError(f"outputs lack declared key {key!r}")
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(
                    f"outputs[{key!r}] is a {type(t).__name__}; expected a torch.Tensor"
                )
            shape = t.shape
            if shape == (n, width):
                pass
            elif skip and kept != n and shape == (kept, width):
                reduced.add(key)  # the skip layers' own output: kept rows only
            elif len(shape) == 2 and shape[1] == width and shape[0] > n:
                t = t.narrow(0, 0, n)  # CUDA-graph padding
            else:
                want = f"({n}, {width})" + (f" or ({kept}, {width})" if skip else "")
                raise InvalidArgumentError(
                    f"outputs[{key!r}] has shape {tuple(shape)}; expected {want}"
                )
            if t.dtype is not dtype:
                raise InvalidArgumentError(f"outputs[{key!r}] is {t.dtype}; key is {dtype}")
            if t.is_cuda != cuda or (cuda and t.device != self._device):
                t = t.to(self._device, non_blocking=cuda)
            out.append((key, storage, t, skip))
        return out, reduced

    def write(self, plan: StepPlan, outputs: Mapping[str, torch.Tensor]) -> SlotReads:
        """Writes the step's rows (one ``index_copy_`` per key), then commits the step in the
        mirror and returns its validated reads (gather them now or later with ``gather``).

        ``outputs[key]`` holds ``plan.num_rows`` rows (more are ignored: padding) laid out by
        ``plan.query_start_loc``; a skip-layer key may instead hold only the ``plan.num_kept``
        rows those layers computed. Everything is checked before the first write; a plan
        made by another cache is refused.
        """
        self._check_plan(plan)
        rows, reduced = self._checked_rows(plan, outputs)
        self._write_rows(plan, rows, reduced)
        return self._mirror.commit(plan.step_id, plan.mirror_id)

    def commit(self, plan: StepPlan) -> SlotReads:
        """Commits the step in the mirror before its rows are written (the rows then go in
        with :meth:`write_committed`, before any later read of the storage): the step's
        writes are counted, its reads validated. For a caller that moves the rows to the
        storage asynchronously and orders every storage access itself."""
        self._check_plan(plan)
        return self._mirror.commit(plan.step_id, plan.mirror_id)

    def write_committed(
        self, plan: StepPlan, reads: SlotReads, outputs: Mapping[str, torch.Tensor]
    ) -> StepRows:
        """Writes the rows of a step :meth:`commit` took, then serves its reads (the
        second half of :meth:`write_and_gather`); the caller keeps the order of steps."""
        if not isinstance(plan, StepPlan) or not isinstance(reads, SlotReads):
            raise TypeError(
                f"expected (StepPlan, SlotReads), got ({type(plan).__name__}, "
                f"{type(reads).__name__})"
            )
        if plan.mirror_id != self._mirror_id or reads.step_id != plan.step_id:
            raise InvalidArgumentError(
                f"reads of step {reads.step_id} with plan {plan.step_id} of another cache"
            )
        rows, reduced = self._checked_rows(plan, outputs)
        self._write_rows(plan, rows, reduced)
        return self._rows(plan, reads, outputs)

    def _check_plan(self, plan: StepPlan) -> None:
        if not isinstance(plan, StepPlan):
            raise TypeError(f"expected a StepPlan (plan_step's result), got {type(plan).__name__}")
        if plan.mirror_id != self._mirror_id:
            raise InvalidArgumentError(
                f"step {plan.step_id} was planned by another HiddenStateCache; a cache "
                "writes only its own plans"
            )
        if self._mirror.pending_step != plan.step_id:
            raise InvalidArgumentError(
                f"step {plan.step_id} is not the pending step "
                f"({self._mirror.pending_step}); plans are written once, in order"
            )

    def _write_rows(
        self,
        plan: StepPlan,
        rows: list[tuple[str, torch.Tensor, torch.Tensor, bool]],
        reduced: set[str],
    ) -> None:
        if not plan.num_rows:
            return
        index = plan.write_slots
        if self._cuda:
            index = self._to_device(index)
        partial = bool(self._skip_keys) and plan.num_kept != plan.num_rows
        kept_index: torch.Tensor | None = None
        kept_rows: torch.Tensor | None = None
        for key, storage, t, skip in rows:
            if not (skip and partial):
                storage.index_copy_(0, index, t)
                continue
            # A skip-layer key under fast prefill: only the rows those layers computed.
            if kept_index is None:
                kept_index = self._to_device(plan.kept_write_slots)
            if key not in reduced:
                if kept_rows is None:
                    kept_rows = self._to_device(_kept_positions(plan))
                t = t.index_select(0, kept_rows)
            if kept_index.numel():
                storage.index_copy_(0, kept_index, t)

    def _gather(self, reads: SlotReads) -> dict[str, torch.Tensor]:
        if not reads.num_rows:
            return {}
        index = self._to_device(index_view(reads.slots()))
        skip_index = index
        if self._skip_keys and not all(reads.skip_layers):
            skip_index = self._to_device(index_view(reads.slots(skip_layers_only=True)))
        return {
            k: torch.index_select(t, 0, skip_index if k in self._skip_keys else index)
            for k, t in self._tensors.items()
        }

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
        if not isinstance(plan, StepPlan) or not isinstance(reads, SlotReads):
            raise TypeError(
                f"expected (StepPlan, SlotReads), got ({type(plan).__name__}, "
                f"{type(reads).__name__})"
            )
        if reads.step_id != plan.step_id or reads.mirror_id != plan.mirror_id:
            raise InvalidArgumentError(f"reads of step {reads.step_id} with plan {plan.step_id}")
        self._mirror.revalidate(reads)
        return self._rows(plan, reads, outputs)

    def _rows(
        self, plan: StepPlan, reads: SlotReads, outputs: Mapping[str, torch.Tensor] | None
    ) -> StepRows:
        reduced: set[str] = set()
        if self._skip_keys and outputs is not None and plan.num_kept != plan.num_rows:
            reduced = {
                k for k in self._skip_keys if k in outputs and outputs[k].shape[0] == plan.num_kept
            }
        return StepRows(plan, reads, self._gather(reads), outputs, self._skip_keys, reduced)

    def write_and_gather(self, plan: StepPlan, outputs: Mapping[str, torch.Tensor]) -> StepRows:
        """``write`` then ``gather`` in one call: the hot path of a step."""
        reads = self.write(plan, outputs)
        return self._rows(plan, reads, outputs)


def _kept_positions(plan: StepPlan) -> torch.Tensor:
    """Row indices (in the step's layout) of the rows the skip layers computed: the last
    ``kept[i]`` rows of every request ``i``."""
    ends = torch.from_numpy(plan.query_start_loc[1:].copy())
    kept = torch.from_numpy(plan.kept.copy())
    starts = torch.repeat_interleave(ends - kept, kept)
    offsets = torch.arange(int(kept.sum()), dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(kept, 0) - kept, kept
    )
    return starts + offsets
