"""Storage that does not stall a step: ``OmniHiddenStateCache.save_outputs`` moves rows off
the device without blocking and defers the host work; on host tensors the same code path
runs at once.

- ``HiddenStateCache.commit`` + ``write_committed`` (the deferred path's two halves) serve
  exactly what ``write_and_gather`` serves.
- On CPU the host work of a step has run when ``save_outputs`` returns (nothing deferred:
  the runner reuses its output buffers, so rows are read before the call returns).
- ``gpu``-marked (skipped without a CUDA device): rows on the device with pinned host
  storage leave through non-blocking copies on a copy stream, with no synchronizing call
  in ``save_outputs`` (``torch.cuda.set_sync_debug_mode("error")``); the host work waits for
  the step's event when the step is consumed; the runner's buffer overwritten after the
  next ``new_step_starts`` (the compute stream waits for the copies on the device) does not
  change what was saved; same-step and later hits serve the saved rows.

Needs neither vLLM nor vllm-omni (the ``SchedulerOutput``-shaped namespaces of
``tests/omni/test_bad_inputs.py``).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from hscache.hidden_states import HiddenStateCache
from hscache.omni import OmniHiddenStateCache, OmniSettings

from tests.omni.test_bad_inputs import View, rows, sched

BS = 4


def _cache(storage: str) -> tuple[OmniHiddenStateCache, View]:
    view = View()
    cache = OmniHiddenStateCache(
        NS(num_blocks=8, block_size=BS), view, settings=OmniSettings(storage=storage)
    )
    return cache, view


def test_commit_then_write_serves_what_write_and_gather_serves() -> None:
    outs = []
    for split in (False, True):
        c = HiddenStateCache(8, BS, {"h": (3, torch.float32)})
        a = rows(8, 0.0)
        p = c.update_from_scheduler_output(sched(new=(("a", [1, 2], 0, 8),)))
        if split:
            c.write_committed(p, c.commit(p), {"h": a})
        else:
            c.write_and_gather(p, {"h": a})
        b = rows(1, 50.0)
        p = c.update_from_scheduler_output(sched(new=(("b", [1, 2, 3], 8, 1),)))
        r = (
            c.write_committed(p, c.commit(p), {"h": b})
            if split
            else c.write_and_gather(p, {"h": b})
        )
        outs.append(r.rows("b", "h"))
        assert torch.equal(r.rows("b", "h"), torch.cat([a, b]))
    assert torch.equal(outs[0], outs[1])


def test_host_rows_are_kept_before_save_returns() -> None:
    cache, view = _cache("cpu")
    a = rows(8, 0.0)
    so = sched(new=(("a", [1, 2], 0, 8),))
    cache.new_step_starts(so)
    view.order = ["a"]
    buf = a.clone()
    sid = cache.save_outputs(buf, {}, num_tokens_unpadded=8, num_tokens_padded=8)
    assert not cache._jobs, "nothing deferred on host tensors"
    buf.fill_(-1)  # the runner's next forward reuses its buffer
    out = cache.materialize(sid, ["a"])
    assert out.hidden_states is not None and torch.equal(out.hidden_states["a"], a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_rows_leave_without_blocking_the_step() -> None:
    cache, view = _cache("pinned")
    a = rows(8, 0.0).cuda()
    buf = torch.empty_like(a)
    buf.copy_(a)
    so = sched(new=(("a", [1, 2], 0, 8),))
    cache.new_step_starts(so)
    view.order = ["a"]
    # The first saved step builds the storage (allocation): outside the check below.
    sid = cache.save_outputs(buf, {}, num_tokens_unpadded=8, num_tokens_padded=8)
    assert cache.cache is not None and cache.cache.device.type == "cpu"
    assert cache.cache.tensor("__hidden_states__").is_pinned()
    cache.new_step_starts(sched(new=(("b", [1, 2, 3], 8, 1), ("c", [1, 2, 4], 8, 1))))
    buf[:2].copy_(rows(2, 100.0).cuda())  # the next forward, after the device-side wait
    view.order = ["b", "c"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        sid2 = cache.save_outputs(buf, {}, num_tokens_unpadded=2, num_tokens_padded=8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(cache._jobs) == 2, "both steps' host work deferred"
    out = cache.materialize(sid, ["a"])
    assert out.hidden_states is not None
    assert torch.equal(out.hidden_states["a"], a.cpu()), "saved before the buffer changed"
    cache.new_step_starts(sched(cont=(("b", None, 9, 1),)))
    buf[:1].copy_(rows(1, 200.0).cuda())
    out = cache.materialize(sid2, ["b", "c"])
    assert out.hidden_states is not None
    new = rows(2, 100.0)
    assert torch.equal(out.hidden_states["b"], torch.cat([a.cpu(), new[:1]]))
    assert torch.equal(out.hidden_states["c"], torch.cat([a.cpu(), new[1:]]))
    assert not cache._jobs
