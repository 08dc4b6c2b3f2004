"""`r3operator render` and `r3operator operator`: typer-compatible command functions.

Mounted in r3operator/cli/main.py (kept apart so `r3operator validate` stays import-light)::

    from r3operator.cli import operator_cmds
    app.command("render")(operator_cmds.render)
    app.command("operator")(operator_cmds.run_operator)

Exit codes of ``render`` are those of ``validate``: 0 rendered, 1 a rule reported an error (nothing is
rendered, as the operator would create nothing), 2 the file could not be read as an RLJob.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from r3operator.cli.cluster_facts import LeaderWorkerSetOption


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the runtime config JSON) as literal blocks, so a review diff is readable."""


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_BlockDumper.add_representer(str, _str_presenter)


def render_yaml(children: list[dict[str, Any]]) -> str:
    return yaml.dump_all(children, Dumper=_BlockDumper, sort_keys=False, default_flow_style=False, width=120)


def render(
    file: Annotated[Path, typer.Argument(help="RLJob YAML file (multi-document files allowed); - reads stdin.")],
    no_pod_monitor: Annotated[
        bool, typer.Option("--no-pod-monitor", help="Render as for a cluster without the Prometheus Operator.")
    ] = False,
    leader_worker_set: LeaderWorkerSetOption = None,
) -> None:
    """Print the children the operator would create for an RLJob, as a YAML stream (GitOps, review).

    Rendered without ownerReferences (the RLJob has no uid until it exists in a cluster).
    """
    from r3operator.api import RLJobLoadError, load_rljobs
    from r3operator.api.rules import errors, evaluate
    from r3operator.cli import output
    from r3operator.cli.cluster_facts import rule_context
    from r3operator.operator.desired import Facts, desired

    try:
        jobs = load_rljobs(file)
    except RLJobLoadError as exc:
        output.print_load_error(exc)
        raise typer.Exit(2) from None
    children: list[dict[str, Any]] = []
    failed = False
    for job in jobs:
        problems = errors(evaluate(job.spec, context=rule_context(job.spec, leader_worker_set)))
        for f in problems:
            output.err.print(f"{file}: error {f.rule} {f.field}: {f.message}", markup=False)
        failed = failed or bool(problems)
        children += desired(job, Facts(pod_monitor_crd=not no_pod_monitor))
    if failed:
        raise typer.Exit(1)
    sys.stdout.write(render_yaml(children))


def run_operator(
    namespace: Annotated[
        list[str] | None, typer.Option("--namespace", "-n", help="Watch this namespace (repeatable).")
    ] = None,
    all_namespaces: Annotated[bool, typer.Option("--all-namespaces", "-A", help="Watch every namespace.")] = False,
    liveness: Annotated[
        str, typer.Option(help="kopf liveness endpoint; empty disables it.")
    ] = "http://0.0.0.0:8080/healthz",
    kubeconfig: Annotated[
        Path | None, typer.Option(help="Kubeconfig (default: in-cluster service account, else $KUBECONFIG).")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    leader_elect: Annotated[
        bool, typer.Option("--leader-elect", help="Reconcile only while holding a coordination.k8s.io Lease.")
    ] = False,
    leader_election_namespace: Annotated[
        str | None, typer.Option(help="Namespace of the Lease (default: $R3OPERATOR_OPERATOR_NAMESPACE).")
    ] = None,
    leader_election_id: Annotated[str, typer.Option(help="Name of the Lease.")] = "r3operator-leader",
    lease_duration: Annotated[float, typer.Option(help="Seconds a standby waits for an unrenewed Lease.")] = 15.0,
    renew_deadline: Annotated[float, typer.Option(help="Seconds the leader may fail to renew before it exits.")] = 10.0,
    retry_period: Annotated[float, typer.Option(help="Seconds between Lease attempts.")] = 2.0,
) -> None:
    """Run the RLJob operator (kopf, standalone). Metrics on $R3OPERATOR_METRICS_PORT (9090).

    With --leader-elect, several replicas may run: only the Lease holder reconciles; the liveness
    address then also serves /readyz (leader or standby)."""
    from r3operator.operator.leader import LeaseConfig
    from r3operator.operator.main import run
    from r3operator.settings import operator_settings

    if not namespace and not all_namespaces:
        typer.echo("pass --namespace NS (repeatable) or --all-namespaces", err=True)
        raise typer.Exit(2)
    lease = None
    if leader_elect:
        lease_namespace = leader_election_namespace or operator_settings().operator_namespace
        if not lease_namespace:
            typer.echo("--leader-elect needs --leader-election-namespace or R3OPERATOR_OPERATOR_NAMESPACE", err=True)
            raise typer.Exit(2)
        try:
            lease = LeaseConfig(
                lease_namespace,
                leader_election_id,
                lease_duration_s=lease_duration,
                renew_deadline_s=renew_deadline,
                retry_period_s=retry_period,
            )
        except ValueError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
    run(
        namespaces=namespace or (),
        all_namespaces=all_namespaces,
        liveness=liveness or None,
        kubeconfig=str(kubeconfig) if kubeconfig else None,
        verbose=verbose,
        lease=lease,
    )
