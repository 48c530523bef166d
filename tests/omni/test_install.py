"""``hscache.omni.install``: vllm-omni's runners build hscache's cache instead of their own
(``HSCACHE_OMNI_PREFIX_CACHE=1``). Skipped without vllm-omni 0.30."""

from __future__ import annotations

import pytest

runner_mixin = pytest.importorskip(
    "vllm_omni.core.prefix_cache.runner_mixin",
    reason="needs vllm-omni 0.30 (the environment of scripts/vllm030_env.sh)",
)

from hscache.omni import OmniHiddenStateCache, install  # noqa: E402


def test_install_swaps_the_runners_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_mixin, "OmniPrefixCacheManager", runner_mixin.OmniPrefixCacheManager)
    monkeypatch.delenv("HSCACHE_OMNI_PREFIX_CACHE", raising=False)
    assert not install()
    assert runner_mixin.OmniPrefixCacheManager is not OmniHiddenStateCache
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "1")
    assert install()
    assert runner_mixin.OmniPrefixCacheManager is OmniHiddenStateCache


def test_plugin_switch_decides_when_the_cache_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's switch reads the environment when a runner builds its cache (a
    deploy YAML's per-stage env applies by then), not when the plugin loads."""
    from types import SimpleNamespace

    from hscache.omni import register

    class Theirs:
        def __init__(self, config: object, view: object) -> None:
            self.config = config

    class View:
        def batch_req_ids(self) -> list[str]:
            return []

    monkeypatch.setattr(runner_mixin, "OmniPrefixCacheManager", Theirs)
    monkeypatch.delenv("HSCACHE_OMNI_PREFIX_CACHE", raising=False)
    register()
    register()  # idempotent
    build = runner_mixin.OmniPrefixCacheManager
    assert build.hscache_original is Theirs
    cfg = SimpleNamespace(num_blocks=4, block_size=4)
    assert isinstance(build(cfg, View()), Theirs)
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "1")
    monkeypatch.setenv("HSCACHE_OMNI_STORAGE", "cpu")
    assert isinstance(build(cfg, View()), OmniHiddenStateCache)
