"""Router replay hooks on real transformers 5.x MoE models (no mocks: the routers are the library's)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tiny_moe import FAMILIES, VOCAB, build_tiny_moe  # noqa: E402

from r3operator.trainer.replay.hf import (  # noqa: E402
    ROUTER_FAMILIES,
    RouterRecorder,
    RouterReplay,
    RouterReplayError,
    UnsupportedRouterError,
    find_routers,
    natural_routing,
)

pytestmark = pytest.mark.slow


def random_ids(b: int, s: int, layers: int, experts: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, s, layers, experts, generator=g).argsort(-1)[..., :k]


def tokens(b: int = 2, s: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def shape_of(model: Any) -> tuple[int, int, int]:
    site = find_routers(model)[0].module
    return model.config.num_hidden_layers, site.num_experts, site.top_k


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_ids_are_the_ids_the_experts_use(family: str) -> None:
    model = build_tiny_moe(family)
    layers, experts, k = shape_of(model)
    ids = tokens()
    replay_ids = random_ids(2, 12, layers, experts, k)
    replay = RouterReplay().install(model)
    used = RouterRecorder(natural=False).install(model)
    natural = RouterRecorder(natural=True).install(model)
    with replay.armed(replay_ids), torch.no_grad():
        model(ids)
    assert not replay.active
    for site in find_routers(model):
        assert torch.equal(used.records[site.layer], replay_ids[:, :, site.layer].reshape(-1, k))
    # The router itself would have chosen differently somewhere: replay really overrides it.
    assert any(not torch.equal(natural.records[layer], used.records[layer]) for layer in used.records)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp32-autocast-bf16"])
def test_replaying_natural_ids_reproduces_the_model_exactly(family: str, precision: str) -> None:
    """Same ids -> identical logits: the recomputed gate values match the family's router bit for bit, also
    under bf16 autocast over fp32 weights (the runtime trainer's precision), where the router's linear
    returns bf16 whatever it casts its inputs to."""
    model = build_tiny_moe(family, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    ids = tokens()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision.endswith("autocast-bf16"))
    with torch.no_grad(), autocast:
        reference = model(ids).logits
        nat = natural_routing(model, ids)
        replay = RouterReplay().install(model)
        with replay.armed(nat):
            replayed = model(ids).logits
    assert torch.equal(reference, replayed)


@pytest.mark.parametrize("family", [*FAMILIES, "glm4_moe"])
def test_replaying_natural_ids_gives_the_natural_gradient_under_the_trainers_autocast(family: str) -> None:
    """The update's forward and backward (bf16 autocast over fp32 weights, train mode): with the ids the
    routers choose themselves replayed, the logits and every parameter's gradient, the gate weights'
    included, are the natural forward's bit for bit. The reference is the library's own forward and
    backward without the hook armed."""
    model = build_tiny_moe(family).train()
    ids = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nat = natural_routing(model, ids)
    replay = RouterReplay().install(model)
    grads, outputs = [], []
    for armed in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if armed:
                with replay.armed(nat):
                    logits = model(ids).logits
            else:
                logits = model(ids).logits
        outputs.append(logits.detach())
        logprobs = logits.float().log_softmax(-1)
        (logprobs * torch.linspace(-1, 1, logprobs.shape[-1])).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    natural, replayed = grads
    assert torch.equal(outputs[0], outputs[1])
    assert any(n.endswith("mlp.gate.weight") for n in natural)
    assert natural.keys() == replayed.keys()
    assert [n for n in natural if not torch.equal(natural[n], replayed[n])] == []


def _qwen3_block_reference(block: Any, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Independent Qwen3-MoE block with given ids: softmax gate values at idx, renormalised."""
    probs = torch.softmax(h @ block.gate.weight.T, dim=-1)
    gates = probs.gather(-1, idx)
    gates = gates / gates.sum(-1, keepdim=True)
    experts = block.experts
    gate_up = torch.einsum("nh,nkoh->nko", h, experts.gate_up_proj[idx])
    g, u = gate_up.chunk(2, dim=-1)
    out = torch.einsum("nki,nkhi->nkh", torch.nn.functional.silu(g) * u, experts.down_proj[idx])
    return (gates.unsqueeze(-1) * out).sum(1)


def test_gradient_reaches_gate_weight_and_matches_reference() -> None:
    model = build_tiny_moe("qwen3_moe").train()
    layers, experts, k = shape_of(model)
    block = model.model.layers[1].mlp
    h = torch.randn(1, 10, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    idx = random_ids(1, 10, layers, experts, k)[0, :, 1]
    replay = RouterReplay().install(model)
    with replay.armed([None, idx, None]):
        out = block(h)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    got = block.gate.weight.grad.clone()
    assert got.abs().sum() > 0
    block.zero_grad()
    ref = _qwen3_block_reference(block, h[0], idx)
    (ref * torch.linspace(-1, 1, ref.numel()).view_as(ref)).sum().backward()
    assert torch.allclose(out[0], ref, atol=1e-5)
    assert torch.allclose(got, block.gate.weight.grad, atol=1e-5)


def test_deepseek_v3_gates_ignore_the_correction_bias() -> None:
    model = build_tiny_moe("deepseek_v3").train()
    block = model.model.layers[1].mlp
    gate = block.gate
    h = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    idx = random_ids(1, 6, 3, 8, 2)[0, :, 1]
    replay = RouterReplay().install(model)
    with replay.armed([None, idx, None]):
        _, weights, got_idx = gate(h)
    scores = (h @ gate.weight.T).sigmoid().gather(-1, idx)  # unbiased scores
    expected = scores / (scores.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
    assert torch.equal(got_idx, idx)
    assert torch.allclose(weights, expected, atol=1e-6)
    weights.sum().backward()
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0


def test_gradient_checkpoint_recompute_sees_the_same_ids() -> None:
    ids = tokens()
    grads = []
    for checkpointing in (False, True):
        model = build_tiny_moe("qwen3_moe").train()
        layers, experts, k = shape_of(model)
        replay_ids = random_ids(2, 12, layers, experts, k)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        replay = RouterReplay().install(model)
        seen: list[tuple[int, torch.Tensor]] = []  # hooks after the replay hook: see what experts get
        for site in find_routers(model):
            site.module.register_forward_hook(
                lambda _m, _a, out, layer=site.layer, seen=seen: seen.append((layer, out[2]))
            )
        replay.arm(replay_ids)
        model(ids, labels=ids).loss.backward()  # stays armed through backward
        replay.disarm()
        # With checkpointing every router ran twice (forward + recompute), always with the replayed ids.
        assert len(seen) == layers * (2 if checkpointing else 1)
        for layer, used in seen:
            assert torch.equal(used, replay_ids[:, :, layer].reshape(-1, k))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")})
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-6), name


def test_sample_packing_with_nnz_indices_matches_padded_batch() -> None:
    model = build_tiny_moe("qwen3_moe")
    layers, experts, k = shape_of(model)
    lens = [7, 12]
    padded = torch.zeros(2, 12, dtype=torch.long)
    attn = torch.zeros(2, 12, dtype=torch.long)
    seqs = [tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lens)]
    for i, seq in enumerate(seqs):
        padded[i, 12 - len(seq) :] = seq  # left padding
        attn[i, 12 - len(seq) :] = 1
    replay_ids = random_ids(2, 12, layers, experts, k)
    nnz = attn.reshape(-1).nonzero().squeeze(-1)
    packed = padded.reshape(-1)[nnz].unsqueeze(0)
    position_ids = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    replay = RouterReplay().install(model)
    used = RouterRecorder(natural=False).install(model)
    with torch.no_grad():
        with replay.armed(replay_ids):
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            padded_logits = model(padded, attention_mask=attn, position_ids=pos).logits
        with replay.armed(replay_ids, nnz_indices=nnz):
            # use_cache=False: transformers only detects packing from position_ids without a KV cache.
            packed_logits = model(packed, position_ids=position_ids, use_cache=False).logits
    assert torch.equal(used.records[0], replay_ids.reshape(-1, layers, k)[nnz][:, 0])
    assert torch.allclose(packed_logits[0], padded_logits.reshape(-1, VOCAB)[nnz], atol=1e-4)


def test_padding_mask_rows_route_naturally() -> None:
    model = build_tiny_moe("qwen3_moe")
    layers, experts, k = shape_of(model)
    ids = tokens()
    replay_ids = random_ids(2, 12, layers, experts, k)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, :4] = True  # e.g. an uncaptured multi-turn prefix
    replay = RouterReplay().install(model)
    natural = RouterRecorder(natural=True).install(model)
    used = RouterRecorder(natural=False).install(model)
    with replay.armed(replay_ids, padding_mask=mask), torch.no_grad():
        model(ids)
    flat_mask = mask.reshape(-1)
    for layer in range(layers):
        assert torch.equal(used.records[layer][flat_mask], natural.records[layer][flat_mask])
        assert torch.equal(used.records[layer][~flat_mask], replay_ids[:, :, layer].reshape(-1, k)[~flat_mask])


