"""What every command shares around its job: logging, the one error path, help texts that show defaults."""

from __future__ import annotations

import argparse
import logging
import sys

from splitlm import SplitLMError


class LogFormatter(logging.Formatter):
    """Status lines as they are; warnings and errors as `splitlm: warning: ...`; servers add the time."""

    def __init__(self, timestamps: bool):
        super().__init__()
        self.timestamps = timestamps

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            text = f"splitlm: {record.levelname.lower()}: {text}"
        if self.timestamps:
            text = f"{self.formatTime(record, '%Y-%m-%d %H:%M:%S')} {text}"
        return text


class BarSafeHandler(logging.Handler):
    """Writes to stderr through tqdm, so that a status line never tears a progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def configure_logging(verbose: bool = False, quiet: bool = False, timestamps: bool = False) -> None:
    """The one place logging is set up: splitlm's status lines on stderr (INFO; WARNING under --quiet,
    DEBUG with -v); other libraries' warnings only."""
    from splitlm.progress import set_quiet

    set_quiet(quiet)
    handler = BarSafeHandler()
    handler.setFormatter(LogFormatter(timestamps))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("splitlm").setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    logging.getLogger("websockets").setLevel(logging.WARNING)


def run_command(func, args) -> int:
    """One error path for every command: a one-line `splitlm: error: ...` and a non-zero exit status
    (1: the job failed, 2: a bad value), never a traceback for what the user can fix."""

    def fail(message: str, status: int) -> int:
        print(f"splitlm: error: {message}", file=sys.stderr)
        return status

    try:
        return func(args) or 0
    except SplitLMError as e:
        return fail(str(e), 1)
    except (ValueError, OverflowError) as e:  # bad values found after argument parsing (addresses, ranges)
        return fail(str(e), 2)
    except OSError as e:  # files and sockets: name the file
        where = f"{e.filename}: " if e.filename else ""
        return fail(f"{where}{e.strerror or e}", 1)
    except KeyboardInterrupt:
        return 130


def add_common_options(parser: argparse.ArgumentParser, subcommands) -> None:
    """`-v` and `-q` on the main parser and after every command; every flag's help shows its default."""
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (debug lines)")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars or status lines, only results and errors"
    )
    for p in subcommands.choices.values():
        p.formatter_class = DefaultsHelpFormatter
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log more")
        p.add_argument(
            "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars or status lines"
        )


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to a flag's help unless the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        # -h and --version have the default SUPPRESS: they show no default either
        if (
            "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"  # argparse %-formats help texts
