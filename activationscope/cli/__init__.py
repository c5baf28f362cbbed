"""The ``activationscope`` command (also ``python -m activationscope``).

Subcommands::

    activationscope demo    [--out runs/demo.zarr] [--report DIR] [--corpus]
    activationscope capture --model MODEL --data DATA --out STORE [options]
    activationscope info    STORE [--json]
    activationscope verify  STORE
    activationscope export  STORE --format parquet|arrow|hf --out FILE [--hook-points HP ...] [--overwrite]
                            [--compression NAME]
    activationscope report  STORE --out DIR [--hook-points HP ...]
    activationscope consolidate STORE [--world-size N]
    activationscope copy    SOURCE TARGET [--overwrite]

Errors (bad paths, unreadable data, unknown hook points, failing model imports) print one
line on stderr and exit with status 1 (2 for a wrong command line); ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..analysis.capture_run import COMPRESSIONS, STORAGE_DTYPES
from ..errors import (ActivationScopeError, ArgumentValueError, HookPointNotFoundError, hook_point_hint, name_repr,
                      names_repr, one_line, warn_at_caller)
from ..sizes import format_bytes

__all__ = ["main", "build_parser", "CLIError"]

PROG = "activationscope"
#: ``activationscope.data.EXPORT_FORMATS``, spelled out so that parsing imports no torch
EXPORT_FORMATS = ("parquet", "arrow", "hf")
DEFAULT_DEMO_OUT = os.path.join("runs", "demo.zarr")


class CLIError(ActivationScopeError):
    """A user error reported by the command line (one line, no traceback)."""


def _misspelt_options(parser: argparse.ArgumentParser, args: Iterable[str]) -> str:
    """``"--jsn: did you mean --json?"`` for each of ``args`` that looks like an option of
    ``parser`` misspelt (an option string it does not take, nor abbreviates), joined by ``; ``."""
    import difflib

    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in args:
        name = arg.split("=", 1)[0]
        if not name.startswith("--") or any(o.startswith(name) for o in options):
            continue
        close = difflib.get_close_matches(name, options, n=1)
        if close:
            hints.append(f"{name}: did you mean {close[0]}?")
    return "; ".join(hints)


#: Commands by the names other tools give them (``inspect`` is ``info``), for the hint of an
#: unknown command
_COMMAND_SYNONYMS = {"inspect": "info", "show": "info", "ls": "info", "stat": "info", "describe": "info",
                     "check": "verify", "validate": "verify", "fsck": "verify", "cp": "copy", "clone": "copy",
                     "merge": "consolidate", "convert": "export", "run": "capture", "record": "capture"}


def _choice_meant(action: argparse.Action, value: Any) -> str | None:
    """For an invalid ``value`` of ``action`` (``inf`` of the command), the choice of its own
    it is closest to (``'info'``), or the command it names in other tools' words (``inspect``:
    ``'info'``); None when none is close. Taken from the parser's choices, not from argparse's
    message, whose wording changes between Python versions."""
    import difflib

    choices = [c for c in action.choices or () if isinstance(c, str)]  # (a dict of subparsers: the names)
    given = str(value)
    synonym = _COMMAND_SYNONYMS.get(given.lower()) if isinstance(action, argparse._SubParsersAction) else None
    if synonym in choices:
        return synonym
    close = difflib.get_close_matches(given.lower(), choices, n=1)
    return close[0] if close else None


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors also name the option a misspelt one may have
    meant: a required option misspelt (``--fromat parquet``) is reported as missing, and
    argparse never gets to the misspelling; and the command or choice an unknown one may
    have meant (``inf`` or ``inspect``: ``info``; ``--format parqet``: ``parquet``)."""

    argv: Sequence[str] = ()
    #: the message of the invalid choice argparse refused last, and the choice meant (or None)
    _invalid_choice: tuple[str, str | None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.suggest_on_error = False  # (Python 3.14's own guess: the one said is that of _choice_meant)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:  # an invalid choice: what it may have meant, for error()
            self._invalid_choice = (str(e), _choice_meant(action, value))
            raise

    def error(self, message: str) -> Any:
        invalid, self._invalid_choice = self._invalid_choice, None
        if message.startswith("the following arguments are required"):
            hints = _misspelt_options(self, self.argv)
            if hints:
                message = f"{message} ({hints})"
        elif invalid is not None and invalid[0] == message and invalid[1] is not None:
            message = f"{message} (did you mean {invalid[1]!r}?)"
        super().error(message)


# ---------------------------------------------------------------------------- parser


def _specs(value: str) -> list[str]:
    """Comma separated, commas inside brackets kept: ``mean,hist[lo=-4,hi=4]``, ``d.a[1,2],b``
    (the splitting of every comma separated option: --reduce, --include, --exclude,
    --sample-rows, --token-rows)."""
    out, depth, cur = [], 0, []
    for ch in value:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [v.strip() for v in out if v.strip()]


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30}


def _size(value: str) -> int:
    """``"1048576"``, ``"4MiB"``, ``"512k"``, ``"64MB"`` -> bytes (a positive int)."""
    import re

    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a positive number of bytes, optionally with a unit (k, KiB, M, MiB, MB, G, GiB), got {value!r}"
        )
    return int(m.group(1)) * _SIZE_UNITS[unit]


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value!r}")
    return n


