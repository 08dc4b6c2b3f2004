"""Locally generated reference MoE models (no hub downloads)."""

from r3operator.models.reference import (
    REFERENCE_SPECS,
    ReferenceModelSpec,
    default_cache_root,
    ensure_reference_model,
    get_spec,
    place_reference_model,
)

__all__ = [
    "REFERENCE_SPECS",
    "ReferenceModelSpec",
    "default_cache_root",
    "ensure_reference_model",
    "get_spec",
    "place_reference_model",
]
