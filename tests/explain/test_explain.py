"""Hit-path explanations (``explain=True``, ``src/explain.rs``): one test per reason a
request's last prefix-cache lookup names, with vLLM 0.33's real ``Request`` objects and
block hasher; the switches and errors of the Python API; and explain mode changing no
decision (block ids, hits, ``state_digest()``) of the manager it explains."""

from __future__ import annotations

import random
from typing import Any

import hscache
import pytest
import torch
from hscache import Explanation, exceptions
from hscache.vllm import KVCacheManager
from hscache_tools.testing import kv_cache as kc
from hscache_tools.testing.kv_cache import full_attention_config
from hscache_tools.testing.manager import manager_kwargs
from hscache_tools.testing.requests import init_none_hash, lora, make_request, mm_feature
from vllm.v1.request import Request

_BLOCK = 16
_counter = iter(range(10**9))


@pytest.fixture(autouse=True)
def _none_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    init_none_hash("sha256")
    monkeypatch.delenv("HSCACHE_EXPLAIN", raising=False)
    monkeypatch.delenv("HSCACHE_RETENTION", raising=False)


def _manager(num_blocks: int = 32, **kwargs: Any) -> Any:
    explain = kwargs.pop("explain", True)
    retention = kwargs.pop("retention", None)
    kw = manager_kwargs(full_attention_config(num_blocks), **kwargs)
    kw["explain"] = explain
    if retention is not None:
        kw["retention"] = retention
    return KVCacheManager(**kw)


def _prompt(seed: int, num_tokens: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_tokens)]


def _admit(m: Any, req: Request) -> int:
    """The Scheduler's admission: lookup, then allocate (which caches the full blocks)."""
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    return int(hit)


def _serve(m: Any, prompt: list[int] | None, **request: Any) -> Request:
    req = make_request(f"r{next(_counter)}", prompt, **request)
    _admit(m, req)
    m.free(req)
    return req


def _explain_new(m: Any, prompt: list[int] | None, **request: Any) -> Explanation:
    """Looks up a new request and returns its explanation."""
    req = make_request(f"q{next(_counter)}", prompt, **request)
    m.get_computed_blocks(req)
    found: Explanation = m.explain(req.request_id)
    assert found == hscache.explain(req.request_id)
    return found


# ---- one test per reason --------------------------------------------------------------


def test_never_cached() -> None:
    m = _manager()
    e = _explain_new(m, _prompt(1, 3 * _BLOCK + 1))
    assert (e.reason, e.hit_blocks, e.num_full_blocks) == ("never_cached", 0, 3)
    assert e.detail["first_missing_block"] == 0
    assert "never cached" in str(e)


def test_hit_capped_when_the_prompt_is_a_multiple_of_the_block_size() -> None:
    m = _manager()
    prompt = _prompt(2, 2 * _BLOCK)
    _serve(m, prompt)
    e = _explain_new(m, prompt)
    assert (e.reason, e.hit_blocks, e.hit_tokens, e.num_full_blocks) == ("hit_capped", 1, 16, 2)
    assert e.detail["max_hit_tokens"] == 2 * _BLOCK - 1
    assert e.detail["block_cached"] is True
    assert "capped" in str(e)


def test_block_alignment_for_a_prompt_shorter_than_a_block() -> None:
    m = _manager()
    e = _explain_new(m, _prompt(3, 10))
    assert (e.reason, e.hit_blocks, e.num_full_blocks) == ("block_alignment", 0, 0)
    assert e.detail["partial_tokens"] == 10


def test_block_alignment_for_the_partial_tail() -> None:
    m = _manager()
    prompt = _prompt(4, 2 * _BLOCK + 8)
    _serve(m, prompt)
    e = _explain_new(m, prompt)
    assert (e.reason, e.hit_blocks, e.hit_tokens) == ("block_alignment", 2, 32)
    assert e.detail["partial_tokens"] == 8
    assert "partial blocks are never cached" in str(e)


