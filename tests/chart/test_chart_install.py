"""End to end with real clients: `helm install` of charts/r3operator into the session's control plane.

- What the apiserver lets the chart's operator ServiceAccount do (`kubectl auth can-i --list --as=...`) is
  what the installed release declares (its Roles/ClusterRoles reached through its bindings) and nothing
  more. The expectation is read from `helm get manifest`, never written down here, so the test follows
  the chart's RBAC as it changes.
- The operator, run in this process with that ServiceAccount's token (RBAC is the chart's, not the
  admin's), turns an RLJob into all its children.
- The per-job trainer ServiceAccount then can exactly what its RoleBinding's role grants, and with its
  token writes its progress report (the ConfigMap `<job>-progress`), and nothing else: not its RLJob, not
  its status.

Both releases take ownership of the RLJob CRD (`--take-ownership`): the CRD is cluster-scoped, and other
modules of the session apply it too. The operator Deployment's pod stays Pending (every fake node is a
tainted GPU node), which does not matter: the operator under test runs here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import yaml
from kubecluster.clients import create_namespace, kubectl
from kubecluster.controlplane import ApiError, ControlPlane
from records import step_record

from r3operator.runtime.metrics import progress_patch
from r3operator.settings import ENV_PREFIX, operator_settings
from tests.chart.conftest import CHART, IMAGE, REPO

Permission = tuple[str, str, str, str]
"""(resource as kubectl prints it, e.g. `rljobs.r3operator.io/status`; non-resource URL; resource name; verb)"""


# ----------------------------------------------------------------------------- releases


@dataclasses.dataclass
class Release:
    name: str
    namespace: str
    docs: list[dict[str, Any]]

    def one(self, kind: str) -> dict[str, Any]:
        [doc] = [d for d in self.docs if d["kind"] == kind]
        return doc

    @property
    def operator_account(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.one('ServiceAccount')['metadata']['name']}"

    @property
    def operator_env(self) -> dict[str, str]:
        [container] = self.one("Deployment")["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _helm(helm: str, plane: ControlPlane, *args: str) -> str:
    proc = subprocess.run(
        [helm, *args, "--kubeconfig", str(plane.kubeconfig)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stderr}"
    return proc.stdout


@contextlib.contextmanager
def installed(helm: str, plane: ControlPlane, name: str, namespace: str, *sets: str) -> Iterator[Release]:
    args = ["install", name, str(CHART), "--namespace", namespace, "--take-ownership"]
    _helm(helm, plane, *args, *[a for s in (IMAGE, *sets) for a in ("--set", s)])
    manifest = _helm(helm, plane, "get", "manifest", name, "--namespace", namespace)
    yield Release(name, namespace, [d for d in yaml.safe_load_all(manifest) if d])
    _helm(helm, plane, "uninstall", name, "--namespace", namespace)


@pytest.fixture(scope="module")
def cluster_release(helm: str, control_plane: ControlPlane) -> Iterator[Release]:
    namespace = create_namespace(control_plane, "chart-cluster-ops")
    with installed(helm, control_plane, "cluster", namespace, "watch.mode=cluster") as release:
        yield release


@pytest.fixture(scope="module")
def jobs_namespace(control_plane: ControlPlane) -> str:
    return create_namespace(control_plane, "chart-jobs")


@pytest.fixture(scope="module")
def namespaced_release(helm: str, control_plane: ControlPlane, jobs_namespace: str) -> Iterator[Release]:
    namespace = create_namespace(control_plane, "chart-ns-ops")
    sets = ("watch.mode=namespaced", f"watch.namespaces={{{jobs_namespace}}}")
    with installed(helm, control_plane, "scoped", namespace, *sets) as release:
        yield release


# ----------------------------------------------------------------------------- RBAC: declared vs enforced


def _expand(rules: list[dict[str, Any]]) -> set[Permission]:
    out: set[Permission] = set()
    for rule in rules:
        for verb in rule["verbs"]:
            for url in rule.get("nonResourceURLs", []):
                out.add(("", url, "", verb))
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    base, slash, sub = resource.partition("/")
                    printed = (f"{base}.{group}" if group else base) + slash + sub
                    for name in rule.get("resourceNames") or [""]:
                        out.add((printed, "", name, verb))
    return out


def declared(objects: list[dict[str, Any]], account: str, namespace: str) -> set[Permission]:
    """What `objects` (Roles, ClusterRoles and their bindings) grant `account` in `namespace`."""
    _, _, sa_namespace, sa_name = account.split(":")
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in objects}
    rules: list[dict[str, Any]] = []
    for binding in objects:
        applies = binding["kind"] == "ClusterRoleBinding" or (
            binding["kind"] == "RoleBinding" and binding["metadata"]["namespace"] == namespace
        )
        subjects = binding.get("subjects") or []
        if not applies or not any(
            s["kind"] == "ServiceAccount" and s["name"] == sa_name and s.get("namespace") == sa_namespace
            for s in subjects
        ):
            continue
        ref = binding["roleRef"]
        role_namespace = None if ref["kind"] == "ClusterRole" else binding["metadata"]["namespace"]
        rules += roles[(ref["kind"], role_namespace, ref["name"])]["rules"]
    return _expand(rules)


def _bracketed(cell: str) -> list[str]:
    inner = cell.strip().removeprefix("[").removesuffix("]")
    return inner.split() if inner else []


def can_i_list(plane: ControlPlane, account: str, namespace: str) -> set[Permission]:
    """`kubectl auth can-i --list` as `account` (impersonated by the admin), one tuple per permission."""
    result = kubectl(plane, "auth", "can-i", "--list", f"--as={account}", "--namespace", namespace)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    starts = [header.index(title) for title in ("Resources", "Non-Resource URLs", "Resource Names", "Verbs")]
    out: set[Permission] = set()
    for row in rows:
        resource, urls, names, verbs = (row[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True))
        for verb in _bracketed(verbs):
            for url in _bracketed(urls) or [""]:
                for name in _bracketed(names) or [""]:
                    out.add((resource, url, name, verb))
    return out


def baseline(plane: ControlPlane, namespace: str) -> set[Permission]:
    """What every ServiceAccount may do (discovery, self reviews): a fresh one with no bindings."""
    with contextlib.suppress(ApiError):  # already made by another test of this module
        plane.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "bare"}})
    return can_i_list(plane, f"system:serviceaccount:{namespace}:bare", namespace)


def assert_exactly(plane: ControlPlane, account: str, namespace: str, expected: set[Permission]) -> None:
    base = baseline(plane, namespace)
    actual = can_i_list(plane, account, namespace)
    assert expected - base, f"the chart grants {account} nothing in {namespace}: nothing to compare"
    assert sorted(actual - base) == sorted(expected - base), "enforced != declared"
    assert base <= actual


def test_operator_in_cluster_mode_can_exactly_what_the_chart_declares(
    control_plane: ControlPlane, cluster_release: Release, jobs_namespace: str
) -> None:
    account = cluster_release.operator_account
    expected = declared(cluster_release.docs, account, jobs_namespace)
    assert ("rljobs.r3operator.io", "", "", "watch") in expected and ("namespaces", "", "", "list") in expected
    assert_exactly(control_plane, account, jobs_namespace, expected)


@pytest.mark.parametrize("where", ["watched", "own"])
def test_operator_in_namespaced_mode_can_exactly_what_the_chart_declares(
    control_plane: ControlPlane, namespaced_release: Release, jobs_namespace: str, where: str
) -> None:
    namespace = jobs_namespace if where == "watched" else namespaced_release.namespace
    account = namespaced_release.operator_account
    expected = declared(namespaced_release.docs, account, namespace)
    if where == "watched":
        assert ("statefulsets.apps", "", "", "create") in expected
    else:  # outside the watched namespaces only the reads of cluster-scoped kinds remain
        assert not {p[0] for p in expected} & {"statefulsets.apps", "rljobs.r3operator.io", "configmaps"}
    assert_exactly(control_plane, account, namespace, expected)


# ----------------------------------------------------------------------------- the operator with the chart's token


def _operator_harness() -> ModuleType:
    """tests/operator's kopf runner (that directory is no package: a package named `operator` shadows the stdlib)."""
    directory = str(REPO / "tests" / "operator")
    if directory not in sys.path:
        sys.path.append(directory)
    return importlib.import_module("operator_harness")


