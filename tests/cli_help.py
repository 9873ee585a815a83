"""``flags_without_help(parser)``: every argparse flag, positional and subcommand lacking a help text.

Walks the parser and, through ``add_subparsers``, every subcommand's parser, so a test can say
"every flag of every subcommand is documented" in one assertion.
"""

from __future__ import annotations

import argparse

__all__ = ["flags_without_help"]


def flags_without_help(parser: argparse.ArgumentParser, where: str = "") -> list[str]:
    """``["kvengine serve --role", ...]``: each action with no help, named by its command path."""
    where = where or parser.prog
    missing: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {a.dest for a in action._choices_actions if a.help}
            for name, sub in action.choices.items():
                if name not in helped:
                    missing.append(f"{where} {name} (the subcommand)")
                missing += flags_without_help(sub, f"{where} {name}")
        elif not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{where} {'/'.join(action.option_strings) or action.dest}")
    return missing
