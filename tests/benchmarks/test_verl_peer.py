"""The verl comparison's CPU-checkable half (benchmarks/peers): reading verl's logged metrics and r3operator's
metrics.csv into one table, the arith parquet verl trains on, the model export verl loads, the reward and the
metrics hook. verl itself is never imported: its logs are recorded samples built here in its documented formats
(`FileLogger` JSONL lines, `concat_dict_to_str` console lines) and every expected figure is written out below.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.peers.compare import (
    MetricsError,
    RunSummary,
    initial_weights_steps,
    read_gpu_peaks,
    read_verl_log,
    summarize_r3,
    summarize_verl,
    table,
)
from benchmarks.peers.verl_config import Workload, verl_overrides
from benchmarks.peers.verl_inputs import ConversionError, convert_arith, read_jsonl
from benchmarks.peers.verl_reward import DATA_SOURCE, compute_score
from benchmarks.peers.verl_vs_r3 import JOB, JOB_NAME, build_table

REPO = Path(__file__).resolve().parents[2]
SAMPLES = 128  # 16 prompts × 8

# Three verl steps as its trainer logs them (values picked so every figure below is checkable by hand).
VERL_STEPS = {
    1: {
        "timing_s/gen": 9.0,
        "timing_s/old_log_prob": 2.0,
        "timing_s/update_actor": 5.0,
        "timing_s/update_weights": 3.0,
        "timing_s/step": 20.0,
        "response_length/mean": 50.0,
        "perf/max_memory_allocated_gb": 30.5,
        "critic/score/mean": 0.0,
        "training/rollout_probs_diff_mean": 0.01,
        "training/rollout_probs_diff_max": 0.9,
        "peer/logprob_abs_diff_mean": 0.5,
        "peer/logprob_abs_diff_max": 9.0,
        "peer/kl_k3": 0.3,
    },
    2: {
        "timing_s/gen": 1.0,
        "timing_s/old_log_prob": 0.5,
        "timing_s/update_actor": 1.5,
        "timing_s/update_weights": 0.25,
        "timing_s/step": 4.0,
        "response_length/mean": 64.0,
        "perf/max_memory_allocated_gb": 31.0,
        "critic/score/mean": 0.125,
        "training/rollout_probs_diff_mean": 0.002,
        "training/rollout_probs_diff_max": 0.2,
        "peer/logprob_abs_diff_mean": 0.004,
        "peer/logprob_abs_diff_max": 0.3,
        "peer/kl_k3": 0.001,
    },
    3: {
        "timing_s/gen": 3.0,
        "timing_s/old_log_prob": 0.5,
        "timing_s/update_actor": 2.5,
        "timing_s/update_weights": 0.75,
        "timing_s/step": 8.0,
        "response_length/mean": 32.0,
        "perf/max_memory_allocated_gb": 30.0,
        "critic/score/mean": 0.25,
        "training/rollout_probs_diff_mean": 0.004,
        "training/rollout_probs_diff_max": 0.4,
        "peer/logprob_abs_diff_mean": 0.006,
        "peer/logprob_abs_diff_max": 0.5,
        "peer/kl_k3": 0.003,
    },
}


def write_verl_jsonl(path: Path, steps: dict[int, dict[str, float]]) -> Path:
    path.write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in steps.items()))
    return path


def write_verl_console(path: Path, steps: dict[int, dict[str, float]]) -> Path:
    lines = ["(TaskRunner pid=1) Training Progress: 0%|", "INFO ray started"]
    for s, d in steps.items():
        lines.append(" - ".join([f"step:{s}", *(f"{k}:{v!r}" for k, v in d.items())]))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_verl_summary_leaves_step_one_out_and_divides_by_gpus(tmp_path: Path) -> None:
    s = summarize_verl(
        write_verl_jsonl(tmp_path / "m.jsonl", VERL_STEPS), replay="R3", gpus=2, samples_per_step=SAMPLES
    )
    tokens = (64 + 32) * SAMPLES  # steps 2 and 3
    assert s.steps == 3 and s.measured_steps == 2
    assert s.generated_tokens_per_s_per_gpu == pytest.approx(tokens / (1.0 + 3.0) / 2)
    assert s.trained_tokens_per_s_per_gpu == pytest.approx(tokens / (4.0 + 8.0) / 2)
    assert s.step_seconds == pytest.approx(6.0)
    assert s.split == pytest.approx(
        {"rollout": 2.0, "old_logprob": 0.5, "update": 2.0, "weight_sync": 0.5, "other": 6.0 - 5.0}
    )
    assert s.trainer_peak_gib == 31.0  # the peak over every step, the first included
    assert s.logprob_abs_diff_mean == pytest.approx(0.005)
    assert s.logprob_abs_diff_max == pytest.approx(0.5)
    assert s.kl_k3 == pytest.approx(0.002)
    assert s.extra == pytest.approx({"prob_abs_diff_mean": 0.003, "prob_abs_diff_max": 0.4})
    assert s.reward == [0.0, 0.125, 0.25]
    assert s.routing_agreement is None


def test_verl_console_log_reads_like_the_jsonl(tmp_path: Path) -> None:
    from_console = read_verl_log(write_verl_console(tmp_path / "console.log", VERL_STEPS))
    assert from_console == read_verl_log(write_verl_jsonl(tmp_path / "m.jsonl", VERL_STEPS))
    assert from_console[2]["timing_s/update_weights"] == 0.25


def test_verl_log_errors_name_the_file_and_the_gap(tmp_path: Path) -> None:
    empty = tmp_path / "console.log"
    empty.write_text("ray started\nno metrics here\n")
    with pytest.raises(MetricsError, match=r"console\.log: no step metrics"):
        read_verl_log(empty)
    broken = tmp_path / "m.jsonl"
    broken.write_text('{"step": 1, "data": {}}\n{"nope": 2}\n')
    with pytest.raises(MetricsError, match=r"m\.jsonl:2: not a verl metrics line"):
        read_verl_log(broken)
    lacking = {1: {k: v for k, v in VERL_STEPS[1].items() if k != "timing_s/update_weights"}}
    with pytest.raises(MetricsError, match="step 1 lacks timing_s/update_weights"):
        summarize_verl(write_verl_jsonl(tmp_path / "l.jsonl", lacking), replay="R3", gpus=2, samples_per_step=8)


def write_r3_metrics(path: Path, rows: list[dict[str, float | int | str]]) -> Path:
    """Through r3operator's own writer, so the test reads exactly what a run writes."""
    from r3operator.runtime.report import append_row

    path.parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        append_row(path, row)
    return path


