"""``python -m hscache bench-omni-e2e``: what a hidden-state cache buys end to end, in
vllm-omni 0.30's real thinker -> talker pipeline on CPU (vLLM 0.30 + vllm-omni 0.30's
environment, run from a checkout of hscache: it uses the CPU scaffolding of
``tests/omni_e2e``).

The model: a random Qwen2.5-Omni made locally (``tests/omni_e2e/make_model.py``; nothing
downloaded) whose thinker is large enough that its prefill dominates a cold request on
this CPU (default: hidden 512, 8 layers, 8 heads / 2 KV heads, fp32), the talker tiny;
served by ``vllm_omni.Omni`` as qwen2_5_omni's stages 0 and 1 (the talker fed the
thinker's latent hidden states of the whole prompt), the talker's own prefix caching off
as upstream ships it. One process per arm (the caches are chosen per process):

- ``off``: thinker prefix caching off (vllm-omni's production default);
- ``vllm-omni``: thinker prefix caching on, vLLM's KV-cache manager and vllm-omni's own
  hidden-state cache (``OmniPrefixCacheManager``);
- ``hscache-kv``: the same with hscache's KV-cache manager (``HSCACHE=1``): what the
  manager alone changes;
- ``hscache``: hscache's KV-cache manager and hidden-state cache (``HSCACHE=1``,
  ``HSCACHE_OMNI_PREFIX_CACHE=1``, ``HSCACHE_STRICT=1``), as ``docs/omni.md`` switches it on.

Traffic, per repeat (each repeat its own ``cache_salt``, so it starts from empty caches in
the same engine): ``shared-first``: ``--concurrency`` requests submitted at once, each one
of ``--systems`` system prompts, every other one followed by one of ``--media`` long
"media-like" prefixes (the run of placeholder tokens an image or a clip becomes), then a
unique user tail: 1-4k tokens with the defaults; ``shared-warm``: as many new requests
(new tails) over the same prefixes, which a cache can serve from the first round;
``unique``: as many requests of the same lengths sharing nothing, where a cache can only
cost. Each request decodes a few thinker tokens, then the talker prefills the whole prompt
and decodes. Arms run in turn, one after another, the order reversed on every other pass
(``--passes``); inside an arm process the repeats follow each other after a warm-up round.

Measured per request, on one wall clock (``time.time()``) shared by the driver and the
stage processes: the thinker's time to first token (submission to the thinker
scheduler's ``update_from_output`` that gave the request its first token, recorded by the
scaffolding's probe) and the time to the talker's first token (the same in the talker's
scheduler: what a user waiting for speech waits for); per round the requests per second
(requests over the round's wall time, submission to the last output). Reported per arm
and traffic: p50 / p99 over every request of every repeat and pass, the median rounds'
requests per second, and whether every request's thinker and talker tokens equal the
``off`` arm's (fp32, greedy); then the goals (issue 32, item 5). The host is a shared
2-core machine: compare arms within one run (medians), not across runs.
``--quick``: a tiny model and workload, every arm once (no test runs it yet: its one
try under load failed at engine start, see ``docs/omni.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ARMS", "E2EConfig", "format_report", "main", "run"]

ARMS = ("off", "vllm-omni", "hscache-kv", "hscache")
TRAFFIC = ("shared-first", "shared-warm", "unique")
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
TEXT_ID_BASE = 1000  # make_model's filler ids: any id below 151643 is plain text
TEXT_IDS = 50000
HSCACHE_MANAGER = "hscache.vllm.kv_cache_manager.KVCacheManager"
HSCACHE_CACHE = "hscache.omni.prefix_cache.OmniHiddenStateCache"
OMNI_CACHE = "vllm_omni.core.prefix_cache.manager.OmniPrefixCacheManager"
# What each arm's thinker must have run (checked from the probe's records).
EXPECTED = {
    "off": (None, None),
    "vllm-omni": ("vllm.v1.core.kv_cache_manager.KVCacheManager", OMNI_CACHE),
    "hscache-kv": (HSCACHE_MANAGER, OMNI_CACHE),
    "hscache": (HSCACHE_MANAGER, HSCACHE_CACHE),
}


@dataclasses.dataclass(frozen=True)
class E2EConfig:
    """One run's sizes. The defaults: the run in ``docs/omni.md``, four arm processes,
    each a stage-engine pair's start (1-2 minutes on a quiet 2-core host, 5-7 on a loaded
    one) and three rounds (under a minute each with caching off on a loaded host);
    ``passes=2`` runs every arm again in the reverse order (twice as long)."""

    concurrency: int = 8
    repeats: int = 1
    passes: int = 1
    arms: tuple[str, ...] = ARMS
    thinker_hidden: int = 512
    thinker_layers: int = 8
    thinker_heads: int = 8
    thinker_kv_heads: int = 2
    systems: int = 3
    system_len: int = 1024
    media: int = 2
    media_len: int = 1536
    tail_min: int = 32
    tail_max: int = 1024
    thinker_max_tokens: int = 4
    talker_max_tokens: int = 4
    chunk: int = 2048  # the thinker's max_num_batched_tokens
    seed: int = 0
    timeout_s: float = 2400.0  # one arm, its two stage starts included (minutes on a loaded host)

    @property
    def max_prompt(self) -> int:
        return self.system_len + self.media_len + self.tail_max

    @property
    def max_model_len(self) -> int:
        need = self.max_prompt + self.thinker_max_tokens + self.talker_max_tokens + 64
        return -(-need // 1024) * 1024

    def check(self) -> None:
        if min(self.concurrency, self.repeats, self.passes, self.systems) <= 0:
            raise ValueError("concurrency, repeats, passes and systems must be > 0")
        if min(self.system_len, self.tail_min, self.chunk) <= 0 or self.media < 0:
            raise ValueError("system_len, tail_min and chunk must be > 0, media >= 0")
        if self.tail_max < self.tail_min:
            raise ValueError("tail_max must be >= tail_min")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise ValueError(f"arms must be some of {', '.join(ARMS)}; got {unknown}")
        if "off" not in self.arms:
            raise ValueError("the off arm is the reference; it must run")


QUICK = E2EConfig(
    concurrency=4,
    repeats=1,
    passes=1,
    thinker_hidden=64,
    thinker_layers=2,
    thinker_heads=2,
    thinker_kv_heads=1,
    systems=2,
    system_len=96,
    media=1,
    media_len=64,
    tail_min=8,
    tail_max=40,
    chunk=256,
    timeout_s=1800.0,
)


# --- the workload -----------------------------------------------------------------


def _ids(rng: random.Random, n: int) -> list[int]:
    return [TEXT_ID_BASE + rng.randrange(TEXT_IDS) for _ in range(n)]


def prefixes(cfg: E2EConfig) -> tuple[list[list[int]], list[list[int]]]:
    """The system prompts and the media-like prefixes (fixed by the seed)."""
    rng = random.Random(cfg.seed)
    systems = [_ids(rng, cfg.system_len) for _ in range(cfg.systems)]
    media = [_ids(rng, cfg.media_len) for _ in range(cfg.media)]
    return systems, media


def round_prompts(cfg: E2EConfig, traffic: str, repeat: int) -> list[tuple[str, list[int]]]:
    """The prompts of one round: (name, token ids). ``shared-*``: request ``i`` is system
    prompt ``i % systems``, then (odd ``i``) media prefix ``(i // 2) % media``, then a tail
    of its own; ``unique``: prompts of the same lengths, every token its own draw."""
    systems, media = prefixes(cfg)
    salt = {"shared-first": 1, "shared-warm": 2, "unique": 3, "warmup": 4}[traffic]
    rng = random.Random(cfg.seed * 1_000_003 + repeat * 101 + salt)
    # The same lengths in every repeat, and in ``unique`` as in ``shared-first``.
    lengths = random.Random(cfg.seed * 7 + (1 if traffic == "unique" else salt))
    out = []
    for i in range(cfg.concurrency):
        tail = lengths.randint(cfg.tail_min, cfg.tail_max)
        head = list(systems[i % cfg.systems])
        if media and i % 2 == 1:
            head += media[(i // 2) % len(media)]
        if traffic in ("unique", "warmup"):
            ids = _ids(rng, len(head) + tail)
        else:
            ids = head + _ids(rng, tail)
        out.append((f"{traffic}/{i}", ids))
    return out


# --- one arm, in its own process ----------------------------------------------------


def arm_env(arm: str) -> dict[str, str]:
    hs_kv = arm in ("hscache", "hscache-kv")
    return {
        "HSCACHE_OMNI_CPU": "1",  # the scaffolding's CPU platform (tests/omni_e2e/plugin)
        "HSCACHE": "1" if hs_kv else "0",
        "HSCACHE_OMNI_PREFIX_CACHE": "1" if arm == "hscache" else "0",
        "HSCACHE_STRICT": "1" if hs_kv else "0",
        "HSCACHE_STATS": "0",
        "HSCACHE_E2E_TALKER_SPAN_FIX": "0",
    }


def deploy_config(cfg: E2EConfig, arm: str, pipeline: str) -> dict[str, Any]:
    """The deploy YAML (as JSON): the thinker's prefix caching as the arm says, the
    talker's off; KV pools that hold every request of a round at once."""
    head_dim = cfg.thinker_hidden // cfg.thinker_heads
    thinker_kv = cfg.thinker_layers * 2 * cfg.thinker_kv_heads * head_dim * 4  # fp32
    talker_kv = 2 * 2 * 1 * 32 * 4  # make_model's talker: 2 layers, 1 KV head of 32
    tokens = (cfg.concurrency + 2) * cfg.max_model_len

    def stage(
        stage_id: int, caching: bool, kv: int, chunk: int, sampling: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "stage_id": stage_id,
            "max_num_seqs": cfg.concurrency,
            "max_num_batched_tokens": chunk,
            "max_model_len": cfg.max_model_len,
            "block_size": BLOCK_SIZE,
            "kv_cache_memory_bytes": tokens * kv,
            "enforce_eager": True,
            "dtype": "float32",
            "enable_prefix_caching": caching,
            "async_scheduling": True,
            "mm_processor_cache_gb": 0,
            "default_sampling_params": sampling,
        }

    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 42}
    return {
        "pipeline": pipeline,
        "async_chunk": False,
        "stages": [
            stage(
                0,
                arm != "off",
                thinker_kv,
                cfg.chunk,
                {**greedy, "max_tokens": cfg.thinker_max_tokens, "repetition_penalty": 1.1},
            ),
            # The talker prefills a whole prompt in one step (vllm-omni 0.30's talker
            # builds its inputs from the prompt's start on every prefill step).
            stage(
                1,
                False,
                talker_kv,
                max(cfg.max_model_len, cfg.chunk),
                {**greedy, "max_tokens": cfg.talker_max_tokens, "repetition_penalty": 1.05},
            ),
        ],
    }


