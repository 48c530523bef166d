"""Differential regressions of the hybrid KV-cache layouts, and vLLM's documented exceptions.

Each ``test_regression_*`` is a short trace, shrunk from a random differential trace
(``tests/vllm_diff``), on which hscache's manager once diverged from vLLM 0.33.0's: it
runs both managers in lock-step and compares every answer and the whole observable state
(every group's tables, the prefix-cache index, Mamba's bookkeeping) after every call.

``test_vllm_exception_*`` cover :data:`vllm_diff.exceptions.KNOWN`: where vLLM itself crashes
or is clearly wrong, the harness stops comparing (``HarnessError`` names the exception) and
these tests pin hscache's own behaviour.

``test_real_scheduler_stream`` runs vLLM's real Scheduler over the hybrid layouts with both
managers in parity mode (``vllm_diff.real_scheduler``).
"""

from __future__ import annotations

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)

from tests import vllm_diff as diff
from tests.vllm_diff.real_scheduler import real_config_for_seed, run_real_scheduler

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def candidate():
    return diff.load_candidate()


def _pair(candidate, name: str, **cfg_kw) -> diff.Pair:
    cfg = diff.TraceConfig(
        **{"num_blocks": 32, "max_model_len": 64, "deep_every": 1, "events_every_call": True}
        | cfg_kw
    )
    return diff.Pair(cfg, candidate, seed=name)


def _spec(rid: str, prompt: list[int], **kw) -> dict:
    return {"rid": rid, "prompt": list(prompt), "max_tokens": kw.pop("max_tokens", 8), **kw}


def test_regression_mamba_prompt_boundary_below_the_cached_run(candidate):
    """Mamba "align" with a retention interval leaves the prompt's last full block
    unkeyed; when a streaming session's next turn moves the prompt boundary onto that
    block, caching registers it as a partial entry and reads its hash, which lies below
    the run of newly full blocks. The core's hash-read plan missed it
    (``InternalError: block hash 8 was read but not planned``); vLLM caches it."""
    p = _pair(candidate, "mamba-boundary", layout="fa:2+mamba:2:mode=align", retention_interval=4)
    p.do(["new", _spec("s", list(range(1, 19)), max_tokens=1, resumable=True)])
    p.call("get_computed_blocks", rid="s")
    p.call("allocate_slots", rid="s", n=18, hit="hit", kw={"num_new_computed_tokens": 0})
    p.do(["set", "s", "num_computed_tokens", 18])
    p.do(["set", "s", "status", "RUNNING"])
    p.do(["append", "s", [77]])
    p.do(["set", "s", "status", "WAITING_FOR_STREAMING_REQ"])
    p.do(["session_update", "s", [88], 4])  # prompt 19 tokens: boundary at 18
    new = p.call("allocate_slots", rid="s", n=1, hit="empty", kw={})
    assert new is not None
    p.call("free", rid="s")
    p.check_state(deep=True)


def test_regression_encoder_longer_than_max_model_len(candidate):
    """An encoder-decoder model's encoder input is not bounded by the decoder's
    ``max_model_len`` (Whisper: 1500 encoder positions, 448 decoder tokens). hscache
    refused ``num_encoder_tokens > max_model_len`` as invalid input; vLLM allocates the
    cross-attention blocks (or answers None when the pool is too small)."""
    p = _pair(
        candidate,
        "cross-long-encoder",
        layout="fa:4+cross:4",
        enable_caching=False,
        max_model_len=16,
        num_blocks=17,
    )
    p.do(["new", _spec("a", [1, 2, 3, 4, 5], max_tokens=4)])
    p.call("get_computed_blocks", rid="a")
    kw = {"num_new_computed_tokens": 0, "num_encoder_tokens": 21}
    new = p.call("allocate_slots", rid="a", n=5, hit="hit", kw=kw)
    assert new is not None and len(new.get_block_ids()[1]) == 6
    p.do(["new", _spec("b", [6, 7, 8], max_tokens=4)])
    p.call("get_computed_blocks", rid="b")
    kw = {"num_new_computed_tokens": 0, "num_encoder_tokens": 80}  # beyond the pool
    assert p.call("allocate_slots", rid="b", n=3, hit="hit", kw=kw) is None
    p.call("free", rid="a")
    p.check_state(deep=True)


