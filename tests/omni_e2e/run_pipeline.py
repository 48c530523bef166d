"""Runs one arm of hscache's vllm-omni end-to-end check: a real thinker -> talker pipeline.

A tiny random Qwen2.5-Omni (:mod:`make_model`) served by ``vllm_omni.Omni`` on CPU (the
scaffolding plugin ``tests/omni_e2e/plugin`` must be installed in the venv): qwen2_5_omni's
stages 0 (thinker) and 1 (talker), the thinker's latent hidden states passed to the talker.
Arms: ``cold`` (thinker prefix caching off), ``omni`` (vllm-omni's own hidden-state cache),
``hscache`` (hscache's KV-cache manager and hidden-state cache, ``HSCACHE_STRICT=1``,
both stages on hscache's omni schedulers, :func:`scheduler_cls`: the fast path);
``hybrid``: the ``hscache`` arm on a thinker with a full-attention and a sliding-window
layer (``make_model.py --sliding-window``), which vllm-omni's own cache refuses, over its
own workload (:func:`hybrid_workload`) whose last round recomputes every request cold in
the same engine (a per-request ``cache_salt``: no hit); and, for the talker's prefix
caching (off upstream, see docs/omni.md), ``talker_pc`` (``omni`` with the talker's prefix
caching on) and ``talker_pc_fixed`` (the same with the scaffolding's span-aligned talker
inputs, ``HSCACHE_E2E_TALKER_SPAN_FIX=1``).
``cold_spec`` / ``hscache_spec``: the thinker drafts with ngram (:data:`SPEC_CONFIG`,
synchronous scheduling) over :func:`spec_workload`, prefix caching off / hscache's.
Writes a JSON: per request the talker's token ids and the thinker's ``num_cached_tokens``,
per round its kind, wall time and the thinker scheduler's probe record after it (the
proof that its hard case happened), the stage start time, and the probe records (who
served the caches, their counters) of every engine process. Checks live in
``test_omni_pipeline.py``. Beside it, ``<out>.rows.pt``: per ``round/request`` the
thinker rows the request handed the talker (the probe's ``HSCACHE_E2E_ROWS_DIR``).
Usage (vLLM 0.30 venv):
``python tests/omni_e2e/run_pipeline.py --arm hscache --model DIR --out arm.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PIPELINE = "hscache_e2e_thinker_talker"
ARMS = (
    "cold",
    "omni",
    "hscache",
    "hybrid",
    "talker_pc",
    "talker_pc_fixed",
    "cold_spec",
    "hscache_spec",
)
SPEC_ARMS = ("cold_spec", "hscache_spec")
#: The thinker's drafting in the ``*_spec`` arms: vLLM's ngram proposer (CPU), prompt
#: lookup of 2-4 tokens, 3 drafts a step. vLLM 0.30 schedules ngram drafting synchronously
#: only (it disables async scheduling for it, or refuses an explicit ``true``).
SPEC_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
SPEC_MAX_TOKENS = 32
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
# The KV pools, in blocks: the thinker's small (blocks get recycled, requests preempted).
THINKER_BLOCKS = 24
TALKER_BLOCKS = 48
THINKER_CHUNK = 64  # max_num_batched_tokens: every thinker prompt is a chunked prefill
MAX_MODEL_LEN = 512
THINKER_MAX_TOKENS = 6
TALKER_MAX_TOKENS = 8
KV_BYTES_PER_TOKEN = 2 * 2 * 1 * 32 * 4  # layers x (K, V) x KV heads x head_dim x fp32
# First text id of the filler range of make_model's tokenizer (any id < 151643 works).
TEXT_ID_BASE = 1000


def _prefix(seed: int, n: int) -> list[int]:
    return [TEXT_ID_BASE + (seed * 7919 + i * 104729) % 50000 for i in range(n)]


GATE_TOKEN = 999  # the probe holds [GATE_TOKEN, k, ...] prompts until k have arrived
PREEMPT_MAX_TOKENS = 130  # two 9-block prompts decoding 130 tokens: 28 blocks > 23
ABORT_MAX_TOKENS = 300  # the aborted request would decode this long; aborted long before


@dataclasses.dataclass(frozen=True)
class Round:
    """A round of prompts sent in one ``Omni.generate`` call.

    ``kind``: which case it is (``abort`` is sent and aborted by hand, not generated);
    ``deterministic``: its thinker hits are independent of timing;
    ``thinker_max_tokens``: the thinker's decode length in this round;
    ``salted``: each prompt carries its own ``cache_salt`` (no prefix hit: a cold run);
    ``thinker_repetition_penalty``: the thinker's (1.0 in the drafting rounds, where the
    random model's repeats are what ngram drafts get accepted on)."""

    kind: str
    deterministic: bool
    prompts: list[tuple[str, list[int]]]
    thinker_max_tokens: int = THINKER_MAX_TOKENS
    salted: bool = False
    thinker_repetition_penalty: float = 1.1


