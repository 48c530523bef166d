"""What the fast path stands in for in vllm-omni's AR schedulers, and the check that it is
the code that was tested.

``hscache.omni.OmniARScheduler`` / ``OmniARAsyncScheduler`` run vllm-omni's own
``schedule()`` and ``update_from_output()``: the fast path serves the vLLM part of
``schedule()`` (vllm-omni calls ``super().schedule()`` between its own steps) and the
steady requests of ``update_from_output()``, whose outputs it builds as vllm-omni's loop
would (``hscache.omni.fast``). So its exactness rests on these pieces of vllm-omni as well
as on vLLM's (``hscache.vllm.mirror``):

- ``OmniARScheduler.schedule`` and ``update_from_output`` (the loop the split takes requests
  out of), ``_process_kv_transfer_trigger``, the module's ``_should_emit_engine_output``;
- ``OmniSchedulerMixin``'s ``_make_omni_engine_output``, ``_append_request_output``,
  ``_reject_invalid_grammar_tokens``, ``_maybe_decode_pooling_output``,
  ``_attach_finished_request_sets`` and ``_wrap_omni_scheduler_output``;
- ``OmniEngineCoreOutput``'s fields and plain defaults.

Their fingerprint is stored per vllm-omni version (with the vLLM release it ran on) in
:mod:`hscache.omni._mirror_table`, written by ``python -m hscache.vllm.mirror --write`` in
an environment with vllm-omni (``tests/omni/test_omni_schedulers.py`` is its
differential). The omni schedulers serve steps only where the installed vllm-omni is one
of the table's, on that vLLM release, with that fingerprint (:func:`omni_verdict`, once
per process), and the class in use resolves those methods to vllm-omni's and every other
method the fast path mirrors to vLLM's (:func:`omni_covered`, per class).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
from typing import Any

from hscache.omni import _mirror_table
from hscache.vllm import mirror

logger = logging.getLogger(__name__)

__all__ = ["OMNI_MIRRORED", "STOOD_IN", "omni_covered", "omni_fingerprint", "omni_verdict"]

_AR = "vllm_omni.core.sched.omni_ar_scheduler"
_MIXIN = "vllm_omni.core.sched.omni_scheduler_mixin"

#: vllm-omni's code the fast path stands in for: table key -> (module, class or None, name).
OMNI_MIRRORED: dict[str, tuple[str, str | None, str]] = {
    "OmniARScheduler.schedule": (_AR, "OmniARScheduler", "schedule"),
    "OmniARScheduler.update_from_output": (_AR, "OmniARScheduler", "update_from_output"),
    "OmniARScheduler._process_kv_transfer_trigger": (
        _AR,
        "OmniARScheduler",
        "_process_kv_transfer_trigger",
    ),
    "_should_emit_engine_output": (_AR, None, "_should_emit_engine_output"),
    "OmniSchedulerMixin._make_omni_engine_output": (
        _MIXIN,
        "OmniSchedulerMixin",
        "_make_omni_engine_output",
    ),
    "OmniSchedulerMixin._append_request_output": (
        _MIXIN,
        "OmniSchedulerMixin",
        "_append_request_output",
    ),
    "OmniSchedulerMixin._reject_invalid_grammar_tokens": (
        _MIXIN,
        "OmniSchedulerMixin",
        "_reject_invalid_grammar_tokens",
    ),
    "OmniSchedulerMixin._maybe_decode_pooling_output": (
        _MIXIN,
        "OmniSchedulerMixin",
        "_maybe_decode_pooling_output",
    ),
    "OmniSchedulerMixin._attach_finished_request_sets": (
        _MIXIN,
        "OmniSchedulerMixin",
        "_attach_finished_request_sets",
    ),
    "OmniSchedulerMixin._wrap_omni_scheduler_output": (
        _MIXIN,
        "OmniSchedulerMixin",
        "_wrap_omni_scheduler_output",
    ),
}

#: vLLM's mirrored methods vllm-omni's schedulers override (checked here, not by
#: ``hscache.vllm.mirror.scheduler_covered``).
STOOD_IN = ("Scheduler.schedule", "Scheduler.update_from_output")

#: The per-class check: the method names that must resolve to vllm-omni's objects.
_CLASS_KEYS = tuple(k for k, (_, owner, _) in OMNI_MIRRORED.items() if owner is not None)


def _omni_version() -> str:
    try:
        return importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _current() -> tuple[dict[str, str], dict[str, Any]]:
    from vllm_omni.engine import OmniEngineCoreOutput

    prints: dict[str, str] = {}
    objects: dict[str, Any] = {}
    for key, (module, owner, name) in OMNI_MIRRORED.items():
        mod = importlib.import_module(module)
        obj = getattr(mod, name, None) if owner is None else vars(getattr(mod, owner)).get(name)
        objects[key] = obj
        prints[key] = "absent" if obj is None else mirror._source_hash(obj)
    objects["OmniEngineCoreOutput"] = OmniEngineCoreOutput
    prints["OmniEngineCoreOutput"] = mirror._struct_hash(OmniEngineCoreOutput)
    prints["vllm"] = mirror._installed_version().split("+", 1)[0]
    return prints, objects


def omni_fingerprint() -> dict[str, str]:
    """The installed vllm-omni's fingerprint (table key -> hash; ``vllm``: the release)."""
    return _current()[0]