def r3_row(step: int, **overrides: float | int | str) -> dict[str, float | int | str]:
    row: dict[str, float | int | str] = {
        "step": step,
        "replay_mode": "R3",
        "reward_mean": 0.1 * step,
        "tokens": 1000,
        "step_seconds": 5.0,
        "t_rollout": 1.0,
        "t_old_logprob": 0.5,
        "t_update": 2.0,
        "t_weight_sync": 0.5,
        "t_checkpoint": 0.0,
        "logprob_abs_diff_mean": 0.002,
        "logprob_abs_diff_max": 0.1,
        "kl_k3": 1e-4,
        "routing_natural_agreement": 0.9,
        "trainer_peak_memory_gib": 40.0,
        "skipped": 0,
    }
    row.update(overrides)
    return row


def test_r3_summary_leaves_out_skipped_steps_and_the_final_checkpoint(tmp_path: Path) -> None:
    path = write_r3_metrics(
        tmp_path / "metrics.csv",
        [
            r3_row(1, step_seconds=30.0, t_rollout=20.0, tokens=900, trainer_peak_memory_gib=38.0),
            r3_row(2, routing_natural_agreement=0.8, logprob_abs_diff_max=0.3),
            r3_row(3, skipped=1, tokens=1000, step_seconds=0.5),
            r3_row(4, step_seconds=29.0, t_checkpoint=24.0, tokens=600, trainer_peak_memory_gib=41.5),
        ],
    )
    s = summarize_r3(path, replay="R3", gpus=2)
    assert s.steps == 3 and s.measured_steps == 2  # step 3 skipped, step 1 warm-up
    assert s.generated_tokens_per_s_per_gpu == pytest.approx((1000 + 600) / (1.0 + 1.0) / 2)
    assert s.trained_tokens_per_s_per_gpu == pytest.approx((1000 + 600) / (5.0 + 5.0) / 2)
    assert s.split == pytest.approx(
        {"rollout": 1.0, "old_logprob": 0.5, "update": 2.0, "weight_sync": 0.5, "other": 1.0}
    )
    assert s.trainer_peak_gib == 41.5
    assert s.routing_agreement == pytest.approx(0.85)
    assert s.logprob_abs_diff_max == pytest.approx(0.3)
    assert s.reward == pytest.approx([0.1, 0.2, 0.4])
    assert s.extra == {"checkpoint_seconds_total": 24.0}


def test_r3_summary_of_an_asynchronous_run_counts_generation_over_the_whole_step(tmp_path: Path) -> None:
    """The asynchronous mode generates while the trainer trains: its `t_rollout` is the trainer's wait for
    finished groups (milliseconds), so generated tokens/s is what the engine delivers per step, and the
    wait for the segment in flight (`t_pause`) has a row of its own instead of hiding in "other"."""
    rows = [r3_row(step, t_rollout=0.01, t_pause=1.5, step_seconds=4.51, tokens=1000) for step in (1, 2, 3)]
    s = summarize_r3(write_r3_metrics(tmp_path / "metrics.csv", rows), replay="R3", gpus=2)
    assert s.generated_tokens_per_s_per_gpu == pytest.approx(2 * 1000 / (2 * 4.51) / 2)
    assert s.split == pytest.approx(
        {"rollout": 0.01, "old_logprob": 0.5, "update": 2.0, "weight_sync": 0.5, "pause": 1.5, "other": 0.0}
    )
    assert "|   pause (s) | 1.5 |" in table([s], ["async"])


def test_r3_metrics_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(MetricsError, match=r"metrics\.csv: no such file"):
        summarize_r3(tmp_path / "metrics.csv", replay="R3", gpus=1)
    bad = tmp_path / "other.csv"
    bad.write_text("step,tokens\n1,5\n")
    with pytest.raises(MetricsError, match=r"other\.csv: not an r3operator metrics\.csv \(no column step_seconds"):
        summarize_r3(bad, replay="R3", gpus=1)


def test_gpu_peaks_per_gpu_in_gib(tmp_path: Path) -> None:
    path = tmp_path / "gpu_memory.csv"
    path.write_text("0, 1024\n1, 2048\n0, 40960\n1, 512\nNVIDIA-SMI has failed\n")
    assert read_gpu_peaks(path) == [40.0, 2.0]
    assert read_gpu_peaks(tmp_path / "absent.csv") is None


def test_table_from_a_run_directory(tmp_path: Path) -> None:
    (tmp_path / "verl-R3").mkdir()
    write_verl_jsonl(tmp_path / "verl-R3" / "metrics.jsonl", VERL_STEPS)
    (tmp_path / "verl-R3" / "gpu_memory.csv").write_text("0, 40960\n1, 30720\n")
    runs = tmp_path / "r3" / JOB_NAME
    write_r3_metrics(runs / "r3" / "metrics.csv", [r3_row(1), r3_row(2), r3_row(3)])
    write_r3_metrics(runs / "disabled" / "metrics.csv", [r3_row(1), r3_row(2, tokens=2000)])
    text, summary = build_table(tmp_path, gpus=2)
    ours = (1000 + 1000) / (5.0 + 5.0) / 2  # r3operator R3, steps 2-3
    theirs = (64 + 32) * SAMPLES / (4.0 + 8.0) / 2
    assert f"{ours / theirs:.2f}×" in text
    header, _rule, *rows = text.split("\n\n")[1].splitlines()
    assert header == "| | verl R3 | r3operator R3 | verl disabled | r3operator disabled |"
    by_name = {r.split(" | ")[0].strip("| "): r.split(" | ")[1:] for r in rows}
    assert by_name["trained tokens/s/GPU"][0] == f"{theirs:.3g}"
    assert by_name["trained tokens/s/GPU"][2] == "not run"  # verl without replay did not run
    assert by_name["GPU peak memory per GPU (GiB, nvidia-smi)"][0] == "40 / 30"
    assert by_name["routing agreement (trainer's own routes vs rollout's)"][:2] == ["—", "0.9"]
    assert summary["verl disabled"] is None
    assert any("verl disabled" in p and "no such file" in p for p in summary["problems"])  # type: ignore[union-attr]
    assert math.isclose(summary["r3operator R3"]["trained_tokens_per_s_per_gpu"], ours)  # type: ignore[index]