def _sampling(cfg: E2EConfig) -> list[Any]:
    from vllm import SamplingParams

    return [
        SamplingParams(
            temperature=0.0, max_tokens=cfg.thinker_max_tokens, repetition_penalty=1.1, seed=42
        ),
        SamplingParams(
            temperature=0.0, max_tokens=cfg.talker_max_tokens, repetition_penalty=1.05, seed=42
        ),
    ]


def _probe_schedulers(probe_dir: Path) -> dict[str, dict[str, Any]]:
    """The latest probe record of each stage's scheduler, by stage name."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(probe_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for sched in record.get("schedulers", []):
            out[str(sched.get("stage"))] = dict(sched)
    return out


def _match(req_id: str, times: dict[str, float]) -> float | None:
    """A stage's time for the driver's request id (the engine may suffix it)."""
    if req_id in times:
        return times[req_id]
    for key, t in times.items():
        if key.startswith(req_id) and key[len(req_id) : len(req_id) + 1] in ("-", "_", ""):
            return t
    return None


def _generate(
    omni: Any, cfg: E2EConfig, prompts: list[tuple[str, list[int]]], salt: str, probe_dir: Path
) -> dict[str, Any]:
    """One round: every prompt submitted in one ``Omni.generate`` call; per request its
    tokens, cached tokens and the stages' first-token times after the submission."""
    batch = [{"prompt_token_ids": ids, "cache_salt": salt} for _, ids in prompts]
    t0 = time.time()
    outs = omni.generate(batch, _sampling(cfg), use_tqdm=False)
    wall = time.time() - t0
    by_req: dict[str, dict[str, Any]] = {}
    for out in outs:
        stage = getattr(out, "stage_id", None)
        inner = getattr(out, "request_output", None) or out
        rec = by_req.setdefault(str(out.request_id), {})
        key = "thinker" if stage == 0 else "talker"
        rec[f"{key}_token_ids"] = list(inner.outputs[0].token_ids) if inner.outputs else []
        rec[f"{key}_num_cached_tokens"] = getattr(inner, "num_cached_tokens", None)
    deadline = time.monotonic() + 10.0
    requests: dict[str, dict[str, Any]] = {}
    while True:
        time.sleep(0.3)  # the probe rewrites its record every 0.2 s
        scheds = _probe_schedulers(probe_dir)
        first = {s: scheds.get(s, {}).get("first_token_at", {}) for s in ("thinker", "talker")}
        requests = {}
        for req_id, rec in by_req.items():
            index = int(req_id.split("_", 1)[0])
            name, ids = prompts[index]
            times = {s: _match(req_id, first[s]) for s in first}
            requests[name] = {
                **rec,
                "prompt_len": len(ids),
                "thinker_ttft_s": None if times["thinker"] is None else times["thinker"] - t0,
                "talker_ttft_s": None if times["talker"] is None else times["talker"] - t0,
            }
        complete = all(
            r["thinker_ttft_s"] is not None and r["talker_ttft_s"] is not None
            for r in requests.values()
        )
        if complete or time.monotonic() > deadline:
            break
    return {"wall_s": wall, "requests": requests, "submitted": len(prompts)}


