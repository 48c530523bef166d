"""What the fast path mirrors of vLLM, and the check that it is the code that was tested.

``hscache.vllm.step`` (with ``src/python/step_schedule.rs``, ``step_update.rs`` and
``src/step/``) does, for steady decode steps, what these pieces of vLLM do, without
calling them:

- ``Scheduler.schedule``, ``_update_after_schedule``, ``_make_cached_request_data``,
  ``update_from_output`` and ``_update_request_with_output``; ``AsyncScheduler``'s
  ``_update_after_schedule`` and (0.32, 0.30) ``_update_request_with_output``;
- ``check_stop`` (the name vLLM's scheduler module calls);
- ``Request.__init__`` (the fields read from the instance ``__dict__``,
  :data:`REQUEST_FIELDS`), ``append_output_token_ids``, ``update_block_hashes`` (the
  request's block hasher hook), ``take_events``, ``num_tokens``, ``num_output_tokens``;
- the fields of ``EngineCoreOutput`` (built from ``request_id``, ``new_token_ids`` and four
  more, the rest left at their defaults), ``SchedulerOutput`` and ``CachedRequestData``
  (built with keywords: a new field would be left at its default).

Their fingerprint (:func:`fingerprint`: a hash of each one's source, ``"absent"`` where a
release lacks it; the field names and plain defaults of the structs) is stored per vLLM
version whose differential ran (``tests/scheduler/test_scheduler_fast_path.py``) in
:mod:`hscache.vllm._mirror_table`, regenerated in each version's environment by
``python -m hscache.vllm.mirror --write``. The fast path serves only where

- the installed vLLM's version (a local suffix such as ``+cpu`` aside) is one of the table's
  and its fingerprint is that entry (:func:`proven`, once per process);
- the scheduler class in use defines none of the mirrored ``Scheduler`` methods itself (a
  subclass or plugin that does is not what was tested) and vLLM's still are the functions
  fingerprinted (:func:`scheduler_covered`, per class);
- each request's class resolves every mirrored ``Request`` method to vLLM's own
  (:func:`request_covered`, per class: a subclass that only adds fields or its own
  ``__init__``, as vllm-omni's ``OmniRequest``, is covered; one that wraps
  ``append_output_token_ids`` is not).

Otherwise it stays off, and the reason is logged once (per process, or per class).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import linecache
import logging
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hscache.vllm import _mirror_table

logger = logging.getLogger(__name__)

__all__ = [
    "MIRRORED",
    "REQUEST_FIELDS",
    "fingerprint",
    "proven",
    "request_covered",
    "scheduler_covered",
]

_REQUEST = "vllm.v1.request"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_ASYNC = "vllm.v1.core.sched.async_scheduler"
_OUTPUT = "vllm.v1.core.sched.output"

#: The code the fast path mirrors: table key -> (module, class or None, attribute).
MIRRORED: dict[str, tuple[str, str | None, str]] = {
    "Request.__init__": (_REQUEST, "Request", "__init__"),
    "Request.append_output_token_ids": (_REQUEST, "Request", "append_output_token_ids"),
    "Request.update_block_hashes": (_REQUEST, "Request", "update_block_hashes"),
    "Request.take_events": (_REQUEST, "Request", "take_events"),
    "Request.num_tokens": (_REQUEST, "Request", "num_tokens"),
    "Request.num_output_tokens": (_REQUEST, "Request", "num_output_tokens"),
    "check_stop": (_SCHEDULER, None, "check_stop"),
    "Scheduler.schedule": (_SCHEDULER, "Scheduler", "schedule"),
    "Scheduler._update_after_schedule": (_SCHEDULER, "Scheduler", "_update_after_schedule"),
    "Scheduler._make_cached_request_data": (
        _SCHEDULER,
        "Scheduler",
        "_make_cached_request_data",
    ),
    "Scheduler.update_from_output": (_SCHEDULER, "Scheduler", "update_from_output"),
    "Scheduler._update_request_with_output": (
        _SCHEDULER,
        "Scheduler",
        "_update_request_with_output",
    ),
    "AsyncScheduler._update_after_schedule": (_ASYNC, "AsyncScheduler", "_update_after_schedule"),
    "AsyncScheduler._update_request_with_output": (
        _ASYNC,
        "AsyncScheduler",
        "_update_request_with_output",
    ),
}

#: The structs the fast path builds: table key -> (module, class).
STRUCTS: dict[str, tuple[str, str]] = {
    "EngineCoreOutput": (_SCHEDULER, "EngineCoreOutput"),
    "SchedulerOutput": (_OUTPUT, "SchedulerOutput"),
    "CachedRequestData": (_OUTPUT, "CachedRequestData"),
}

#: The ``Request`` attributes the core reads (``REQUEST_FIELDS`` in
#: ``src/python/step_update.rs`` and the reads of ``src/python/step_schedule.rs``): all set
#: by ``Request.__init__``, whose source the fingerprint covers.
REQUEST_FIELDS = (
    "_all_token_ids",
    "_block_hasher",
    "_output_token_ids",
    "block_hashes",
    "client_index",
    "events",
    "is_prefill_chunk",
    "max_tokens",
    "mm_features",
    "next_decode_eligible_step",
    "num_computed_tokens",
    "num_in_flight_tokens",
    "num_nans_in_logits",
    "num_output_placeholders",
    "num_prompt_tokens",
    "num_stale_output_tokens",
    "pooling_params",
    "prefill_stats",
    "request_id",
    "sampling_params",
    "spec_token_ids",
    "status",
    "stop_reason",
    "structured_output_request",
    "trace_headers",
)

_ABSENT = "absent"


def _source_hash(obj: Any) -> str:
    """A hash of the source of the code that runs for ``obj`` (a function, or a property's
    getter): its own code object's lines, so a ``functools.wraps`` wrapper hashes as the
    wrapper, not as what it wraps."""
    if isinstance(obj, property):
        obj = obj.fget
    code = getattr(obj, "__code__", None)
    if code is None:
        return f"not-a-function:{type(obj).__name__}"
    block = _block(linecache.getlines(code.co_filename), code.co_firstlineno - 1)
    if not block:
        return "source-unavailable"
    return hashlib.sha256("".join(block).encode()).hexdigest()[:16]


def _block(lines: list[str], first: int) -> list[str]:
    """The lines of the function whose first line (first decorator, or ``def``) is
    ``lines[first]``: the decorators, the ``def`` header up to its balanced closing ``:``,
    then every line blank or indented deeper than the ``def``, trailing blank lines
    dropped. A textual rule, so the hash is the same on every Python version, and
    ~100 times cheaper than ``inspect.getsource``'s tokenizing (0.15 s for these
    functions)."""
    if not 0 <= first < len(lines):
        return []
    i = first
    depth = 0
    while i < len(lines):  # decorators and the header
        line = lines[i].split("#", 1)[0].rstrip()
        depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")
        i += 1
        stripped = line.lstrip()
        if depth <= 0 and not stripped.startswith("@") and stripped.endswith(":"):
            break
    head = lines[first]
    indent = len(head) - len(head.lstrip())
    end = i
    while end < len(lines):
        line = lines[end]
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        end += 1
    block = lines[first:end]
    while block and not block[-1].strip():
        block.pop()
    return block


def _struct_hash(cls: Any) -> str:
    """A hash of a struct's field names, with each plain default (None, bool, int, str)."""
    fields = getattr(cls, "__struct_fields__", None)
    if fields is not None:  # msgspec
        defaults = tuple(getattr(cls, "__struct_defaults__", ()))
        pad: list[Any] = [inspect.Parameter.empty] * (len(fields) - len(defaults))
        pairs: list[tuple[str, Any]] = list(zip(fields, [*pad, *defaults], strict=True))
    elif dataclasses.is_dataclass(cls):
        pairs = [(f.name, f.default) for f in dataclasses.fields(cls)]
    else:
        return f"not-a-struct:{type(cls).__name__}"
    text = ",".join(
        f"{name}={d!r}" if d is None or isinstance(d, bool | int | str) else name
        for name, d in pairs
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _lookup(module: str, owner: str | None, name: str) -> Any:
    """The object at ``module.owner.name`` (the ``__dict__`` entry of the class that
    ``module`` defines as ``owner``), or None. The class is found in the MRO of what
    ``module.owner`` is bound to now: vllm-omni rebinds ``vllm.v1.request.Request`` to its
    subclass ``OmniRequest``, whose own methods are the per-class check's business."""
    mod = importlib.import_module(module)
    if owner is None:
        return getattr(mod, name, None)
    bound = getattr(mod, owner, None)
    for cls in getattr(bound, "__mro__", ()):
        if cls.__module__ == module and cls.__qualname__ == owner:
            return vars(cls).get(name)
    return None


def _current() -> tuple[dict[str, str], dict[str, Any]]:
    """The installed vLLM's fingerprint and the objects it was taken of."""
    prints: dict[str, str] = {}
    objects: dict[str, Any] = {}
    for key, (module, owner, name) in MIRRORED.items():
        obj = _lookup(module, owner, name)
        objects[key] = obj
        prints[key] = _ABSENT if obj is None else _source_hash(obj)
    for key, (module, name) in STRUCTS.items():
        cls = getattr(importlib.import_module(module), name, None)
        objects[key] = cls
        own = _vllm_class(cls, name)
        prints[key] = _ABSENT if own is None else _struct_hash(own)
    return prints, objects


def _vllm_class(cls: Any, name: str) -> Any:
    """vLLM's own class ``name`` in the MRO of ``cls`` (what a module name is bound to now:
    vllm-omni rebinds ``EngineCoreOutput`` to its subclass ``OmniEngineCoreOutput``, whose
    own fields are ``hscache.omni.mirror``'s business), or None."""
    for klass in getattr(cls, "__mro__", ()):
        if klass.__qualname__ == name and klass.__module__.startswith("vllm."):
            return klass
    return None


def fingerprint() -> dict[str, str]:
    """The installed vLLM's fingerprint of what the fast path mirrors (table key -> hash)."""
    return _current()[0]


def tested_version(version: str) -> str | None:
    """The table's key for vLLM ``version`` (its release, without a ``+local`` suffix),
    or None when that release is not in the table."""
    release = version.strip().split("+", 1)[0]
    return release if release in _mirror_table.FINGERPRINTS else None


def _installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


class _Verdict:
    """The process's verdict: why the fast path is off (None: proven), and the objects
    fingerprinted, which the per-class checks compare with."""

    def __init__(self, reason: str | None, objects: dict[str, Any]) -> None:
        self.reason = reason
        self.objects = objects


def _why_not() -> _Verdict:
    version = _installed_version()
    key = tested_version(version)
    if key is None:
        tested = ", ".join(sorted(_mirror_table.FINGERPRINTS))
        return _Verdict(f"vLLM {version} is not a version it was tested on ({tested})", {})
    prints, objects = _current()
    expected = _mirror_table.FINGERPRINTS[key]
    differ = sorted(k for k in expected.keys() | prints.keys() if expected.get(k) != prints.get(k))
    if differ:
        return _Verdict(
            f"vLLM {version}'s {', '.join(differ)} differ from the code tested on {key}",
            objects,
        )
    return _Verdict(None, objects)


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


@functools.cache
def _verdict() -> _Verdict:
    return _why_not()


def code_proven() -> bool:
    """Whether the installed vLLM is a tested version whose mirrored code is the code
    tested, whatever ``EngineCoreOutput`` its scheduler module builds now (vllm-omni's
    schedulers check theirs themselves, ``hscache.omni.mirror``). The reason is logged
    once when not."""
    reason = _verdict().reason
    if reason is not None and ("code", "") not in _logged:
        _logged.add(("code", ""))
        logger.warning("hscache: the fast path is off: %s", reason)
    return reason is None


def verified_objects() -> dict[str, Any]:
    """The objects the fingerprint was taken of (table key -> object)."""
    return _verdict().objects


@functools.cache
def proven(output_class: Any) -> bool:
    """Whether the installed vLLM is a tested version whose mirrored code is the code tested,
    and its scheduler builds ``output_class`` (the fast path's ``EngineCoreOutput``). Decided
    once per process; when not, the reason is logged once."""
    verdict = _verdict()
    reason = verdict.reason
    used = verdict.objects.get("EngineCoreOutput")
    if reason is None and used is not _vllm_class(used, "EngineCoreOutput"):
        # vllm-omni's patch: its own schedulers' fast path is hscache.omni's business.
        reason = (
            f"vLLM's scheduler builds {_name(used)}, a subclass of vLLM's EngineCoreOutput "
            "(as vllm-omni's patch binds): not what vLLM's schedulers were tested with "
            "(hscache.omni's schedulers check their own)"
        )
    if reason is None and used is not output_class:
        reason = f"vLLM's scheduler builds {_name(used)}, the fast path {_name(output_class)}"
    if reason is not None:
        logger.warning("hscache: the fast path is off: %s", reason)
    return reason is None


def _resolve(cls: type, name: str, skip: Callable[[type], bool]) -> tuple[type | None, Any]:
    """The class of ``cls``'s MRO that defines ``name`` first (``skip``ped classes aside)
    and what it defines."""
    for klass in cls.__mro__:
        if skip(klass) or name not in vars(klass):
            continue
        return klass, vars(klass)[name]
    return None, None


def _covered(
    cls: type, keys: Sequence[str], objects: dict[str, Any], skip: Callable[[type], bool]
) -> str | None:
    """Why ``cls`` does not run the mirrored ``keys`` as fingerprinted (None: it does)."""
    for key in keys:
        name = MIRRORED[key][2]
        verified = [objects[k] for k in keys if MIRRORED[k][2] == name and objects[k] is not None]
        if not verified:
            continue  # absent in this release
        klass, found = _resolve(cls, name, skip)
        if klass is None or not any(found is v for v in verified):
            owner = "nothing" if klass is None else _name(klass)
            return f"{_name(cls)} runs {name} from {owner}, not the vLLM code tested"
    return None


def _hscache_own(klass: type) -> bool:
    """hscache's scheduler classes, whose ``schedule`` / ``update_from_output`` are the fast
    path's own entry points."""
    return klass.__module__ in ("hscache.vllm.scheduler", "hscache.omni.scheduler")


_SCHEDULER_KEYS = tuple(k for k in MIRRORED if k.split(".")[0] in ("Scheduler", "AsyncScheduler"))
_REQUEST_KEYS = tuple(k for k in MIRRORED if k.startswith("Request.") and k != "Request.__init__")
_logged: set[tuple[str, str]] = set()
_request_verdicts: dict[type, str | None] = {}


def _log_once(kind: str, cls: type, reason: str) -> None:
    if (kind, _name(cls)) not in _logged:
        _logged.add((kind, _name(cls)))
        logger.warning("hscache: the fast path is off for this %s: %s", kind, reason)


def scheduler_covered(cls: type, stood_in: Sequence[str] = ()) -> bool:
    """Whether scheduler class ``cls`` runs vLLM's mirrored ``Scheduler`` methods,
    ``check_stop`` and ``EngineCoreOutput`` as fingerprinted (hscache's own classes aside):
    a subclass or a patch that replaced one since is not what was tested (logged once per
    class). ``stood_in``: mirrored keys a subclass overrides and whose override is checked
    by its caller (vllm-omni's ``schedule`` / ``update_from_output``,
    ``hscache.omni.mirror``). Call it after :func:`proven` or :func:`code_proven`."""
    verdict = _verdict()
    if verdict.reason is not None:
        return False
    keys = tuple(k for k in _SCHEDULER_KEYS if k not in stood_in)
    reason = _covered(cls, keys, verdict.objects, _hscache_own)
    for key in ("check_stop", "EngineCoreOutput"):
        if reason is None and _lookup(_SCHEDULER, None, key) is not verdict.objects[key]:
            reason = f"vLLM's scheduler module's {key} is not the one tested"
    if reason is not None:
        _log_once("scheduler", cls, reason)
    return reason is None


def request_covered(cls: type) -> bool:
    """Whether request class ``cls`` resolves every mirrored ``Request`` method to vLLM's
    own, as fingerprinted (decided once per class, logged once when not)."""
    known = _request_verdicts.get(cls, False)
    if known is not False:
        return known is None
    verdict = _verdict()
    if verdict.reason is not None:
        return False
    reason = _covered(cls, _REQUEST_KEYS, verdict.objects, lambda _: False)
    _request_verdicts[cls] = reason
    if reason is not None:
        _log_once("request class", cls, reason)
    return reason is None


def _reset() -> None:
    """Test only: forget every verdict (after a test patched vLLM)."""
    _verdict.cache_clear()
    proven.cache_clear()
    if "hscache.omni.mirror" in sys.modules:
        sys.modules["hscache.omni.mirror"].omni_verdict.cache_clear()
    _logged.clear()
    _request_verdicts.clear()


def _write_table(version: str, prints: dict[str, str], module: Any = _mirror_table) -> Path:
    """Stores ``prints`` as ``version``'s entry of the table module ``module``
    (``_mirror_table.py`` here; vllm-omni's, ``hscache.omni.mirror``'s)."""
    table = dict(module.FINGERPRINTS)
    table[version.strip().split("+", 1)[0]] = dict(sorted(prints.items()))
    # ruff format's layout: one entry a line, trailing commas.
    lines = ["FINGERPRINTS: dict[str, dict[str, str]] = {"]
    for release, entry in sorted(table.items()):
        lines.append(f'    "{release}": {{')
        lines.extend(f'        "{k}": "{v}",' for k, v in sorted(entry.items()))
        lines.append("    },")
    lines.append("}")
    path = Path(module.__file__)
    old = path.read_text()
    header = old[: old.index("FINGERPRINTS")]  # the module doc and imports, kept
    path.write_text(header + "\n".join(lines) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hscache.vllm.mirror",
        description="The installed vLLM's fingerprint of the code the fast path mirrors.",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="store it as the installed version's entry of hscache/vllm/_mirror_table.py",
    )
    args = parser.parse_args(argv)
    version = _installed_version()
    prints = fingerprint()
    if args.write:
        print(f"vLLM {version}: wrote {_write_table(version, prints)}")
        if importlib.util.find_spec("vllm_omni") is not None:
            # vllm-omni's schedulers' entry (its import patches vLLM: after vLLM's own).
            omni_mirror = importlib.import_module("hscache.omni.mirror")
            print(omni_mirror.write_entry())
        return 0
    key = tested_version(version)
    expected = _mirror_table.FINGERPRINTS.get(key or "", {})
    for k, v in prints.items():
        mark = "" if expected.get(k) == v else "  (differs from the table)"
        print(f"{k}: {v}{mark}")
    if not re.match(r"^\d+\.\d+\.\d+", version) or key is None:
        print(f"vLLM {version} is not in the table")
        return 1
    return 0 if expected == prints else 1


if __name__ == "__main__":
    sys.exit(main())
