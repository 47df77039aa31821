"""Words for counts in messages: one place, so no message says "1 classes"."""

from __future__ import annotations

__all__ = ["plural"]


def plural(count: int, word: str, many: str | None = None) -> str:
    """``"1 tensor"``, ``"2 tensors"``; ``many`` for irregular plurals (``plural(n, "class", "classes")``).

    Example:
        >>> plural(1, "tensor"), plural(3, "class", "classes")
        ('1 tensor', '3 classes')
    """
    return f"{count} {word if count == 1 else many or word + 's'}"