def test_table_adds_r3operators_fast_run_beside_the_like_for_like_ones(tmp_path: Path) -> None:
    from benchmarks.peers.verl_vs_r3 import FAST, FAST_LABEL

    (tmp_path / "verl-R3").mkdir()
    write_verl_jsonl(tmp_path / "verl-R3" / "metrics.jsonl", VERL_STEPS)
    runs = tmp_path / "r3" / JOB_NAME
    write_r3_metrics(runs / "r3" / "metrics.csv", [r3_row(1), r3_row(2), r3_row(3)])
    text, _ = build_table(tmp_path, gpus=2)
    assert FAST_LABEL not in text  # not asked for: the four like-for-like columns only
    write_r3_metrics(runs / FAST / "metrics.csv", [r3_row(1), r3_row(2, step_seconds=2.5), r3_row(3, step_seconds=2.5)])
    text, summary = build_table(tmp_path, gpus=2)
    header = text.split("\n\n")[1].splitlines()[0]
    assert header.endswith(f"| r3operator disabled | {FAST_LABEL} |")
    theirs = (64 + 32) * SAMPLES / (4.0 + 8.0) / 2
    fast = (1000 + 1000) / (2.5 + 2.5) / 2
    assert f"{FAST_LABEL} / verl trained tokens/s/GPU with R3: {fast / theirs:.2f}×" in text
    assert math.isclose(summary[FAST_LABEL]["trained_tokens_per_s_per_gpu"], fast)  # type: ignore[index]


# ---- the inputs verl reads ------------------------------------------------------------------------------------


