"""hscache's omni plugin (``hscache.omni.switch:register``, the ``hscache_omni`` entry point
vLLM runs in every process) can never stop vLLM, and touches vllm-omni only when asked.

Each case runs vLLM's own ``load_general_plugins()`` (``VLLM_PLUGINS=hscache_omni``) in a
fresh interpreter with a vllm-omni stand-in first on ``sys.path``: a package with the
four attributes the switch replaces and a ``vllm_omni-<version>.dist-info``, as a wheel
installs it. A renamed attribute or an untested release is one warning and vllm-omni left
as it was (none of the four replaced); without ``HSCACHE_OMNI_PREFIX_CACHE`` nothing of
vllm-omni is even imported; asked, on the tested release, the switch is in. Needs no real
vllm-omni (the stand-in shadows it where one is installed), so it runs in every
environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hscache.omni.switch import TESTED_VLLM_OMNI

ROOT = Path(__file__).resolve().parents[2]

RUNNER_MIXIN = """
def OmniPrefixCacheManager(config, view, **kwargs):
    return "vllm-omni's cache"


def get_prefix_cache_group_view(input_batch, block_size, kv_cache_groups=None):
    return "vllm-omni's view"
"""

GROUP_VIEW = """
def check_prefix_cache_kv_groups(kv_cache_groups):
    return None


def check_prefix_cache_token_accounting(cache_config, speculative_config):
    return None
"""

PROBE = """
import importlib, json, logging, os, sys
import vllm.plugins

records = []


class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)


logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.INFO)
results = {}
for case, site, asked, extra in json.loads(sys.argv[1]):
    # A fresh start for each case: vLLM's plugins not yet loaded, no vllm_omni imported.
    for name in [m for m in sys.modules if m == "vllm_omni" or m.startswith("vllm_omni.")]:
        del sys.modules[name]
    sys.path.insert(0, site)
    importlib.invalidate_caches()
    for name in [k for k in os.environ if k.startswith("HSCACHE_")]:
        del os.environ[name]
    os.environ.update(extra)
    if asked:
        os.environ["HSCACHE_OMNI_PREFIX_CACHE"] = "1"
    records.clear()
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    imported = "vllm_omni" in sys.modules
    from vllm_omni.core.prefix_cache import group_view, runner_mixin

    names = (
        (runner_mixin, "OmniPrefixCacheManager"),
        (runner_mixin, "OmniPrefixCacheManagerV2"),
        (runner_mixin, "get_prefix_cache_group_view"),
        (group_view, "check_prefix_cache_kv_groups"),
        (group_view, "check_prefix_cache_token_accounting"),
    )
    results[case] = {
        "imported_by_plugins": imported,
        "hooked": sorted(
            name for module, name in names
            if hasattr(getattr(module, name, None), "hscache_original")
        ),
        "warnings": [
            r.getMessage() for r in records
            if r.levelno >= logging.WARNING and r.name.startswith("hscache")
        ],
        "errors": [r.getMessage() for r in records if r.levelno >= logging.ERROR],
    }
    sys.path.remove(site)
print(json.dumps(results))
"""

TESTED = TESTED_VLLM_OMNI[0]
#: case -> (stand-in version, renamed attribute, HSCACHE_OMNI_PREFIX_CACHE set, more env)
CASES: dict[str, tuple[str, bool, bool, dict[str, str]]] = {
    "renamed": (TESTED, True, True, {}),
    "untested": ("0.31.0", False, True, {}),
    "not_asked": (TESTED, False, False, {}),
    "not_asked_untested": ("0.31.0", False, False, {}),
    # The cache's other settings are not read (nor refused) unless it is asked for.
    "not_asked_bad_storage": (TESTED, False, False, {"HSCACHE_OMNI_STORAGE": "nowhere"}),
    "asked": (TESTED, False, True, {}),
}


def _stand_in(tmp_path: Path, version: str, renamed: bool = False) -> Path:
    """A vllm-omni ``version`` package under ``tmp_path`` (its runner mixin's
    ``OmniPrefixCacheManager`` renamed ``OmniPrefixCacheManagerV2`` if ``renamed``)."""
    pkg = tmp_path / "vllm_omni"
    (pkg / "core" / "prefix_cache").mkdir(parents=True)
    for init in (pkg, pkg / "core", pkg / "core" / "prefix_cache"):
        (init / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    mixin = RUNNER_MIXIN.replace("OmniPrefixCacheManager(", "OmniPrefixCacheManagerV2(")
    (pkg / "core" / "prefix_cache" / "runner_mixin.py").write_text(
        mixin if renamed else RUNNER_MIXIN
    )
    (pkg / "core" / "prefix_cache" / "group_view.py").write_text(GROUP_VIEW)
    dist = tmp_path / f"vllm_omni-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-omni\nVersion: {version}\n")
    return tmp_path


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case's outcome, from one interpreter (importing vLLM is most of the cost):
    vLLM's ``load_general_plugins()`` run afresh per case, with that case's stand-in."""
    cases = [
        (case, str(_stand_in(tmp_path_factory.mktemp(case), version, renamed)), asked, extra)
        for case, (version, renamed, asked, extra) in CASES.items()
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSCACHE_")}
    env["VLLM_PLUGINS"] = "hscache_omni"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE), json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_renamed_attribute_is_one_warning_and_vllm_omni_unchanged(
    seen: dict[str, Any],
) -> None:
    seen = seen["renamed"]
    assert seen["errors"] == []  # vLLM's plugin loader logged no failure
    assert seen["hooked"] == []  # all or none: the two attributes still there untouched
    assert len(seen["warnings"]) == 1, seen["warnings"]
    assert "runner_mixin has no OmniPrefixCacheManager" in seen["warnings"][0]


def test_an_untested_release_is_one_warning_and_vllm_omni_unchanged(
    seen: dict[str, Any],
) -> None:
    seen = seen["untested"]
    assert seen["errors"] == []
    assert seen["hooked"] == []
    assert not seen["imported_by_plugins"]
    assert len(seen["warnings"]) == 1, seen["warnings"]
    assert "vllm-omni 0.31.0 is not a release" in seen["warnings"][0]


@pytest.mark.parametrize("case", ["not_asked", "not_asked_untested", "not_asked_bad_storage"])
def test_not_asked_leaves_vllm_omni_untouched(seen: dict[str, Any], case: str) -> None:
    """Without ``HSCACHE_OMNI_PREFIX_CACHE`` the plugin imports nothing of vllm-omni (whose
    own import patches vLLM) and says nothing."""
    assert seen[case] == {"imported_by_plugins": False, "hooked": [], "warnings": [], "errors": []}


def test_asked_on_the_tested_release_the_switch_is_in(seen: dict[str, Any]) -> None:
    seen = seen["asked"]
    assert seen["hooked"] == [
        "OmniPrefixCacheManager",
        "check_prefix_cache_kv_groups",
        "check_prefix_cache_token_accounting",
        "get_prefix_cache_group_view",
    ]
    assert seen["warnings"] == [] and seen["errors"] == []


def test_tested_releases_are_the_pinned_ones() -> None:
    """:data:`TESTED_VLLM_OMNI` is what the vllm-omni environment installs."""
    pins = (ROOT / "requirements" / "vllm030-nodeps.txt").read_text()
    pinned = {
        line.split("==", 1)[1].split()[0]
        for line in pins.splitlines()
        if line.startswith("vllm-omni==")
    }
    assert pinned == set(TESTED_VLLM_OMNI)