def run_arm(cfg: E2EConfig, arm: str, model: Path, pass_index: int) -> dict[str, Any]:
    """Runs one arm in this process (call it in a fresh one: the caches are chosen when
    vllm-omni and the stage engines start)."""
    os.environ.update(arm_env(arm))
    root = scaffolding_root()
    plugin = str(root / "plugin")
    sys.path[:0] = [plugin, str(root)]
    work = Path(tempfile.mkdtemp(prefix=f"hscache-omni-bench-{arm}-"))
    probe_dir = work / "probe"
    os.environ["HSCACHE_E2E_PROBE_DIR"] = str(probe_dir)
    from run_pipeline import PIPELINE, register_pipeline, scheduler_cls  # tests/omni_e2e
    from vllm_omni import Omni

    # The hscache arm runs both stages on hscache's omni schedulers (the fast path), as
    # docs/omni.md says to switch it on; the stages schedule asynchronously (deploy_config).
    register_pipeline(scheduler_cls(arm, async_scheduling=True))
    deploy = work / "deploy.yaml"
    deploy.write_text(json.dumps(deploy_config(cfg, arm, PIPELINE), indent=1))  # JSON is YAML
    result: dict[str, Any] = {"arm": arm, "pass": pass_index, "rounds": []}
    t = time.perf_counter()
    omni = Omni(model=str(model), deploy_config=str(deploy), log_stats=False)
    result["start_s"] = time.perf_counter() - t
    try:
        # A short warm-up round (its own salt): first-call costs out of the measured rounds.
        warm = [(n, ids[: cfg.system_len]) for n, ids in round_prompts(cfg, "warmup", 0)[:2]]
        _generate(omni, cfg, warm, f"warmup-{pass_index}", probe_dir)
        for repeat in range(cfg.repeats):
            salt = f"pass{pass_index}-repeat{repeat}"
            order = TRAFFIC if repeat % 2 == 0 else ("unique", "shared-first", "shared-warm")
            for traffic in order:
                rnd = _generate(omni, cfg, round_prompts(cfg, traffic, repeat), salt, probe_dir)
                result["rounds"].append({"traffic": traffic, "repeat": repeat, **rnd})
        time.sleep(0.5)
        scheds = _probe_schedulers(probe_dir)
        caches = []
        for path in sorted(probe_dir.glob("*.json")):
            try:
                caches += json.loads(path.read_text()).get("prefix_caches", [])
            except (OSError, ValueError):
                continue
        thinker = scheds.get("thinker", {})
        result["served"] = {
            "fast_path": {
                stage: {"fast_step": rec.get("fast_step"), **(rec.get("fast_path_counts") or {})}
                for stage, rec in scheds.items()
            },
            "kv_cache_manager": thinker.get("kv_cache_manager"),
            "enable_caching": thinker.get("enable_caching"),
            "preemptions": thinker.get("preemptions"),
            "prefix_caches": caches,
        }
    finally:
        omni.close()
        shutil.rmtree(work, ignore_errors=True)
    return result


