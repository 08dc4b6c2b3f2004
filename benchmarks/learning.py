"""The learning proof (issue 44): a warm-started reference MoE trained by GRPO on a long-answer task, with replay
Disabled, R2 and R3 from the same start, seed and workload, scored on a held-out split it never trains on.

    python -m benchmarks.learning --out DIR --device cuda            # data, warm start, the three runs, summary
    python -m benchmarks.learning --out DIR --parts summary          # the summary again from DIR's runs
    python -m benchmarks.learning --out DIR --device cpu --model tiny --steps 2 --prompts 4 --group 2 ...  # CPU

Parts, each resumable from DIR:
1. data: the `arith-chain` task (r3operator/tasks/arith_chain.py) as DIR/data/{train,eval}.jsonl.
2. warm: supervised steps on the train split's worked solutions from the generated reference model, checked every
   `--warm-check` steps by the held-out reward an engine samples, until it reaches `--warm-target`: the start RL
   learns from (a random-init model draws no reward to learn from). Written as a Hugging Face directory,
   DIR/warm/model, with DIR/warm/warm.json saying how it was made.
3. runs: one `r3operator run` per replay mode on the same RLJob but for `routingReplay.mode` (DIR/jobs/*.yaml), all
   at once on the one device (`--concurrent`, the default: three small jobs share a GPU better than they take
   turns; each one's figures are its own, its step time is under that sharing, said in the summary). `--modes` may
   add `R3-async`: R3 with `algorithm.mode: async` (partial rollouts, staleness ≤ 1, truncated importance weights).
4. summary: DIR/learning.json (per mode: the figures issue 44 names) and one PNG per mode plus one comparing
   them (reward and held-out reward, k3 KL, extreme-token fraction, grad norm per step).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODES = ("Disabled", "R2", "R3")
ASYNC_MODES = ("R3-async",)
"""R3 in `algorithm.mode: async` (partial rollouts, staleness ≤ `ASYNC_STALENESS`, TIS): asked for by name only."""
ASYNC_STALENESS = 1
PARTS = ("data", "warm", "runs", "summary")
WARM_HERE = "warm-in-this-process"  # what the `warm` part runs in a child process
STAGGER_S = 15.0  # between the side-by-side runs' starts: their engines load and capture CUDA graphs apart
REWARD_FUNCTION = "r3operator.tasks.arith_chain:score"
EVAL_COLUMN = "eval_reward_mean"  # eval.csv's (runtime/evaluation.py)


@dataclass(frozen=True)
class Plan:
    """Everything that decides the runs; written into learning.json so a reader can rebuild them."""

    model: str = "gpu"
    device: str = "cuda"
    steps: int = 100
    prompts: int = 64
    group: int = 8
    max_tokens: int = 512
    max_prompt_tokens: int = 256
    mini_batches: int = 4
    learning_rate: float = 2e-5
    micro_batch_tokens: int | None = 4096
    """Three trainers share an 80 GB GPU side by side: at 8,192 tokens a micro-batch each held ~19.7 GB and the third
    ran out of memory in its first update (2026-12-06, H100)."""
    gpu_memory_utilization: float = 0.15
    kv_cache_gib: int = 4
    """A fixed KV cache per engine (`--kv-cache-memory-bytes`): engines that start beside other runs' processes
    size their cache without profiling the free memory those processes are taking at the same time."""
    eval_prompts: int = 256
    eval_interval: int = 10
    min_terms: int = 2
    max_terms: int = 32
    train_rows: int = 20_000
    warm_learning_rate: float = 2e-4
    warm_batch: int = 32
    warm_check: int = 100
    warm_max_steps: int = 1200
    warm_target: float = 0.2
    modes: tuple[str, ...] = MODES
    seed: int = 0
    concurrent: bool = True
    extra_engine_args: tuple[str, ...] = field(default=())
    cuda_graphs: bool = True
    """GPU engines capture CUDA graphs (`--no-enforce-eager`): decoding 512 samples eagerly took ~45 % of a step."""
    machine: str = ""
    """The summary's machine (`h100`, `h200`): empty, the GPU this process sees (a summary made elsewhere names it)."""

    def chain_spec(self) -> Any:
        from r3operator.tasks.arith_chain import ChainSpec

        return ChainSpec(
            min_terms=self.min_terms,
            max_terms=self.max_terms,
            train_rows=self.train_rows,
            eval_rows=self.eval_prompts,
            seed=self.seed,
        )


