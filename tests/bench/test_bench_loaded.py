"""Quick runs of ``bench-scheduler --loaded`` (``hscache_tools.bench.loaded``): a loaded step.

Checks that every variant runs stock vLLM and ``hscache.vllm.Scheduler`` on a trace that
keeps a queue and admits while decoding, compares their decisions and outputs at every
step (and that the comparison catches a side that answers differently), and reports the
fast path's per-phase counters; and that the command line prints the table. No timing
assertions.
"""

from __future__ import annotations

from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache.__main__ import main
from hscache.vllm import Scheduler
from hscache.vllm.scheduler import FAST_PATH_COUNTS
from hscache_tools.bench.loaded import VARIANTS, bench_loaded, run_loaded

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("variant", "async_scheduling"),
    [*((v, False) for v in VARIANTS), ("base", True)],
    ids=[*VARIANTS, "base-async"],
)
def test_sides_compared_at_every_step_and_counters_reported(
    variant: str, async_scheduling: bool
) -> None:
    r = bench_loaded(
        running=8, steps=12, repeat=1, variant=variant, async_scheduling=async_scheduling
    )
    # The warm-up (filling the batch, 16 steps) and the timed steps, all compared.
    assert r["checked_steps"] >= 12 + 16
    assert r["queued"] == 1.0, "a request must wait at every timed step"
    assert r["full"] >= 0.5, "most steps must run max_num_seqs requests"
    assert r["admitted"] > 0 and r["chunked"] > 0
    assert r["vllm_us"] > 0 and r["hscache_us"] > 0
    assert 0.0 <= r["schedule_share"] <= 1.0 and 0.0 <= r["update_share"] <= 1.0
    if variant != "spec":
        # Steady decodes' updates are served (drafts turn the update phase off today).
        assert r["update_share"] > 0
    if variant == "base":
        # Steps whose queue vLLM's waiting loop cannot admit from (all seats taken, every
        # running request a decode) are served whole.
        assert r["schedule_share"] > 0


def test_counters_cover_the_timed_steps() -> None:
    workload: dict[str, int] = {}
    check: list[str] = []
    times, counts = run_loaded("hscache", running=8, steps=10, check=check, workload=workload)
    assert len(times) == 10 and workload["steps"] == 10
    assert set(counts) == set(FAST_PATH_COUNTS)
    assert counts["schedule_steps"] == 10
    assert counts["update_requests"] >= 8 * 9
    assert len(check) >= 10 + 16
    stock_times, stock_counts = run_loaded("vllm", running=8, steps=10)
    assert len(stock_times) == 10 and stock_counts == {}


def test_each_side_hashes_with_its_engines_hasher(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the hscache side's requests carry hscache's native hasher (what its
    Scheduler installs in an engine), the stock side's vLLM's; ``hasher="vllm"`` gives
    both vLLM's. The hashes are equal either way (the sides' hits are compared)."""
    import hscache_tools.testing.requests as requests_module

    seen: dict[str, set[str]] = {}
    run = {"label": ""}
    make = requests_module.make_request

    def spy(*args: Any, **kwargs: Any) -> Any:
        hasher = kwargs["block_hasher"]
        seen.setdefault(run["label"], set()).add(f"{hasher.__module__}.{hasher.__qualname__}")
        return make(*args, **kwargs)

    monkeypatch.setattr(requests_module, "make_request", spy)
    for label, side, hasher in (
        ("engine-hscache", "hscache", "engine"),
        ("engine-vllm", "vllm", "engine"),
        ("vllm-hscache", "hscache", "vllm"),
    ):
        run["label"] = label
        run_loaded(side, running=8, steps=4, hasher=hasher)
    native = "hscache.vllm.block_hasher.get_request_block_hasher.<locals>.request_block_hasher"
    assert seen["engine-hscache"] == {native}, seen
    vllms = "vllm.v1.core.kv_cache_utils.get_request_block_hasher.<locals>.request_block_hasher"
    assert seen["engine-vllm"] == seen["vllm-hscache"] == {vllms}, seen
    with pytest.raises(ValueError, match="unknown hasher"):
        run_loaded("hscache", running=8, steps=4, hasher="nope")


def test_a_different_answer_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    update = Scheduler.update_from_output

    def wrong(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = update(self, scheduler_output, model_runner_output)
        for eco in outputs.values():
            for o in eco.outputs[:1]:
                o.new_token_ids = [t + 1 for t in o.new_token_ids]
        return outputs

    monkeypatch.setattr(Scheduler, "update_from_output", wrong)
    with pytest.raises(RuntimeError, match="diverged from vLLM at step"):
        bench_loaded(running=8, steps=4, repeat=1)


def test_cli_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench-scheduler", "--loaded", "8", "--steps", "4", "--repeat", "1"]
    assert main([*args, "--variant", "base,lora"]) == 0
    out = capsys.readouterr().out
    assert "identical at every step" in out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.split()[:2] in (["base", "8"], ["lora", "8"])
    ]
    assert len(rows) == 2
    assert all(row[4].endswith("x") and row[5].endswith("%") for row in rows)
    assert ">= 4x" in out
    with pytest.raises(SystemExit):
        main([*args, "--variant", "nope"])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_talker_stage_under_vllm_omnis_scheduler(async_scheduling: bool) -> None:
    """``--variant talker``: vllm-omni's own ``OmniARScheduler`` (vLLM's manager) against
    ``hscache.omni.OmniARScheduler`` (with the fast path); vLLM 0.30 + vllm-omni 0.30's
    environment only."""
    pytest.importorskip(
        "vllm_omni.core.sched.omni_ar_scheduler",
        reason="needs vllm-omni 0.30 (the environment of scripts/vllm030_env.sh)",
    )
    r = bench_loaded(
        running=8, steps=12, repeat=1, variant="talker", async_scheduling=async_scheduling
    )
    assert r["checked_steps"] >= 12 + 16
    assert r["queued"] == 1.0 and r["admitted"] > 0
    assert r["vllm_us"] > 0 and r["hscache_us"] > 0
    # hscache's omni schedulers have the fast path: both phases served some of it.
    assert r["schedule_share"] > 0 and r["update_share"] > 0, r
