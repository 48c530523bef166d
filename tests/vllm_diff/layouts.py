"""KV-cache layouts of differential traces: one short string names a list of KV-cache groups.

A layout is ``"+"``-joined group tokens ``kind:block_size[:option]...`` (JSON-able, so that
repro files carry it, and readable in a test id):

==========  ===============================================  ==============================
kind        vLLM spec (``hscache_tools.testing.kv_cache``)          options
==========  ===============================================  ==============================
``fa``      ``FullAttentionSpec``                             ``eagle``
``mla``     ``MLAAttentionSpec``                              ``eagle``
``swa``     ``SlidingWindowSpec``                             ``w=<window>``, ``mla``, ``eagle``
``cl``      ``ChunkedLocalAttentionSpec``                     ``c=<chunk>``
``mamba``   ``MambaSpec``                                     ``mode=none|all|align``,
                                                              ``s=<speculative blocks>``,
                                                              ``ck=<checkpoint blocks>``,
                                                              ``al=<checkpoint alignment>``
``cross``   ``CrossAttentionSpec`` (encoder-decoder)
``rswa``    ``RSWASpec``                                      ``w=<window>``
``ring``    ``CircularBufferSpec`` (compressor ring)
==========  ===============================================  ==============================

e.g. ``"fa:16+swa:16:w=64+swa:16:w=64+swa:16:w=64"`` (gpt-oss style, 1 : 3),
``"fa:16+mamba:64:mode=align"`` (a hybrid Mamba model with partial hash hits).
:func:`parse` reads one, :func:`kv_cache_groups` builds vLLM's groups for it and
:class:`LayoutInfo` answers the questions the generator asks about it (which Scheduler
rules apply: encoder tokens, Mamba chunk alignment, multi-group connector failures).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

from hscache_tools.testing import kv_cache as kc
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

KINDS = ("fa", "mla", "swa", "cl", "mamba", "cross", "rswa", "ring")


@dataclasses.dataclass(frozen=True)
class GroupDesc:
    kind: str
    block_size: int
    window: int = 0  # swa, rswa
    chunk: int = 0  # cl
    mode: str = "none"  # mamba
    spec_blocks: int = 0  # mamba: num_speculative_blocks
    ckpt_blocks: int = 0  # mamba: num_prefill_checkpoint_blocks
    ckpt_align: int | None = None  # mamba: prefill_checkpoint_alignment
    mla: bool = False  # swa: the MLA variant
    eagle: bool = False

    def token(self) -> str:
        parts = [self.kind, str(self.block_size)]
        if self.window:
            parts.append(f"w={self.window}")
        if self.chunk:
            parts.append(f"c={self.chunk}")
        if self.kind == "mamba":
            parts.append(f"mode={self.mode}")
            if self.spec_blocks:
                parts.append(f"s={self.spec_blocks}")
            if self.ckpt_blocks:
                parts.append(f"ck={self.ckpt_blocks}")
            if self.ckpt_align is not None:
                parts.append(f"al={self.ckpt_align}")
        if self.mla:
            parts.append("mla")
        if self.eagle:
            parts.append("eagle")
        return ":".join(parts)

    def spec(self):  # -> KVCacheSpec
        k, b = self.kind, self.block_size
        if k == "fa":
            return kc.full_attention(b)
        if k == "mla":
            return kc.mla(b)
        if k == "swa":
            return kc.sliding_window(b, self.window, mla=self.mla)
        if k == "cl":
            return kc.chunked_local(b, self.chunk)
        if k == "mamba":
            return kc.mamba(
                b,
                mode=self.mode,  # type: ignore[arg-type]
                num_speculative_blocks=self.spec_blocks,
                num_prefill_checkpoint_blocks=self.ckpt_blocks,
                prefill_checkpoint_alignment=self.ckpt_align,
            )
        if k == "cross":
            return kc.cross_attention(b)
        if k == "rswa":
            return kc.rswa(b, self.window)
        if k == "ring":
            return kc.circular_buffer(b)
        raise ValueError(f"unknown group kind {k!r}")


def parse(layout: str) -> list[GroupDesc]:
    groups = []
    for tok in layout.split("+"):
        kind, bs, *opts = tok.split(":")
        if kind not in KINDS:
            raise ValueError(f"unknown group kind {kind!r} in layout {layout!r}")
        kw: dict = {}
        for opt in opts:
            key, _, val = opt.partition("=")
            if key == "w":
                kw["window"] = int(val)
            elif key == "c":
                kw["chunk"] = int(val)
            elif key == "mode":
                kw["mode"] = val
            elif key == "s":
                kw["spec_blocks"] = int(val)
            elif key == "ck":
                kw["ckpt_blocks"] = int(val)
            elif key == "al":
                kw["ckpt_align"] = int(val)
            elif key in ("mla", "eagle"):
                kw[key] = True
            else:
                raise ValueError(f"unknown option {opt!r} in layout {layout!r}")
        groups.append(GroupDesc(kind, int(bs), **kw))
    return groups


def render(groups: list[GroupDesc]) -> str:
    return "+".join(g.token() for g in groups)


def kv_cache_groups(layout: str) -> list[KVCacheGroupSpec]:
    """vLLM's groups of a layout (layer names ``layer<i>``)."""
    return [kc.group(g.spec(), f"layer{i}", eagle=g.eagle) for i, g in enumerate(parse(layout))]


@dataclasses.dataclass(frozen=True)
class LayoutInfo:
    """What the generator needs to know about a layout."""

    layout: str

    @cached_property
    def groups(self) -> list[GroupDesc]:
        return parse(self.layout)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def has_cross(self) -> bool:
        """Encoder-decoder: the Scheduler passes ``num_encoder_tokens`` at admission."""
        return any(g.kind == "cross" for g in self.groups)

    @cached_property
    def mamba(self) -> GroupDesc | None:
        return next((g for g in self.groups if g.kind == "mamba"), None)

    @property
    def mamba_align(self) -> bool:
        """vLLM's Scheduler splits prefill chunks at Mamba block boundaries."""
        return self.mamba is not None and self.mamba.mode == "align"

    @property
    def needs_sparse_caching_groups(self) -> bool:
        """A retention interval other than None/0 needs a sliding-window or Mamba group."""
        return any(g.kind in ("swa", "mamba") for g in self.groups)

    @property
    def caching_allowed(self) -> bool:
        """vLLM's manager refuses prefix caching over cross attention (no hit search)
        and over Mamba outside ``align``."""
        return not self.has_cross and not (self.mamba is not None and not self.mamba_align)
