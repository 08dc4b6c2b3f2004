"""benchmarks/gpu_memory.py against a stand-in nvidia-smi that answers as the real one does (csv, no header, no
units) for the GPUs it is asked about."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.gpu_memory import used_mib

ANSWER = {0: 46329, 1: 51227, 2: 0, 3: 4}  # MiB per physical GPU


@pytest.fixture
def nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    lines = "".join(f'{i}) echo "{i}, {mib}" ;; ' for i, mib in ANSWER.items())
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/bash\n"
        'ids="0,1,2,3"\n'
        'for a in "$@"; do case "$a" in --id=*) ids=${a#--id=} ;; esac; done\n'
        "for i in $(echo \"$ids\" | tr , ' ' | tr ' ' '\\n' | sort -r); do case $i in " + lines + "esac; done\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return script


@pytest.mark.usefixtures("nvidia_smi")
def test_every_gpu_in_index_order_when_none_is_named() -> None:
    assert used_mib({}) == [46329, 51227, 0, 4]  # the stand-in answers in reverse: the order is used_mib's


@pytest.mark.usefixtures("nvidia_smi")
def test_only_the_gpus_a_run_was_given() -> None:
    assert used_mib({"CUDA_VISIBLE_DEVICES": "0,1"}) == [46329, 51227]
    assert used_mib({"CUDA_VISIBLE_DEVICES": "3"}) == [4]
