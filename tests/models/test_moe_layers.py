"""`models.architecture.moe_layers` names the decoder layers the transformers model builds routers in."""

from __future__ import annotations

import pytest
from tiny_moe import build_tiny_moe

from r3operator.models.architecture import moe_layers
from r3operator.trainer.replay.hf import find_routers


@pytest.mark.parametrize(
    ("family", "dense"),
    [("qwen3_moe", ()), ("qwen3_moe", (0, 2)), ("deepseek_v3", ()), ("glm4_moe", ()), ("mixtral", ()), ("olmoe", ())],
)
def test_moe_layers_are_where_the_model_has_routers(family: str, dense: tuple[int, ...]) -> None:
    model = build_tiny_moe(family, dense_layers=dense) if dense else build_tiny_moe(family)
    assert moe_layers(model.config) == tuple(site.layer for site in find_routers(model))
