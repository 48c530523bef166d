"""One seeded differential trace: :func:`run_trace` builds a :class:`~.pair.Pair` of managers
for a configuration and lets the :class:`~.generator.Generator` drive it.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from .actions import summarize
from .config import TraceConfig, config_for_seed, load_candidate
from .exceptions import KnownVllmException
from .generator import Generator
from .pair import Pair


def run_trace(
    seed: int,
    cfg: TraceConfig | None = None,
    candidate: type | str | None = None,
    *,
    num_ops: int | None = None,
    cand_hasher_factory: Callable | None = None,
) -> dict:
    """Generate and run one trace; raise ``Divergence`` on the first difference.

    Returns a small summary (calls made, actions, feature counters) for coverage checks.
    A documented vLLM crash (:mod:`.exceptions`) ends the trace early; the summary counts
    it as ``vllm_exception:<name>``."""
    if cfg is None:
        cfg = config_for_seed(seed)
    if num_ops is not None:
        cfg = dataclasses.replace(cfg, num_ops=num_ops)
    if candidate is None or isinstance(candidate, str):
        candidate = load_candidate(candidate)
    pair = Pair(cfg, candidate, seed, cand_hasher_factory)
    gen = Generator(pair, random.Random(seed))
    try:
        gen.run()
    except KnownVllmException:
        pass  # vLLM crashed in a documented case: the trace ends here (counted)
    return summarize(pair.actions) | pair.stats | {"calls": pair.ncalls}
