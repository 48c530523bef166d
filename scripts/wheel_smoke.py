"""Smoke test of an installed hscache wheel (run by scripts/wheel_smoke.sh).

Checks that ``hscache`` is imported from the wheel's install location (not the source
tree), that the compiled core is a release build, that the vLLM plugin entry point is
registered, and that vLLM's real ``Scheduler`` runs a few steps on hscache's manager.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    expected_root = Path(sys.argv[1]).resolve()
    import hscache
    import hscache._core

    core_path = Path(hscache._core.__file__).resolve()
    if expected_root not in core_path.parents:
        print(f"FAIL: hscache._core imported from {core_path}, not from {expected_root}")
        return 1
    if hscache.build_profile != "release":
        print(f"FAIL: the wheel holds a {hscache.build_profile} build")
        return 1
    plugins = {ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if "hscache" not in plugins:
        print("FAIL: the vllm.general_plugins entry point is missing")
        return 1

    import hscache.vllm
    from hscache.bench.scheduler_level import request_stream
    from hscache.testing.offline_scheduler import make_scheduler, stub_runner_output

    sched = make_scheduler(hscache.vllm.Scheduler, 512, max_model_len=4096)
    assert isinstance(sched.kv_cache_manager, hscache.vllm.KVCacheManager)
    for step, new in enumerate(request_stream(0, 20, 16, 256, 1.0)):
        for req in new:
            sched.add_request(req)
        out = sched.schedule()
        sched.update_from_output(out, stub_runner_output(out, lambda _i, step=step: step))
    print(f"wheel smoke: ok (hscache {hscache.__version__} from {core_path.parent})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
