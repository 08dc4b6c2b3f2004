"""api/weight_transfer.py: which weight-sync transport for which topology and vLLM release, and the engine
flags the operator renders for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from packaging.version import Version
from spec_edits import apply_edits

from r3operator.api.enums import WeightSyncLayout
from r3operator.api.load import parse_rljob
from r3operator.api.plan import plan
from r3operator.api.rules import evaluate
from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.api.versions import EngineVersion, VersionSource
from r3operator.api.vllm_args import vllm_serve_args
from r3operator.api.weight_transfer import (
    LayoutChoice,
    Topology,
    TransferMethod,
    choose_layout,
    choose_transfer,
    cluster_transfer,
    native_since,
    weight_transfer_config_arg,
)
from r3operator.operator.builders.config import runtime_config

QWEN = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


def _version(text: str | None) -> EngineVersion:
    return EngineVersion(Version(text) if text else None, VersionSource.SPEC if text else VersionSource.UNKNOWN)


def _doc(**edits: object) -> dict:
    doc = yaml.safe_load(QWEN.read_text())
    apply_edits(doc, edits)
    return doc


def _spec(image: str) -> RLJobSpec:
    """The example on engine ``image``, with a trainer image whose tag names no vLLM (the engines decide)."""
    return parse_rljob(_doc(**{"inference.image": image, "trainer.image": "acme/trainer:1.0"})).spec


@pytest.mark.parametrize(
    ("topology", "version", "method", "fallback"),
    [
        # the cluster: NCCL from the first release with the backend AND the start/finish bracket
        (Topology.SEPARATE_GPUS, "0.22.1", TransferMethod.NCCL, False),
        (Topology.SEPARATE_GPUS, "0.30.0", TransferMethod.NCCL, False),
        (Topology.SEPARATE_GPUS, "0.16.0", TransferMethod.PACKED, True),  # NCCL backend, no bracket
        (Topology.SEPARATE_GPUS, "0.14.0", TransferMethod.PACKED, True),  # no native API at all
        (Topology.SEPARATE_GPUS, None, TransferMethod.PACKED, True),  # unknown: fail closed
        # the local GPU run: the engine shares the trainer's GPU
        (Topology.SHARED_GPU, "0.22.1", TransferMethod.IPC, False),
        (Topology.SHARED_GPU, "0.17.1", TransferMethod.PACKED, True),
        (Topology.SHARED_GPU, "0.16.0", TransferMethod.PACKED, True),  # NCCL only: no IPC backend yet
        # CPU engines: the packed path is the design, not a fallback
        (Topology.CPU, "0.30.0", TransferMethod.PACKED, False),
        (Topology.CPU, None, TransferMethod.PACKED, False),
    ],
)
def test_method_per_topology_and_release(
    topology: Topology, version: str | None, method: TransferMethod, fallback: bool
) -> None:
    choice = choose_transfer(topology, _version(version))
    assert (choice.method, choice.fallback) == (method, fallback)


def test_a_fallback_names_the_missing_feature_and_the_release_that_has_it() -> None:
    choice = choose_transfer(Topology.SEPARATE_GPUS, _version("0.16.0"))
    assert choice.describe() == (
        "packed (fallback: engine vLLM 0.16.0 lacks native nccl transfer (weight-transfer-bracket needs >= 0.22.1))"
    )
    unknown = choose_transfer(Topology.SHARED_GPU, _version(None))
    assert "version unknown" in unknown.reason and ">= 0.22.1" in unknown.reason
    assert "spec.inference.vllmVersion" in unknown.reason


def test_native_since_is_the_later_of_backend_and_bracket() -> None:
    assert native_since(TransferMethod.NCCL) == "0.22.1"
    assert native_since(TransferMethod.IPC) == "0.22.1"


@pytest.mark.parametrize(
    ("image", "flag"),
    [
        ("ghcr.io/r3operator/engine:0.1.0-vllm0.30.0", '{"backend":"nccl"}'),
        ("vllm/vllm-openai:v0.22.1", '{"backend":"nccl"}'),
        ("vllm/vllm-openai:v0.16.0", None),  # the backend without the bracket: the packed path, no flag
        ("vllm/vllm-openai:v0.14.0", None),
        ("vllm/vllm-openai:latest", None),
    ],
)
def test_engine_flag_rendered_only_on_images_that_have_the_native_transfer(image: str, flag: str | None) -> None:
    args = vllm_serve_args(_spec(image), model_path="m")
    rendered = args[args.index("--weight-transfer-config") + 1] if "--weight-transfer-config" in args else None
    assert rendered == flag
    # the packed path stays available on every image: the worker extension is always there
    assert "--worker-extension-cls" in args


def test_runtime_config_tells_the_trainer_the_rendered_method() -> None:
    doc = _doc(**{"inference.image": "vllm/vllm-openai:v0.22.1", "trainer.image": "acme/trainer:1.0-vllm0.22.1"})
    native = json.loads(runtime_config(parse_rljob(doc)).to_json())
    assert native["runtime"]["weightTransfer"] == {
        "method": "nccl",
        "reason": "vLLM 0.22.1 native nccl weight transfer; the trainer image carries vLLM 0.22.1",
        "fallback": False,
    }
    old = json.loads(runtime_config(parse_rljob(_doc(**{"inference.image": "vllm/vllm-openai:v0.16.0"}))).to_json())
    assert old["runtime"]["weightTransfer"]["method"] == "packed"
    assert old["runtime"]["weightTransfer"]["fallback"] is True


@pytest.mark.parametrize(
    ("trainer_image", "engine_image", "method", "fallback", "says"),
    [
        # the trainer image names the engines' release: the native sender matches, NCCL confirmed
        ("acme/trainer:1.0-vllm0.22.1", "vllm/vllm-openai:v0.22.1", TransferMethod.NCCL, False, "carries vLLM 0.22.1"),
        # another release: the update-info wire format differs, so the packed path, and what restores NCCL
        ("acme/trainer:1.0-vllm0.22.1", "vllm/vllm-openai:v0.30.0", TransferMethod.PACKED, True, "tagged -vllm0.30.0"),
        ("acme/trainer:1.0-vllm0.30.0", "vllm/vllm-openai:v0.22.1", TransferMethod.PACKED, True, "!= engine vLLM"),
        # the tag says nothing: rendered for NCCL, and the driver decides at start from what it can import
        ("acme/trainer:1.0", "vllm/vllm-openai:v0.22.1", TransferMethod.NCCL, False, "checks at start"),
        # the engines cannot do it: the trainer image changes nothing
        ("acme/trainer:1.0-vllm0.16.0", "vllm/vllm-openai:v0.16.0", TransferMethod.PACKED, True, "lacks native"),
    ],
)
def test_cluster_transfer_needs_the_engines_vllm_release_in_the_trainer_image(
    trainer_image: str, engine_image: str, method: TransferMethod, fallback: bool, says: str
) -> None:
    spec = parse_rljob(_doc(**{"inference.image": engine_image, "trainer.image": trainer_image})).spec
    choice = cluster_transfer(spec)
    assert (choice.method, choice.fallback) == (method, fallback)
    assert says in choice.reason
    rendered = vllm_serve_args(spec, model_path="m")
    assert ("--weight-transfer-config" in rendered) is (method is TransferMethod.NCCL)


def test_cluster_transfer_reads_the_explicit_version_over_the_tag() -> None:
    spec = parse_rljob(_doc(**{"inference.image": "acme/engine@sha256:" + "0" * 64, "inference.vllmVersion": "0.22.1"}))
    assert cluster_transfer(spec.spec).method is TransferMethod.NCCL


def test_extra_args_may_not_set_the_derived_weight_transfer_flag() -> None:
    job = parse_rljob(_doc(**{"inference.extraArgs": ['--weight-transfer-config={"backend":"ipc"}']}))
    findings = [f for f in evaluate(job.spec) if f.rule == "EXTRA-ARGS-DERIVED"]
    assert findings and "--weight-transfer-config" in findings[0].message


def test_the_packed_path_has_no_engine_flag() -> None:
    assert json.loads(weight_transfer_config_arg(TransferMethod.IPC)) == {"backend": "ipc"}
    with pytest.raises(ValueError, match="packed path needs no --weight-transfer-config"):
        weight_transfer_config_arg(TransferMethod.PACKED)


_KERNEL_OK = {
    "weightSync.layout": "kernel",
    "inference.tensorParallelSize": 1,
    "inference.enableExpertParallel": False,
}


def _kernel_findings(**edits: object) -> list[str]:
    spec = parse_rljob(_doc(**{**_KERNEL_OK, **edits})).spec
    return [f.message for f in evaluate(spec) if f.rule == "WEIGHT-SYNC-KERNEL-LAYOUT"]


@pytest.mark.parametrize("release", ["0.22.1", "0.30.0", "0.33.0"])
def test_the_kernel_layout_is_accepted_on_whole_unquantized_parameters_of_the_releases_with_a_kernel_bracket(
    release: str,
) -> None:
    """vLLM 0.22.x brackets a kernel-format sync itself; from 0.30 the worker extension does (engine/worker.py)."""
    image = f"ghcr.io/r3operator/engine:0.1.0-vllm{release}"
    assert _kernel_findings(**{"inference.image": image}) == []
    assert (
        _kernel_findings(
            **{"inference.image": image, "weightSync.layout": "checkpoint", "inference.tensorParallelSize": 2}
        )
        == []
    )
    assert (
        _kernel_findings(**{"inference.image": image, "weightSync.layout": "auto", "inference.tensorParallelSize": 2})
        == []
    )
    assert parse_rljob(_doc()).spec.weight_sync.layout.value == "auto"


@pytest.mark.parametrize(
    ("edits", "named"),
    [
        # 0.26.0's wheel: its start_weight_update() takes no is_checkpoint_format and its trainer factory is not 0.30's
        ({"inference.image": "ghcr.io/r3operator/engine:0.1.0-vllm0.26.0"}, "engine vLLM 0.26.0 has no kernel bracket"),
        ({"inference.image": "acme/engine:latest"}, "is unknown"),
        ({"inference.tensorParallelSize": 2}, "engine vLLM 0.22.1 is not verified"),
        ({"inference.enableExpertParallel": True}, "inference.enableExpertParallel: each engine rank holds a part"),
        ({"inference.extraArgs": ["--quantization=fp8"]}, "--quantization=fp8"),
    ],
)
def test_the_kernel_layout_is_refused_where_it_cannot_be_right(edits: dict[str, object], named: str) -> None:
    [message] = _kernel_findings(**edits)
    assert message.startswith("spec.weightSync.layout kernel") and named in message


@pytest.mark.parametrize("release", ["0.30.0", "0.33.0"])
@pytest.mark.parametrize(
    "sharding",
    [{"inference.tensorParallelSize": 2}, {"inference.tensorParallelSize": 4, "inference.enableExpertParallel": True}],
)
def test_a_tensor_or_expert_parallel_engine_takes_the_kernel_layout_where_its_layers_sharding_is_read(
    release: str, sharding: dict[str, object]
) -> None:
    """Each rank takes its part of the whole parameters (engine/shards.py), read off vLLM >= 0.30's layers."""
    tags = {
        "inference.image": f"ghcr.io/r3operator/engine:0.1.0-vllm{release}",
        "trainer.image": f"ghcr.io/r3operator/trainer:0.1.0-vllm{release}",
    }
    assert _kernel_findings(**tags, **sharding) == []
    chosen = _layout(**tags, **sharding)
    assert chosen.layout is WeightSyncLayout.KERNEL and "each engine rank its part" in chosen.describe()
    # Pipeline and context parallelism, and EPLB's redundant experts, stay refused on every release.
    [staged] = _kernel_findings(**tags, **sharding, **{"inference.pipelineParallelSize": 2})
    assert "inference.pipelineParallelSize is 2" in staged
    if sharding.get("inference.enableExpertParallel"):
        [eplb] = _kernel_findings(**tags, **sharding, **{"inference.extraArgs": ["--enable-eplb"]})
        assert "enables EPLB" in eplb


