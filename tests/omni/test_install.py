"""``hscache.omni.install`` / ``register``: vllm-omni's runners build hscache's cache instead
of their own (``HSCACHE_OMNI_PREFIX_CACHE=1``), hybrid KV layouts and speculative decoding on
synchronous stages included, which vllm-omni's own checks refuse. Skipped without vllm-omni 0.30."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

runner_mixin = pytest.importorskip(
    "vllm_omni.core.prefix_cache.runner_mixin",
    reason="needs vllm-omni 0.30 (the environment of scripts/vllm030_env.sh)",
)

from hscache.exceptions import InvalidArgumentError  # noqa: E402
from hscache.omni import OmniHiddenStateCache, install, register  # noqa: E402
from hscache.omni.switch import SPEC_ASYNC_REFUSAL, KVGroupView  # noqa: E402
from vllm_omni.core.prefix_cache import group_view  # noqa: E402
from vllm_omni.core.prefix_cache.interface import OmniPrefixCacheUnmatchError  # noqa: E402

HOOKED = (
    (runner_mixin, "OmniPrefixCacheManager"),
    (runner_mixin, "get_prefix_cache_group_view"),
    (group_view, "check_prefix_cache_kv_groups"),
    (group_view, "check_prefix_cache_token_accounting"),
)


@pytest.fixture(autouse=True)
def _vllm_omni_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every name the switch hooks is put back after each test."""
    for module, name in HOOKED:
        current = getattr(module, name)
        monkeypatch.setattr(module, name, getattr(current, "hscache_original", current))
    monkeypatch.delenv("HSCACHE_OMNI_PREFIX_CACHE", raising=False)
    monkeypatch.setenv("HSCACHE_OMNI_STORAGE", "cpu")
    yield


class View:
    def batch_req_ids(self) -> list[str]:
        return []


def _groups(*kinds: str) -> list[Any]:
    """vLLM 0.30's KV-cache groups, one layer each: ``full`` or ``window`` (64 tokens)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    out = []
    for i, kind in enumerate(kinds):
        common: dict[str, Any] = {
            "block_size": 32,
            "num_kv_heads": 1,
            "head_size": 32,
            "dtype": torch.float32,
        }
        spec = (
            FullAttentionSpec(**common)
            if kind == "full"
            else SlidingWindowSpec(**common, sliding_window=64)
        )
        out.append(KVCacheGroupSpec([f"layers.{i}.attn"], spec))
    return out


def test_install_switches_the_runners_manager() -> None:
    original = runner_mixin.OmniPrefixCacheManager
    assert not install()
    assert runner_mixin.OmniPrefixCacheManager is original  # off: nothing is touched
    assert install(force=True)
    build = runner_mixin.OmniPrefixCacheManager
    assert build.hscache_original is original
    cfg = SimpleNamespace(num_blocks=4, block_size=4)
    assert isinstance(build(cfg, View()), OmniHiddenStateCache)  # whatever the env says
    install(force=True)  # twice: harmless, the originals stay reachable
    assert runner_mixin.OmniPrefixCacheManager.hscache_original is original


def test_plugin_switch_decides_when_the_cache_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not asked when the plugin loads: vllm-omni is left untouched. Asked: the switch is
    in, and it reads the environment again when a runner builds its cache."""

    class Theirs:
        def __init__(self, config: object, view: object) -> None:
            self.config = config

    monkeypatch.setattr(runner_mixin, "OmniPrefixCacheManager", Theirs)
    register()
    assert runner_mixin.OmniPrefixCacheManager is Theirs  # not asked: untouched
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "1")
    register()
    register()  # idempotent
    build = runner_mixin.OmniPrefixCacheManager
    assert build.hscache_original is Theirs
    cfg = SimpleNamespace(num_blocks=4, block_size=4)
    assert isinstance(build(cfg, View()), OmniHiddenStateCache)
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "0")
    assert isinstance(build(cfg, View()), Theirs)


@pytest.mark.parametrize("kinds", [("window", "full"), ("full", "window")])
def test_hybrid_layout_refused_by_vllm_omni_served_by_hscache(
    monkeypatch: pytest.MonkeyPatch, kinds: tuple[str, str]
) -> None:
    """vllm-omni's own check refuses a full + sliding-window layout; with hscache's cache on,
    the runner's check passes, its view names the full-attention group and the cache built
    follows that group's block tables."""
    groups = _groups(*kinds)
    full = kinds.index("full")
    with pytest.raises(
        OmniPrefixCacheUnmatchError, match="single full-attention kv-cache group; found 2"
    ):
        group_view.check_prefix_cache_kv_groups(groups)
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "1")
    register()
    # Off again (the environment, read now): vllm-omni's refusal stands.
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "0")
    with pytest.raises(OmniPrefixCacheUnmatchError, match="found 2"):
        group_view.check_prefix_cache_kv_groups(groups)
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "1")
    group_view.check_prefix_cache_kv_groups(groups)  # hscache's rule: a full group exists
    batch = SimpleNamespace(req_ids=["a", "b"])
    view = runner_mixin.get_prefix_cache_group_view(batch, 32, kv_cache_groups=groups)
    assert isinstance(view, KVGroupView)
    assert (view.kv_cache_group, view.block_size, view.batch_req_ids()) == (full, 32, ["a", "b"])
    cache = runner_mixin.OmniPrefixCacheManager(SimpleNamespace(num_blocks=8, block_size=32), view)
    assert isinstance(cache, OmniHiddenStateCache)
    assert cache._kv_cache_group == full


