"""The alignment health signal reacts to misaligned routes: the trainer's natural agreement per MoE layer
drops when every route lands one token early, and R3RoutingAgreementLow fires on the exported values.

The "engine" is exact (its routes are the trainer's own natural routing of the same tokens), so aligned
routes agree everywhere; the misaligned batch is what a builder that drops `routed_experts_prompt_start`
produces for a request sent with start 1.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiny_moe import VOCAB, build_tiny_moe  # noqa: E402

from r3operator.api.enums import ReplayMode  # noqa: E402
from r3operator.observability.rules import ROUTING_AGREEMENT_MIN  # noqa: E402
from r3operator.routing.codec import encode  # noqa: E402
from r3operator.routing.sample import RolloutSample  # noqa: E402
from r3operator.trainer.batch import build_batch  # noqa: E402
from r3operator.trainer.metrics import R3Metrics  # noqa: E402
from r3operator.trainer.replay.hf import natural_routing  # noqa: E402
from tests.observability.conftest import RULES, tool  # noqa: E402

pytestmark = pytest.mark.slow
LAYERS = 3


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from r3operator.trainer.hf_policy import PolicyTrainer

    path = tmp_path_factory.mktemp("tiny-moe")
    build_tiny_moe("qwen3_moe").save_pretrained(path)
    return PolicyTrainer(path, device="cpu", learning_rate=0.0, seed=0, compute_dtype="float32")


def exported_agreement(trainer, samples: list[RolloutSample], routes: list) -> dict[int, float]:  # type: ignore[no-untyped-def]
    """Per-layer `r3operator_routing_agreement_ratio` after one R3 old-logprob pass, as the driver exports it."""
    batch = build_batch(samples, [0.0] * len(samples), routes=routes, pad_id=0)
    old = trainer.old_logprobs(batch, ReplayMode.R3)
    metrics = R3Metrics("j")
    metrics.observe_routing(old.natural_ids, batch.engine_routes, ~batch.route_pad)
    values = {}
    for layer in range(LAYERS):
        labels = {"namespace": "default", "rljob": "j", "layer": str(layer)}
        value = metrics.registry.get_sample_value("r3operator_routing_agreement_ratio", labels)
        assert value is not None, f"layer {layer} not exported"
        values[layer] = value
    return values


def test_routes_one_token_off_drop_the_agreement_and_fire_the_alert(trainer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    samples, aligned, shifted = [], [], []
    for i in range(4):
        prompt, gen = rng.integers(3, VOCAB, 8), rng.integers(3, VOCAB, 8)
        seq = torch.as_tensor(np.concatenate([prompt, gen]))[None]
        rows = natural_routing(trainer.model, seq)[0, :-1].numpy()  # the engine's rows for [0, P+G-1)
        samples.append(
            RolloutSample(
                sample_id=f"s{i}",
                prompt_index=i,
                choice_index=0,
                prompt_token_ids=tuple(map(int, prompt)),
                token_ids=tuple(map(int, gen)),
                logprobs=np.zeros(len(gen), dtype=np.float32),
                routes=None,
            )
        )
        aligned.append(encode(rows, num_experts=8))
        shifted.append(encode(rows[1:], num_experts=8))  # rows of [1, P+G-1) placed from position 0
    good = exported_agreement(trainer, samples, aligned)
    bad = exported_agreement(trainer, samples, shifted)
    assert all(v == 1.0 for v in good.values()), good  # an exact engine: the routers agree everywhere
    assert all(v < 0.5 for v in bad.values()), bad
    assert np.mean(list(bad.values())) < ROUTING_AGREEMENT_MIN < np.mean(list(good.values()))

    # Feed the exported values to the shipped rule: 15 min aligned, then 20 min one token off.
    series = "\n".join(
        f'      - series: \'r3operator_routing_agreement_ratio{{namespace="rl", rljob="j", layer="{layer}"}}\'\n'
        f"        values: '{good[layer]!r}x15 {bad[layer]!r}x20'"
        for layer in range(LAYERS)
    )
    firing = 'ALERTS{alertname="R3RoutingAgreementLow", alertstate="firing"}'
    test = tmp_path / "alignment_test.yaml"
    test.write_text(f"""rule_files:
  - {RULES}
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
{series}
      - series: 'r3operator_replay_active{{namespace="rl", rljob="j"}}'
        values: '1x35'
    promql_expr_test:
      - expr: '{firing}'
        eval_time: 15m
        exp_samples: []
      - expr: '{firing}'
        eval_time: 30m
        exp_samples:
          - labels: '{firing[:-1]}, severity="warning", namespace="rl", rljob="j"}}'
            value: 1
""")
    proc = subprocess.run([tool("promtool"), "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
