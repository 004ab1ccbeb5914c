"""``translate`` and ``generate`` as line filters: N lines in, N lines out, in order.

Input comes from the command's arguments, ``--input`` or standard input and is read,
translated and written :data:`CHUNK` lines at a time, so a file of any length
streams through. Lines end at "\\n" only; invalid UTF-8 is replaced; blank lines
give blank lines; one warning at the end counts what was replaced or cut.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator, Sequence

from flaxformer_lite.inference.translate import TranslateError, Translator, one_line

CHUNK = 1024  # lines read, translated and written at a time (a multiple of batch sizes)


def translate_main(
    workdir: str,
    sentences: list[str],
    input_file: str | None = None,
    ensemble: Sequence[str] = (),
    **options,
) -> int:
    """``main translate``: one output line per input line, in order, written as each
    chunk of :data:`CHUNK` lines is translated (``options``: beam_size, alpha,
    no_repeat_ngram, min/max_length_ratio as in ``Translator.translate``; None = the
    run's ``decode`` section). Empty lines give empty lines; invalid UTF-8 is replaced
    (U+FFFD); a line over ``model.max_len`` pieces is translated from its first
    pieces; one warning at the end counts each kind."""
    translator = Translator.from_workdir(workdir, ensemble=ensemble)
    report: Counter = Counter()
    for chunk in _chunks(read_lines(sentences, input_file, "sentences", report)):
        for line in translator.translate(chunk, report=report, **options):
            print(one_line(line))
        sys.stdout.flush()
    _summary(report, "lines", translator.config.max_len)
    return 0


def read_lines(
    given: list[str], input_file: str | None, what: str, report: Counter
) -> Iterator[str]:
    """The command's texts, one at a time: its arguments, else ``--input``'s lines,
    else standard input's. Lines end at "\n" only (and a "\r" before it); the last may
    lack one. Bytes that are not UTF-8 become U+FFFD, counted in ``report``."""
    if given and not input_file:
        report["lines"] += len(given)
        yield from given
        return
    if input_file:
        try:
            stream = open(input_file, "rb")  # noqa: SIM115 (closed below)
        except OSError as e:
            raise TranslateError(f"cannot read --input={input_file} ({e.strerror})") from e
    else:
        if sys.stdin.isatty():
            print(
                f"reading {what} from standard input, one per line (Ctrl-D ends)",
                file=sys.stderr,
            )
        stream = sys.stdin.buffer
    try:
        for raw in stream:
            report["lines"] += 1
            raw = raw[:-1] if raw.endswith(b"\n") else raw
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            if report["lines"] == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a byte-order mark (Windows tools' UTF-8): not text
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                report["invalid_utf8"] += 1
                report.setdefault("first_invalid", report["lines"])
                yield raw.decode("utf-8", "replace")
    finally:
        if input_file:
            stream.close()


def _chunks(lines: Iterator[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _summary(report: Counter, unit: str, max_len: int) -> None:
    notes = []
    if report["empty"]:
        notes.append(f"{report['empty']} empty or blank (empty lines out)")
    if report["truncated"]:
        notes.append(
            f"{report['truncated']} longer than model.max_len={max_len} pieces (translated "
            f"from their first {max_len - 1})"
        )
    if report["invalid_utf8"]:
        notes.append(
            f"{report['invalid_utf8']} not valid UTF-8 (bad bytes replaced by U+FFFD; the "
            f"first: line {report['first_invalid']})"
        )
    if notes:
        print(f"warning: of {report['lines']} {unit}, " + "; ".join(notes), file=sys.stderr)


def generate_main(
    workdir: str,
    prompts: list[str],
    input_file: str | None = None,
    ensemble: Sequence[str] = (),
    **options,
) -> int:
    """``main generate``: one continuation per prompt, one line each, in order, chunk
    by chunk like ``translate`` (``options``: max_new_tokens, temperature, top_k,
    top_p, seed as in ``Translator.generate``)."""
    generator = Translator.from_workdir(workdir, ensemble=ensemble)
    report: Counter = Counter()
    done = 0
    for chunk in _chunks(read_lines(prompts, input_file, "prompts", report)):
        for text in generator.generate(chunk, first_index=done, **options):
            print(one_line(text))
        sys.stdout.flush()
        done += len(chunk)
    _summary(report, "prompts", generator.config.max_len)
    return 0
