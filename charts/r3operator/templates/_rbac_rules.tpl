{{- /*
The namespaced permissions of the operator; one list shared by Role and ClusterRole. Source of truth:
docs/operator.md "RBAC the operator needs" (children are read by name and written, never listed/watched).
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
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "create", "patch", "delete"]
{{- end -}}
