"""`asyncrl train [CONFIG.toml] [--section.key value ...]`, `asyncrl warmstart`, `asyncrl report RUN_DIR`."""
from __future__ import annotations

import argparse
import sys

from asyncrl.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="run a training job: train [CONFIG.toml] [--section.key value ...]")
    sub.add_parser("warmstart", help="build the default tiny policy: warmstart [CONFIG.toml] [--section.key value ...]")
    p_report = sub.add_parser("report", help="(re)write the report of a run directory")
    p_report.add_argument("run_dir")
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parser.parse_known_args(argv[:1] + (argv[1:2] if argv[:1] == ["report"] else []))
    rest = argv[2:] if args.command == "report" else argv[1:]
    args.config = rest.pop(0) if rest and not rest[0].startswith("--") else None
    overrides = rest
    try:
        if args.command == "report":
            from asyncrl.report import write_report, table

            print(table(write_report(args.run_dir)))
            return 0
        cfg = load_config(args.config, overrides)
        if args.command == "warmstart":
            from asyncrl.warmstart import warmstart

            warmstart(cfg)
            return 0
        from asyncrl.launcher import RunError, train

        try:
            train(cfg)
        except RunError as e:
            print(f"\nasyncrl: run failed: {e}", file=sys.stderr)
            return 1
        return 0
    except (ConfigError, FileNotFoundError) as e:
        print(f"asyncrl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
