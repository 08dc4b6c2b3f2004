"""The base of every RLJob API model (v1alpha1 and the pod customisation blocks in pods.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """Base for every spec/status block: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        alias_generator=to_camel,
        use_attribute_docstrings=True,
        validate_assignment=False,
    )
