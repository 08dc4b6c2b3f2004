"""On CUDA, the trainer's logprobs equal vLLM's processed logprobs bit for bit (the formula written out from
vllm/v1/sample/sampler.py, as in tests/trainer/test_logprobs_vllm.py). CUDA divides a tensor by a Python
float as a multiplication by its reciprocal, one bit off the true division vLLM does by its float32
temperature tensor; the CPU kernels divide truly either way, so only a GPU can catch that."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from r3operator.trainer.logprobs import logprobs_from_logits  # noqa: E402
from tests.trainer.test_logprobs_vllm import QWEN3_VOCAB, vllm_processed_logprobs  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("temperature", [0.6, 0.7, 1.3])
def test_cuda_logprobs_equal_vllms_at_the_rollout_temperature(temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 64, QWEN3_VOCAB, generator=g) * 4).to(torch.bfloat16).cuda()
    labels = torch.randint(0, QWEN3_VOCAB, (4, 64), generator=g).cuda()
    got = logprobs_from_logits(logits, labels, temperature=temperature)
    expected = vllm_processed_logprobs(logits, labels, temperature)
    assert (got - expected).abs().max().item() == 0.0
