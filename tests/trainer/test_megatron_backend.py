"""The Megatron backend on CPU (gloo world of 1, local spec): real GPTModel, real RouterReplay.

A tiny Qwen3-MoE with a DENSE first layer (`mlp_only_layers=[0]`, like DeepSeek's first_k_dense) is
built in transformers, converted, and compared with the HF model and the HF replay hooks.
The two CPU shims (`torch.cuda.current_device` -> "cpu", no-op RNG-tracker fork) are described in
r3operator/trainer/megatron/parallel.py; everything routing-related is megatron-core's own code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core not installed (pip extra `megatron`)")

from tiny_moe import VOCAB, build_tiny_moe  # noqa: E402

from r3operator.api.enums import ReplayMode  # noqa: E402
from r3operator.api.v1alpha1 import MegatronSpec  # noqa: E402
from r3operator.routing.codec import encode  # noqa: E402
from r3operator.routing.sample import RolloutSample  # noqa: E402
from r3operator.trainer.batch import TrainBatch, build_batch  # noqa: E402
from r3operator.trainer.logprobs import token_logprobs  # noqa: E402
from r3operator.trainer.megatron import build_megatron_trainer  # noqa: E402
from r3operator.trainer.replay.hf import RouterRecorder  # noqa: E402
from r3operator.trainer.replay.hf import RouterReplay as HFRouterReplay  # noqa: E402
from r3operator.trainer.replay.megatron import MegatronReplayError, replay_instances  # noqa: E402

pytestmark = pytest.mark.slow
LAYERS, EXPERTS, TOPK = 3, 8, 2  # build_tiny_moe("qwen3_moe"): 8 experts, top-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dense-moe")
    build_tiny_moe("qwen3_moe", layers=LAYERS, dense_layers=(0,)).save_pretrained(path)  # layer 0 dense
    return path


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> Any:
    return build_megatron_trainer(None, model_dir, "cpu", micro_batch_size=2)


def make_batch(seed: int = 0) -> tuple[TrainBatch, torch.Tensor]:
    """Three right-padded samples through the production builder; the second has an uncaptured 3-token
    prefix (`routed_experts_prompt_start=3`). Routes hold every layer, the dense layer 0 as zeros."""
    rng = np.random.default_rng(seed)
    samples, routes = [], []
    for i, (prompt, gen, start) in enumerate(((6, 4, 0), (5, 3, 3), (4, 2, 0))):
        rows = rng.random((prompt + gen - 1 - start, LAYERS, EXPERTS)).argsort(-1)[..., :TOPK]
        rows[:, 0] = 0  # dense layer: vLLM reports zeros
        r = encode(rows, start=start, num_experts=EXPERTS)
        samples.append(
            RolloutSample(
                sample_id=f"s{i}",
                prompt_index=i,
                choice_index=0,
                prompt_token_ids=tuple(int(t) for t in rng.integers(3, VOCAB, prompt)),
                token_ids=tuple(int(t) for t in rng.integers(3, VOCAB, gen)),
                logprobs=np.zeros(gen, dtype=np.float32),
                routes=r,
                routed_experts_prompt_start=start,
            )
        )
        routes.append(r)
    batch = build_batch(samples, [1.0, -0.5, 0.25], routes=routes, pad_id=0)
    assert batch.engine_routes is not None
    return batch, batch.engine_routes


def hf_logprobs(hf: Any, batch: TrainBatch) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(hf, batch.input_ids, batch.attention_mask)


def hf_replay(hf: Any, batch: TrainBatch, routes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF logprobs and the ids its experts received [B, S, L, K] under replay of `routes`."""
    replay = HFRouterReplay().install(hf)
    used = RouterRecorder(natural=False).install(hf)
    try:
        with replay.armed(routes, padding_mask=batch.route_pad):
            lp = hf_logprobs(hf, batch)
        ids = used.stacked(LAYERS).reshape(*batch.input_ids.shape, LAYERS, TOPK).sort(-1).values
    finally:
        replay.remove()
        used.remove()
    return lp, ids


def test_natural_logprobs_match_hf(trainer: Any, hf: Any) -> None:
    batch, _ = make_batch()
    out = trainer.logprobs(batch, None, ReplayMode.DISABLED)
    diff = (out.logprobs - hf_logprobs(hf, batch))[batch.response_mask].abs()
    assert diff.max() < 1e-4, diff.max()