def test_layout_without_a_full_attention_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "1")
    register()
    with pytest.raises(InvalidArgumentError, match="no KV-cache group carries full-attention"):
        group_view.check_prefix_cache_kv_groups(_groups("window"))
    with pytest.raises(InvalidArgumentError, match="no KV-cache group carries full-attention"):
        group_view.check_prefix_cache_kv_groups(_groups("window", "window"))


def test_one_group_keeps_vllm_omnis_view() -> None:
    """A one-group layout gets vllm-omni's own view (group 0), as before; so does any
    layout while hscache's cache is off."""
    from hscache.omni.switch import _group_view

    seen: list[Any] = []

    def theirs(input_batch: Any, block_size: int, kv_cache_groups: Any = None) -> str:
        seen.append(kv_cache_groups)
        return "vllm-omni's view"

    one, two = _groups("full"), _groups("window", "full")
    assert _group_view(theirs, lambda: True)(None, 32, kv_cache_groups=one) == "vllm-omni's view"
    assert _group_view(theirs, lambda: False)(None, 32, kv_cache_groups=two) == "vllm-omni's view"
    assert seen == [one, two]


def _stage_gate(speculative: Any, prefix_match_unit: int | None = None) -> Any:
    """vllm-omni 0.30's runner-side gate (``stage_prefix_cache_config``, what its runner calls
    at KV-cache init) for a one-group stage with prefix caching on."""
    return group_view.stage_prefix_cache_config(
        kv_cache_config=SimpleNamespace(kv_cache_groups=_groups("full"), num_blocks=8),
        cache_config=SimpleNamespace(
            enable_prefix_caching=True, block_size=32, prefix_match_unit=prefix_match_unit
        ),
        kv_transfer_config=None,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        model_config=None,
        is_pooling_model=False,
        speculative_config=speculative,
    )


def _scheduling(monkeypatch: pytest.MonkeyPatch, async_scheduling: bool | None) -> None:
    """vLLM's current config as the worker sets it around KV-cache init (None: no config)."""
    import vllm.config

    config = (
        None
        if async_scheduling is None
        else SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
    )
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)


NGRAM = SimpleNamespace(method="ngram", num_speculative_tokens=3)


def test_speculative_decoding_refused_by_vllm_omni_served_by_hscache_on_sync_stages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vllm-omni refuses drafts for any prefix cache; with hscache's cache on, a stage that
    schedules synchronously passes the runner's gate with drafts (the cache is staged) and
    one that schedules asynchronously is refused with hscache's reason."""
    _scheduling(monkeypatch, False)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="together with speculative decoding"):
        _stage_gate(NGRAM)
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "1")
    register()
    assert group_view.check_prefix_cache_token_accounting.hscache_original is not None
    cfg = _stage_gate(NGRAM)
    assert (cfg.num_blocks, cfg.block_size) == (8, 32)
    _scheduling(monkeypatch, True)
    with pytest.raises(OmniPrefixCacheUnmatchError) as refused:
        _stage_gate(NGRAM)
    assert str(refused.value) == SPEC_ASYNC_REFUSAL
    assert "async_scheduling: false" in str(refused.value)
    assert _stage_gate(None) is not None  # no drafts: async stages keep their cache
    # Off again (the environment, read now): vllm-omni's refusal stands, sync or not.
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "0")
    _scheduling(monkeypatch, False)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="together with speculative decoding"):
        _stage_gate(NGRAM)


def test_drafts_refused_where_the_stages_scheduling_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No current vLLM config (a caller outside the worker's KV-cache init): hscache cannot
    tell a sync stage from an async one, and refuses drafts saying so."""
    _scheduling(monkeypatch, None)
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "1")
    register()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="could not be read"):
        _stage_gate(NGRAM)
    assert _stage_gate(None) is not None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sub_block_hits_stay_refused(
    monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    """vllm-omni's other rule of the same check (block-aligned hits) holds under hscache's
    rule, with drafts or without."""
    _scheduling(monkeypatch, async_scheduling)
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "1")
    register()
    for speculative in (None, NGRAM):
        with pytest.raises(OmniPrefixCacheUnmatchError, match="prefix_match_unit=16"):
            _stage_gate(speculative, prefix_match_unit=16)
