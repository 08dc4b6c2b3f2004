"""`r3operator up` on CPU with prefill/decode disaggregation: the rendered prefill and decode `vllm serve` processes
(R3StorageConnector between them) and the trainer driver run an R3 step with weight sync to both roles and the
canary on each, against the same job on one engine.

Same seeds, same weights, fp32 on CPU: a prefill → decode rollout must give the trainer the samples one engine gives
it, so the step's |Δlogprob| (rollout vs trainer) and natural routing agreement equal the one-engine run's, replay
is applied to every token and the canary passes after the sync. The prompts are long enough (about 50 tokens) that
their KV crosses the connector in whole blocks, which the decode engine's log shows."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from up_process import LOCAL, free_port_offset, metrics_rows, run_dir, up_output, up_process

pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 1200


def _job(tmp_path: Path, *, disaggregated: bool) -> Path:
    dataset = tmp_path / "long.jsonl"
    with dataset.open("w") as f:
        for i in range(8):
            numbers = " plus ".join(str((i * 7 + k) % 10) for k in range(20))
            f.write(json.dumps({"id": f"long-{i}", "prompt": f"what is {numbers} ?", "answer": "0"}) + "\n")
    doc = yaml.safe_load(LOCAL.read_text())
    inference = doc["spec"]["inference"]
    inference["extraArgs"] = [*inference.get("extraArgs", []), "--block-size", "32"]
    if disaggregated:
        inference["disaggregation"] = {"connector": "storage"}
    doc["spec"]["task"] = {"name": "dataset", "datasetPath": str(dataset), "reward": "math"}
    doc["spec"]["rollout"].update(promptsPerStep=4, groupSize=2, maxTokens=4)
    doc["spec"]["algorithm"].update(sftWarmupSteps=0)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _results(tmp_path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    [row] = metrics_rows(tmp_path)
    return row, json.loads((run_dir(tmp_path) / "up.json").read_text())


def test_a_disaggregated_job_trains_as_one_engine_does(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    # The two jobs run side by side (own run directories and ports): most of each is engine and trainer start-up.
    # The disaggregated job's engines listen on 8000 and 8001 + its offset, the other's on 8002 + the same offset,
    # and each driver's metrics on 9400 + its own.
    offset = free_port_offset(8000, 8001, 8002, 9400, 9402)
    offsets = {"pd": offset, "one": offset + 2}
    with ExitStack() as stack:
        ups = {}
        for name, disaggregated in (("pd", True), ("one", False)):
            (tmp_path / name).mkdir()
            job = _job(tmp_path / name, disaggregated=disaggregated)
            ups[name] = stack.enter_context(up_process(tmp_path / name, job, steps=1, port_offset=offsets[name]))
        for name, up in ups.items():
            up.wait(timeout=RUN_TIMEOUT_S)
            assert up.returncode == 0, up_output(tmp_path / name)[-3000:]
    pd, manifest = _results(tmp_path / "pd")
    one, _ = _results(tmp_path / "one")

    # The rendered topology ran: a prefill and a decode engine, each with its connector role, and the trainer.
    processes = {p["name"]: p for p in manifest["processes"]}
    assert sorted(processes) == ["engine-0", "prefill-0", "trainer"]
    roles = {}
    for name in ("prefill-0", "engine-0"):
        argv = processes[name]["argv"]
        roles[name] = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_role"]
    assert roles == {"prefill-0": "kv_producer", "engine-0": "kv_consumer"}
    logs = run_dir(tmp_path / "pd") / "logs"
    assert "Inject KV cache of 32 tokens" in (logs / "engine-0.log").read_text()  # KV crossed the connector

    # Replay on every token, the canary passed after the sync to both roles, and the figures are one engine's.
    for row in (pd, one):
        assert float(row["replay_applied"]) == 1.0 and row["canary_ok"] == "1", row
    assert pd["tokens"] == one["tokens"] and pd["prompt_tokens"] == one["prompt_tokens"]
    for column in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "routing_natural_agreement", "reward_mean"):
        assert float(pd[column]) == pytest.approx(float(one[column]), rel=1e-5, abs=1e-7), column
