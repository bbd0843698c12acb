"""The `geoattn` command: quickstart | train | eval | sample | bench | data."""

from __future__ import annotations

import argparse
import importlib
import sys

from geoattn.bench import BENCHMARKS


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit code 2."""


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure kernels against their peers (medians, ratios)")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, module in BENCHMARKS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            continue
        p = kinds.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geoattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, FileNotFoundError) as err:
        print(f"geoattn {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("geoattn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
