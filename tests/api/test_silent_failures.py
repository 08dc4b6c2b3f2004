"""The silent-failure catalogue (api/silent_failures.py, docs/rules.md) names only rules, checks and features
that exist, and the operator pins the MoE kernel where vLLM's capture would miss a monolithic one."""

from __future__ import annotations

import pytest

from r3operator.api.rules import RULES
from r3operator.api.silent_failures import SILENT_FAILURES
from r3operator.api.vllm_args import vllm_serve_args
from r3operator.routing import checks
from tests.api.conftest import build, sets


def test_at_least_ten_modes_each_with_sources_and_an_answer() -> None:
    assert len(SILENT_FAILURES) >= 10 and len({m.key for m in SILENT_FAILURES}) == len(SILENT_FAILURES)
    for mode in SILENT_FAILURES:
        assert mode.sources and mode.vllm_0_22_1 and mode.vllm_0_30_0, mode.key
        assert mode.rules or mode.setting or mode.checks, f"{mode.key} has no answer"


def test_every_named_rule_and_check_exists_and_every_check_answers_some_mode() -> None:
    rule_ids = {r.id for r in RULES}
    named_rules = {r for m in SILENT_FAILURES for r in m.rules}
    named_checks = {c for m in SILENT_FAILURES for c in m.checks}
    assert named_rules <= rule_ids, named_rules - rule_ids
    assert named_checks <= set(checks.RULES), named_checks - set(checks.RULES)
    assert set(checks.RULES) - {"routes-invalid", "route-shape"} <= named_checks | {"route-shape"}


@pytest.mark.parametrize(
    ("image", "mode", "pinned"),
    [
        ("vllm/vllm-openai:v0.22.1", "R3", True),  # monolithic kernels skip capture: pin Triton
        ("vllm/vllm-openai:v0.30.0", "R3", False),  # capture in the kernel, or refused at start-up
        ("vllm/vllm-openai:v0.21.0", "R3", False),  # no --moe-backend to pass (unverified before 0.22.1)
        ("vllm/vllm-openai:v0.22.1", "Disabled", False),  # nothing captured
    ],
)
def test_r3_pins_the_triton_moe_kernel_only_where_capture_needs_it(image: str, mode: str, pinned: bool) -> None:
    job = build(sets(**{"inference.image": image, "routingReplay.mode": mode}))
    args = vllm_serve_args(job.spec, model_path="/m")
    assert (
        (args[args.index("--moe-backend") : args.index("--moe-backend") + 2] == ["--moe-backend", "triton"])
        if pinned
        else ("--moe-backend" not in args)
    )


def test_every_named_test_file_and_gpu_row_exists() -> None:
    from pathlib import Path

    from benchmarks.gpu_accept import ROWS

    root = Path(__file__).resolve().parents[2]
    rows = {row.name for row in ROWS}
    for mode in SILENT_FAILURES:
        for where in mode.tests:
            if where.startswith("gpu-accept row "):
                assert where.removeprefix("gpu-accept row ") in rows, where
            else:
                assert (root / where.split(" (")[0]).is_file(), where
