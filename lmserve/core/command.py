"""What the command lines (``lm-rescore``, ``lm-serve``) share: ``--version``, ``--debug``, options refused together
at parse time (:func:`parse_args`), and how they end: one line on stderr for anything a user can fix, never a
traceback.

- a bad file, flag or model (``ValueError`` and its kin ``BundleError``, ``NBestFormatError``, ``ConfigError``;
  ``OSError``): ``PROG: error: MESSAGE``, exit 2;
- Ctrl-C: ``PROG: interrupted``, exit 130; SIGTERM: ``PROG: terminated``, exit 143. SIGTERM is turned into an
  exception first, so that, as with Ctrl-C, every temporary file and folder is removed on the way out
  (``core.atomic``);
- stdout closed by its reader (``| head``): quietly, exit 141 (128 + SIGPIPE, what a shell reports when a pipe
  ends a command; Python ignores the signal and raises ``BrokenPipeError`` instead);
- anything else is a bug: one line that says so, exit 1.

``LMSERVE_DEBUG=1`` in the environment (or ``--debug``) shows the traceback of each instead.

A message that echoes what a user gave (an id, a feature name, a candidate word, a model name) echoes it through
:func:`clip`: a 16 KB id must not become a 16 KB error line, nor a 200 KB log record.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable

import lmserve

DEBUG_ENV = "LMSERVE_DEBUG"
ECHO_CHARS = 80  # of a user's value echoed in a message (:func:`clip`)


class Terminated(BaseException):
    """SIGTERM arrived (a BaseException, like KeyboardInterrupt, so that ``except Exception`` does not swallow it)."""


def clip(value: object, limit: int = ECHO_CHARS, quote: bool = True) -> str:
    """A user's value as a message echoes it: a string quoted as ``repr`` quotes it (as it is: ``quote=False``),
    anything else as its ``repr``; past ``limit`` characters, the first ``limit`` of them and how long it was:
    ``'xxxx'... (16,384 chars)``."""
    if isinstance(value, str):
        shown = (lambda text: repr(text)) if quote else (lambda text: text)
        return shown(value) if len(value) <= limit else f"{shown(value[:limit])}... ({len(value):,} chars)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} chars)"


def _terminate(signum, frame) -> None:
    raise Terminated()


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--version`` and ``--debug`` (tracebacks instead of one-line errors, as ``LMSERVE_DEBUG=1``)."""
    parser.add_argument("--version", action="version", version=f"%(prog)s (lmserve) {lmserve.__version__}")
    parser.add_argument("--debug", action="store_true", help=f"show tracebacks (also: {DEBUG_ENV}=1)")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args``, then the subcommand's ``conflicts(args)`` (given with ``set_defaults``): a message when
    options cannot be honoured together, refused as argparse refuses a bad value (exit 2), before anything is read.
    An option that would be ignored without a word (``--html`` with ``--no-metrics`` wrote nothing, exit 0) must not
    pass for one that was honoured."""
    args = parser.parse_args(argv)
    conflict = getattr(args, "conflicts", None)
    message = conflict(args) if conflict else None
    if message:
        parser.error(message)
    return args


def debugging(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def stdout_closed() -> int:
    """The exit status for a reader that closed our stdout early. What is still buffered for it goes to /dev/null, so
    that the interpreter's last flush does not fail again on the way out."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def run_command(prog: str, func: Callable[[], int], debug: bool = False, user_errors: tuple = ()) -> int:
    """``func()``'s exit status, or the status of how it failed (module docstring). ``user_errors``: more exception
    types whose message is meant for the user."""
    main_thread = threading.current_thread() is threading.main_thread()  # (signal handlers: the main thread's only)
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return func()
    except BrokenPipeError:
        return stdout_closed()
    except (ValueError, OSError, *user_errors) as e:
        if debugging(debug):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debugging(debug):
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        if debugging(debug):
            raise
        print(f"{prog}: terminated", file=sys.stderr)
        return 143
    except Exception as e:
        if debugging(debug):
            raise
        print(
            f"{prog}: internal error: {type(e).__name__}: {e} (a bug: {DEBUG_ENV}=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