# --- the driver ---------------------------------------------------------------------


def scaffolding_root() -> Path:
    """``tests/omni_e2e`` of the checkout this hscache was imported from
    (``HSCACHE_OMNI_E2E_DIR`` overrides it)."""
    given = os.environ.get("HSCACHE_OMNI_E2E_DIR")
    root = Path(given) if given else Path(__file__).resolve().parents[3] / "tests" / "omni_e2e"
    if not (root / "make_model.py").is_file() or not (root / "plugin").is_dir():
        raise FileNotFoundError(
            f"{root}: not hscache's tests/omni_e2e (bench-omni-e2e runs from a checkout; "
            "HSCACHE_OMNI_E2E_DIR names the folder)"
        )
    return root


def _entry_points_dir(work: Path, root: Path) -> Path:
    """A folder holding the scaffolding's distribution metadata (its entry points: the
    CPU platform and the probe), to put first on the stage processes' path instead of
    installing ``tests/omni_e2e/plugin`` into the shared venv; importlib's metadata takes
    the first distribution of a name on the path."""
    info = work / "entry_points" / "hscache_omni_cpu-0.0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: hscache-omni-cpu\nVersion: 0.0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[vllm_omni.platform_plugins]\n"
        "hscache_omni_cpu = hscache_omni_cpu:platform_plugin\n\n"
        "[vllm.general_plugins]\n"
        "hscache_omni_probe = hscache_omni_cpu.probe:register\n"
    )
    (info / "top_level.txt").write_text("hscache_omni_cpu\n")
    return info.parent


