"""The switch: vllm-omni's runners build hscache's cache when the settings say so.

:func:`register` is hscache's ``vllm.general_plugins`` entry point ``hscache_omni``, run in
every vLLM process: it acts only where ``HSCACHE_OMNI_PREFIX_CACHE=1`` is set when the
plugins load (a stage's environment is applied around its process's spawn), on a tested
vllm-omni release (:data:`TESTED_VLLM_OMNI`), replacing its four attributes all or none,
and never raises: anything it cannot do is one warning, vllm-omni unchanged. Not asked, it
imports nothing of vllm-omni. :func:`install` switches at once, in code. What the
environment says lives in :mod:`hscache.omni.settings`; the cache itself in
:mod:`hscache.omni.prefix_cache`.

Hybrid KV layouts (a sliding-window, chunked-local or Mamba group beside full attention):
vllm-omni 0.30 refuses every layout but one full-attention group, at KV-cache init
(``vllm_omni/core/prefix_cache/group_view.py``, ``check_prefix_cache_kv_groups``: "omni
prefix caching requires a single full-attention kv-cache group; found 2"), and its group
view reads block table 0. While hscache's cache is on, the switch puts hscache's rule in
that check's place (a group that carries full-attention positions must exist,
:func:`hscache.hidden_states.full_attention_group`) and, for a layout of several groups,
hands the runner a view that names that group, whose block tables the cache then follows.
With hscache's cache off, vllm-omni's own check and view run unchanged.

Speculative decoding: vllm-omni 0.30 refuses it for any prefix cache, at KV-cache init
(``group_view.check_prefix_cache_token_accounting``). While hscache's cache is on, the
switch puts hscache's rule in its place (:func:`_check_token_accounting`): drafts are
served on stages that schedule synchronously, where every ``SchedulerOutput`` carries a
step's true start (vLLM's scheduler has rolled the previous step's rejected drafts back
before it schedules the next) and a rejected draft's row is overwritten by the real
token's before its block is hashed (``tests/omni/test_draft_rows.py``, and the
``hscache_spec`` arm of the end-to-end check). Stages with async scheduling stay refused,
with the reason (:data:`SPEC_ASYNC_REFUSAL`). vllm-omni's other rule of that check
(block-aligned hits: ``prefix_match_unit``) is kept as it is.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from hscache.hidden_states.cache import full_attention_group
from hscache.omni.prefix_cache import OmniHiddenStateCache
from hscache.omni.refusals import install_on_runner
from hscache.omni.settings import OmniSettings

logger = logging.getLogger(__name__)

Enabled = Callable[[], bool]


def _from_env() -> bool:
    return OmniSettings.from_env().enabled


def _always() -> bool:
    return True


class KVGroupView:
    """The runner-facing view of a multi-group layout: the runner's batch order
    (``batch_req_ids``, all :class:`OmniHiddenStateCache` reads of a view) and the KV-cache
    group whose block tables index the rows, with that group's block size."""

    def __init__(self, input_batch: Any, kv_cache_group: int, block_size: int) -> None:
        self._input_batch = input_batch
        self.kv_cache_group = kv_cache_group
        self.block_size = block_size

    def batch_req_ids(self) -> list[str]:
        return list(self._input_batch.req_ids)


def _full_group(kv_cache_groups: Sequence[Any] | None) -> int:
    """The group the cache follows; hscache's ``InvalidArgumentError`` when there is none."""
    return full_attention_group(SimpleNamespace(kv_cache_groups=list(kv_cache_groups or ())))


def _check_kv_groups(original: Any, enabled: Enabled) -> Any:
    """vllm-omni's ``check_prefix_cache_kv_groups``, hscache's rule while its cache is on."""

    def check(kv_cache_groups: Any) -> None:
        if not enabled():
            original(kv_cache_groups)
            return
        _full_group(kv_cache_groups)

    check.hscache_original = original  # type: ignore[attr-defined]
    return check


SPEC_ASYNC_REFUSAL = (
    "hscache's hidden-state prefix cache serves speculative decoding only on stages that "
    "schedule synchronously (async_scheduling: false): with async scheduling, vLLM's runner "
    "corrects a step's positions for the previous step's rejected drafts only after the "
    "step's outputs are saved (vllm-omni 0.30's AR runner runs the deferred correction after "
    "_prefix_cache_save_step), so the cache would lay the step's rows out at positions that "
    "assume every draft accepted. Set async_scheduling: false on this stage, or disable "
    "enable_prefix_caching"
)
"""hscache's refusal of speculative decoding on an async stage (or one whose scheduling it
cannot tell)."""