def _gated(k: int, seed: int, n: int) -> list[int]:
    return [GATE_TOKEN, k, *_prefix(seed, n - 2)]


def workload() -> list[Round]:
    """The rounds.

    1. Cold caches: two long shared prefixes (5 and 4 blocks), one prompt twice (its twin
       hits the first's blocks if they were computed before it arrived, or is computed
       beside it in the same step).
    2. Exact repeats of round 1 and new suffixes over the same prefixes (deterministic).
    3. Pressure: four prompts over fresh prefixes, 13 blocks each, in the thinker's pool
       of 24 blocks (23 usable): every cached block of rounds 1-2 is recycled (two
       prefilling at once may not fit: preemption here depends on timing).
    4. Recycled blocks: repeats of round 3's last prompts (hits on blocks whose previous
       tenants were round 1-3's) and of round 1's (recomputed or partly hit).
    5. Same step: three identical 40-token prompts, gated by the probe so that all three
       are scheduled in one step: the second and third hit the first one's block while
       it is being computed in that very step.
    6. Preemption: two gated 9-block prompts decoding 130 tokens together: 28 blocks in
       23, so the later one is preempted and resumed (hitting its own cached blocks).
    7. Abort: one 101-token prompt decoding up to 300 tokens, aborted through
       ``Omni.abort`` once the thinker has decoded a few tokens of it.
    8. After the abort: its prompt again and a new suffix over its first 3 blocks, which
       hit the blocks (and rows) the aborted request computed (deterministic).
    9-10. Never preempted: each of round 6's prompts again, with its own ``cache_salt``
       (no hit: cold in every arm), beside a 3-token gated partner (19 blocks in 23: no
       preemption): the rows a never-preempted run hands the talker, round 6's reference.
    The thinker prefills at most 64 tokens a step: every long prompt is a chunked prefill.
    """
    a, b = _prefix(1, 160), _prefix(2, 128)
    round1 = [
        ("a1", a + _prefix(11, 13)),
        ("a2", a + _prefix(12, 21)),
        ("a1_twin", a + _prefix(11, 13)),
        ("b1", b + _prefix(21, 9)),
    ]
    round2 = [
        ("a1_again", a + _prefix(11, 13)),
        ("a3", a + _prefix(13, 30)),
        ("b1_again", b + _prefix(21, 9)),
        ("b2", b + _prefix(22, 17)),
    ]
    pressure = [(f"p{k}", _prefix(30 + k, 384) + _prefix(40 + k, 15)) for k in range(4)]
    recycled = [
        ("p2_again", pressure[2][1]),
        ("p3_again", pressure[3][1]),
        ("a1_late", round1[0][1]),
        ("b1_late", round1[3][1]),
    ]
    same = _gated(3, 50, 40)
    x = _prefix(70, 96) + _prefix(71, 5)
    preempt = [("q1", _gated(2, 60, 288)), ("q2", _gated(2, 61, 288))]
    solo = [
        Round(
            f"solo_{name}",
            True,
            [(name, ids), (f"partner_{name}", _gated(2, 62, 3))],
            thinker_max_tokens=PREEMPT_MAX_TOKENS,
            salted=True,
        )
        for name, ids in preempt
    ]
    return [
        Round("shared", False, round1),
        Round("repeat", True, round2),
        Round("pressure", False, pressure),
        Round("recycled", False, recycled),
        Round("same_step", True, [("s1", same), ("s2", same), ("s3", same)]),
        Round("preempt", True, preempt, thinker_max_tokens=PREEMPT_MAX_TOKENS),
        Round("abort", True, [("x", x)], thinker_max_tokens=ABORT_MAX_TOKENS),
        Round("after_abort", True, [("x_again", x), ("x_branch", x[:96] + _prefix(72, 9))]),
        *solo,
    ]


