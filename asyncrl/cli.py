"""asyncrl's command line.

    asyncrl train [CONFIG.toml] [--section.key value ...]     a new run
    asyncrl train --resume runs/NAME [--force] [--section.key value ...]
                                                             continue a stopped run in its directory
    asyncrl warmstart [CONFIG.toml] [--section.key value ...] build the tiny default policy
    asyncrl report RUN_DIR                                   (re)write a run's plots and table
    asyncrl export RUN_DIR OUT_DIR [--step N]                a checkpoint as a plain HF model directory
    asyncrl ctl RUN_DIR status | set KEY VALUE | eval | checkpoint | stop | dashboard
                                                             steer a running job (docs/control.md)
    asyncrl worker --join URL --token T [--dir DIR] [--device cpu] [--threads N] [--max-bytes-per-second B]
                                                             an inference worker joining a run from here
                                                             (docs/untrusted.md)
    asyncrl plan --calibrate RUN_DIR | [CONFIG.toml] --rates RATES.json [--devices N] ...
                                                             predict a layout's run (docs/planner.md)
"""
from __future__ import annotations

import os
import sys

from asyncrl.config import ConfigError, load_config
from asyncrl.rundir import RunDir


def _take(args: list[str], flag: str, has_value: bool) -> str | bool | None:
    """Remove `flag` (and its value, `--flag v` or `--flag=v`) from args; its value, True, or None when
    absent."""
    for i, arg in enumerate(args):
        if has_value and arg.startswith(flag + "="):
            del args[i]
            return arg.split("=", 1)[1]
        if arg == flag:
            del args[i]
            if not has_value:
                return True
            if i == len(args):
                raise ConfigError(f"{flag} needs a value")
            return args.pop(i)
    return None


def main(argv: list[str] | None = None) -> int:
    """The exit code: 0 done, 1 the run failed, 2 bad input (or an unforeseen error, said in one line
    with its traceback in a log file), 130/143 stopped by Ctrl-C/SIGTERM (the run can be resumed)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\nasyncrl: interrupted; a started run's directory is intact: asyncrl train --resume <run dir> "
              "continues it", file=sys.stderr)
        return 130
    except Exception as e:
        log = _save_traceback()
        message = " ".join(str(e).split())[:300]
        print(f"asyncrl: unexpected {type(e).__name__}: {message} (traceback: {log})", file=sys.stderr)
        return 2


def _save_traceback() -> str:
    import tempfile
    import time
    import traceback

    path = f"{tempfile.gettempdir()}/asyncrl-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    with open(path, "w") as f:
        f.write(f"asyncrl {' '.join(sys.argv[1:])}\n\n{traceback.format_exc()}")
    return path


def _main(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = ("train", "warmstart", "report", "export", "ctl", "plan", "worker")
    if not args or args[0] not in commands or args[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr if args and args[0] not in ("-h", "--help") else sys.stdout)
        return 0 if args and args[0] in ("-h", "--help") else 2
    command, rest = args[0], args[1:]
    try:
        if command == "report":
            from asyncrl.observe.report import table, write_report

            if len(rest) != 1:
                raise ConfigError("usage: asyncrl report RUN_DIR")
            if not (RunDir(rest[0]).metrics).exists():
                raise ConfigError(f"{rest[0]} is not a run directory with metrics (no metrics.jsonl)")
            print(table(write_report(rest[0])))
            return 0
        if command == "plan":
            from asyncrl.plan.cli import main as plan

            return plan(rest, _take)
        if command == "worker":
            from asyncrl.swarm.join import main as worker

            return worker(rest, _take)
        if command == "ctl":
            from asyncrl.control import ctl

            return ctl.main(rest)
        if command == "export":
            from asyncrl.store.checkpoint import export

            step = _take(rest, "--step", True)
            if len(rest) != 2:
                raise ConfigError("usage: asyncrl export RUN_DIR OUT_DIR [--step N]")
            if step is not None and not step.isdigit():
                raise ConfigError(f"--step must be a checkpoint's step number, got {step!r}")
            try:
                out = export(rest[0], rest[1], int(step) if step is not None else None)
            except ValueError as e:  # a corrupt checkpoint
                raise ConfigError(str(e)) from None
            print(f"exported to {out}")
            return 0
        resume_dir = _take(rest, "--resume", True) if command == "train" else None
        force = bool(_take(rest, "--force", False))
        config_path = rest.pop(0) if rest and not rest[0].startswith("--") else None
        from asyncrl.run.launcher import RunError, Stopped, resume, train

        try:
            if resume_dir is not None:
                resume(resume_dir, rest, force=force)
                return 0
            cfg = load_config(config_path, rest)
            if command == "warmstart":
                from asyncrl.policy.warmstart import warmstart

                warmstart(cfg)
                return 0
            train(cfg)
        except Stopped as e:
            print(
                f"\nasyncrl: {e}; the run directory is intact: asyncrl train --resume <run dir> continues it",
                file=sys.stderr,
            )
            return 143
        except RunError as e:
            print(f"\nasyncrl: run failed: {e}", file=sys.stderr)
            return 1
        return 0
    except (ConfigError, FileNotFoundError) as e:
        print(f"asyncrl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