JOB = "chart-e2e"


@pytest.fixture(scope="module")
def reconciled(
    control_plane: ControlPlane,
    namespaced_release: Release,
    jobs_namespace: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, dict[str, Any]]]:
    """The operator runs with the chart's ServiceAccount token and the chart's settings; an RLJob is applied
    and all its children exist. Yields the children by kind."""
    harness = _operator_harness()
    kubeconfig = tmp_path_factory.mktemp("operator") / "kubeconfig"
    sa_namespace, sa_name = namespaced_release.operator_account.split(":")[2:]
    token = control_plane.token_for(sa_namespace, sa_name)
    kubeconfig.write_text(yaml.safe_dump(control_plane.kubeconfig_for(sa_name, token, namespace=jobs_namespace)))
    registry = harness.operator_registry()
    handlers = sys.modules["r3operator.operator.handlers"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KUBECONFIG", str(kubeconfig))
        # The operator settings the chart passes (no metrics server: other operators share this process).
        for name, value in namespaced_release.operator_env.items():
            if name.startswith(ENV_PREFIX) and name != "R3OPERATOR_METRICS_PORT":
                patch.setenv(name, value)
        patch.setattr(handlers, "CONFIG", operator_settings())
        from kopf.testing import KopfRunner

        with KopfRunner(harness.operator_args([jobs_namespace]), timeout=120, registry=registry) as runner:
            job = harness.example(JOB, jobs_namespace)
            applied = kubectl(control_plane, "apply", "-f", "-", stdin=yaml.safe_dump(job))
            assert applied.returncode == 0, applied.stderr
            children = {k: p for k, p in harness.paths(jobs_namespace, JOB).items() if k != "rljob"}

            def all_children() -> dict[str, dict[str, Any]] | None:
                found = {k: control_plane.request("GET", p) for k, p in children.items()}
                return found if all(found.values()) else None  # type: ignore[return-value]

            yield harness.wait_for(all_children, timeout=60, what=f"children of {JOB} (operator output follows)")
    assert runner.exception is None, runner.output
    for problem in ("Traceback", "Forbidden"):
        assert problem not in runner.output, runner.output[-4000:]


def test_operator_with_the_charts_token_creates_every_child(
    control_plane: ControlPlane, reconciled: dict[str, dict[str, Any]], jobs_namespace: str
) -> None:
    assert set(reconciled) == {"pvc", "cm", "svc", "sts", "rayjob", "sa", "rb", "np"}  # np: networkpolicies granted
    rljob = control_plane.request("GET", f"/apis/r3operator.io/v1alpha1/namespaces/{jobs_namespace}/rljobs/{JOB}")
    conditions = {c["type"]: c for c in rljob["status"]["conditions"]}
    assert conditions["Valid"]["status"] == "True", conditions


def test_with_the_charts_token_a_missing_secret_is_valid_false_with_its_name(
    control_plane: ControlPlane, reconciled: dict[str, dict[str, Any]], jobs_namespace: str
) -> None:
    """rbac.checkSecretReferences (the default) lets the operator GET a Secret the spec names: a missing HF token
    is refused before anything is created (no Forbidden in the operator's output: the fixture checks)."""
    harness = _operator_harness()
    name = "chart-no-token"
    job = harness.example(name, jobs_namespace, **{"model.tokenSecretRef": {"name": "hf-absent", "key": "token"}})
    applied = kubectl(control_plane, "apply", "-f", "-", stdin=yaml.safe_dump(job))
    assert applied.returncode == 0, applied.stderr
    path = f"/apis/r3operator.io/v1alpha1/namespaces/{jobs_namespace}/rljobs/{name}"

    def valid() -> dict[str, Any] | None:
        conditions = (control_plane.request("GET", path).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "Valid" and c["status"] == "False"), None)

    refused = harness.wait_for(valid, timeout=60, what=f"{name} Valid=False")
    assert refused["reason"] == "ReferenceNotFound"
    assert "Secret/hf-absent (key token), named in model.tokenSecretRef, does not exist" in refused["message"]
    assert control_plane.request("GET", harness.paths(jobs_namespace, name)["sts"]) is None  # nothing created


