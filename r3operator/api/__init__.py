"""The RLJob API: schema, compatibility rules, vLLM version matrix, CRD generation.

Import-light by design: pydantic, pyyaml and packaging only, so the operator image and the
trainer share one schema without pulling in torch, vLLM or Ray.
"""

from r3operator.api.enums import (
    ConditionStatus,
    ConditionType,
    ExecutorBackend,
    KVConnector,
    ReplayMode,
    RouterType,
    Severity,
    TrainerBackend,
)
from r3operator.api.load import RLJobLoadError, load_rljob, load_rljobs, parse_rljob
from r3operator.api.plan import Plan, plan
from r3operator.api.rules import RULES, Finding, Rule, evaluate
from r3operator.api.v1alpha1 import API_VERSION, GROUP, KIND, PLURAL, VERSION, RLJob, RLJobSpec, RLJobStatus

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "RULES",
    "VERSION",
    "ConditionStatus",
    "ConditionType",
    "ExecutorBackend",
    "Finding",
    "KVConnector",
    "Plan",
    "RLJob",
    "RLJobLoadError",
    "RLJobSpec",
    "RLJobStatus",
    "ReplayMode",
    "RouterType",
    "Rule",
    "Severity",
    "TrainerBackend",
    "evaluate",
    "load_rljob",
    "load_rljobs",
    "parse_rljob",
    "plan",
]
