"""A rank's part of a whole parameter (wire/shards.py): what it takes, against numpy's indexing written out."""

from __future__ import annotations

import numpy as np
import pytest

from r3operator.wire.shards import Shard, ShardError, shard_of, take

torch = pytest.importorskip("torch")


def test_take_is_the_runs_of_each_dimension_in_order() -> None:
    whole = torch.arange(6 * 4 * 5).reshape(6, 4, 5)
    shard = Shard((6, 4, 5), (((4, 2), (0, 1)), None, ((1, 3),)))
    expected = whole.numpy()[np.ix_([4, 5, 0], [0, 1, 2, 3], [1, 2, 3])]
    assert shard.shape == (3, 4, 3)
    assert np.array_equal(take(whole, shard).numpy(), expected)
    with pytest.raises(ShardError, match=r"taken from a tensor of \[6, 4\]"):
        take(whole[:, :, 0], shard)


def test_a_shard_goes_over_the_wire_and_back_and_a_malformed_one_is_named() -> None:
    shard = Shard((8, 3), (((2, 2), (6, 2)), None))
    assert Shard.from_wire(shard.to_wire(), name="w") == shard
    with pytest.raises(ShardError, match=r"^w13: not a shard"):
        Shard.from_wire({"whole": [8]}, name="w13")
    with pytest.raises(ShardError, match="outside a dimension of 8"):
        Shard((8, 3), (((6, 4),), None))


def test_the_whole_parameter_is_no_shard_and_adjacent_runs_are_one() -> None:
    assert shard_of((8, 3), {0: [(0, 4), (4, 4)]}) is None  # an engine of one rank: q, k, v back to back
    assert shard_of((8, 3), {0: [(2, 1), (3, 1), (6, 2)]}) == Shard((8, 3), (((2, 2), (6, 2)), None))


def test_an_engines_metadata_is_its_whole_parameters_with_each_workers_part() -> None:
    from r3operator.wire.sync_messages import ParameterMetadata

    whole = [["qkv", "bfloat16", [16, 8]], ["norm", "bfloat16", [8]]]
    part = Shard((16, 8), (((0, 8),), None)).to_wire()
    workers = [
        {"parameters": whole, "shards": {"qkv": part}, "refused": None},
        {"parameters": whole, "shards": {"qkv": Shard((16, 8), (((8, 8),), None)).to_wire()}, "refused": None},
    ]
    answer = ParameterMetadata().answer(workers)
    assert answer["parameters"] == whole and answer["refused"] is None
    assert [list(s) for s in answer["shards"]] == [["qkv"], ["qkv"]] and answer["shards"][0]["qkv"] == part
    # A worker that holds other whole parameters cannot share one broadcast with the first; a worker's own refusal
    # (a layout it serves otherwise) is the engine's.
    other = [*workers[:1], {**workers[1], "parameters": whole[:1]}]
    assert ParameterMetadata().answer(other)["refused"] == "its worker 1 reports other whole parameters than worker 0"
    refusing = [*workers[:1], {**workers[1], "refused": "lm_head.weight: padding rows"}]
    assert ParameterMetadata().answer(refusing)["refused"] == "lm_head.weight: padding rows"
