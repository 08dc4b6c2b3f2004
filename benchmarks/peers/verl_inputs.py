"""The inputs verl reads, made from r3operator's own: the reference MoE in the Hugging Face layout and the arith
dataset as verl's RL parquet.

verl (`data.train_files`, `verl/utils/dataset/rl_dataset.py`) reads a parquet whose rows carry `prompt` (chat
messages, which verl renders with the tokenizer's chat template, as r3operator's dataset task does),
`data_source` (the key its reward manager passes to `compute_score`), `reward_model.ground_truth`, `ability` and
`extra_info`. The model directory is the one `r3operator reference-model` generates: `config.json`
(`Qwen3MoeForCausalLM`), bf16 `model.safetensors`, `tokenizer.json` with its chat template — the files verl's
`actor_rollout_ref.model.path` and vLLM load.

    python -m benchmarks.peers.verl_inputs --model a3b --out DIR    # DIR/model, DIR/data/{train,test}.parquet

The learning benchmark's data (benchmarks/learning.py: the `arith-chain` splits, DIR/data/{train,eval}.jsonl) goes
through `convert_learning`: read by r3operator's own dataset reader, so that each verl row holds the prompt, answer
and metadata r3operator's `function` reward is handed, and the held-out split becomes verl's `val.parquet`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

DATA_SOURCE = "r3operator/arith"  # verl_reward.compute_score answers for this source
CHAIN_SOURCE = "r3operator/arith-chain"  # the learning workload's task (verl_reward: r3operator's function reward)
ARITH = Path(__file__).resolve().parents[2] / "examples" / "data" / "arith.jsonl"


class ConversionError(ValueError):
    """A dataset row verl could not train on; the message names the file and the line."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConversionError(f"{path}:{number}: not JSON ({exc.msg})") from None
        for key in ("prompt", "answer"):
            if not isinstance(row, dict) or not isinstance(row.get(key), str) or not row[key].strip():
                raise ConversionError(f"{path}:{number}: field {key!r} must be a non-empty string")
        rows.append(row)
    if not rows:
        raise ConversionError(f"{path}: no rows")
    return rows


def verl_rows(rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """verl's RL-dataset schema, one row per problem, the prompt as one user message (r3operator's dataset task
    sends a `prompt` row through the chat template as the same single user message)."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": row["answer"]},
            "extra_info": {"split": split, "index": index, "id": str(row.get("id", index))},
        }
        for index, row in enumerate(rows)
    ]


def learning_rows(path: Path, split: str) -> list[dict[str, Any]]:
    """verl's rows for one split of a dataset file, read as r3operator's dataset task reads it
    (r3operator/tasks/dataset_reader.py): the prompt as the messages r3operator renders through the chat template,
    and in `extra_info` the row's id, prompt text and metadata, which verl hands back to `compute_score`."""
    from r3operator.tasks.dataset_reader import DatasetError, read_rows

    try:
        rows = read_rows(path)
    except DatasetError as exc:
        raise ConversionError(str(exc)) from None
    out = []
    for index, row in enumerate(rows):
        messages = [dict(m) for m in row.messages] if row.messages else [{"role": "user", "content": row.prompt}]
        out.append(
            {
                "data_source": CHAIN_SOURCE,
                "prompt": messages,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": row.answer},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "id": row.id,
                    "prompt_text": row.prompt if row.prompt is not None else messages[-1]["content"],
                    "metadata_json": json.dumps(dict(row.metadata), sort_keys=True),
                },
            }
        )
    return out


def convert_learning(data_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """DIR/train.jsonl → `train.parquet`, DIR/eval.jsonl (the held-out split) → `val.parquet`."""
    train = write_parquet(learning_rows(data_dir / "train.jsonl", "train"), out_dir / "train.parquet")
    val = write_parquet(learning_rows(data_dir / "eval.jsonl", "eval"), out_dir / "val.parquet")
    return train, val


def write_parquet(rows: list[dict[str, Any]], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)  # a reader never sees half a file
    return path


def convert_arith(jsonl: Path, out_dir: Path) -> tuple[Path, Path]:
    """`train.parquet` (every row: both frameworks sample prompts from the whole set) and `test.parquet` (the same
    rows; verl insists on a validation file, and the benchmark turns validation off with `trainer.test_freq=-1`)."""
    rows = read_jsonl(jsonl)
    train = write_parquet(verl_rows(rows, "train"), out_dir / "train.parquet")
    test = write_parquet(verl_rows(rows, "test"), out_dir / "test.parquet")
    return train, test


def export_model(name: str, out_dir: Path, cache_dir: Path | None = None) -> Path:
    """Copy reference model `name` (generated locally, deterministic) into `out_dir` as a plain directory: verl
    hands the path to Ray workers and vLLM, so it must not be a symlink into a cache another process may prune."""
    from r3operator.models.reference import ensure_reference_model

    source = ensure_reference_model(name, cache_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    tmp.rename(out_dir)
    return out_dir


def check_hf_layout(model_dir: Path) -> dict[str, Any]:
    """Load the directory the way verl's workers do (AutoConfig, AutoTokenizer, AutoModelForCausalLM) and run one
    forward on a chat-templated arith prompt; return what a reader of the log needs to trust the export."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 1 plus 3 ?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return {
        "architectures": list(config.architectures or []),
        "model_type": config.model_type,
        "num_experts": int(config.num_experts),
        "top_k": int(config.num_experts_per_tok),
        "prompt_tokens": int(ids.shape[1]),
        "logits_shape": list(logits.shape),
        "finite": bool(torch.isfinite(logits).all()),
        "chat_text": text,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="a3b", help="reference model name (tiny, small, gpu, a3b)")
    parser.add_argument("--dataset", type=Path, default=ARITH)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--check", action="store_true", help="load the export with transformers and run a forward")
    args = parser.parse_args(argv)
    model_dir = export_model(args.model, args.out / "model")
    train, test = convert_arith(args.dataset, args.out / "data")
    print(f"model: {model_dir}\ntrain: {train}\ntest: {test}")
    if args.check:
        print(json.dumps({k: v for k, v in check_hf_layout(model_dir).items() if k != "chat_text"}))


if __name__ == "__main__":
    main()
