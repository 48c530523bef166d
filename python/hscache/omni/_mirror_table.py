"""The fingerprints of the vllm-omni code the omni schedulers' fast path stands in for,
per vllm-omni version whose differential ran (``hscache.omni.mirror``; ``vllm``: the vLLM
release it ran on). Generated: regenerate an entry in that version's environment with
``python -m hscache.vllm.mirror --write``."""

from __future__ import annotations

FINGERPRINTS: dict[str, dict[str, str]] = {
    "0.30.0": {
        "OmniARScheduler._process_kv_transfer_trigger": "d6f70e7c4c747b33",
        "OmniARScheduler.schedule": "1f811288ea7c6b74",
        "OmniARScheduler.update_from_output": "cfd08e6f17ebc46a",
        "OmniEngineCoreOutput": "de9aeb23655d90c9",
        "OmniSchedulerMixin._append_request_output": "8849eb7e26585632",
        "OmniSchedulerMixin._attach_finished_request_sets": "ae5d0a0509300edd",
        "OmniSchedulerMixin._make_omni_engine_output": "074a9c77cf8ddce6",
        "OmniSchedulerMixin._maybe_decode_pooling_output": "bc910ce8528b5f46",
        "OmniSchedulerMixin._reject_invalid_grammar_tokens": "2513b8d8a533b1f7",
        "OmniSchedulerMixin._wrap_omni_scheduler_output": "acad3748d72d775e",
        "_should_emit_engine_output": "a8d9227737e5c09b",
        "vllm": "0.30.0",
    },
}
