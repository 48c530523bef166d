"""``hscache.vllm.Scheduler``'s fast path in a process where vllm-omni 0.30 is imported.

vllm-omni's import (``vllm_omni/patch.py``) rebinds, in every loaded module whose name
contains ``vllm``, ``Request`` to its ``OmniRequest`` and ``EngineCoreOutput`` to its
``OmniEngineCoreOutput`` (five more fields). ``OmniRequest`` adds fields and its own
``__init__`` / ``from_engine_core_request``, none of the methods the fast path mirrors:
covered. ``OmniEngineCoreOutput`` is not the struct the fast path was tested building
with vLLM's own schedulers: with it their fast path is off, one log line naming
``OmniEngineCoreOutput``, while vLLM's fingerprint (taken of vLLM's own struct, the base
class) still holds and hscache's omni schedulers keep theirs (``hscache.omni.mirror``).
Run in a fresh interpreter (the patch is process-wide). Skipped without vllm-omni 0.30.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm_omni.core.prefix_cache.runner_mixin",
    reason="needs vllm-omni 0.30 (the environment of scripts/vllm030_env.sh)",
)

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, logging
records = []


class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)


logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.INFO)
import vllm.v1.engine as engine
import vllm.v1.core.sched.scheduler as scheduler_module

vllm_output = engine.EngineCoreOutput
import vllm_omni  # noqa: F401 (its patch)
from vllm_omni.engine import OmniEngineCoreOutput
from vllm_omni.request import OmniRequest
from hscache_tools.testing.offline_scheduler import make_scheduler
from hscache.vllm import Scheduler, mirror

patched = scheduler_module.EngineCoreOutput is OmniEngineCoreOutput
off = make_scheduler(Scheduler, 256, block_size=16).fast_step
import hscache.omni
omni_on = make_scheduler(hscache.omni.OmniARScheduler, 256, block_size=16).fast_step
omni_async_on = make_scheduler(
    hscache.omni.OmniARAsyncScheduler, 256, block_size=16, async_scheduling=True
).fast_step
code_proven = mirror.code_proven()
lines = sorted({
    r.getMessage() for r in records
    if r.name.startswith("hscache") and "fast path is off" in r.getMessage()
})
# vLLM's own struct back where the scheduler builds it: OmniRequest alone stays.
scheduler_module.EngineCoreOutput = vllm_output
from hscache._core import StepUpdate
from hscache.vllm.step import update as step_update
from vllm.v1.request import RequestStatus

step_update.OUTPUT_CLASS = vllm_output
step_update._STEP_UPDATE = StepUpdate(
    running=RequestStatus.RUNNING,
    output_class=vllm_output,
    cache_blocks_at=step_update.CACHE_BLOCKS_AT,
)
mirror._reset()
on = make_scheduler(Scheduler, 256, block_size=16)
print(json.dumps({
    "patched": patched,
    "fast_step_with_omni_output": off,
    "omni_schedulers": [omni_on, omni_async_on],
    "code_proven": code_proven,
    "lines": lines,
    "request_is_omni": scheduler_module.Request is OmniRequest,
    "omni_request_covered": mirror.request_covered(OmniRequest),
    "fast_step_with_omni_request": on.fast_step,
}))
"""


def test_vllm_omnis_patch_turns_plain_schedulers_fast_path_off_not_omnis() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSCACHE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["patched"]
    assert not seen["fast_step_with_omni_output"]
    assert len(seen["lines"]) == 1, seen["lines"]
    assert "builds vllm_omni.engine.OmniEngineCoreOutput" in seen["lines"][0]
    assert "differ" not in seen["lines"][0]
    assert seen["code_proven"]
    assert seen["omni_schedulers"] == [True, True]
    assert seen["request_is_omni"]
    assert seen["omni_request_covered"]
    assert seen["fast_step_with_omni_request"]
