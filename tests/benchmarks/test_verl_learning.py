"""The verl comparison at the learning workload (benchmarks/peers/verl_learning.py), on CPU: verl's configuration built
from the learning benchmark's RLJob and checked against verl's own, its inputs and reward, the per-step figures of
both frameworks read back into one summary, the dry run and the detached runner. verl is never imported; its logs are
samples written here in its formats (`FileLogger` JSONL lines, the v1 trainer's metric names) and every expected
figure is written out below (the workload's from issue 44: 64 prompts × 8 samples, ≤ 512 response tokens, ≤ 256
prompt tokens, 4 mini-batches, lr 2e-5, eval every 10 steps).

What was read in verl 0.9.1's wheel (`pip download --no-deps verl==0.9.1`) is kept as assertions on the keys and
values set here; `test_every_key_is_one_of_verls_own` checks every key against the wheel's generated config when a
wheel is at hand (R3_VERL_WHEEL, or benchmarks/peers/verl-wheels.sh's .whl-verl/), and no test downloads anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import learning
from benchmarks.peers import verl_learning as vl
from benchmarks.peers.verl_reference import (
    REFERENCE,
    ReferenceError,
    apply_overrides,
    changes,
    parse_value,
    read_reference,
    resolve,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "peers" / "verl-learning.sh"
ACTOR, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


def verl_wheel() -> Path | None:
    given = os.environ.get("R3_VERL_WHEEL")
    if given:
        return Path(given)
    found = sorted(REPO.glob(".whl-verl/part-*/verl-0.9.1-*.whl"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, dict[str, dict[str, str]]]]:
    """The override dict of each mode on 1 and 4 GPUs, built as the runner builds it (no warm start yet: the reference
    model's config, which the warm start keeps)."""
    pytest.importorskip("transformers")
    out: dict[int, dict[str, dict[str, str]]] = {}
    base = tmp_path_factory.mktemp("learning")
    for gpus in (1, 4):
        setup = vl.Setup(learning_dir=base / "L", out=base / f"O{gpus}", gpus=gpus, steps=50)
        with vl.model_config_dir(setup) as config_dir:
            specs = {mode: vl.parsed_spec(vl.job_document(setup, mode, config_dir)) for mode in vl.MODES}
        out[gpus] = {
            mode: dict(
                item.split("=", 1)
                for item in vl.overrides_for(setup, mode, vl.learning_workload(specs[mode], engine_memory_fraction=0.5))
            )
            for mode in vl.MODES
        }
    yield out


# ---- the configuration ------------------------------------------------------------------------------------------


def test_verl_runs_the_learning_workload_of_issue_44(workloads: dict[int, dict[str, dict[str, str]]]) -> None:
    for gpus in (1, 4):
        on = workloads[gpus]["R3"]
        assert (on["data.train_batch_size"], on[f"{ROLLOUT}.n"]) == ("64", "8")  # 64 prompts × 8 samples
        assert (on["data.max_response_length"], on["data.max_prompt_length"]) == ("512", "256")
        assert on[f"{ACTOR}.ppo_mini_batch_size"] == "16"  # verl counts prompts: 64 / 16 = 4 mini-batches
        assert on[f"{ACTOR}.ppo_epochs"] == "1"
        assert float(on[f"{ACTOR}.optim.lr"]) == 2e-5
        assert float(on[f"{ACTOR}.optim.weight_decay"]) == 0.0  # r3operator's AdamW; verl's default is 0.01
        assert float(on[f"{ACTOR}.optim.clip_grad"]) == 1.0
        assert (float(on[f"{ACTOR}.clip_ratio_low"]), float(on[f"{ACTOR}.clip_ratio_high"])) == (0.2, 0.28)
        assert float(on[f"{ACTOR}.clip_ratio_c"]) == 3.0  # dual clip
        assert on[f"{ACTOR}.use_kl_loss"] == "False" and on["algorithm.use_kl_in_reward"] == "False"
        assert on[f"{ACTOR}.entropy_coeff"] == "0" and on[f"{ACTOR}.loss_agg_mode"] == "token-mean"
        assert on["algorithm.adv_estimator"] == "grpo" and on["algorithm.norm_adv_by_std_in_grpo"] == "True"
        assert float(on[f"{ROLLOUT}.temperature"]) == 1.0 and on[f"{ROLLOUT}.dtype"] == "bfloat16"
        assert float(on[f"{ROLLOUT}.gpu_memory_utilization"]) == 0.5
        assert on[f"{ROLLOUT}.max_num_seqs"] == "512"  # the learning engine's --max-num-seqs
        # micro-batches by tokens, as the learning RLJob's fsdp.microBatchTokens
        assert on[f"{ACTOR}.use_dynamic_bsz"] == "True"
        assert on[f"{ACTOR}.ppo_max_token_len_per_gpu"] == on[f"{ROLLOUT}.log_prob_max_token_len_per_gpu"]
        assert on[f"{ACTOR}.ppo_max_token_len_per_gpu"] == str(learning.Plan().micro_batch_tokens)
        # held-out eval every 10 steps and before the first, one answer per prompt at the rollout temperature
        assert on["data.val_files"].endswith("/inputs/data/val.parquet")
        assert (on["trainer.test_freq"], on["trainer.val_before_train"]) == ("10", "True")
        assert float(on[f"{ROLLOUT}.val_kwargs.temperature"]) == 1.0 and on[f"{ROLLOUT}.val_kwargs.n"] == "1"
        assert on[f"{ROLLOUT}.val_kwargs.do_sample"] == "True"
        # the layout: Megatron on every GPU with its experts split over all of them, a vLLM replica of TP 1 on each
        assert on[f"{ACTOR}.strategy"] == "megatron"
        assert on["trainer.n_gpus_per_node"] == on[f"{ACTOR}.megatron.expert_model_parallel_size"] == str(gpus)
        assert on[f"{ACTOR}.megatron.tensor_model_parallel_size"] == on[f"{ROLLOUT}.tensor_model_parallel_size"] == "1"
        assert on["actor_rollout_ref.model.path"].endswith("/L/warm/model")
        assert on["trainer.total_training_steps"] == "50"
        # R3 is verl 0.9.1's two switches, and nothing else differs but the run's names
        off = workloads[gpus]["Disabled"]
        assert (on[f"{ACTOR}.megatron.router_replay.mode"], off[f"{ACTOR}.megatron.router_replay.mode"]) == (
            "R3",
            "disabled",
        )
        assert (on[f"{ROLLOUT}.enable_rollout_routing_replay"], off[f"{ROLLOUT}.enable_rollout_routing_replay"]) == (
            "True",
            "False",
        )
        assert {k for k in on if on[k] != off[k]} == {
            f"{ACTOR}.megatron.router_replay.mode",
            f"{ROLLOUT}.enable_rollout_routing_replay",
            "trainer.experiment_name",
            "trainer.default_local_dir",
        }


def test_the_workload_is_read_from_the_rljob_r3operator_runs(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    setup = vl.Setup(learning_dir=tmp_path / "L", out=tmp_path / "O", gpus=4, steps=50, r3_engines=1)
    with vl.model_config_dir(setup) as config_dir:
        doc = vl.job_document(setup, "R3", config_dir)
    spec = vl.parsed_spec(doc)
    assert (spec.rollout.prompts_per_step, spec.rollout.group_size, spec.rollout.max_tokens) == (64, 8, 512)
    assert (spec.algorithm.mini_batches, spec.algorithm.learning_rate, spec.task.max_prompt_tokens) == (4, 2e-5, 256)
    assert spec.evaluation is not None and spec.evaluation.interval_steps == 10
    # four GPUs: `up` puts one engine on a GPU of its own and the trainer on the three others
    assert (spec.inference.replicas, spec.trainer.gpus_per_node) == (1, 3)
    assert doc["spec"]["model"]["uri"] == f"file://{(tmp_path / 'L' / 'warm' / 'model').resolve()}"
    # a job that does not evaluate before training cannot be mirrored by verl's val_before_train here
    doc["spec"]["evaluation"]["beforeTraining"] = False
    with pytest.raises(vl.LearningPeerError, match="evaluate before training"):
        vl.learning_workload(vl.parsed_spec(doc), engine_memory_fraction=0.5)


def test_every_key_is_one_of_verls_own(workloads: dict[int, dict[str, dict[str, str]]]) -> None:
    wheel = verl_wheel()
    if wheel is None:
        pytest.skip("no verl 0.9.1 wheel here (R3_VERL_WHEEL, or bash benchmarks/peers/verl-wheels.sh)")
    config, _where = read_reference(wheel)
    # what the harness relies on, as verl 0.9.1 ships it
    defaults = resolve(config)
    actor, rollout = defaults["actor_rollout_ref"]["actor"], defaults["actor_rollout_ref"]["rollout"]
    assert actor["megatron"]["router_replay"]["mode"] == "disabled"
    assert rollout["enable_rollout_routing_replay"] is False
    assert rollout["val_kwargs"]["temperature"] == 0 and rollout["val_kwargs"]["do_sample"] is False  # greedy
    assert actor["clip_ratio_c"] == 3.0 and actor["optim"]["weight_decay"] == 0.01
    assert actor["megatron"]["override_transformer_config"]["attention_backend"] == "flash"
    assert rollout["log_prob_use_dynamic_bsz"] is False  # follows the actor's use_dynamic_bsz
    with zipfile.ZipFile(wheel) as zf:  # FSDP's engine has no router replay: why one GPU runs Megatron too
        assert "router_replay" not in zf.read(REFERENCE.replace("_megatron", "")).decode()
    for gpus, modes in workloads.items():
        for mode, items in modes.items():
            ours = resolve(apply_overrides(config, [f"{k}={v}" for k, v in items.items()]))
            assert ours["actor_rollout_ref"]["rollout"]["log_prob_use_dynamic_bsz"] is True, (gpus, mode)
            assert ours["actor_rollout_ref"]["ref"]["megatron"]["expert_model_parallel_size"] == gpus


# ---- verl_reference: Hydra's struct check and OmegaConf's interpolations, on a config written here ---------------

SMALL = """
a:
  x: 1
  y: ${oc.select:a.x,5}
  z: ${oc.select:a.missing,${oc.select:b.w,7}}
  rel: ${.x}
  text: pre/${a.x}/post
  empty: ${oc.select:a.gone,{}}
b:
  v: [p, q]
"""


def small_wheel(tmp_path: Path, text: str = SMALL) -> Path:
    wheel = tmp_path / "verl-0.9.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(REFERENCE, text)
    return wheel


def test_overrides_are_checked_and_interpolations_followed(tmp_path: Path) -> None:
    config, where = read_reference(small_wheel(tmp_path))
    assert where.endswith(f"!{REFERENCE}")
    assert resolve(config)["a"] == {"x": 1, "y": 1, "z": 7, "rel": 1, "text": "pre/1/post", "empty": {}}
    ours = apply_overrides(config, ["model_engine=megatron", "a.x=3", "b.v=[r,s]"])  # a group choice is no key
    assert resolve(ours)["a"] == {"x": 3, "y": 3, "z": 7, "rel": 3, "text": "pre/3/post", "empty": {}}
    assert changes(config, ours) == [
        ("a.x", 1, 3),
        ("a.y", 1, 3),
        ("a.rel", 1, 3),
        ("a.text", "pre/1/post", "pre/3/post"),
        ("b.v", ["p", "q"], ["r", "s"]),
    ]
    with pytest.raises(ReferenceError, match=r"a\.nope, c\.x"):
        apply_overrides(config, ["a.nope=1", "a.x=2", "c.x=1"])
    with pytest.raises(ReferenceError, match="no verl/trainer/config"):
        read_reference(tmp_path)


def test_override_values_read_as_hydra_reads_them() -> None:
    assert parse_value("1e-05") == 1e-5 and parse_value("2e-05") == 2e-5  # YAML 1.1 would keep these strings
    assert (parse_value("True"), parse_value("false"), parse_value("null")) == (True, False, None)
    assert (parse_value("16"), parse_value("-1"), parse_value("0.5")) == (16, -1, 0.5)
    assert parse_value("[console,file]") == ["console", "file"] and parse_value("grpo") == "grpo"


# ---- inputs and reward -------------------------------------------------------------------------------------------


def chain_data(directory: Path) -> None:
    from r3operator.tasks.arith_chain import ChainSpec, write_splits

    write_splits(directory, ChainSpec(min_terms=2, max_terms=4, train_rows=6, eval_rows=3))


def test_learning_data_becomes_verls_parquet_and_is_scored_by_r3operators_function(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from benchmarks.peers.verl_inputs import CHAIN_SOURCE, convert_learning
    from benchmarks.peers.verl_reward import compute_score

    chain_data(tmp_path / "data")
    train, val = convert_learning(tmp_path / "data", tmp_path / "out")
    source = [json.loads(line) for line in (tmp_path / "data" / "eval.jsonl").read_text().splitlines()]
    rows = pq.read_table(val).to_pylist()
    assert (len(pq.read_table(train).to_pylist()), len(rows)) == (6, 3)  # the held-out split is verl's val set
    for row, record in zip(rows, source, strict=True):
        assert row["data_source"] == CHAIN_SOURCE
        assert row["prompt"] == [{"role": "user", "content": record["prompt"]}]
        assert row["reward_model"]["ground_truth"] == record["answer"]
        info = row["extra_info"]
        assert (info["id"], info["prompt_text"]) == (record["id"], record["prompt"])
        # the worked solution ends in the right answer: 1; the same with the answer off by one, or cut short: 0
        assert compute_score(CHAIN_SOURCE, record["solution"], record["answer"], info) == 1.0
        wrong = record["solution"].rsplit(": ", 1)[0] + f": {int(record['answer']) + 1}"
        assert compute_score(CHAIN_SOURCE, wrong, record["answer"], info) == 0.0
        assert compute_score(CHAIN_SOURCE, record["solution"].rsplit(" .", 1)[0], record["answer"], info) == 0.0
    # "add 7 + 8" worked out by hand, digit by digit as the reference tokenizer decodes it
    assert compute_score(CHAIN_SOURCE, "7 + 8 = 1 5 . answer : 1 5", "15", {}) == 1.0
    with pytest.raises(ValueError, match="data_source 'other'"):
        compute_score("other", "x", "1")


def test_a_learning_dir_without_its_warm_start_is_named_with_the_command_that_makes_it(tmp_path: Path) -> None:
    chain_data(tmp_path / "L" / "data")
    with pytest.raises(vl.LearningPeerError, match=r"warm/model/config\.json.*--parts data,warm"):
        vl.check_learning_dir(tmp_path / "L")


# ---- per-step figures and the summary ------------------------------------------------------------------------------

SAMPLES = 64 * 8


def verl_steps(kl: float, evals: tuple[float, float], extreme: float) -> list[dict[str, Any]]:
    """Two trained steps of the v1 trainer, the validation before training (step 0, alone) and at step 2."""
    lines: list[dict[str, Any]] = [{"step": 0, "data": {vl.eval_key(1): evals[0]}}]
    for step, (response, prompt, seconds) in enumerate([(100.0, 40.0, 20.0), (150.0, 50.0, 25.0)], start=1):
        data = {
            "critic/score/mean": 0.1 * step,
            "timing_s/step": seconds,
            "timing_s/gen": seconds / 2,
            "timing_s/old_log_prob": 1.0,
            "timing_s/update_actor": 5.0,
            "timing_s/update_weights": 1.0,
            "rollout_corr/k3_kl": kl * step,
            "peer/extreme_token_fraction": extreme,
            "peer/logprob_abs_diff_mean": 0.01,
            "peer/logprob_abs_diff_max": 0.5,
            "actor/entropy": 0.5 / step,
            "actor/grad_norm": 0.2,
            "actor/pg_clipfrac": 0.01,
            "actor/pg_clipfrac_lower": 0.0,
            "response_length/mean": response,
            "prompt_length/mean": prompt,
            "perf/throughput": (response + prompt) * SAMPLES / seconds / 4,  # verl's own, for 4 GPUs
        }
        if step == 2:
            data[vl.eval_key(1)] = evals[1]
        lines.append({"step": step, "data": data})
    return lines


def r3_rows(kl: float) -> list[dict[str, Any]]:
    return [
        {
            "step": step,
            "replay_mode": "R3",
            "reward_mean": 0.2 * step,
            "samples": SAMPLES,
            "tokens": 60_000,
            "prompt_tokens": 20_000,
            "kl_k3": kl,
            "extreme_token_fraction": 0.0,
            "entropy_mean": 0.02,
            "grad_norm": 0.1,
            "canary_ok": 1,
            "skipped": 0,
            "step_seconds": 12.0 if step == 1 else 18.0,
            "t_eval": 0.0 if step == 1 else 5.0,  # step 2 evaluated: 13 s of training
            "t_checkpoint": 1.0 if step == 2 else 0.0,
            "t_rollout": 5.0,
        }
        for step in (1, 2)
    ]


def write_runs(out: Path) -> None:
    from r3operator.runtime.report import append_row

    for mode, kl in (("R3", 1e-5), ("Disabled", 2e-5)):
        verl = out / f"verl-{mode}"
        verl.mkdir(parents=True)
        lines = verl_steps(kl=kl * 10, evals=(0.4, 0.5 if mode == "R3" else 0.2), extreme=1e-4)
        (verl / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        (verl / "overrides.txt").write_text("a=1\n")
        run = out / "r3" / "runs" / learning.run_name(mode)
        run.mkdir(parents=True)
        for row in r3_rows(kl):
            append_row(run / "metrics.csv", row)
        (run / "eval.csv").write_text("step,eval_reward_mean\n0,0.38\n2,0.9\n")
    (out / vl.RUN_FILE).write_text(json.dumps({"date": "2026-12-07", "machine": "h100x4", "gpus": 4}))


def test_summary_reads_both_frameworks_through_the_learning_benchmarks_figures(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "O"
    write_runs(out)
    setup = vl.Setup(learning_dir=tmp_path / "L", out=out, gpus=4, steps=2)
    path = vl.summarize(setup)
    assert path == out / "verl-peer-2026-12-07-h100x4" / "summary.json"
    report = json.loads(path.read_text())
    verl, ours = report["frameworks"]["verl"]["R3"], report["frameworks"]["r3operator"]["R3"]
    for figures in (verl, ours):
        assert (figures["gpus"], figures["samples_per_step"], figures["max_response_tokens"]) == (4, 512, 512)
    # verl: (response + prompt tokens) × 512 samples / timing_s/step, per step, averaged, over 4 GPUs
    verl_rate = ((140 * SAMPLES / 20) + (200 * SAMPLES / 25)) / 2 / 4
    assert verl["trained_tokens_per_s_per_gpu"] == pytest.approx(verl_rate)
    assert verl["verl_perf_throughput_mean"] == pytest.approx(verl_rate)  # verl's own perf/throughput agrees
    assert verl["kl_k3"] == pytest.approx((1e-4 + 2e-4) / 2)  # rollout_corr/k3_kl
    assert verl["extreme_token_fraction"] == pytest.approx(1e-4)
    assert (verl["eval_reward_first"], verl["eval_reward_last"], verl["eval_steps"]) == (0.4, 0.5, [0, 2])
    assert (verl["entropy_first"], verl["entropy_last"]) == (0.5, 0.25)
    # r3operator: its step time less the held-out evaluation and the checkpoint, which verl times apart
    ours_rate = (80_000 / 12.0 + 80_000 / (18.0 - 5.0 - 1.0)) / 2 / 4
    assert ours["trained_tokens_per_s_per_gpu"] == pytest.approx(ours_rate)
    assert ours["step_seconds_mean"] == pytest.approx(12.0)
    assert (ours["kl_k3"], ours["eval_reward_first"], ours["eval_reward_last"]) == (1e-5, 0.38, 0.9)
    speed = report["comparisons"]["trained_tokens_per_s_per_gpu_r3operator_over_verl_R3"]
    assert speed["value"] == pytest.approx(ours_rate / verl_rate) and speed["met"] == (ours_rate / verl_rate >= 1.5)
    assert report["comparisons"]["kl_k3_r3operator_over_verl_R3"]["value"] == pytest.approx(1e-5 / 1.5e-4)
    assert report["comparisons"]["kl_k3_R3_over_Disabled_verl"] == pytest.approx(0.5)
    assert report["problems"] == []
    folder = path.parent
    assert sorted(report["plots"]) == sorted(
        [f"learning-{f.lower()}-{m.lower()}.png" for f in vl.FRAMEWORKS for m in vl.MODES] + ["learning-all-modes.png"]
    )
    assert all((folder / p).is_file() for p in report["plots"])
    assert (folder / "verl-R3-overrides.txt").is_file() and "| verl R3 |" in (folder / "table.md").read_text()


def test_a_missing_or_unstarted_run_is_a_problem_not_a_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "O"
    write_runs(out)
    (out / "verl-Disabled" / "metrics.jsonl").unlink()
    (out / "verl-Disabled" / "not-started.txt").write_text("Transformer Engine preflight failed: no backend\n")
    report = json.loads(vl.summarize(vl.Setup(learning_dir=tmp_path, out=out, gpus=4, steps=2)).read_text())
    assert "Disabled" not in report["frameworks"]["verl"]
    assert report["problems"] == ["verl Disabled: not started: Transformer Engine preflight failed: no backend"]
    assert report["comparisons"]["kl_k3_R3_over_Disabled_verl"] is None


def test_verl_step_rows_need_a_trained_step(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    log.write_text(json.dumps({"step": 0, "data": {vl.eval_key(1): 0.3}}) + "\n")
    with pytest.raises(vl.MetricsError, match="no trained step"):
        vl.verl_step_rows(log, samples=8, eval_samples=1)


# ---- the commands -------------------------------------------------------------------------------------------------


def test_r3operator_one_gpu_runs_are_the_learning_benchmarks_own() -> None:
    setup = vl.Setup(learning_dir=Path("/L"), out=Path("/O"), gpus=1, steps=30)
    command = vl.r3_run_command(setup)
    assert command[1:7] == ["-m", "benchmarks.learning", "--out", "/O/r3", "--parts", "runs"]
    plan, out, parts = learning.parse(command[3:])  # the learning benchmark reads back the very plan
    assert (plan, out, parts) == (setup.plan, Path("/O/r3"), ["runs"])
    assert (plan.steps, plan.modes, plan.concurrent) == (30, ("R3", "Disabled"), False)  # alone on the GPU, R3 first
    short = vl.Setup(learning_dir=Path("/L"), out=Path("/O"), gpus=1, steps=10, r3_modes=("R3",))
    assert learning.parse(vl.r3_run_command(short)[3:])[0].modes == ("R3",)


@pytest.mark.parametrize("gpus", [1, 4])
def test_dry_run_prints_every_command_and_checks_verls_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], gpus: int
) -> None:
    pytest.importorskip("transformers")
    argv = ["--learning-dir", str(tmp_path / "L"), "--gpus", str(gpus), "--steps", "50", "--out", str(tmp_path / "O")]
    # a verl config without the R3 switch: refused, naming it
    broken = small_wheel(tmp_path, "actor_rollout_ref:\n  rollout:\n    n: 1\n")
    assert vl.main([*argv, "--dry-run", "--verl-config", str(broken)]) == 2
    text = capsys.readouterr().out
    assert "not keys of verl's configuration" in text and f"{ROLLOUT}.enable_rollout_routing_replay" in text
    assert "--parts data,warm" in text  # the warm start is not there yet, and the output says how to make it
    for mode in ("R3", "Disabled"):
        assert f"== verl-{mode}: preflight, then verl" in text
    assert text.count("-m verl.trainer.main_ppo model_engine=megatron") == 2
    assert text.count(f"{ACTOR}.megatron.expert_model_parallel_size={gpus} ") == 2
    if gpus == 1:
        assert "benchmarks.learning --out" in text and "--modes R3,Disabled --no-concurrent" in text
    else:
        assert text.count("-m r3operator up") == 2 and text.count("--gpus 0,1,2,3") == 2
        assert "1 engine(s), trainer 3 GPU(s)" in text
    assert not (tmp_path / "O").exists()  # a dry run writes nothing
    wheel = verl_wheel()
    if wheel is not None:
        assert vl.main([*argv, "--dry-run", "--verl-config", str(wheel)]) == 0
        text = capsys.readouterr().out
        assert "every key of both runs is one of verl's" in text
        assert f"{ACTOR}.megatron.router_replay.mode: 'disabled' → 'R3'" in text
        assert f"{ROLLOUT}.val_kwargs.temperature: 0 → 1.0" in text


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--learning-dir", "L", "--out", "O", "--dry-run"]
    for extra, message in (
        (["--gpus", "4", "--r3-engines", "4"], "--r3-engines 4: between 1 and 3"),
        (["--gpus", "1", "--parts", "prepare,train"], "--parts: unknown train"),
        (["--gpus", "1", "--engine-memory-fraction", "1.5"], "--engine-memory-fraction"),
        (["--gpus", "1", "--r3-modes", "R3,R2"], "--r3-modes 'R3,R2': some of R3, Disabled"),
    ):
        with pytest.raises(SystemExit):
            vl.main([*base, *extra])
        assert message in capsys.readouterr().err


def test_more_gpus_than_experts_split_into_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 64}))
    vl.check_experts(tmp_path, 4)
    with pytest.raises(vl.LearningPeerError, match="64 experts do not split over 3 GPUs"):
        vl.check_experts(tmp_path, 3)


# ---- the detached runner ------------------------------------------------------------------------------------------


def _runner(tmp_path: Path, *args: str, **env: str) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    # "python3" records its arguments; the warm start takes longest, as the real one does
    (bin_dir / "python3").write_text(
        f'#!/bin/bash\ncase "$*" in *"--parts data,warm"*) sleep 1 ;; esac\necho "$*" >> {calls}\n'
    )
    setup = tmp_path / "verl-setup.sh"
    setup.write_text(f'#!/bin/bash\nsleep 0.5\necho "te-build $*" >> {calls}\n')
    for tool in (bin_dir / "python3", setup):
        tool.chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VLEARN_ROOT": str(tmp_path / "root")}
    full.update(VERL_SETUP=str(setup), **env)
    started = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=full, capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    marker = tmp_path / "root" / "vlearn-bg" / "peer.rc"
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, "peer.rc never written"
        time.sleep(0.1)
    return (tmp_path / "calls").read_text().splitlines()


@pytest.mark.timeout(120)
def test_runner_builds_te_beside_the_warm_start_then_runs_every_part(tmp_path: Path) -> None:
    calls = _runner(tmp_path, "start", "1", "30")
    root = tmp_path / "root"
    warm = f"-m benchmarks.learning --out {root}/learn --parts data,warm --device cuda"
    # the TE build and the warm start side by side, in either order; the comparison only after both
    assert set(calls[:2]) == {f"te-build {root}/verl-stash", f"{warm} --warm-batch 32 --warm-max-steps 800"}
    assert calls[2] == (
        f"-m benchmarks.peers.verl_learning --learning-dir {root}/learn --gpus 1 --steps 30 --out {root}/vlearn "
        "--parts prepare,verl-R3,r3,verl-Disabled,summary --r3-modes R3,Disabled"
    )


@pytest.mark.timeout(120)
def test_runner_keeps_a_warm_start_already_there(tmp_path: Path) -> None:
    warm = tmp_path / "root" / "learn" / "warm"
    warm.mkdir(parents=True)
    (warm / "warm.json").write_text("{}")
    calls = _runner(tmp_path, "start", "4", "50", PARTS="verl-R3,r3,summary", R3_MODES="R3")
    assert not any("benchmarks.learning" in call for call in calls)
    assert calls[-1].endswith(
        f"--gpus 4 --steps 50 --out {tmp_path}/root/vlearn --parts verl-R3,r3,summary --r3-modes R3"
    )


# ---- verl's wheels -------------------------------------------------------------------------------------------------

VERL_091_REQUIRES = {
    # verl 0.9.1's Requires-Dist (unzip -p verl-0.9.1-py3-none-any.whl '*/METADATA'), for what verl-wheels.sh pins
    "transformers": "!=5.6.0,<5.11,>=5.5.3",
    "tensordict": "!=0.9.0,<=0.10.0,>=0.8.0",
    "transferqueue": ">=0.1.10",
}


def test_verls_pinned_wheels_meet_its_requirements() -> None:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    text = (REPO / "benchmarks" / "peers" / "verl-wheels.sh").read_text()
    pins = dict(
        word.lower().split("==", 1) for word in text.split("pkgs=(", 1)[1].split(")", 1)[0].split() if "==" in word
    )
    assert pins["verl"] == "0.9.1"
    for name, spec in VERL_091_REQUIRES.items():
        assert pins[name] in SpecifierSet(spec), (name, pins[name], spec)
    wheel = verl_wheel()
    if wheel is None:
        return
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read("verl-0.9.1.dist-info/METADATA").decode()
    core = [Requirement(line.split(":", 1)[1]) for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    found = {r.name.lower(): str(r.specifier) for r in core if r.marker is None}  # no extra: what verl needs
    found["transferqueue"] = next(str(r.specifier) for r in core if r.name.lower() == "transferqueue")  # verl-core's
    for name, spec in VERL_091_REQUIRES.items():
        assert SpecifierSet(found[name]) == SpecifierSet(spec), name


# ---- the parts, with the programs they start replaced by recorders -------------------------------------------------


def learning_dir(tmp_path: Path) -> Path:
    """What benchmarks.learning's data and warm parts leave: the splits, a warm model's config, warm.json."""
    from r3operator.models.reference import get_spec

    root = tmp_path / "L"
    chain_data(root / "data")
    get_spec("gpu").hf_config().save_pretrained(root / "warm" / "model")
    (root / "warm" / "warm.json").write_text(json.dumps({"reached": True}))
    return root


def test_parts_prepare_the_inputs_then_start_each_run_where_the_summary_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from benchmarks.peers import verl_vs_r3

    started: list[tuple[str, list[str], Path]] = []

    def run_logged(name: str, cmd: list[str], env: dict[str, str], out: Path, timeout_s: int) -> int:
        started.append((name, cmd, out))
        if "up" in cmd:  # `up` leaves its run folder under --out-dir; the part copies its CSVs from there
            run = Path(cmd[cmd.index("--out-dir") + 1]) / "some-run"
            run.mkdir(parents=True)
            (run / "metrics.csv").write_text("step\n1\n")
            (run / "eval.csv").write_text("step,eval_reward_mean\n0,0.4\n")
        return 0

    launched: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(verl_vs_r3, "run_logged", run_logged)

    def launch_verl(part: str, run_dir: Path, overrides: list[str], model_dir: Path, **_: object) -> int:
        launched.append((part, overrides))
        return 0

    monkeypatch.setattr(verl_vs_r3, "launch_verl", launch_verl)
    monkeypatch.setattr(learning, "machine", lambda: "h100")
    root = learning_dir(tmp_path)
    base = ["--learning-dir", str(root), "--steps", "7"]
    assert vl.main([*base, "--gpus", "1", "--out", str(tmp_path / "O1"), "--parts", "verl-R3"]) == 1  # no parquet yet
    assert vl.main([*base, "--gpus", "1", "--out", str(tmp_path / "O1"), "--parts", "prepare,verl-R3,r3"]) == 0
    o1 = tmp_path / "O1"
    assert (o1 / "inputs" / "data" / "val.parquet").is_file()
    assert json.loads((o1 / "start.json").read_text())["warm"] == {"reached": True}
    assert json.loads((o1 / vl.RUN_FILE).read_text())["machine"] == "h100"
    ((part, overrides),) = launched
    assert part == "verl-R3" and "trainer.total_training_steps=7" in overrides
    assert f"data.val_files={o1 / 'inputs' / 'data' / 'val.parquet'}" in overrides
    ((_name, cmd, log),) = started  # one GPU: the learning benchmark's runs, on the learning dir's data and warm start
    assert cmd[1:3] == ["-m", "benchmarks.learning"] and log == o1 / "r3" / "log"
    assert (o1 / "r3" / "warm").resolve() == (root / "warm").resolve()
    assert (o1 / "r3" / "data").resolve() == (root / "data").resolve()
    started.clear()
    o4 = tmp_path / "O4"
    assert vl.main([*base, "--gpus", "4", "--out", str(o4), "--parts", "r3", "--r3-modes", "R3"]) == 0
    ((_name, cmd, log),) = started  # four GPUs: `up` of the learning RLJob, engine and trainer apart
    assert cmd[1:4] == ["-m", "r3operator", "up"] and cmd[cmd.index("--gpus") + 1] == "0,1,2,3"
    assert json.loads((o4 / vl.RUN_FILE).read_text())["machine"] == "h100x4"
    run = vl.r3_run_dir(vl.Setup(learning_dir=root, out=o4, gpus=4, steps=7), "R3")
    assert (run / "metrics.csv").read_text() == "step\n1\n" and (run / "eval.csv").is_file()
