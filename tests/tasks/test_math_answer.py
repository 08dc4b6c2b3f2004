"""Math-answer verification: where the final answer is found, and when two answers are the same."""

from __future__ import annotations

import pytest

from r3operator.tasks.math_answer import answers_match, as_number, last_boxed, marked_answer


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        (r"so \boxed{42}.", "42"),
        (r"first \boxed{1} then \boxed{\frac{3}{4}}", r"\frac{3}{4}"),
        (r"\boxed{ {a}+{b} }", "{a}+{b}"),
        (r"\fbox{7}", "7"),
        (r"never closed \boxed{12", None),
        ("no box at all", None),
    ],
)
def test_last_boxed_balances_braces(text: str, boxed: str | None) -> None:
    assert last_boxed(text) == boxed


def test_marked_answer_prefers_boxed_then_the_line_after_the_last_marker() -> None:
    assert marked_answer("Janet has 3 ... 16 - 3 - 4 = 9 eggs.\n#### 18") == "18"
    assert marked_answer("#### 5\n#### 6\nthanks") == "6"
    assert marked_answer(r"#### 5 but \boxed{6}") == "6"
    assert marked_answer("#### ") is None
    assert marked_answer("the answer is 4") is None


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", (42, 1)),
        ("-3", (-3, 1)),
        ("1,234", (1234, 1)),
        ("$1,234.50", (2469, 2)),
        ("0.5", (1, 2)),
        ("1/2", (1, 2)),
        (r"\frac{1}{2}", (1, 2)),
        (r"-\dfrac{6}{4}", (-3, 2)),
        ("50%", (50, 1)),
        (r"50\%", (50, 1)),
        ("7.", (7, 1)),
        (r"\text{ 9 }", (9, 1)),
    ],
)
def test_numbers_read_as_exact_fractions(text: str, value: tuple[int, int]) -> None:
    number = as_number(text)
    assert number is not None and (number.numerator, number.denominator) == value


@pytest.mark.parametrize("text", ["x + 1", "1,2", "(1, 2)", "nan", "1/0", "", "seven"])
def test_non_numbers_are_not_numbers(text: str) -> None:
    assert as_number(text) is None


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        (r"The total is \boxed{18}.", "18"),
        ("16 - 3 - 4 = 9 and 9 * 2 = 18\n#### 18", "Janet sells 16 - 3 - 4 = 9 eggs ... \n#### 18"),
        ("so the answer is 18.", "18"),
        ("we get 1/2", "0.5"),
        (r"\boxed{\frac{1}{2}}", r"\boxed{0.5}"),
        ("It costs $1,000", "1000"),
        (r"\boxed{x+1}", "x + 1"),
        ("Yes", "yes"),
        ("5-2 makes 3", "3"),
        ("7", "7"),
    ],
)
def test_matching_answers(completion: str, reference: str) -> None:
    assert answers_match(completion, reference)


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        ("the answer is 17", "18"),
        (r"\boxed{18} ... actually 19", "19"),  # the boxed answer is the final one, not the last number
        ("5-2", "-2"),  # the minus of a subtraction is no sign
        ("no number here", "18"),
        ("", "18"),
        (r"\boxed{x+2}", "x + 1"),
        ("1", "x + 1"),  # a reference that is no number is never cut down to its last number
        ("4 2", "42"),
    ],
)
def test_differing_answers(completion: str, reference: str) -> None:
    assert not answers_match(completion, reference)
