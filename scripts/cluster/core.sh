# The core control plane's build recipe, sourced by scripts/install-cluster.sh: kube-apiserver,
# kube-controller-manager, kube-scheduler, etcd, kwok and the KubeRay operator (+ its CRDs).
#
# This file and the core go.mod/go.sum files are what the core stamp (.stamp-core) hashes: editing
# install-cluster.sh, or an add-on's recipe, never rebuilds the core (a ~15-minute build on 2 cores).
# Expects from install-cluster.sh: SRC, OUT, BIN, log, pinned.

CORE_COMPONENTS=(kubernetes etcd kwok kuberay)

build_core() {
  local k8s etcd kwok kuberay minor ldflags kuberay_dir
  k8s="$(pinned kubernetes k8s.io/kubernetes)"
  etcd="$(pinned etcd go.etcd.io/etcd/server/v3)"
  kwok="$(pinned kwok sigs.k8s.io/kwok)"
  kuberay="$(pinned kuberay github.com/ray-project/kuberay/ray-operator)"
  mkdir -p "$BIN" "$OUT/crds"
  # Keep the build's memory in bounds on a 2-core / 24 GiB machine; -p 2 matches the cores.
  local build=(env CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--mod=mod}" go build -trimpath -p "${GO_BUILD_JOBS:-2}")

  minor="${k8s#v1.}"; minor="${minor%%.*}"
  # kube-apiserver reports this version to clients (helm's kubeVersion check, kubectl's skew warning).
  ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$k8s \
-X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor \
-X k8s.io/component-base/version.gitTreeState=clean"

  log "building kube-apiserver, kube-controller-manager, kube-scheduler $k8s (first build: several minutes)"
  (cd "$SRC/kubernetes" && "${build[@]}" -ldflags "$ldflags" -o "$BIN/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler)

  log "building etcd $etcd"
  (cd "$SRC/etcd" && "${build[@]}" -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3)

  log "building kwok $kwok"
  (cd "$SRC/kwok" && "${build[@]}" -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$kwok" \
    -o "$BIN/kwok" sigs.k8s.io/kwok/cmd/kwok)

  log "building the KubeRay operator $kuberay"
  (cd "$SRC/kuberay" && "${build[@]}" -ldflags "-s -w" -o "$BIN/kuberay-operator" \
    github.com/ray-project/kuberay/ray-operator)
  kuberay_dir="$(cd "$SRC/kuberay" && go list -m -f '{{.Dir}}' github.com/ray-project/kuberay/ray-operator)"
  install -m 0644 "$kuberay_dir"/config/crd/bases/ray.io_*.yaml "$OUT/crds/"
}
