"""The verl comparison's warmed-up common start (benchmarks/peers/warm_start.py, `verl_vs_r3.py --warm-start-steps`):
the warmed export against the random-init one, both frameworks on the same directory, and nothing changed at N=0.

The warm-up's effect is judged by a loss this file computes itself (plain transformers, the chat template, the
arith answers), not by the loss the warm-up reports."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.peers.verl_config import verl_overrides
from benchmarks.peers.verl_vs_r3 import JOB, build_table, main, r3_command, r3_up_commands, run_part
from benchmarks.peers.warm_start import WarmStartError, check_start, read_warm_start

REPO = Path(__file__).resolve().parents[2]
ARITH = REPO / "examples" / "data" / "arith.jsonl"
WARM_STEPS = 4
WARM_LR = 1e-3  # large for the tiny model, so that 4 steps move its loss well past noise


def runner_args(out: Path, *, warm: int, gpus: int = 2, model: str = "a3b") -> argparse.Namespace:
    from benchmarks.peers.verl_vs_r3 import build_parser

    argv = ["--gpus", str(gpus), "--out", str(out), "--steps", "3", "--model", model, "--site", "/s"]
    argv += ["--verl-site", "/v", "--timeout-s", "5", "--r3-fast", "--warm-start-steps", str(warm)]
    return build_parser().parse_args([*argv, "--warm-start-lr", str(WARM_LR)])


@pytest.fixture(scope="module")
def warm_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`prepare` on the CPU with the tiny model, as the command line runs it (the warm-up in a process of its own)."""
    out = tmp_path_factory.mktemp("warm")
    argv = ["--gpus", "1", "--out", str(out), "--model", "tiny", "--device", "cpu", "--parts", "prepare"]
    rc = main([*argv, "--warm-start-steps", str(WARM_STEPS), "--warm-start-lr", str(WARM_LR), "--site", str(out)])
    assert rc == 0, (out / "warm-start" / "console.log").read_text()
    return out


