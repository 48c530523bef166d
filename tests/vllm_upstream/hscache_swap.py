"""pytest plugin: run vLLM's own unit tests offline, optionally with hscache swapped in.

Loaded with ``-p hscache_swap`` (this directory on ``PYTHONPATH``) by ``run.sh``, from the
cached tests tree of the vLLM sdist (``fetch_sdist.sh``; 0.33.0, or 0.32.0 against vLLM
0.32) with ``--confcutdir tests/v1``: the conftest files under ``tests/v1/`` (the KV
connector tests' fixtures) load, vLLM's root conftest (which needs many extras) does not.
It is not a test module and is never collected by hscache's own ``pytest tests/`` run.

What it does:

* **Offline models.** vLLM's scheduler tests build ``ModelConfig(model="facebook/opt-125m")``
  (and ``ModelConfig()`` with the default model, and a few others), which needs the Hugging
  Face Hub. The plugin writes local stand-ins (``hscache_offline_models.py``: ``config.json``, and
  for LLaVA a synthetic tokenizer/processor) into a temp directory, points vLLM's own
  ``VLLM_MODEL_REDIRECT_PATH`` mechanism at them, and wraps ``ModelConfig.__init__`` so that
  the text-only ones get ``skip_tokenizer_init=True`` (no tokenizer offline). Any other
  model id is left alone and fails offline as it would anyway (see ``known_failures.txt``).
* ``caplog_vllm``, ``default_vllm_config``: fixtures of vLLM's root conftest (not loaded),
  re-implemented.
* **The swap** (``HSCACHE_SWAP=1``): replaces vLLM's ``KVCacheManager`` with
  ``hscache.vllm.KVCacheManager`` (or ``HSCACHE_SWAP_CLASS=module:Class``) in
  ``vllm.v1.core.kv_cache_manager`` and in every module that has already bound the name with
  ``from ... import KVCacheManager`` (the Scheduler, test modules): the source module is
  patched at configure time, before any test module is imported, and ``sys.modules`` is swept
  again after collection. If ``hscache.vllm`` provides ``get_request_block_hasher``, vLLM's
  block hasher is swapped the same way (``HSCACHE_SWAP_HASHER=0`` keeps vLLM's; or
  ``HSCACHE_SWAP_HASHER=module:func`` picks another).
* **Results.** With ``HSCACHE_RESULTS=path`` the outcome of every test (``passed``, ``failed``,
  ``error``, ``skipped``, ``xfailed``), each failure's message, the swaps made, how often the
  swapped-in class was constructed, the census and the ``HSCACHE*`` environment are written
  there as JSON, for ``compare.py``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import hscache_offline_models
import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_state: dict[str, Any] = {"local_dirs": {}, "tmp": None, "swaps": [], "results": {}, "messages": {}}


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"expected 'module:attribute', got {spec!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- offline models


def _write_local_models() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="hscache-vllm-models-"))
    _state["tmp"] = tmp
    redirect = hscache_offline_models.write(tmp)
    (tmp / "redirect.json").write_text(json.dumps(redirect))
    _state["local_dirs"] = redirect
    # Read by vllm.transformers_utils.utils.maybe_model_redirect at every ModelConfig.
    os.environ["VLLM_MODEL_REDIRECT_PATH"] = str(tmp / "redirect.json")


def _patch_model_config() -> None:
    from vllm.config import ModelConfig

    default_model = ModelConfig.__dataclass_fields__["model"].default
    no_tokenizer = {
        key
        for model_id, d in _state["local_dirs"].items()
        if model_id not in hscache_offline_models.WITH_TOKENIZER
        for key in (model_id, d)
    }
    original_init = ModelConfig.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        model = args[0] if args else kwargs.get("model", default_model)
        if model in no_tokenizer:
            # A config-only local directory: there is no tokenizer to load.
            kwargs["skip_tokenizer_init"] = True
        original_init(self, *args, **kwargs)

    __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
    ModelConfig.__init__ = __init__  # type: ignore[method-assign]


# --------------------------------------------------------------------------------- the swap


def _sweep(original: Any, replacement: Any, name: str) -> int:
    """Rebind ``name`` wherever a module bound ``original`` (``from x import name``)."""
    n = 0
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name.split(".")[0] == "hscache":
            continue  # hscache keeps its own reference to vLLM's class (fallback, parity)
        try:
            if module.__dict__.get(name) is original:
                setattr(module, name, replacement)
                n += 1
        except Exception:  # exotic module objects
            continue
    return n


def _install_swaps() -> None:
    if os.environ.get("HSCACHE_SWAP", "0") in ("", "0"):
        return
    import vllm.v1.core.kv_cache_manager as kv_cache_manager
    import vllm.v1.core.kv_cache_utils as kv_cache_utils
    import vllm.v1.core.sched.scheduler  # noqa: F401  (binds KVCacheManager at import)

    spec = os.environ.get("HSCACHE_SWAP_CLASS") or "hscache.vllm:KVCacheManager"
    try:
        replacement = _load(spec)
    except Exception as exc:
        raise RuntimeError(
            f"HSCACHE_SWAP=1 but {spec} cannot be imported ({type(exc).__name__}: {exc}). "
            "Build and install hscache first (source scripts/env.sh), or point "
            "HSCACHE_SWAP_CLASS=module:Class at another class."
        ) from exc
    swaps = [("KVCacheManager", kv_cache_manager.KVCacheManager, replacement, spec)]

    hasher_spec = os.environ.get("HSCACHE_SWAP_HASHER", "1")
    if hasher_spec not in ("", "0"):
        if ":" not in hasher_spec:
            hasher_spec = "hscache.vllm:get_request_block_hasher"
        try:
            hasher = _load(hasher_spec)
        except (ImportError, AttributeError):
            if os.environ.get("HSCACHE_SWAP_HASHER", "1") != "1":
                raise  # asked for by name: must exist
            hasher = None  # the default: only if hscache.vllm provides one
        if hasher is not None:
            original = kv_cache_utils.get_request_block_hasher
            swaps.append(("get_request_block_hasher", original, hasher, hasher_spec))

    # The multimodal encoder-cache manager, when hscache.vllm provides one
    # (HSCACHE_SWAP_ENCODER_CACHE=0 keeps vLLM's).
    if os.environ.get("HSCACHE_SWAP_ENCODER_CACHE", "1") not in ("", "0"):
        import vllm.v1.core.encoder_cache_manager as encoder_cache_manager

        ec_spec = "hscache.vllm:EncoderCacheManager"
        try:
            ec = _load(ec_spec)
        except (ImportError, AttributeError):
            ec = None
        if ec is not None:
            swaps.append(
                ("EncoderCacheManager", encoder_cache_manager.EncoderCacheManager, ec, ec_spec)
            )

    for name, original, new, new_spec in swaps:
        if original is new:
            raise RuntimeError(f"{new_spec} is vLLM's own {name}: nothing would be swapped")
        n = _sweep(original, new, name)
        _state["swaps"].append([name, original, new, new_spec, n])
    _count_constructions(replacement)


def _count_constructions(cls: Any) -> None:
    """Count constructions of the swapped-in class: proof that the tests really used it.

    Also keeps the *census*: every construction's outcome (served by the swapped-in class,
    or the fallback it returned and why) and its layout (the vLLM manager classes of its
    KV-cache groups)."""
    _state["constructed"] = 0
    try:
        original_init = cls.__init__
        original_new = cls.__new__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            _state["constructed"] += 1
            original_init(self, *args, **kwargs)

        def __new__(klass: Any, *args: Any, **kwargs: Any) -> Any:
            obj = original_new(klass, *args, **kwargs)
            _record_construction(klass, obj, args, kwargs)
            return obj

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        cls.__init__ = __init__
        cls.__new__ = __new__
    except (TypeError, AttributeError):  # immutable (e.g. native) type: no count
        _state["constructed"] = None


def _record_construction(cls: Any, obj: Any, args: tuple, kwargs: dict) -> None:
    """One census entry: `served` / `served (parity)` / `fallback: <reason>`, by layout."""
    config = kwargs.get("kv_cache_config", args[0] if args else None)
    try:
        from hscache.vllm.specs import manager_class, unsupported_reason

        groups = getattr(config, "kv_cache_groups", [])
        layout = "+".join(getattr(manager_class(g), "__name__", "?") for g in groups) or "none"
    except ImportError:  # a HSCACHE_SWAP_CLASS without hscache: no census
        return
    if isinstance(obj, cls):
        outcome = "served"
    elif type(obj).__name__ == "ParityKVCacheManager":
        outcome = "served (parity)"
    else:
        outcome = f"fallback: {unsupported_reason(config) or 'unknown'}"
    census: dict[str, int] = _state.setdefault("census", {})
    key = f"{outcome} | {layout}"
    census[key] = census.get(key, 0) + 1


# ------------------------------------------------------------------------------ pytest hooks


@pytest.fixture()
def caplog_vllm(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What vLLM's root conftest (not loaded) provides: caplog of vLLM's logs."""
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.INFO):
        yield caplog


