"""What the readers share: the error they raise and the small parsers that know where they are in a file.

Every complaint names the file, the line (or the entry, for JSON lists) and the field, and says what was expected,
so that a bad line in an 86,000-line n-best dump can be found without a debugger.
"""

from __future__ import annotations

import math

from lmserve.core.command import clip


class NBestFormatError(ValueError):
    """Malformed n-best input, e.g. ``output.gold:17: field 3 (features): 'lm_0=abc' is not name=number``."""

    def __init__(
        self, path: object, problem: str, line: int | None = None, entry: int | None = None, field: str | None = None
    ):
        self.path, self.line, self.entry, self.field, self.problem = str(path), line, entry, field, problem
        where = self.path + (f":{line}" if line is not None else "")
        where += f": entry {entry}" if entry is not None else ""
        where += f": field {field}" if field is not None else ""
        super().__init__(f"{where}: {problem}")


def split_lines(text: str) -> list[str]:
    """Lines without their ends ("\\n" or "\\r\\n"); a last newline does not make an empty last line."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def to_number(text: str) -> float | None:
    """The float ``text`` spells, None if it spells none or a non-finite one: a NaN feature would poison every
    weighted sum, and +inf would win its list whatever the other features say (and is not JSON)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_number(text: str, path: object, line: int | None, field: str, entry: int | None = None) -> float:
    value = to_number(text)
    if value is None:
        raise NBestFormatError(path, f"expected a finite number, got {clip(text)}", line, entry, field)
    return value


def json_number(value: object, path: object, line: int | None, field: str, entry: int | None = None) -> float:
    """A number from parsed JSON: not a string, not a bool (JSON's true is no score), finite (Python's json reads
    NaN, Infinity and 1e999)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise NBestFormatError(path, f"expected a finite number, got {value!r:.40}", line, entry, field)
    return float(value)


def split_key(line: str, path: object, lineno: int, key_name: str) -> tuple[str, str]:
    """``key rest-of-line``, the layout of Kaldi tables and ESPnet's text/score files; the rest may be empty."""
    parts = line.split(maxsplit=1)
    if not parts:
        raise NBestFormatError(path, f"expected '<{key_name}> ...', got an empty line", lineno, field=f"1 ({key_name})")
    return parts[0], parts[1].strip() if len(parts) == 2 else ""