def answer_loss(model_dir: Path) -> float:
    """Token-mean cross-entropy of every arith answer (then EOS) after its chat-templated prompt, fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for line in ARITH.read_text().splitlines():
        row = json.loads(line)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        answer_ids = [*tokenizer(row["answer"], add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        ids = torch.tensor([prompt_ids + answer_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        targets = ids[0, 1:]
        nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")[len(prompt_ids) - 1 :]
        total, count = total + float(nll.sum()), count + len(answer_ids)
    return total / count


@pytest.mark.slow
def test_warm_export_loads_and_has_learned_the_answers(warm_out: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    from benchmarks.peers.verl_inputs import check_hf_layout, export_model

    warm_dir = warm_out / "inputs" / "model"
    random_dir = export_model("tiny", tmp_path / "random")
    facts = check_hf_layout(warm_dir)  # AutoConfig, AutoTokenizer, AutoModelForCausalLM and a forward
    assert facts["architectures"] == ["Qwen3MoeForCausalLM"] and (facts["num_experts"], facts["top_k"]) == (32, 4)
    assert facts["finite"] and facts["chat_text"] == check_hf_layout(random_dir)["chat_text"]
    assert not (warm_dir / "r3_reference_spec.json").exists()  # no longer the generator's weights

    def tensors(directory: Path) -> dict[str, Any]:
        with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)

    warm, random = tensors(warm_dir), tensors(random_dir)
    assert warm.keys() == random.keys()
    assert {t.dtype for t in warm.values()} == {t.dtype for t in random.values()}  # bf16, as the export
    changed = [name for name in warm if not warm[name].equal(random[name])]
    assert "lm_head.weight" in changed and len(changed) > len(warm) // 2

    before, after = answer_loss(random_dir), answer_loss(warm_dir)
    assert after < before - 0.1, (before, after)

    record = json.loads((warm_out / "inputs" / "warm_start.json").read_text())
    assert (record["steps"], record["learning_rate"], record["device"]) == (WARM_STEPS, WARM_LR, "cpu")
    assert math.isfinite(record["final_loss"]) and record["batch"] == 32
    header = build_table(warm_out, gpus=1)[0].splitlines()[0]
    assert f"warm start {WARM_STEPS} SFT steps (lr {WARM_LR:g}, final loss " in header


@pytest.mark.slow
def test_r3_jobs_point_at_the_directory_verl_reads(warm_out: Path, tmp_path: Path) -> None:
    from r3operator.api.load import load_rljob, parse_rljob
    from r3operator.api.rules import errors, evaluate
    from r3operator.cli.up.plan import plan_up
    from r3operator.runtime.config import resolve_model_dir

    args = runner_args(warm_out, warm=WARM_STEPS)
    verl = dict(
        item.split("=", 1)
        for item in verl_overrides(
            model_dir=warm_out / "inputs" / "model",  # as the runner's verl part passes it
            data_dir=warm_out / "inputs" / "data",
            reward_file=Path("/r.py"),
            gpus=2,
            steps=3,
            replay="R3",
            log_file=Path("/o/metrics.jsonl"),
        )
    )
    verl_model = Path(verl["actor_rollout_ref.model.path"]).resolve()
    runs = r3_up_commands(args)
    assert [sub for sub, _, _ in runs] == ["r3", "r3-fast", "disabled"]
    for _sub, cmd, _metrics in runs:
        job = load_rljob(Path(cmd[2]))
        assert errors(evaluate(job.spec)) == []
        assert job.spec.model.uri == "file://" + str(verl_model)
        assert job.spec.algorithm.sft_warmup_steps == 0  # warmed once, for both
        arch = job.spec.model.architecture
        assert arch is not None and (arch.num_layers, arch.num_experts, arch.top_k) == (4, 32, 4)  # tiny's
        assert resolve_model_dir(job) == verl_model  # the trainer's model
        plan = plan_up(
            parse_rljob(yaml.safe_load(Path(cmd[2]).read_text())),
            run_dir=tmp_path / "plan",
            gpus=["0", "1"],
            bin_dir=tmp_path,
            host_path="",
        )
        (engine,) = plan.engines
        assert engine.argv[:3] == ["vllm", "serve", str(verl_model)]  # the engine's model
    # One process (1 GPU, the CPU): the same directory, and no reference-model override beside it
    one = r3_command(runner_args(warm_out, warm=WARM_STEPS, gpus=1, model="tiny"))
    assert "--model" not in one
    assert load_rljob(Path(one[4])).spec.model.uri == "file://" + str(verl_model)


def test_without_a_warm_start_nothing_changes(tmp_path: Path) -> None:
    from r3operator.api.load import load_rljob

    committed = yaml.safe_load(JOB.read_text())["spec"]
    for _sub, cmd, _metrics in r3_up_commands(runner_args(tmp_path, warm=0)):
        spec = yaml.safe_load(Path(cmd[2]).read_text())["spec"]
        assert spec["model"] == committed["model"]
        assert spec["model"]["uri"] == "r3operator://reference/a3b"
        assert spec["algorithm"]["sftWarmupSteps"] == 0
    one = r3_command(runner_args(tmp_path, warm=0, gpus=1, model="tiny"))
    assert one[4] == str(JOB) and one[one.index("--model") + 1] == "tiny"
    assert load_rljob(Path(one[4])).spec.model.uri == "r3operator://reference/a3b"
    text, summary = build_table(tmp_path, gpus=2)
    assert text.splitlines()[0].startswith("## verl 0.9.1 vs r3operator, 2 GPU(s), a3b, random init, arith, ")
    assert summary["start"] is None


def test_verl_overrides_are_the_same_for_either_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl reads DIR/inputs/model either way; a warm start changes the files there, not verl's command."""
    from benchmarks.peers import verl_vs_r3

    passing = 'print(\'TE_PREFLIGHT {"ok": true, "passes": {}}\')'
    monkeypatch.setattr(verl_vs_r3, "preflight_command", lambda python, model: [sys.executable, "-c", passing])
    monkeypatch.setattr(verl_vs_r3, "run_logged", lambda *a, **k: 0)
    (tmp_path / "inputs" / "model").mkdir(parents=True)
    (tmp_path / "inputs" / "model" / "config.json").write_text("{}")
    (tmp_path / "inputs" / "data").mkdir(parents=True)
    (tmp_path / "inputs" / "data" / "train.parquet").write_bytes(b"")
    written = {}
    for warm in (0, WARM_STEPS):
        if warm:
            record = {"steps": warm, "learning_rate": 1e-4, "first_loss": 6.0, "final_loss": 2.5}
            record |= {"batch": 32, "seed": 0, "device": "cpu"}
            (tmp_path / "inputs" / "warm_start.json").write_text(json.dumps(record))
        assert run_part("verl-R3", runner_args(tmp_path, warm=warm)) == 0
        written[warm] = (tmp_path / "verl-R3" / "overrides.txt").read_text().splitlines()
    assert written[0] == written[WARM_STEPS]
    assert f"actor_rollout_ref.model.path={tmp_path}/inputs/model" in written[0]


def test_parts_refuse_inputs_that_hold_another_start(tmp_path: Path) -> None:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    assert check_start(inputs, 0) is None
    with pytest.raises(WarmStartError, match="holds the random-init model; run --parts prepare --warm-start-steps 5"):
        check_start(inputs, 5)
    assert run_part("verl-R3", runner_args(tmp_path, warm=5)) == 2  # neither framework starts
    assert run_part("r3", runner_args(tmp_path, warm=5)) == 2
    (inputs / "warm_start.json").write_text(json.dumps({"steps": 5, "learning_rate": "high"}))
    with pytest.raises(WarmStartError, match="field 'batch' must be int"):
        read_warm_start(inputs)
    record = {"steps": 5, "learning_rate": 1e-4, "first_loss": 6.0, "final_loss": 2.5, "batch": 32, "seed": 0}
    (inputs / "warm_start.json").write_text(json.dumps({**record, "device": "cuda"}))
    start = check_start(inputs, 5)
    assert start is not None and start.label() == "warm start 5 SFT steps (lr 0.0001, final loss 2.5)"
    with pytest.raises(WarmStartError, match="holds a warm start of 5 steps"):
        check_start(inputs, 0)
    (inputs / "warm_start.json").write_text(json.dumps({**record, "device": "cuda", "final_loss": float("nan")}))
    with pytest.raises(WarmStartError, match="field 'final_loss' must be a finite number"):
        read_warm_start(inputs)


def test_runner_refuses_a_negative_warm_start(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--gpus", "1", "--out", str(tmp_path), "--parts", "table", "--warm-start-steps", "-1"])
    assert "--warm-start-steps: expected 0 or more, got -1" in capsys.readouterr().err
