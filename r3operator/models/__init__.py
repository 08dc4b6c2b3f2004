"""Locally generated reference MoE models (no hub downloads)."""

from r3operator.models.reference import (
    REFERENCE_SPECS,
    ReferenceModelSpec,
    default_cache_root,
    ensure_reference_model,
    get_spec,
)

__all__ = [
    "REFERENCE_SPECS",
    "ReferenceModelSpec",
    "default_cache_root",
    "ensure_reference_model",
    "get_spec",
]
