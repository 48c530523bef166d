"""Tenant isolation: requests that differ in ``cache_salt``, LoRA adapter or multimodal
input never share a KV block, under every block-hash algorithm hscache supports (vLLM's
``sha256``, ``sha256_cbor``, ``xxhash``, ``xxhash_cbor`` and hscache's ``blake3``).

Hypothesis draws the prompt and the two requests' identities; request A is admitted and
computed (its full blocks cached), then request B with the same tokens is looked up and
admitted, once while A still holds its blocks and once after A was freed (its blocks cached
in the free queue). The properties, checked through hscache's ``KVCacheManager`` and its
native block hasher:

- a different salt or LoRA adapter: B hits nothing and its table shares no block with A's;
- a different image: B may hit only the blocks that end before the first placeholder
  token (no extra keys there, exactly as in vLLM), never a block holding image tokens;
- the control: an identical identity hits every full block but the last token's.

The collision assumptions behind these guarantees are in ``docs/security.md``.
"""

from __future__ import annotations

from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache.vllm import KVCacheManager
from hscache.vllm.block_hasher import blake3, get_request_block_hasher
from hscache_tools.testing.kv_cache import full_attention_config
from hscache_tools.testing.manager import build_manager
from hscache_tools.testing.requests import lora, make_request, mm_feature
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.vllm

ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "blake3"]
BLOCK = 4
PLACEHOLDER = 9999


def _hash_fn(algo: str) -> Any:
    return blake3 if algo == "blake3" else get_hash_fn_by_name(algo)


def _identity(kind: str, which: int, prompt: list[int]) -> dict[str, Any]:
    """Request keywords of tenant ``which`` (0 or 1) differing only in ``kind``."""
    if kind == "salt":
        return {"cache_salt": f"tenant-{which}"}
    if kind == "lora":
        return {"lora_request": lora(f"adapter-{which}", which + 1, f"/adapters/{which}")}
    if kind == "none_vs_salt":  # an unsalted request vs a salted one
        return {"cache_salt": "tenant-1"} if which else {}
    if kind == "none_vs_lora":
        return {"lora_request": lora("adapter", 1, "/adapters/a")} if which else {}
    raise AssertionError(kind)


def _run(algo: str, prompt: list[int], kw_a: dict, kw_b: dict, a_running: bool) -> tuple:
    """Admit A (computed, cached), optionally free it, then look up and admit B; return
    B's hit, A's and B's tables."""
    kv_cache_utils.init_none_hash(_hash_fn(algo))
    mgr: Any = build_manager(
        KVCacheManager, full_attention_config(64, BLOCK), enable_kv_cache_events=True
    )
    hasher = get_request_block_hasher(BLOCK, _hash_fn(algo))
    a = make_request("A", prompt, block_hasher=hasher, **kw_a)
    b = make_request("B", prompt, block_hasher=hasher, **kw_b)
    blocks, hit = mgr.get_computed_blocks(a)[:2]
    assert mgr.allocate_slots(a, len(prompt) - hit, hit, blocks) is not None
    a.num_computed_tokens = len(prompt)
    a.status = RequestStatus.RUNNING
    table_a = mgr.get_block_ids("A")[0]
    if not a_running:
        a.status = RequestStatus.FINISHED_STOPPED
        mgr.free(a)
    blocks, hit = mgr.get_computed_blocks(b)[:2]
    assert mgr.allocate_slots(b, len(prompt) - hit, hit, blocks) is not None
    table_b = mgr.get_block_ids("B")[0]
    mgr.check_invariants()
    return hit, table_a, table_b


prompts = st.lists(st.integers(0, 50_000), min_size=1, max_size=40)


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(
    prompt=prompts,
    kind=st.sampled_from(["salt", "lora", "none_vs_salt", "none_vs_lora"]),
    a_running=st.booleans(),
)
def test_salt_and_lora_never_share_a_block(
    algo: str, prompt: list[int], kind: str, a_running: bool
) -> None:
    hit, table_a, table_b = _run(
        algo, prompt, _identity(kind, 0, prompt), _identity(kind, 1, prompt), a_running
    )
    assert hit == 0, f"{kind}: B hit {hit} tokens of A's cache"
    if a_running:
        assert not set(table_a) & set(table_b), "A and B share a block"
    # the control: the same identity shares every full block but the one of the last token
    same = _identity(kind, 1, prompt)
    hit, table_a, table_b = _run(algo, prompt, same, same, a_running)
    assert hit == (len(prompt) - 1) // BLOCK * BLOCK
    assert table_b[: hit // BLOCK] == table_a[: hit // BLOCK]


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(
    prompt=st.lists(st.integers(0, 50_000), min_size=4, max_size=40),
    data=st.data(),
    a_running=st.booleans(),
)
def test_different_images_never_share_an_image_block(
    algo: str, prompt: list[int], data: st.DataObject, a_running: bool
) -> None:
    offset = data.draw(st.integers(0, len(prompt) - 2), label="offset")
    length = data.draw(st.integers(1, len(prompt) - offset - 1), label="length")
    prompt = list(prompt)
    prompt[offset : offset + length] = [PLACEHOLDER] * length
    kw_a = {"mm_features": [mm_feature("image-a", offset, length)]}
    kw_b = {"mm_features": [mm_feature("image-b", offset, length)]}
    hit, table_a, table_b = _run(algo, prompt, kw_a, kw_b, a_running)
    shareable = offset // BLOCK * BLOCK  # the full blocks before the first image token
    assert hit <= shareable, f"B hit {hit} tokens, past the image at {offset}"
    assert hit == min(shareable, (len(prompt) - 1) // BLOCK * BLOCK)  # the text before it
    if a_running:
        # only the blocks before the image may be shared, and only position by position
        shared = set(table_a) & set(table_b)
        assert shared <= set(table_a[: shareable // BLOCK])
