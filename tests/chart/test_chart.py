"""The chart: lint, schema validation, least-privilege RBAC, security settings, CRD and generated files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from r3operator.observability import rules
from r3operator.observability.generate import CRD_COPY
from tests.chart.conftest import ALL_ON, CHART, CLUSTER, IMAGE, NAMESPACED, REPO, helm_template

MIN_KUBERNETES = "1.30.0"  # Chart.yaml kubeVersion and the README: CEL messageExpression, reason, fieldPath


def test_helm_lint_strict(helm: str) -> None:
    for sets in ((), CLUSTER + ALL_ON, NAMESPACED + ALL_ON):
        args = [helm, "lint", "--strict", str(CHART)] + [a for s in (IMAGE, *sets) for a in ("--set", s)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ALL_ON,
        NAMESPACED + ALL_ON,
        ("crds.install=false", "rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=ops"),
    ],
    ids=str,
)
def test_rendered_manifests_validate_strict_for_min_kubernetes(render, tmp_path: Path, sets: tuple[str, ...]) -> None:
    manifest = tmp_path / "chart.yaml"
    manifest.write_text(render(*sets).text)
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", MIN_KUBERNETES, str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "passed for resource deployment/" in proc.stdout


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ("replicaCount=0", "/replicaCount"),
        ("leaderElection.enabled=maybe", "/leaderElection/enabled"),
        ("podSecurityContext=none", "/podSecurityContext"),
        ("prometheusRule.runbookBaseURL=wiki", "/prometheusRule/runbookBaseURL"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("image.digest=sha256:nothex", "/image/digest"),
        ("watch.mode=everywhere", "/watch/mode"),
        ("watch.namespaces={Bad_Name}", "/watch/namespaces/0"),
        ("operator.logLevel=loud", "/operator/logLevel"),
        ("operator.metricsPort=80", "/operator/metricsPort"),
        ("metrics.podMonitor.interval=often", "/metrics/podMonitor/interval"),
        ("dashboards.enabled=maybe", "/dashboards/enabled"),
        ("rbac.checkSecretReferences=sometimes", "/rbac/checkSecretReferences"),
        ("unknownKey=1", "unknownKey"),
        ("operator.typo=1", "typo"),
    ],
)
def test_values_schema_rejects_bad_values(helm: str, bad: str, field: str) -> None:
    proc = helm_template(helm, bad)
    assert proc.returncode != 0, f"--set {bad} rendered"
    assert "schema" in proc.stderr and field in proc.stderr, proc.stderr


def test_servicemonitor_needs_the_service(helm: str) -> None:
    proc = helm_template(helm, "metrics.serviceMonitor.enabled=true", "metrics.service.enabled=false")
    assert proc.returncode != 0 and "metrics.service.enabled" in proc.stderr


def _aggregated(doc: dict) -> bool:
    """The ClusterRoles the chart adds to the built-in admin/edit/view: users' rights, not the operator's."""
    return any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in doc["metadata"].get("labels", {}))


def _rbac_rules(docs) -> list[dict]:
    return [r for d in docs if d["kind"] in ("Role", "ClusterRole") and not _aggregated(d) for r in d["rules"]]


@pytest.mark.parametrize("sets", [CLUSTER + ALL_ON, NAMESPACED + ALL_ON], ids=["cluster", "namespaced"])
def test_rbac_has_no_wildcards_and_only_the_operators_permissions(render, sets: tuple[str, ...]) -> None:
    granted = set()
    for rule in _rbac_rules(render(*sets)):
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], f"wildcard in {key}: {rule}"
        assert "nonResourceURLs" not in rule
        assert "resourceNames" not in rule or rule["resources"] == ["leases"]
        granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    # children: listed and watched by the operator's label (its cache), written (docs/operator.md)
    crud = ("get", "list", "watch", "create", "patch", "delete")
    expected = (
        {("r3operator.io", "rljobs", v) for v in ("get", "list", "watch", "patch", "update")}
        | {("r3operator.io", "rljobs/status", v) for v in ("get", "patch", "update")}
        | {("apps", "statefulsets", v) for v in crud}
        | {("", r, v) for r in ("services", "configmaps", "persistentvolumeclaims") for v in crud}
        | {(g, "events", v) for g in ("", "events.k8s.io") for v in ("create", "patch")}
        | {("", "pods", v) for v in ("list", "watch")}  # the scheduler's reason for pods it cannot place
        | {("ray.io", "rayjobs", v) for v in crud}
        | {("leaderworkerset.x-k8s.io", "leaderworkersets", v) for v in crud}  # engines wider than a node
        | {("batch", "jobs", v) for v in crud}  # the engine-upgrade canary and the model-fetch Job
        | {("monitoring.coreos.com", "podmonitors", v) for v in crud}
        | {("kueue.x-k8s.io", "workloads", v) for v in crud}
        | {("kueue.x-k8s.io", "workloads/status", "patch")}
        | {("scheduling.k8s.io", "priorityclasses", "get")}  # a pod template's PriorityClass must exist
        | {("networking.k8s.io", "networkpolicies", v) for v in crud}  # the engine port's fence
        | {("", "serviceaccounts", v) for v in crud}  # per RLJob: the trainer's identity
        | {("", "secrets", "get")}  # rbac.checkSecretReferences (default): a named Secret and key must exist
        | {("rbac.authorization.k8s.io", r, v) for r in ("roles", "rolebindings") for v in crud}
        | {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("get", "list", "watch")}
        # kopf lists and watches namespaces in both modes, also when they are named.
        | {("", "namespaces", v) for v in ("get", "list", "watch")}
        # leader election: its one Lease in the release namespace
        | {("coordination.k8s.io", "leases", v) for v in ("create", "get", "update")}
    )
    assert granted == expected
    # Never: pods/exec, Secrets beyond get by name, and no RBAC escalation: no bind or escalate, no cluster
    # roles (the per-job trainer Role grants only what the operator holds).
    assert not {r for _, r, _ in granted} & {"pods/exec", "clusterroles"}
    assert {v for _, r, v in granted if r == "secrets"} == {"get"}
    assert {v for _, r, v in granted if r == "pods"} == {"list", "watch"}
    assert not {v for _, _, v in granted} & {"bind", "escalate", "impersonate"}


@pytest.mark.parametrize("sets", [CLUSTER, NAMESPACED], ids=["cluster", "namespaced"])
def test_secret_access_is_get_by_name_and_only_with_check_secret_references(render, sets: tuple[str, ...]) -> None:
    def secret_verbs(*extra: str) -> set[str]:
        rules = _rbac_rules(render(*sets, *extra))
        return {v for rule in rules if "secrets" in rule["resources"] for v in rule["verbs"]}

    assert secret_verbs() == {"get"}  # on by default: a missing HF token or store Secret is Valid=False
    assert secret_verbs("rbac.checkSecretReferences=true") == {"get"}
    assert secret_verbs("rbac.checkSecretReferences=false") == set()


def test_namespaced_is_the_default_and_watches_the_release_namespace(render) -> None:
    docs = render()
    assert {d["metadata"]["name"]: d["metadata"]["namespace"] for d in docs.kind("Role")} == {
        "r3-r3operator": "r3-system",
        "r3-r3operator-leader-election": "r3-system",
    }
    args = docs.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" not in args and "--namespace=r3-system" in args
    operator_cluster_roles = {d["metadata"]["name"] for d in docs.kind("ClusterRole") if not _aggregated(d)}
    assert operator_cluster_roles == {"r3-r3operator-crd-reader"}
    env = docs.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert not [e for e in env if e["name"] == "R3OPERATOR_TRAINER_CLUSTER_ROLE"]  # the trainer Role is per job


def test_rbac_matches_docs_operator_md(render) -> None:
    # docs/operator.md (the operator's own table) is the source of truth; every row is granted.
    doc = (REPO / "docs/operator.md").read_text().split("## RBAC the operator needs", 1)[1].split("\n## ", 1)[0]
    granted = {
        (g, r, v)
        for rule in _rbac_rules(render(*CLUSTER))
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    rows = re.findall(r"^\| `([^`]*)` \| `([^`]*)` \| ([a-z, ]+)", doc, re.M)
    assert len(rows) >= 10
    documented = {
        ("" if group == '""' else group, resource, verb.strip())
        for group, resource, verbs in rows
        for verb in verbs.split(",")
    }
    assert documented == granted  # every row is granted, and nothing undocumented is
    # docs/install.md points at that table instead of keeping a copy that goes stale.
    install = (REPO / "docs/install.md").read_text().split("### What the operator may do", 1)[1].split("\n#", 1)[0]
    assert "docs/operator.md" in install and not re.findall(r"^\|", install, re.M)


def test_cluster_mode_uses_cluster_roles_and_watches_all_namespaces(render) -> None:
    docs = render(*CLUSTER)
    assert {d["metadata"]["name"] for d in docs.kind("ClusterRole") if not _aggregated(d)} == {
        "r3-r3operator",
        "r3-r3operator-crd-reader",
    }
    # Only the leader-election Role stays namespaced.
    assert [d["metadata"]["name"] for d in docs.kind("Role")] == ["r3-r3operator-leader-election"]
    args = docs.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["operator", "--all-namespaces"]


def test_namespaced_mode_grants_a_role_per_watched_namespace(render) -> None:
    docs = render(*NAMESPACED)
    operator_roles = [d for d in docs.kind("Role") if d["metadata"]["name"] == "r3-r3operator"]
    assert {d["metadata"]["namespace"] for d in operator_roles} == {"team-a", "team-b"}
    bindings = [d for d in docs.kind("RoleBinding") if d["metadata"]["name"] == "r3-r3operator"]
    assert {d["metadata"]["namespace"] for d in bindings} == {"team-a", "team-b"}
    for binding in docs.kind("RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "r3-r3operator", "namespace": "r3-system"}]
    # Only reading the cluster-scoped CRDs, namespaces and PriorityClasses stays cluster-wide.
    (cluster_role,) = [d for d in docs.kind("ClusterRole") if not _aggregated(d)]
    assert cluster_role["rules"] == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": ["get", "list", "watch"],
        },
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"], "verbs": ["get"]},
    ]
    args = docs.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" not in args
    assert [a for a in args if a.startswith("--namespace=")] == ["--namespace=team-a", "--namespace=team-b"]


def test_deployment_is_ha_with_leader_election_non_root_read_only(render) -> None:
    docs = render()
    spec = docs.one("Deployment")["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = spec["template"]["spec"]
    # No fixed UID (the image's USER 65532 applies; OpenShift restricted-v2 may assign another).
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True and "runAsUser" not in sc
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "healthz"}
    health = next(p for p in container["ports"] if p["name"] == "healthz")["containerPort"]
    assert f"--liveness=http://0.0.0.0:{health}/healthz" in container["args"]
    assert {
        "--leader-elect",
        "--leader-election-namespace=r3-system",
        "--leader-election-id=r3-r3operator-leader",
        "--lease-duration=15",
        "--renew-deadline=10",
        "--retry-period=2",
    } <= set(container["args"])
    [lease_role] = [r for r in docs.kind("Role") if r["metadata"]["name"].endswith("-leader-election")]
    named = next(rule for rule in lease_role["rules"] if "resourceNames" in rule)
    assert named["resourceNames"] == ["r3-r3operator-leader"]  # the --leader-election-id above
    metrics_port = next(p for p in container["ports"] if p["name"] == "metrics")["containerPort"]
    assert {"name": "R3OPERATOR_METRICS_PORT", "value": str(metrics_port)} in container["env"]
    assert container["image"] == "registry.example.com/r3operator/operator:0.1.0"  # appVersion, never latest
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    pdb = docs.one("PodDisruptionBudget")["spec"]
    assert pdb["minAvailable"] == 1 and pdb["selector"]["matchLabels"] == spec["selector"]["matchLabels"]


def test_one_replica_without_leader_election_is_recreate_and_has_no_pdb(render, helm: str) -> None:
    docs = render("replicaCount=1", "leaderElection.enabled=false")
    spec = docs.one("Deployment")["spec"]
    assert spec["strategy"] == {"type": "Recreate"}
    assert "readinessProbe" not in spec["template"]["spec"]["containers"][0]
    assert not docs.kind("PodDisruptionBudget")
    assert not [r for r in docs.kind("Role") if "leader" in r["metadata"]["name"]]
    proc = helm_template(helm, "replicaCount=2", "leaderElection.enabled=false")
    assert proc.returncode != 0 and "replicaCount > 1 needs leaderElection.enabled=true" in proc.stderr


def test_security_contexts_are_overridable(render) -> None:
    docs = render(
        "podSecurityContext.runAsNonRoot=true",
        "podSecurityContext.fsGroup=1000680000",
        "securityContext.runAsUser=1000680000",
    )
    pod = docs.one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == 1000680000
    assert pod["containers"][0]["securityContext"]["runAsUser"] == 1000680000


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("image.tag=latest",), "image.tag=latest: pin a version tag"),
        (("image.repository=",), "image.repository is not set: no r3operator image is published"),
        (("leaderElection.renewDeadline=20",), "renewDeadline must be shorter than leaderElection.leaseDuration"),
    ],
)
def test_refusals_say_what_is_wrong(helm: str, sets: tuple[str, ...], message: str) -> None:
    proc = helm_template(helm, *sets)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_chart_works_as_a_subchart_with_global_values(render) -> None:
    assert render("global.imageRegistry=mirror.example.com", "global.storageClass=fast").one("Deployment")


def test_kube_version_is_the_one_the_readme_states() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    readme = re.search(r"Kubernetes ≥ (\d+\.\d+)", (REPO / "README.md").read_text())
    assert readme is not None
    assert chart["kubeVersion"] == f">={readme.group(1)}.0-0" == f">={MIN_KUBERNETES}-0"


def test_aggregated_cluster_roles_extend_admin_edit_and_view_to_rljobs(render) -> None:
    docs = render()
    aggregated = {d["metadata"]["name"]: d for d in docs.kind("ClusterRole") if _aggregated(d)}
    edit, view = aggregated["r3-r3operator-rljob-edit"], aggregated["r3-r3operator-rljob-view"]
    labels = edit["metadata"]["labels"]
    assert labels["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert labels["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {"create", "update", "patch", "delete"} <= set(edit["rules"][0]["verbs"])
    assert {v for rule in view["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}
    assert not [d for d in render("rbac.aggregateToDefaultRoles=false").kind("ClusterRole") if _aggregated(d)]


def test_runbook_urls_follow_the_configured_base(render) -> None:
    spec = render(*ALL_ON, "prometheusRule.runbookBaseURL=https://wiki.example.com/r3/").one("PrometheusRule")["spec"]
    urls = [r["annotations"]["runbook_url"] for g in spec["groups"] for r in g["rules"] if "alert" in r]
    assert urls and all(u.startswith("https://wiki.example.com/r3#") for u in urls)


def test_deployment_sets_only_variables_the_operator_reads(render) -> None:
    from r3operator.settings import ENV_PREFIX, OperatorSettings

    container = render().one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    ours = {e["name"] for e in container["env"] if e["name"].startswith(ENV_PREFIX)}
    assert ours == {
        "R3OPERATOR_METRICS_PORT",
        "R3OPERATOR_OPERATOR_NAMESPACE",
        "R3OPERATOR_POD_NAME",
        "R3OPERATOR_SERVICE_ACCOUNT",
    }
    namespace_env = next(e for e in container["env"] if e["name"] == "R3OPERATOR_OPERATOR_NAMESPACE")
    assert namespace_env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    account_env = next(e for e in container["env"] if e["name"] == "R3OPERATOR_SERVICE_ACCOUNT")
    assert account_env["valueFrom"] == {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}
    assert ours <= set(OperatorSettings.env_names())


def test_image_digest_wins_over_tag(render) -> None:
    digest = "sha256:" + "a" * 64
    container = render(f"image.digest={digest}").one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"registry.example.com/r3operator/operator@{digest}"


def test_crd_template_is_the_generated_crd_plus_the_keep_policy(render) -> None:
    source = yaml.safe_load((REPO / "crds/rljob.yaml").read_text())
    rendered = render().one("CustomResourceDefinition")
    assert rendered["metadata"]["annotations"].pop("helm.sh/resource-policy") == "keep"
    assert rendered == source
    assert not render("crds.install=false").kind("CustomResourceDefinition")


def test_chart_crd_copy_is_byte_identical_to_crds_dir() -> None:
    assert (REPO / CRD_COPY).read_bytes() == (REPO / "crds/rljob.yaml").read_bytes(), (
        "charts/r3operator/files/crds/rljob.yaml is stale: run python -m r3operator.observability.generate"
    )
    assert not (CHART / "crds").exists(), "a chart crds/ dir would be installed once and never upgraded"


def test_dashboards_configmap_carries_every_generated_dashboard(render) -> None:
    configmap = next(d for d in render().kind("ConfigMap") if d["metadata"]["name"].endswith("-dashboards"))
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    assert len(files) == 4
    assert {k: v.rstrip("\n") for k, v in configmap["data"].items()} == {k: v.rstrip("\n") for k, v in files.items()}
    off = render("dashboards.enabled=false").kind("ConfigMap")
    assert not [d for d in off if "dashboards" in d["metadata"]["name"]]


def test_prometheus_rule_and_monitors_render_only_when_enabled(render) -> None:
    assert not render().kind("PrometheusRule") and not render().kind("PodMonitor")
    docs = render(*ALL_ON)
    assert docs.one("PrometheusRule")["spec"] == rules.rule_groups()
    endpoint = docs.one("PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    assert docs.one("ServiceMonitor")["spec"]["endpoints"][0]["honorLabels"] is True


def test_notes_tell_the_next_commands(helm: str) -> None:
    proc = subprocess.run(
        [
            helm,
            "install",
            "r3",
            str(CHART),
            "--dry-run=client",
            "-n",
            "r3-system",
            *("--set", IMAGE),
            *("--set", NAMESPACED[0]),
            *("--set", NAMESPACED[1]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "kubectl apply -f examples/qwen3-30b-a3b-r3-fsdp.yaml" in notes
    assert "kubectl get rlj -n rl -w" in notes
    assert "must be one of team-a, team-b" in notes
    assert (REPO / "examples/qwen3-30b-a3b-r3-fsdp.yaml").exists()