def test_block_alignment_names_the_hybrid_alignment() -> None:
    # Full attention of 16-token blocks beside sliding window of 32: hits are aligned
    # to 32 tokens, so a 3-block cached prefix hits 2 blocks only.
    cfg = kc.kv_cache_config(
        [kc.group(kc.full_attention(16), "full"), kc.group(kc.sliding_window(32, 64), "swa")],
        num_blocks=64,
    )
    kw = manager_kwargs(cfg)
    kw["explain"] = True
    m = KVCacheManager(**kw)
    sbs, hbs = kc.block_sizes(cfg)
    prompt = _prompt(5, 3 * _BLOCK + 5)
    _serve(m, prompt, hash_block_size=hbs)
    e = _explain_new(m, prompt, hash_block_size=hbs)
    assert e.hit_tokens % sbs == 0
    assert e.reason == "block_alignment", e
    assert e.detail["cause"] == "hybrid_alignment"
    assert e.detail["alignment_tokens"] == sbs
    assert "alignment" in str(e)


def test_lookup_skipped_for_prompt_logprobs() -> None:
    m = _manager()
    prompt = _prompt(6, 2 * _BLOCK + 1)
    _serve(m, prompt)
    e = _explain_new(m, prompt, prompt_logprobs=1)
    assert (e.reason, e.hit_tokens) == ("lookup_skipped", 0)
    assert e.detail["cause"] == "skip_reading_prefix_cache"
    assert e.detail["skip_reason"] == "prompt_logprobs"
    assert "prompt_logprobs" in str(e)


def test_lookup_skipped_with_caching_off() -> None:
    m = _manager(enable_caching=False)
    e = _explain_new(m, _prompt(7, 2 * _BLOCK + 1))
    assert e.reason == "lookup_skipped"
    assert e.detail["cause"] == "caching_disabled"


@pytest.mark.parametrize("policy", ["lru", "priority"])
def test_evicted_names_the_policy(policy: str) -> None:
    # 4 usable blocks: serving a second 4-block prompt evicts the first one's blocks.
    m = _manager(num_blocks=5, retention=policy)
    first = _prompt(8, 3 * _BLOCK + 1)
    _serve(m, first)
    _serve(m, _prompt(9, 3 * _BLOCK + 1))
    e = _explain_new(m, first)
    assert (e.reason, e.hit_blocks) == ("evicted", 0)
    assert e.detail["policy"] == policy
    assert e.detail["eviction_cause"] == "reuse"
    assert e.detail["eviction_seq"] >= 1 and e.detail["evictions_since"] >= 0
    assert f"evicted by the {policy} policy" in str(e)


def test_evicted_by_evict_blocks() -> None:
    m = _manager()
    prompt = _prompt(10, 2 * _BLOCK + 1)
    req = make_request("held", prompt)
    _admit(m, req)
    ids = m.get_block_ids(req.request_id)[0]
    m.free(req)
    m.evict_blocks(set(ids))
    e = _explain_new(m, prompt)
    assert (e.reason, e.detail["eviction_cause"]) == ("evicted", "explicit")


def test_extra_keys_differ_cache_salt() -> None:
    m = _manager()
    prompt = _prompt(11, 2 * _BLOCK + 1)
    _serve(m, prompt, cache_salt="tenant-a")
    e = _explain_new(m, prompt, cache_salt="tenant-b")
    assert (e.reason, e.hit_blocks) == ("extra_keys_differ", 0)
    assert e.detail["differs"] == ["cache_salt"]
    assert e.detail["variant_cached"] is True
    assert "cache_salt differ" in str(e)


def test_extra_keys_differ_lora() -> None:
    m = _manager()
    prompt = _prompt(12, 2 * _BLOCK + 1)
    _serve(m, prompt, lora_request=lora("adapter-a", 1, "/a"))
    e = _explain_new(m, prompt, lora_request=lora("adapter-b", 2, "/b"))
    assert e.reason == "extra_keys_differ"
    assert e.detail["differs"] == ["lora"]


def test_extra_keys_differ_multimodal() -> None:
    # The image sits in block 1: block 0 hits, block 1 differs by its mm identifier.
    m = _manager()
    prompt = _prompt(13, 3 * _BLOCK + 1)
    _serve(m, prompt, mm_features=[mm_feature("img-a", 20, 8)])
    e = _explain_new(m, prompt, mm_features=[mm_feature("img-b", 20, 8)])
    assert (e.reason, e.hit_blocks, e.detail["first_missing_block"]) == (
        "extra_keys_differ",
        1,
        1,
    )
    assert e.detail["differs"] == ["mm"]