def test_logprobs_are_scored_at_the_rollout_temperature(trainer: Any, hf: Any) -> None:
    """Reference: log_softmax(logits / T) of the HF forward, written out here, at T = 0.6."""
    batch, _ = make_batch()
    batch.temperature = 0.6
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    expected = torch.log_softmax(logits / 0.6, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    out = trainer.logprobs(batch, None, ReplayMode.DISABLED)
    assert (out.logprobs - expected)[batch.response_mask].abs().max() < 1e-4


def test_hf_state_dict_round_trips_before_training(trainer: Any, hf: Any) -> None:
    sd = trainer.hf_state_dict()
    ref = hf.state_dict()
    assert set(sd) == set(ref)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


def test_r3_dispatches_exactly_the_replayed_routes_and_matches_hf_replay(trainer: Any, hf: Any) -> None:
    batch, routes = make_batch(1)
    out = trainer.logprobs(batch, routes, ReplayMode.R3, probe=True)
    captured = ~batch.route_pad
    for layer in (1, 2):  # MoE layers; layer 0 is dense
        assert torch.equal(out.used[:, :, layer][captured], routes[:, :, layer].sort(-1).values[captured])
    natural = trainer.logprobs(batch, None, ReplayMode.DISABLED).logprobs
    ref, _ = hf_replay(hf, batch, routes)
    cols = batch.response_mask
    assert (out.logprobs - ref)[cols].abs().max() < 1e-4
    assert (out.logprobs - natural)[cols].abs().max() > 1e-3  # replay really changed the routing


def test_uncaptured_prefix_routes_naturally_as_on_hf(trainer: Any, hf: Any) -> None:
    """Rows without a route (sample 1's 3-token prefix, every last token) take the router's own choice on
    both backends, so HF and Megatron agree on every real token, not only where routes were captured."""
    batch, routes = make_batch(2)
    out = trainer.logprobs(batch, routes, ReplayMode.R3, probe=True)
    off = trainer.logprobs(batch, None, ReplayMode.DISABLED, probe=True)
    ref_lp, ref_used = hf_replay(hf, batch, routes)
    real = batch.attention_mask.bool()
    moe = [1, 2]
    assert torch.equal(out.used[:, :, moe][real], ref_used[:, :, moe][real])
    # Inside the prefix the hidden states never saw a replayed token: exactly the natural routing.
    assert torch.equal(out.used[1, :3], off.used[1, :3])
    assert not torch.equal(out.used[1, :3, 1], routes[1, :3, 1].sort(-1).values)  # not the zero filler
    real_cols = real[:, 1:] & real[:, :-1]
    assert (out.logprobs - ref_lp)[real_cols].abs().max() < 1e-4
    assert (out.logprobs[1, :2] - off.logprobs[1, :2]).abs().max() < 1e-5


def test_r2_records_natural_routes_and_replaying_them_is_exact(trainer: Any) -> None:
    batch, routes = make_batch(2)
    rec = trainer.logprobs(batch, None, ReplayMode.R2, probe=True)
    assert torch.equal(rec.recorded.sort(-1).values, rec.used)
    assert rec.recorded[:, :, 0].eq(0).all()  # dense layer
    batch.route_pad = torch.zeros_like(batch.route_pad)  # every recorded row replays (pads route naturally)
    again = trainer.logprobs(batch, rec.recorded, ReplayMode.R3)
    cols = batch.response_mask
    assert (again.logprobs[cols] - rec.logprobs[cols]).abs().max() < 1e-5
    with pytest.raises(MegatronReplayError, match="must not be given rollout routes"):
        trainer.logprobs(batch, routes, ReplayMode.R2)


def _assert_clear() -> None:
    for inst in replay_instances():
        assert inst.target_topk_idx is None and inst.replay_backward_list == [] and inst.router_replay_action is None


def loss_fn(lp: torch.Tensor, mb: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mb.response_mask.float()
    return -(lp * mask).sum() / mask.sum(), {}


def test_global_replay_state_is_cleared_before_and_after_each_schedule(trainer: Any) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    batch, routes = make_batch(3)
    natural = trainer.logprobs(batch, None, ReplayMode.DISABLED).logprobs
    trainer.logprobs(batch, routes, ReplayMode.R3)
    _assert_clear()
    # Stale state from elsewhere (a crashed schedule) must not leak into the next natural forward.
    RouterReplay.set_replay_data([r.reshape(-1, TOPK)[:30] for r in routes[:, :, 1:].unbind(2)])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    assert torch.equal(trainer.logprobs(batch, None, ReplayMode.DISABLED).logprobs, natural)
    with pytest.raises(ValueError, match="does not match instances"):  # megatron's own length check
        RouterReplay.set_replay_data([routes[0, :, 1]])
    trainer.train_step(batch, routes, loss_fn)
    _assert_clear()


def test_router_fusion_is_refused_naming_the_field(model_dir: Path) -> None:
    with pytest.raises(MegatronReplayError, match=r"trainer\.megatron\.routerFusion"):
        build_megatron_trainer(MegatronSpec(router_fusion=True), model_dir, "cpu")


def test_recompute_replays_in_forward_order_and_rebuild_invalidates_old_model(trainer: Any, model_dir: Path) -> None:
    """Two micro-batches, full activation recompute: backward recompute pops REPLAY_BACKWARD routes FIFO.
    Same gradients as without recompute only if every recomputed router got its own micro-batch's routes."""
    batch, routes = make_batch(4)
    plain = build_megatron_trainer(MegatronSpec(recompute=False), model_dir, "cpu", micro_batch_size=2)
    s_plain = plain.train_step(batch, routes, loss_fn)
    with pytest.raises(MegatronReplayError, match="global RouterReplay list changed"):
        trainer.logprobs(batch, None, ReplayMode.DISABLED)  # `plain` replaced the process-global instance list
    recompute = build_megatron_trainer(MegatronSpec(recompute=True), model_dir, "cpu", micro_batch_size=2)
    s_re = recompute.train_step(batch, routes, loss_fn)
    _assert_clear()
    assert s_re["loss"] == pytest.approx(s_plain["loss"], rel=1e-6)
    assert s_re["grad_norm"] == pytest.approx(s_plain["grad_norm"], rel=1e-5)
    swapped = (routes + 1) % EXPERTS  # other (still distinct) experts: wrong routes change the gradient
    s_other = build_megatron_trainer(None, model_dir, "cpu", micro_batch_size=2).train_step(batch, swapped, loss_fn)
    assert s_other["grad_norm"] != pytest.approx(s_plain["grad_norm"], rel=1e-5)


def test_canary_forward_replays_the_engines_routes_and_reports_the_natural_ones(model_dir: Path) -> None:
    """The adapter's weight-canary forward: logits under the replayed routes equal the R3 pass; the natural
    ids are what the routers pick without replay. (Its own model: the one of the module fixture was replaced
    by the rebuild test, and megatron's replay instances are process-global.)"""
    from r3operator.trainer.megatron.adapter import MegatronPolicyTrainer

    trainer = build_megatron_trainer(None, model_dir, "cpu", micro_batch_size=2)
    batch, routes = make_batch(2)
    row, length = 0, int(batch.attention_mask[0].sum())
    sequence = batch.input_ids[row, :length].tolist()
    seq_routes, pad = routes[row : row + 1, :length], batch.route_pad[row : row + 1, :length]
    forward = MegatronPolicyTrainer(trainer).canary_forward(sequence, seq_routes, pad)

    replayed = trainer.logprobs(batch, routes, ReplayMode.R3).logprobs[row, : length - 1]
    ids = torch.as_tensor(sequence[1:])
    lp = torch.log_softmax(forward.logits[:-1], -1).gather(-1, ids[:, None])[:, 0]
    assert (lp - replayed).abs().max() < 1e-4
    natural = trainer.logprobs(batch, None, ReplayMode.DISABLED, probe=True).used[row, :length]
    assert torch.equal(forward.natural_ids.sort(-1).values, natural.sort(-1).values)


def _two_rows(long: int, short: int) -> TrainBatch:
    """Two rows with `long` and `short` response tokens, no routes (natural routing)."""
    rng = np.random.default_rng(7)
    samples = []
    for i, gen in enumerate((long, short)):
        samples.append(
            RolloutSample(
                sample_id=f"r{i}",
                prompt_index=i,
                choice_index=0,
                prompt_token_ids=tuple(int(t) for t in rng.integers(3, VOCAB, 4)),
                token_ids=tuple(int(t) for t in rng.integers(3, VOCAB, gen)),
                logprobs=np.zeros(gen, dtype=np.float32),
                routes=None,
            )
        )
    return build_batch(samples, [1.0, -0.5], routes=None, pad_id=0)


def test_micro_batches_weigh_every_token_like_the_global_token_mean(model_dir: Path) -> None:
    """The update's loss is the token-mean over the whole mini-batch (verl's token-level aggregation),
    whatever `trainer.megatron.microBatchSize` is. Reference 1, written out: on-policy (ratio 1) the PPO loss
    is -sum_i A_i n_i / sum_i n_i over rows with n_i response tokens. Reference 2: the same update without
    micro-batches (one micro-batch) has the same gradient norm. A mean of per-micro-batch token-means gives
    -(1 - 0.5) / 2 and a gradient norm ~1.8x off on these rows of 12 and 2 tokens."""
    from r3operator.trainer.megatron.adapter import MegatronPolicyTrainer

    batch = _two_rows(12, 2)
    tokens = batch.response_mask.sum(dim=1).tolist()
    assert tokens == [12, 2]
    expected_loss = -(1.0 * 12 - 0.5 * 2) / (12 + 2)
    results = {}
    for micro in (None, 1):  # built one after the other: megatron's replay instances are process-global
        policy = MegatronPolicyTrainer(
            build_megatron_trainer(None, model_dir, "cpu", micro_batch_size=micro), compute_dtype="float32"
        )
        old = policy.old_logprobs(batch, ReplayMode.DISABLED)
        results[micro] = policy.update(batch, old, mini_batches=1, clip_low=0.2, clip_high=0.28)
    for stats in results.values():
        assert stats.loss == pytest.approx(expected_loss, rel=1e-5)
    assert results[1].grad_norm == pytest.approx(results[None].grad_norm, rel=1e-4)


def test_bf16_compute_reads_every_parameter_at_its_bf16_value(model_dir: Path) -> None:
    """Off the bf16 grid (the random embedding; RMSNorm weights moved as an update moves them), the bf16
    old-logprob pass equals the pass of the same model with its parameters rounded to bf16 here and the
    rounding hooks taken off (the engine's view), and differs from the unrounded fp32 weights under
    autocast (what it computed before). The fp32 canary forward still reads the unrounded weights."""
    from r3operator.trainer import bf16_params
    from r3operator.trainer.megatron.adapter import MegatronPolicyTrainer

    mt = build_megatron_trainer(None, model_dir, "cpu", micro_batch_size=2)
    policy = MegatronPolicyTrainer(mt)
    with torch.no_grad():
        for name, param in mt.model.named_parameters():
            if "norm" in name:
                param.add_(torch.linspace(-3e-3, 3e-3, param.numel()).reshape(param.shape))
    batch, _ = make_batch(3)
    mask = batch.response_mask
    sequence = batch.input_ids[0, : int(batch.attention_mask[0].sum())].tolist()
    rounded_pass = policy.old_logprobs(batch, ReplayMode.DISABLED).logprobs * mask
    fp32_canary = policy.canary_logits(sequence)

    bf16_params.uninstall(mt.model)
    unrounded = policy.old_logprobs(batch, ReplayMode.DISABLED).logprobs * mask
    assert torch.equal(policy.canary_logits(sequence), fp32_canary)
    with torch.no_grad():
        for param in mt.model.parameters():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    engine_view = policy.old_logprobs(batch, ReplayMode.DISABLED).logprobs * mask
    assert torch.equal(rounded_pass, engine_view)
    assert not torch.equal(unrounded, engine_view)
    assert not torch.equal(policy.canary_logits(sequence), fp32_canary)


def test_r3_counts_each_moe_layers_replay_and_a_router_whose_replay_is_not_the_listed_one_counts_none(
    model_dir: Path,
) -> None:
    """The replay-hook count the step loop checks (hooks-not-fired): every MoE layer's RouterReplay asked once
    per micro-batch forward. A router whose RouterReplay is not the one in Megatron's global list (verl#7340: a
    decoder rebuilt after the list was filled) routes naturally, and its layer counts 0."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    trainer = build_megatron_trainer(None, model_dir, "cpu", micro_batch_size=2)
    batch, routes = make_batch(2)
    micro_batches = -(-batch.size // 2)  # 3 rows in micro-batches of 2
    assert trainer.logprobs(batch, routes, ReplayMode.R3).hook_calls == {1: micro_batches, 2: micro_batches}
    assert trainer.logprobs(batch, None, ReplayMode.DISABLED).hook_calls is None
    router = next(m for m in trainer.model.modules() if getattr(m, "router_replay", None) and m.layer_number == 3)
    orphaned = RouterReplay.__new__(RouterReplay)  # a live router's own replay, not in the global list
    orphaned.__dict__.update(target_topk_idx=None, recorded_topk_idx=None, router_replay_action=None)
    orphaned.replay_backward_list = []
    router.router_replay = orphaned
    assert trainer.logprobs(batch, routes, ReplayMode.R3).hook_calls == {1: micro_batches, 2: 0}