class _OmniVerdict:
    def __init__(self, reason: str | None, objects: dict[str, Any]) -> None:
        self.reason = reason
        self.objects = objects


@functools.cache
def omni_verdict() -> _OmniVerdict:
    """Why the omni schedulers' fast path is off in this process (``reason`` None: vLLM's
    and vllm-omni's mirrored code are the code tested); logged once when off."""
    reason: str | None = None
    objects: dict[str, Any] = {}
    version = _omni_version()
    expected = _mirror_table.FINGERPRINTS.get(version)
    if not mirror.code_proven():
        reason = "vLLM's mirrored code is not the code tested (logged above)"
    elif expected is None:
        tested = ", ".join(sorted(_mirror_table.FINGERPRINTS)) or "none"
        reason = f"vllm-omni {version} is not a version it was tested on ({tested})"
    else:
        prints, objects = _current()
        differ = sorted(
            k for k in expected.keys() | prints.keys() if expected.get(k) != prints.get(k)
        )
        if differ:
            reason = (
                f"vllm-omni {version}'s {', '.join(differ)} differ from the code tested "
                f"(vllm-omni {version} on vLLM {expected.get('vllm')})"
            )
        else:
            import vllm.v1.core.sched.scheduler as scheduler_module

            built = getattr(scheduler_module, "EngineCoreOutput", None)
            if built is not objects["OmniEngineCoreOutput"]:
                reason = "vLLM's scheduler module does not build vllm-omni's OmniEngineCoreOutput"
    if reason is not None:
        logger.warning("hscache: the fast path of vllm-omni's schedulers is off: %s", reason)
    return _OmniVerdict(reason, objects)


def omni_covered(cls: type) -> bool:
    """Whether omni scheduler class ``cls`` runs vllm-omni's fingerprinted methods where
    vllm-omni defines them and vLLM's everywhere else the fast path mirrors (hscache's own
    classes aside). Logged once per class when not."""
    verdict = omni_verdict()
    if verdict.reason is not None:
        return False
    reason: str | None = None
    for key in _CLASS_KEYS:
        name = OMNI_MIRRORED[key][2]
        for klass in cls.__mro__:
            if mirror._hscache_own(klass) or name not in vars(klass):
                continue
            if vars(klass)[name] is not verdict.objects[key]:
                reason = f"{mirror._name(cls)} runs {name} from {mirror._name(klass)}"
            break
        if reason is not None:
            break
    if reason is None and not mirror.scheduler_covered(cls, stood_in=STOOD_IN):
        return False  # logged there
    if reason is not None:
        mirror._log_once("vllm-omni scheduler", cls, reason)
    return reason is None


def write_entry() -> str:
    """Store the installed vllm-omni's fingerprint as its entry of ``_mirror_table.py``."""
    version = _omni_version()
    path = mirror._write_table(version, omni_fingerprint(), _mirror_table)
    return f"vllm-omni {version}: wrote {path}"
