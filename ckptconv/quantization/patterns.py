"""The module-name regexes a quantization_config carries, run by a linear-time engine or refused.

A config file is untrusted input, and so are its regexes (compressed-tensors' ``re:`` entries in
``targets`` and ``ignore``): Python's ``re`` backtracks, so ``re:(a|a)*$`` against a module name of
40 ``a``'s runs for minutes. Where google-re2 is installed (a runtime dependency where it ships
wheels) every pattern runs on RE2, whose matching time is linear in the name; a pattern RE2 cannot
run (back-references, look-arounds) is refused. Without re2 a pattern runs on ``re`` only when it
cannot backtrack badly: no quantified group (``(...)*``, ``(...)+``, ``(...){n,}``), no
back-reference or look-around, at most :data:`MAX_REPEATS` repeated atoms, and names of at most
:data:`MAX_NAME` characters; anything else is refused. Patterns longer than :data:`MAX_PATTERN`
characters are refused either way.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from ckptconv._text import short_repr
from ckptconv.errors import UnsupportedQuantizationError

try:  # pragma: no cover - which branch runs depends on the platform
    import re2 as _re2  # type: ignore[import-not-found,import-untyped,unused-ignore]
except ImportError:  # pragma: no cover
    _re2 = None

__all__ = ["MAX_NAME", "MAX_PATTERN", "MAX_REPEATS", "compile_pattern", "engine", "search_from_start"]

#: The longest pattern a config may carry.
MAX_PATTERN = 1000
#: Without re2: the longest module name matched, and the most repeated atoms (``*``, ``+``, ``{n,}``) a pattern has.
MAX_NAME = 1024
MAX_REPEATS = 3

# A group closed and repeated: the shape of every catastrophic backtracking pattern ((a|a)*, (a+)+, (a*)*).
_REPEATED_GROUP = re.compile(r"\)(?:[*+]|\{\d*,\d*\})")
_REPEAT = re.compile(r"(?<!\\)(?:[*+]|\{\d*,\})")
_UNBOUNDED = re.compile(r"\\[1-9]|\(\?P=|\(\?<?[=!]|\\g<")


def engine() -> str:
    """Which engine runs the patterns: ``"re2"``, or ``"re"`` behind the bounds of the module docstring."""
    return "re2" if _re2 is not None else "re"


def _refused(pattern: str, where: str, why: str, advice: str = "") -> UnsupportedQuantizationError:
    advice = advice or "ckptconv runs only patterns it can match in linear time"
    return UnsupportedQuantizationError(
        f"the quantization_config's {where} pattern {short_repr(pattern)} {why}; {advice}", scheme="config"
    )


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str, use_re2: bool) -> Any:
    if use_re2:
        options = _re2.Options()
        options.log_errors = False
        return _re2.compile(pattern, options)
    return re.compile(pattern)


def compile_pattern(pattern: object, where: str) -> Any:
    """``pattern`` compiled by the linear-time engine, or refused in one line naming ``where`` it came from.

    Raises:
        UnsupportedQuantizationError: not a string, too long, invalid, or (without re2) able to backtrack.
    """
    if not isinstance(pattern, str):
        raise _refused(repr(pattern)[:60], where, "is not a string")
    if len(pattern) > MAX_PATTERN:
        raise _refused(pattern, where, f"is longer than {MAX_PATTERN} characters")
    if _re2 is None:
        if _UNBOUNDED.search(pattern):
            raise _refused(pattern, where, "has a back-reference or look-around (google-re2 is not installed)")
        if _REPEATED_GROUP.search(pattern) or len(_REPEAT.findall(pattern)) > MAX_REPEATS:
            raise _refused(pattern, where, "repeats a group or has many repeats (google-re2 is not installed)")
    try:
        return _compiled(pattern, _re2 is not None)
    except Exception as error:  # re.error, re2.error: what the engine says is in the one line
        text = error.args[0] if error.args else type(error).__name__
        reason = (text.decode(errors="replace") if isinstance(text, bytes) else str(text)).splitlines()[0]
        raise _refused(pattern, where, f"does not compile ({reason[:80]})", "fix the pattern") from None


def search_from_start(compiled: Any, name: str) -> bool:
    """``re.match(compiled, name)``: the pattern matches at the start of ``name``."""
    if _re2 is None and len(name) > MAX_NAME:
        raise UnsupportedQuantizationError(
            f"module name {short_repr(name)} is longer than {MAX_NAME} characters; install google-re2 to match it "
            "against the quantization_config's patterns",
            scheme="config",
        )
    return compiled.match(name) is not None
