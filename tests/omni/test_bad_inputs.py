"""Bad input to ``OmniHiddenStateCache``: a typed error, the cache unchanged, never zeros or
another request's rows. Needs neither vLLM nor vllm-omni (``SchedulerOutput``-shaped
namespaces carry the facts the slot mirror reads), so it runs in every environment."""

from __future__ import annotations

import os
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch
from hscache.exceptions import InvalidArgumentError, UnknownRequestError
from hscache.omni import (
    OmniHiddenStateCache,
    OmniSettings,
    StepIdError,
    UnservableHitError,
    UnsupportedOutputError,
    install,
)

BS = 4
W = 3


class View:
    def __init__(self) -> None:
        self.order: list[str] = []

    def batch_req_ids(self) -> list[str]:
        return list(self.order)


def sched(
    new: tuple[tuple[str, list[int], int, int], ...] = (),
    cont: tuple[tuple[str, list[int] | None, int, int], ...] = (),
    finished: tuple[str, ...] = (),
) -> Any:
    """A ``SchedulerOutput``-shaped step: ``new`` (id, blocks, computed, scheduled),
    ``cont`` (id, new blocks, computed, scheduled)."""
    return NS(
        scheduled_new_reqs=[
            NS(req_id=r, block_ids=(b,), num_computed_tokens=nc, prompt_token_ids=None)
            for r, b, nc, _ in new
        ],
        scheduled_cached_reqs=NS(
            req_ids=[r for r, *_ in cont],
            resumed_req_ids=set(),
            new_block_ids=[None if b is None else (b,) for _, b, _, _ in cont],
            num_computed_tokens=[nc for _, _, nc, _ in cont],
        ),
        num_scheduled_tokens={r: n for r, _, _, n in (*new, *cont)},
        finished_req_ids=set(finished),
        preempted_req_ids=None,
        new_block_ids_to_zero=None,
        kv_connector_metadata=None,
        scheduled_spec_decode_tokens={},
    )


def rows(n: int, base: float) -> torch.Tensor:
    return base + torch.arange(n * W, dtype=torch.float32).reshape(n, W)


def make(deliver_once: bool = True) -> tuple[OmniHiddenStateCache, View]:
    view = View()
    cache = OmniHiddenStateCache(
        NS(num_blocks=8, block_size=BS),
        view,
        settings=OmniSettings(storage="cpu", step_wait_s=0.05),
        deliver_once=deliver_once,
    )
    return cache, view


def step(
    cache: OmniHiddenStateCache, view: View, so: Any, hidden: torch.Tensor, **mm: torch.Tensor
) -> int:
    cache.new_step_starts(so)
    view.order = list(so.num_scheduled_tokens)
    n = hidden.shape[0]
    return cache.save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=n)


def warm() -> tuple[OmniHiddenStateCache, View, torch.Tensor]:
    """``a`` prefilled 8 tokens into blocks 1, 2 and finished; its step materialized."""
    cache, view = make()
    a = rows(8, 0.0)
    sid = step(cache, view, sched(new=(("a", [1, 2], 0, 8),)), a, **{"mm.codes": a * 2})
    cache.materialize(sid, ["a"])
    return cache, view, a


def test_hit_served_then_step_consumed_once() -> None:
    cache, view, a = warm()
    b_new = rows(2, 100.0)
    sid = step(
        cache,
        view,
        sched(new=(("b", [1, 2, 3], 8, 2),), finished=("a",)),
        b_new,
        **{"mm.codes": b_new * 2},
    )
    out = cache.materialize(sid, ["b"])
    assert out.hidden_states is not None
    assert torch.equal(out.hidden_states["b"], torch.cat([a, b_new]))
    assert torch.equal(out.mm_outputs["mm.codes"]["b"], torch.cat([a, b_new]) * 2)
    with pytest.raises(StepIdError):
        cache.materialize(sid, ["b"])
    with pytest.raises(StepIdError):
        cache.discard_step(sid)


