"""`r3operator up --dry-run`: the processes are the rendered pods, argv and env equal to the containers'
except for the documented substitutions (cli/up/plan.py): `--port`'s value, mountPath prefixes in argv, and
the added variables."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_edits import apply_edits
from typer.testing import CliRunner
from vllm_argv import exec_argv, flag

from r3operator.api.load import parse_rljob
from r3operator.cli.main import app
from r3operator.cli.up.plan import UpError, plan_up
from r3operator.operator.desired import desired

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "examples" / "rljob-local.yaml"
QWEN = REPO / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
ROUTING, CONFIG, MODEL = "/var/lib/r3operator", "/etc/r3operator", "/mnt/model"
ENGINE_ADDED = {"PATH", "HOSTNAME"}
TRAINER_ADDED = {"PATH", "HOSTNAME", "R3OPERATOR_MOUNTS", "R3OPERATOR_ENGINE_URLS", "R3OPERATOR_DRIVER_METRICS_PORT"}


def _doc(path: Path = LOCAL, **edits: Any) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    apply_edits(doc, edits)
    return doc


def _write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _dry_run(tmp_path: Path, job: Path, *options: str) -> dict[str, Any]:
    result = CliRunner().invoke(
        app, ["up", str(job), "--dry-run", "-o", "json", "--out-dir", str(tmp_path / "runs"), *options]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _rendered(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine container and the trainer head container, as the operator renders them."""
    children = {c["kind"]: c for c in desired(parse_rljob(doc))}
    engine = children["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    head = children["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return engine, {**head, "entrypoint": children["RayJob"]["spec"]["entrypoint"]}


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _differences(rendered: list[str], argv: list[str]) -> list[tuple[str, str]]:
    assert len(rendered) == len(argv)
    return [(r, a) for r, a in zip(rendered, argv, strict=True) if r != a]


def test_processes_run_the_rendered_containers_modulo_the_documented_substitutions(tmp_path: Path) -> None:
    doc = _doc()
    plan = _dry_run(tmp_path, LOCAL, "--gpus", "none", "--port-offset", "100")
    engine_c, trainer_c = _rendered(doc)
    engine, trainer = plan["processes"]
    routing_host = plan["hostDirs"][ROUTING]
    assert Path(routing_host).is_relative_to(tmp_path / "runs" / "tiny-count-r3")

    rendered_argv = engine_c["command"] + engine_c.get("args", [])
    assert engine["renderedArgv"] == rendered_argv
    # Exactly two arguments differ: the model path on the routing volume, and the port.
    assert _differences(rendered_argv, engine["argv"]) == [
        (f"{ROUTING}/models/tiny", f"{routing_host}/models/tiny"),
        ("8000", "8100"),
    ]
    assert engine["argv"][engine["argv"].index("--port") + 1] == "8100" and engine["port"] == 8100
    assert {k: v for k, v in engine["env"].items() if k not in ENGINE_ADDED} == _env(engine_c)
    assert engine["env"]["HOSTNAME"] == "tiny-count-r3-engine-0" and "CUDA_VISIBLE_DEVICES" not in engine["env"]
    assert engine["env"]["PATH"].split(":")[0].endswith("/bin")

    assert (
        trainer["argv"]
        == shlex.split(trainer_c["entrypoint"])
        == ["r3operator", "run", "--config", f"{CONFIG}/config.json"]
    )
    added = {k: v for k, v in trainer["env"].items() if k not in _env(trainer_c)}
    assert {k: v for k, v in trainer["env"].items() if k in _env(trainer_c)} == _env(trainer_c)
    # The example's engine runs --dtype float32: the driver is told, for the canary's tolerance.
    assert set(added) == TRAINER_ADDED | {"R3OPERATOR_ENGINE_DTYPE"}
    assert added["R3OPERATOR_ENGINE_DTYPE"] == "float32"
    assert added["R3OPERATOR_ENGINE_URLS"] == "http://127.0.0.1:8100"
    assert added["R3OPERATOR_DRIVER_METRICS_PORT"] == str(doc["spec"]["monitoring"]["port"] + 100)
    mounts = dict(item.split("=", 1) for item in added["R3OPERATOR_MOUNTS"].split(","))
    assert mounts == {CONFIG: plan["hostDirs"][CONFIG], ROUTING: routing_host}


def test_the_configmap_is_written_as_rendered_where_the_trainer_reads_it(tmp_path: Path) -> None:
    config_map = next(c for c in desired(parse_rljob(_doc())) if c["kind"] == "ConfigMap")
    plan = plan_up(parse_rljob(_doc()), run_dir=tmp_path, gpus=[], bin_dir=tmp_path / "bin", host_path="")
    assert plan.config_files == {f"{plan.host_dirs[CONFIG]}/config.json": config_map["data"]["config.json"]}


def test_replicas_get_distinct_ports_gpus_and_engine_urls(tmp_path: Path) -> None:
    job = _write(tmp_path, _doc(**{"inference.replicas": 2}))
    plan = _dry_run(tmp_path, job, "--gpus", "4,5,6", "--port-offset", "7")
    engine0, engine1, trainer = plan["processes"]
    assert (engine0["port"], engine1["port"]) == (8007, 8008)
    assert (engine0["gpus"], engine1["gpus"], trainer["gpus"]) == (["4"], ["5"], ["6"])
    assert [p["env"].get("CUDA_VISIBLE_DEVICES") for p in plan["processes"]] == ["4", "5", "6"]
    assert trainer["env"]["R3OPERATOR_ENGINE_URLS"] == "http://127.0.0.1:8007,http://127.0.0.1:8008"
    assert engine1["env"]["HOSTNAME"] == "tiny-count-r3-engine-1"


def test_gpus_count_within_the_cuda_visible_devices_up_itself_was_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lane of a bigger machine: this process may use GPUs 2 and 3, and `--gpus 0,1` means those two, as in any
    # CUDA program. Each child's CUDA_VISIBLE_DEVICES is written out, so it must name the physical GPUs.
    job = _write(tmp_path, _doc())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    engine, trainer = _dry_run(tmp_path, job, "--gpus", "0,1")["processes"]
    assert (engine["env"]["CUDA_VISIBLE_DEVICES"], trainer["env"]["CUDA_VISIBLE_DEVICES"]) == ("2", "3")
    engine, trainer = _dry_run(tmp_path, job)["processes"]  # no --gpus: what this process was given
    assert (engine["gpus"], trainer["gpus"]) == (["2"], ["3"])
    result = CliRunner().invoke(app, ["up", str(job), "--dry-run", "--gpus", "1,2", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "--gpus 1,2: 2 not among the 2 GPU(s) CUDA_VISIBLE_DEVICES='2,3'" in result.output
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    engine, trainer = _dry_run(tmp_path, job, "--gpus", "0,1")["processes"]
    assert (engine["gpus"], trainer["gpus"]) == (["0"], ["1"])


LWS_ADDED = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}


def test_leader_worker_set_groups_run_as_leaders_and_headless_workers(tmp_path: Path) -> None:
    """Two replicas of DP=2 over pods of one rank: two LeaderWorkerSet groups of a leader (the API) and a
    --headless worker; each group meets on its own DP RPC port, and the trainer reaches the leaders only."""
    doc = _doc(**{"inference.replicas": 2, "inference.dataParallelSize": 2, "inference.dataParallelSizeLocal": 1})
    lws = next(c for c in desired(parse_rljob(doc)) if c["kind"] == "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    rendered = {
        "leader": template["leaderTemplate"]["spec"]["containers"][0],
        "worker": template["workerTemplate"]["spec"]["containers"][0],
    }
    plan = _dry_run(tmp_path, _write(tmp_path, doc), "--gpus", "0,1,2,3,4", "--port-offset", "7")
    *engines, trainer = plan["processes"]
    routing_host = plan["hostDirs"][ROUTING]
    name = lws["metadata"]["name"]
    assert [(e["name"], e["pod"], e["group"]) for e in engines] == [
        ("engine-0", f"{name}-0", f"{name}-0"),
        ("engine-0-1", f"{name}-0-1", f"{name}-0"),
        ("engine-1", f"{name}-1", f"{name}-1"),
        ("engine-1-1", f"{name}-1-1", f"{name}-1"),
    ]
    assert [e["port"] for e in engines] == [8007, None, 8008, None]  # a --headless worker serves no HTTP
    assert [e["gpus"] for e in [*engines, trainer]] == [["0"], ["1"], ["2"], ["3"], ["4"]]
    for engine, group, role in zip(engines, [0, 0, 1, 1], ["leader", "worker"] * 2, strict=True):
        container = rendered[role]
        assert engine["renderedArgv"] == container["command"] + container["args"]
        # Exactly three arguments differ: the model path, the HTTP port, and the group's DP RPC port.
        assert _differences(engine["renderedArgv"], engine["argv"]) == [
            (f"{ROUTING}/models/tiny", f"{routing_host}/models/tiny"),
            ("8000", str(8007 + group)),
            ("13345", str(13345 + 7 + group)),
        ]
        added = {k: v for k, v in engine["env"].items() if k not in _env(container)}
        assert set(added) == ENGINE_ADDED | {"CUDA_VISIBLE_DEVICES"} | LWS_ADDED
        assert (added["LWS_LEADER_ADDRESS"], added["LWS_GROUP_SIZE"]) == ("127.0.0.1", "2")
        assert added["LWS_WORKER_INDEX"] == ("0" if role == "leader" else "1")
    assert trainer["env"]["R3OPERATOR_ENGINE_URLS"] == "http://127.0.0.1:8007,http://127.0.0.1:8008"


def test_a_group_member_runs_its_own_dp_ranks_against_the_local_leader(tmp_path: Path) -> None:
    """The rendered shell, run with up's environment and a `vllm` that prints its argv: the worker starts at
    DP rank 1 (the leader names none), both meet at 127.0.0.1 on the group's local RPC port, only the worker
    is headless."""
    doc = _doc(**{"inference.dataParallelSize": 2, "inference.dataParallelSizeLocal": 1})
    plan = plan_up(parse_rljob(doc), run_dir=tmp_path / "run", gpus=[], bin_dir=tmp_path, host_path="/usr/bin:/bin")
    argvs = [exec_argv(engine.argv, engine.env, tmp_path) for engine in plan.engines]
    assert "--data-parallel-start-rank" not in argvs[0] and flag(argvs[1], "--data-parallel-start-rank") == "1"
    for argv in argvs:
        assert argv[0] == "serve"
        assert flag(argv, "--data-parallel-address") == "127.0.0.1"
        assert flag(argv, "--data-parallel-rpc-port") == "13345"
    assert ["--headless" in argv for argv in argvs] == [False, True]


def test_too_few_gpus_is_refused_with_the_counts(tmp_path: Path) -> None:
    job = _write(tmp_path, _doc(**{"inference.replicas": 2}))
    result = CliRunner().invoke(app, ["up", str(job), "--dry-run", "--gpus", "0,1", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "request 3 GPUs (2 engine pod(s) × 1 + trainer 1); this machine has 2 (0,1)" in result.output


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"trainer.nodes": 2}, "spec.trainer.nodes=2: up runs the trainer's head pod only"),
    ],
)
def test_topologies_a_machine_cannot_hold_are_refused(edits: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(UpError, match=message):
        plan_up(parse_rljob(_doc(**edits)), run_dir=tmp_path, gpus=[], bin_dir=tmp_path, host_path="")


def test_a_downloaded_model_needs_its_volume_and_then_maps_it(tmp_path: Path) -> None:
    job = parse_rljob(_doc(QWEN, **{"trainer.nodes": 1}))
    with pytest.raises(UpError, match=r"filled by Job qwen3-30b-a3b-r3-model-fetch .*--volume /mnt/model=DIR"):
        plan_up(job, run_dir=tmp_path, gpus=[], bin_dir=tmp_path, host_path="")
    models = tmp_path / "models"
    plan = plan_up(job, run_dir=tmp_path, gpus=[], bin_dir=tmp_path, host_path="", volumes={MODEL: models})
    (engine, *_), trainer = plan.engines, plan.trainer
    assert engine.argv[2] == f"{models}/hf/Qwen/Qwen3-30B-A3B/main"  # the cache key: hf/<repo>/<revision>
    # The trainer's R3OPERATOR_MODEL_DIR stays as rendered; the driver reads it through R3OPERATOR_MOUNTS.
    assert trainer.env["R3OPERATOR_MODEL_DIR"] == f"{MODEL}/hf/Qwen/Qwen3-30B-A3B/main"
    assert f"{MODEL}={models}" in trainer.env["R3OPERATOR_MOUNTS"].split(",")


def test_a_rule_error_starts_nothing(tmp_path: Path) -> None:
    job = _write(tmp_path, _doc(**{"inference.executorBackend": "ray"}))  # R3 + ray executor: R3-EXECUTOR-RAY
    result = CliRunner().invoke(app, ["up", str(job), "--out-dir", str(tmp_path / "runs")])
    assert result.exit_code == 1 and "R3-EXECUTOR-RAY" in result.output
    assert not (tmp_path / "runs").exists()


PD_NIXL = REPO / "benchmarks" / "jobs" / "gpu-accept-pd.yaml"


@pytest.mark.parametrize(
    ("roles", "offset"),
    [({}, 0), ({"prefill": {"replicas": 1, "dataParallelSize": 2}, "decode": {"replicas": 2}}, 3)],
    ids=["one-each", "prefill-dp2-two-decodes"],
)
def test_every_nixl_engine_listens_on_side_channel_ports_of_its_own(
    roles: dict[str, Any], offset: int, tmp_path: Path
) -> None:
    # vLLM's NixlConnector: each engine core, decode role too, binds a handshake listener at
    # VLLM_NIXL_SIDE_CHANNEL_PORT (default 5600) + its DP index, and waits for ever if the bind fails. In a cluster
    # each pod has its own network; on one host two engines at 5600 hung the GPU row's P/D job (2026-12-08).
    doc = _doc(PD_NIXL, **{f"inference.disaggregation.{k}": v for k, v in roles.items()})
    plan = _dry_run(tmp_path, _write(tmp_path, doc), "--gpus", "none", "--port-offset", str(offset))
    engines = [p for p in plan["processes"] if p["role"] == "engine"]
    listening: dict[int, str] = {}
    for engine in engines:
        config = json.loads(flag(engine["argv"], "--kv-transfer-config"))
        assert config["kv_connector"] == "NixlConnector"
        base = int(engine["env"].get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
        for dp_index in range(int(flag(engine["argv"], "--data-parallel-size"))):
            taken = listening.setdefault(base + dp_index, engine["name"])
            assert taken == engine["name"], f"{engine['name']} and {taken} both listen on {base + dp_index}"
    ranks = sum(int(flag(e["argv"], "--data-parallel-size")) for e in engines)
    assert len(listening) == ranks == len(engines) + (1 if roles else 0)
    # The prefill engines' ports are the ones they hand the decode engines (their env, not vLLM's default).
    assert all("VLLM_NIXL_SIDE_CHANNEL_PORT" in e["env"] for e in engines)
    assert min(listening) == 5600 + offset  # moved with --port-offset, as the HTTP ports are