def test_arith_parquet_holds_every_row_in_verls_schema(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    source = REPO / "examples" / "data" / "arith.jsonl"
    lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    train, test = convert_arith(source, tmp_path)
    rows = pq.read_table(train).to_pylist()
    assert len(rows) == len(lines) == len(pq.read_table(test).to_pylist())
    for row, line in zip(rows, lines, strict=True):
        assert row["prompt"] == [{"role": "user", "content": line["prompt"]}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": line["answer"]}
        assert row["data_source"] == DATA_SOURCE
        assert compute_score(row["data_source"], f"so the answer is {line['answer']}", line["answer"]) == 1.0


def test_a_row_with_a_worked_solution_is_scored_against_its_answer_by_verl(tmp_path: Path) -> None:
    """verl trains RL only here (no SFT): a row's `solution`, the r3operator warm-up's target, is not its reward."""
    import pyarrow.parquet as pq

    source = tmp_path / "chain.jsonl"
    row = {"prompt": "what is 3 plus 4 minus 2 ?", "answer": "5", "solution": "3 plus 4 is 7 , 7 minus 2 is 5"}
    source.write_text(json.dumps(row) + "\n")
    train, _ = convert_arith(source, tmp_path / "out")
    [converted] = pq.read_table(train).to_pylist()
    assert converted["reward_model"] == {"style": "rule", "ground_truth": "5"}
    assert converted["prompt"] == [{"role": "user", "content": row["prompt"]}]


def test_bad_jsonl_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"prompt": "what is 1 plus 1 ?", "answer": "2"}\n{"prompt": "x"}\n')
    with pytest.raises(ConversionError, match=r"d\.jsonl:2: field 'answer'"):
        read_jsonl(bad)
    with pytest.raises(ConversionError, match=r"d\.jsonl:2: field 'answer'"):
        convert_arith(bad, tmp_path / "out")
    assert not (tmp_path / "out" / "train.parquet").exists()  # nothing half-written


def test_reward_is_r3operators_math_reward() -> None:
    assert compute_score(DATA_SOURCE, "4", "4") == 1.0
    assert compute_score(DATA_SOURCE, "1 plus 3 is 5", "4") == 0.0
    assert compute_score(DATA_SOURCE, "\\boxed{1/2}", "0.5") == 1.0
    with pytest.raises(ValueError, match="gsm8k"):
        compute_score("gsm8k", "4", "4")


def test_verl_config_matches_the_rljob_and_switches_both_r3_halves() -> None:
    from r3operator.api import load_rljob

    spec = load_rljob(JOB).spec
    work = Workload()
    assert (work.prompts_per_step, work.group_size, work.max_response_tokens) == (
        spec.rollout.prompts_per_step,
        spec.rollout.group_size,
        spec.rollout.max_tokens,
    )
    assert (work.learning_rate, work.clip_low, work.clip_high, work.mini_batches) == (
        spec.algorithm.learning_rate,
        spec.algorithm.clip_ratio_low,
        spec.algorithm.clip_ratio_high,
        spec.algorithm.mini_batches,
    )
    assert (work.temperature, work.seed, work.engine_memory_fraction) == (
        spec.rollout.temperature,
        spec.seed,
        spec.inference.gpu_memory_utilization,
    )
    assert spec.algorithm.sft_warmup_steps == 0  # verl has no SFT warm-up

    def overrides(replay: str) -> dict[str, str]:
        items = verl_overrides(
            model_dir=Path("/m"),
            data_dir=Path("/d"),
            reward_file=Path("/r.py"),
            gpus=2,
            steps=30,
            replay=replay,
            log_file=Path("/o/metrics.jsonl"),
        )
        return dict(item.split("=", 1) for item in items)

    on, off = overrides("R3"), overrides("disabled")
    assert on["actor_rollout_ref.actor.megatron.router_replay.mode"] == "R3"
    assert on["actor_rollout_ref.rollout.enable_rollout_routing_replay"] == "True"
    assert off["actor_rollout_ref.actor.megatron.router_replay.mode"] == "disabled"
    assert off["actor_rollout_ref.rollout.enable_rollout_routing_replay"] == "False"
    assert {k for k in on if on[k] != off[k]} == {
        "actor_rollout_ref.actor.megatron.router_replay.mode",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay",
        "trainer.experiment_name",
    }
    # verl counts a mini-batch in prompts and multiplies by n; two mini-batches per step as in the RLJob
    assert int(on["actor_rollout_ref.actor.ppo_mini_batch_size"]) * spec.algorithm.mini_batches == 16
    assert on["trainer.n_gpus_per_node"] == "2" and on["trainer.total_training_steps"] == "30"
    with pytest.raises(ValueError, match="replay"):
        overrides("R2")
    # both engines decode alike: verl's vLLM is eager exactly when r3operator's `vllm serve` is
    from r3operator.api.vllm_args import vllm_serve_args

    ours_eager = "--enforce-eager" in vllm_serve_args(spec, model_path="/m")
    assert on["actor_rollout_ref.rollout.enforce_eager"] == str(ours_eager)


# ---- torch: the model export and verl's metrics hook ------------------------------------------------------------


@pytest.mark.slow
def test_exported_model_loads_the_way_verl_loads_it(tmp_path: Path) -> None:
    from benchmarks.peers.verl_inputs import check_hf_layout, export_model

    model_dir = export_model("tiny", tmp_path / "model")
    assert not model_dir.is_symlink() and (model_dir / "model.safetensors").is_file()
    facts = check_hf_layout(model_dir)
    assert facts["architectures"] == ["Qwen3MoeForCausalLM"] and facts["model_type"] == "qwen3_moe"
    assert (facts["num_experts"], facts["top_k"]) == (32, 4)
    assert facts["logits_shape"] == [1, facts["prompt_tokens"], 512] and facts["finite"]
    assert facts["chat_text"].endswith("assistant :")


def load_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modules: dict[str, str]) -> None:
    """Stand-ins for verl's and mbridge's modules at their real import paths (`modules`: dotted name -> source),
    then the hook loaded the way Python loads a sitecustomize; its finder is removed at the test's end."""
    for dotted, source in modules.items():
        parts = dotted.split(".")
        for i in range(1, len(parts)):
            package = tmp_path.joinpath(*parts[:i])
            package.mkdir(parents=True, exist_ok=True)
            (package / "__init__.py").touch()
        tmp_path.joinpath(*parts[:-1], parts[-1] + ".py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] in {d.split(".")[0] for d in modules}]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the hook's finder goes with the test
    hook_path = REPO / "benchmarks" / "peers" / "verl_hook" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("peer_sitecustomize", hook_path)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_hook_gives_mbridge_the_rope_theta_transformers_5_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bridge = (
        "class AutoBridge:\n"
        "    @classmethod\n"
        "    def from_config(cls, hf_config, **kwargs):\n"
        "        return (cls.__name__, hf_config.rope_theta, kwargs)\n"  # what mbridge's LLMBridge reads
    )
    load_hook(tmp_path, monkeypatch, {"mbridge.core.auto_bridge": bridge})
    from mbridge.core.auto_bridge import AutoBridge  # type: ignore[import-not-found]

    config = type("Config", (), {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})()
    assert AutoBridge.from_config(config, dtype="bf16") == ("AutoBridge", 1e6, {"dtype": "bf16"})
    legacy = type("Legacy", (), {"rope_theta": 5.0, "rope_parameters": {"rope_theta": 1e6}})()
    assert AutoBridge.from_config(legacy)[1] == 5.0  # a config that has it keeps its own


def test_hook_gives_mbridge_the_model_type_megatron_core_0_19_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mbridge 0.15.1's get_model, as it reads against megatron-core 0.19's ModelType (no encoder_and_decoder).
    util = (
        "import enum\n"
        "class ModelType(enum.Enum):\n"
        "    encoder_or_decoder = 1\n"
        "def build_model(model_type):\n"
        "    return 'encoder-decoder' if model_type == ModelType.encoder_and_decoder else 'decoder'\n"
    )
    load_hook(tmp_path, monkeypatch, {"mbridge.core.util": util})
    from mbridge.core.util import ModelType, build_model  # type: ignore[import-not-found]

    assert build_model(ModelType.encoder_or_decoder) == "decoder"
    assert list(ModelType) == [ModelType.encoder_or_decoder]  # no member added: iteration and lookup unchanged


def test_hook_gives_a_tokenizer_without_chatml_verls_generic_token_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from r3operator.models.tokenizer import build_tokenizer

    # verl 0.9.1's wiring, reduced to what decides: model_type qwen3_moe → the Qwen builder, which checks the newline.
    wiring = (
        "def create_continuous_token_builder(tokenizer, *, model_family='auto', hf_model_type=None, **kw):\n"
        "    if model_family == 'auto' and hf_model_type == 'qwen3_moe':\n"
        "        if len(tokenizer.encode('\\n', add_special_tokens=False)) != 1:\n"
        "            raise ValueError('Expected Qwen newline to tokenize to one token')\n"
        "        return 'qwen'\n"
        "    return model_family\n"
    )
    load_hook(tmp_path, monkeypatch, {"verl.utils.tokenizer.continuous_token_wiring": wiring})
    from verl.utils.tokenizer.continuous_token_wiring import (  # type: ignore[import-not-found]
        create_continuous_token_builder,
    )

    class HFTokenizer:  # the two calls verl makes, over the reference models' own tokenizer
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            if text in self.vocab:
                return [self.vocab[text]]
            return [self.vocab[t] for t in text.split() if t in self.vocab]  # word-level: "\n" alone is nothing

    reference = HFTokenizer(build_tokenizer(256).get_vocab())
    assert create_continuous_token_builder(reference, hf_model_type="qwen3_moe") == "default"
    chatml = HFTokenizer({"<|im_end|>": 0, "\n": 1})
    assert create_continuous_token_builder(chatml, hf_model_type="qwen3_moe") == "qwen"  # a real Qwen keeps its own
    assert create_continuous_token_builder(reference, model_family="qwen", hf_model_type="x") == "qwen"  # explicit


def test_hook_still_runs_the_sitecustomize_it_shadows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image_site = tmp_path / "image-site"
    image_site.mkdir()
    (image_site / "sitecustomize.py").write_text("import os\nos.environ['R3_TEST_IMAGE_SITECUSTOMIZE'] = 'ran'\n")
    monkeypatch.syspath_prepend(str(image_site))
    monkeypatch.delenv("R3_TEST_IMAGE_SITECUSTOMIZE", raising=False)
    load_hook(tmp_path / "stand-ins", monkeypatch, {})
    assert os.environ.get("R3_TEST_IMAGE_SITECUSTOMIZE") == "ran"


@pytest.mark.slow
def test_hook_adds_logprob_metrics_to_verls_debug_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    metrics_source = "def calculate_debug_metrics(data):\n    return {'training/rollout_probs_diff_mean': 0.5}\n"
    load_hook(tmp_path, monkeypatch, {"verl.utils.debug.metrics": metrics_source})
    import verl.utils.debug.metrics as metrics  # type: ignore[import-not-found]

    rollout = torch.tensor([[0.0, -1.0, -2.0, -3.0], [-0.5, -0.5, -0.5, -0.5]])
    trainer = torch.tensor([[0.0, -1.5, -2.0, -9.0], [-0.25, -0.5, -0.5, -0.5]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # -9.0 is padding and must not count
    batch = {
        "rollout_log_probs": rollout,
        "old_log_probs": trainer,
        "response_mask": mask,
        "responses": torch.zeros(2, 4),
    }
    got = metrics.calculate_debug_metrics(type("Data", (), {"batch": batch})())
    log_ratios = [0.0, -0.5, 0.0, 0.25, 0.0]  # trainer - rollout over the 5 unmasked tokens
    assert got["training/rollout_probs_diff_mean"] == 0.5  # verl's own metrics stay
    assert got["peer/logprob_abs_diff_mean"] == pytest.approx(sum(abs(x) for x in log_ratios) / 5)
    assert got["peer/logprob_abs_diff_max"] == pytest.approx(0.5)
    assert got["peer/kl_k3"] == pytest.approx(sum(math.expm1(x) - x for x in log_ratios) / 5)
    assert got["peer/extreme_token_fraction"] == 0.0  # no |log r| above ln 2
    # r3operator's extreme tokens: |log r| > ln 2 = 0.6931 (0.7, -0.7 and -5.0, not 0.69; 9.0 is padding)
    batch = {
        "rollout_log_probs": torch.zeros(1, 5),
        "old_log_probs": torch.tensor([[0.7, -0.7, 0.69, -5.0, 9.0]]),
        "response_mask": torch.tensor([[1, 1, 1, 1, 0]]),
        "responses": torch.zeros(1, 5),
    }
    got = metrics.calculate_debug_metrics(type("Data", (), {"batch": batch})())
    assert got["peer/extreme_token_fraction"] == pytest.approx(3 / 4)


def test_memory_sampler_reads_only_the_gpus_the_run_was_given() -> None:
    from benchmarks.gpu_memory import nvidia_smi_memory_query

    base = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    assert nvidia_smi_memory_query({}) == base
    assert nvidia_smi_memory_query({"CUDA_VISIBLE_DEVICES": "2, 3"}) == [*base, "--id=2,3"]
    # UUIDs or MIG names are not indices nvidia-smi's index column would show: sample every GPU, as before.
    assert nvidia_smi_memory_query({"CUDA_VISIBLE_DEVICES": "GPU-8a1f"}) == base


def r3_args(out: Path, gpus: int, **given: Any) -> Any:
    """verl_vs_r3's options for the r3 part on GPUs, as its parser reads `--steps 20`, with `given` changed."""
    from benchmarks.peers.verl_vs_r3 import build_parser

    args = build_parser().parse_args(["--gpus", str(gpus), "--out", str(out), "--steps", "20"])
    for name, value in given.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize("gpus", [2, 4])
def test_r3_side_on_gpus_runs_both_modes_through_up_engine_and_trainer_apart(tmp_path: Path, gpus: int) -> None:
    from benchmarks.peers.verl_vs_r3 import r3_up_commands
    from r3operator.api.load import load_rljob, parse_rljob
    from r3operator.api.rules import errors, evaluate
    from r3operator.cli.up.plan import plan_up

    args = r3_args(tmp_path, gpus)
    assert [sub for sub, _, _ in r3_up_commands(args)] == ["r3", "disabled"]  # the target's column first
    args.skip_r3_disabled = True
    assert [sub for sub, _, _ in r3_up_commands(args)] == ["r3"]
    args.r3_fast, args.skip_r3_disabled = True, False
    runs = r3_up_commands(args)
    assert [sub for sub, _, _ in runs] == ["r3", "r3-fast", "disabled"]
    base = load_rljob(JOB).spec.model_dump()
    for sub, cmd, metrics in runs:
        assert cmd[:2] == ["r3operator", "up"] and cmd[cmd.index("--gpus") + 1] == ",".join(map(str, range(gpus)))
        assert metrics == tmp_path / "r3" / JOB_NAME / sub / "metrics.csv"  # where build_table reads it
        job = load_rljob(Path(cmd[2]))
        spec = job.spec.model_dump()
        assert errors(evaluate(job.spec)) == []  # the rules would start it, the fast settings included
        assert job.spec.routing_replay.mode.value == ("Disabled" if sub == "disabled" else "R3")
        # Everything verl's configuration is matched against stays as the committed RLJob has it, but in the fast
        # run the sync's layout and the algorithm's mode.
        fast = {"weight_sync": {"layout": "kernel"}, "algorithm": {"mode": "async"}} if sub == "r3-fast" else {}
        for key in ("rollout", "algorithm", "task", "seed", "weight_sync", "model"):
            assert spec[key] == ({**base[key], **fast[key]} if key in fast else base[key]), key
        committed = load_rljob(JOB).spec.weight_sync.layout.value  # the API's default since vLLM >= 0.30: auto
        assert (job.spec.weight_sync.layout.value, job.spec.algorithm.mode) == (
            ("kernel", "async") if sub == "r3-fast" else (committed, "sync")
        )
        assert spec["inference"] == base["inference"]
        plan = plan_up(
            parse_rljob(yaml.safe_load(Path(cmd[2]).read_text())),
            run_dir=tmp_path / "plan",
            gpus=[str(g) for g in range(gpus)],
            bin_dir=tmp_path,
            host_path="",
        )
        engine_gpus = [g for e in plan.engines for g in e.gpus]
        assert len(engine_gpus) == 1 and sorted(engine_gpus + plan.trainer.gpus) == [str(g) for g in range(gpus)]


def test_r3_engines_takes_gpus_from_the_trainer_and_the_table_says_so(tmp_path: Path) -> None:
    from benchmarks.peers.verl_vs_r3 import main, r3_layout_line, r3_up_commands
    from r3operator.api.load import parse_rljob
    from r3operator.cli.up.plan import plan_up

    args = r3_args(tmp_path, 4, skip_r3_disabled=True, r3_engines=3)
    [(_, cmd, _)] = r3_up_commands(args)
    plan = plan_up(
        parse_rljob(yaml.safe_load(Path(cmd[2]).read_text())),
        run_dir=tmp_path / "plan",
        gpus=["0", "1", "2", "3"],
        bin_dir=tmp_path,
        host_path="",
    )
    assert [g for e in plan.engines for g in e.gpus] == ["0", "1", "2"] and plan.trainer.gpus == ["3"]
    assert r3_layout_line(Path(cmd[2])) == [
        "r3operator's GPUs: 3 engine replica(s), a GPU each; the trainer over 1 rank(s).",
        "",
    ]
    assert r3_layout_line(tmp_path / "missing.yaml") == []
    with pytest.raises(SystemExit):
        main(["--gpus", "4", "--out", str(tmp_path), "--r3-engines", "4", "--parts", "table"])


# ---- Transformer Engine's attention: verl's backend and the preflight that checks it before verl starts ----------

ATTENTION_KEY = "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend"
# TE 2.x's words (transformer_engine/pytorch/attention/dot_product_attention/{utils,dot_product_attention}.py).
TE_NO_BACKEND = (
    "No dot product attention backend is available for the provided inputs. Please run with NVTE_DEBUG=1 "
    "NVTE_DEBUG_LEVEL=2 to find out the reasons for disabling all backends."
)


def wheel_set() -> list[str]:
    """The package specs of verl-wheels.sh's `pkgs=( … )` array: what verl's site dir can hold."""
    text = (REPO / "benchmarks" / "peers" / "verl-wheels.sh").read_text()
    body = text.split("pkgs=(", 1)[1].split(")", 1)[0]
    return [word.split("==")[0].lower() for word in body.split()]


def test_verl_runs_with_an_attention_backend_its_wheels_provide() -> None:
    from benchmarks.peers.verl_config import ATTENTION_BACKEND
    from benchmarks.peers.verl_vs_r3 import preflight_command

    items = dict(
        item.split("=", 1)
        for item in verl_overrides(
            model_dir=Path("/m"),
            data_dir=Path("/d"),
            reward_file=Path("/r.py"),
            gpus=2,
            steps=3,
            replay="R3",
            log_file=Path("/o/metrics.jsonl"),
        )
    )
    # verl 0.9.1 defaults to `flash` (its engine/megatron.yaml); megatron-core then turns TE's fused and unfused
    # backends off, and flash-attn is not among verl's wheels (no build for torch 2.11 + CUDA 13).
    assert not {"flash-attn", "flash_attn", "flash-attn-3"} & set(wheel_set())
    assert items[ATTENTION_KEY] not in {"flash", "local"}
    assert items[ATTENTION_KEY] == ATTENTION_BACKEND in {"fused", "auto", "unfused"}
    # the preflight checks the very setting verl runs with
    cmd = preflight_command("/py", Path("/m"))
    assert cmd[cmd.index("--attention-backend") + 1] == items[ATTENTION_KEY]
    assert cmd[:3] == ["/py", "-m", "benchmarks.peers.te_preflight"] and cmd[cmd.index("--model") + 1] == "/m"


def test_preflight_reads_heads_from_the_model_config(tmp_path: Path) -> None:
    from benchmarks.peers.te_preflight import AttentionShape, PreflightError, attention_shape, packed_lengths

    config = tmp_path / "config.json"
    # the a3b export's attention (r3operator/models/reference.py: Qwen3-30B-A3B's layer)
    config.write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}))
    assert attention_shape(config) == AttentionShape(heads=32, kv_heads=4, head_dim=128)
    config.write_text(json.dumps({"num_attention_heads": 12, "hidden_size": 768}))  # no head_dim, no GQA
    assert attention_shape(config) == AttentionShape(heads=12, kv_heads=12, head_dim=64)
    config.write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": "4", "head_dim": 128}))
    with pytest.raises(PreflightError, match=r"config\.json: field 'num_key_value_heads'"):
        attention_shape(config)
    config.write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 5, "head_dim": 128}))
    with pytest.raises(PreflightError, match="not a multiple"):
        attention_shape(config)
    with pytest.raises(PreflightError, match=r"missing\.json"):
        attention_shape(tmp_path / "missing.json")
    # one micro-batch of verl's: 8 sequences of prompt (≤ 64) + response (≤ 64) tokens, the longest at the limit
    lengths = packed_lengths(8, 128)
    assert lengths == [128, 112, 96, 80, 64, 48, 32, 16]
    assert packed_lengths(3, 2) == [2, 2, 1]  # never empty


