"""models/architecture.py (what spec.model.architecture states, from a Hugging Face config) and the runtime's
check that the RLJob states the model it loads (runtime/config.py `check_architecture`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from r3operator.api.load import parse_rljob
from r3operator.api.v1alpha1 import RLJob
from r3operator.models import REFERENCE_SPECS
from r3operator.models.architecture import architecture, num_experts
from r3operator.runtime.config import check_architecture

LOCAL_JOB = Path(__file__).resolve().parents[2] / "examples" / "rljob-local.yaml"


def test_a_reference_config_states_its_spec() -> None:
    spec = REFERENCE_SPECS["tiny"]
    assert architecture(spec.hf_config()) == {
        "numLayers": spec.num_hidden_layers,
        "numExperts": spec.num_experts,
        "topK": spec.num_experts_per_tok,
    }


def test_the_expert_count_under_either_name_and_none_for_a_dense_model() -> None:
    assert num_experts(SimpleNamespace(num_experts=64)) == 64
    assert num_experts(SimpleNamespace(num_local_experts=8)) == 8  # Mixtral's name
    assert num_experts(SimpleNamespace(hidden_size=16)) is None


def _job(**architecture: int) -> RLJob:
    doc = yaml.safe_load(LOCAL_JOB.read_text())  # the tiny reference model, its architecture stated
    doc["spec"]["model"]["architecture"].update(architecture)
    return parse_rljob(doc, source=str(LOCAL_JOB))


def test_a_job_that_states_the_model_it_loads_passes_and_another_is_refused_naming_the_field() -> None:
    config = REFERENCE_SPECS["tiny"].hf_config()
    check_architecture(_job(), config)
    with pytest.raises(ValueError, match=r"numExperts=64 \(model has 32\), topK=2 \(model has 4\)"):
        check_architecture(_job(numExperts=64, topK=2), config)