@pytest.fixture()
def default_vllm_config() -> Any:
    """What vLLM's root conftest (not loaded) provides: a default ``VllmConfig`` made
    current, for tests that reach ``get_current_vllm_config()`` outside an engine."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


def pytest_configure(config: Any) -> None:
    _write_local_models()
    _patch_model_config()
    _install_swaps()


def pytest_unconfigure(config: Any) -> None:
    if _state["tmp"] is not None:
        shutil.rmtree(_state["tmp"], ignore_errors=True)
    path = os.environ.get("HSCACHE_RESULTS")
    if path:
        doc = {
            "swap": [[name, spec] for name, _, _, spec, _ in _state["swaps"]],
            "constructed": _state.get("constructed"),
            "census": _state.get("census", {}),
            # hscache's switches as the tests saw them (compare.py refuses a swap run with
            # HSCACHE_DISABLE on: vLLM's manager would serve every test).
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("HSCACHE")},
            "results": _state["results"],
            "messages": _state["messages"],
        }
        Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True))


def pytest_report_header(config: Any) -> list[str]:
    if not _state["swaps"]:
        return ["hscache: swap OFF (vLLM's own KVCacheManager)"]
    return [
        f"hscache: swap ON: {name} -> {spec} ({n} module bindings patched)"
        for name, _, _, spec, n in _state["swaps"]
    ]


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    # Test modules are imported now; rebind anything that still holds vLLM's objects.
    for entry in _state["swaps"]:
        name, original, new, _, _ = entry
        entry[4] += _sweep(original, new, name)


def pytest_runtest_logreport(report: Any) -> None:
    results: dict[str, str] = _state["results"]
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "failed"  # strict xpass fails
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
        else:
            outcome = report.outcome  # passed / skipped
        results[report.nodeid] = outcome
        if outcome in ("failed", "error"):
            _state["messages"][report.nodeid] = _crash_message(report)
    elif report.when == "teardown" and report.failed:
        results[report.nodeid] = "error"
        _state["messages"][report.nodeid] = _crash_message(report)


def _crash_message(report: Any) -> str:
    full = str(report.longrepr)
    missing = re.search(r"fixture '[^']+' not found", full)
    crash = getattr(report.longrepr, "reprcrash", None)
    text = missing.group(0) if missing else crash.message if crash is not None else full
    return " ".join(text.split())[:300]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    counts = Counter(_state["results"].values())
    line = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests"
    if not _state["swaps"]:
        terminalreporter.write_line(f"hscache swap OFF (vLLM's own classes): {line}")
        return
    swapped = ", ".join(f"{name} -> {spec}" for name, _, _, spec, _ in _state["swaps"])
    constructed = _state.get("constructed")
    if constructed is not None:
        line += f"; the swapped-in class was constructed {constructed} times"
    terminalreporter.write_line(f"hscache swap ON ({swapped}): {line}")
    census: dict[str, int] = _state.get("census", {})
    if census:
        served = sum(n for key, n in census.items() if key.startswith("served"))
        total = sum(census.values())
        terminalreporter.write_line(
            f"census: {served} of {total} KV-cache managers served by hscache "
            f"({100.0 * served / total:.1f} %); fallbacks: "
            + (
                ", ".join(f"{k} x{n}" for k, n in census.items() if k.startswith("fallback"))
                or "none"
            )
        )
