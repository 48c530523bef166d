"""Test scaffolding: speculative decoding in the thinker stage of the end-to-end run.

vllm-omni 0.30's deploy YAML has no owner for ``speculative_config`` (a stage that names it
is refused: "explicit engine argument(s) with no structured config owner:
speculative_config"), so the end-to-end run's drafting arms hand it to vLLM here: with
``HSCACHE_E2E_THINKER_SPEC`` set (a JSON ``speculative_config``), vLLM's
``EngineArgs.create_engine_config`` builds the thinker stage's engine (``model_stage``
``thinker``) with it, wherever that engine's config is made; every other stage, and every
run without the variable, is unchanged.

vLLM 0.30's rejection sampler decides greedy drafts in a Triton kernel, which the CPU build
cannot launch ("Cannot inspect kernel parameters for function"); with the variable set,
:func:`greedy_rejection` (the same rule in torch: each draft kept while it equals the
target's argmax at its position, the first mismatch replaced by the argmax and the rest
dropped, the bonus token appended when all were kept) runs instead for tensors on the CPU.
Both arms of the drafting check (cold and hscache) run it alike.
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "HSCACHE_E2E_THINKER_SPEC"


def greedy_rejection(
    output_token_ids: Any,
    cu_num_draft_tokens: Any,
    draft_token_ids: Any,
    target_argmax: Any,
    bonus_token_ids: Any,
    is_greedy: Any,
    max_spec_len: int,
    uniform_probs: Any,
    synthetic_conditional_rates: Any,
) -> None:
    """vLLM's ``rejection_greedy_sample_kernel``, in torch on the host: writes each greedy
    request's row of ``output_token_ids`` (``[batch, max_spec_len + 1]``)."""
    if synthetic_conditional_rates is not None:
        raise NotImplementedError("synthetic rejection sampling is not scaffolded on CPU")
    ends = cu_num_draft_tokens.tolist()
    drafts, argmax = draft_token_ids.tolist(), target_argmax.tolist()
    bonus = bonus_token_ids.reshape(-1).tolist()
    greedy = None if is_greedy is None else is_greedy.tolist()
    start = 0
    for req, end in enumerate(ends):
        if greedy is None or greedy[req]:
            rejected = False
            for pos in range(end - start):
                output_token_ids[req, pos] = argmax[start + pos]
                if drafts[start + pos] != argmax[start + pos]:
                    rejected = True
                    break
            if not rejected:
                output_token_ids[req, end - start] = bonus[req]
        start = end


class _OnTheHost:
    """vLLM's kernel dispatcher, but :func:`greedy_rejection` for host tensors; everything
    else (``register_warmup``, ...) is the dispatcher's."""

    hscache_probe = True

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel

    def __call__(self, output_token_ids: Any, *args: Any) -> Any:
        if output_token_ids.device.type != "cpu":
            return self._kernel(output_token_ids, *args)
        return greedy_rejection(output_token_ids, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)


def install() -> None:
    """Wraps ``EngineArgs.create_engine_config`` and puts :func:`greedy_rejection` in the
    rejection sampler's place, once per process (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample import rejection_sampler

    kernel = rejection_sampler._rejection_greedy_sample
    if not getattr(kernel, "hscache_probe", False):
        rejection_sampler._rejection_greedy_sample = _OnTheHost(kernel)

    original = EngineArgs.create_engine_config
    if getattr(original, "hscache_probe", False):
        return

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        spec = os.environ.get(ENV)
        if (
            spec
            and getattr(self, "model_stage", None) == "thinker"
            and not getattr(self, "speculative_config", None)
        ):
            self.speculative_config = json.loads(spec)
        return original(self, *args, **kwargs)

    create_engine_config.hscache_probe = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