def _make_model(cfg: E2EConfig, work: Path, root: Path) -> Path:
    name = f"model-h{cfg.thinker_hidden}-l{cfg.thinker_layers}-a{cfg.thinker_heads}"
    out = work / f"{name}-kv{cfg.thinker_kv_heads}"
    cmd = [sys.executable, str(root / "make_model.py"), str(out)]
    cmd += ["--thinker-hidden", str(cfg.thinker_hidden), "--thinker-layers"]
    cmd += [str(cfg.thinker_layers), "--thinker-heads", str(cfg.thinker_heads)]
    cmd += ["--thinker-kv-heads", str(cfg.thinker_kv_heads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"make_model.py failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return out


def run(cfg: E2EConfig, work: Path, log: Any = None) -> list[dict[str, Any]]:
    """Every arm of every pass, one process each; returns their results."""
    cfg.check()
    root = scaffolding_root()
    work.mkdir(parents=True, exist_ok=True)
    model = _make_model(cfg, work, root)
    entry = _entry_points_dir(work, root)
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(entry), str(root / "plugin"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    for var in ("HSCACHE", "HSCACHE_PARITY", "HSCACHE_DISABLE", "HSCACHE_OMNI_PREFIX_CACHE"):
        env.pop(var, None)
    results = []
    for p in range(cfg.passes):
        order = cfg.arms if p % 2 == 0 else tuple(reversed(cfg.arms))
        for arm in order:
            out = work / f"{arm}-pass{p}.json"
            arm_log = work / f"{arm}-pass{p}.log"
            cmd = [sys.executable, "-m", "hscache_tools.bench.omni_e2e", "--worker", arm]
            cmd += ["--pass-index", str(p), "--model", str(model), "--out", str(out)]
            cmd += ["--config", json.dumps(dataclasses.asdict(cfg))]
            t = time.perf_counter()
            with arm_log.open("w") as fh:
                # Its own session: on a timeout the stage engines it spawned go with it.
                proc = subprocess.Popen(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
                try:
                    rc = proc.wait(timeout=cfg.timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    rc = -1
            if rc != 0 or not out.exists():
                tail = arm_log.read_text(errors="replace").splitlines()[-40:]
                raise RuntimeError(f"arm {arm} (pass {p}) failed, rc {rc}:\n" + "\n".join(tail))
            res = json.loads(out.read_text())
            results.append(res)
            if log is not None:
                print(
                    f"[bench-omni-e2e] pass {p} {arm}: {time.perf_counter() - t:.0f} s "
                    f"(stage start {res['start_s']:.0f} s)",
                    file=log,
                    flush=True,
                )
    return results


# --- the report ---------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    """The q-quantile, nearest rank (p99 of a few dozen requests is their maximum or
    next to it)."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 1)) - 1))
    return s[k]


def _requests(results: list[dict[str, Any]], arm: str, traffic: str) -> list[dict[str, Any]]:
    return [
        r
        for res in results
        if res["arm"] == arm
        for rnd in res["rounds"]
        if rnd["traffic"] == traffic
        for r in rnd["requests"].values()
    ]


def _keyed(results: list[dict[str, Any]], arm: str) -> dict[tuple[int, int, str, str], Any]:
    return {
        (res["pass"], rnd["repeat"], rnd["traffic"], name): (
            r.get("thinker_token_ids"),
            r.get("talker_token_ids"),
        )
        for res in results
        if res["arm"] == arm
        for rnd in res["rounds"]
        for name, r in rnd["requests"].items()
    }


def summarize(results: list[dict[str, Any]], cfg: E2EConfig) -> dict[str, Any]:
    """Per arm and traffic: p50 / p99 of both times to first token, requests per second
    (median round), cached tokens, agreement with ``off``; and the goals."""
    ref = _keyed(results, "off")
    table: dict[str, dict[str, Any]] = {}
    for arm in cfg.arms:
        keyed = _keyed(results, arm)
        for traffic in TRAFFIC:
            reqs = _requests(results, arm, traffic)
            rounds = [
                rnd
                for res in results
                if res["arm"] == arm
                for rnd in res["rounds"]
                if rnd["traffic"] == traffic
            ]
            thinker = [r["thinker_ttft_s"] for r in reqs if r.get("thinker_ttft_s") is not None]
            talker = [r["talker_ttft_s"] for r in reqs if r.get("talker_ttft_s") is not None]
            same = sum(keyed[k] == ref.get(k) for k in keyed if k[2] == traffic)
            table[f"{arm}|{traffic}"] = {
                "requests": len(reqs),
                "timed": min(len(thinker), len(talker)),
                "thinker_p50": _pct(thinker, 0.5) if thinker else float("nan"),
                "thinker_p99": _pct(thinker, 0.99) if thinker else float("nan"),
                "talker_p50": _pct(talker, 0.5) if talker else float("nan"),
                "talker_p99": _pct(talker, 0.99) if talker else float("nan"),
                "rps": statistics.median(r["submitted"] / r["wall_s"] for r in rounds)
                if rounds
                else float("nan"),
                "prompt_tokens": sum(int(r["prompt_len"]) for r in reqs),
                "cached_tokens": sum(int(r.get("thinker_num_cached_tokens") or 0) for r in reqs),
                "same_as_off": f"{same}/{sum(1 for k in keyed if k[2] == traffic)}",
            }
    goals: dict[str, Any] = {}

    def cell(arm: str, traffic: str, key: str) -> float:
        row = table.get(f"{arm}|{traffic}")
        return float(row[key]) if row else float("nan")

    if "hscache" in cfg.arms:
        for traffic in ("shared-warm", "shared-first"):
            goals[f"{traffic}: off / hscache talker TTFT p50 (goal >= 4x)"] = cell(
                "off", traffic, "talker_p50"
            ) / cell("hscache", traffic, "talker_p50")
            if "vllm-omni" in cfg.arms:
                goals[f"{traffic}: hscache below vllm-omni, talker TTFT p50 (goal >= 10 %)"] = (
                    1
                    - cell("hscache", traffic, "talker_p50")
                    / cell("vllm-omni", traffic, "talker_p50")
                ) * 100
        goals["unique: hscache / off requests per second (goal >= 0.98)"] = cell(
            "hscache", "unique", "rps"
        ) / cell("off", "unique", "rps")
        if "vllm-omni" in cfg.arms:
            goals["unique: vllm-omni / off requests per second"] = cell(
                "vllm-omni", "unique", "rps"
            ) / cell("off", "unique", "rps")
    served = {
        res["arm"]: {
            "kv_cache_manager": res["served"]["kv_cache_manager"],
            "enable_caching": res["served"]["enable_caching"],
            "prefix_caches": sorted({c["class"] for c in res["served"]["prefix_caches"]}),
        }
        for res in results
    }
    starts = {arm: [res["start_s"] for res in results if res["arm"] == arm] for arm in cfg.arms}
    return {"table": table, "goals": goals, "served": served, "starts": starts}


def format_report(summary: dict[str, Any], cfg: E2EConfig) -> str:
    lines = [
        f"vllm-omni 0.30 thinker -> talker on CPU: thinker hidden {cfg.thinker_hidden}, "
        f"{cfg.thinker_layers} layers, fp32; {cfg.concurrency} requests submitted at once "
        f"per round; {cfg.passes} pass(es) x {cfg.repeats} repeat(s), arm order reversed "
        "every other pass; times in seconds from submission, p50 / p99 over every request",
        "",
        "| traffic | arm | requests | thinker TTFT p50 | p99 | talker TTFT p50 | p99 "
        "| requests/s | thinker cached / prompt tokens | tokens = off |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for traffic in TRAFFIC:
        for arm in cfg.arms:
            row = summary["table"][f"{arm}|{traffic}"]
            lines.append(
                f"| {traffic} | {arm} | {row['requests']} | {row['thinker_p50']:.2f} | "
                f"{row['thinker_p99']:.2f} | {row['talker_p50']:.2f} | {row['talker_p99']:.2f} "
                f"| {row['rps']:.3f} | {row['cached_tokens']} / {row['prompt_tokens']} "
                f"| {row['same_as_off']} |"
            )
    lines.append("")
    for name, value in summary["goals"].items():
        unit = " %" if "%" in name else "x"
        lines.append(f"- {name}: {value:.2f}{unit}")
    lines.append("")
    for arm, served in summary["served"].items():
        lines.append(
            f"- {arm}: thinker KV-cache manager {served['kv_cache_manager']} "
            f"(caching {'on' if served['enable_caching'] else 'off'}), hidden-state cache "
            f"{', '.join(served['prefix_caches']) or 'none'}; stage start "
            + ", ".join(f"{s:.0f} s" for s in summary["starts"][arm])
        )
    return "\n".join(lines)


def check_served(results: list[dict[str, Any]]) -> list[str]:
    """Every arm's thinker ran the KV-cache manager and hidden-state cache it names, and
    the ``hscache`` arm's two stages ran hscache's omni schedulers with the fast path
    serving ``schedule()`` steps (a silent decline fails the run)."""
    problems = []
    for res in results:
        manager, cache = EXPECTED[res["arm"]]
        served = res["served"]
        if res["arm"] == "hscache":
            fast = served.get("fast_path", {})
            for stage in ("thinker", "talker"):
                rec = fast.get(stage, {})
                if rec.get("fast_step") is not True or not rec.get("schedule_served"):
                    problems.append(f"hscache: the {stage}'s fast path served nothing: {rec}")
        classes = {c["class"] for c in served["prefix_caches"]}
        if manager is None:
            if served["enable_caching"] or classes:
                problems.append(f"{res['arm']}: caching on or a cache built: {served}")
            continue
        if served["kv_cache_manager"] != manager or not served["enable_caching"]:
            problems.append(f"{res['arm']}: thinker manager {served['kv_cache_manager']}")
        if classes != {cache}:
            problems.append(f"{res['arm']}: hidden-state caches {sorted(classes)}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hscache bench-omni-e2e", description=__doc__.splitlines()[0]
    )
    defaults = E2EConfig()
    parser.add_argument("--quick", action="store_true", help="a tiny model and workload")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--passes", type=int, default=None)
    parser.add_argument("--arms", default=None, help=f"comma-separated, of {','.join(ARMS)}")
    for name in ("thinker_hidden", "thinker_layers", "system_len", "media_len", "tail_max"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--work", type=Path, default=None, help="work folder (models, logs)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--pass-index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        raw = json.loads(args.config)
        cfg = E2EConfig(**{**raw, "arms": tuple(raw["arms"])})
        res = run_arm(cfg, args.worker, args.model, args.pass_index)
        args.out.write_text(json.dumps(res))
        return 0
    import importlib.util

    if importlib.util.find_spec("vllm_omni") is None:  # the arms import it, not the driver
        print("bench-omni-e2e needs vllm-omni 0.30 on vLLM 0.30 (scripts/vllm030_env.sh)")
        return 2
    base = QUICK if args.quick else defaults
    given = {
        k: getattr(args, k)
        for k in (
            "concurrency",
            "repeats",
            "passes",
            "thinker_hidden",
            "thinker_layers",
            "system_len",
            "media_len",
            "tail_max",
        )
        if getattr(args, k) is not None
    }
    if args.arms:
        given["arms"] = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    cfg = dataclasses.replace(base, seed=args.seed, **given)
    try:
        cfg.check()
    except ValueError as exc:
        parser.error(str(exc))
    cache = Path(os.environ.get("HSCACHE_CACHE", Path.home() / ".cache" / "hscache"))
    work = args.work or cache / "omni_bench"
    results = run(cfg, work, log=sys.stderr)
    summary = summarize(results, cfg)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"config": dataclasses.asdict(cfg), "results": results, "summary": summary},
                indent=1,
            )
        )
    print(format_report(summary, cfg))
    problems = check_served(results)
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
