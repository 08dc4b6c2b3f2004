"""`make cluster-up` / `make cluster-down`: the test control plane for people.

    PYTHONPATH=tests python -m kubecluster up [--dir .tools/cluster] [--nodes 16] [--gpus-per-node 8]
                                             [--no-kuberay] [--no-kueue] [--no-lws] [--complete-submitters]
    PYTHONPATH=tests python -m kubecluster down [--dir .tools/cluster]
    PYTHONPATH=tests python -m kubecluster status [--dir .tools/cluster]
    PYTHONPATH=tests python -m kubecluster walkthrough --out FILE [--docs docs/install.md]

`up` leaves the processes running (each in its own session) and records their pids in DIR/state.json;
`export KUBECONFIG=DIR/kubeconfig` then points kubectl, helm and `r3operator operator` at it. `walkthrough`
records docs/install.md's shared-GPU-cluster walk-through on a control plane of its own (kubecluster/walkthrough.py).
On the cluster `up` starts, KubeRay's submitter pods keep running as `ray job submit` does while a job trains, so
a RayJob (and the RLJob's trainer) stays Running until deleted; `--complete-submitters` lets them complete as the
test session's control plane does (KubeRay then fails each RayJob ~30 s later: no Ray dashboard reports it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from kubecluster.controlplane import REPO, ControlPlane, Fleet, binaries_dir

DEFAULT_DIR = REPO / ".tools" / "cluster"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def up(
    directory: Path,
    fleet: Fleet,
    with_kuberay: bool,
    with_kueue: bool = True,
    with_lws: bool = True,
    keep_submitters_running: bool = True,
) -> int:
    """Start the control plane and leave it running; Kueue and LeaderWorkerSet too unless switched off, as
    docs/install.md's walk-through and the Kueue and LWS examples need them. `keep_submitters_running`: a
    RayJob stays Running as on a real cluster (the test session's control plane leaves it off)."""
    state = directory / "state.json"
    if state.exists() and any(_alive(p) for p in json.loads(state.read_text())["pids"].values()):
        print(f"a control plane is already running from {directory} (make cluster-down first)", file=sys.stderr)
        return 1
    shutil.rmtree(directory, ignore_errors=True)
    plane = ControlPlane(
        directory,
        binaries_dir(),
        fleet=fleet,
        with_kuberay=with_kuberay,
        keep_submitters_running=keep_submitters_running,
    )
    try:
        plane.start()
        if with_kueue:
            plane.start_kueue()
        if with_lws:
            plane.start_lws()
    except Exception:
        plane.stop()
        raise
    pids = {name: proc.popen.pid for name, proc in plane.processes.items()}
    state.write_text(json.dumps({"pids": pids, "url": plane.url}, indent=2))
    nodes = f"{fleet.nodes} nodes × {fleet.gpus_per_node} GPUs"
    extras = ", ".join(name for name in ("kuberay-operator", "kueue", "lws") if name in plane.processes) or "no add-ons"
    print(f"control plane up in {plane.startup_seconds:.1f}s: {plane.url}, {nodes}, {extras}")
    print(f"logs in {plane.logs}")
    print(f"export KUBECONFIG={plane.kubeconfig}")
    return 0


def down(directory: Path) -> int:
    state = directory / "state.json"
    if not state.exists():
        print(f"no control plane recorded in {directory}", file=sys.stderr)
        return 0
    pids = json.loads(state.read_text())["pids"]
    for pid in reversed(list(pids.values())):
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
        time.sleep(0.2)
    for pid in pids.values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    state.unlink()
    print("control plane stopped")
    return 0


def status(directory: Path) -> int:
    state = directory / "state.json"
    if not state.exists():
        print("down")
        return 1
    data = json.loads(state.read_text())
    for name, pid in data["pids"].items():
        print(f"{name:26} pid {pid:<8} {'running' if _alive(pid) else 'EXITED'}")
    return 0 if all(_alive(p) for p in data["pids"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["walkthrough"]:
        from kubecluster import walkthrough

        return walkthrough.main(args_in[1:])
    parser = argparse.ArgumentParser(prog="kubecluster", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--nodes", type=int, default=Fleet.nodes)
    parser.add_argument("--gpus-per-node", type=int, default=Fleet.gpus_per_node)
    parser.add_argument("--cpu-nodes", type=int, default=Fleet.cpu_nodes)
    parser.add_argument("--no-kuberay", action="store_true")
    parser.add_argument("--no-kueue", action="store_true", help="leave Kueue out (RLJobs with spec.queueName)")
    parser.add_argument("--no-lws", action="store_true", help="leave LeaderWorkerSet out (multi-node engines)")
    parser.add_argument(
        "--complete-submitters",
        action="store_true",
        help="KubeRay's submitter pods complete (each RayJob then fails ~30 s later), as in the test session",
    )
    args = parser.parse_args(args_in)
    directory = args.dir.resolve()
    if args.command == "up":
        fleet = Fleet(nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpu_nodes=args.cpu_nodes)
        return up(
            directory, fleet, not args.no_kuberay, not args.no_kueue, not args.no_lws, not args.complete_submitters
        )
    if args.command == "down":
        return down(directory)
    return status(directory)


if __name__ == "__main__":
    raise SystemExit(main())
