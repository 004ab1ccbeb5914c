"""What goes wrong reading or writing a checkpoint, said in one line.

A failed orbax read leaves tensorstore's reads in flight, each reporting to an event
loop already closed: :func:`ignore_closed_loop_reports` drops those reports (and only
those); :func:`unreadable` names the checkpoint and the first line of the cause;
:func:`disk_error` tells a full or read-only disk from other failures; the command
line's one-line report of an ``OSError`` (:func:`os_error_line`) and its filter of
orbax's error logs (:class:`NotFromOrbax`).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import warnings

from flaxformer_lite.workdir.folder import CheckpointError


def ignore_closed_loop_reports() -> None:
    """After a failed read, tensorstore's reads still in flight report to orbax's event
    loop, closed by then, and Python prints each "Event loop is closed" and each orbax
    read coroutine left unfinished (hundreds of tracebacks for one error that
    :func:`unreadable` reports). Those reports, and only those, are dropped."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_reports", False):
        return

    def hook(report):
        value = report.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        code = getattr(report.object, "cr_code", None)
        if code is not None and "orbax" in code.co_filename:
            return
        previous(report)

    hook.drops_closed_loop_reports = True
    sys.unraisablehook = hook
    warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
    logging.getLogger("asyncio").addFilter(_StrayReadErrors())


class _StrayReadErrors(logging.Filter):
    """asyncio's "Future exception was never retrieved" for the other reads of a
    checkpoint whose first failed read was already reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("never retrieved" in text and ("OCDBT" in text or "TensorStore" in text))


# What the operating system says when a write cannot be done, as tensorstore quotes it.
_DISK_ERRORS = ("No space left on device", "Read-only file system", "Permission denied",
                "Disk quota exceeded")  # fmt: skip


def disk_error(error: BaseException) -> str | None:
    """The reason, when ``error`` (or its cause) is a failed write for want of space or
    permission (an ``OSError``, or tensorstore's error quoting one); else None."""
    while error is not None:
        if isinstance(error, OSError) and error.errno is not None:
            return error.strerror or str(error)
        for phrase in _DISK_ERRORS:
            if phrase in str(error):
                return phrase
        error = error.__cause__ or error.__context__
    return None


def unreadable(workdir, kind: str, step: int, error: BaseException) -> CheckpointError:
    """The error for a checkpoint that cannot be read: its step, and the cause's first
    line."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__  # tensorstore's own words, if any
    cause = (str(error).strip().splitlines() or [""])[0][:240]
    return CheckpointError(
        f"the {kind} checkpoint of step {step} in {workdir} cannot be read "
        f"({type(error).__name__}: {cause})"
    )


def os_error_line(e: OSError) -> str:
    """``No space left on device: PATH; ...`` with what to do."""
    where = f" {e.filename}" if e.filename else ""
    text = f"{e.strerror}:{where}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
        text += (
            "; free space or choose a writable location, then rerun the same command "
            "(training resumes from its newest checkpoint)"
        )
    return text


class NotFromOrbax(logging.Filter):
    """orbax logs each error it raises, with its traceback; the command line reports the
    error itself, in one line (``--debug`` keeps orbax's logs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"{os.sep}orbax{os.sep}" not in record.pathname
