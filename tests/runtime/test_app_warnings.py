"""What `r3operator run` prints: DCP's note that a one-rank trainer saves and loads without a process group (which
it does on purpose) is left out, every other warning is not. The reference is torch's own warning, caught first
without the filter: if torch rewords it, the first half fails instead of the filter silently missing it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from r3operator.runtime import app


def _single_process_round_trip(directory: Path, prepare: Callable[[], None]) -> list[str]:
    """A one-process DCP save and load, as the one-rank trainer's checkpoint does, after `prepare`; the warnings
    they raised (and one of our own)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what an earlier test's filters would otherwise hide
        prepare()  # its filters go in front of that one
        # no_dist: without a process group even where an earlier test in this process left one initialised
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(directory), no_dist=True)
        loaded = {"w": torch.zeros(4)}
        dcp.load(loaded, checkpoint_id=str(directory), no_dist=True)
        assert torch.equal(loaded["w"], torch.arange(4.0))
        warnings.warn("a warning of our own", UserWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def test_dcps_single_process_note_is_filtered_and_other_warnings_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RAY_USAGE_STATS_ENABLED", "TOKENIZERS_PARALLELISM", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(name, "0")  # restored after the test: _prepare_env only sets defaults
    unfiltered = _single_process_round_trip(tmp_path / "before", lambda: None)
    assert any("assuming the intent is to save in a single process" in m for m in unfiltered)
    assert any("assuming the intent is to load in a single process" in m for m in unfiltered)
    filtered = _single_process_round_trip(tmp_path / "after", lambda: app._prepare_env("cpu"))
    assert "a warning of our own" in filtered
    assert not any("assuming the intent" in m for m in filtered), filtered