# ------------------------------------------------------------------------------------------------ jobs


def job_document(plan: Plan, *, mode: str, model_dir: Path, data: Path, name: str) -> dict[str, Any]:
    """The RLJob of one run: every mode the same but for `routingReplay.mode`, and for an asynchronous mode
    (`R3-async`) `algorithm.mode: async` with its staleness bound and importance-weight cap."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    fsdp: dict[str, Any] = {"paramDtype": "bfloat16"}
    if plan.micro_batch_tokens is not None:
        fsdp["microBatchTokens"] = plan.micro_batch_tokens
    engine_args = ["--max-num-seqs", str(plan.prompts * plan.group), *plan.extra_engine_args]
    if plan.device.startswith("cuda"):
        engine_args += ["--kv-cache-memory-bytes", str(plan.kv_cache_gib << 30)]
        if plan.cuda_graphs:
            engine_args.append("--no-enforce-eager")
    else:  # the run's CPU engine is fp32 and eager already
        engine_args += ["--kv-cache-memory-bytes", "1G"]
    return {
        "apiVersion": "r3operator.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": {
            "model": {
                "uri": f"file://{model_dir.resolve()}",
                "architecture": {
                    "numLayers": int(config.num_hidden_layers),
                    "numExperts": int(config.num_experts),
                    "topK": int(config.num_experts_per_tok),
                    "family": "qwen3_moe",
                },
            },
            "routingReplay": {"mode": mode.removesuffix("-async")},
            "inference": {
                "image": "ghcr.io/r3operator/engine:0.1.0-vllm0.22.1",
                "replicas": 1,
                "gpuMemoryUtilization": plan.gpu_memory_utilization,
                "maxModelLen": plan.max_prompt_tokens + plan.max_tokens,
                "extraArgs": engine_args,
            },
            "trainer": {
                "image": "ghcr.io/r3operator/trainer:0.1.0-vllm0.22.1",
                "backend": "FSDP",
                "nodes": 1,
                "gpusPerNode": 1,
                "fsdp": fsdp,
            },
            "rollout": {
                "promptsPerStep": plan.prompts,
                "groupSize": plan.group,
                "maxTokens": plan.max_tokens,
                "temperature": 1.0,
            },
            "algorithm": {
                "steps": plan.steps,
                "learningRate": plan.learning_rate,
                "clipRatioLow": 0.2,
                "clipRatioHigh": 0.28,
                "miniBatches": plan.mini_batches,
                **(
                    {"mode": "async", "maxStaleness": ASYNC_STALENESS, "importanceWeightCap": 2.0}
                    if mode in ASYNC_MODES
                    else {}
                ),
            },
            "task": {
                "name": "dataset",
                "datasetPath": str((data / "train.jsonl").resolve()),
                "reward": "function",
                "rewardFunction": REWARD_FUNCTION,
                "maxPromptTokens": plan.max_prompt_tokens,
            },
            "evaluation": {
                "datasetPath": str((data / "eval.jsonl").resolve()),
                "intervalSteps": plan.eval_interval,
                "maxPrompts": plan.eval_prompts,
            },
            "weightSync": {
                "chunkSizeMB": 256,
                "canary": True,
                "layout": "kernel" if plan.device.startswith("cuda") else "checkpoint",
            },
            "checkpoint": {"intervalSteps": max(plan.steps, 1), "keepLast": 1},
            "seed": plan.seed,
        },
    }


def write_job(document: Mapping[str, Any], path: Path) -> Path:
    """The job, validated as the operator would read it, then written."""
    import yaml

    from r3operator.api.load import parse_rljob

    parse_rljob(dict(document), source=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(document), sort_keys=False))
    return path


def run_name(mode: str) -> str:
    return f"learning-{mode.lower()}"


# ------------------------------------------------------------------------------------------------ data


def make_data(plan: Plan, out: Path) -> Path:
    from r3operator.tasks.arith_chain import write_splits

    data = out / "data"
    write_splits(data, plan.chain_spec())
    return data


# ------------------------------------------------------------------------------------------ warm start


@dataclass(frozen=True)
class WarmCheck:
    sft_step: int
    loss: float
    eval_reward: float
    seconds: float


def sft_pairs(path: Path, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids as the dataset task encodes them, worked-solution ids + <eos>) per row of `path`."""
    from r3operator.tasks.dataset_reader import parse_row
    from r3operator.tasks.dataset_task import encode_prompt

    pairs = []
    for n, line in enumerate(path.read_text().splitlines()):
        record = json.loads(line)
        row = parse_row(record, where=f"{path}:{n + 1}", index=n)
        target = [*tokenizer(record["solution"], add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        pairs.append((encode_prompt(row, tokenizer), target))
    return pairs


def held_out_reward(
    run: Any,
    tokenizer: Any,
    pairs: Sequence[tuple[list[int], list[int]]],
    answers: Sequence[str],
    *,
    plan: Plan,
    seed: int,
) -> float:
    """The mean reward of one sample per held-out prompt, drawn by the run's engines at the rollout temperature."""
    from r3operator.tasks.arith_chain import score

    samples = run.engines.generate([p for p, _ in pairs], max_tokens=plan.max_tokens, temperature=1.0, seed=seed, n=1)
    rewards = [
        score("", tokenizer.decode(list(s.token_ids), skip_special_tokens=True), answers[s.prompt_index], {})
        for s in samples
    ]
    return sum(rewards) / max(len(rewards), 1)


def warm_start(plan: Plan, out: Path) -> Path:
    """SFT from the reference model until the held-out reward reaches `plan.warm_target`; DIR/warm/model."""
    import numpy as np

    from benchmarks.peers.warm_start import save_hf
    from r3operator.models import ensure_reference_model
    from r3operator.runtime.app import _prepare_env, build_settings
    from r3operator.runtime.loop import GRPORun

    data = out / "data"
    target = out / "warm" / "model"
    if (out / "warm" / "warm.json").is_file():
        return target
    reference = ensure_reference_model(plan.model)
    document = job_document(plan, mode="Disabled", model_dir=reference, data=data, name="learning-warm")
    document["spec"].pop("evaluation")  # the warm start scores the held-out split itself, below
    document["spec"]["algorithm"]["learningRate"] = plan.warm_learning_rate
    job = write_job(document, out / "jobs" / "warm.yaml")
    settings = build_settings(job, out_dir=out / "warm-run", resume=False, device=plan.device)
    _prepare_env(settings.device)
    run = GRPORun(settings)
    run.setup()  # the engine, the trainer, the first sync and canary
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.model_dir)
    train = sft_pairs(data / "train.jsonl", tokenizer)
    held = sft_pairs(data / "eval.jsonl", tokenizer)[: plan.eval_prompts]
    answers = [json.loads(line)["answer"] for line in (data / "eval.jsonl").read_text().splitlines()]
    rng = np.random.default_rng([plan.seed, 7])
    checks: list[WarmCheck] = []
    begin = time.perf_counter()
    first = held_out_reward(run, tokenizer, held, answers, plan=plan, seed=0)
    checks.append(WarmCheck(0, math.nan, first, 0.0))
    for step in range(1, plan.warm_max_steps + 1):
        picks = rng.integers(0, len(train), size=plan.warm_batch)
        loss = run.trainer.sft_step([train[int(i)][0] for i in picks], [train[int(i)][1] for i in picks])
        if not math.isfinite(loss):
            raise RuntimeError(f"warm start: SFT step {step} has a non-finite loss {loss}")
        if step % plan.warm_check and step != plan.warm_max_steps:
            continue
        run.sync_weights()
        reward = held_out_reward(run, tokenizer, held, answers, plan=plan, seed=step)
        checks.append(WarmCheck(step, loss, reward, time.perf_counter() - begin))
        print(f"== warm start: SFT step {step}, loss {loss:.4f}, held-out reward {reward:.3f}", flush=True)
        if reward >= plan.warm_target:
            break
    tmp = target.with_name(".model.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(reference, run.trainer.model_state_dict(), tmp)
    run.close()  # the weight sync too, not only the trainer: shared CUDA tensors are let go before the engine exits
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    record = {
        "reference_model": plan.model,
        "learning_rate": plan.warm_learning_rate,
        "batch": plan.warm_batch,
        "target": plan.warm_target,
        "reached": checks[-1].eval_reward >= plan.warm_target,
        "checks": [asdict(c) for c in checks],
    }
    (out / "warm" / "warm.json").write_text(json.dumps(record, indent=2) + "\n")
    return target


# ------------------------------------------------------------------------------------------------ runs


def write_jobs(plan: Plan, out: Path) -> dict[str, Path]:
    model = out / "warm" / "model"
    return {
        mode: write_job(
            job_document(plan, mode=mode, model_dir=model, data=out / "data", name=run_name(mode)),
            out / "jobs" / f"{mode.lower()}.yaml",
        )
        for mode in plan.modes
    }


def run_modes(plan: Plan, out: Path) -> dict[str, int]:
    """One `r3operator run` per mode, side by side (or one after another); each mode's exit code."""
    jobs = write_jobs(plan, out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    codes: dict[str, int] = {}
    running: list[tuple[str, subprocess.Popen[bytes], Any]] = []
    for mode, job in jobs.items():
        ray_tmp = Path(f"/tmp/ray-learning-{mode.lower()}")
        ray_tmp.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "PYTHONUNBUFFERED": "1"}
        command = [
            sys.executable, "-m", "r3operator", "run", str(job), "--device", plan.device,
            "--out-dir", str(out / "runs"), "--no-resume", "--quiet",
        ]  # fmt: skip
        log = (logs / f"{mode.lower()}.log").open("wb")
        print(f"== {mode}: {' '.join(command)}", flush=True)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        running.append((mode, process, log))
        if plan.concurrent:
            time.sleep(STAGGER_S)
        else:
            codes[mode] = process.wait()
            log.close()
            running.clear()
    while running:  # side by side: a run that stops is said at once, while the others go on
        for entry in list(running):
            mode, process, log = entry
            code = process.poll()
            if code is None:
                continue
            codes[mode] = code
            log.close()
            running.remove(entry)
            if code:
                print(f"== {mode} stopped (exit {code}){last_error(logs / f'{mode.lower()}.log')}", flush=True)
        time.sleep(1.0)
    return codes


# --------------------------------------------------------------------------------------------- summary


def _float(row: Mapping[str, Any], key: str) -> float:
    try:
        return float(row.get(key) or math.nan)
    except (TypeError, ValueError):
        return math.nan


def _mean(values: Sequence[float]) -> float | None:
    kept = [v for v in values if math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


def _read_csv(path: Path) -> list[dict[str, str]]:
    import csv

    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def collapsed(evals: Sequence[float], entropy: Sequence[float], grad_norm: Sequence[float]) -> str | None:
    """Why a run collapsed, by the issue's definition, or None: the held-out reward fell below half the peak it had
    reached (whether it came back later is said, not forgiven), the entropy fell below a tenth of its start, or the
    grad norm exceeded 10× its median."""
    finite = [v for v in evals if math.isfinite(v)]
    peak = -math.inf
    for i, value in enumerate(finite):
        if value > peak:
            peak = value
        elif peak > 0 and value < 0.5 * peak:
            later = max(finite[i + 1 :], default=None)
            after = (
                " (the last evaluation)"
                if later is None
                else f", back to {later:.3f} later"
                if later >= 0.5 * peak
                else ", and did not come back"
            )
            return f"held-out reward fell from its peak {peak:.3f} to {value:.3f}{after}"
    ent = [v for v in entropy if math.isfinite(v)]
    if len(ent) >= 2 and ent[0] > 0 and ent[-1] < 0.1 * ent[0]:
        return f"entropy fell from {ent[0]:.3f} to {ent[-1]:.3f}"
    norms = sorted(v for v in grad_norm if math.isfinite(v))
    if norms and norms[-1] > 10 * norms[len(norms) // 2]:
        return f"grad norm reached {norms[-1]:.3g}, over 10× its median {norms[len(norms) // 2]:.3g}"
    return None


def last_error(log: Path | None) -> str:
    """The last line of a run's log that names an exception (`; log: <line>`), or nothing."""
    if log is None or not log.is_file():
        return ""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if "Error" in line]
    return f"; {log.name}: {lines[-1][:300]}" if lines else ""


def mode_summary(plan: Plan, run_dir: Path, *, gpus_shared_by: int, log: Path | None = None) -> dict[str, Any]:
    """The figures of one mode's run, from its metrics.csv and eval.csv; `log`: the run's console log, whose last
    error explains a run that trained nothing."""
    rows = [r for r in _read_csv(run_dir / "metrics.csv") if r.get("skipped") in ("0", "")]
    evals = _read_csv(run_dir / "eval.csv")
    if not rows:
        return {"error": f"{run_dir}: no trained step in metrics.csv" + last_error(log)}
    step_seconds = [_float(r, "step_seconds") for r in rows]
    trained = [_float(r, "tokens") + _float(r, "prompt_tokens") for r in rows]
    per_s = [t / s for t, s in zip(trained, step_seconds, strict=True) if s > 0 and math.isfinite(t)]
    eval_rewards = [_float(e, EVAL_COLUMN) for e in evals]
    phases = sorted({k for r in rows for k in r if k.startswith("t_") and r[k] != ""})
    summary: dict[str, Any] = {
        "steps": len(rows),
        "samples_per_step": plan.prompts * plan.group,
        "max_response_tokens": plan.max_tokens,
        "response_tokens_mean": _mean([_float(r, "tokens") / max(_float(r, "samples"), 1) for r in rows]),
        "prompt_tokens_mean": _mean([_float(r, "prompt_tokens") / max(_float(r, "samples"), 1) for r in rows]),
        "reward_first": _float(rows[0], "reward_mean"),
        "reward_last": _float(rows[-1], "reward_mean"),
        "eval_steps": [int(_float(e, "step")) for e in evals],
        "eval_rewards": eval_rewards,
        "eval_reward_first": eval_rewards[0] if eval_rewards else None,
        "eval_reward_last": eval_rewards[-1] if eval_rewards else None,
        "eval_reward_peak": max((v for v in eval_rewards if math.isfinite(v)), default=None),
        "k3_kl_mean": _mean([_float(r, "kl_k3") for r in rows]),
        "extreme_token_fraction_mean": _mean([_float(r, "extreme_token_fraction") for r in rows]),
        "logprob_abs_diff_mean": _mean([_float(r, "logprob_abs_diff_mean") for r in rows]),
        "logprob_abs_diff_max": max(
            (v for r in rows if math.isfinite(v := _float(r, "logprob_abs_diff_max"))), default=None
        ),
        "routing_agreement_mean": _mean([_float(r, "routing_natural_agreement") for r in rows]),
        "routing_tokens_any_diff_mean": _mean([_float(r, "routing_tokens_any_diff") for r in rows]),
        "replay_applied_mean": _mean([_float(r, "replay_applied") for r in rows]),
        "clip_fraction_mean": _mean([_float(r, "clip_fraction") for r in rows]),
        "dual_clip_fraction_mean": _mean([_float(r, "dual_clip_fraction") for r in rows]),
        "entropy_first": _float(rows[0], "entropy_mean"),
        "entropy_last": _float(rows[-1], "entropy_mean"),
        "grad_norm_mean": _mean([_float(r, "grad_norm") for r in rows]),
        "grad_norm_max": max((v for r in rows if math.isfinite(v := _float(r, "grad_norm"))), default=None),
        "canary_ok_steps": sum(int(_float(r, "canary_ok") == 1) for r in rows),
        "step_seconds_mean": _mean(step_seconds),
        "phase_seconds_mean": {p.removeprefix("t_"): _mean([_float(r, p) for r in rows]) for p in phases},
        "trained_tokens_per_s_per_gpu": _mean(per_s),
        "gpus": 1,
        "gpu_shared_by_runs": gpus_shared_by,
        "collapse": collapsed(
            eval_rewards, [_float(r, "entropy_mean") for r in rows], [_float(r, "grad_norm") for r in rows]
        ),
    }
    return summary


def command_line(plan: Plan, out: Path) -> str:
    """The command that makes this plan: `--out` and every setting that differs from the defaults."""
    words = ["python", "-m", "benchmarks.learning", "--out", str(out)]
    defaults = Plan()
    for name, value in asdict(plan).items():
        if value == getattr(defaults, name) or name == "machine":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{name.replace('_', '-')}")
        else:
            words.append(f"{flag}={','.join(value) if isinstance(value, tuple) else value}")
    return " ".join(words)


def machine() -> str:
    """`h100`, `h200` or `cpu`: the device's kind, for the summary's file name."""
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower()
            return "h200" if "h200" in name else "h100" if "h100" in name else name.split()[-1]
    except ImportError:
        pass
    return "cpu"


def targets(modes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Issue 44's targets, each with the figures it compares and whether it is met (None: not measurable)."""

    def get(mode: str, key: str) -> float | None:
        value = modes.get(mode, {}).get(key)
        return float(value) if isinstance(value, int | float) and math.isfinite(value) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    first, last = get("R3", "eval_reward_first"), get("R3", "eval_reward_last")
    rise = None if first is None or last is None else last - first
    kl = ratio(get("R3", "k3_kl_mean"), get("Disabled", "k3_kl_mean"))
    extreme = ratio(get("R3", "extreme_token_fraction_mean"), get("Disabled", "extreme_token_fraction_mean"))
    cost = ratio(get("R3", "step_seconds_mean"), get("Disabled", "step_seconds_mean"))
    r2_kl = get("R2", "k3_kl_mean")
    between = None
    if r2_kl is not None and get("R3", "k3_kl_mean") is not None and get("Disabled", "k3_kl_mean") is not None:
        low, high = sorted((get("R3", "k3_kl_mean") or 0.0, get("Disabled", "k3_kl_mean") or 0.0))
        between = low <= r2_kl <= high
    return {
        "learning_eval_rise": {"value": rise, "target": ">= 0.2", "met": None if rise is None else rise >= 0.2},
        "k3_kl_r3_over_disabled": {"value": kl, "target": "<= 0.5", "met": None if kl is None else kl <= 0.5},
        "extreme_r3_over_disabled": {
            "value": extreme,
            "target": "<= 0.2",
            "met": None if extreme is None else extreme <= 0.2,
        },
        "r2_kl_between": {"value": r2_kl, "target": "between R3 and Disabled", "met": between},
        "step_time_r3_over_disabled": {
            "value": cost,
            "target": "<= 1.05",
            "met": None if cost is None else cost <= 1.05,
        },
        "stability": {
            "Disabled": modes.get("Disabled", {}).get("collapse"),
            "R3": modes.get("R3", {}).get("collapse"),
            "target": "if Disabled collapses, R3 does not",
        },
    }


def summarize(plan: Plan, out: Path) -> Path:
    shared = len(plan.modes) if plan.concurrent else 1
    modes = {
        mode: mode_summary(
            plan, out / "runs" / run_name(mode), gpus_shared_by=shared, log=out / "logs" / f"{mode.lower()}.log"
        )
        for mode in plan.modes
    }
    warm = json.loads((out / "warm" / "warm.json").read_text()) if (out / "warm" / "warm.json").is_file() else None
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    record = {
        "benchmark": "learning",
        "date": date,
        "machine": plan.machine or machine(),
        "command": command_line(plan, out),
        "plan": {**asdict(plan), "modes": list(plan.modes), "extra_engine_args": list(plan.extra_engine_args)},
        "warm_start": warm,
        "modes": modes,
        "targets": targets(modes),
        "plots": [p.name for p in draw_plots(plan, out)],
    }
    path = out / f"learning-{date}-{record['machine']}.json"
    path.write_text(json.dumps(_finite_json(record), indent=2) + "\n")
    return path


def _finite_json(value: Any) -> Any:
    """NaN and infinities as null: JSON has neither."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return value


PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (train mean) and held-out reward", ("reward_mean", EVAL_COLUMN)),
    ("k3 KL(rollout || trainer) per token", ("kl_k3",)),
    ("extreme tokens (ratio outside [1/2, 2])", ("extreme_token_fraction",)),
    ("grad norm (before clipping at 1.0)", ("grad_norm",)),
)
COLORS = {"Disabled": "tab:red", "R2": "tab:orange", "R3": "tab:blue", "R3-async": "tab:purple"}


def draw_plots(plan: Plan, out: Path) -> list[Path]:
    """One PNG per mode and one with every mode, four panels each; [] without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {}
    for mode in plan.modes:
        run_dir = out / "runs" / run_name(mode)
        data[mode] = (_read_csv(run_dir / "metrics.csv"), _read_csv(run_dir / "eval.csv"))
    paths = []
    for title, shown in [*((m, (m,)) for m in plan.modes), ("all modes", tuple(plan.modes))]:
        fig, axes = plt.subplots(2, 2, figsize=(13, 8))
        for ax, (panel, columns) in zip(axes.flat, PANELS, strict=True):
            for mode in shown:
                rows, evals = data[mode]
                color = COLORS.get(mode)
                for column in columns:
                    held = column == EVAL_COLUMN
                    source = evals if held else rows
                    steps = [int(_float(r, "step")) for r in source]
                    values = [_float(r, column) for r in source]
                    ax.plot(
                        steps,
                        values,
                        "o-" if held else "-",
                        color=color,
                        alpha=1.0 if held or len(columns) == 1 else 0.45,
                        markersize=4,
                        label=f"{mode} {'held-out' if held else 'train'}" if len(columns) > 1 else mode,
                    )
            ax.set_title(panel)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if panel.startswith(("k3", "extreme")):
                ax.set_yscale("symlog", linthresh=1e-5)  # zero stays on the axis, a log scale above it
                ax.set_ylim(bottom=0)
            ax.legend(fontsize=8)
        fig.suptitle(
            f"GRPO on arith-chain, {plan.model} model, {plan.prompts}×{plan.group} samples, "
            f"≤{plan.max_tokens} tokens, {plan.mini_batches} mini-batches: {title}"
        )
        fig.tight_layout()
        path = out / f"learning-{title.lower().replace(' ', '-')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------ main


def parse(argv: Sequence[str] | None) -> tuple[Plan, Path, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    defaults = Plan()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        elif isinstance(value, tuple):
            parser.add_argument(flag, default=",".join(value))
        elif value is None or isinstance(value, int):
            parser.add_argument(flag, type=int, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    args = parser.parse_args(argv)
    values = {name: getattr(args, name) for name in asdict(defaults)}
    values["modes"] = tuple(m for m in str(values["modes"]).split(",") if m)
    values["extra_engine_args"] = tuple(a for a in str(values["extra_engine_args"]).split(",") if a)
    unknown = [m for m in values["modes"] if m not in (*MODES, *ASYNC_MODES)]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {[*MODES, *ASYNC_MODES]}")
    parts = [p for p in str(args.parts).split(",") if p]
    if bad := [p for p in parts if p not in (*PARTS, WARM_HERE)]:
        parser.error(f"--parts: unknown {bad}; choose from {list(PARTS)}")
    return Plan(**values), args.out, parts


def main(argv: Sequence[str] | None = None) -> int:
    plan, out, parts = parse(argv)
    out.mkdir(parents=True, exist_ok=True)
    if "data" in parts:
        make_data(plan, out)
    if WARM_HERE in parts:
        warm_start(plan, out)
    if "warm" in parts and not (out / "warm" / "warm.json").is_file():
        # Its own process: the warm start's engine and trainer give their GPU memory back when it exits.
        given = list(sys.argv[1:] if argv is None else argv)
        code = subprocess.call([sys.executable, "-m", "benchmarks.learning", *given, "--parts", WARM_HERE])
        if code:
            print(f"== warm start failed (exit {code})", flush=True)
            return code
    if "runs" in parts:
        codes = run_modes(plan, out)
        print(f"== runs: {codes}", flush=True)
    if "summary" in parts:
        path = summarize(plan, out)
        print(f"== summary: {path}", flush=True)
        print(json.dumps(json.loads(path.read_text())["targets"], indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
