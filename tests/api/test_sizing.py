from __future__ import annotations

import pytest

from r3operator.api.sizing import checkpoint_bytes, quantity_bytes


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [
        ("500Gi", 500 * 2**30),
        ("1Ti", 2**40),
        ("100G", 100 * 10**9),
        ("1.5Gi", 3 * 2**29),
        ("1e3", 1000),
        ("+2k", 2000),
        ("1500m", 1),
        (".5Ki", 512),
    ],
)
def test_quantity_bytes(quantity: str, expected: int) -> None:
    assert quantity_bytes(quantity) == expected


def test_quantity_bytes_refuses_what_is_not_a_quantity() -> None:
    with pytest.raises(ValueError, match="'500GB'"):
        quantity_bytes("500GB")


def test_checkpoint_is_fp32_weights_plus_two_adamw_moments() -> None:
    assert checkpoint_bytes(30) == 30 * 10**9 * (4 + 4 + 4)
