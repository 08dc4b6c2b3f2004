{{- /*
The namespaced permissions of the operator; one list shared by Role and ClusterRole. Source of truth:
docs/operator.md "RBAC the operator needs" (children are read by name and written, never listed/watched;
pods are listed, never written).
*/ -}}
{{- define "r3operator.operatorRules" -}}
- apiGroups: ["r3operator.io"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["r3operator.io"]
  resources: ["rljobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "persistentvolumeclaims"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# Read-only, listed by the job's label while its engines or trainer are not up: the scheduler's reason
# for pods it cannot place goes into status (operator/scheduling.py).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "create", "patch", "delete"]
# Per RLJob: the trainer's ServiceAccount and its RoleBinding to the trainer ClusterRole.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
# Binding a role needs its permissions or `bind` on it: only the trainer ClusterRole.
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["clusterroles"]
  verbs: ["bind"]
  resourceNames: [{{ include "r3operator.trainerClusterRoleName" . | quote }}]
{{- end -}}
