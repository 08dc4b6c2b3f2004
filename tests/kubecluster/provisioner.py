"""A volume provisioner for the test control plane: every pending PVC of a StorageClass it provisions
(`standard`, the default, and `rwx-nfs`, a typical shared-filesystem class that the examples name) gets a
PersistentVolume made for it and pre-bound to it (`claimRef`), which the real PV controller then binds.

Real clusters run a CSI driver's external-provisioner for this; the test cluster has no storage, so its
volumes are `hostPath` placeholders that nothing mounts (kwok runs the pods). Run as its own process:

    python -m kubecluster.provisioner --kubeconfig KUBECONFIG
"""

from __future__ import annotations

import argparse
import json
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

PROVISIONER = "r3operator.io/test-provisioner"
STORAGE_CLASSES = ("standard", "rwx-nfs")


class Api:
    def __init__(self, kubeconfig: Path) -> None:
        config = yaml.safe_load(kubeconfig.read_text())
        self.server = config["clusters"][0]["cluster"]["server"]
        self.token = config["users"][0]["user"]["token"]
        self.ssl = ssl.create_default_context(cafile=config["clusters"][0]["cluster"]["certificate-authority"])

    def call(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(
            self.server + path, data=None if body is None else json.dumps(body).encode(), method=method
        )
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=30, context=self.ssl) as resp:
            return json.loads(resp.read())


def storage_class(name: str) -> dict[str, Any]:
    default = {"storageclass.kubernetes.io/is-default-class": "true"} if name == STORAGE_CLASSES[0] else {}
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": name, "annotations": default},
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


def volume_for(claim: dict[str, Any]) -> dict[str, Any]:
    meta = claim["metadata"]
    size = claim["spec"].get("resources", {}).get("requests", {}).get("storage", "1Gi")
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"pv-{meta['uid']}", "annotations": {"pv.kubernetes.io/provisioned-by": "test"}},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": claim["spec"].get("accessModes") or ["ReadWriteOnce"],
            "storageClassName": claim["spec"]["storageClassName"],
            "persistentVolumeReclaimPolicy": "Delete",
            "claimRef": {"namespace": meta["namespace"], "name": meta["name"], "uid": meta["uid"]},
            "hostPath": {"path": f"/tmp/r3-test-volumes/{meta['uid']}"},
        },
    }


def provision_once(api: Api) -> int:
    made = 0
    for claim in api.call("GET", "/api/v1/persistentvolumeclaims")["items"]:
        spec, phase = claim["spec"], claim.get("status", {}).get("phase")
        if phase != "Pending" or spec.get("volumeName") or spec.get("storageClassName") not in STORAGE_CLASSES:
            continue
        if claim["metadata"].get("deletionTimestamp"):
            continue
        try:
            api.call("POST", "/api/v1/persistentvolumes", volume_for(claim))
            made += 1
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # made on an earlier pass, not yet bound
                raise
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    api = Api(args.kubeconfig)
    for name in STORAGE_CLASSES:
        try:
            api.call("POST", "/apis/storage.k8s.io/v1/storageclasses", storage_class(name))
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise
    print("provisioner ready", flush=True)
    while True:
        try:
            provision_once(api)
        except (urllib.error.URLError, OSError) as exc:  # apiserver restarts in tests: keep going
            print(f"provisioner: {exc}", flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    raise SystemExit(main())