def test_regression_negative_reserved_blocks(candidate):
    """The Scheduler's reservation for in-flight prefills sums
    ``coordinator.get_num_blocks_to_allocate``, which a Mamba "align" group with
    over-allocated speculative blocks makes negative (seen in trace seed 328); vLLM then
    admits against ``free - reserved``. hscache refused a negative ``reserved_blocks``
    as invalid input."""
    p = _pair(candidate, "negative-reserve", layout="fa:4+mamba:4:mode=align:s=1", num_blocks=6)
    p.do(["new", _spec("b", list(range(100, 108)))])
    p.call("get_computed_blocks", rid="b")
    kw = {
        "num_new_computed_tokens": 0,
        "num_external_computed_tokens": 4,
        "delay_cache_blocks": True,
        "reserved_blocks": -1,
    }
    assert p.call("allocate_slots", rid="b", n=0, hit="hit", kw=kw) is not None
    p.call("free", rid="b")
    p.check_state(deep=True)


# ------------------------------------------------------------------ vLLM's own crashes


def _prefill_in_mamba_chunks(p: diff.Pair, rid: str, chunks: list[int]) -> None:
    """Admit ``rid`` and prefill it in the chunks vLLM's Mamba "align" split makes."""
    p.call("get_computed_blocks", rid=rid)
    p.call("allocate_slots", rid=rid, n=chunks[0], hit="hit", kw={"num_new_computed_tokens": 0})
    done = chunks[0]
    p.do(["set", rid, "num_computed_tokens", done])
    p.do(["set", rid, "status", "RUNNING"])
    for n in chunks[1:]:
        p.call("allocate_slots", rid=rid, n=n)
        done += n
        p.do(["set", rid, "num_computed_tokens", done])


def test_vllm_exception_report_full_partial_hit_events(candidate):
    """Known vLLM bug ``report-full-partial-hit-events``: full attention 32 + Mamba
    "align" 64, hash block 32; a 110-token request asking for full KV-cache reports hits
    96 tokens (a partial Mamba hit). vLLM raises IndexError inside
    ``get_computed_blocks``; hscache answers the hit and reports it: the full-attention
    blocks' BlockStored, the Mamba group's full block and a partial-entry event for the
    tail."""
    cfg_kw = {"layout": "fa:32+mamba:64:mode=align", "num_blocks": 40, "max_model_len": 256}
    p = _pair(candidate, "report-full", events_every_call=False, **cfg_kw)
    prompt = list(range(1, 111))
    p.do(["new", _spec("warm", prompt[:100], max_tokens=1)])
    _prefill_in_mamba_chunks(p, "warm", [64, 32, 4])  # vLLM's aligned split of 100
    p.call("free", rid="warm")
    p.call("take_events")
    p.do(["new", _spec("r", prompt, max_tokens=1, report_full=True)])
    with pytest.raises(diff.exceptions.KnownVllmException) as err:
        p.call("get_computed_blocks", rid="r")
    assert err.value.bug.name == "report-full-partial-hit-events"
    # hscache's answer (the harness already checked it did not raise)
    events = [e for e in p.cand.mgr.take_events() if type(e).__name__ == "BlockStored"]
    assert p.cand.hits["r"].get_block_ids() == ([1, 2, 4], [0, 7])  # 96 tokens
    hashes = p.cand.reqs["r"].block_hashes  # every 32 tokens
    ext = [int.from_bytes(h, "big") & (2**64 - 1) for h in hashes]
    summary = [
        (e.group_idx, e.block_size, e.block_hashes, e.parent_block_hash, len(e.token_ids))
        for e in events
    ]
    assert summary[0] == (0, 32, ext[:3], None, 96)
    assert summary[1:] == [(1, 64, [ext[1]], None, 64), (1, 32, [ext[2]], ext[1], 32)]


