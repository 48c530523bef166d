"""Test scaffolding (not shipped with hscache): per-layer sliding windows for vLLM 0.30's Qwen2.

transformers' Qwen2 configs say which layers slide (``use_sliding_window``,
``sliding_window``, ``layer_types``); vLLM 0.30's Qwen2 does not read ``layer_types``:
``Qwen2Attention`` builds vLLM's ``Attention`` without ``per_layer_sliding_window``
(``vllm/model_executor/models/qwen2.py``), so every layer takes the model-wide
``cache_config.sliding_window``, which vLLM sets only when *all* layers slide
(``vllm/engine/arg_utils.py``, ``create_engine_config``). A Qwen2.5-Omni thinker whose
layers mix full and sliding-window attention is therefore served as all full attention
(one KV-cache group) by vLLM 0.30, whatever its config says.

:func:`install` gives each Qwen2 decoder layer the window its config's ``layer_types``
names, by passing ``per_layer_sliding_window`` to vLLM's own ``Attention`` (which takes it,
and which the CPU attention backend serves): the thinker of ``make_model.py
--sliding-window W`` then has a full-attention layer and a sliding-window layer, two
KV-cache groups, and vLLM's hybrid KV-cache manager. Models whose config does not mix
layer types are built exactly as before. Called from the scaffolding's general plugin
(:func:`hscache_omni_cpu.probe.register`) when ``HSCACHE_OMNI_CPU=1``, in every engine
process, before any model is built.
"""

from __future__ import annotations

import contextvars
from typing import Any

_window: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "hscache_e2e_layer_window", default=None
)


def layer_window(config: Any, prefix: str) -> int | None:
    """The sliding window of the decoder layer at ``prefix`` (``...layers.<i>``), or None
    for a full-attention layer: the config's window where its ``layer_types`` mix full and
    sliding-window layers and this one slides."""
    from vllm.model_executor.models.utils import extract_layer_index

    types = list(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    if len(set(types)) < 2 or not window or not getattr(config, "use_sliding_window", False):
        return None
    return int(window) if types[extract_layer_index(prefix)] == "sliding_attention" else None


def install() -> None:
    """Qwen2's decoder layers build their attention with their own window (idempotent)."""
    from vllm.model_executor.models import qwen2

    layer_cls = qwen2.Qwen2DecoderLayer
    if getattr(layer_cls.__init__, "hscache_hybrid", False):
        return
    attention = qwen2.Attention
    original_init = layer_cls.__init__

    def attention_with_window(*args: Any, **kwargs: Any) -> Any:
        window = _window.get()
        if window is not None and kwargs.get("per_layer_sliding_window") is None:
            kwargs["per_layer_sliding_window"] = window
        return attention(*args, **kwargs)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        config = kwargs["config"] if "config" in kwargs else args[0]
        token = _window.set(layer_window(config, str(kwargs.get("prefix", ""))))
        try:
            original_init(self, *args, **kwargs)
        finally:
            _window.reset(token)

    init.hscache_hybrid = True  # type: ignore[attr-defined]
    # Qwen2Attention builds its attention by this module-level name.
    qwen2.Attention = attention_with_window  # type: ignore[assignment,misc]
    layer_cls.__init__ = init  # type: ignore[method-assign]
