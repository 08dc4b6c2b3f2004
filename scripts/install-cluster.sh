#!/usr/bin/env bash
# Build the real Kubernetes control plane the tests run against, from pinned Go modules.
#
#   scripts/cluster/kubernetes/go.mod : kube-apiserver, kube-controller-manager, kube-scheduler
#                                       (k8s.io/kubernetes, every k8s.io staging module replaced by its
#                                       matching v0.x release: the usual way to build k8s as a dependency)
#   scripts/cluster/etcd/go.mod       : etcd (go.etcd.io/etcd/server/v3)
#   scripts/cluster/kwok/go.mod       : kwok (fake nodes and pod lifecycles)
#   scripts/cluster/kuberay/go.mod    : the KubeRay operator; its CRDs are copied from the module
#   scripts/cluster/kueue/go.mod      : Kueue (queueing and gang admission); its CRDs and webhook
#                                       configurations are copied from the module into kueue/
#
# Each go.mod (with its go.sum) is the one pin of its component. Binaries land in
# DIR/k8s-<kubernetes version>/bin and are rebuilt only when a go.mod/go.sum or the Go toolchain changes
# (a stamp holds their hash), so the build runs once per version; after the first build it is offline
# (Go's module cache). No binary download, no docker: the ordinary `go` client only. Kueue's go.mod has a
# stamp of its own (.stamp-kueue): bumping Kueue rebuilds Kueue only.
#
# Usage: bash scripts/install-cluster.sh [DIR]   (default .tools); prints the directory it built.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SRC="$ROOT/scripts/cluster"
DIR="${1:-$ROOT/.tools}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

log() { printf '[install-cluster] %s\n' "$*" >&2; }
die() { printf '[install-cluster] ERROR: %s\n' "$*" >&2; exit 1; }

command -v go >/dev/null || die "Go is required (go 1.25 or newer on PATH) to build the control plane"

pinned() {  # pinned MODULE-DIR MODULE-PATH -> version required in that go.mod
  local v
  v="$(awk -v m="$2" '$1 == m && $2 ~ /^v/ {print $2; exit}' "$SRC/$1/go.mod")"
  [[ -n "$v" ]] || die "scripts/cluster/$1/go.mod does not require $2"
  printf '%s' "$v"
}

K8S_VERSION="$(pinned kubernetes k8s.io/kubernetes)"
ETCD_VERSION="$(pinned etcd go.etcd.io/etcd/server/v3)"
KWOK_VERSION="$(pinned kwok sigs.k8s.io/kwok)"
KUBERAY_VERSION="$(pinned kuberay github.com/ray-project/kuberay/ray-operator)"
KUEUE_VERSION="$(pinned kueue sigs.k8s.io/kueue)"

OUT="$DIR/k8s-$K8S_VERSION"
BIN="$OUT/bin"
STAMP="$OUT/.stamp"
CORE=(kubernetes etcd kwok kuberay)
want="$( (go env GOVERSION; for c in "${CORE[@]}"; do cat "$SRC/$c/go.mod" "$SRC/$c/go.sum"; done; cat "$0") |
        sha256sum | cut -c1-16)"
want_kueue="$( (go env GOVERSION; cat "$SRC/kueue/go.mod" "$SRC/kueue/go.sum") | sha256sum | cut -c1-16)"

build_kueue() {
  log "building Kueue $KUEUE_VERSION"
  mkdir -p "$BIN" "$OUT/kueue/crds"
  (cd "$SRC/kueue" && CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--mod=mod}" go build -trimpath -p "${GO_BUILD_JOBS:-2}" \
    -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" -o "$BIN/kueue" sigs.k8s.io/kueue/cmd/kueue)
  local dir
  dir="$(cd "$SRC/kueue" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
  install -m 0644 "$dir"/config/components/crd/bases/kueue.x-k8s.io_*.yaml "$OUT/kueue/crds/"
  # The webhook configurations as the module has them (service and ports are filled in at start).
  install -m 0644 "$dir/config/components/webhook/manifests.yaml" "$OUT/kueue/webhooks.yaml"
  echo "$want_kueue" >"$OUT/.stamp-kueue"
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  if [[ ! -f "$OUT/.stamp-kueue" || "$(cat "$OUT/.stamp-kueue")" != "$want_kueue" ]]; then
    build_kueue
  fi
  log "up to date: $OUT"
  echo "$OUT"
  exit 0
fi

mkdir -p "$BIN" "$OUT/crds"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--mod=mod}"
# Keep the build's memory in bounds on a 2-core / 24 GiB machine; -p 2 matches the cores.
BUILD=(go build -trimpath -p "${GO_BUILD_JOBS:-2}")
start=$SECONDS

minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
# kube-apiserver reports this version to clients (helm's kubeVersion check, kubectl's skew warning).
K8S_LDFLAGS="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
-X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor \
-X k8s.io/component-base/version.gitTreeState=clean"

log "building kube-apiserver, kube-controller-manager, kube-scheduler $K8S_VERSION (first build: several minutes)"
(cd "$SRC/kubernetes" && "${BUILD[@]}" -ldflags "$K8S_LDFLAGS" -o "$BIN/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler)

log "building etcd $ETCD_VERSION"
(cd "$SRC/etcd" && "${BUILD[@]}" -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3)

log "building kwok $KWOK_VERSION"
(cd "$SRC/kwok" && "${BUILD[@]}" -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" \
  -o "$BIN/kwok" sigs.k8s.io/kwok/cmd/kwok)

log "building the KubeRay operator $KUBERAY_VERSION"
(cd "$SRC/kuberay" && "${BUILD[@]}" -ldflags "-s -w" -o "$BIN/kuberay-operator" \
  github.com/ray-project/kuberay/ray-operator)
kuberay_dir="$(cd "$SRC/kuberay" && go list -m -f '{{.Dir}}' github.com/ray-project/kuberay/ray-operator)"
install -m 0644 "$kuberay_dir"/config/crd/bases/ray.io_*.yaml "$OUT/crds/"

build_kueue

cat >"$OUT/versions.txt" <<EOF
kubernetes $K8S_VERSION
etcd $ETCD_VERSION
kwok $KWOK_VERSION
kuberay $KUBERAY_VERSION
kueue $KUEUE_VERSION
go $(go env GOVERSION)
EOF
echo "$want" >"$STAMP"
log "built in $((SECONDS - start)) s into $OUT ($(du -sh "$OUT" | cut -f1)):"
sed 's/^/[install-cluster]   /' "$OUT/versions.txt" >&2
echo "$OUT"