def test_vllm_exception_mamba_align_external_undercount(candidate):
    """Known vLLM bug ``mamba-align-external-undercount``: full attention 2 + Mamba
    "align" 2, 4 free blocks; a 5-token request with 4 external (connector) tokens, one
    new token and one lookahead slot. vLLM counts 4 blocks (3 + the Mamba group's per-step
    cap of 1) but its base ``allocate_external_computed_blocks`` takes a Mamba block for
    the external tokens first, so ``get_new_blocks`` raises ValueError mid-allocation.
    hscache counts the same, fails at the same call with InternalError and stays
    poisoned (every later call raises): no silent wrong allocation."""
    from hscache.exceptions import InternalError

    p = _pair(candidate, "mamba-external", layout="fa:2+mamba:2:mode=align", num_blocks=5)
    p.do(["new", _spec("r", [1, 2, 3, 4, 5], max_tokens=4)])
    p.call("get_computed_blocks", rid="r")
    kw = {
        "num_new_computed_tokens": 0,
        "num_external_computed_tokens": 4,
        "num_lookahead_tokens": 1,
    }
    with pytest.raises(diff.exceptions.KnownVllmException) as err:
        p.call("allocate_slots", rid="r", n=1, hit="hit", kw=kw)
    assert err.value.bug.name == "mamba-align-external-undercount"
    with pytest.raises(InternalError, match="poisoned"):
        p.cand.mgr.free(p.cand.reqs["r"])


def test_vllm_exception_report_full_dcp_events(candidate):
    """Known vLLM bug ``report-full-dcp-events``: one full-attention group of 4 tokens
    under DCP 2 (blocks of 8); a request asking for full KV-cache reports hits 24 tokens.
    vLLM fails an assertion inside ``get_computed_blocks``; hscache answers the hit and
    reports its 3 blocks at the block size caching reports them with (8)."""
    cfg_kw = {"layout": "fa:4", "dcp": 2, "num_blocks": 40, "max_model_len": 128}
    p = _pair(candidate, "report-full-dcp", events_every_call=False, **cfg_kw)
    prompt = list(range(1, 30))
    p.do(["new", _spec("warm", prompt, max_tokens=1)])
    p.call("get_computed_blocks", rid="warm")
    p.call("allocate_slots", rid="warm", n=29, hit="hit", kw={"num_new_computed_tokens": 0})
    p.call("free", rid="warm")
    stored = [e for e in p.call("take_events") if type(e).__name__ == "BlockStored"]
    assert [(e.block_size, len(e.block_hashes)) for e in stored] == [(8, 3)]
    p.do(["new", _spec("r", prompt, max_tokens=1, report_full=True)])
    with pytest.raises(diff.exceptions.KnownVllmException) as err:
        p.call("get_computed_blocks", rid="r")
    assert err.value.bug.name == "report-full-dcp-events"
    events = [e for e in p.cand.mgr.take_events() if type(e).__name__ == "BlockStored"]
    assert p.cand.hits["r"].get_block_ids() == ([1, 2, 3],)
    assert [(e.block_size, e.block_hashes) for e in events] == [(8, stored[0].block_hashes)]


# ------------------------------------------------------------------ vLLM's real Scheduler


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_real_scheduler_stream(seed):
    """vLLM's own Scheduler schedules a seeded request stream over a hybrid layout with
    both managers in parity mode; every call and, after every step, every group's state
    must agree (``vllm_diff.real_scheduler``)."""
    cfg = real_config_for_seed(seed, steps=100)
    stats = run_real_scheduler(seed, cfg)
    assert stats["steps"] == 100 and stats["calls"] > 0