def _folds(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be an int of at least 2 (folds of the probe's cross-validation), "
                                         f"got {value!r}")
    return n


class _VersionAction(argparse.Action):
    """``--version``: prints ``activationscope <version> (torch <version>)``, what a bug report
    needs first, and exits (torch is imported only then: parsing stays quick)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        import torch

        from .._version import __version__

        print(f"{PROG} {__version__} (torch {torch.__version__})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``activationscope`` command."""
    # --debug goes before or after the command: the subcommands' copy must not reset the
    # value given before the command to its default (argparse's subparser defaults win)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks of errors, and warnings with their source line")

    parser = _Parser(
        prog=PROG,
        description="Capture activations of PyTorch models into a Zarr v3 store, inspect, verify, export and report them.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks of errors, and warnings with their source line")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of activationscope and torch, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "demo",
        parents=[common],
        help="capture all-MiniLM-L6-v2 on 200 movie-review sentences, probe every layer, write a report",
        description=(
            "Capture every encoder layer of all-MiniLM-L6-v2 (token rows and mean-pooled sentence rows) "
            "over the 200 labelled Pang & Lee movie-review sentences into a store, read it back through "
            "ActivationDataset + DataLoader, train a linear probe per layer (k-fold cross-validated) and "
            "write an HTML report."
        ),
    )
    p.add_argument("--out", default=DEFAULT_DEMO_OUT, help="store path, overwritten on rerun (default: %(default)s)")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="report folder (default: demo-report next to the store, in the folder holding it)")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.add_argument("--corpus", action="store_true",
                   help="also capture the 300 unlabelled Lee news articles (label -1; not used by the probe)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per forward (default: %(default)s)")
    p.add_argument("--folds", type=_folds, default=5, help="cross-validation folds of the probe (default: %(default)s)")
    p.add_argument("--max-samples", type=int, default=None,
                   help="use this many labelled sentences, evenly spaced over both classes (quick run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "capture",
        parents=[common],
        help="capture a model's activations over a data set into a store",
        description="Capture a model's activations over a data set into a store.",
    )
    p.add_argument("--model", required=True,
                   help="'demo', a local Hugging Face model folder, or an import path package.module:factory")
    p.add_argument("--data", required=True,
                   help="'demo' (the labelled movie-review sentences), a text file (one sample per line; "
                        "'__label__X text' lines give labels, on every line or none), or a tensor file (.npy / .pt / .npz / "
                        ".safetensors of one tensor, samples along dim 0)")
    p.add_argument("--out", required=True, help="store path or URL")
    p.add_argument("--text-column", default=None, metavar="NAME",
                   help="the text column of a table --data (.csv, .tsv, .jsonl, .json, .parquet, .arrow, .feather, "
                        "or a datasets.save_to_disk folder); default: 'text'")
    p.add_argument("--label-column", default=None, metavar="NAME",
                   help="the label column of a table --data; default: 'label' where the table has one")
    p.add_argument("--labels", default=None, metavar="FILE",
                   help="one label per sample of tensor --data, stored as the 'label' column: a 1-D .npy / .pt, or "
                        "a text file of one label per line; as many labels as the data has samples")
    p.add_argument("--include", action="append", default=None, metavar="PATTERN",
                   help="fnmatch pattern of module names to track (repeatable or comma separated; '*': every "
                        "module). Default: for a Hugging Face model folder its blocks (the children of its stack "
                        "of repeated layers, e.g. encoder.layer.0..5: the residual stream after each), for 'demo' "
                        "its layers and pools, for package.module:factory every module)")
    p.add_argument("--exclude", action="append", default=None, metavar="PATTERN",
                   help="fnmatch pattern of module names not to track (repeatable or comma separated)")
    p.add_argument("--exclude-hook-points", action="append", default=None, metavar="PATTERN",
                   help="fnmatch pattern of hook points never captured while the rest of their module's are, "
                        "e.g. 'h.*.output.1' (the attention weights a BLOOM block returns next to its hidden state) "
                        "(repeatable or comma separated)")
    p.add_argument("--capture", choices=("output", "input", "both"), default="output",
                   help="which side of each module (default: %(default)s)")
    p.add_argument("--reduce", type=_specs, default=None, metavar="NAMES",
                   help="built-in reductions, comma separated, options in brackets, e.g. "
                        "mean,var[ddof=1],nonzero,hist[lo=-4,hi=4,bins=64],topk[k=5]")
    p.add_argument("--reductions-only", action="store_true",
                   help="keep only the --reduce reductions (and the sample table) in the store, no activation row: "
                        "flat memory and disk for statistics over many tokens (--resume of such a store needs it)")
    p.add_argument("--dtype", choices=STORAGE_DTYPES, default=None, help="store floating-point activations as this dtype (integer and bool ones keep theirs)")
    p.add_argument("--compression", choices=COMPRESSIONS, default=None, help="chunk compression (default: none)")
    p.add_argument("--shard-bytes", type=_size, default=None, metavar="BYTES",
                   help="target bytes per shard file, e.g. 4MiB (default: 64 MiB but at most 16384 rows); rows are "
                        "committed a whole shard at a time, so smaller shards commit more often")
    p.add_argument("--chunk-rows", type=_positive, default=None, metavar="N",
                   help="rows per chunk (default: about 256 KiB of rows, at most 16384; with --shard-bytes, "
                        "no larger than it and at most 65536)")
    p.add_argument("--stop-after-last", action="store_true",
                   help="end each forward after its last tracked hook point (later layers do not run)")
    p.add_argument("--sample-rows", action="append", default=None, metavar="PATTERN",
                   help="fnmatch pattern of hook points stored one row per sample even when shaped like the "
                        "attention mask's (batch, pos), e.g. a pooled (batch, d) output with d equal to the length "
                        "(repeatable or comma separated; wins over --token-rows)")
    p.add_argument("--token-rows", action="append", default=None, metavar="PATTERN",
                   help="fnmatch pattern of hook points confirmed as one row per token (their activation must "
                        "start with the mask's (batch, pos)); silences the warning about 2-D ones")
    p.add_argument("--rows", choices=("auto", "token"), default="auto",
                   help="what a stored row is: 'token' stores tensor data of token ids (batch, pos) one row per "
                        "token, with a token row table (sample_id, pos), as for SAE training; 'auto' (default): "
                        "one per real token of text data, else one per sample")
    p.add_argument("--batch-size", type=int, default=32, help="samples per forward (default: %(default)s)")
    p.add_argument("--max-samples", type=int, default=None, help="capture at most this many samples")
    p.add_argument("--max-length", type=int, default=None,
                   help="token limit of text samples, special tokens included; longer texts are cut, with a warning "
                        "(default: 128, or the model's positions where it takes fewer)")
    p.add_argument("--padding", choices=("longest", "max_length"), default=None,
                   help="how each batch of text is padded: 'longest' (default) to its longest text, 'max_length' "
                        "every batch to --max-length tokens, so that a hook point stored one row per sample whose "
                        "shape follows the length (an attention map (batch, heads, pos, pos)) keeps one shape; "
                        "token rows leave the padding out either way (a --resume pads as the store was)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="continue an incomplete store from its next sample")
    group.add_argument("--overwrite", action="store_true", help="replace an existing store")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("info", parents=[common], help="describe a store",
                       description="Hook points with shapes, dtypes, rows, bytes, compression, reductions, "
                                   "provenance and status of a store.")
    p.add_argument("store", help="store path or URL")
    p.add_argument("--json", action="store_true", help="print the store's info() as JSON")

    p = sub.add_parser("verify", parents=[common], help="check a store's integrity",
                       description="Check a store's structure and checksums; exit 1 naming what is damaged.")
    p.add_argument("store", help="store path or URL")

    p = sub.add_parser("consolidate", parents=[common], help="commit the rank stores of a multi-rank capture",
                       description="Commit the complete rank stores under STORE/ranks/ (a torchrun capture whose "
                                   "commit crashed, or Slurm / Ray tasks that each wrote a rank store) into one "
                                   "store, root metadata last. Safe to rerun.")
    p.add_argument("store", help="store path")
    p.add_argument("--world-size", type=_positive, default=None,
                   help="expected number of rank stores; must agree with the number the capture recorded")

    p = sub.add_parser("copy", parents=[common], help="copy a store (to share it: a folder, s3://...)",
                       description="Copy every committed object of a store to another path or URL, its root "
                                   "document last (activationscope.copy_store); the source is not changed.")
    p.add_argument("source", help="store path or URL")
    p.add_argument("target", help="path or URL of the copy (new, or an existing store with --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a store at TARGET (never a folder of other files, nor a store being written)")

    p = sub.add_parser("export", parents=[common], help="export rows to Parquet, Arrow or Hugging Face datasets",
                       description="Export a store's rows (activations plus row table) to a Parquet or Arrow IPC "
                                   "file, or a Hugging Face datasets folder (--format hf).")
    p.add_argument("store", help="store path or URL")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS,  # those of activationscope.data
                   help="file format; hf: a Hugging Face datasets folder (datasets.load_from_disk)")
    p.add_argument("--out", required=True, help="output file (a folder for --format hf)")
    p.add_argument("--tensor-type", choices=("fixed_shape_tensor", "fixed_size_list"), default=None,
                   help="parquet / arrow: Arrow type of hook point columns; fixed_size_list where pandas "
                        "(split_blocks=True) reads the file (default: fixed_shape_tensor)")
    p.add_argument("--compression", default=None, metavar="NAME",
                   help="parquet: none, snappy, gzip, brotli, lz4 or zstd (default: zstd); arrow: none, lz4 or zstd "
                        "(default: none; a compressed file is not read back zero-copy)")
    p.add_argument("--context-size", type=_positive, default=None, metavar="N",
                   help="--format hf: N consecutive rows per example, SAELens's cached-activations layout")
    p.add_argument("--drop-last", action="store_true",
                   help="--format hf with --context-size: leave out the rows that do not fill the last example")
    p.add_argument("--overwrite", action="store_true",
                   help="parquet / arrow: replace --out even when it is not an earlier export (default: refused; "
                        "--format hf replaces only an earlier hf export, and refuses --overwrite)")
    p.add_argument("--hook-points", nargs="+", action="extend", default=None, metavar="HP",
                   help="hook points or fnmatch patterns to export (repeatable; default: all; they must share a "
                        "row kind)")
    p.add_argument("--columns", nargs="+", action="extend", default=None, metavar="COL",
                   help="row-table columns to write (repeatable; default: all, but for token rows not the "
                        "per-sample text, which each token row would repeat; e.g. --columns sample_id pos token_ids)")

    p = sub.add_parser("report", parents=[common], help="write an HTML report with plots",
                       description="Write an HTML page with PNG plots per hook point (activation histogram, "
                                   "mean/std per unit, dead units, PCA explained variance) and per-layer "
                                   "probe accuracy when the rows have labels.")
    p.add_argument("store", help="store path or URL")
    p.add_argument("--out", required=True, help="report folder (created; index.html inside)")
    p.add_argument("--hook-points", nargs="+", action="extend", default=None, metavar="HP",
                   help="hook points or fnmatch patterns to show (repeatable; default: all)")
    p.add_argument("--label-column", default=None,
                   help="row-table column with labels for the probes (default: 'label' when the store has one)")
    p.add_argument("--folds", type=_folds, default=5, help="cross-validation folds of the probe (default: %(default)s)")
    return parser