def test_reference_model_replay_is_a_second_install() -> None:
    policy, ref = build_tiny_moe("qwen3_moe", seed=0), build_tiny_moe("qwen3_moe", seed=0)
    with torch.no_grad():  # ref drifts from policy, as after some updates
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    layers, experts, k = shape_of(policy)
    ids, replay_ids = tokens(), random_ids(2, 12, layers, experts, k)
    replays = [RouterReplay().install(m) for m in (policy, ref)]
    recorders = [RouterRecorder(natural=False).install(m) for m in (policy, ref)]
    with torch.no_grad():
        for replay, model in zip(replays, (policy, ref), strict=True):
            with replay.armed(replay_ids):
                model(ids)
    for layer in range(layers):
        assert torch.equal(recorders[0].records[layer], recorders[1].records[layer])


def test_unsupported_router_family_points_to_megatron() -> None:
    import transformers as tf

    cfg = tf.GraniteMoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = tf.GraniteMoeForCausalLM(cfg)
    with pytest.raises(UnsupportedRouterError, match=r"GraniteMoeTopKRouter.*Megatron"):
        RouterReplay().install(model)
    assert "GraniteMoeTopKRouter" not in ROUTER_FAMILIES


def test_arm_rejects_misaligned_indices() -> None:
    model = build_tiny_moe("qwen3_moe")
    layers, experts, k = shape_of(model)
    replay = RouterReplay().install(model)
    with pytest.raises(RouterReplayError, match="cover 2 layers but the model has 3 decoder layers"):
        replay.arm(random_ids(2, 12, 2, experts, k))
    with pytest.raises(RouterReplayError, match="cover 4 layers but the model has 3 decoder layers"):
        replay.arm(random_ids(2, 12, layers + 1, experts, k))  # extra layers are refused too
    with pytest.raises(RouterReplayError, match="4 per-layer replay entries but the model has 3"):
        replay.arm([None] * (layers + 1))
    with pytest.raises(RouterReplayError, match=r"outside \[0, 8\)"):
        replay.arm(random_ids(2, 12, layers, experts, k) + experts)
    replay.arm(random_ids(2, 10, layers, experts, k))
    with pytest.raises(RouterReplayError, match="router sees 24 tokens but 20"), torch.no_grad():
        model(tokens())
    replay.disarm()