@pytest.mark.parametrize(
    "bad",
    [
        rows(3, 0.0),  # too few rows
        rows(4, 0.0).to(torch.float64),  # wrong dtype
        torch.zeros(4, W + 1),  # wrong width
        torch.zeros(4),  # not rows
    ],
)
def test_wrong_rows_are_refused_and_change_nothing(bad: torch.Tensor) -> None:
    cache, view, a = warm()
    assert cache.cache is not None
    before = cache.cache.tensor("__hidden_states__").clone()
    stats = cache.cache.stats()
    so = sched(new=(("b", [1, 2, 3], 8, 4),), finished=("a",))
    cache.new_step_starts(so)
    view.order = ["b"]
    with pytest.raises(InvalidArgumentError):
        cache.save_outputs(
            bad, {"mm.codes": rows(4, 0.0)}, num_tokens_unpadded=4, num_tokens_padded=4
        )
    assert torch.equal(cache.cache.tensor("__hidden_states__"), before)
    assert cache.cache.stats() == stats
    # The same step saved right: b is served a's rows, nothing else.
    good = rows(4, 50.0)
    sid = cache.save_outputs(
        good, {"mm.codes": good * 2}, num_tokens_unpadded=4, num_tokens_padded=4
    )
    out = cache.materialize(sid, ["b"])
    assert out.hidden_states is not None
    assert torch.equal(out.hidden_states["b"], torch.cat([a, good]))


def test_missing_or_new_key_is_refused() -> None:
    cache, view, _ = warm()
    so = sched(new=(("b", [3], 0, 2),), finished=("a",))
    cache.new_step_starts(so)
    view.order = ["b"]
    with pytest.raises(UnsupportedOutputError):
        cache.save_outputs(rows(2, 0.0), {}, num_tokens_unpadded=2, num_tokens_padded=2)
    with pytest.raises(UnsupportedOutputError):
        cache.save_outputs(
            rows(2, 0.0),
            {"mm.codes": rows(2, 0.0), "mm.other": rows(2, 0.0)},
            num_tokens_unpadded=2,
            num_tokens_padded=2,
        )
    assert cache.unconsumed_steps() == []


def test_unknown_request_and_foreign_step_ids() -> None:
    cache, view, _ = warm()
    other, other_view = make()
    sid_other = step(other, other_view, sched(new=(("x", [1], 0, 2),)), rows(2, 0.0))
    sid = step(
        cache, view, sched(new=(("b", [3], 0, 2),)), rows(2, 0.0), **{"mm.codes": rows(2, 0.0)}
    )
    with pytest.raises(UnknownRequestError):
        cache.materialize(sid, ["b", "nobody"])
    with pytest.raises(StepIdError):
        cache.materialize(sid_other, ["x"])  # another cache's step
    for never in (12345678, -1, 0, True, "1"):
        with pytest.raises(StepIdError):
            cache.discard_step(never)  # type: ignore[arg-type]
    assert cache.unconsumed_steps() == [sid]  # nothing was consumed by the refusals
    cache.discard_step(sid)
    other.discard_step(sid_other)


def test_steps_never_consumed_are_refused() -> None:
    cache, view = make()
    ids = []
    for i in range(4):  # the default limit
        ids.append(step(cache, view, sched(new=((f"r{i}", [i + 1], 0, 1),)), rows(1, 0.0)))
    cache.new_step_starts(sched(new=(("r9", [6], 0, 1),)))
    view.order = ["r9"]
    with pytest.raises(StepIdError):
        cache.save_outputs(rows(1, 0.0), {}, num_tokens_unpadded=1, num_tokens_padded=1)
    cache.discard_step(ids[0])
    cache.save_outputs(rows(1, 0.0), {}, num_tokens_unpadded=1, num_tokens_padded=1)


def test_hit_on_unwritten_rows_is_refused_not_zeros() -> None:
    """a's step is never saved (its rows never written); b hits a's blocks: refused."""
    cache, view, _ = warm()
    cache.new_step_starts(sched(new=(("c", [4, 5], 0, 8),), finished=("a",)))  # never saved
    so = sched(new=(("d", [4, 5, 6], 8, 1),), finished=("c",))
    d = rows(1, 7.0)
    sid = step(cache, view, so, d, **{"mm.codes": d})
    with pytest.raises(UnservableHitError):
        cache.materialize(sid, ["d"])
    assert cache.unconsumed_steps() == [sid]
    cache.discard_step(sid)


