"""``zmrl``: the plugin's command line."""

from __future__ import annotations

import argparse
import sys


def _validate_config(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin.validate_config import compose_verl_config, format_report, validate_config

    try:
        cfg = compose_verl_config(args.config_path, args.config_name, args.overrides)
    except Exception as error:  # noqa: BLE001 - composition errors are the user's to fix
        print(f"ERROR: cannot compose {args.config_name!r} from {args.config_path}: {error}", file=sys.stderr)
        return 2
    problems = validate_config(cfg)
    print(format_report(problems))
    return 1 if any(p.fatal for p in problems) else 0


def _selfcheck(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin.selfcheck import run_selfcheck

    return run_selfcheck()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zmrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser("validate-config", help="compose a verl config and check the plugin's requirements")
    validate.add_argument("--config-path", required=True, help="directory holding the Hydra config")
    validate.add_argument("--config-name", required=True, help="config file name without .yaml")
    validate.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. actor_rollout_ref.rollout.n=1")
    validate.set_defaults(func=_validate_config)

    selfcheck = sub.add_parser("selfcheck", help="check, on CPU, that verl sees the plugin and its losses work")
    selfcheck.set_defaults(func=_selfcheck)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
