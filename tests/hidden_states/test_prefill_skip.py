"""``hscache.hidden_states.prefill_skip`` against vLLM 0.33's fast-prefill metadata builder.

vLLM's ``make_kv_sharing_fast_prefill_common_attn_metadata`` is the reference.

Randomized batches (chunked prefill, partial chunks, decode, spec-decode drafts, CUDA-graph
padding of requests and of logits indices), 10 000 cases: the logits indices vLLM's runner
would compute for the batch (written here from the runner's rule: the last ``1 + drafts``
tokens of every sampling request, padded with the last one) arm the batch metadata, vLLM's
function builds the skip layers' metadata on CPU tensors, and hscache's host-side result
must equal it field by field. With every request sampling the inputs are vLLM's own; with
partial prefill chunks not sampling, vLLM's function gets the same reduced index set.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest
import torch
from hscache.exceptions import InvalidArgumentError
from hscache.hidden_states.prefill_skip import arm, prefill_skip, skip_layer_metadata

pytestmark = pytest.mark.vllm

CASES_PER_SEED = 1000
SEEDS = 10


def random_batch(rng: random.Random) -> dict[str, Any]:
    """One batch: per request its scheduled tokens, drafts and whether it samples."""
    n = rng.randint(1, 12)
    spec_mode = rng.random() < 0.4
    all_sample = rng.random() < 0.5
    decode_only = rng.random() < 0.15
    sched, spec, samples = [], [], []
    for _ in range(n):
        kind = "decode" if decode_only else rng.choice(["decode", "prefill", "chunk"])
        if kind == "decode":
            d = rng.randint(0, 3) if spec_mode and not decode_only else 0
            sched.append(1 + d)
            spec.append(d)
            samples.append(True)
        else:
            sched.append(rng.choice([1, 2, rng.randint(1, 40), rng.randint(1, 300)]))
            spec.append(0)
            samples.append(kind == "prefill" or all_sample)
    return {
        "sched": sched,
        "spec": spec,
        "samples": samples,
        "num_reqs_padded": n + rng.choice([0, 0, 1, rng.randint(1, 5)]),
        "pad_logits": rng.choice([0, 0, 1, rng.randint(1, 16)]),
    }


def runner_logits_indices(b: dict[str, Any]) -> tuple[list[int], int]:
    """vLLM's runner's rule: the last ``1 + drafts`` tokens of each sampling request."""
    out, start, max_sampled = [], 0, 0
    for s, d, smp in zip(b["sched"], b["spec"], b["samples"], strict=True):
        if smp:
            out += list(range(start + s - 1 - d, start + s))
            max_sampled = max(max_sampled, d + 1)
        start += s
    return out, max_sampled


def batch_metadata(b: dict[str, Any], rng: random.Random) -> Any:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n, rp = len(b["sched"]), b["num_reqs_padded"]
    qsl = np.zeros(rp + 1, dtype=np.int32)
    qsl[1 : n + 1] = np.cumsum(b["sched"])
    qsl[n + 1 :] = qsl[n]
    seq_lens = torch.tensor([rng.randint(s, s + 500) for s in b["sched"]] + [0] * (rp - n))
    total = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.copy()),
        query_start_loc_cpu=torch.from_numpy(qsl.copy()),
        seq_lens=seq_lens.to(torch.int32),
        num_reqs=rp,
        num_actual_tokens=total + rng.choice([0, 3]),
        max_query_len=max(b["sched"]),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros((rp, 4), dtype=torch.int32),
        slot_mapping=torch.arange(total, dtype=torch.int64),
        causal=True,
        seq_lens_cpu_upper_bound=seq_lens.to(torch.int32),
    )


def assert_same_metadata(ours: Any, want: Any, where: str) -> None:
    for f in dataclasses.fields(want):
        a, b = getattr(ours, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), (where, f.name)
            assert a.dtype == b.dtype and torch.equal(a, b), (where, f.name, a, b)
        else:
            assert a == b if not isinstance(b, np.ndarray) else np.array_equal(a, b), (
                where,
                f.name,
                a,
                b,
            )


@pytest.mark.parametrize("seed", range(SEEDS))
def test_equals_vllm_field_by_field(seed: int) -> None:
    from vllm.v1.attention.backends.utils import (
        make_kv_sharing_fast_prefill_common_attn_metadata as vllm_reduce,
    )

    rng = random.Random(seed)
    reduced = 0
    for case in range(CASES_PER_SEED):
        b = random_batch(rng)
        where = f"seed {seed} case {case}: {b}"
        indices, max_sampled = runner_logits_indices(b)
        padded = max(b["pad_logits"], len(indices))
        cm = batch_metadata(b, rng)
        skip = prefill_skip(
            np.array(b["sched"]) if case % 2 else b["sched"],
            b["spec"],
            np.array(b["samples"]) if case % 3 == 0 else b["samples"],
            num_reqs_padded=b["num_reqs_padded"],
            num_logits_padded=b["pad_logits"],
            query_start_loc=cm.query_start_loc_cpu.numpy(),
        )
        # vLLM's runner arms the batch with the padded indices (last one repeated).
        want_padded = indices + [indices[-1] if indices else 0] * (padded - len(indices))
        if skip.reduced:
            assert skip.logits_indices.tolist() == indices, where
            assert skip.max_query_len == max_sampled, where
        else:
            assert max(b["sched"]) == 1, where
        armed_vllm = cm.replace(
            logits_indices_padded=torch.tensor(want_padded, dtype=torch.int32),
            num_logits_indices=len(indices),
            max_logits_per_req=max_sampled,
        )
        if skip.reduced:
            armed_ours = arm(cm, skip)
            assert armed_ours.logits_indices_padded.tolist() == want_padded, where
            assert armed_ours.num_logits_indices == len(indices), where
            assert armed_ours.max_logits_per_req == max_sampled, where
            want = vllm_reduce(armed_vllm)
            ours = skip_layer_metadata(armed_ours, skip)
            assert_same_metadata(ours, want, where)
            reduced += 1
            kept = set(indices)
        else:
            # Pure decode: vLLM returns the batch's own metadata, and so does hscache.
            assert vllm_reduce(armed_vllm) is armed_vllm
            assert skip_layer_metadata(armed_vllm, skip) is armed_vllm
            kept = set(range(sum(b["sched"])))
        assert skip.computed.tolist() == [t in kept for t in range(sum(b["sched"]))], where
        starts = np.cumsum([0, *b["sched"]])
        for i, k in enumerate(skip.num_kept.tolist()):
            assert all(t in kept for t in range(starts[i + 1] - k, starts[i + 1])), where
    assert reduced > CASES_PER_SEED // 2


def test_bad_batches_raise() -> None:
    for args, kwargs in [
        (([3, 0],), {}),
        (([3, 2], [3, 0]), {}),
        (([3, 2], [1, 0], [False, True]), {}),
        (([3, 2],), {"num_reqs_padded": 1}),
        (([3, 2],), {"query_start_loc": [0, 3, 4]}),
        (([-1],), {}),
    ]:
        with pytest.raises(InvalidArgumentError):
            prefill_skip(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_copies_come_from_one_transfer() -> None:
    skip = prefill_skip(
        [15, 5, 3], [0, 0, 2], num_reqs_padded=4, num_logits_padded=8, device="cuda"
    )
    assert skip.query_start_loc.is_cuda and skip.logits_indices_padded.is_cuda
    # Both device tensors are views of one buffer (one H2D copy).
    assert skip.query_start_loc.untyped_storage().data_ptr() == (
        skip.logits_indices_padded.untyped_storage().data_ptr()
    )
    assert (
        skip.query_start_loc.cpu().tolist() == skip.query_start_loc_cpu.tolist() == [0, 1, 2, 5, 5]
    )
    assert skip.logits_indices_padded.cpu().tolist() == [14, 19, 20, 21, 22, 22, 22, 22]
