"""Every command the README tells a user to type is run by some test, or says why not.

``test_every_readme_command_is_run_somewhere`` reads the README's bash blocks and inline
code spans, keeps what is a command (``python -m ...``, ``bash scripts/...``, ``cargo``,
``pytest``, ``vllm serve``, ...) and requires a row of ``COVERAGE`` for each: the
``scripts/test.sh`` step or the test file that runs it (which must exist), or, for the few
that cannot run in CI (hours long, a GPU, another machine), the reason. A new command in
the README without a row fails here. The cheap commands no other test ran are run below,
in process, at a small size: ``python -m hscache info``, ``python -m hscache soak`` and
``python -m hscache_tools.bench.hashing``; and ``python -m hscache`` without hscache's tools
(``tools/``, not in the wheel) answers ``info`` and says how to get the tools for the rest.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
COMMAND = re.compile(
    r"^(HSCACHE\w*=\S+ )*(python -m |bash scripts/|scripts/|tests/vllm_upstream/run\.sh|"
    r"cargo (test|bench)|pytest |python -m pytest|vllm serve|pip install|source scripts/|curl )"
)

# (regex over the command, where it runs: "step:NAME" of scripts/test.sh, "file:PATH", or
# "not run: why"). First match wins.
COVERAGE: list[tuple[str, str]] = [
    (r"^bash scripts/bench\.sh|^scripts/bench\.sh", "step:bench-smoke"),
    (r"^(bash )?scripts/test\.sh", "file:.ci/run"),
    (r"^(bash )?scripts/e2e\.sh", "step:e2e"),
    (r"^(bash )?scripts/router_e2e\.sh", "step:router-e2e"),
    (r"^(bash )?scripts/omni_e2e\.sh", "step:omni-e2e"),
    (r"^(source )?scripts/vllm032_env\.sh", "step:vllm032-env"),
    (r"^(source )?scripts/vllm030_env\.sh", "step:vllm030-env"),
    (r"^(bash )?scripts/panic_python\.sh", "step:panic-safety"),
    (r"^scripts/fuzz\.sh", "not run: hours of libFuzzer by design; cargo test runs its targets"),
    (r"^(source )?scripts/env\.sh", "file:scripts/test.sh"),
    (r"^tests/vllm_upstream/run\.sh --vllm 0\.32", "step:vllm032-upstream"),
    (r"^tests/vllm_upstream/run\.sh", "step:vllm-upstream"),
    (r"^cargo test --features fault-injection", "step:panic-safety"),
    (r"^cargo test", "step:cargo-test"),
    (r"^cargo bench", "not run: criterion timing runs; clippy --all-targets builds them"),
    (r"^(python -m )?pytest -m gpu", "not run: needs a CUDA device"),
    (r"^(python -m )?pytest", "step:pytest"),
    (r"^python -m hscache bench --hot-decode", "file:tests/bench/test_bench_smoke.py"),
    (r"^python -m hscache bench --retention", "file:tests/retention/test_bench_retention.py"),
    (r"^python -m hscache bench --hidden-states", "file:tests/hidden_states/test_hidden_states.py"),
    (r"^python -m hscache bench\b(?!-)", "file:tests/bench/test_bench_smoke.py"),
    (r"^python -m hscache bench-scheduler --loaded", "file:tests/bench/test_bench_loaded.py"),
    (r"^python -m hscache bench-scheduler", "file:tests/scheduler/test_scheduler_fast_path.py"),
    (r"^python -m hscache bench-engine", "file:tests/bench/test_bench_engine.py"),
    (
        r"^python -m hscache bench-omni-e2e",
        "not run: four vllm-omni engine pairs, ~40 min on 2 cores; measured by hand (docs/omni.md)",
    ),
    (r"^python -m hscache bench-omni", "file:tests/omni/test_bench_omni.py"),
    (r"^python -m hscache soak", "file:tests/harness/test_readme_commands.py"),
    (r"^python -m hscache info", "file:tests/harness/test_readme_commands.py"),
    (r"^python -m hscache_tools\.bench\.hashing", "file:tests/harness/test_readme_commands.py"),
    (r"^python -m vllm_diff", "file:tests/differential/test_differential_vllm.py"),
    (r"^python -m dynamo\.indexer", "step:router-e2e"),
    (r"^curl .*localhost:8090", "step:router-e2e"),
    # e2e: `vllm serve` with and without --scheduler-cls; HSCACHE=1 in the offline engine
    (r"^(HSCACHE=1 )?vllm serve", "step:e2e"),
    (r"^pip install hscache", "step:wheel-smoke"),
    # hscache's tools outside a checkout's environment; the tests import them from tools/
    (r"^pip install \./tools", "file:tests/harness/test_readme_commands.py"),
]


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks and inline code spans, one line each."""
    text = README.read_text()
    found: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        found += [line.split("  #")[0].strip() for line in joined.splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return sorted({c for c in found if COMMAND.match(c)})


def where(command: str) -> str | None:
    for pattern, place in COVERAGE:
        if re.search(pattern, command):
            return place
    return None


def test_every_readme_command_is_run_somewhere() -> None:
    commands = readme_commands()
    assert len(commands) >= 20, commands
    steps = set(
        re.findall(r"^step(?:_after \S+)? (\S+)", (ROOT / "scripts/test.sh").read_text(), re.M)
    )
    missing = [c for c in commands if where(c) is None]
    assert not missing, f"README commands no test runs (add a run and a COVERAGE row): {missing}"
    for c in commands:
        place = where(c)
        assert place is not None
        kind, _, name = place.partition(":")
        if kind == "step":
            assert name in steps, f"{c}: scripts/test.sh has no step {name}"
        elif kind == "file":
            assert (ROOT / name).is_file(), f"{c}: {name} does not exist"
        else:
            assert kind == "not run" and name.strip(), place


def test_info_prints_the_version_and_build_profile(capsys: pytest.CaptureFixture[str]) -> None:
    from hscache.__main__ import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^hscache \d+\.\d+", out, re.M), out
    assert re.search(r"^build profile: \S+", out, re.M) and "unknown" not in out, out
    assert re.search(r"^vllm: \d+\.\d+", out, re.M), out


def test_soak_runs_small(capsys: pytest.CaptureFixture[str]) -> None:
    from hscache.__main__ import main

    assert main(["soak", "--ops", "4000", "--check-every", "1000"]) == 0
    out = capsys.readouterr().out
    assert "4" in out and "invariants" in out.lower(), out


def test_bench_hashing_runs_small(capsys: pytest.CaptureFixture[str]) -> None:
    from hscache_tools.bench.hashing import main

    args = ["--algo", "sha256", "--prompt-len", "256", "--requests", "2", "--repeat", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "sha256" in out and re.search(r"\d+(\.\d+)?x", out), out


def test_tool_commands_without_the_tools_say_how_to_get_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hscache.__main__ as entry

    assert (ROOT / "tools" / "pyproject.toml").is_file()
    assert entry.tools_cli() is not None  # from this checkout
    monkeypatch.setattr(entry, "tools_cli", lambda: None)  # as from the wheel alone
    for command in entry.TOOL_COMMANDS:
        assert entry.main([command, "--quick"]) == 2
        err = capsys.readouterr().err
        assert f"python -m hscache {command}" in err and "source scripts/env.sh" in err, err
        assert "pip install ./tools" in err, err
    assert entry.main(["info"]) == 0
    assert "build profile:" in capsys.readouterr().out
    assert entry.main(["--help"]) == 0
    assert "info" in capsys.readouterr().out
    assert entry.main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err