def test_hit_on_unwritten_rows_is_recomputed_when_reported() -> None:
    """Recomputation on: d's refused hit hands out no rows (the scheduler drops that
    output; hscache's delivery watermark, ``deliver_once``, the default) and names block 4
    (the first unwritten one) for the scheduler; rolled back to 0, d's recomputation serves all
    its rows; rolled back to its hit shared with a request recomputing block 4 in the
    same step, its rows are read again (``[cached prefix | rows]``)."""
    cache, view, _ = warm()
    cache.set_recompute_refused(True)
    cache.new_step_starts(sched(new=(("c", [4, 5], 0, 8),), finished=("a",)))  # never saved
    d = rows(1, 7.0)
    sid = step(
        cache, view, sched(new=(("d", [4, 5, 6], 8, 1),), finished=("c",)), d, **{"mm.codes": d}
    )
    out = cache.materialize(sid, ["d"])
    assert out.hidden_states is not None
    assert out.hidden_states["d"].shape == (0, 3)  # dropped by the scheduler: none handed on
    assert out.mm_outputs["mm.codes"]["d"].shape[0] == 0
    assert cache.take_invalid_blocks(sid) == [4]
    assert cache.take_invalid_blocks(sid) == []
    assert cache.rules.recomputing() == ["d"]
    # vLLM rolled d back to block 4's start (0): every row computed again.
    d_all = rows(9, 20.0)
    sid = step(cache, view, sched(cont=(("d", None, 0, 9),)), d_all, **{"mm.codes": d_all})
    out = cache.materialize(sid, ["d"])
    assert out.hidden_states is not None
    assert torch.equal(out.hidden_states["d"], d_all)
    assert cache.rules.recomputing() == []
    # e hits d's rewritten blocks 4, 5: served, nothing to report.
    e = rows(1, 50.0)
    sid = step(cache, view, sched(new=(("e", [4, 5, 7], 8, 1),)), e, **{"mm.codes": e})
    out = cache.materialize(sid, ["e"])
    assert out.hidden_states is not None
    assert torch.equal(out.hidden_states["e"], torch.cat([d_all[:8], e]))
    assert cache.take_invalid_blocks(sid) == []


def test_recomputed_hit_reread_from_its_rollback_point() -> None:
    """Rolled back to a block boundary after the written blocks: rows before it are read
    from the cache, rows from it are the step's."""
    cache, view, a = warm()
    cache.set_recompute_refused(True)
    # f computes block 3 in a step never saved; g hits blocks 1, 2 (a's) and 3.
    cache.new_step_starts(sched(new=(("f", [1, 2, 3], 8, 4),), finished=("a",)))
    g = rows(1, 9.0)
    sid = step(
        cache, view, sched(new=(("g", [1, 2, 3, 6], 12, 1),), finished=("f",)), g, **{"mm.codes": g}
    )
    cache.materialize(sid, ["g"])
    assert cache.take_invalid_blocks(sid) == [3]
    g_tail = rows(5, 30.0)
    sid = step(cache, view, sched(cont=(("g", None, 8, 5),)), g_tail, **{"mm.codes": g_tail})
    out = cache.materialize(sid, ["g"])
    assert out.hidden_states is not None
    assert torch.equal(out.hidden_states["g"], torch.cat([a, g_tail]))
    # A rollback that is not block aligned is refused before anything changes.
    cache2, view2, _ = warm()
    cache2.set_recompute_refused(True)
    cache2.new_step_starts(sched(new=(("f", [1, 2, 3], 8, 4),), finished=("a",)))
    sid = step(
        cache2,
        view2,
        sched(new=(("g", [1, 2, 3, 6], 12, 1),), finished=("f",)),
        g,
        **{"mm.codes": g},
    )
    cache2.discard_step(sid)
    with pytest.raises(InvalidArgumentError):
        cache2.new_step_starts(sched(cont=(("g", None, 9, 4),)))
    assert cache2.rules.recomputing() == ["g"]


def test_non_aligned_hit_is_refused_before_anything_changes() -> None:
    cache, _, _ = warm()
    live = cache.rules.num_live
    with pytest.raises(InvalidArgumentError):
        cache.new_step_starts(sched(new=(("b", [1, 2, 3], 6, 2),)))
    assert cache.rules.num_live == live and not cache.rules.has_pending_step


@pytest.mark.parametrize("deliver_once", [True, False])
@pytest.mark.parametrize(
    "mutant", [None, pytest.param("continuation_hit", marks=pytest.mark.hooks)]
)
def test_a_live_request_resent_as_new_gets_this_steps_rows(
    mutant: str | None, deliver_once: bool
) -> None:
    """A request resent among ``scheduled_new_reqs`` while live (vllm-omni's async-chunk
    continuation, vLLM's V2-runner resumption) gets this step's rows only, as vllm-omni
    serves it, not its prefix again. vLLM's own scheduler never resends one, so the
    differential does not reach this rule: it and its mutant are checked here. The
    delivery watermark (``deliver_once``) also trims a resent prefix, so the rule's mutant
    is caught with the watermark off; with it on, the rows are right even then."""
    cache, view = make(deliver_once)
    a = rows(8, 0.0)
    sid = step(cache, view, sched(new=(("a", [1, 2], 0, 8),)), a, **{"mm.codes": a})
    cache.materialize(sid, ["a"])
    if mutant is not None:
        cache.rules._break_rule(mutant)
    x = rows(1, 50.0)
    sid = step(cache, view, sched(new=(("a", [1, 2, 3], 8, 1),)), x, **{"mm.codes": x})
    out = cache.materialize(sid, ["a"])
    assert out.hidden_states is not None
    served_step_rows = torch.equal(out.hidden_states["a"], x)
    assert served_step_rows == (mutant is None or deliver_once)