def verdict_line(**fields: object) -> str:
    """A probe's last line as te_preflight prints it: `TE_PREFLIGHT ` + its JSON."""
    return "TE_PREFLIGHT " + json.dumps(fields)


def test_preflight_decision_on_the_probes_output() -> None:
    from benchmarks.peers.verl_vs_r3 import read_preflight

    fused = {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"}
    passed = verdict_line(
        ok=True,
        attention_backend="fused",
        switches=fused,
        passes={"compute_log_prob (eval forward)": "FusedAttention (sub-backend 1)"},
        reason="",
        te_log=[],
    )
    ok = read_preflight(f"shape …\n{passed}\n", 0)
    assert ok.ok and "FusedAttention (sub-backend 1)" in ok.message and "attention_backend=fused" in ok.message
    assert not read_preflight(f"{passed}\n", 1).ok  # a verdict is trusted only with exit status 0

    failed = verdict_line(
        ok=False,
        attention_backend="flash",
        switches={"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
        passes={},
        reason=f"ValueError: {TE_NO_BACKEND}",
        te_log=[
            "Disabling FusedAttention due to NVTE_FUSED_ATTN=0",
            "Disabling UnfusedDotProductAttention due to NVTE_UNFUSED_ATTN=0",
        ],
    )
    no = read_preflight(f"[TE DEBUG] …\n{failed}\n", 1)
    assert not no.ok
    for words in (
        "No dot product attention backend",
        "attention_backend=flash",
        "NVTE_FUSED_ATTN=0",
        "NVTE_UNFUSED_ATTN=0",
    ):
        assert words in no.message
    died = read_preflight("Traceback (most recent call last):\nImportError: libcudnn.so.9: cannot open\n", 1)
    assert not died.ok and died.message == "no verdict (exit status 1): ImportError: libcudnn.so.9: cannot open"
    assert read_preflight("", 124).message == "no verdict (exit status 124): no output"
    assert not read_preflight("TE_PREFLIGHT {not json\n", 0).ok


# A stand-in for the probe: prints what te_preflight prints and exits as it does, and shows which GPU it was given.
FAKE_PROBE = """
import os, sys
print("gpu=" + os.environ.get("CUDA_VISIBLE_DEVICES", ""))
print({line!r})
sys.exit({rc})
"""


def verl_part_args(tmp_path: Path) -> Any:
    import argparse

    (tmp_path / "inputs" / "model").mkdir(parents=True)
    (tmp_path / "inputs" / "model" / "config.json").write_text("{}")
    (tmp_path / "inputs" / "data").mkdir(parents=True)
    (tmp_path / "inputs" / "data" / "train.parquet").write_bytes(b"")
    return argparse.Namespace(
        out=tmp_path,
        gpus=2,
        steps=3,
        model="a3b",
        site="/s",
        verl_site="/v",
        timeout_s=5,
        device="cuda",
        warm_start_steps=0,
    )


@pytest.mark.parametrize("passes", [False, True])
def test_verl_part_starts_verl_only_after_the_preflight_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, passes: bool
) -> None:
    from benchmarks.peers import verl_vs_r3

    line = verdict_line(
        ok=passes,
        attention_backend="fused",
        switches={},
        passes={"update_actor": "FusedAttention (sub-backend 1)" if passes else None},
        reason="" if passes else f"ValueError: {TE_NO_BACKEND}",
        te_log=[] if passes else ["Disabling FusedAttention due to NVTE_FUSED_ATTN=0"],
    )
    script = FAKE_PROBE.format(line=line, rc=0 if passes else 1)
    monkeypatch.setattr(verl_vs_r3, "preflight_command", lambda python, model: [sys.executable, "-c", script])
    started: list[list[str]] = []

    def run_logged(name: str, cmd: list[str], env: dict[str, str], out: Path, timeout_s: int) -> int:
        started.append(cmd)
        return 0

    monkeypatch.setattr(verl_vs_r3, "run_logged", run_logged)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    args = verl_part_args(tmp_path)
    run_dir = tmp_path / "verl-R3"
    run_dir.mkdir()
    (run_dir / "console.log").write_text("step:1 - timing_s/step:1.0\n")  # an earlier run's log: not read again

    rc = verl_vs_r3.run_part("verl-R3", args)

    log = (run_dir / "preflight.log").read_text()
    assert "gpu=2\n" in log and line in log  # on the first of the run's GPUs, its output kept
    if passes:
        assert rc == 0 and len(started) == 1 and "verl.trainer.main_ppo" in started[0]
        assert not (run_dir / "not-started.txt").exists()
        return
    assert rc != 0 and started == []  # verl never started
    assert not (run_dir / "console.log").exists()
    _text, summary = build_table(tmp_path, gpus=2)
    assert summary["verl R3"] is None
    problem = next(p for p in summary["problems"] if str(p).startswith("verl R3:"))
    assert "not started: Transformer Engine preflight failed" in str(problem)
    assert "NVTE_FUSED_ATTN=0" in str(problem) and "No dot product attention backend" in str(problem)


@pytest.mark.slow
def test_megatron_turns_verls_default_flash_into_flash_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's own switch setting, read through te_preflight; the expected values are Megatron's opt-out
    semantics written out: `flash` keeps only flash-attn, `fused` only cuDNN."""
    from benchmarks.peers.te_preflight import PreflightError, megatron_attention_env
    from benchmarks.peers.verl_config import ATTENTION_BACKEND

    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")  # whatever the caller's process has, it keeps
    assert megatron_attention_env("flash") == {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}
    assert megatron_attention_env("fused") == {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"}
    assert megatron_attention_env(ATTENTION_BACKEND)["NVTE_FUSED_ATTN"] == "1"
    assert os.environ["NVTE_FUSED_ATTN"] == "1" and "NVTE_UNFUSED_ATTN" not in os.environ
    with pytest.raises(PreflightError, match="--attention-backend"):
        megatron_attention_env("flash3")


# A stand-in for Transformer Engine's torch package at its import paths: DotProductAttention that picks its backend
# from the NVTE_* switches the way TE does when flash-attn is absent, logs its reasons on the logger TE uses, and
# computes packed (thd) attention per sequence; MODE = "causal" or "broken" (ignores the causal mask).
FAKE_TE = """
import logging, os
import torch
import torch.nn.functional as F
from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import _attention_backends

MODE = {mode!r}
log = logging.getLogger("DotProductAttention")
log.setLevel(logging.DEBUG if os.environ.get("NVTE_DEBUG") == "1" else logging.WARNING)


class DotProductAttention(torch.nn.Module):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups, attention_dropout, qkv_format,
                 attn_mask_type, layer_number, attention_type):
        super().__init__()
        self.heads, self.groups = num_attention_heads, num_gqa_groups

    def forward(self, q, k, v, mask, *, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv,
                cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv):
        assert (qkv_format, attn_mask_type) == ("thd", "padding_causal") and mask is None
        fused = os.environ.get("NVTE_FUSED_ATTN", "1") == "1"
        unfused = os.environ.get("NVTE_UNFUSED_ATTN", "1") == "1"
        if not fused:
            log.debug("Disabling FusedAttention due to NVTE_FUSED_ATTN=0")
        if not unfused:
            log.debug("Disabling UnfusedDotProductAttention due to NVTE_UNFUSED_ATTN=0")
        _attention_backends.update(use_flash_attention=False, use_fused_attention=fused,
                                   fused_attention_backend=1 if fused else None,
                                   use_unfused_attention=unfused and not fused)
        if not (fused or unfused):
            raise ValueError({no_backend!r})
        bounds = cu_seqlens_q.tolist()
        outs = []
        for start, end in zip(bounds, bounds[1:]):
            group = self.heads // self.groups
            qs = q[start:end].transpose(0, 1).float()
            ks = k[start:end].repeat_interleave(group, dim=1).transpose(0, 1).float()
            vs = v[start:end].repeat_interleave(group, dim=1).transpose(0, 1).float()
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=MODE == "causal")
            outs.append(o.transpose(0, 1).reshape(end - start, -1))
        return torch.cat(outs).to(q.dtype)