def _trainer(reconciled: dict[str, dict[str, Any]], namespace: str) -> str:
    return f"system:serviceaccount:{namespace}:{reconciled['sa']['metadata']['name']}"


def test_trainer_service_account_can_exactly_its_roles_rules(
    control_plane: ControlPlane, namespaced_release: Release, reconciled: dict[str, dict[str, Any]], jobs_namespace: str
) -> None:
    binding = reconciled["rb"]
    ref = binding["roleRef"]
    # The role is the chart's (ClusterRole) or, if the operator makes one per job, the Role it made.
    role = next(
        (d for d in namespaced_release.docs if d["kind"] == ref["kind"] and d["metadata"]["name"] == ref["name"]),
        None,
    ) or control_plane.request(
        "GET",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{jobs_namespace}/roles/{ref['name']}"
        if ref["kind"] == "Role"
        else f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{ref['name']}",
    )
    account = _trainer(reconciled, jobs_namespace)
    expected = declared([binding, role], account, jobs_namespace)
    assert expected == {("configmaps", "", f"{JOB}-progress", verb) for verb in ("get", "patch")}
    assert_exactly(control_plane, account, jobs_namespace, expected)


def test_trainer_token_writes_its_progress_report_and_nothing_else(
    control_plane: ControlPlane, reconciled: dict[str, dict[str, Any]], jobs_namespace: str
) -> None:
    token = control_plane.token_for(jobs_namespace, reconciled["sa"]["metadata"]["name"])
    rljob = f"/apis/r3operator.io/v1alpha1/namespaces/{jobs_namespace}/rljobs/{JOB}"
    report = f"/api/v1/namespaces/{jobs_namespace}/configmaps/{JOB}-progress"
    progress = progress_patch(step_record(3, reward_mean=0.5), total_steps=10, last_checkpoint_step=None)
    patch = {"data": {"progress": json.dumps(progress["status"]["progress"])}}
    patched = control_plane.request("PATCH", report, patch, "application/merge-patch+json", token=token)
    assert json.loads(patched["data"]["progress"])["step"] == 3
    forbidden = [
        ("GET", rljob, None),
        ("PATCH", rljob + "/status", progress),
        ("PATCH", rljob, {"spec": {"rollout": {"promptsPerStep": 8}}}),
        ("DELETE", rljob, None),
        ("PATCH", f"/api/v1/namespaces/{jobs_namespace}/configmaps/{JOB}-config", {"data": {"config.json": "{}"}}),
        ("GET", f"/api/v1/namespaces/{jobs_namespace}/secrets", None),
        ("POST", f"/api/v1/namespaces/{jobs_namespace}/pods", {"metadata": {"name": "x"}}),
        ("GET", f"/apis/apps/v1/namespaces/{jobs_namespace}/statefulsets", None),
    ]
    for method, path, body in forbidden:
        content_type = "application/merge-patch+json" if method == "PATCH" else "application/json"
        with pytest.raises(ApiError) as refused:
            control_plane.request(method, path, body, content_type, token=token)
        assert refused.value.code == 403, (method, path, refused.value)


