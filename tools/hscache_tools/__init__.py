"""hscache's tools: benchmarks, the soak test and test fixtures, kept out of the wheel.

Lives in the repository beside the product (``tools/``, not ``python/``), so the wheel that
users install holds only ``hscache``. ``scripts/env.sh`` puts ``tools/`` on ``PYTHONPATH``
(the test and benchmark environment), pytest does for the tests (``pyproject.toml``), and
``python -m hscache`` finds it from a checkout (``hscache/__main__.py``); elsewhere
``pip install ./tools`` installs it (``tools/pyproject.toml``, no dependencies of its own:
the benchmarks need the ``vllm`` extra).

- :mod:`.cli` — the sub-commands ``python -m hscache`` hands over: ``bench``,
  ``bench-scheduler``, ``bench-omni``, ``bench-omni-e2e``, ``bench-engine``, ``soak``;
- :mod:`.bench` — the benchmarks (the side-by-side manager benchmark, the scheduler-level
  ones, the omni and engine ones, block hashing in :mod:`.bench.hashing`, the hidden-state
  cache in :mod:`.bench.hidden_states`);
- :mod:`.soak` — the soak test;
- :mod:`.testing` — vLLM objects built the way vLLM's engine builds them, shared by the
  tests, the differential suite and the benchmarks.
"""