"""


def install_fake_te(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    root = tmp_path / f"te-{mode}"
    pkg = root / "transformer_engine" / "pytorch" / "attention" / "dot_product_attention"
    pkg.mkdir(parents=True)
    for folder in (root / "transformer_engine", root / "transformer_engine" / "pytorch" / "attention", pkg):
        (folder / "__init__.py").touch()
    (pkg / "dot_product_attention.py").write_text("_attention_backends = {}\n")
    (root / "transformer_engine" / "pytorch" / "__init__.py").write_text(
        FAKE_TE.format(mode=mode, no_backend=TE_NO_BACKEND)
    )
    monkeypatch.syspath_prepend(str(root))
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("NVTE_DEBUG", "NVTE_DEBUG_LEVEL", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.setenv(name, "")  # recorded, so what the probe sets goes at the test's end
        monkeypatch.delenv(name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "mode", "ok", "words"),
    [
        ("fused", "causal", True, "FusedAttention (sub-backend 1)"),
        ("flash", "causal", False, "Disabling FusedAttention due to NVTE_FUSED_ATTN=0"),  # verl's default
        ("fused", "broken", False, "differs from PyTorch's attention"),  # a backend that computes the wrong thing
    ],
)
def test_probe_runs_both_passes_and_reports_tes_choice_or_reasons(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, mode: str, ok: bool, words: str
) -> None:
    from benchmarks.peers.te_preflight import AttentionShape, megatron_attention_env, probe

    # megatron-core imported before the stand-in is on the path: it asks an importable TE for its wheel's version
    megatron_attention_env("fused")
    install_fake_te(tmp_path, monkeypatch, mode)
    try:
        verdict = probe(AttentionShape(heads=4, kv_heads=2, head_dim=16), [9, 5, 1], backend, device="cpu")
    finally:  # the stand-in's modules go with the test: later tests in this process must not find them
        for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
            del sys.modules[name]
    assert verdict.ok is ok
    assert words in (" ".join(verdict.te_log) + verdict.reason + str(verdict.passes))
    if ok:
        assert list(verdict.passes) == ["compute_log_prob (eval forward)", "update_actor (train forward+backward)"]
        assert verdict.max_abs_error is not None and verdict.max_abs_error <= 0.1
    if backend == "flash":
        assert "No dot product attention backend" in verdict.reason
        assert "Disabling UnfusedDotProductAttention due to NVTE_UNFUSED_ATTN=0" in verdict.te_log


def _run(reward: list[float], diffs: dict[int, float]) -> RunSummary:
    return RunSummary(
        framework="x", replay="R3", gpus=2, steps=len(reward), measured_steps=len(reward) - 1,
        generated_tokens_per_s_per_gpu=1.0, trained_tokens_per_s_per_gpu=1.0, step_seconds=1.0, split={},
        trainer_peak_gib=None, gpu_peak_gib=None, logprob_abs_diff_mean=None, logprob_abs_diff_max=None,
        kl_k3=None, routing_agreement=None, reward=reward, logprob_abs_diff_by_step=diffs,
    )  # fmt: skip


def test_fidelity_on_the_initial_weights_stops_at_the_first_rewarded_step_of_any_run() -> None:
    """A run's policy first moves in the update of its first step with a reward: that step's rollout still came
    from the initial weights. The asynchronous run (|Δlogprob| at step 1 only) does not bound the window."""
    a = _run([0, 0, 0, 0.5, 0, 0.2], {s: 0.01 * s for s in range(1, 7)})
    b = _run([0, 0, 0, 0, 0, 0.1], {s: 0.001 for s in range(1, 7)})
    asynchronous = _run([0, 0.5, 0, 0, 0, 0], {1: 0.5})
    runs = [a, b, asynchronous, None]
    assert initial_weights_steps(runs) == [2, 3, 4]  # a's first reward at step 4; step 1 left out
    text = table(runs, ["a", "b", "async", "absent"])
    row = next(line for line in text.splitlines() if "initial weights" in line)
    assert row.startswith("| mean \\|Δlogprob\\|, steps 2–4 ")
    assert row.endswith("| 0.03 | 0.001 | — | not run |")  # a: (0.02 + 0.03 + 0.04) / 3; async: none logged
    assert initial_weights_steps([_run([0.3, 0], {1: 0.1, 2: 0.2})]) == [1]
    assert initial_weights_steps([asynchronous]) == []
    assert "initial weights" not in table([asynchronous], ["async"])