# ---------------------------------------------------------------------------- entry point


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a batch scheduler ending a job: Slurm, ``timeout``, ``kill``), raised in the
    command as a Ctrl-C is, so that it stops the same way: the rows committed kept, the store
    left incomplete and unlocked, no temporary file left."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted
    by Ctrl-C, 143 by SIGTERM).

    While the command runs (in the main thread), SIGTERM stops it as Ctrl-C does: what was
    committed is kept (a capture's store is left incomplete, for ``--resume``), and the status
    is 143; the handler before is put back when it returns."""
    try:
        before = _raise_on_sigterm()
        try:
            return _main(argv)
        finally:
            if before is not None:
                import signal

                signal.signal(signal.SIGTERM, before)
    except KeyboardInterrupt as e:  # (before the command ran: its arguments read; nothing was done)
        command = next((a for a in (sys.argv[1:] if argv is None else argv) if a in _COMMANDS), None)
        how = "terminated (SIGTERM)" if isinstance(e, _Terminated) else "interrupted"
        print(f"{PROG}{f' {command}' if command else ''}: {how}", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130


def _raise_on_sigterm() -> Any:
    """Make SIGTERM raise :class:`_Terminated` (in the main thread only: elsewhere no handler
    can be set); the handler it replaces, or None."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _terminate)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    for p in (parser, *next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices.values()):
        p.argv = given
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said by the command they were given to, with the option it may have meant
            _unrecognized(parser, args.command, unknown)
        _refuse_empty_paths(parser, args)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    _expand_paths(args)
    handler = _COMMANDS[args.command]
    # warnings shown as one line of this command, like its errors (--debug: Python's own form,
    # with the file and source line)
    formatwarning = warnings.formatwarning
    if not args.debug:
        warnings.formatwarning = _warning_formatter(args.command)
    try:
        return handler(args) or 0
    except KeyboardInterrupt as e:
        notes = "".join(f"; {n}" for n in getattr(e, "__notes__", ()))
        how = "terminated (SIGTERM)" if isinstance(e, _Terminated) else "interrupted"
        print(_printable(f"{PROG} {args.command}: {how}{_cli_spelling(notes, args.command)}"), file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    except BrokenPipeError:
        return 1
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into exit codes
        if args.debug:
            traceback.print_exc()
        else:
            notes = "".join(f"; {n}" for n in getattr(e, "__notes__", ()))
            # messages name hook points and values from the store, which may come from someone
            # else: control characters (terminal escapes) are shown escaped, never sent as is
            spelled = _cli_spelling(one_line(e) + notes, args.command,
                                    include_given=getattr(args, "include", True) not in (None, []))
            print(_printable(f"{PROG} {args.command}: error: {spelled}"),
                  file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = formatwarning


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def _unrecognized(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """Exit with a usage error (2) naming the arguments ``command`` does not take, as that
    command's error (its usage line, ``activationscope <command>: error: ...``), with the
    option each misspelt one is closest to (``--jsn``: did you mean ``--json``?)."""
    sub = _subparser(parser, command)
    hints = _misspelt_options(sub, unknown)
    fix = f" ({hints})" if hints else f" (see {PROG} {command} --help)"
    sub.error(f"unrecognized arguments: {' '.join(unknown)}{fix}")


def _in_package(filename: str) -> bool:
    """Whether ``filename`` is a file of this package (not a user's, whatever its path)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.abspath(filename).startswith(package + os.sep)


def _warning_formatter(command: str) -> Callable[..., str]:
    """A ``warnings.formatwarning`` that writes ``activationscope COMMAND: warning: MESSAGE``
    on one line, the message in the command line's words (:func:`_cli_spelling`); a warning
    of another package than this one also names its category."""

    def format_warning(message: Any, category: type, filename: str, lineno: int, line: str | None = None) -> str:
        text = " ".join(str(message).split())
        ours = (getattr(category, "__module__", "").startswith("activationscope.") or _in_package(filename)
                or getattr(message, "_from_activationscope", False))  # (shown at the caller's line)
        kind = "" if ours or category is UserWarning else f"{category.__name__}: "
        return _printable(f"{PROG} {command}: warning: {kind}{_cli_spelling(text, command)}") + "\n"

    return format_warning


#: Library advice in Python spelling (keyword arguments, set_batch) and what it is on the
#: command line; the messages come from the library and its native code, in one line.
_CLI_SPELLINGS = (
    ("For sequences of varying length pass attention_mask= to tracker.set_batch() so rows are tokens; for images "
     "of varying size (conv maps (C, H, W) follow the input's size) feed one size (resize or crop), track a module "
     "after a global pooling (nn.AdaptiveAvgPool2d) instead, or capture each size into a store of its own; or "
     "exclude this hook point",  # (no full stop: a message joined to what the store keeps has none there)
     "With text of varying length only token rows keep one feature shape: leave it out of --sample-rows, or "
     "--exclude its module"),
    ("(pass attention_mask= to tracker.set_batch() for sequences of varying length; feed images of one size; or "
     "exclude this hook point)",
     "(with text of varying length only token rows keep one feature shape: leave it out of --sample-rows, or "
     "--exclude its module)"),
    ("The attention mask given to set_batch is (batch, pos)", "The attention mask of the tokenized text is (batch, pos)"),
    ('The attention mask given to set_batch (or taken from the input by rows="token") is (batch, pos)',
     "The attention mask of the tokenized text is (batch, pos)"),
    # sink.cpp: a sample-row hook point whose shape follows pos (an attention map): the command
    # pads each batch of text to its longest text unless --padding max_length pads every one to --max-length
    ('pad every batch to one length (a tokenizer\'s padding="max_length", max_length=N; the token rows of the other '
     "hook points still leave the padding out), so that its rows keep one shape, or leave it out of the capture",
     "capture again with --overwrite --padding max_length, which pads every batch of text to --max-length tokens "
     "(the token rows of the other hook points still leave the padding out), so that its rows keep one shape, or "
     "leave it out of the capture"),
    ('(exclude= its module, or capture="output": it is an input of its module)',
     "(--exclude its module, or --capture output: it is an input of its module)"),
    ("(exclude= its module)", "(--exclude its module)"),
    ("leave one out (track(exclude=...) or ", "leave one out (--exclude its module or "),
    ("storage_dtype casts floating-point hook points only", "--dtype casts floating-point hook points only"),
    ("ass storage_dtype= to cast every row to one dtype", "ass --dtype to cast every row to one dtype"),
    # sink.cpp: a hook point whose first call was an empty batch of another dtype than its rows
    ("pass storage_dtype= to store every row as one dtype", "pass --dtype to store every row as one dtype"),
    ("pass a wider storage_dtype (torch.bfloat16 keeps float32's range, or torch.float32), or none",
     "pass a wider --dtype (bfloat16 keeps float32's range, or float32), or no --dtype"),
    ("resume with the same include=/exclude=/capture= as the first run",
     "resume with the same --include / --exclude / --capture as the first run"),
    ("is set to token rows by token_rows=", "is set to token rows by --token-rows"),
    ("pass attention_mask= to tracker.set_batch (or rows='token'), or drop the hook point from token_rows=",
     "token rows are for activations starting with the (batch, pos) of the text's attention mask: leave it out "
     "of --token-rows"),
    ("Pass attention_mask= to tracker.set_batch() for every batch",
     "Token rows need text data (the tokenizer's attention mask): leave it out of --token-rows"),
    ("export compression must be", "--compression must be"),
    ("pass drop_last=True", "pass --drop-last"),
    ("with drop_last=True", "with --drop-last"),
    ("pass a context_size of", "pass a --context-size of"),
    ("another context_size", "another --context-size"),
    ("context_size=", "--context-size "),
    ("n_folds must", "--folds must"),
    ("batch_size must", "--batch-size must"),
    ("label_column '", "--label-column '"),
    ("out_dir '", "--out '"),
    ("export path '", "--out '"),
    ("max_samples must be at least 2 * n_folds", "--max-samples must be at least 2 * --folds"),
    ("for file_format='arrow'", "for --format hf"),
    ("(none committed, or none selected by rows= / filter= / sample_ids=)", "(none committed)"),
    ("select some rows, or use export_parquet / export_arrow, which write an empty table",
     "--format parquet and --format arrow write an empty table"),
    # a store that keeps reductions only (store.reader, capture.scope): the fix in the command's flags
    ("to store rows, capture again without reduction_policy", "to store rows, capture again without --reductions-only"),
    # a multi-rank capture (store.ranks) that failed on a rank, run by torchrun
    ("with store_options resume=True", "with --resume"),
)


def _cli_spelling(message: str, command: str | None = None, include_given: bool = True) -> str:
    """``message`` with the library's Python spellings (``drop_last=True``,
    ``tracker.set_batch(attention_mask=...)``, ``n_folds``) replaced by the command line's
    (``command``'s: the report folder is ``--report`` of ``demo``, ``--out`` of ``report``).
    ``include_given`` False: the command chose the modules to track itself (no ``--include``)."""
    import re

    if command == "demo":
        message = message.replace("out_dir '", "--report '")
    if command == "verify":  # (the store's errors point to this very command)
        message = _without_verify_hint(message)

    # the export options of activationscope.data.check_format_options: "option tensor_type="
    # is --tensor-type, "the export format 'hf'" is --format hf
    message = re.sub(r"\boption (\w+)=", lambda m: "--" + m.group(1).replace("_", "-"), message)
    message = re.sub(r"\bthe export format '(\w+)'", r"--format \1", message)
    for python, cli in _CLI_SPELLINGS:
        message = message.replace(python, cli)
    message = _token_rows_flags(message)
    # sink.cpp: built-in reductions refusing a complex hook point (--reduce applies to every one)
    message = re.sub(r"give reductions= as a dict of patterns that leaves ('.*?') out \(\{\"pattern\": \[\.\.\.\]\}\), "
                     r"or exclude= its module", r"capture without --reduce, or --exclude the module of \1", message)
    # hooks.bracket_hint, the fix of a pattern holding '[': "which include=['d.a[[]1].*'] selects",
    # "which token_rows={'d.a[[]1].*': ...} selects"; and the pattern it is about ("exclude_hook_points=
    # pattern 'd.a[1].*' leaves out", "token_rows= pattern 'd.a[1].*' selects")
    message = re.sub(rf"\bwhich (include|exclude|exclude_hook_points)=({_LIST}) (selects|leaves out)\b",
                     lambda m: f"which --{m[1].replace('_', '-')} {_pattern_list(m[2])} {m[3]}", message)
    message = re.sub(rf"\bwhich token_rows=\{{({_REPR}): \.\.\.\}} selects\b",
                     r"which --sample-rows or --token-rows \1 selects", message)
    message = re.sub(r"\bexclude_hook_points= pattern\b", "--exclude-hook-points pattern", message)
    message = re.sub(r"\btoken_rows= pattern\b", "--sample-rows / --token-rows pattern", message)
    # sink.cpp: "alone with exclude_hook_points=['h.0.output.1']"; scope: "exclude_hook_points pattern(s) [...]"
    message = re.sub(rf"\bexclude_hook_points=({_LIST})",
                     lambda m: f"--exclude-hook-points {_pattern_list(m.group(1))}", message)
    message = message.replace("exclude_hook_points pattern(s)", "--exclude-hook-points pattern(s)")
    # hooks.select_modules: "include=['a', 'b'] and exclude=['c'] leave no module of M to track"
    message = re.sub(r"\binclude=(\[.*?\]|None) and exclude=(\[.*?\]|None) leave no module",
                     lambda m: (f"--include {_pattern_list(m.group(1))}" if include_given else
                                f"the modules tracked by default ({_pattern_list(m.group(1))}; no --include given)")
                               + f" and --exclude {_pattern_list(m.group(2))} leave no module", message)
    if command in ("capture", "export", "copy"):  # the commands with an --overwrite flag
        for python in ("overwrite=True (CLI: --overwrite)", "overwrite=True (--overwrite)"):
            message = message.replace(python, "--overwrite")
        # (not inside a Python call the message names: "StoreWriter(..., overwrite=True)" or
        # "StoreWriter('runs/x.zarr', overwrite=True).abort()", "store_options overwrite=True" of a rank store)
        message = re.sub(rf"StoreWriter\((?:{_REPR}|\.\.\.), overwrite=True\)|(?<!\.\.\., )(?<!store_options )"
                         r"\boverwrite=True\b", lambda m: m[0] if m[0].startswith("StoreWriter(") else "--overwrite",
                         message)
        message = re.sub(r"\((overwrite) (does not allow|replaces)\b", r"(--\1 \2", message)
    if command == "capture":  # (a store writer's error: "... and resume=True continues from them")
        message = re.sub(r"(?<!\.\.\., )(?<!store_options )\bresume=True\b", "--resume", message)
        # the store writer's refusal of a row-table column named like a hook point: the command
        # names its columns itself (a table --data's label is 'label'), so the fix is the hook point's
        message = re.sub(r"column ('[^']*') has the name of a hook point (of store .*?); rename the column\b",
                         lambda m: f"column {m[1]} (of --labels, --label-column or a text --data) has the name of a "
                                   f"hook point {m[2]}; leave the hook point out: --exclude-hook-points {m[1]}", message)
        message = message.replace(" (given to set_batch): ", " (of --labels, --label-column or a text --data): ")
        message = message.replace("; rename the column, or leave the hook point out ", "; leave the hook point out ")
        # a resume of a store captured with another capture policy: the command has no option for
        # one (it captures every forward), so the store resumes from Python only
        message = message.replace("this capture has capture_policy=CapturePolicy.EVERY, ",
                                  "this capture captures every forward (the command line has no capture policy), ")
        message = re.sub(r"\bresume with (capture_policy=CapturePolicy\.\w+(?:, \w+=\d+)?) \(the resumed forwards "
                         r"then continue its rule\)", r"resume it from Python with \1", message)
        # the refused resume of a store that keeps reductions only (capture.scope)
        message = message.replace(
            "resume with the same model, reductions= and storage_dtype, or capture again with "
            "store_options={'overwrite': True}",
            "resume with the same --model, --reduce and --dtype, or capture again with --overwrite")
        # sink.cpp's refusals of a cast: "storage_dtype=torch.float16 turns finite values into inf"
        message = re.sub(r"\bstorage_dtype=torch\.(\w+) (turns finite values|changes its integers)", r"--dtype \1 \2",
                         message)
    # the rest of the advice to leave a module out ("or exclude= them", "exclude= the module of
    # 'x'"); "include=/exclude= as the first run" names both keyword arguments and stays
    message = re.sub(r"(?<![\w/])exclude= ", "--exclude ", message)
    return message


#: A string's repr in a library message (single or double quotes), and a Python list of them
#: (``['d.a[[]1].*', 'b']``: the brackets inside the quotes do not end the list).
_REPR = r"(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
_LIST = rf"\[(?:{_REPR}(?:, {_REPR})*)?\]"

#: ``token_rows={'a': False, 'b': True}`` in a library message, and one entry of it (a hook
#: point's repr, in single or double quotes).
_TOKEN_ROWS_DICT = re.compile(r"token_rows=\{((?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"): (?:True|False)"
                              r"(?:, (?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"): (?:True|False))*)\}")
_TOKEN_ROWS_ENTRY = re.compile(r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"): (True|False)")


def _pattern_list(shown: str) -> str:
    """A Python list of patterns as a message shows it (``['a', 'b']``) in the words of a
    comma-separated flag value (``'a,b'``); ``None`` (no patterns: every module) as ``'*'``.
    Patterns not in Unicode NFC form or holding a control character are given as a shell
    ``$'...'`` string with ``\\uXXXX`` escapes (``$'d.e\\u0301.output'``), which a shell
    turns into those characters, where their printed form looks like another name."""
    import ast

    try:
        patterns = ast.literal_eval(shown)
    except (ValueError, SyntaxError):
        return shown
    if patterns is None:
        return "'*'"
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        return shown
    joined = ",".join(patterns)
    if name_repr(joined) != repr(joined) or not joined.isprintable():
        # a name that prints as another (not NFC: 'd.e\u0301.output' beside 'd.\u00e9.output') or
        # holds a control character: the shell's $'...' with its escapes, which gives those characters
        return "$'" + "".join(c if " " <= c <= "~" and c not in "\\'" else "\\" + c if c in "\\'" else
                              f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}" for c in joined) + "'"
    return repr(joined)


def _token_rows_flags(message: str) -> str:
    """The library's advice ``token_rows={'x': False}`` (one row per sample) / ``{'x': True}``
    (token rows confirmed) as the flags that give it, ``--sample-rows 'x'`` / ``--token-rows 'x'``."""

    def flags(m: re.Match) -> str:
        return " ".join(f"--{'token' if value == 'True' else 'sample'}-rows {name}"
                        for name, value in _TOKEN_ROWS_ENTRY.findall(m.group(1)))

    message = _TOKEN_ROWS_DICT.sub(flags, message)
    return message.replace("; True instead of False confirms token rows", "; --token-rows instead confirms token rows")


#: Arguments that name local paths (stores, outputs, data files, model folders): a leading
#: ``~`` is expanded in them, also where the shell leaves it (``--out=~/runs/x``, quoted).
_PATH_ARGS = ("store", "source", "target", "out", "report", "data", "model", "labels")


def _refuse_empty_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error (2) for an empty or blank path argument (an empty shell variable,
    ``--out "$DIR"``): as a path it is the current folder, where ``report`` wrote its page and
    plots and ``export`` read the folder holding the store."""
    for name in _PATH_ARGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and not value.strip():
            flag = name if name in ("store", "source", "target") else f"--{name}"
            fix = ("give 'demo', a Hugging Face model folder or package.module:factory" if name == "model" else
                   "give 'demo' or a data file" if name == "data" else
                   "give a label file, or leave --labels out" if name == "labels" else "give a path (. for the current folder)")
            _subparser(parser, args.command).error(
                f"argument {flag}: must not be empty, got {value!r} (an empty shell variable?); {fix}")


def _expand_paths(args: argparse.Namespace) -> None:
    """Expand a leading ``~`` / ``~user`` of the path arguments (``os.path.expanduser``);
    URLs and model names (never starting with ``~``) are left as they are."""
    for name in _PATH_ARGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))


# ---------------------------------------------------------------------------- store access


def _open(path: str, verify: bool = False) -> Any:
    """Open a store read-only, with a clear error for a path that is not one (``verify``:
    every chunk read is checked against its crc32c, ``open_store(verify=True)``)."""
    if "://" not in path and not path.startswith("file:") and not os.path.exists(path):
        # (a 'file:/x' URL: open_store says how it would be misread)
        from ..store.reader import missing_store_hint

        raise CLIError(f"store {path!r} does not exist{missing_store_hint(path)}")
    from ..store import open_store

    return open_store(path, verify=verify)


# ---------------------------------------------------------------------------- commands


def _patterns(values: list[str] | None, flag: str = "--include") -> list[str] | None:
    """The patterns of a repeatable, comma separated ``flag``.

    Raises
    ------
    ArgumentValueError
        An item whose brackets do not pair up holds a comma (``a[0,b``): the comma did not
        separate patterns, so it is refused naming ``flag`` and the item. A value that holds
        no pattern at all (``--include ""``, an empty shell variable) is refused too: read as
        no ``--include``, it would track every module.
    """
    if values is None:
        return None
    out: list[str] = []
    for v in values:
        items = _specs(v)
        if not items:
            raise ArgumentValueError(
                f"{flag} {v!r} holds no pattern; give "
                + ("module name patterns (fnmatch, e.g. 'encoder.layer.?')" if flag in ("--include", "--exclude")
                   else "hook point patterns (fnmatch, e.g. 'pool.?.output')")
                + f", or leave {flag} out")
        for item in items:
            if "," in item and not _balanced(item):
                raise ArgumentValueError(
                    f"{flag} {item!r} has a '[' or ']' without its pair, so its commas do not separate patterns; "
                    f"close the bracket (a[0] matches a0), or give each pattern its own {flag}")
            out.append(item)
    return out or None


def _balanced(text: str) -> bool:
    """Whether every ``]`` of ``text`` closes an earlier ``[`` and every ``[`` is closed."""
    depth = 0
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            return False
    return depth == 0


def _token_rows(sample: list[str] | None, token: list[str] | None) -> dict[str, bool] | None:
    """``token_rows=`` of ``--sample-rows`` / ``--token-rows`` (sample patterns first)."""
    out = {p: False for p in _patterns(sample, "--sample-rows") or []}
    for p in _patterns(token, "--token-rows") or []:
        if p in out:
            raise ArgumentValueError(f"--token-rows {p!r} is also given to --sample-rows; give each pattern once")
        out[p] = True
    return out or None


def cmd_capture(args: argparse.Namespace) -> int:
    from ..analysis.capture_run import capture_dataset

    if str(args.out).startswith("memory://"):
        raise CLIError(f"--out {args.out!r} is an in-memory store: it is gone when this command's process ends, so "
                       "nothing would be kept; nothing was captured. Write to a folder or an object store URL "
                       "(s3://...), or capture from Python (ActivationScope(store='memory://...')) to use it there")
    summary = capture_dataset(
        args.model, args.data, args.out,
        include=_patterns(args.include), exclude=_patterns(args.exclude, "--exclude"), capture=args.capture,
        reductions=args.reduce, dtype=args.dtype, compression=args.compression,
        shard_bytes=args.shard_bytes, chunk_rows=args.chunk_rows, batch_size=args.batch_size,
        max_samples=args.max_samples, max_length=args.max_length, padding=args.padding, resume=args.resume,
        overwrite=args.overwrite,
        stop_after_last=args.stop_after_last, progress=not args.no_progress,
        command=" ".join([PROG, *args.argv]),
        token_rows=_token_rows(args.sample_rows, args.token_rows), rows=args.rows,
        exclude_hook_points=_patterns(args.exclude_hook_points, "--exclude-hook-points"),
        labels=args.labels, text_column=args.text_column, label_column=args.label_column,
        on_start=lambda note: print(f"tracked modules: {note}", flush=True), reductions_only=args.reductions_only,
    )
    if summary.rank != 0:  # under torchrun: rank 0 says what the ranks did
        return 0
    if summary.nothing_to_capture:
        reduced = (f"; reductions {args.reduce} computed over the stored rows of {len(summary.reduced_hook_points)} "
                   "hook point(s)") if summary.reduced_hook_points else ""
        if summary.reduced_hook_points and args.reductions_only:  # (no row to compute them over: kept as stored)
            reduced = (f"; reductions {args.reduce} of {len(summary.reduced_hook_points)} hook point(s) kept as "
                       "stored (they cover every sample)")
        completed = ("; it was incomplete (its run stopped before closing) and is now marked complete"
                     if summary.completed else "")
        print(f"store {args.out} already holds {summary.first_sample} samples of {summary.n_target}; "
              f"nothing to capture{reduced}{completed}")
        return 0
    print(
        f"captured {summary.n_samples} samples ({summary.n_forwards} forward{'' if summary.n_forwards == 1 else 's'}, "
        f"{len(summary.hook_points)} hook point{'' if len(summary.hook_points) == 1 else 's'}) "
        f"in {summary.elapsed_s:.1f} s into {args.out}"
        + (f" on {summary.world_size} ranks" if summary.world_size > 1 else "")
        + (f" (reductions only: {args.reduce})" if args.reductions_only else "")
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ..analysis import demo

    t0 = time.perf_counter()
    result = demo.run_demo(
        out=args.out,
        report_dir=None if args.no_report else (args.report or demo.default_report_dir(args.out)),
        corpus=args.corpus,
        batch_size=args.batch_size,
        n_folds=args.folds,
        progress=not args.no_progress,
        max_samples=args.max_samples,
    )
    print(result.table())
    print()
    print(f"store:  {result.store_location}")
    if result.report_path:
        print(f"report: {os.path.abspath(result.report_path)}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    store = _open(args.store)
    info = store.info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(format_info(info, args.store))
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from ..store.ranks import commit_ranks

    if "://" in args.store and not args.store.startswith("file://"):  # (file://PATH is the folder PATH)
        raise CLIError(f"consolidate takes a local store folder, got the URL {args.store!r}; for object storage "
                       "call activationscope.store.ranks.commit_ranks(url, storage_options=...)")
    # a missing path, a file, or a folder holding no store: commit_ranks refuses it before it
    # creates anything there

    summary = commit_ranks(args.store, world_size=args.world_size)
    if summary.get("already_committed"):
        print(f"{args.store}: already committed ({summary['n_ranks']} ranks, {summary['n_samples']} samples)")
        return 0
    copied = sum(a["copied_bytes"] for a in summary["arrays"].values())
    replaced = ", replacing the store it held" if summary.get("replaced") else ""
    print(f"{args.store}: committed {summary['n_ranks']} rank stores, {summary['n_samples']} samples, "
          f"{len(summary['arrays'])} hook points ({copied} bytes of tail rows re-chunked){replaced}")
    return 0


def cmd_copy(args: argparse.Namespace) -> int:
    from ..store import copy_store

    for what, path in (("source", args.source), ("target", args.target)):
        if str(path).startswith("memory://"):  # (nothing there in a new process; nothing kept after it)
            raise CLIError(f"{what} {path!r} is an in-memory store, which lives in one process only: this command's "
                           "is new and is gone when it ends; nothing was copied. Give a folder or an object store URL "
                           "(s3://...), or call activationscope.copy_store from Python to use one")
    store = _open(args.source)
    if store.status != "complete":  # its committed rows are copied: say they are not all of the capture
        print(f"{PROG} copy: note: {args.source} is {store.status} (its capture did not finish, or is running): "
              f"copying its {store.n_samples} committed samples", file=sys.stderr)
    copy_store(store, args.target, overwrite=args.overwrite)
    copied = _open(args.target)
    n = len(copied.hook_points)
    print(f"copied {args.source} to {args.target} ({copied.status}, {copied.n_samples} samples, "
          f"{n} hook point{'' if n == 1 else 's'})")
    return 0


def _without_verify_hint(message: str) -> str:
    """``message`` without the library's pointer to this command (`` (`activationscope verify
    STORE` lists every damaged file)``), for the lines of ``verify`` itself, which lists them."""
    import re

    return re.sub(r"(?: \(|; )`activationscope verify STORE` lists every damaged file\)?", "", message)


def cmd_verify(args: argparse.Namespace) -> int:
    from ..errors import StoreCorruptError

    store = _open(args.store)
    try:
        result = store.verify()
    except StoreCorruptError as e:
        print(_printable(f"{PROG} verify: {args.store}: damaged: {_without_verify_hint(one_line(e))}"),
              file=sys.stderr)
        return 1
    problems = _problems(result)
    if problems:
        for p in problems:
            print(_printable(f"{PROG} verify: {args.store}: damaged: {_without_verify_hint(p)}"), file=sys.stderr)
        n = len(problems)
        print(_printable(f"{PROG} verify: {args.store}: {n} problem{'' if n == 1 else 's'} found, nothing was changed: "
                         "restore the files named from an intact copy of the store, or capture it again"),
              file=sys.stderr)
        return 1
    for line in store.leftovers():  # files a killed writer left, which nothing reads: no damage
        print(_printable(f"{PROG} verify: note: {args.store}: {line}"), file=sys.stderr)
    if store.status != "complete":  # its committed rows were checked: say they are not all of the capture
        print(f"{PROG} verify: note: {args.store} is {store.status} (its capture did not finish, or is running): "
              f"its {store.n_samples} committed samples were checked; `activationscope capture --resume` (or "
              "store_options={'resume': True}) continues a capture that stopped", file=sys.stderr)
    if not getattr(store, "rows_stored", True):
        print(f"{args.store}: ok (reductions only: {len(store.hook_points)} hook point"
              f"{'' if len(store.hook_points) == 1 else 's'} reduced, no activation row stored)")
        return 0
    print(f"{args.store}: ok")
    return 0


def _problems(result: Any) -> list[str]:
    if result is None or result is True:
        return []
    if result is False:
        return ["verification failed"]
    if isinstance(result, dict):
        for key in ("problems", "errors", "damaged"):
            if key in result:
                return [str(p) for p in result[key] or []]
        if result.get("ok") is False:
            return [str(result)]
        return []
    if isinstance(result, (list, tuple)):
        return [str(p) for p in result]
    for key in ("problems", "errors", "damaged"):
        if hasattr(result, key):
            return [str(p) for p in getattr(result, key) or []]
    if getattr(result, "ok", True) is False:
        return [str(result)]
    return []


def cmd_export(args: argparse.Namespace) -> int:
    from .. import data

    # options that do nothing for this format are refused before the store is opened
    data.check_format_options(args.format, tensor_type=args.tensor_type, overwrite=args.overwrite,
                              compression=args.compression, context_size=args.context_size,
                              drop_last=args.drop_last)
    if args.compression is not None:
        data.check_compression(args.format, args.compression)
    store = _open(args.store, verify=True)  # (an export reads every byte: a damaged chunk is an error)
    hook_points = _one_row_kind(store, _check_hook_points(store, args.hook_points))
    if store.status != "complete":  # its committed rows are exported: say it is not all of the capture
        print(f"{PROG} export: note: {args.store} is {store.status} (its capture did not finish, or is running): "
              f"exporting its {store.n_samples} committed samples", file=sys.stderr)
    # --out (a path or a file:// URL) is checked by the export itself, before it writes
    if args.format == "hf":
        out = data.export_hf(store, args.out, hook_points=hook_points, columns=args.columns,
                             context_size=args.context_size, drop_last=args.drop_last)
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        print(f"wrote {args.out} ({format_bytes(size)}, Hugging Face datasets: "
              f"datasets.load_from_disk({str(out)!r}))")
        return 0
    fn = data.export_parquet if args.format == "parquet" else data.export_arrow
    given = {} if args.compression is None else {"compression": args.compression}  # else the format's default
    out = fn(store, args.out, hook_points=hook_points, columns=args.columns,
             tensor_type=args.tensor_type or "fixed_shape_tensor", overwrite=args.overwrite, **given)
    print(f"wrote {args.out} ({format_bytes(out.stat().st_size)}, {args.format})")
    return 0


def _check_hook_points(store: Any, hook_points: list[str] | None) -> list[str] | None:
    """Resolve names and fnmatch patterns against the store's hook points, in store order
    (a pattern equal to a hook point selects that hook point only)."""
    from ..capture.hooks import bracket_hint, pattern_hits

    if hook_points is None:
        return None
    known = list(store.hook_points)
    chosen: set[str] = set()
    for hp in hook_points:
        hits = pattern_hits(hp, known)
        bracket = bracket_hint(hp, known, hits, "--hook-points", spelled="--hook-points {}")
        if not hits:
            # (names that print alike, 'é' and 'e' plus an accent, are told apart by their escapes)
            shown = bracket or f"; it holds {names_repr(known, 8)}"
            if any(c in hp for c in "*?["):
                raise HookPointNotFoundError(f"pattern {name_repr(hp)} matches no hook point of the store{shown}")
            # (a module path or a typo: the hook points meant, as store[...] and the exports name them)
            hint = "" if bracket else hook_point_hint(hp, known)
            raise HookPointNotFoundError(f"hook point {name_repr(hp)} is not in the store{shown}{hint}")
        if bracket:
            warn_at_caller(f"--hook-points pattern {name_repr(hp)} selects {names_repr(hits, 8)}{bracket}")
        chosen.update(hits)
    return [k for k in known if k in chosen]


def _one_row_kind(store: Any, hook_points: list[str] | None) -> list[str] | None:
    """Export needs hook points of one row kind; say which to pick when they are mixed."""
    names = hook_points if hook_points is not None else list(store.hook_points)
    kinds: dict[str, list[str]] = {}
    for hp in names:
        kinds.setdefault(str(store.row_kind(hp)), []).append(hp)
    if len(kinds) > 1:
        listing = "; ".join(
            f"{kind} rows: {', '.join(hps[:4])}{', ...' if len(hps) > 4 else ''}" for kind, hps in kinds.items()
        )
        raise CLIError(
            "exported hook points must have one row kind (token or sample rows), "
            f"got {listing}; pass --hook-points with one kind and export the other to another file"
        )
    return hook_points


def cmd_report(args: argparse.Namespace) -> int:
    from ..analysis import report

    report.check_out_dir(args.out)  # before the store is read
    store = _open(args.store)
    hook_points = _check_hook_points(store, args.hook_points)
    for hp in hook_points if hook_points is not None else list(store.hook_points):
        if not store.follows_row_table(hp):
            print(f"{PROG} report: note: no probe for {_printable(hp)}: its rows do not follow the row table (first captured "
                  "after some forwards, or another number of rows than the row table's, or none, in some forward), so no "
                  "label lines up with them; its statistics and plots are in the report")
    path = report.write_report(store, args.out, hook_points=hook_points, label_column=args.label_column,
                               n_folds=args.folds)
    if store.status == "incomplete":
        print(f"{PROG} report: note: {report.incomplete_note(store)}")
    print(f"report: {os.path.abspath(path)}")
    return 0


def _flat(value: Any) -> str:
    """``{"a": 1, "b": {"c": 2}, "e": [{"f": 4}]}`` -> ``a=1, b={c=2}, e=[{f=4}]``: a record inside
    another, or in a list (each resume of a store's provenance), in braces, so that where one ends
    and the next begins shows."""
    def inner(v: Any) -> str:
        return "{" + _flat(v) + "}" if isinstance(v, dict) else _flat(v)

    if isinstance(value, dict):
        return ", ".join(f"{k}={inner(v)}" for k, v in value.items() if v not in (None, "", {}, []))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(inner(v) for v in value) + "]"
    return str(value)


def _reduction_names(names: Iterable[str], partial: Mapping[str, Any] | None = None,
                     refused: Iterable[str] = ()) -> str:
    # "var", "var.mean", "var.count" are outputs of one reduction: show "var" once; a reduction
    # over part of the rows (a resume that did not continue it) says so, one with a refused entry too
    refused_bases = {name.split(".")[0] for name in refused}
    seen: list[str] = []
    for name in names:
        base = name.split(".")[0]
        label = f"{base} (refused)" if base in refused_bases else base
        if label not in seen:
            seen.append(label)
    for name, cov in (partial or {}).items():
        base = name.split(".")[0]
        label = f"{base} (partial: {cov['n_rows']:,} of {cov['of_rows']:,} rows)"
        if label not in seen:
            seen.append(label)
    return ", ".join(seen) or "-"


def _printable(text: str) -> str:
    """``text`` with every non-printable character written as its escape (``\\x1b``, ``\\n``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _shown_name(name: str) -> str:
    """A hook point for a table: as is, but with the escapes of :func:`~activationscope.errors.name_repr`
    (no quotes) when it is not in Unicode NFC form, so that ``d.\u00e9.output`` and
    ``d.e\u0301.output`` (``e`` plus a combining accent), which print alike, are told apart."""
    shown = name_repr(name)
    return name if shown == repr(name) else shown[1:-1]


def _columns(text: str) -> int:
    """Terminal columns of printable ``text``: a combining accent takes none, a wide (East
    Asian) character two, so that names such as ``d.层.output`` or an ``é`` written as ``e``
    plus an accent line up in a table."""
    import unicodedata

    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def format_info(info: dict[str, Any], name: str) -> str:
    """Human-readable text of a store's ``info()``: a header, one line per hook point, totals."""
    fmt = info.get("format")
    if isinstance(fmt, dict) and "name" in fmt:
        fmt_s = f"{fmt['name']} v{fmt.get('version', '?')}"
    else:
        fmt_s = _flat(fmt) if fmt else "?"
    if info.get("format_reason"):  # (why a version above 1: FORMAT.md section 8)
        fmt_s += f" ({info['format_reason']})"
    lines = [
        f"store:    {info.get('path') or name}",
        f"status:   {info.get('status', '?')}, {info.get('n_samples', '?')} samples, format {fmt_s}",
    ]
    if isinstance(info.get("pending_ranks"), dict):
        lines.extend(_pending_ranks_lines(info["pending_ranks"], info, name))
    elif info.get("rank_stores"):
        lines.append(f"ranks:    not committed; the rows of rank stores {info['rank_stores']} (rank by rank), "
                     "no reductions; commit with `activationscope consolidate STORE` once every rank is complete")
    reductions_only = info.get("rows_stored") is False
    if reductions_only:
        lines.append("stores:   reductions only (captured with ReductionPolicy.STREAMING / --reductions-only): the "
                     "reductions and the sample table, no activation row; rows are the rows reduced")
    if info.get("created"):
        lines.append(f"created:  {info['created']}")
    if info.get("model"):
        lines.append(f"model:    {_flat(info['model'])}")
    arrays = info.get("arrays") or {}
    reductions = info.get("reductions") or {}
    head = ("hook point", "kind", "rows", "shape", "dtype", "bytes", "on disk", "data/disk", "reductions")
    rows = []
    for hp, a in (info.get("reduced") or {}).items() if reductions_only else ():
        rows.append((
            _printable(_shown_name(hp)), str(a.get("row_kind", "?")), f"{a.get('n_rows', 0):,}",
            str(tuple(a.get("feature_shape") or ())), str(a.get("dtype", "?")), "-", "-", "-",
            _reduction_names(reductions.get(hp, []), (info.get("partial_reductions") or {}).get(hp),
                             (info.get("refused_reductions") or {}).get(hp) or ()),
        ))
    for hp, a in arrays.items():
        shape = tuple(a.get("shape", [])[1:])
        ratio = a.get("data_to_disk_ratio")
        dtype = str(a.get("dtype", "?"))
        if a.get("compression"):
            dtype += f" ({a['compression']})"
        rows.append((
            _printable(_shown_name(hp)), str(a.get("row_kind", "?")), f"{a.get('n_rows', 0):,}", str(shape), dtype,
            format_bytes(a.get("bytes")), format_bytes(a.get("bytes_on_disk")),
            "-" if ratio is None else f"{ratio:.2f}",
            _reduction_names(reductions.get(hp, []), (info.get("partial_reductions") or {}).get(hp),
                             (info.get("refused_reductions") or {}).get(hp) or ()),
        ))
    lines.append("")
    if rows:
        rows = [tuple(_printable(c) for c in r) for r in rows]  # (escaped before the columns are measured)
        widths = [max(len(h), *(_columns(r[i]) for r in rows)) for i, h in enumerate(head)]
        numeric = {2, 5, 6, 7}
        pad = lambda c, w: " " * (w - _columns(c))  # noqa: E731
        line = lambda cells: "  ".join(  # noqa: E731
            pad(c, w) + c if i in numeric else c + pad(c, w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()
        lines.append(line(head))
        lines.extend(line(r) for r in rows)
    else:
        lines.append("(no hook points)")
    refused = info.get("refused_reductions") or {}
    if refused:
        lines.append("")
        lines.append("refused reductions (no built-in reduction writes them; reading one raises, "
                     "store.reductions[hook point] returns the others with a warning, the rest of the store reads as "
                     "usual; `activationscope verify STORE` says why):")
        lines.extend(f"  {_shown_name(hp)}: {', '.join(sorted(names))}" for hp, names in refused.items())
    aliases = info.get("aliases") or {}
    if aliases:
        lines.append("")
        lines.append("stored once (the same tensor as another hook point at every call):")
        lines.extend(f"  {_shown_name(a)} = {_shown_name(t)}" for a, t in aliases.items())
    if info.get("status") == "incomplete" and not info.get("n_samples") and not reductions_only:
        lines.append("")
        lines.append("no samples committed yet: a commit needs the rows of whole forwards in complete shards of every "
                     "array (capture with a smaller --shard-bytes to commit more often)")
    ratio = info.get("data_to_disk_ratio")
    lines.append("")
    red_bytes = info.get("reduction_bytes")
    reduced_bytes = f", {format_bytes(red_bytes)} of reductions (results and states)" if red_bytes else ""
    if reductions_only:
        n = len(info.get("reduced") or {})
        lines.append(f"total:    {n} hook point{'' if n == 1 else 's'} reduced, reductions only (no activation "
                     f"row){reduced_bytes}")
    else:
        lines.append(
            f"total:    {_hook_point_count(len(arrays), len(aliases))}, {format_bytes(info.get('bytes'))} of "
            f"activations, {format_bytes(info.get('bytes_on_disk'))} on disk"
            + (f" (data/disk {ratio:.2f}: activation bytes per byte of shard files, which also hold each array's "
               "full-size last chunk and the shard indexes; not a compression ratio)" if ratio else "")
            + reduced_bytes
        )
    tables = info.get("row_tables") or {}
    if tables:
        columns = info.get("row_table_columns") or {}
        lines.append("rows:     " + ", ".join(
            f"{k} table {v:,} rows" + (f" ({', '.join(map(str, columns[k]))})" if columns.get(k) else "")
            for k, v in tables.items()))
    layout = _layout_line(arrays, info.get("row_table_parts") or {})
    if layout:
        lines.append(layout)
    if info.get("provenance"):
        lines.append(f"provenance: {_flat(info['provenance'])}")
    if info.get("library"):
        lines.append(f"library:  {_flat(info['library'])}")
    # every value comes from the store, written by someone else: a control character
    # (a terminal escape, a carriage return, a newline) is shown escaped, never sent as is
    return "\n".join(_printable(line) for line in lines)


#: Most hook points whose manifest segments the ``layout:`` line of ``info`` names one by one.
_MAX_SEGMENTED_SHOWN = 4


def _layout_line(arrays: Mapping[str, Any], parts: Mapping[str, Any]) -> str:
    """The ``layout:`` line of ``info``: the manifest segments of the arrays that have some
    (FORMAT.md section 5; the first few by name, then how many more) and the Parquet parts of
    each row table (section 4); empty when the store has neither arrays nor row tables."""
    if not arrays and not parts:
        return ""
    segmented = [(hp, int(a.get("n_manifest_segments") or 0)) for hp, a in arrays.items()
                 if a.get("n_manifest_segments")]
    if segmented:
        shown = ", ".join(f"{_shown_name(hp)} {n}" for hp, n in segmented[:_MAX_SEGMENTED_SHOWN])
        more = len(segmented) - _MAX_SEGMENTED_SHOWN
        total = sum(n for _, n in segmented)
        segments = (f"{total:,} manifest segment{'' if total == 1 else 's'} ({shown}"
                    + (f", and {more} more hook points" if more > 0 else "") + ")")
    else:
        segments = "no manifest segment"
    tables = ", ".join(f"{k} {int(n):,}" for k, n in parts.items())
    return f"layout:   {segments}" + (f"; row-table parts: {tables}" if tables else "")


#: Most rank stores listed one per line by ``info``.
_MAX_RANK_LINES = 20


def _shown_ranks(ranks: list, n: int | None = None) -> str:
    """``[0, 1, 2]``, or the first ten and how many in all."""
    n = len(ranks) if n is None else n
    return str(ranks) if n <= 10 and len(ranks) == n else f"{str(list(ranks[:10]))[:-1]}, ...] ({n} in all)"


def _rank_rows(entry: dict) -> str:
    rows = sorted({int(v) for v in (entry.get("n_rows") or {}).values()})
    if not rows:
        return "no rows"
    return f"{rows[0]:,} rows per hook point" if len(rows) == 1 else f"{rows[0]:,}..{rows[-1]:,} rows per hook point"


def _pending_ranks_lines(p: dict[str, Any], info: dict[str, Any], name: str) -> list[str]:
    """The lines of ``info`` about the rank stores waiting under ranks/ (``info()["pending_ranks"]``):
    which capture they are, each rank's status and rows, what is missing, and what to run."""
    url = "://" in name and not name.startswith("file://")
    call = (f"activationscope.store.ranks.commit_ranks({name!r}, storage_options=...)" if url else
            f"`activationscope consolidate {name}`")
    kind, world, run = p.get("capture"), p.get("world_size"), p.get("run_id")
    entries = p.get("ranks") or []
    others = p.get("other_runs") or []
    listed = [e.get("rank") for e in entries]
    if kind == "unreadable":
        return [f"ranks:    the rank stores under ranks/ cannot be read: {p.get('error')}"]
    if kind == "left_by_commit":
        return [f"ranks:    rank stores {_shown_ranks(listed)} under ranks/ were left by the commit of this store, "
                f"which already holds every rank's rows: {call} removes them"]
    if kind == "other":
        return [f"ranks:    rank stores {_shown_ranks(others)} under ranks/ are of another run, no capture of this store: "
                "consolidate does not commit them; move them away if they are yours"]
    n_ranks = f"{world} ranks" if world is not None else "ranks recording different world sizes"
    if kind == "again":
        lines = [f"ranks:    a capture again of this store waits in ranks/ (run {run}, {n_ranks}), not committed: "
                 f"the store reads its current rows ({info.get('n_samples', '?')} samples) until it is"]
    else:
        lines = [f"ranks:    not committed: a capture by {n_ranks} (run {run}); shown are the rows of rank stores "
                 f"{_shown_ranks(info.get('rank_stores') or [])} (rank by rank), no reductions"]
    for e in entries[:_MAX_RANK_LINES]:
        if "error" in e:
            lines.append(f"            rank {e.get('rank')}: cannot be opened: {e['error']}")
        else:
            writing = f", being written by {e['writer']}" if e.get("writer") else ""
            lines.append(f"            rank {e.get('rank')}: {e.get('status')}{writing}, {e.get('n_samples')} samples, "
                         f"{_rank_rows(e)}")
    if len(entries) > _MAX_RANK_LINES:
        lines.append(f"            ... ({len(entries) - _MAX_RANK_LINES} more rank stores)")
    missing, beyond, incomplete = p.get("missing") or [], p.get("beyond") or [], p.get("incomplete") or []
    if missing:
        lines.append(f"            missing: rank(s) {_shown_ranks(missing, p.get('n_missing') or len(missing))}")
    if beyond:
        lines.append(f"            beyond its {world} ranks: rank store(s) {_shown_ranks(beyond)}")
    if others:
        lines.append(f"            of another run, no part of it: rank store(s) {_shown_ranks(others)}; consolidate "
                     "removes them with the others once it commits: move them away first if you keep them")
    replacing = ", replacing the store's current rows" if kind == "again" else " into one store"
    if p.get("ready"):
        lines.append(f"next:     all {world} ranks are complete: {call} commits them{replacing}")
        return lines
    todo = []
    if world is None:
        todo.append("the rank stores record different world sizes (rank_store.world_size): run every task again "
                    "with the same RankStore(rank, world_size) (store_options overwrite=True)")
    if missing:
        with_opts = " with store_options overwrite=True, as the others" if kind == "again" else ""
        todo.append(f"run the task(s) of rank(s) {_shown_ranks(missing, p.get('n_missing') or len(missing))}"
                    f"{with_opts}")
    writing = [e.get("rank") for e in entries if e.get("writer")]
    stopped = [r for r in incomplete if r not in writing]
    if writing:
        todo.append(f"wait for the task(s) writing rank(s) {_shown_ranks(writing)} to finish")
    if stopped:
        todo.append(f"resume rank(s) {_shown_ranks(stopped)} (store_options resume=True) until complete")
    if beyond:
        todo.append(f"remove the rank store(s) {_shown_ranks(beyond)} beyond its {world} ranks (an earlier attempt's)")
    inside = [r for r in others if world is not None and r < world]
    if inside:
        todo.append(f"capture rank(s) {_shown_ranks(inside)} again (store_options overwrite=True)")
    lines.append(f"next:     {'; '.join(todo)}; then {call} commits them{replacing}")
    return lines


def _hook_point_count(n_arrays: int, n_aliases: int) -> str:
    """The total line's count: every hook point of the store (``store.hook_points``), the
    ones stored once as another's alias included, with how many arrays hold them."""
    total = n_arrays + n_aliases
    text = f"{total} hook point{'' if total == 1 else 's'}"
    if n_aliases:
        text += (f" ({n_arrays} arra{'y' if n_arrays == 1 else 'ys'}, {n_aliases} stored once as the same tensor as "
                 "another)")
    return text


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": cmd_demo,
    "capture": cmd_capture,
    "info": cmd_info,
    "verify": cmd_verify,
    "consolidate": cmd_consolidate,
    "copy": cmd_copy,
    "export": cmd_export,
    "report": cmd_report,
}
