"""Shared pytest fixtures: vLLM-shaped requests and KV-cache configs for one full-attention group.

`tests/vllm_upstream/` holds a plugin for vLLM's own test files, run from the vLLM
sdist by `scripts/test.sh`; it is not collected here.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

collect_ignore = ["vllm_upstream", "vllm_diff"]
