"""``hscache_tools.testing``'s KV-cache configs and manager keywords against vLLM's own rules.

The lead's hybrid work builds its differential configs and benchmark pools with these
builders, so: every spec builder gives a config vLLM's ``KVCacheManager`` accepts (alone and
beside full attention, with and without prefix caching), and :func:`block_sizes` (vLLM's
``resolve_kv_cache_block_sizes`` over a stand-in of the few engine settings it reads) gives
the sizes the same function gives over a real ``VllmConfig``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache_tools.testing import kv_cache as kc
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.offline_scheduler import make_vllm_config
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import KVCacheConfig

pytestmark = pytest.mark.vllm

# name -> (groups, prefix caching allowed); block sizes differ per group where vLLM allows.
CONFIGS: dict[str, tuple[Callable[[], KVCacheConfig], bool]] = {
    "full": (lambda: kc.full_attention_config(64), True),
    "mla": (lambda: kc.kv_cache_config([kc.mla(16)], 64), True),
    "sliding-window": (lambda: kc.kv_cache_config([kc.sliding_window(16, 64)], 64), True),
    "sliding-window-mla": (
        lambda: kc.kv_cache_config([kc.sliding_window(16, 64, mla=True)], 64),
        True,
    ),
    "chunked-local": (lambda: kc.kv_cache_config([kc.chunked_local(16, 64)], 64), True),
    "cross-attention": (lambda: kc.kv_cache_config([kc.cross_attention(16)], 64), True),
    "full+sliding-window": (
        lambda: kc.kv_cache_config([kc.full_attention(16), kc.sliding_window(16, 64)], 64),
        True,
    ),
    "full32+sliding-window16": (
        lambda: kc.kv_cache_config([kc.full_attention(32), kc.sliding_window(16, 64)], 64),
        True,
    ),
    "full+chunked-local": (
        lambda: kc.kv_cache_config([kc.full_attention(16), kc.chunked_local(16, 32)], 64),
        True,
    ),
    "full+mamba-align": (
        lambda: kc.kv_cache_config([kc.full_attention(16), kc.mamba(64, mode="align")], 64),
        True,
    ),
    "full+mamba-none": (
        lambda: kc.kv_cache_config([kc.full_attention(16), kc.mamba(64, mode="none")], 64),
        False,  # vLLM: "Mamba prefix caching requires mamba_cache_mode='align'"
    ),
    "full+mamba-align-checkpoint": (
        lambda: kc.kv_cache_config(
            [
                kc.full_attention(16),
                kc.mamba(
                    64,
                    mode="align",
                    num_speculative_blocks=1,
                    num_prefill_checkpoint_blocks=1,
                    prefill_checkpoint_alignment=16,
                ),
            ],
            64,
        ),
        True,
    ),
    "full+mamba-all": (
        lambda: kc.kv_cache_config([kc.full_attention(16), kc.mamba(64, mode="all")], 64),
        False,
    ),
    "rswa": (lambda: kc.kv_cache_config([kc.rswa(16, 32)], 64), True),
    "full+circular-buffer": (
        lambda: kc.kv_cache_config([kc.full_attention(16), kc.circular_buffer(16)], 64),
        True,
    ),
    "full+sliding-window-retention": (
        lambda: kc.kv_cache_config(
            [kc.full_attention(16), kc.sliding_window(16, 64)], 64, retention_interval=32
        ),
        True,
    ),
    "full+eagle": (
        lambda: kc.kv_cache_config(
            [
                kc.group(kc.full_attention(16), "target"),
                kc.group(kc.full_attention(16), "draft", eagle=True),
            ],
            64,
        ),
        True,
    ),
    "hisparse": (lambda: kc.hisparse_config(64, 16), True),
    "hisparse-3-resident": (lambda: kc.hisparse_config(64, 16, num_resident_groups=3), True),
}


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_sizes_are_vllms(name: str, caching: bool, model_dir: Path) -> None:
    make, _ = CONFIGS[name]
    config = make()
    block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
    engine = make_vllm_config(
        block_size=block_size, enable_prefix_caching=caching, model_path=model_dir
    )
    want = resolve_kv_cache_block_sizes(config, engine)
    assert kc.block_sizes(config, enable_caching=caching) == want
    kwargs = manager_kwargs(config, enable_caching=caching)
    assert (kwargs["scheduler_block_size"], kwargs["hash_block_size"]) == want


def test_block_sizes_of_mixed_groups() -> None:
    """The lcm schedules, the gcd of prefix-cacheable groups hashes; a Mamba group outside
    align mode hashes at the lcm."""
    mixed = kc.kv_cache_config([kc.full_attention(32), kc.sliding_window(16, 64)], 64)
    assert kc.block_sizes(mixed) == (32, 16)
    assert kc.block_sizes(mixed, enable_caching=False) == (32, 32)
    align = kc.kv_cache_config([kc.full_attention(16), kc.mamba(64, mode="align")], 64)
    assert kc.block_sizes(align) == (64, 16)
    none = kc.kv_cache_config([kc.full_attention(16), kc.mamba(64, mode="none")], 64)
    assert kc.block_sizes(none, enable_caching=False) == (64, 64)


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_vllms_manager_accepts_the_config(name: str, caching: bool) -> None:
    make, cacheable = CONFIGS[name]
    if caching and not cacheable:
        with pytest.raises(AssertionError, match="mamba_cache_mode='align'"):
            KVCacheManager(**manager_kwargs(make(), enable_caching=True))
        return
    config = make()
    manager = KVCacheManager(**manager_kwargs(config, enable_caching=caching))
    managers = manager.coordinator.single_type_managers
    assert [m.kv_cache_spec for m in managers] == [g.kv_cache_spec for g in config.kv_cache_groups]
    assert manager.block_pool.num_gpu_blocks == 64


def test_sink_spec_is_built_but_vllm_033_cannot_manage_it() -> None:
    """What the builder's doc says: vLLM 0.33's SinkFullAttentionManager rejects the
    keyword its coordinator passes, so no manager can be built over a sink group."""
    config = kc.kv_cache_config([kc.sink(16, 4)], 64)
    assert config.kv_cache_groups[0].kv_cache_spec.sink_len == 4
    with pytest.raises(TypeError, match="needs_kv_cache_zeroing"):
        KVCacheManager(**manager_kwargs(config))


def test_zeroing_config_and_layer_names() -> None:
    config = kc.kv_cache_config([kc.full_attention(16), kc.sliding_window(16, 64)], 8)
    assert [g.layer_names for g in config.kv_cache_groups] == [["layer0"], ["layer1"]]
    assert not config.needs_kv_cache_zeroing
    assert kc.full_attention_config(8, needs_zeroing=True).needs_kv_cache_zeroing


def test_hisparse_config_binds_vllms_coordinator() -> None:
    """The HiSparse builder gives the layout vLLM's connector binds: one host group first,
    resident groups of its block size, one hot group per resident group."""
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    config = kc.hisparse_config(32, 12, num_resident_groups=2, blocks_per_request=3)
    manager = KVCacheManager(**manager_kwargs(config))
    coordinator = get_hisparse_coordinator(manager)
    assert coordinator.host_group_id == 0
    assert [m.kv_cache_group_id for m in coordinator.resident_managers] == [2, 4]
    assert [m.blocks_per_request for m in coordinator.hot_managers] == [3, 3]
    assert coordinator.get_host_block_pool().num_gpu_blocks == 12