def hybrid_workload() -> list[Round]:
    """The ``hybrid`` arm's rounds (a thinker whose layer 1 slides over 64 tokens, two
    blocks: vLLM's sliding-window manager hits only where the two blocks before the hit's
    end are still cached, and frees a running request's blocks that fell out of the window).

    1. Cold caches: a 6-block prefix with a tail, and a 5-block one with a tail.
    2. Hits under the window (deterministic: only round 1's blocks are hit): an exact
       repeat (6 blocks), a new tail over the whole 6-block prefix, a new tail after its
       first 3 blocks (the window's blocks 1-2 were freed by round 1's request once out of
       its window, and are hit from the free queue), the other prompt again (5 blocks).
    3. Reference: every request of rounds 1-2 again, each with its own ``cache_salt``
       (no prefix hit, no cached row: a cold run of the same engine).
    """
    a, b = _prefix(81, 192), _prefix(82, 160)
    seed = [("h1", a + _prefix(91, 13)), ("g1", b + _prefix(92, 9))]
    hits = [
        ("h1_again", seed[0][1]),
        ("h2", a + _prefix(93, 21)),
        ("h3", a[:96] + _prefix(94, 30)),
        ("g1_again", seed[1][1]),
    ]
    reference = [
        (f"{kind}/{name}", ids)
        for kind, rnd in (("seed", seed), ("hits", hits))
        for name, ids in rnd
    ]
    return [
        Round("seed", False, seed),
        Round("hits", True, hits),
        Round("reference", True, reference, salted=True),
    ]


def spec_workload() -> list[Round]:
    """The ``*_spec`` arms' rounds (the thinker drafting with ngram, :data:`SPEC_CONFIG`):
    prompts over repeated phrases, 32 decode tokens each, no repetition penalty. The random
    model's greedy tokens rarely continue a phrase; its drafts come from its own repeats
    (``r1_branch`` decodes one token 8 times: drafts accepted, then rejected where the
    repeat ends; measured 5 drafts, 3 accepted, 2 rejected in round 2, the same in both
    arms, since drafts and acceptance follow from the tokens).

    1. Cold caches: three prompts of 2-3 blocks, two over one repeated phrase.
    2. Hits with drafting on (deterministic: only round 1's blocks are hit): an exact
       repeat, a new tail over the first one's 2 full blocks, the third again.
    """
    phrase, other = _prefix(101, 12), _prefix(102, 10)
    seed = [
        ("r1", phrase * 6 + _prefix(111, 5)),
        ("r2", phrase * 4 + other * 3 + _prefix(112, 7)),
        ("r3", other * 8 + _prefix(113, 3)),
    ]
    hits = [
        ("r1_again", seed[0][1]),
        ("r1_branch", seed[0][1][:64] + _prefix(114, 11)),
        ("r3_again", seed[2][1]),
    ]
    return [
        Round("spec_seed", False, seed, SPEC_MAX_TOKENS, thinker_repetition_penalty=1.0),
        Round("spec_hits", True, hits, SPEC_MAX_TOKENS, thinker_repetition_penalty=1.0),
    ]


def scheduler_cls(arm: str, async_scheduling: bool) -> str | None:
    """The stages' scheduler class in this arm: hscache's omni schedulers (vllm-omni's
    own, on hscache's manager, with the fast path) in the ``hscache`` arm, matching the
    stages' ``async_scheduling``; None (vllm-omni's choice) elsewhere. The ``hybrid`` and
    ``hscache_spec`` arms keep ``HSCACHE=1`` alone: hscache's manager under vllm-omni's
    classes, no fast path."""
    if arm != "hscache":
        return None
    return "hscache.omni." + ("OmniARAsyncScheduler" if async_scheduling else "OmniARScheduler")