# ----------------------------------------------------------------------------- users: aggregated roles


def _can(plane: ControlPlane, user: str, verb: str, namespace: str) -> bool:
    result = kubectl(plane, "auth", "can-i", verb, "rljobs.r3operator.io", f"--as={user}", "--namespace", namespace)
    return result.stdout.strip() == "yes"


def test_namespace_editors_manage_rljobs_and_viewers_read_them(
    control_plane: ControlPlane, namespaced_release: Release, jobs_namespace: str
) -> None:
    for user, role in (("alice", "edit"), ("bob", "view")):
        binding = {
            "metadata": {"name": f"{user}-{role}"},
            "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}],
            "roleRef": {"kind": "ClusterRole", "name": role, "apiGroup": "rbac.authorization.k8s.io"},
        }
        with contextlib.suppress(ApiError):
            control_plane.request(
                "POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{jobs_namespace}/rolebindings", binding
            )
    # The controller manager folds the chart's labelled ClusterRoles into edit and view.
    harness = _operator_harness()
    harness.wait_for(
        lambda: _can(control_plane, "alice", "create", jobs_namespace),
        timeout=60,
        what="edit aggregates the chart's RLJob rules",
    )
    assert all(_can(control_plane, "alice", v, jobs_namespace) for v in ("create", "update", "delete", "list"))
    assert all(_can(control_plane, "bob", v, jobs_namespace) for v in ("get", "list", "watch"))
    assert not any(_can(control_plane, "bob", v, jobs_namespace) for v in ("create", "patch", "delete"))


