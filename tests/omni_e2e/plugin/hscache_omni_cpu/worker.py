"""Test scaffolding (not shipped with hscache): vllm-omni's AR worker and runner on CPU.

The runner lists vllm-omni's ``GPUARModelRunner`` before vLLM's ``CPUModelRunner`` (itself
a ``GPUModelRunner``), so vllm-omni's stage logic (latent outputs, its prefix cache) runs
over vLLM's CPU tensors; vllm-omni's init makes device buffers after vLLM's CPU runner
rebinds them, so they are rebound once more. The worker is vLLM's ``CPUWorker`` with
vllm-omni's ``OmniWorkerMixin`` (its plugins); it names its runner (vllm-omni's connector
validation reads ``model_runner_cls``).
"""

from __future__ import annotations

import os
from typing import Any

import vllm.v1.worker.cpu_worker as cpu_worker_module
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

# The talker's default speaker; vllm-omni sets it inside the first forward, which on a GPU
# is the profiling pass that this CPU worker skips.
DEFAULT_VOICE = "Chelsie"


class CPUARModelRunner(GPUARModelRunner, CPUModelRunner):  # type: ignore[misc]
    """vllm-omni's AR runner over vLLM's CPU runner."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._postprocess_tensors()


class CPUARWorker(OmniWorkerMixin, CPUWorker):  # type: ignore[misc]
    """vLLM's CPU worker building :class:`CPUARModelRunner`."""

    model_runner_cls = CPUARModelRunner

    def init_device(self) -> None:
        # vLLM's CPUWorker.init_device builds its runner by this module-level name.
        original = cpu_worker_module.CPUModelRunner
        cpu_worker_module.CPUModelRunner = self.model_runner_cls  # type: ignore[misc]
        try:
            super().init_device()
        finally:
            cpu_worker_module.CPUModelRunner = original  # type: ignore[misc]
        assert isinstance(self.model_runner, CPUARModelRunner)

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        out = super().load_model(*args, **kwargs)
        model = self.model_runner.get_model()
        if getattr(model, "model_stage", None) == "talker":
            if not hasattr(model, "voice_type"):
                model.voice_type = DEFAULT_VOICE
            if os.environ.get("HSCACHE_E2E_TALKER_SPAN_FIX") == "1":
                model.preprocess = _span_aligned_talker_preprocess(model)
        return out


def _span_aligned_talker_preprocess(model: Any) -> Any:
    """The experiment behind docs/omni.md's note on the talker's prefix caching (opt-in,
    ``HSCACHE_E2E_TALKER_SPAN_FIX=1``): vllm-omni 0.30's Qwen2.5-Omni talker builds the
    embeddings of its whole prompt on every prefill step, and its runner copies the first
    ``span`` rows into the scheduled span, whatever ``num_computed_tokens`` is; after a
    talker KV hit (or in a later prefill chunk) the span gets the embeddings of the
    prompt's first positions. This returns the rows of the scheduled positions instead
    (and a one-token prefill span stays a prefill)."""
    original = model.preprocess

    def preprocess(input_ids: Any, input_embeds: Any, **info: Any) -> Any:
        computed = int(info.get("_omni_num_computed_tokens") or 0)
        if not info.get("_omni_is_prefill") or computed == 0:
            return original(input_ids, input_embeds, **info)
        if input_embeds is None:
            input_embeds = model.talker.embed_input_ids(input_ids)
        ids, embeds, update = model.thinker_to_talker_process(input_ids, input_embeds, info)
        span = int(input_ids.shape[0])
        return ids[computed : computed + span], embeds[computed : computed + span], update

    return preprocess


__all__ = ["CPUARModelRunner", "CPUARWorker"]
