"""The experiment programs' command lines: absl flags, one mechanism for every program.

A program defines its flags in ``define_flags(flag_values)`` and reads them at
the top of ``main(argv)``::

    def define_flags(flag_values: flags.FlagValues) -> None:
        fv = {"flag_values": flag_values}
        flags.DEFINE_integer("repeats", 7, "Timed repeats.", **fv)

    def main(argv):
        f = cli.parse(define_flags, argv)
        ...  # f.repeats

    if __name__ == "__main__":
        cli.run(main, define_flags)

As a program (``python -m experiments.X --repeats=5``), :func:`run` defines
the flags on absl's global ``flags.FLAGS`` and ``app.run`` parses the command
line into them (``--help``, ``--helpfull``, ``--flagfile``, ``--name value``
as well as ``--name=value``); ``main`` then gets those parsed flags. Called
from Python (tests, notebooks), ``main(["X", "--repeats=5"])`` takes a whole
command line (program name first, as ``sys.argv``) and parses it into a
fresh ``flags.FlagValues``: the programs one process imports never clash on a
flag name, and the global flags are left alone. A bad flag there raises
absl's ``flags.Error``.

A bad setting ``main`` finds itself (a value out of range, a combination of
flags, the training program's validation) stops the program with
:func:`fail`: one line on stderr and exit status 2 (as argparse's
``parser.error``), from the command line and from Python alike.
Logging stays at WARNING unless ``--verbosity`` is given (``app.run`` would
otherwise show JAX's INFO messages).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import app, flags
from absl import logging as absl_logging

__all__ = ["check_choices", "check_repeats", "command", "fail", "parse", "run", "values"]

DefineFlags = Callable[[flags.FlagValues], None]


def parse(define_flags: DefineFlags, argv: Sequence[str] | flags.FlagValues) -> flags.FlagValues:
    """The program's parsed flags.

    Args:
      define_flags: the program's ``define_flags(flag_values)``.
      argv: a whole command line (``["bench_selection", "--repeats=5"]``, the
        program name first), parsed into a fresh ``FlagValues``; or flags
        already parsed (what :func:`run` passes: absl's ``flags.FLAGS``),
        returned as they are.

    Raises:
      flags.Error: an unknown flag or a bad value.
      app.UsageError: arguments that are not flags.
    """
    if isinstance(argv, flags.FlagValues):
        return argv
    flag_values = flags.FlagValues()
    define_flags(flag_values)
    rest = flag_values(list(argv))
    if len(rest) > 1:
        raise app.UsageError(f"unexpected arguments: {rest[1:]}")
    return flag_values


def check_choices(name: str, choices, flag_values: flags.FlagValues) -> None:
    """Checks that the list flag ``name`` holds only ``choices`` (empty allowed: ``--name=``)."""
    flags.register_validator(
        name,
        lambda v: all(x in choices for x in v),
        message=f"--{name}: a comma list of {', '.join(choices)}",
        flag_values=flag_values,
    )


def command(argv: Sequence[str] | flags.FlagValues) -> list[str]:
    """The command line ``main(argv)`` runs: ``sys.argv`` as a program, else ``argv`` itself."""
    return list(sys.argv) if isinstance(argv, flags.FlagValues) else list(argv)


def values(define_flags: DefineFlags, flag_values: flags.FlagValues) -> dict[str, Any]:
    """The program's own flags as ``{name: value}``, in definition order (for its JSON)."""
    names = flags.FlagValues()
    define_flags(names)
    return {name: flag_values[name].value for name in names.flag_values_dict()}


def fail(message: str) -> NoReturn:
    """Stops the program over a bad setting: ``<program>: error: <message>``, exit status 2."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_repeats(repeats: int, least: int = 5) -> None:
    """Stops the program (:func:`fail`) unless medians of ``repeats`` runs, ``least`` or more."""
    if repeats < least:
        fail(f"--repeats must be >= {least} (medians of at least {least} runs)")


def run(main: Callable[[flags.FlagValues], Any], define_flags: DefineFlags) -> None:
    """Runs ``main`` as the program: its flags on ``flags.FLAGS``, parsed by ``app.run``."""
    define_flags(flags.FLAGS)

    def program(argv: Sequence[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        if not flags.FLAGS["verbosity"].present:
            absl_logging.set_verbosity(absl_logging.WARNING)
        main(flags.FLAGS)

    app.run(program)
