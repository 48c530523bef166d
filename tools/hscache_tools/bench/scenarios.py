"""Benchmark scenarios for ``python -m hscache bench``: workload shapes and seeded traces.

Owns the :class:`Scenario` description (running-set size, prompt and output lengths, shared
system prompts, pool size, token budget, step counts), the embedded default and ``--quick``
scenario sets, and :func:`make_trace`, which turns a scenario and a seed into a deterministic
list of :class:`RequestSpec` (prompt token ids and the output tokens the "model" will emit).
Nothing here touches a KV-cache manager.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

__all__ = [
    "DEFAULT_SCENARIOS",
    "QUICK_SCENARIOS",
    "RequestSpec",
    "Scenario",
    "all_scenarios",
    "find_scenario",
    "make_trace",
]

VOCAB_SIZE = 32_000


@dataclass(frozen=True)
class Scenario:
    """One benchmark workload: a steady stream of requests through one KV-cache pool."""

    name: str
    description: str
    max_running: int
    """Most requests running at once (vLLM's ``max_num_seqs``)."""
    num_blocks: int
    """Blocks in the pool, the null block included."""
    prompt_len: tuple[int, int]
    """Prompt length range in tokens (uniform, inclusive), shared prefix included."""
    output_len: tuple[int, int]
    """Output length range in tokens (uniform, inclusive) for requests after the first wave."""
    num_prefixes: int
    """Distinct shared system prompts."""
    prefix_len: tuple[int, int]
    """System prompt length range in tokens."""
    prefix_share: float
    """Fraction of requests that start with one of the shared system prompts."""
    repeat_share: float = 0.0
    """Fraction of requests whose whole prompt repeats an earlier prompt (full prefix hits)."""
    token_budget: int = 8192
    """Tokens scheduled per step (vLLM's ``max_num_batched_tokens``); prefills are chunked."""
    block_size: int = 16
    max_model_len: int = 32_768
    warmup_steps: int = 100
    """Steps run (and checked) before measuring starts; excluded from the statistics."""
    steps: int = 200
    """Measured steps."""
    kv_events: bool = True
    """Construct the managers with ``enable_kv_cache_events`` (``take_events`` every step)."""
    candidate_events: str = "vllm"
    """The candidate's KV events when ``kv_events`` is on: ``"vllm"`` (vLLM's stream, as the
    reference), ``"compact"`` (built under ``HSCACHE_KV_EVENTS=compact``) or ``"off"``
    (built without events; the reference keeps them)."""
    layout: str = "full"
    """The KV-cache layout (:data:`hscache_tools.bench.layouts.LAYOUTS`). Hybrid layouts run on
    vLLM's real Scheduler (:mod:`hscache_tools.bench.real_scheduler`), drop-in path only."""
    tags: tuple[str, ...] = field(default=())

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    def with_steps(self, steps: int | None, warmup: int | None = None) -> Scenario:
        """A copy with the measured (and optionally warm-up) step counts replaced."""
        return replace(
            self,
            steps=self.steps if steps is None else steps,
            warmup_steps=self.warmup_steps if warmup is None else warmup,
        )

    def estimated_requests(self) -> int:
        """Upper estimate of how many requests the run admits (first wave + refills)."""
        lo, hi = self.output_len
        mean_out = max(1.0, (lo + hi) / 2)
        refills = self.total_steps * self.max_running / mean_out
        return int(self.max_running + 1.3 * refills + 32)


@dataclass(frozen=True)
class RequestSpec:
    """A request of the trace: what both managers' ``Request`` objects are built from."""

    request_id: str
    prompt: list[int]
    output: list[int]
    """The tokens the emulated model emits, one per decode step; its length is max_tokens."""


# The two prompt shapes the scenarios share: ~1k-token prompts behind 256-512-token system
# prompts, and ~8k-token prompts behind 1-3k-token ones. A scenario is a shape plus a running
# set, a pool, output lengths and step counts (`dataclasses.replace`).
_PROMPTS_1K = Scenario(
    name="",
    description="",
    max_running=0,
    num_blocks=0,
    prompt_len=(768, 1_280),
    output_len=(0, 0),
    num_prefixes=8,
    prefix_len=(256, 512),
    prefix_share=0.9,
    repeat_share=0.05,
)
_PROMPTS_8K = replace(
    _PROMPTS_1K,
    prompt_len=(6_144, 10_240),
    num_prefixes=4,
    prefix_len=(1_024, 3_072),
    prefix_share=0.8,
)

# Running-set sizes 64 / 256 / 512 / 1024, ~1k and ~8k prompts with shared system prompts,
# chunked prefill under an 8192-token budget, roomy pools (>= 64k blocks) and two under pressure
# (preemptions, evictions, failed admissions). Step counts keep the default run to ~2-3 minutes.
DEFAULT_SCENARIOS: tuple[Scenario, ...] = (
    replace(
        _PROMPTS_8K,
        name="r64-p8k",
        description="64 running, ~8k-token prompts, 4 shared 1-3k system prompts, 64k pool",
        max_running=64,
        num_blocks=65_536,
        output_len=(64, 512),
        warmup_steps=60,
        steps=1_000,
        tags=("roomy",),
    ),
    replace(
        _PROMPTS_1K,
        name="r256-p1k",
        description="256 running, ~1k-token prompts, 8 shared system prompts, 64k pool",
        max_running=256,
        num_blocks=65_536,
        output_len=(32, 512),
        warmup_steps=60,
        steps=1_000,
        tags=("roomy",),
    ),
    replace(
        _PROMPTS_1K,
        name="r1024-p1k",
        description="1024 running, ~1k-token prompts, 8 shared system prompts, 128k pool",
        max_running=1024,
        num_blocks=131_072,
        output_len=(64, 768),
        warmup_steps=140,
        steps=500,
        tags=("roomy",),
    ),
    replace(
        _PROMPTS_1K,
        name="r512-p1k-pressure",
        description="up to 512 running, ~1k-token prompts, 16k-block pool: preemptions, evictions",
        max_running=512,
        num_blocks=16_384,
        output_len=(256, 1_024),
        warmup_steps=60,
        steps=1_000,
        tags=("pressure",),
    ),
    replace(
        _PROMPTS_8K,
        name="r256-p8k-pressure",
        description="up to 256 running, ~8k-token prompts, 64k pool full: failed admissions",
        max_running=256,
        num_blocks=65_536,
        output_len=(256, 2_048),
        warmup_steps=100,
        steps=600,
        tags=("pressure",),
    ),
    # Hybrid layouts, on vLLM's real Scheduler (see Scenario.layout).
    replace(
        _PROMPTS_1K,
        name="r256-p1k-swa",
        description="256 running, ~1k-token prompts, full attention + 128-token sliding window",
        max_running=256,
        num_blocks=65_536,
        output_len=(32, 512),
        warmup_steps=60,
        steps=500,
        layout="full+swa",
        tags=("roomy", "hybrid"),
    ),
    replace(
        _PROMPTS_1K,
        name="r256-p1k-mamba",
        description="256 running, ~1k-token prompts, full attention + Mamba 'align' (64-token "
        "blocks)",
        max_running=256,
        num_blocks=65_536,
        output_len=(32, 512),
        warmup_steps=60,
        steps=500,
        layout="full+mamba",
        tags=("roomy", "hybrid"),
    ),
)

# Small versions of the same shapes for a ~20 s smoke run.
QUICK_SCENARIOS: tuple[Scenario, ...] = (
    replace(
        _PROMPTS_1K,
        name="quick-r64-p1k",
        description="64 running, ~1k-token prompts, shared system prompts, roomy pool",
        max_running=64,
        num_blocks=16_384,
        output_len=(16, 128),
        num_prefixes=4,
        warmup_steps=15,
        steps=100,
        tags=("roomy", "quick"),
    ),
    replace(
        _PROMPTS_1K,
        name="quick-r128-pressure",
        description="up to 128 running, ~1k-token prompts, 2k-block pool under pressure",
        max_running=128,
        num_blocks=2_048,
        output_len=(128, 512),
        num_prefixes=4,
        warmup_steps=20,
        steps=100,
        tags=("pressure", "quick"),
    ),
    replace(
        _PROMPTS_1K,
        name="quick-r64-mamba",
        description="64 running, ~1k-token prompts, full attention + Mamba 'align'",
        max_running=64,
        num_blocks=16_384,
        output_len=(16, 128),
        num_prefixes=4,
        warmup_steps=15,
        steps=60,
        layout="full+mamba",
        tags=("roomy", "quick", "hybrid"),
    ),
)

# A few steps on a tiny pool, for the pytest smoke test: admissions, hits, preemptions, finishes.
TINY_SCENARIO = Scenario(
    name="tiny",
    description="16 running, short prompts, 96-block pool (preemptions and evictions)",
    max_running=16,
    num_blocks=96,
    prompt_len=(40, 200),
    output_len=(4, 40),
    num_prefixes=3,
    prefix_len=(16, 64),
    prefix_share=0.8,
    repeat_share=0.1,
    token_budget=256,
    block_size=16,
    max_model_len=1_024,
    warmup_steps=5,
    steps=60,
    tags=("test",),
)


def all_scenarios() -> tuple[Scenario, ...]:
    """Every embedded scenario (default, quick, tiny)."""
    return (*DEFAULT_SCENARIOS, *QUICK_SCENARIOS, TINY_SCENARIO)


def find_scenario(name: str) -> Scenario:
    """The embedded scenario called ``name``; ``KeyError`` listing the names otherwise."""
    for scenario in all_scenarios():
        if scenario.name == name:
            return scenario
    names = ", ".join(s.name for s in all_scenarios())
    raise KeyError(f"unknown scenario {name!r}; known: {names}")


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


class TraceGenerator:
    """Deterministic, resumable request stream for one scenario and seed.

    The first ``max_running`` requests (the first wave) get output lengths spread over
    ``[1, 2 * mean]`` so that finishes (and therefore admissions) start early and are spread
    evenly, which brings the run to its steady state quickly.
    """

    def __init__(self, scenario: Scenario, seed: int) -> None:
        self.scenario = scenario
        self._rng = random.Random(f"{scenario.name}:{seed}")
        self._count = 0
        self._prefixes = [
            _random_tokens(self._rng, self._rng.randint(*scenario.prefix_len))
            for _ in range(scenario.num_prefixes)
        ]
        # Zipf-like popularity: system prompt k is chosen with weight 1 / (k + 1).
        self._prefix_weights = [1.0 / (k + 1) for k in range(scenario.num_prefixes)]
        self._history: list[list[int]] = []

    def _prompt(self) -> list[int]:
        sc, rng = self.scenario, self._rng
        if self._history and rng.random() < sc.repeat_share:
            return list(rng.choice(self._history))
        length = rng.randint(*sc.prompt_len)
        prompt: list[int] = []
        if self._prefixes and rng.random() < sc.prefix_share:
            prefix = rng.choices(self._prefixes, weights=self._prefix_weights)[0]
            prompt.extend(prefix[:length])
        prompt.extend(_random_tokens(rng, length - len(prompt)))
        if len(self._history) < 256:
            self._history.append(prompt)
        else:
            self._history[rng.randrange(len(self._history))] = prompt
        return prompt

    def _output_len(self, prompt_len: int) -> int:
        sc, rng = self.scenario, self._rng
        lo, hi = sc.output_len
        if self._count < sc.max_running:
            n = rng.randint(1, lo + hi)
        else:
            n = rng.randint(lo, hi)
        return max(1, min(n, sc.max_model_len - prompt_len - 1))

    def next(self) -> RequestSpec:
        prompt = self._prompt()
        output = _random_tokens(self._rng, self._output_len(len(prompt)))
        spec = RequestSpec(f"{self.scenario.name}-{self._count}", prompt, output)
        self._count += 1
        return spec

    def take(self, n: int) -> list[RequestSpec]:
        return [self.next() for _ in range(n)]


def make_trace(scenario: Scenario, seed: int, num_requests: int | None = None) -> list[RequestSpec]:
    """The first ``num_requests`` (default: the scenario's estimate) requests of the trace."""
    n = scenario.estimated_requests() if num_requests is None else num_requests
    return TraceGenerator(scenario, seed).take(n)