def test_only_plain_rows_are_copied_once_more() -> None:
    """A step with a served hit and a plain request keeps a copy of the plain request's
    rows only (the hit's rows are in its gathered rows); both are served right."""
    cache, view, a = warm()
    b_new, c = rows(2, 100.0), rows(3, 200.0)
    so = sched(new=(("b", [1, 2, 3], 8, 2), ("c", [4], 0, 3)), finished=("a",))
    cache.new_step_starts(so)
    view.order = ["c", "b"]
    x = torch.cat([c, b_new])
    sid = cache.save_outputs(x, {"mm.codes": x * 2}, num_tokens_unpadded=5, num_tokens_padded=5)
    kept = cache._steps[sid].plain["__hidden_states__"]
    assert [t.shape[0] for t in kept] == [3]
    # warm()'s step wrote and kept a's 8 rows; this one writes 5, gathers b's 10 rows
    # (cached prefix + its 2 new rows) and keeps c's 3.
    assert cache.row_copies() == {"written": 13, "gathered": 10, "kept": 11}
    out = cache.materialize(sid, ["b", "c"])
    assert out.hidden_states is not None
    assert torch.equal(out.hidden_states["b"], torch.cat([a, b_new]))
    assert torch.equal(out.hidden_states["c"], c)
    assert torch.equal(out.mm_outputs["mm.codes"]["c"], c * 2)


def test_batch_that_does_not_match_the_step_is_refused() -> None:
    cache, view, _ = warm()
    cache.new_step_starts(sched(new=(("b", [3], 0, 2), ("c", [4], 0, 2))))
    view.order = ["b"]  # c is missing from the runner's batch
    with pytest.raises(InvalidArgumentError):
        cache.save_outputs(rows(4, 0.0), {}, num_tokens_unpadded=4, num_tokens_padded=4)


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSCACHE_OMNI_STORAGE", "nowhere")
    with pytest.raises(InvalidArgumentError):
        OmniSettings.from_env()
    monkeypatch.setenv("HSCACHE_OMNI_STORAGE", "device")
    monkeypatch.setenv("HSCACHE_OMNI_PREFIX_CACHE", "1")
    s = OmniSettings.from_env()
    assert s.enabled and s.storage == "device"
    monkeypatch.delenv("HSCACHE_OMNI_PREFIX_CACHE")
    assert not install()  # off: nothing is touched
    assert "HSCACHE_OMNI_PREFIX_CACHE" not in os.environ


def test_materialize_on_another_thread_while_saving() -> None:
    """vllm-omni's async output thread materializes step N while the engine saves N + 1."""
    from concurrent.futures import ThreadPoolExecutor

    view = View()
    cache = OmniHiddenStateCache(
        NS(num_blocks=8, block_size=BS), view, settings=OmniSettings(storage="cpu")
    )
    futures = []
    with ThreadPoolExecutor(1) as pool:
        for i in range(60):
            r = f"r{i}"
            block = i % 7 + 1
            prev = (f"r{i - 1}",) if i else ()
            so = sched(new=((r, [block], 0, 4),), finished=prev)
            x = rows(4, float(i * 100))
            sid = step(cache, view, so, x, **{"mm.codes": x})
            futures.append((pool.submit(cache.materialize, sid, [r]), r, x))
        for fut, r, x in futures:
            out = fut.result()
            assert out.hidden_states is not None
            assert torch.equal(out.hidden_states[r], x)
    assert cache.unconsumed_steps() == []


def test_model_without_per_token_outputs_keeps_nothing() -> None:
    """A policy without hidden states and no per-token mm: nothing cached, no backlog
    growing, and a per-token key appearing later is refused."""
    cache, view = make()
    cache.register_policy(NS(needs_full_hidden_states=False))
    for i in range(3):
        sid = step(cache, view, sched(new=((f"r{i}", [i + 1], 0, 2),)), rows(2, 0.0))
        out = cache.materialize(sid, [f"r{i}"])
        assert out.hidden_states is None and out.mm_outputs == {}
    assert cache.cache is None and cache.bytes_per_token() == 0
    cache.new_step_starts(sched(new=(("x", [5], 0, 2),)))
    view.order = ["x"]
    with pytest.raises(UnsupportedOutputError):
        cache.save_outputs(
            rows(2, 0.0), {"mm.codes": rows(2, 0.0)}, num_tokens_unpadded=2, num_tokens_padded=2
        )


