"""The module-name regexes a quantization_config carries, run by a linear-time engine or refused.

A config file is untrusted input, and so are its regexes (compressed-tensors' ``re:`` entries in
``targets`` and ``ignore``): Python's ``re`` backtracks, so ``re:(a|a)*$`` against a module name of
40 ``a``'s runs for minutes. Where google-re2 is installed (a runtime dependency where it ships
wheels) every pattern runs on RE2, whose matching time is linear in the name; a pattern RE2 cannot
run (back-references, look-arounds) is refused. Without re2 a pattern runs on ``re`` only when it
cannot backtrack badly: no quantified group (``(...)*``, ``(...)+``, ``(...){n}``), no
back-reference or look-around, at most :data:`MAX_REPEATS` repeated atoms (so a match costs at most
``len(name) ** 2`` steps), names of at most :data:`MAX_NAME` characters, and at most :data:`MAX_WORK`
steps for all the matches of one config (measured: 0.6 ms for the worst match of a 256-character name,
so at most about 10 s in all); anything else is refused. Patterns longer than :data:`MAX_PATTERN`
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

__all__ = ["MAX_NAME", "MAX_PATTERN", "MAX_REPEATS", "MAX_WORK", "Patterns", "compile_pattern", "engine"]

#: The longest pattern a config may carry.
MAX_PATTERN = 1000
#: Without re2: the longest module name matched, the most repeated atoms (``*``, ``+``, ``{m,n}``) a pattern
#: has, and the most steps (``len(name) ** repeats`` a match) all the matches of one config may take.
MAX_NAME = 256
MAX_REPEATS = 2
MAX_WORK = 10**9

# A group closed and repeated: the shape of every catastrophic backtracking pattern ((a|a)*, (a+)+, (a|a){30}).
_REPEATED_GROUP = re.compile(r"\)(?:[*+]|\{)")
_REPEAT = re.compile(r"(?<!\\)(?:[*+]|\{\d*,\d*\})")
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


class Patterns:
    """The regexes of one config, compiled, matched from the start of a name (``re.match``)."""

    def __init__(self, patterns: tuple[str, ...], where: str) -> None:
        self._compiled = [(compile_pattern(pattern, where), len(_REPEAT.findall(pattern))) for pattern in patterns]
        self._work = 0

    def match(self, name: str) -> bool:
        """Whether any pattern matches at the start of ``name``.

        Raises:
            UnsupportedQuantizationError: without re2, a name over :data:`MAX_NAME` characters, or matches
                past :data:`MAX_WORK` steps.
        """
        if not self._compiled:
            return False
        if _re2 is None:
            if len(name) > MAX_NAME:
                raise UnsupportedQuantizationError(
                    f"module name {short_repr(name)} is longer than {MAX_NAME} characters; install google-re2 to "
                    "match it against the quantization_config's patterns",
                    scheme="config",
                )
            self._work += sum((len(name) + 1) ** max(repeats, 1) for _, repeats in self._compiled)
            if self._work > MAX_WORK:
                raise UnsupportedQuantizationError(
                    "the quantization_config's patterns take too long to match without google-re2 "
                    f"(over {MAX_WORK:,} steps); install google-re2, which matches them in linear time",
                    scheme="config",
                )
        return any(compiled.match(name) is not None for compiled, _ in self._compiled)
