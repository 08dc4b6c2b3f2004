"""Math-answer verification: find a solution's final answer and compare it with the reference.

The final answer of a text is, in this order: the content of its last ``\\boxed{...}`` (braces balanced), the
rest of the line after its last ``####`` (GSM8K's marker), and for a completion only, its last number. A
reference answer without a marker is taken whole, so the reference ``x + 1`` is never cut down to ``1``.

Two answers match when both read as numbers and are equal as exact fractions (``0.5``, ``1/2``,
``\\frac{1}{2}`` and ``\\dfrac{1}{2}`` are one number; ``1,234`` is 1234; a ``$``, a trailing ``%`` and a
trailing ``.`` are dropped), or otherwise when their normalised texts are equal (``\\text{}`` unwrapped,
``$`` and spaces removed, lower-cased).
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MARKER = "####"
# A number as written in prose: thousands separators, decimals, a fraction, a sign (not the minus of "5-2");
# "3." at a sentence end is 3.
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, nested braces included; None when there is none or it is
    never closed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    begin = starts[-1]
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
    return None


def marked_answer(text: str) -> str | None:
    """The boxed answer, else the line after the last ``####``; None when the text marks no answer."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if _MARKER in text:
        tail = text.rsplit(_MARKER, 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    return None


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def normalise(answer: str) -> str:
    text = _TEXT.sub(r"\1", answer.strip())
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "%").replace("\\!", "").replace("\\,", "")
    text = "".join(text.split()).lower()
    return text.rstrip(".")


def as_number(answer: str) -> Fraction | None:
    """The exact value of `answer` when it is one number (see the module docstring), else None."""
    text = normalise(answer).removesuffix("%")
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    if frac := _FRAC.match(text):
        sign, numerator, denominator = frac.groups()
        text = f"{sign}{numerator}/{denominator}"
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def reference_answer(reference: str) -> str:
    marked = marked_answer(reference)
    return marked if marked is not None else reference.strip()


def completion_answer(completion: str, *, numeric: bool) -> str | None:
    """The completion's final answer; without a marker, its last number when the reference is a number,
    else the whole completion."""
    marked = marked_answer(completion)
    if marked is not None:
        return marked
    return last_number(completion) if numeric else completion.strip() or None


def answers_match(completion: str, reference: str) -> bool:
    want = reference_answer(reference)
    want_number = as_number(want)
    got = completion_answer(completion, numeric=want_number is not None)
    if got is None:
        return False
    if want_number is not None:
        got_number = as_number(got)
        if got_number is not None:
            return got_number == want_number
    return normalise(got) == normalise(want)