def _async_scheduling() -> bool | None:
    """Whether the stage whose KV cache is being initialized schedules asynchronously: vLLM's
    current config (set around the worker's ``initialize_from_config``, where vllm-omni's
    runner runs its checks), resolved by then; None where no config is current or its
    choice is unresolved."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    config = get_current_vllm_config_or_none()
    choice = getattr(getattr(config, "scheduler_config", None), "async_scheduling", None)
    return None if choice is None else bool(choice)


AsyncScheduling = Callable[[], "bool | None"]


def _check_token_accounting(
    original: Any, enabled: Enabled, async_scheduling: AsyncScheduling = _async_scheduling
) -> Any:
    """vllm-omni's ``check_prefix_cache_token_accounting``, hscache's rule while its cache
    is on: speculative decoding passes on a stage that schedules synchronously; on an async
    stage (or where the stage's scheduling is unknown) it is refused with
    :data:`SPEC_ASYNC_REFUSAL`; vllm-omni's block-aligned-hit rule runs in either case."""

    def check(cache_config: Any, speculative_config: Any) -> None:
        if not enabled():
            original(cache_config, speculative_config)
            return
        original(cache_config, None)  # vllm-omni's other rule: block-aligned hits
        if speculative_config is None:
            return
        is_async = async_scheduling()
        if is_async is False:
            return
        from vllm_omni.core.prefix_cache.interface import OmniPrefixCacheUnmatchError

        why = "" if is_async else " (this stage's scheduling could not be read)"
        raise OmniPrefixCacheUnmatchError(SPEC_ASYNC_REFUSAL + why)

    check.hscache_original = original  # type: ignore[attr-defined]
    return check


def _group_view(original: Any, enabled: Enabled) -> Any:
    """vllm-omni's ``get_prefix_cache_group_view``; a :class:`KVGroupView` of the
    full-attention group for a layout of several groups while hscache's cache is on."""

    def view(input_batch: Any, block_size: int, kv_cache_groups: Any = None) -> Any:
        groups = list(kv_cache_groups or ())
        if not enabled() or len(groups) <= 1:
            return original(input_batch, block_size, kv_cache_groups=kv_cache_groups)
        group = _full_group(groups)
        spec = groups[group].kv_cache_spec
        return KVGroupView(input_batch, group, int(getattr(spec, "block_size", block_size)))

    view.hscache_original = original  # type: ignore[attr-defined]
    return view


def _build_manager(original: Any, enabled: Enabled = _from_env) -> Any:
    """What vllm-omni's runner mixin calls to build its cache: hscache's when ``enabled()``
    at that moment (the environment, for the plugin), vllm-omni's own otherwise."""

    def build(config: Any, view: Any, **kwargs: Any) -> Any:
        if not enabled():
            return original(config, view, **kwargs)
        settings = OmniSettings.from_env()
        if isinstance(view, KVGroupView):
            kwargs.setdefault("kv_cache_group", view.kv_cache_group)
            config = SimpleNamespace(num_blocks=config.num_blocks, block_size=view.block_size)
        logger.info(
            "hscache: the hidden-state prefix cache is hscache's (%s storage, KV-cache group %d)",
            settings.storage,
            kwargs.get("kv_cache_group", 0),
        )
        # A refused hit is recomputed where the runner reports its blocks (refusals.py).
        kwargs.setdefault("recompute_refused", install_on_runner())
        return OmniHiddenStateCache(config, view, settings=settings, **kwargs)

    build.hscache_original = original  # type: ignore[attr-defined]
    return build


#: The vllm-omni releases the switch was tested on (``requirements/vllm030-nodeps.txt``).
TESTED_VLLM_OMNI = ("0.30.0",)

_RUNNER_MIXIN = "vllm_omni.core.prefix_cache.runner_mixin"
_GROUP_VIEW = "vllm_omni.core.prefix_cache.group_view"
#: What the switch replaces: (module, attribute, hook).
_HOOKS: tuple[tuple[str, str, Callable[[Any, Enabled], Any]], ...] = (
    (_RUNNER_MIXIN, "OmniPrefixCacheManager", _build_manager),
    (_RUNNER_MIXIN, "get_prefix_cache_group_view", _group_view),
    (_GROUP_VIEW, "check_prefix_cache_kv_groups", _check_kv_groups),
    (_GROUP_VIEW, "check_prefix_cache_token_accounting", _check_token_accounting),
)


class VllmOmniMismatchError(RuntimeError):
    """The installed vllm-omni lacks an attribute the switch replaces (renamed, moved):
    nothing was replaced."""


def _targets() -> list[tuple[Any, str, Callable[[Any, Enabled], Any], Any]]:
    """Every attribute the switch replaces, looked up before any is: ``(module, name,
    hook, current)``; :class:`VllmOmniMismatchError` naming the first one missing."""
    found = []
    for module_name, name, hook in _HOOKS:
        module = importlib.import_module(module_name)
        current = getattr(module, name, None)
        if current is None:
            raise VllmOmniMismatchError(f"{module_name} has no {name}")
        found.append((module, name, hook, current))
    return found


def _switch(enabled: Enabled) -> None:
    """Puts the four hooks into vllm-omni, all or none (once per process: a second call
    keeps the first call's hooks; the originals stay reachable as ``hscache_original``)."""
    for module, name, hook, current in _targets():
        if not hasattr(current, "hscache_original"):
            setattr(module, name, hook(current, enabled))


def install(force: bool = False) -> bool:
    """Makes vllm-omni's runners build :class:`hscache.omni.OmniHiddenStateCache` instead
    of their own manager (hybrid layouts included), when ``HSCACHE_OMNI_PREFIX_CACHE=1``
    (or ``force``). Returns whether it did. Call it in every process that runs a model
    runner (a ``vllm_omni.general_plugins`` entry point does); calling it twice is
    harmless. A vllm-omni without one of the attributes it replaces raises
    :class:`VllmOmniMismatchError`, nothing replaced."""
    if not (force or OmniSettings.from_env().enabled):
        return False
    targets = _targets()
    if any(hasattr(current, "hscache_original") for *_, current in targets):
        # The plugin's hooks read the environment when a cache is built: from now on,
        # hscache's whatever it says. Put the originals back and switch for good.
        _restore()
    _switch(_always)
    return True


def _restore() -> None:
    for module, name, _, current in _targets():
        setattr(module, name, getattr(current, "hscache_original", current))


def _installed_vllm_omni() -> str | None:
    """The installed vllm-omni's version (its distribution's metadata: nothing imported),
    ``"unknown"`` for a package without metadata, None when there is no vllm-omni."""
    if importlib.util.find_spec("vllm_omni") is None:
        return None
    try:
        return importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _register() -> str | None:
    """What :func:`register` does; the reason it left vllm-omni unchanged, where it was
    asked to switch and could not (None otherwise)."""
    version = _installed_vllm_omni()
    if version is None or not OmniSettings.enabled_in_env():
        return None  # no vllm-omni, or not asked: nothing imported, nothing touched
    if version.split("+", 1)[0] not in TESTED_VLLM_OMNI:
        return (
            f"vllm-omni {version} is not a release hscache's switch was tested with "
            f"({', '.join(TESTED_VLLM_OMNI)})"
        )
    _switch(_from_env)
    return None


def register() -> None:
    """vLLM general plugin (entry point ``hscache_omni``, run in every vLLM process). Where
    the process's environment asks for hscache's cache (``HSCACHE_OMNI_PREFIX_CACHE=1``: the
    process's own, or its stage's, which vllm-omni applies around the stage's spawn) and
    vllm-omni is a tested release (:data:`TESTED_VLLM_OMNI`), its runners build their
    cache through :func:`_build_manager` and its KV-group check, group view and
    token-accounting check (speculative decoding) defer to hscache's while the variable
    stays set. Otherwise it imports nothing of vllm-omni and
    changes nothing. It never raises (a plugin's exception would stop vLLM's start): a
    vllm-omni it cannot switch (an untested release, a renamed attribute) is one warning,
    vllm-omni unchanged."""
    try:
        reason = _register()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    if reason is None:
        return
    with contextlib.suppress(Exception):
        from hscache.vllm.plugin import use_vllm_log_handler

        use_vllm_log_handler()
    logger.warning(
        "hscache: HSCACHE_OMNI_PREFIX_CACHE is set, but vllm-omni is left unchanged "
        "(its own prefix cache serves): %s",
        reason,
    )
