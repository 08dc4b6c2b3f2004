"""`r3operator up FILE`: run the RLJob's rendered topology on this machine (docs/up.md).

Exit codes: the trainer's exit code once it ran; 1 a rule reported an error (the operator would create
nothing) or the topology did not come up; 2 the file is not an RLJob or cannot run as local processes;
130 Ctrl-C; 143 SIGTERM.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from r3operator.cli import output

if TYPE_CHECKING:
    from r3operator.api.v1alpha1 import RLJobSpec


class UpOutput(StrEnum):
    TEXT = "text"
    JSON = "json"


def _say(line: str) -> None:
    output.out.print(line, markup=False)


def _echo(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def local_gpus(spec: str | None, visible: str | None = None) -> list[str]:
    """The physical GPU ids to hand out. ``--gpus``: ``0,1``, ``none``; unset: every GPU this process may use.

    ``visible`` is this process's own ``CUDA_VISIBLE_DEVICES``: when set, ``--gpus`` counts within it, as every
    CUDA program does (``CUDA_VISIBLE_DEVICES=2,3 … --gpus 0,1`` runs on GPUs 2 and 3; each child gets its
    ``CUDA_VISIBLE_DEVICES`` written out, so it must name the GPUs themselves), and unset ``--gpus`` means all of
    it. Without it: nvidia-smi's list (none without nvidia-smi)."""
    given = None
    if spec is not None:
        given = [] if spec.strip().lower() in ("", "none") else [g.strip() for g in spec.split(",") if g.strip()]
    if visible is not None:
        allowed = [g.strip() for g in visible.split(",") if g.strip()]
        if given is None:
            return allowed
        outside = [g for g in given if not (g.isdigit() and int(g) < len(allowed))]
        if outside:
            raise ValueError(
                f"--gpus {spec}: {', '.join(outside)} not among the {len(allowed)} GPU(s) CUDA_VISIBLE_DEVICES="
                f"{visible!r} leaves this process (count from 0 within it)"
            )
        return [allowed[int(g)] for g in given]
    if given is not None:
        return given
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    result = subprocess.run(
        [smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, check=False
    )
    return [line.strip() for line in result.stdout.splitlines() if line.strip()] if result.returncode == 0 else []


def _parse_volumes(items: list[str]) -> dict[str, Path]:
    volumes: dict[str, Path] = {}
    for item in items:
        inside, sep, outside = item.partition("=")
        if not sep or not inside.startswith("/") or not outside:
            raise ValueError(f"--volume {item!r}: expected MOUNT_PATH=HOST_DIR with an absolute MOUNT_PATH")
        volumes[inside] = Path(outside).expanduser().absolute()
    return volumes


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def up(
    file: Annotated[Path, typer.Argument(help="An RLJob YAML file, e.g. examples/rljob-local.yaml.")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", "--print", help="Print the processes (argv, env, GPUs, ports); start none.")
    ] = False,
    output_format: Annotated[UpOutput, typer.Option("--output", "-o", help="--dry-run format: text or json")] = (
        UpOutput.TEXT
    ),
    out_dir: Annotated[Path, typer.Option(help="The run directory is OUT_DIR/<job name>.")] = Path("runs/up"),
    gpus: Annotated[
        str | None,
        typer.Option(
            help="GPUs to hand out, e.g. 0,1, or none; counted within CUDA_VISIBLE_DEVICES when that is set "
            "(default: all of those, or what nvidia-smi lists)."
        ),
    ] = None,
    port_offset: Annotated[
        int, typer.Option(min=0, help="Added to every rendered port (engine N listens on containerPort+offset+N).")
    ] = 0,
    steps: Annotated[int | None, typer.Option(min=1, help="Override spec.algorithm.steps (R3OPERATOR_STEPS).")] = None,
    volume: Annotated[
        list[str] | None,
        typer.Option(help="MOUNT_PATH=HOST_DIR: a volume's directory here (needed for pvc:// and hf:// models)."),
    ] = None,
    max_restarts: Annotated[int, typer.Option(min=0, help="Restarts of a dead engine before up gives up.")] = 5,
) -> None:
    """Run the RLJob's rendered pods as local processes: engines (`vllm serve`) and the trainer driver."""
    from r3operator.api import RLJobLoadError, load_rljob
    from r3operator.api.rules import errors, evaluate
    from r3operator.cli.up import vllm_cli
    from r3operator.cli.up.plan import UpError, plan_up
    from r3operator.settings import process_environment

    try:
        job = load_rljob(file)
    except RLJobLoadError as exc:
        output.print_load_error(exc)
        raise typer.Exit(2) from None
    if problems := errors(evaluate(job.spec)):
        for finding in problems:
            output.err.print(f"{file}: error {finding.rule} {finding.field}: {finding.message}", markup=False)
        raise typer.Exit(1)
    try:
        handed = local_gpus(gpus, process_environment().get("CUDA_VISIBLE_DEVICES"))
    except ValueError as exc:
        output.err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None
    if not handed and (refused := _cpu_r3_refusal(job.spec)):
        output.err.print(f"{file}: error spec.routingReplay.mode: {refused}", markup=False)
        raise typer.Exit(1)
    try:
        plan = plan_up(
            job,
            run_dir=out_dir / job.metadata.name,
            gpus=handed,
            bin_dir=Path(sys.prefix) / "bin",
            host_path=process_environment().get("PATH", ""),
            vllm_entry_point=vllm_cli.needed(),
            port_offset=port_offset,
            steps=steps,
            volumes=_parse_volumes(volume or []),
        )
    except (UpError, ValueError) as exc:
        output.err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None
    if dry_run:
        if output_format is UpOutput.JSON:
            print(json.dumps(plan.as_json(), indent=2))
        else:
            _print_plan(plan)
        return
    raise typer.Exit(_run(plan, max_restarts=max_restarts))


def _cpu_r3_refusal(spec: RLJobSpec) -> str | None:
    """Why R3 cannot run on this machine's CPU engines (`vllm serve` of the vLLM installed here), or None."""
    from r3operator.api.checks import cpu_route_capture_refusal
    from r3operator.api.enums import ReplayMode
    from r3operator.api.versions import installed_engine_version

    if spec.routing_replay.mode is not ReplayMode.R3:
        return None
    reason = cpu_route_capture_refusal(installed_engine_version())
    return f"R3 cannot run on this machine's CPU engines: {reason}" if reason else None


def _print_plan(plan: object) -> None:
    from r3operator.cli.up.plan import UpPlan

    assert isinstance(plan, UpPlan)
    _say(f"RLJob {plan.job}: {len(plan.engines)} engine pod(s) + the trainer head, as desired() renders them")
    _say(f"run directory {plan.run_dir}")
    for mount, host in sorted(plan.host_dirs.items()):
        _say(f"  volume {mount} -> {host}")
    for proc in [*plan.engines, plan.trainer]:
        added = {k: v for k, v in proc.env.items() if proc.rendered_env.get(k) != v}
        _say(
            f"\n{proc.name} (pod {proc.pod}, container {proc.container}) GPUs {','.join(proc.gpus) or '-'}"
            + (f" port {proc.port}" if proc.port else "")
        )
        _say("  argv: " + " ".join(proc.argv))
        for key, value in sorted(proc.rendered_env.items()):
            _say(f"  env {key}={value}")
        for key, value in sorted(added.items()):
            _say(f"  env {key}={value}  (up)")
    for note in plan.notes:
        _say(f"\nnote: {note}")


def _run(plan: object, *, max_restarts: int) -> int:
    import time

    from r3operator.cli.up.plan import UpPlan
    from r3operator.cli.up.runner import Runner, Stopped, UpFailed, exit_status, raise_on_sigterm
    from r3operator.settings import REFERENCE_MODELS_SUBDIR, RuntimeSettings, process_environment

    assert isinstance(plan, UpPlan)
    ports = [p.port for p in plan.engines if p.port is not None]
    metrics = plan.trainer.env.get(RuntimeSettings.env_name("driver_metrics_port"))
    taken = [p for p in [*ports, *([int(metrics)] if metrics else [])] if _port_taken(p)]
    if taken:
        output.err.print(f"error: port(s) {taken} are in use here; pick free ones with --port-offset", markup=False)
        return 2
    begin = time.monotonic()
    _say(f"r3operator up {plan.job}: {len(plan.engines)} engine pod(s) + trainer, from the operator's desired()")
    _say(f"  run directory {plan.run_dir}")
    for note in plan.notes:
        _say(f"  note: {note}")
    runner = Runner(plan, environ=process_environment(), say=_say, echo=_echo, max_restarts=max_restarts)
    raise_on_sigterm()
    code = 1
    try:
        runner.prepare()
        if plan.reference_model and plan.routing_dir is not None:
            from transformers.utils import logging as hf_logging

            from r3operator.models import place_reference_model

            hf_logging.disable_progress_bar()  # one line per event here; the bar is the model's shard writes

            _say(
                f"  reference model {plan.reference_model}: generating onto the routing volume (the driver's "
                f"job in a pod; done first here so that the engines find it)"
            )
            path = place_reference_model(plan.reference_model, plan.routing_dir / REFERENCE_MODELS_SUBDIR)
            _say(f"  reference model at {path}")
        _say(f"  starting {len(plan.engines)} engine(s); waiting for /health")
        runner.start_engines()
        engines_up = time.monotonic() - begin
        code = exit_status(runner.run_trainer())
        verdict = "finished" if code == 0 else f"failed (exit code {code})"
        # The trainer's report times the driver alone: the engines were serving before it started.
        _say(
            f"r3operator up {plan.job}: trainer {verdict} after {time.monotonic() - begin:.0f} s in all "
            f"(engines healthy after {engines_up:.0f} s of it); logs in {runner.log_dir}"
        )
    except UpFailed as exc:
        output.err.print(f"error: {exc}", markup=False)
        code = 1
    except KeyboardInterrupt:
        _say("\ninterrupted: stopping every process")
        code = 130
    except Stopped:
        _say("terminated: stopping every process")
        code = 143
    finally:
        runner.shutdown()
    return code
