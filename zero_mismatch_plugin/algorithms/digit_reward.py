"""The digit reward: the share of a response's pieces that are digits, in [0, 1].

The demo's ``digits`` task scores response tokens with it, the CPU smoke run's verl reward the
decoded text's non-whitespace characters (see docs/recipes.md).
"""

from __future__ import annotations

from typing import Sequence

ASCII_DIGITS = "0123456789"


def is_digit_piece(text: str) -> bool:
    """``text`` is ASCII digits, after any leading spaces (``"7"``, ``" 42"``; not ``"4 "``, ``"²"``)."""
    digits = text.lstrip(" ")
    return bool(digits) and all(c in ASCII_DIGITS for c in digits)


def digit_share(pieces: Sequence[str]) -> float:
    """Share of ``pieces`` that are digit pieces (:func:`is_digit_piece`); 0.0 for no pieces."""
    if not pieces:
        return 0.0
    return sum(is_digit_piece(piece) for piece in pieces) / len(pieces)