def test_arm_refuses_rows_that_are_not_k_distinct_experts_unless_masked() -> None:
    model = build_tiny_moe("deepseek_v3")  # layer 0 dense (first_k_dense_replace=1), layers 1-2 MoE
    layers, experts, k = shape_of(model)
    replay = RouterReplay().install(model)
    assert replay.layers == [1, 2]
    ids = random_ids(2, 12, layers, experts, k)
    ids[:, :, 0] = 0  # zero rows on the dense layer: what vLLM reports, never replayed
    replay.arm(ids)
    zero = ids.clone()
    zero[1, 4, 2] = 0  # flat row 12 + 4 = 16 of MoE layer 2
    with pytest.raises(RouterReplayError, match=r"MoE layer 2: row 16 is all zero \[0, 0\].*padding mask"):
        replay.arm(zero)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[1, 4] = True
    replay.arm(zero, padding_mask=mask)  # "no route" said by the mask: that row routes naturally
    dup = ids.clone()
    dup[0, 3, 1] = torch.tensor([5, 5])
    with pytest.raises(RouterReplayError, match=r"MoE layer 1: row 3 repeats an expert id \[5, 5\]"):
        replay.arm(dup)
    replay.disarm()


def test_natural_routing_leaves_an_armed_replay_armed() -> None:
    model = build_tiny_moe("qwen3_moe")
    layers, experts, k = shape_of(model)
    ids, replay_ids = tokens(), random_ids(2, 12, layers, experts, k)
    replay = RouterReplay().install(model)
    replay.arm(replay_ids)
    nat = natural_routing(model, ids, replay=replay)
    assert replay.active
    assert nat.shape == (2, 12, layers, k)
    assert not torch.equal(nat, replay_ids)
    used = RouterRecorder(natural=False).install(model)
    with torch.no_grad():
        model(ids)
    assert torch.equal(used.records[0], replay_ids[:, :, 0].reshape(-1, k))
