"""Human output of the CLI (rich). Machine output (JSON) is printed by the commands themselves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from r3operator.api import Finding, Plan, RLJob, RLJobLoadError
    from r3operator.cli.validate import ValidationResults
    from r3operator.operator.picture import SchedulingPicture

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

_STYLE = {"error": "bold red", "warning": "yellow"}


def print_load_error(exc: RLJobLoadError) -> None:
    for p in exc.problems:
        where = f"{p.field}: " if p.field else ""
        err.print(f"{exc.source}: {where}{p.message}", markup=False)


def print_validation(results: ValidationResults) -> None:
    for row in results.rows:
        if row.rule == "schema":
            where = f"{row.field}: " if row.field else ""
            err.print(f"{row.file}: {where}{row.message}", markup=False)
            continue
        out.print(f"{row.file}: [{_STYLE[row.severity]}]{row.severity}[/] {row.rule} {row.field}: ", end="")
        out.print(row.message, markup=False)
    for f in results.files_ok:
        out.print(f"{f}: [green]valid[/]")


def print_scheduling(picture: SchedulingPicture) -> None:
    t = Table(title=f"scheduling: {picture.gpus} GPUs in all", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("engine workload", picture.engines)
    for r in picture.roles:
        t.add_row(r.role, f"{r.pods} pod(s) x {r.gpus_per_pod} GPU")
        t.add_row("  nodeSelector", r.node_selector)
        t.add_row("  tolerations", r.tolerations)
        t.add_row("  affinity", r.affinity)
        t.add_row("  priorityClass", r.priority_class)
        t.add_row("  serviceAccount", r.service_account)
        t.add_row("  imagePullSecrets", r.image_pull_secrets)
    t.add_row("queue", picture.queue)
    t.add_row("model", picture.model)
    out.print(t)


def print_plan(job: RLJob, plan: Plan, findings: list[Finding]) -> None:
    spec = job.spec
    t = Table(title=f"RLJob {job.metadata.name}: resolved plan", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    v = plan.engine_version
    t.add_row("vLLM version", f"{v} (from {v.source.value})")
    inf = spec.inference
    t.add_row(
        "engines",
        f"{inf.replicas} replica(s) x {plan.engine_gpus_per_replica} GPU "
        f"(tp {inf.tensor_parallel_size} x pp {inf.pipeline_parallel_size} x dp "
        f"{inf.data_parallel_size}), {plan.engine_pods_per_replica} pod(s) per replica, "
        f"executor {inf.executor_backend.value}",
    )
    t.add_row("engine GPUs", str(plan.engine_gpus_total))
    t.add_row("engine EP size", str(plan.engine_expert_parallel_size))
    tr = spec.trainer
    t.add_row(
        "trainer",
        f"{tr.backend.value}: {tr.nodes} node(s) x {tr.gpus_per_node} GPU = "
        f"{plan.trainer_gpus_total} GPUs, EP {plan.trainer_expert_parallel_size}",
    )
    t.add_row("replay", plan.replay_path)
    from r3operator.cli.sources_view import model_summary

    t.add_row("model", model_summary(job))
    if plan.routing_bytes_per_token is not None:
        t.add_row(
            "routing data",
            f"{plan.routing_bytes_per_token} bytes/token ({plan.route_dtype}, "
            "all layers x topK, dense layers included)",
        )
    from r3operator.cli.explain import routed_experts_needed

    if routed_experts_needed(job):
        gates = ", ".join(
            f"{k}={'yes' if ok else 'no' if ok is False else 'unknown'}" for k, ok in plan.features.items()
        )
        t.add_row("vLLM features", gates)
    t.add_row("weight sync", f"{plan.weight_transfer.describe()}; {plan.weight_sync_layout.describe()}")
    out.print(t)
    for f in findings:
        out.print(f"[{_STYLE[f.severity.value]}]{f.severity.value}[/] {f.rule} {f.field}: ", end="")
        out.print(f.message, markup=False)
    if not findings:
        out.print("[green]no findings[/]")