def _layout(**edits: object) -> LayoutChoice:
    job = parse_rljob(_doc(**{**_KERNEL_OK, "weightSync.layout": "auto", **edits}))
    return plan(job).weight_sync_layout


@pytest.mark.parametrize("release", ["0.22.1", "0.33.0"])
def test_auto_takes_the_kernel_layout_for_the_a3b_shape_on_both_releases_and_status_resolved_says_so(
    release: str,
) -> None:
    """The a3b GPU job's shape (one engine rank, unquantized) on the GPU acceptance run's two releases."""
    tags = {"inference.image": f"ghcr.io/r3operator/engine:0.1.0-vllm{release}"}
    tags["trainer.image"] = f"ghcr.io/r3operator/trainer:0.1.0-vllm{release}"
    chosen = _layout(**tags)
    assert chosen.layout is WeightSyncLayout.KERNEL and not chosen.fallback
    assert f"engine vLLM {release} over nccl" in chosen.describe()
    resolved = plan(parse_rljob(_doc(**{**_KERNEL_OK, "weightSync.layout": "auto", **tags}))).to_resolved()
    assert resolved.weight_sync_layout is WeightSyncLayout.KERNEL
    assert resolved.weight_sync_layout_reason == chosen.describe()


@pytest.mark.parametrize(
    ("edits", "named"),
    [
        ({"inference.tensorParallelSize": 2}, "inference.tensorParallelSize is 2"),
        ({"inference.image": "ghcr.io/r3operator/engine:0.1.0-vllm0.26.0"}, "engine vLLM 0.26.0"),
        # a trainer image of another release: the transfer itself falls back to packed, which has no kernel layout
        ({"trainer.image": "ghcr.io/r3operator/trainer:0.1.0-vllm0.30.0"}, "needs vLLM's native transfer"),
    ],
)
def test_auto_falls_back_to_checkpoint_naming_why_the_kernel_layout_is_not_admitted(
    edits: dict[str, object], named: str
) -> None:
    chosen = _layout(**edits)
    assert chosen.layout is WeightSyncLayout.CHECKPOINT and chosen.fallback
    assert chosen.describe().startswith("layout checkpoint (fallback: auto: ") and named in chosen.describe()
    assert _kernel_findings(**{**edits, "weightSync.layout": "auto"}) == []  # auto is never refused


def test_checkpoint_is_taken_as_asked_and_the_run_time_fallback_says_the_same_words() -> None:
    asked = _layout(**{"weightSync.layout": "checkpoint"})
    assert asked == LayoutChoice(WeightSyncLayout.CHECKPOINT, "spec.weightSync.layout checkpoint")
    kernel = _layout()
    refused = kernel.refused("3 of 39 parameter(s) differ from vLLM's own load_weights")
    assert refused.layout is WeightSyncLayout.CHECKPOINT and refused.fallback
    assert refused.describe() == (
        "layout checkpoint (fallback: kernel refused at run time: 3 of 39 parameter(s) differ from vLLM's own "
        "load_weights)"
    )


def test_cpu_engines_sync_packed_in_the_checkpoint_layout_by_design() -> None:
    spec = parse_rljob(_doc(**{**_KERNEL_OK, "weightSync.layout": "auto"})).spec
    packed = choose_transfer(Topology.CPU, _version("0.30.0"))
    chosen = choose_layout(spec, _version("0.30.0"), packed)
    assert chosen.layout is WeightSyncLayout.CHECKPOINT and not chosen.fallback
