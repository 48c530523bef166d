"""``hscache._core.StepUpdate`` (``src/python/step_update.rs``) on the paths the fast-path
differential (``test_scheduler_fast_path.py``) does not choose between: a request class
that defines a read field as a property (read with ``getattr``, not the instance dict),
the calls it skips (hscache's hasher where no block completes, ``take_events`` without
events), and the output struct built without keywords."""

from __future__ import annotations

from typing import Any

import pytest
import vllm  # noqa: F401 (a hard requirement: a broken install fails, never skips)
from hscache.vllm.step import update as step_update
from hscache_tools.testing.requests import init_none_hash, make_request, request_block_hasher
from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput
from vllm.v1.request import Request, RequestStatus

pytestmark = pytest.mark.vllm

BLOCK = 16


class PropertyRequest(Request):
    """A ``Request`` whose ``max_tokens`` is a property (vLLM's own class has a plain
    attribute): the call must read it with ``getattr``, never the instance dict."""

    @property
    def max_tokens(self) -> int:
        return self._max

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        self._max = value


class CountingHasher:
    """vLLM's hasher, counting its calls; with ``window`` it claims hscache's
    ``hscache_hash_window`` (so the call may skip it where no block completes)."""

    def __init__(self, window: bool) -> None:
        self.inner = request_block_hasher(BLOCK, "sha256")
        self.calls = 0
        if window:
            self.hscache_hash_window = (BLOCK, 0)

    def __call__(self, request: Request) -> list[Any]:
        self.calls += 1
        return self.inner(request)


def _running(rid: str, hasher: Any, cls: type = Request, max_tokens: int = 1000) -> Request:
    r = make_request(rid, list(range(100, 120)), max_tokens=max_tokens, block_hasher=hasher)
    if cls is not Request:
        r.__class__ = cls
        r.max_tokens = max_tokens
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = r.num_tokens
    r.prefill_stats = None
    return r


def _step(requests: dict[str, Request], token: int) -> Any:
    for r in requests.values():
        r.num_in_flight_tokens = 1
    ids = list(requests)
    return step_update._STEP_UPDATE.split(
        requests,
        dict.fromkeys(ids, 1),
        [[token] for _ in ids],
        {rid: i for i, rid in enumerate(ids)},
        drafts={},
        prompt_logprobs=({}, {}),
        has_logprobs=False,
        max_model_len=4096,
        is_async=False,
    )


def test_a_property_field_is_read_with_getattr() -> None:
    init_none_hash("sha256")
    hasher = request_block_hasher(BLOCK, "sha256")
    plain = {"p": _running("p", hasher, max_tokens=3)}
    prop = {"q": _running("q", hasher, cls=PropertyRequest, max_tokens=3)}
    # A stale instance-dict entry under the property: getattr (the property) wins.
    vars(prop["q"])["max_tokens"] = 10**9
    assert prop["q"].max_tokens == 3
    for token in (7, 8):
        a, b = _step(plain, token), _step(prop, token)
        assert a is not None and b is not None
    # The third token reaches max_tokens (3): vLLM's to serve on both.
    a, b = _step(plain, 9), _step(prop, 9)
    assert a is None and b is None
    assert plain["p"]._output_token_ids == prop["q"]._output_token_ids == [7, 8]


@pytest.mark.parametrize("window", [False, True], ids=["vllm-hasher", "hscache-window"])
def test_the_hasher_is_skipped_only_where_no_block_completes(window: bool) -> None:
    init_none_hash("sha256")
    hasher = CountingHasher(window)
    reference = request_block_hasher(BLOCK, "sha256")
    requests = {"r": _running("r", hasher)}
    hasher.calls = 0  # the prompt's block was hashed at construction
    twin = make_request("t", list(range(100, 120)), block_hasher=reference)
    steps = 40
    for k in range(steps):
        assert _step(requests, 1000 + k) is not None
        twin.append_output_token_ids(1000 + k)
    r = requests["r"]
    assert r.block_hashes == twin.block_hashes and len(r.block_hashes) == 3
    # 20 prompt tokens + 40: blocks complete at 32 and 48 tokens.
    assert hasher.calls == (2 if window else steps)


def test_outputs_carry_events_and_fields_as_the_keyword_call_would() -> None:
    init_none_hash("sha256")
    hasher = request_block_hasher(BLOCK, "sha256")
    requests = {"a": _running("a", hasher), "b": _running("b", hasher)}
    event = EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED)
    requests["b"].events.append(event)
    requests["b"].stop_reason = "x"  # not the default: set on the struct
    requests["b"].num_nans_in_logits = 2
    split = _step(requests, 7)
    assert split is not None
    built, rest = split
    assert rest == {}
    for rid, r in requests.items():
        expected = EngineCoreOutput(
            request_id=rid,
            new_token_ids=[7],
            stop_reason="x" if rid == "b" else None,
            events=[event] if rid == "b" else None,
            trace_headers=None,
            num_nans_in_logits=2 if rid == "b" else 0,
        )
        assert built[rid] == expected
        assert r.events == []