def register_pipeline(stage_scheduler_cls: str | None = None) -> None:
    """qwen2_5_omni's stages 0 and 1, the talker a final output too (its token ids), both
    on ``stage_scheduler_cls`` where given. It is the pipeline's (topology) field:
    vllm-omni 0.30 overwrites a deploy YAML stage's ``scheduler_cls`` with it
    (``StageConfig.to_omegaconf``), so a YAML key would be silently ignored."""
    from vllm_omni.config.pipeline_registry import register_pipeline as register
    from vllm_omni.model_executor.models.qwen2_5_omni.pipeline import QWEN2_5_OMNI_PIPELINE

    thinker, talker = QWEN2_5_OMNI_PIPELINE.stages[:2]
    talker = dataclasses.replace(
        talker,
        final_output=True,
        final_output_type="text",
        custom_process_next_stage_input_func=None,
    )
    if stage_scheduler_cls is not None:
        thinker = dataclasses.replace(thinker, scheduler_cls=stage_scheduler_cls)
        talker = dataclasses.replace(talker, scheduler_cls=stage_scheduler_cls)
    register(
        dataclasses.replace(
            QWEN2_5_OMNI_PIPELINE,
            model_type=PIPELINE,
            default_deploy_config_name=None,
            stages=(thinker, talker),
        )
    )


def deploy_yaml(arm: str, async_scheduling: bool) -> str:
    def stage(
        stage_id: int, prefix_caching: bool, blocks: int, chunk: int, sampling: dict[str, Any]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "stage_id": stage_id,
            "max_num_seqs": 4,
            "max_num_batched_tokens": chunk,
            "max_model_len": MAX_MODEL_LEN,
            "block_size": BLOCK_SIZE,
            "kv_cache_memory_bytes": blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN,
            "enforce_eager": True,
            "dtype": "float32",
            "enable_prefix_caching": prefix_caching,
            "async_scheduling": async_scheduling,
            "mm_processor_cache_gb": 0,
            "default_sampling_params": sampling,
        }
        if stage_id == 0 and arm in SPEC_ARMS:
            # The drafts themselves come through the scaffolding (HSCACHE_E2E_THINKER_SPEC):
            # vllm-omni 0.30's deploy YAML refuses a stage's speculative_config.
            out["async_scheduling"] = False  # vLLM drafts with ngram synchronously only
        return out

    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 42}
    config = {
        "pipeline": PIPELINE,
        "async_chunk": False,
        "stages": [
            stage(
                0,
                not arm.startswith("cold"),
                THINKER_BLOCKS,
                THINKER_CHUNK,
                {**greedy, "max_tokens": THINKER_MAX_TOKENS, "repetition_penalty": 1.1},
            ),
            # The talker's own prefix caching stays off, as upstream ships it, except in
            # the arms that look at it.
            stage(
                1,
                arm.startswith("talker_pc"),
                TALKER_BLOCKS,
                1024,
                {**greedy, "max_tokens": TALKER_MAX_TOKENS, "repetition_penalty": 1.05},
            ),
        ],
    }
    return json.dumps(config, indent=2)  # JSON is YAML


def arm_env(arm: str) -> dict[str, str]:
    on = arm in ("hscache", "hybrid", "hscache_spec")
    return {
        "HSCACHE_OMNI_CPU": "1",  # the scaffolding's CPU platform (tests/omni_e2e/plugin)
        "HSCACHE": "1" if on else "0",
        "HSCACHE_OMNI_PREFIX_CACHE": "1" if on else "0",
        "HSCACHE_STRICT": "1" if on else "0",
        "HSCACHE_STATS": "1",
        "HSCACHE_E2E_TALKER_SPAN_FIX": "1" if arm == "talker_pc_fixed" else "0",
        # The thinker's drafting (tests/omni_e2e/plugin/hscache_omni_cpu/drafting.py).
        "HSCACHE_E2E_THINKER_SPEC": json.dumps(SPEC_CONFIG) if arm in SPEC_ARMS else "",
    }


def _stage_outputs(out: Any) -> tuple[int | None, list[int], int | None]:
    stage = getattr(out, "stage_id", None)
    inner = getattr(out, "request_output", None) or out
    token_ids = list(inner.outputs[0].token_ids) if inner.outputs else []
    return stage, token_ids, getattr(inner, "num_cached_tokens", None)


