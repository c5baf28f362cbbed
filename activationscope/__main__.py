"""``python -m activationscope`` and the ``activationscope`` console script: the command line
of :mod:`activationscope.cli`, its modules imported under :func:`main`'s Ctrl-C handling."""

import sys

#: the commands of :mod:`activationscope.cli` (its ``_COMMANDS``), named in the line printed for
#: a Ctrl-C while it is imported
COMMANDS = ("demo", "capture", "info", "verify", "consolidate", "copy", "export", "report")


def main(argv=None) -> int:
    """Run the ``activationscope`` command (:func:`activationscope.cli.main`) and return its exit
    status. A Ctrl-C while the command line's modules are still being imported, before its own
    handling is in place, ends it as a Ctrl-C during the command does: one line on stderr,
    ``activationscope <command>: interrupted``, no traceback, status 130.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments after the program name; default ``sys.argv[1:]``.

    Returns
    -------
    int
        0 ok, 1 error, 2 usage, 130 interrupted by Ctrl-C, 143 by SIGTERM.
    """
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:  # (nothing was done yet)
        command = next((a for a in (sys.argv[1:] if argv is None else argv) if a in COMMANDS), None)
        print(f"activationscope{f' {command}' if command else ''}: interrupted", file=sys.stderr)
        return 130
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