# ----------------------------------------------------------------------------- the README's install


def _readme_install(crds_applied: bool) -> list[str]:
    """The README's `helm install` command, as its install block says to run it (with the CRD applied first by
    `kubectl apply -f crds/`, the flags the block's comment gives for that case), as argv without `helm`."""
    text = (REPO / "README.md").read_text()
    block = text[text.index("kubectl create namespace rl") :]
    block = block[: block.index("```")]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("helm install r3 "))
    command = ""
    for line in lines[start:]:
        command += line.split("#", 1)[0].rstrip().removesuffix("\\") + " "
        if not line.split("#", 1)[0].rstrip().endswith("\\"):
            break
    argv = shlex.split(command)[1:]
    if crds_applied:
        comment = " ".join(line for line in lines[:start] if line.startswith("#"))
        assert "kubectl apply -f crds/" in comment, "the install block does not say what to do with the CRD applied"
        argv += shlex.split(comment[comment.index("`--set") + 1 :].split("`")[0])
    return argv


def test_the_readmes_install_works_after_kubectl_apply_of_the_crds(helm: str, control_plane: ControlPlane) -> None:
    """The README's first-hour path after `kubectl apply -f crds/` (issue #45): the CRD is the cluster's, not a
    release's, and the command the README gives for that case installs; without its flag helm refuses."""
    applied = kubectl(control_plane, "apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    assert applied.returncode == 0, applied.stderr
    watched = create_namespace(control_plane, "readme-rl")
    operator_ns = create_namespace(control_plane, "readme-r3-system")

    def install(argv: list[str]) -> subprocess.CompletedProcess[str]:
        argv = [a.replace("{rl}", f"{{{watched}}}").replace("REGISTRY/", "registry.example.com/") for a in argv]
        argv = [operator_ns if a == "r3-system" else a for a in argv]
        argv[argv.index("r3")] = "readme"  # a release name of its own in the session's cluster
        command = [helm, *argv, "--kubeconfig", str(control_plane.kubeconfig)]
        return subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=REPO)

    plain = install(_readme_install(crds_applied=False))
    assert plain.returncode != 0 and "cannot be imported" in plain.stderr, plain.stderr
    _helm(helm, control_plane, "uninstall", "readme", "--namespace", operator_ns, "--ignore-not-found")
    documented = install(_readme_install(crds_applied=True))
    assert documented.returncode == 0, documented.stderr
    _helm(helm, control_plane, "uninstall", "readme", "--namespace", operator_ns)