def _params(thinker_max_tokens: int, thinker_repetition_penalty: float = 1.1) -> list[Any]:
    from vllm import SamplingParams

    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=thinker_max_tokens,
            repetition_penalty=thinker_repetition_penalty,
            seed=42,
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=TALKER_MAX_TOKENS,
            repetition_penalty=1.05,
            seed=42,
            stop_token_ids=[8294],
        ),
    ]


def _generate(omni: Any, rnd: Round, params: list[Any]) -> dict[str, Any]:
    """One ``Omni.generate`` call with all the round's prompts (submitted together)."""
    prompts: list[dict[str, Any]] = [{"prompt_token_ids": ids} for _, ids in rnd.prompts]
    if rnd.salted:
        for prompt, (name, _) in zip(prompts, rnd.prompts, strict=True):
            prompt["cache_salt"] = f"cold:{name}"
    outs = omni.generate(prompts, params, use_tqdm=False)
    by_req: dict[str, dict[str, Any]] = {}
    order = {}
    for out in outs:
        stage, token_ids, cached = _stage_outputs(out)
        rec = by_req.setdefault(out.request_id, {"request_id": str(out.request_id)})
        if stage == 0:
            rec["thinker_token_ids"] = token_ids
            rec["thinker_num_cached_tokens"] = cached
        else:
            rec["talker_token_ids"] = token_ids
            rec["talker_num_cached_tokens"] = cached
        order[out.request_id] = int(str(out.request_id).split("_", 1)[0])
    requests = {}
    for req_id, rec in by_req.items():
        name, ids = rnd.prompts[order[req_id]]
        requests[name] = {**rec, "prompt_len": len(ids)}
    return requests


