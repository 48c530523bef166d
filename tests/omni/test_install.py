"""``hscache.omni.install``: vllm-omni's runners build hscache's cache instead of their own
(``HSCACHE_OMNI_PREFIX_CACHE=1``). Skipped without vllm-omni 0.30."""

from __future__ import annotations

import pytest

runner_mixin = pytest.importorskip(
    "vllm_omni.core.prefix_cache.runner_mixin",
    reason="needs vllm-omni 0.30 (the environment of scripts/omni_env.sh)",
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
