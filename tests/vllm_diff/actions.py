"""The action vocabulary of a differential trace: what actions are, how they read, how they
are counted and saved.

A *trace* is a list of primitive actions (plain JSON-able lists):

* ``["new", spec]``                 create a request (one ``vllm.v1.request.Request`` per side)
* ``["set", rid, attr, value]``     set a request field (``num_computed_tokens``, ``status``, ...)
* ``["append", rid, tokens]``       ``request.append_output_token_ids(tokens)`` (extends hashes)
* ``["call", method, args]``        one manager call (see ``Side._call``)
* ``["session_update", rid, toks, max_tokens]``  Scheduler._update_request_as_session
* ``["rehash", rid]``               ``block_hashes.clear(); update_block_hashes()``

:func:`render_action` prints one as the Python it stands for (repros read like code);
:func:`summarize` counts which features a trace exercised; :func:`dump_repro` /
:func:`load_repro` save and load a trace with its configuration.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from .config import TraceConfig

# Optional request features a trace's "new" action may carry (repro text, coverage).
REQUEST_FEATURES = (
    "mm",
    "lora",
    "salt",
    "logprobs",
    "report_full",
    "session",
    "embeds_seed",
    "resumable",
)


def _short_list(xs: Sequence, n: int = 12) -> str:
    xs = list(xs)
    if len(xs) <= n:
        return repr(xs)
    return f"[{', '.join(map(repr, xs[:n]))}, ... ({len(xs)} items)]"


def render_action(action: list) -> str:
    kind = action[0]
    if kind == "construct":
        return "KVCacheManager(**manager_kwargs(config))"
    if kind == "new":
        s = action[1]
        extras = []
        for key in REQUEST_FEATURES:
            if s.get(key):
                extras.append(f"{key}={s[key]!r}")
        return (
            f"{s['rid']} = Request(prompt={_short_list(s['prompt'], 8)} "
            f"[{len(s['prompt'])} tok], max_tokens={s['max_tokens']}"
            f"{', ' if extras else ''}{', '.join(extras)})"
        )
    if kind == "set":
        return f"{action[1]}.{action[2]} = {action[3]!r}"
    if kind == "append":
        return f"{action[1]}.append_output_token_ids({action[2]!r})"
    if kind == "rehash":
        return f"{action[1]}.block_hashes.clear(); {action[1]}.update_block_hashes()"
    if kind == "session_update":
        return (
            f"scheduler._update_request_as_session({action[1]}, "
            f"prompt_token_ids={action[2]!r}, max_tokens={action[3]})"
        )
    if kind == "call":
        method, a = action[1], dict(action[2])
        rid = a.pop("rid", None)
        args = [rid] if rid is not None else []
        if method == "allocate_slots":
            args.append(a.pop("n"))
            hit = a.pop("hit", "none")
            kw = a.pop("kw", {})
            if hit == "hit":
                kw = {"new_computed_blocks": f"<{rid} lookup result>", **kw}
            elif hit == "empty":
                kw = {"new_computed_blocks": "mgr.empty_kv_cache_blocks", **kw}
            args += [f"{k}={v}" for k, v in kw.items()]
        elif method == "free_popped":
            return f"mgr.block_pool.free_blocks(reversed(<blocks popped for {rid}>))"
        raises = a.pop("expect_raise", None)
        a.pop("key", None)
        args += [f"{k}={v!r}" for k, v in a.items()]
        if method == "usage":
            return "mgr.usage"
        return f"mgr.{method}({', '.join(map(str, args))})" + ("  # must raise" if raises else "")
    return repr(action)


def rid_of(action: list) -> str | None:
    if action[0] == "new":
        return action[1]["rid"]
    if action[0] in ("set", "append", "rehash", "session_update"):
        return action[1]
    return action[2].get("rid")


def format_actions(actions: Sequence[list]) -> str:
    return "\n".join(f"  {render_action(a)}" for a in actions)


def summarize(actions: Sequence[list]) -> dict:
    """Feature counters of a trace (which paths it exercised)."""
    c: dict[str, int] = {}

    def bump(k: str) -> None:
        c[k] = c.get(k, 0) + 1

    for a in actions:
        if a[0] == "new":
            s = a[1]
            bump("requests")
            for k in REQUEST_FEATURES:
                if s.get(k):
                    bump(f"req_{k}")
        elif a[0] == "call":
            bump(a[1])
            kw = a[2].get("kw", {})
            if a[1] == "allocate_slots":
                if kw.get("num_external_computed_tokens"):
                    bump("alloc_external")
                if kw.get("delay_cache_blocks"):
                    bump("alloc_delayed")
                if a[2].get("hit") == "empty":
                    bump("alloc_after_remote")
        elif a[0] == "set" and a[2] == "status":
            bump(f"status_{a[3]}")
        elif a[0] == "set" and a[2] == "num_output_placeholders" and a[3]:
            bump("async_placeholder")
        elif a[0] in ("session_update", "rehash"):
            bump(a[0])
    return c


def dump_repro(path: str, cfg: TraceConfig, actions: Sequence[list]) -> None:
    with open(path, "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "actions": list(actions)}, f)


def load_repro(path: str) -> tuple[TraceConfig, list[list]]:
    with open(path) as f:
        data = json.load(f)
    return TraceConfig(**data["config"]), data["actions"]