def _thinker_record(probe_dir: Path) -> dict[str, Any]:
    """The thinker scheduler's latest probe record ({} before the probe wrote one)."""
    for path in sorted(probe_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for sched in record["schedulers"]:
            if sched["stage"] == "thinker":
                return dict(sched)
    return {}


def _wait_for(probe_dir: Path, what: str, ok: Any, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = _thinker_record(probe_dir)
        if record and ok(record):
            return record
        time.sleep(0.05)
    raise TimeoutError(f"the thinker never showed {what}: {_thinker_record(probe_dir)}")


def _abort(omni: Any, probe_dir: Path, rnd: Round, params: list[Any]) -> dict[str, Any]:
    """Submits the round's one prompt as ``Omni.generate`` does, waits (by the probe) until
    the thinker is decoding it, aborts it through ``Omni.abort`` (vllm-omni's abort path:
    orchestrator, then each stage's engine core), and waits until the thinker has
    finished it and holds no KV block. Records what the probe saw then."""
    ((name, ids),) = rnd.prompts
    req_id = f"0_abort-{name}"
    params = omni._maybe_force_final_only_for_llm_stages(params)
    final = omni._compute_final_stage_id(None)
    before = _thinker_record(probe_dir).get("aborted", 0)
    omni.engine.add_request(
        request_id=req_id,
        prompt={"prompt_token_ids": ids},
        sampling_params_list=params,
        final_stage_id=final,
        final_output_stage_ids=omni._compute_final_output_stage_ids(None) or [final],
    )
    decoding = _wait_for(
        probe_dir,
        f"{req_id} decoding",
        lambda r: r.get("running", {}).get(req_id, 0) >= len(ids) + 4,
    )
    omni.abort([req_id])
    done = _wait_for(
        probe_dir,
        f"{req_id} aborted and freed",
        lambda r: r.get("aborted", 0) > before and r["unfinished"] == 0 and r["kv_usage"] == 0,
    )
    return {
        name: {
            "aborted_at_computed_tokens": decoding["running"][req_id],
            "aborted_blocks": done.get("aborted_blocks", 0),
            "prompt_len": len(ids),
        }
    }


def _thinker_text_config(model: Path) -> dict[str, Any]:
    """The served model's thinker layout (which layers slide, over how many tokens)."""
    config = json.loads((model / "config.json").read_text())
    text = config["thinker_config"]["text_config"]
    keys = ("use_sliding_window", "sliding_window", "layer_types", "max_window_layers")
    return {k: text.get(k) for k in keys}


def _take_rows(rows_dir: Path, requests: dict[str, Any]) -> dict[str, Any]:
    """The thinker rows each request of a round handed the talker (the probe's files),
    by request name; the files are removed."""
    import torch
    from hscache_omni_cpu.probe import safe_name

    out = {}
    for name, rec in requests.items():
        rid = str(rec.get("request_id", ""))
        found = sorted(rows_dir.glob(f"{safe_name(rid)}*.pt")) if rid else []
        if len(found) == 1:  # the engine's id is the driver's, maybe with a suffix
            out[name] = torch.load(found[0])
            found[0].unlink()
    return out


def run(arm: str, model: Path, out_path: Path, async_scheduling: bool) -> dict[str, Any]:
    # Before vllm-omni is imported: it resolves its platform once per process.
    os.environ.update(arm_env(arm))
    # This checkout's scaffolding, in this process and the spawned stage engines, whichever
    # checkout last pip-installed the plugin into the shared venv (its entry points are
    # the same in every checkout; the modules are found by name).
    plugin = str(Path(__file__).resolve().parent / "plugin")
    sys.path.insert(0, plugin)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [plugin, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    work = Path(tempfile.mkdtemp(prefix=f"hscache-omni-{arm}-"))
    probe_dir = work / "probe"
    os.environ["HSCACHE_E2E_PROBE_DIR"] = str(probe_dir)
    rows_dir = work / "rows"
    os.environ["HSCACHE_E2E_ROWS_DIR"] = str(rows_dir)
    from vllm_omni import Omni

    stage_scheduler_cls = scheduler_cls(arm, async_scheduling)
    register_pipeline(stage_scheduler_cls)
    deploy = work / "deploy.yaml"
    deploy.write_text(deploy_yaml(arm, async_scheduling))
    result: dict[str, Any] = {
        "arm": arm,
        "async_scheduling": async_scheduling,
        "block_size": BLOCK_SIZE,
        "scheduler_cls": stage_scheduler_cls,
        "thinker_text_config": _thinker_text_config(model),
        "rounds": [],
    }
    rows: dict[str, Any] = {}
    t0 = time.perf_counter()
    omni = Omni(model=str(model), deploy_config=str(deploy), log_stats=False)
    result["start_s"] = time.perf_counter() - t0
    try:
        rounds = (
            hybrid_workload()
            if arm == "hybrid"
            else spec_workload()
            if arm in SPEC_ARMS
            else workload()
        )
        for rnd in rounds:
            params = _params(rnd.thinker_max_tokens, rnd.thinker_repetition_penalty)
            t = time.perf_counter()
            if rnd.kind == "abort":
                requests = _abort(omni, probe_dir, rnd, params)
            else:
                requests = _generate(omni, rnd, params)
            wall = time.perf_counter() - t
            time.sleep(0.5)  # the probe's record after the round
            if rnd.kind != "abort":
                for name, t in _take_rows(rows_dir, requests).items():
                    rows[f"{rnd.kind}/{name}"] = t
            result["rounds"].append(
                {
                    "kind": rnd.kind,
                    "wall_s": wall,
                    "requests": requests,
                    "deterministic": rnd.deterministic,
                    "thinker": _thinker_record(probe_dir),
                }
            )
        time.sleep(1.0)  # the probe threads write every 0.2 s
        result["probes"] = [json.loads(p.read_text()) for p in sorted(probe_dir.glob("*.json"))]
    finally:
        omni.close()
        shutil.rmtree(work, ignore_errors=True)
    out_path.write_text(json.dumps(result, indent=1, sort_keys=True))
    if rows:
        import torch

        torch.save(rows, out_path.with_suffix(".rows.pt"))
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=ARMS, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sync", action="store_true", help="async_scheduling: false")
    args = parser.parse_args(argv)
    result = run(args.arm, args.model, args.out, async_scheduling=not args.sync)
    print(
        f"{args.arm}: start {result['start_s']:.1f} s, rounds "
        + ", ".join(f"{r['wall_s']:.2f} s" for r in result["rounds"])
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
