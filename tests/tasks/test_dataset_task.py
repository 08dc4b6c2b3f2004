"""The dataset task: prompts through the reference tokenizer's chat template exactly once, over-long prompts
dropped and counted, a seeded epoch order, and rewards on the decoded completion without re-tokenising."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r3operator.models.tokenizer import BOS, EOS, save_tokenizer, vocabulary
from r3operator.routing.sample import RolloutSample
from r3operator.tasks.dataset_reader import DatasetError
from r3operator.tasks.dataset_task import DatasetTask, load_problems, step_indices
from r3operator.tasks.rewards import MathReward

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "examples" / "data" / "arith.jsonl"
VOCAB = vocabulary(512)
INDEX = {token: i for i, token in enumerate(VOCAB)}


def ids(text: str) -> tuple[int, ...]:
    """Token ids of space-separated vocabulary words (the reference tokenizer is word-level)."""
    return tuple(INDEX[word] for word in text.split())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(directory, vocab_size=512, model_max_length=512)
    return AutoTokenizer.from_pretrained(directory)


def _jsonl(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_template_is_applied_once_to_prompt_and_messages_rows(tmp_path: Path, tokenizer: Any) -> None:
    path = _jsonl(
        tmp_path,
        [
            {"prompt": "what is 3 plus 4 ?", "answer": "7"},
            {
                "messages": [
                    {"role": "user", "content": "what is 2 times 3 ?"},
                    {"role": "assistant", "content": "6"},
                    {"role": "user", "content": "and double 3 ?"},
                ],
                "answer": "6",
            },
        ],
    )
    plus, chat = load_problems(path, tokenizer, max_prompt_tokens=None)
    # The template: "<bos>{role} : {content} \n" per message, then "assistant :"; one <bos>, never two.
    assert plus.prompt_ids == ids(f"{BOS} user : what is 3 plus 4 ? assistant :")
    assert chat.prompt_ids == ids(f"{BOS} user : what is 2 times 3 ? assistant : 6 user : and double 3 ? assistant :")
    assert plus.answer_ids == ids(f"7 {EOS}")
    assert (plus.prompt_text, chat.prompt_text) == ("what is 3 plus 4 ?", "and double 3 ?")
    assert (plus.answer, chat.problem_id, chat.metadata) == ("7", "row-1", {"id": "row-1"})


def test_without_a_chat_template_prompts_are_plain_text_and_messages_are_refused(
    tmp_path: Path, tokenizer: Any
) -> None:
    import copy

    plain = copy.copy(tokenizer)
    plain.chat_template = None
    [problem] = load_problems(
        _jsonl(tmp_path, [{"prompt": "what is 3 plus 4 ?", "answer": "7"}]), plain, max_prompt_tokens=None
    )
    assert problem.prompt_ids == ids(f"{BOS} what is 3 plus 4 ?")
    chat = _jsonl(tmp_path, [{"messages": [{"role": "user", "content": "hi"}], "answer": "1"}])
    with pytest.raises(DatasetError, match=rf"{chat}:1: 'messages' need a tokenizer with a chat_template"):
        load_problems(chat, plain, max_prompt_tokens=None)


def test_prompts_over_the_limit_are_dropped_and_counted(
    tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    short = "what is 1 plus 1 ?"  # 11 tokens with the template
    long = "what is 1 plus 1 plus 1 plus 1 ?"  # 15
    path = _jsonl(
        tmp_path, [{"prompt": short, "answer": "2"}, {"prompt": long, "answer": "4"}, {"prompt": long, "answer": "4"}]
    )
    with caplog.at_level(logging.WARNING):
        [kept] = load_problems(path, tokenizer, max_prompt_tokens=11)
    assert kept.prompt_text == short
    assert f"dropped 2 of 3 prompts longer than 11 tokens: {path}:2 (15 tokens), {path}:3 (15 tokens)" in caplog.text
    with pytest.raises(DatasetError, match="every prompt is longer than 10 tokens"):
        load_problems(path, tokenizer, max_prompt_tokens=10)


def test_epoch_order_covers_every_row_once_per_epoch_and_depends_only_on_seed_and_step() -> None:
    size, count = 10, 4
    steps = [step_indices(size, seed=3, step=s, count=count) for s in range(1, 6)]  # 20 draws = 2 epochs
    flat = [i for batch in steps for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # each epoch has its own permutation
    assert step_indices(size, seed=3, step=4, count=count) == steps[3]  # a resumed step 4 sees the same rows
    assert step_indices(size, seed=4, step=1, count=count) != steps[0]


class _NoEncoding:
    """The tokenizer with every encoding entry point refused: after load only decoding may happen."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return str(self._tokenizer.decode(*args, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("re-tokenised after load")

    encode = apply_chat_template = __call__


