"""KV-sharing prefill skip (vLLM's ``--kv-sharing-fast-prefill``), computed on the host.

In models whose later layers reuse an earlier layer's KV cache (YOCO, Gemma-3n), those
layers only need the tokens whose logits are sampled. vLLM 0.33 rebuilds their reduced
attention metadata on the device every step (``make_kv_sharing_fast_prefill_common_attn_metadata``:
a bucketize, a scatter-add, a cumsum and a copy back to the host). :func:`prefill_skip`
computes the same numbers in one Rust call (``src/prefill_skip.rs``) from the host-side
batch: the kept token indices (the logits indices, padded for CUDA graphs by repeating the
last one), the reduced ``query_start_loc`` (host and device copies from one pinned
transfer), per-request kept counts, ``max_query_len`` and a per-token "computed by the skip
layers" mask. :func:`skip_layer_metadata` turns them into vLLM's ``CommonAttentionMetadata``
for the skip layers; :func:`arm` sets the fields vLLM's runner sets on the batch metadata.

A request that samples keeps its last ``1 + num_spec_tokens`` tokens; one that does not
sample this step (a partial prefill chunk: vLLM discards its sampled token) keeps none. With
every request sampling (the default) the result is vLLM's own. A pure decode batch (no
request with more than one token) is not reduced, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from hscache import _core

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata

__all__ = ["PrefillSkip", "arm", "prefill_skip", "skip_layer_metadata"]

IntArray = Sequence[int] | npt.NDArray[np.integer[Any]]
RawSkip = tuple[int, int, bool, tuple[int, int, int], bytearray, bytearray]
"""What the core returns: ``(num_logits, max_query_len, reduced, lengths, ints, computed)``."""


def _ints(values: IntArray) -> bytes | list[int]:
    """Counts as the core reads them: int64 bytes (one copy) or a list of ints."""
    if isinstance(values, np.ndarray):
        return np.ascontiguousarray(values, dtype=np.int64).tobytes()
    return list(values)


def _view(buf: bytearray, dtype: torch.dtype) -> torch.Tensor:
    # torch.frombuffer rejects an empty buffer; it keeps `buf` alive otherwise.
    return torch.frombuffer(buf, dtype=dtype) if buf else torch.zeros(0, dtype=dtype)


class PrefillSkip:
    """The reduced batch of the KV-sharing (skip) layers for one step.

    ``logits_indices`` (host, int32) are the kept token indices in batch order;
    ``logits_indices_padded`` (on ``device``) pads them to the CUDA-graph size with the last
    one. ``query_start_loc`` (on ``device``) / ``query_start_loc_cpu`` (host) are the reduced
    per-request offsets (``num_reqs_padded + 1`` entries, int32); ``num_kept[i]`` the kept
    tokens of request ``i`` (its last ones); ``computed[t]`` whether token ``t`` goes through
    the skip layers. ``reduced`` is False for a pure decode batch (the skip layers see every
    token and vLLM keeps the batch's metadata).
    """

    __slots__ = (
        "computed",
        "logits_indices",
        "logits_indices_padded",
        "max_query_len",
        "num_kept",
        "num_logits",
        "query_start_loc",
        "query_start_loc_cpu",
        "reduced",
    )

    def __init__(self, raw: RawSkip, device: torch.device | str = "cpu") -> None:
        num_logits, max_query_len, reduced, (n_idx, n_qsl, n_kept), ints, computed = raw
        self.num_logits: int = num_logits
        self.max_query_len: int = max_query_len
        self.reduced: bool = reduced
        host = _view(ints, torch.int32)
        self.logits_indices: torch.Tensor = host[:num_logits]
        self.query_start_loc_cpu: torch.Tensor = host[n_idx : n_idx + n_qsl]
        self.num_kept: npt.NDArray[np.int32] = host[n_idx + n_qsl : n_idx + n_qsl + n_kept].numpy()
        self.computed: torch.Tensor = _view(computed, torch.bool)
        device = torch.device(device)
        staged = host[: n_idx + n_qsl]
        if device.type == "cuda" and staged.numel():
            # One pinned staging buffer and one asynchronous copy for both device
            # tensors; torch's caching host allocator keeps it alive until the copy ran.
            pinned = torch.empty(staged.numel(), dtype=torch.int32, pin_memory=True)
            pinned.copy_(staged)
            staged = pinned.to(device, non_blocking=True)
        elif device.type != "cpu":
            staged = staged.to(device)
        self.logits_indices_padded: torch.Tensor = staged[:n_idx]
        self.query_start_loc: torch.Tensor = staged[n_idx:]

    def __repr__(self) -> str:
        return (
            f"PrefillSkip(num_logits={self.num_logits}, max_query_len={self.max_query_len}, "
            f"reduced={self.reduced}, padded={self.logits_indices_padded.numel()})"
        )


def prefill_skip(
    num_scheduled_tokens: IntArray,
    num_spec_tokens: IntArray | None = None,
    samples: Sequence[bool] | npt.NDArray[np.bool_] | None = None,
    *,
    num_reqs_padded: int | None = None,
    num_logits_padded: int = 0,
    query_start_loc: IntArray | None = None,
    device: torch.device | str = "cpu",
) -> PrefillSkip:
    """The skip layers' reduced batch from the host-side batch numbers, in batch order.

    ``num_scheduled_tokens[i]`` tokens of request ``i``; ``num_spec_tokens[i]`` of them are
    drafts; ``samples[i]`` (default all True) whether it samples this step.
    ``num_reqs_padded`` / ``num_logits_padded`` are the CUDA-graph sizes; a given
    ``query_start_loc`` is checked against the counts. Bad input raises
    ``InvalidArgumentError`` (a ``ValueError``).
    """
    flags: bytes | list[bool] | None = None
    if samples is not None:
        flags = (
            np.ascontiguousarray(samples, dtype=np.bool_).tobytes()
            if isinstance(samples, np.ndarray)
            else [bool(s) for s in samples]
        )
    raw = _core.prefill_skip(
        _ints(num_scheduled_tokens),
        None if num_spec_tokens is None else _ints(num_spec_tokens),
        flags,
        num_reqs_padded=num_reqs_padded,
        num_logits_padded=num_logits_padded,
        query_start_loc=None if query_start_loc is None else _ints(query_start_loc),
    )
    return PrefillSkip(raw, device)


def arm(cm: CommonAttentionMetadata, skip: PrefillSkip) -> CommonAttentionMetadata:
    """``cm`` with the fields vLLM's runner sets for fast prefill (the skip layers' builder
    and the model read them): padded logits indices, their count, the largest per-request
    count."""
    return cm.replace(
        logits_indices_padded=skip.logits_indices_padded,
        num_logits_indices=skip.num_logits,
        max_logits_per_req=skip.max_query_len,
    )


def skip_layer_metadata(
    cm: CommonAttentionMetadata, skip: PrefillSkip | None
) -> CommonAttentionMetadata:
    """vLLM's ``CommonAttentionMetadata`` for the KV-sharing layers, from the host result:
    what ``make_kv_sharing_fast_prefill_common_attn_metadata(arm(cm, skip))`` returns, with
    no device work. ``cm`` itself for a pure decode batch or without a ``skip``."""
    if skip is None or not skip.reduced:
        return cm
    # Imported here: hscache works without vLLM installed; this helper needs it.
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata(
        query_start_loc=skip.query_start_loc,
        query_start_loc_cpu=skip.query_start_loc_cpu,
        seq_lens=cm.seq_lens,
        num_reqs=cm.num_reqs,
        num_actual_tokens=skip.num_logits,
        max_query_len=skip.max_query_len,
        max_seq_len=cm.max_seq_len,
        block_table_tensor=cm.block_table_tensor,
        slot_mapping=cm.slot_mapping,
        causal=True,
        seq_lens_cpu_upper_bound=cm.seq_lens_cpu_upper_bound,
    )