def test_extra_keys_differ_prompt_embeds() -> None:
    m = _manager()
    n = 2 * _BLOCK + 1
    torch.manual_seed(0)
    _serve(m, None, prompt_embeds=torch.randn(n, 4))
    e = _explain_new(m, None, prompt_embeds=torch.randn(n, 4))
    assert e.reason == "extra_keys_differ"
    assert e.detail["differs"] == ["prompt_embeds"]


# ---- switches, errors, the module-level function --------------------------------------


def test_explain_off_is_a_runtime_error_that_says_how_to_turn_it_on() -> None:
    m = _manager(explain=False)
    assert m.explain_enabled is False
    req = make_request("off", _prompt(14, 20))
    m.get_computed_blocks(req)
    with pytest.raises(RuntimeError, match="explain=True"):
        m.explain("off")


def test_unknown_request_is_a_key_error() -> None:
    m = _manager()
    with pytest.raises(exceptions.UnknownRequestError):
        m.explain("never-seen")
    with pytest.raises(exceptions.UnknownRequestError):
        hscache.explain("never-seen")


def test_environment_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSCACHE_EXPLAIN", "1")
    kw = manager_kwargs(full_attention_config(16))
    m = KVCacheManager(**kw)
    assert m.explain_enabled
    e = _explain_new(m, _prompt(15, 20))
    assert e.reason == "never_cached"


def test_stats_counts_explained_lookups_by_reason() -> None:
    """``hscache.stats()["explain"]``: every explained lookup by reason (summed over the
    live managers with explain mode on) and the requests remembered."""
    m = _manager()
    assert m.core_explain_summary()["requests"] == 0
    prompt = _prompt(40, 2 * _BLOCK)
    _serve(m, prompt)  # never_cached
    _explain_new(m, prompt)  # hit_capped
    _explain_new(m, _prompt(41, 10))  # block_alignment
    own = m.core_explain_summary()
    assert own["requests"] == 3
    assert own["lookups"] == {
        "lookup_skipped": 0,
        "hit_capped": 1,
        "block_alignment": 1,
        "evicted": 0,
        "extra_keys_differ": 0,
        "never_cached": 1,
    }
    total = hscache.stats()["explain"]
    assert total["requests"] >= 3
    assert all(total["lookups"][r] >= n for r, n in own["lookups"].items())


def test_the_summary_refuses_with_explain_off() -> None:
    m = _manager(explain=False)
    with pytest.raises(RuntimeError, match="explain=True"):
        m.core_explain_summary()


def test_the_last_lookup_is_the_one_explained() -> None:
    m = _manager()
    prompt = _prompt(16, 2 * _BLOCK + 1)
    req = make_request("again", prompt)
    m.get_computed_blocks(req)
    first = m.explain("again")
    _serve(m, prompt)
    m.get_computed_blocks(req)
    second = m.explain("again")
    assert first.reason == "never_cached" and second.reason == "block_alignment"
    assert second.lookup_seq > first.lookup_seq
    assert second.hit_tokens == 32


# ---- explain mode changes no decision -------------------------------------------------


def _trace(explain: bool, seed: int = 7) -> list[Any]:
    """A small trace of shared-prefix requests under memory pressure, with every
    decision and the state digest after each step."""
    rng = random.Random(seed)
    m = _manager(num_blocks=24, explain=explain)
    prefixes = [_prompt(100 + i, 2 * _BLOCK) for i in range(3)]
    running: list[Request] = []
    out: list[Any] = []
    for step in range(60):
        if running and (rng.random() < 0.4 or len(running) > 4):
            req = running.pop(rng.randrange(len(running)))
            m.free(req)
            out.append(("free", req.request_id))
        else:
            prompt = rng.choice(prefixes) + _prompt(200 + step, rng.randrange(1, 40))
            req = make_request(f"t{step}", prompt, cache_salt=rng.choice([None, "s"]))
            blocks, hit, _ = m.get_computed_blocks(req)
            new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
            ids = None if new is None else new.get_block_ids()
            out.append(("admit", req.request_id, int(hit), ids))
            if new is not None:
                running.append(req)
        for req in running:
            req.num_computed_tokens = req.num_tokens
        out.append(m.state_digest())
    return out


def test_explain_mode_changes_no_decision() -> None:
    assert _trace(explain=False) == _trace(explain=True)