def _sample(prompt_index: int, choice: int, tokens: tuple[int, ...]) -> RolloutSample:
    return RolloutSample(
        sample_id=f"p{prompt_index}-c{choice}",
        prompt_index=prompt_index,
        choice_index=choice,
        prompt_token_ids=(),
        token_ids=tokens,
        logprobs=np.zeros(len(tokens), np.float32),
        routes=None,
    )


def test_the_math_reward_scores_decoded_completions_without_re_tokenising(tmp_path: Path, tokenizer: Any) -> None:
    path = _jsonl(
        tmp_path, [{"prompt": "what is 3 plus 4 ?", "answer": "7"}, {"prompt": "what is 2 times 3 ?", "answer": "6"}]
    )
    task = DatasetTask(
        load_problems(path, tokenizer, max_prompt_tokens=None),
        tokenizer=_NoEncoding(tokenizer),
        reward=MathReward(),
        seed=0,
    )
    problems = task.batch(1, 2)
    by_answer = {p.answer: n for n, p in enumerate(problems)}
    seven, six = by_answer["7"], by_answer["6"]
    samples = [
        _sample(seven, 0, ids(f"7 {EOS}")),
        _sample(seven, 1, ids(f"the answer is 7 {EOS}")),
        _sample(seven, 2, ids("6")),  # cut at maxTokens, wrong
        _sample(six, 0, ids(f"3 times 2 = 6 {EOS}")),
        _sample(six, 1, ids(f"{EOS}")),
    ]
    assert task.score(samples, problems).tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert task.canary_tokens == 2 and task.canary_prompts == [p.prompt_ids for p in task.pool[:4]]


def test_the_warm_up_trains_on_the_solution_while_the_reward_compares_with_the_answer(
    tmp_path: Path, tokenizer: Any
) -> None:
    from r3operator.runtime.sft import SFT_BATCH, sft_warmup

    solution = "first 3 plus 4 is 7 then 7 minus 2 is 5 so the answer is 5"
    path = _jsonl(
        tmp_path,
        [
            {"prompt": "what is 3 plus 4 then minus 2 ?", "answer": "5", "solution": solution},
            {"prompt": "what is 2 plus 2 ?", "answer": "4"},
        ],
    )
    chained, plain = load_problems(path, tokenizer, max_prompt_tokens=None)
    assert chained.target_ids == (*ids(solution), INDEX[EOS]) and chained.answer_ids == ids(f"5 {EOS}")
    assert plain.target_ids == plain.answer_ids == ids(f"4 {EOS}")

    class Recorder:
        """A trainer that records what each supervised step is asked to fit."""

        def __init__(self) -> None:
            self.pairs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

        def sft_step(self, prompts: list[tuple[int, ...]], targets: list[tuple[int, ...]]) -> float:
            self.pairs += [(tuple(p), tuple(t)) for p, t in zip(prompts, targets, strict=True)]
            return 0.0

    trainer = Recorder()
    sft_warmup(trainer, [chained, plain], steps=2, seed=0)  # type: ignore[arg-type]
    expected = {chained.prompt_ids: (*ids(solution), INDEX[EOS]), plain.prompt_ids: ids(f"4 {EOS}")}
    assert len(trainer.pairs) == 2 * SFT_BATCH and {p for p, _ in trainer.pairs} == set(expected)
    assert all(target == expected[prompt] for prompt, target in trainer.pairs)

    task = DatasetTask([chained, plain], tokenizer=_NoEncoding(tokenizer), reward=MathReward(), seed=0)
    # The model answers with the worked solution: the reward reads its final number against `answer`.
    samples = [_sample(0, 0, ids(f"{solution} {EOS}")), _sample(0, 1, ids(f"3 plus 4 is 7 {EOS}"))]
    assert task.score(samples, [chained]).tolist() == [1.0, 0.0]
    # The canary decodes as far as the longest warm-up target, capped.
    assert task.canary_tokens == 16 and len(chained.target_ids) > 16
    assert DatasetTask([plain], tokenizer=tokenizer, reward=MathReward(), seed=0).canary_tokens == 2


def test_the_example_dataset_is_generated_and_every_prompt_is_in_the_reference_vocabulary(tokenizer: Any) -> None:
    spec = importlib.util.spec_from_file_location("make_arith_dataset", ROOT / "scripts" / "make_arith_dataset.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert ARITH.read_text() == script.render(), "examples/data/arith.jsonl is stale: run scripts/make_arith_dataset.py"

    problems = load_problems(ARITH, tokenizer, max_prompt_tokens=None)
    assert len(problems) >= 24
    unk = tokenizer.unk_token_id
    for problem in problems:
        assert unk not in problem.prompt_ids, problem.problem_id
        assert len(problem.answer_ids) == 2, problem.problem_id  # one digit, then <eos>
