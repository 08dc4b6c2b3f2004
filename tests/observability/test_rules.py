"""Rules pass promtool and their unit tests; the alerts the runbooks in docs/metrics.md rely on exist."""

from __future__ import annotations

import subprocess
from pathlib import Path

from r3operator.observability import rules
from tests.observability.conftest import RULES, tool

HERE = Path(__file__).parent


def test_promtool_check_rules() -> None:
    proc = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules.RECORDINGS) + len(rules.ALERTS)} rules found" in proc.stdout


def test_promtool_unit_tests() -> None:
    proc = subprocess.run(
        [tool("promtool"), "test", "rules", str(HERE / "rules_test.yaml")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_unit_test() -> None:
    text = (HERE / "rules_test.yaml").read_text()
    alerts = {a.alert for a in rules.ALERTS}
    assert {
        "R3LogprobDiffSpike",
        "R3RoutingAgreementLow",
        "R3RoutesMissing",
        "RLJobNoProgress",
        "R3OperatorReconcileErrors",
    } <= alerts
    assert all(f"alertname: {name}" in text for name in alerts)
