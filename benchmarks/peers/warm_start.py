"""The verl comparison's common warmed-up start (issue #27): r3operator's own supervised warm-up, written back as a
plain Hugging Face directory that verl and r3operator both load.

From the random-init reference model neither framework draws more than a stray reward in 20 steps of arithmetic.
This runs `algorithm.sftWarmupSteps` steps of r3operator's SFT warm-up (r3operator/runtime/sft.py, the same draws
an RLJob with that setting makes) on the comparison's RLJob and the arith answers, at the learning rate given, and
saves the weights in the export's dtype beside its config and tokenizer. The RL runs then start from that
directory with `sftWarmupSteps: 0`. `warm_start.json` beside the model says how it was made; its presence is what
marks the inputs as warm.

    python -m benchmarks.peers.warm_start --model-dir DIR/inputs/model --steps 50 --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PEERS = Path(__file__).resolve().parent
JOB = PEERS.parents[1] / "benchmarks" / "jobs" / "a3b-verl-peer.yaml"
ARITH = PEERS.parents[1] / "examples" / "data" / "arith.jsonl"
WARM_START_FILE = "warm_start.json"
DEFAULT_LEARNING_RATE = 1e-4
"""Ten times the RL runs' 1e-5: a random-init model moves little in tens of steps at 1e-5. Not tuned on `a3b`."""
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")
# The reference model's generator record: the warmed weights are no longer what that spec generates.
NOT_COPIED = ("r3_reference_spec.json",)


class WarmStartError(ValueError):
    """A warm_start.json that cannot be read, or inputs that do not hold the start a part was told to use."""


@dataclass(frozen=True)
class WarmStart:
    steps: int
    learning_rate: float
    first_loss: float
    final_loss: float
    batch: int
    seed: int
    device: str

    def label(self) -> str:
        return f"warm start {self.steps} SFT steps (lr {self.learning_rate:g}, final loss {self.final_loss:.4g})"

    @classmethod
    def from_json(cls, data: Any, *, source: str) -> WarmStart:
        if not isinstance(data, dict):
            raise WarmStartError(f"{source}: expected a JSON object")
        values: dict[str, Any] = {}
        for name, kind in (("steps", int), ("batch", int), ("seed", int), ("device", str)):
            value = data.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise WarmStartError(f"{source}: field {name!r} must be {kind.__name__}, got {value!r}")
            values[name] = value
        for name in ("learning_rate", "first_loss", "final_loss"):
            value = data.get(name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise WarmStartError(f"{source}: field {name!r} must be a finite number, got {value!r}")
            values[name] = float(value)
        if values["steps"] < 1:
            raise WarmStartError(f"{source}: field 'steps' must be at least 1, got {values['steps']}")
        return cls(**values)


def read_warm_start(inputs: Path) -> WarmStart | None:
    """The start `inputs` (DIR/inputs) hold: None for the random-init export."""
    path = inputs / WARM_START_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise WarmStartError(f"{path}: not JSON ({exc.msg})") from None
    return WarmStart.from_json(data, source=str(path))


def check_start(inputs: Path, steps: int) -> WarmStart | None:
    """The inputs' start, refused unless it is the one asked for (`steps` 0: random init), so that both frameworks
    never start from different weights."""
    found = read_warm_start(inputs)
    held = 0 if found is None else found.steps
    if held != steps:
        what = "the random-init model" if found is None else f"a warm start of {held} steps"
        raise WarmStartError(
            f"--warm-start-steps {steps}: {inputs} holds {what}; run --parts prepare --warm-start-steps {steps} first"
        )
    return found


def sft_job(steps: int, learning_rate: float) -> Any:
    """The comparison's RLJob with `sftWarmupSteps` and the warm-up's learning rate: what the trainer is built from."""
    import yaml

    from r3operator.api.load import parse_rljob

    doc = yaml.safe_load(JOB.read_text())
    doc["spec"]["algorithm"]["sftWarmupSteps"] = steps
    doc["spec"]["algorithm"]["learningRate"] = learning_rate
    return parse_rljob(doc, source=f"{JOB} (warm start)")


def warm_up(model_dir: Path, out_dir: Path, *, steps: int, learning_rate: float, device: str) -> WarmStart:
    """`steps` SFT steps from `model_dir`; the weights written to `out_dir` (which must not exist yet)."""
    from transformers import AutoConfig

    from r3operator.runtime.sft import SFT_BATCH, sft_warmup
    from r3operator.tasks.source import build_task_source
    from r3operator.trainer.factory import build_trainer

    if steps < 1:
        raise ValueError(f"--warm-start-steps: expected at least 1, got {steps}")
    if not learning_rate > 0:
        raise ValueError(f"--warm-start-lr: expected a positive learning rate, got {learning_rate}")
    spec = sft_job(steps, learning_rate).spec
    vocab_size = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    task = build_task_source(spec, model_dir=model_dir, vocab_size=vocab_size, dataset_file=ARITH)
    trainer = build_trainer(spec, model_dir, device=device, ranks=1)
    try:
        losses = sft_warmup(trainer, task.pool, steps=steps, seed=spec.seed)
        save_hf(model_dir, trainer.model_state_dict(), out_dir)
    finally:
        trainer.close()
    return WarmStart(
        steps=steps,
        learning_rate=learning_rate,
        first_loss=losses[0],
        final_loss=losses[-1],
        batch=SFT_BATCH,
        seed=spec.seed,
        device=device,
    )


def save_hf(source: Path, state: dict[str, Any], out_dir: Path) -> Path:
    """`state` in `source`'s architecture and dtype, saved by transformers, plus `source`'s other files
    (tokenizer, chat template) but not its weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    model.load_state_dict(state, strict=True)  # copies into the export's dtype; a missing name fails here
    model.save_pretrained(out_dir, safe_serialization=True)
    for path in source.iterdir():
        kept = path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name not in NOT_COPIED
        if kept and not (out_dir / path.name).exists():  # config.json as transformers wrote it wins
            shutil.copy2(path, out_dir / path.name)
    return out_dir


def warm_in_place(model_dir: Path, *, steps: int, learning_rate: float, device: str) -> WarmStart:
    """Replace `model_dir` by its warmed copy, then write warm_start.json beside it (last: its presence means the
    directory is warm)."""
    record = model_dir.parent / WARM_START_FILE
    record.unlink(missing_ok=True)
    tmp = model_dir.with_name(f".{model_dir.name}.warm")
    shutil.rmtree(tmp, ignore_errors=True)
    start = warm_up(model_dir, tmp, steps=steps, learning_rate=learning_rate, device=device)
    shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    record.write_text(json.dumps(asdict(start), indent=2, sort_keys=True) + "\n")
    return start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True, help="the export to warm, replaced in place")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--lr", type=float, default=DEFAULT_LEARNING_RATE)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    start = warm_in_place(args.model_dir, steps=args.steps, learning_rate=args.lr, device=args.device)
    print(f"== warm start: {start.label()}, first loss {start.first_loss:.4g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
