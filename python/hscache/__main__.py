"""``python -m hscache``: ``info`` here, every other sub-command in hscache's tools.

``info`` prints the installed version and the build profile of the compiled core
(:func:`hscache.observability.print_build_info`). The
benchmarks and the soak test (``bench``, ``bench-scheduler``, ``bench-omni``,
``bench-omni-e2e``, ``bench-engine``, ``soak``) are not part of the wheel: they live in the
repository's ``tools/`` folder (the ``hscache_tools`` package, :mod:`hscache_tools.cli`),
which this module hands the command to. It finds ``hscache_tools`` where it is importable
(``scripts/env.sh`` puts ``tools/`` on ``PYTHONPATH``; ``pip install ./tools`` installs it)
or, when hscache itself is imported from a checkout, in that checkout's ``tools/``; without
it, it says how to get it and exits with status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from hscache.observability import print_build_info

TOOL_COMMANDS = (
    "bench",
    "bench-scheduler",
    "bench-omni",
    "bench-omni-e2e",
    "bench-engine",
    "soak",
)
"""The sub-commands :mod:`hscache_tools.cli` answers."""

_MISSING = (
    "python -m hscache {command}: the benchmarks and the soak test are hscache's tools, not "
    "part of the installed package. Run them from a checkout of hscache's repository: "
    "`source scripts/env.sh` there (or `pip install ./tools` into this environment), then "
    "`python -m hscache {command} ...`."
)


def tools_cli() -> ModuleType | None:
    """:mod:`hscache_tools.cli`, or None where hscache's tools are not to be found."""
    try:
        import hscache_tools.cli as cli
    except ModuleNotFoundError as exc:
        if exc.name not in ("hscache_tools", "hscache_tools.cli"):
            raise
    else:
        return cli
    # hscache imported from a checkout (python/hscache/): its tools are in ../../tools.
    checkout_tools = Path(__file__).resolve().parents[2] / "tools"
    if not (checkout_tools / "hscache_tools" / "cli.py").is_file():
        return None
    sys.path.insert(0, str(checkout_tools))
    import hscache_tools.cli as cli

    return cli


def _usage() -> str:
    return (
        "usage: python -m hscache {info," + ",".join(TOOL_COMMANDS) + "} ...\n\n"
        "  info    print the version and build profile\n\n" + _MISSING.format(command="<command>")
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["info"]:
        return print_build_info()
    cli = tools_cli()
    if cli is not None:
        result: int = cli.main(args)
        return result
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in TOOL_COMMANDS:
        print(_MISSING.format(command=args[0]), file=sys.stderr)
        return 2
    print(f"{_usage()}\n\npython -m hscache: unknown command {args[0]!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