def test_a_discard_wakes_a_save_waiting_for_room() -> None:
    """A save that waits for a consumed step is woken by ``discard_step`` as by
    ``materialize`` (it would otherwise wait out ``step_wait_s`` and raise)."""
    import threading
    import time

    view = View()
    cache = OmniHiddenStateCache(
        NS(num_blocks=8, block_size=BS),
        view,
        settings=OmniSettings(storage="cpu", max_unconsumed_steps=1, step_wait_s=60.0),
    )
    first = step(cache, view, sched(new=(("a", [1], 0, 1),)), rows(1, 0.0))
    cache.new_step_starts(sched(new=(("b", [2], 0, 1),)))
    view.order = ["b"]
    result: list[object] = []

    def save() -> None:
        try:
            result.append(
                cache.save_outputs(rows(1, 1.0), {}, num_tokens_unpadded=1, num_tokens_padded=1)
            )
        except Exception as e:  # reported below
            result.append(e)

    saver = threading.Thread(target=save)
    saver.start()
    deadline = time.monotonic() + 30  # a guard against a hang, not a timing assertion
    while not cache._savers_waiting and saver.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    cache.discard_step(first)
    # Woken, it returns at once; unwoken it would sleep out the 60 s (then succeed).
    saver.join(timeout=30)
    assert not saver.is_alive(), "the discard did not wake the waiting save"
    assert len(result) == 1 and isinstance(result[0], int), result
    assert cache.unconsumed_steps() == [result[0]]


def test_resumed_request_hands_each_row_on_once_and_is_forgotten_when_finished() -> None:
    """p prefills 8 tokens and decodes one (rows 0..8 handed on), is preempted, and resumes
    at its 8-token hit on its own blocks: the resumed step's row (position 8 again) is not
    handed on a second time, the next decode row (position 9) is; once p has finished and
    its steps are consumed, hscache keeps no watermark for it."""
    cache, view = make()
    p = rows(8, 0.0)
    sid = step(cache, view, sched(new=(("p", [1, 2], 0, 8),)), p, **{"mm.codes": p})
    assert cache.materialize(sid, ["p"]).hidden_states["p"].shape[0] == 8  # type: ignore[index]
    d = rows(1, 40.0)
    sid = step(cache, view, sched(cont=(("p", [3], 8, 1),)), d, **{"mm.codes": d})
    assert cache.materialize(sid, ["p"]).hidden_states["p"].shape[0] == 1  # type: ignore[index]
    preempt = sched()
    preempt.preempted_req_ids = {"p"}
    cache.new_step_starts(preempt)
    resumed = sched(cont=(("p", [1, 2, 4], 8, 1),))
    resumed.scheduled_cached_reqs.resumed_req_ids = {"p"}
    again = rows(1, 40.0)
    sid = step(cache, view, resumed, again, **{"mm.codes": again})
    out = cache.materialize(sid, ["p"])
    assert out.hidden_states is not None
    assert out.hidden_states["p"].shape == (0, W)  # position 8: handed on already
    assert out.mm_outputs["mm.codes"]["p"].shape == (0, W)
    nxt = rows(1, 60.0)
    sid = step(cache, view, sched(cont=(("p", None, 9, 1),)), nxt, **{"mm.codes": nxt})
    out = cache.materialize(sid, ["p"])
    assert out.hidden_states is not None
    assert torch.equal(out.hidden_states["p"], nxt)  # position 9: new
    cache.new_step_starts(sched(finished=("p",)))
    assert "p" not in cache._delivered and "p" not in cache._floors


def test_watermark_of_a_request_finished_before_its_last_step_is_consumed() -> None:
    """The async output thread materializes a step late: q's last step is consumed after the
    step that reports q finished began; its rows are still handed on, then q is forgotten."""
    cache, view = make()
    q = rows(8, 0.0)
    sid = step(cache, view, sched(new=(("q", [1, 2], 0, 8),)), q, **{"mm.codes": q})
    cache.new_step_starts(sched(finished=("q",)))
    assert "q" not in cache._delivered
    out = cache.materialize(sid, ["q"])
    assert out.hidden_states is not None
    assert torch.equal(out.hidden_states["q"], q)
    assert "q" not in cache._delivered and not cache._retiring
