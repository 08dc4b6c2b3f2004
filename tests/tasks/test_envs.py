"""The guessing game: token ids in, hint tokens, done and reward out."""

from __future__ import annotations

import pytest

from r3operator.models.tokenizer import vocabulary
from r3operator.tasks import toy as tasks
from r3operator.tasks.envs import GuessGame, environment

VOCAB = vocabulary(512)
ID = {tok: i for i, tok in enumerate(VOCAB)}


def _words(ids: tuple[int, ...]) -> list[str]:
    return [VOCAB[i] for i in ids]


def test_hints_point_at_the_secret_and_a_hit_ends_the_game() -> None:
    game = GuessGame(6, vocab_size=512)
    prompt = [ID[w] for w in tasks.GUESS_PROMPT]
    first = game.turn([*prompt, ID["4"], ID["<eos>"]], [ID["4"], ID["<eos>"]])
    assert _words(first.tokens) == [">", "A", ":"] and not first.done  # the secret is larger than 4
    second = game.turn([ID["7"]], [ID["7"]])
    assert _words(second.tokens) == ["<", "A", ":"] and not second.done
    third = game.turn([ID["A"], ID["6"]], [ID["A"], ID["6"], ID["3"]])  # the first digit is the guess
    assert third.done and third.tokens == () and third.reward == pytest.approx(0.5)  # 2 wrong of 4 turns


def test_no_digit_is_no_guess_and_the_turns_run_out() -> None:
    game = GuessGame(2, vocab_size=512, max_turns=2)
    reply = game.turn([ID["yes"]], [ID["yes"], ID["<eos>"]])
    assert _words(reply.tokens) == ["no", "A", ":"] and not reply.done
    last = game.turn([ID["9"]], [ID["9"]])
    assert last.done and last.reward == 0.0


def test_first_turn_hit_earns_the_full_reward() -> None:
    assert GuessGame(0, vocab_size=512).turn([ID["0"]], [ID["0"]]).reward == 1.0


def test_each_guess_problem_gets_a_game_over_its_secret() -> None:
    pool = tasks.problems("guess", vocab_size=512)
    assert [environment("guess", p, vocab_size=512).secret for p in pool] == list(range(10))  # type: ignore[attr-defined]
    assert len({p.prompt_ids for p in pool}) == 1  # one prompt: the secret lives in the environment only
    with pytest.raises(ValueError, match="'count' has no multi-turn environment"):
        environment("count", pool[0], vocab_size=512)
