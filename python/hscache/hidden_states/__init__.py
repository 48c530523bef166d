"""The hidden-state cache: per-token model outputs of prefix-cached tokens, served on a hit.

One room, three modules:

- :mod:`.cache` — :class:`HiddenStateCache` (torch tensors, one row per KV slot, indexed by
  the Rust slot mirror of ``src/slots/``) and :func:`full_attention_group`;
- :mod:`.steps` — one step's :class:`StepPlan` (what the forward pass produces, where it
  goes) and :class:`StepRows` (every request's rows after the step);
- :mod:`.prefill_skip` — vLLM's KV-sharing fast prefill (``--kv-sharing-fast-prefill``)
  computed on the host (``src/prefill_skip.rs``).

vllm-omni's side (the stage's prefix cache, the switch, the schedulers) is built on this
package in :mod:`hscache.omni`. The names below are the public ones; import them from here.
"""

from hscache.hidden_states.cache import HiddenStateCache, KeySpec, full_attention_group
from hscache.hidden_states.prefill_skip import PrefillSkip
from hscache.hidden_states.steps import StepPlan, StepRows

__all__ = [
    "HiddenStateCache",
    "KeySpec",
    "PrefillSkip",
    "StepPlan",
    "StepRows",
    "full_attention_group",
]
