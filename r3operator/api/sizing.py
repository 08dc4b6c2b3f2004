"""Sizes estimated from the spec alone: parameters from the model's name, bytes of a checkpoint, quantities.

These feed warnings and heuristics (the engines' startup budget, CHECKPOINT-FITS-STORAGE), never a
refusal: a name is a hint, not a measurement.
"""

from __future__ import annotations

import re
from decimal import Decimal

_PARAMS = re.compile(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)[Bb](?![A-Za-z])")
_ACTIVE_PARAMS = re.compile(r"[Aa](\d+(?:\.\d+)?)[Bb](?![A-Za-z])")

CHECKPOINT_BYTES_PER_PARAM = 12
"""What the runtime saves per parameter (runtime/checkpoint.py): fp32 master weights (4 bytes) and AdamW's two
fp32 moments (8 bytes). A lower bound for Megatron, which may also keep bf16 copies."""

_QUANTITY = re.compile(r"^[+]?(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?P<suffix>[eE][+-]?[0-9]+|[KMGTPE]i|[mkMGTPE])?$")
_BINARY: dict[str, Decimal] = {
    s: Decimal(2) ** (10 * (i + 1)) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))
}
_DECIMAL: dict[str, Decimal] = {
    "m": Decimal("0.001"),
    **{s: Decimal(10) ** (3 * (i + 1)) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
}


def model_params_billions(uri: str) -> float | None:
    """Total parameters from the model name, e.g. Qwen3-30B-A3B → 30 (the A3B active count is ignored)."""
    name = uri.rsplit("/", 1)[-1]
    name = _ACTIVE_PARAMS.sub("", name)
    found = [float(m.group(1)) for m in _PARAMS.finditer(name.replace("_", "-"))]
    return max(found) if found else None


def checkpoint_bytes(params_billions: float) -> int:
    """One full checkpoint of a model with this many parameters (weights + optimizer state)."""
    return int(params_billions * 1e9 * CHECKPOINT_BYTES_PER_PARAM)


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes resource.Quantity in bytes (``500Gi`` → 536870912000); ValueError when it is not one."""
    m = _QUANTITY.match(quantity)
    if m is None:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    value = Decimal(m.group("num"))
    suffix = m.group("suffix") or ""
    if suffix in _BINARY:
        value *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        value *= _DECIMAL[suffix]
    elif suffix:
        value *= Decimal(10) ** int(suffix[1:])
    return int(value)


def gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.0f} GiB"
