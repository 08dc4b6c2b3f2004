"""The weight canary's trainer forward: the engine's routes replayed, the routers' own choices recorded."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiny_moe import build_tiny_moe  # noqa: E402

from r3operator.rollout.base import Greedy  # noqa: E402
from r3operator.routing.codec import encode  # noqa: E402
from r3operator.trainer.hf_policy import PolicyTrainer  # noqa: E402
from r3operator.weightsync.canary import CanaryMismatchError, canary_forwards, check_routing_agreement  # noqa: E402

LAYERS, EXPERTS, TOPK = 2, 8, 2  # build_tiny_moe("qwen3_moe") has 8 experts, top-2


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> PolicyTrainer:
    path = tmp_path_factory.mktemp("canary-moe")
    build_tiny_moe("qwen3_moe", layers=LAYERS).save_pretrained(path)
    return PolicyTrainer(path, device="cpu", learning_rate=1e-4, seed=0, compute_dtype="float32")


SEQUENCE = [1, 7, 9, 11, 13, 17, 19]


def natural_routes(trainer: PolicyTrainer, sequence: list[int]) -> np.ndarray:
    """[S, L, K] ids the routers pick on their own."""
    no_routes = torch.zeros(1, len(sequence), LAYERS, TOPK, dtype=torch.int64)
    everything_natural = torch.ones(1, len(sequence), dtype=torch.bool)
    return np.asarray(trainer.canary_forward(sequence, no_routes, everything_natural).natural_ids)


def test_own_routes_replayed_give_the_natural_logits(trainer: PolicyTrainer) -> None:
    routes = torch.from_numpy(natural_routes(trainer, SEQUENCE))[None]
    forward = trainer.canary_forward(SEQUENCE, routes, torch.zeros(1, len(SEQUENCE), dtype=torch.bool))
    assert torch.allclose(forward.logits, trainer.canary_logits(SEQUENCE), atol=1e-5)


def test_other_routes_change_the_logits_but_not_the_recorded_natural_choice(trainer: PolicyTrainer) -> None:
    natural = natural_routes(trainer, SEQUENCE)
    other = (natural + 3) % EXPERTS  # a different expert set at every token-layer
    forward = trainer.canary_forward(
        SEQUENCE, torch.from_numpy(other)[None], torch.zeros(1, len(SEQUENCE), dtype=torch.bool)
    )
    assert not torch.allclose(forward.logits, trainer.canary_logits(SEQUENCE), atol=1e-3)
    assert np.array_equal(np.sort(np.asarray(forward.natural_ids), -1), np.sort(natural, -1))


def _greedy(routes: np.ndarray, prompt_len: int) -> Greedy:
    """The engine's answer: tokens after the prompt, routes of every position but the last (never forwarded)."""
    return Greedy(
        SEQUENCE[prompt_len:], [0.0] * (len(SEQUENCE) - prompt_len), encode(routes[:-1], start=0, num_experts=EXPERTS)
    )


def test_agreement_is_one_with_the_engines_own_routes_and_fails_with_a_foreign_gate(trainer: PolicyTrainer) -> None:
    prompt = SEQUENCE[:3]
    natural = natural_routes(trainer, SEQUENCE)
    same = canary_forwards(trainer, [prompt], [_greedy(natural, 3)])
    assert same.routing_agreement == 1.0
    assert torch.allclose(same.logits_fn(SEQUENCE), trainer.canary_logits(SEQUENCE), atol=1e-5)
    check_routing_agreement(same.routing_agreement, where="engine 0")

    foreign = canary_forwards(trainer, [prompt], [_greedy((natural + 3) % EXPERTS, 3)])
    assert foreign.routing_agreement == 0.0
    with pytest.raises(CanaryMismatchError, match=r"engine 0: .*0\.0% of the canary's token-layers.*gate"):
        check_routing_agreement(foreign.routing_agreement, where="engine 0")


def test_an_engine_without_routes_gets_the_natural_forward(trainer: Any) -> None:
    forwards = canary_forwards(trainer, [SEQUENCE[:3]], [Greedy(SEQUENCE[3:], [0.0] * 4)])
    assert forwards.routing_agreement is None
    assert torch.equal(forwards.logits_fn(SEQUENCE), trainer.canary_logits(SEQUENCE))
