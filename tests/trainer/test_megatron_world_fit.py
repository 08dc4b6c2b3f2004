"""The Megatron parallel sizes against the trainer's rank count: refused before any rank starts, naming
the fields to change."""

from __future__ import annotations

import pytest

from r3operator.trainer.megatron.parallel import ParallelSizes, check_world


def test_sizes_that_fit_the_ranks_pass() -> None:
    check_world(ParallelSizes(tp=2, sequence_parallel=True), 4)  # 2 data-parallel replicas
    check_world(ParallelSizes(tp=2, ep=4, sequence_parallel=True), 8, num_experts=64)
    check_world(ParallelSizes(ep=2), 2, num_experts=8)
    check_world(ParallelSizes(pp=2), 2, num_experts=8, num_layers=4)
    check_world(ParallelSizes(pp=2, ep=2), 8, num_experts=8, num_layers=4)  # 2 data-parallel replicas per stage


def test_model_parallel_sizes_must_divide_the_ranks() -> None:
    with pytest.raises(
        ValueError,
        match=r"tensorParallelSize × pipelineParallelSize × contextParallelSize = "
        r"2 × 1 × 1 = 2 does not divide the trainer's 3 ranks \(trainer\.nodes × "
        r"trainer\.gpusPerNode",
    ):
        check_world(ParallelSizes(tp=2, sequence_parallel=True), 3)


def test_expert_sizes_must_divide_the_ranks_and_the_experts() -> None:
    with pytest.raises(
        ValueError,
        match=r"expertParallelSize × expertTensorParallelSize × pipelineParallelSize = "
        r"4 × 1 × 1 = 4 does not divide the trainer's 2 ranks",
    ):
        check_world(ParallelSizes(ep=4), 2)
    with pytest.raises(ValueError, match=r"expertParallelSize 3 does not divide the model's 8 experts"):
        check_world(ParallelSizes(ep=3), 3, num_experts=8)


def test_pipeline_stages_must_divide_the_ranks_and_the_layers() -> None:
    with pytest.raises(ValueError, match=r"2 × 2 × 1 = 4 does not divide the trainer's 2 ranks"):
        check_world(ParallelSizes(tp=2, pp=2, sequence_parallel=True), 2)
    with pytest.raises(ValueError, match=r"pipelineParallelSize 2 does not divide the model's 3 decoder layers"):
        check_world(ParallelSizes(pp=2), 2, num_layers=3)


def test_unsupported_combinations_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"pipelineParallelSize 2 with a model that ties its input and output"):
        check_world(ParallelSizes(pp=2), 2, num_layers=4, tied_embeddings=True)
    with pytest.raises(ValueError, match=r"tensorParallelSize 2 on an MoE model needs .*sequenceParallel"):
        check_world(ParallelSizes(tp=2), 2)
