{{- /*
The namespaced permissions of the operator; one list shared by Role and ClusterRole. Source of truth:
docs/operator.md "RBAC the operator needs" (children are listed and watched by the operator's label into
its cache, and written; pods are listed and watched, never written).
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
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# Read-only, watched by the job's label into the operator's cache: the scheduler's reason for pods it
# cannot place goes into status (operator/scheduling.py).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# The engine-upgrade canary (operator/upgrade.py): one Job per upgrade attempt; the model-fetch Job that
# fills an hf://, s3:// or gs:// model's cache once (builders/model_cache.py).
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The engines of an RLJob whose replica spans pods (api/engine_layout.py): one LeaderWorkerSet.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The Workload of a queued RLJob (spec.queueName), and its status: the operator is its job controller
# (it releases the quota of an evicted Workload and marks a finished one, operator/admission.py).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- if .Values.rbac.checkSecretReferences }}
# A Secret the spec names (model.tokenSecretRef, s3/gcs credentials, env secretKeyRef, secret volumes,
# imagePullSecrets) must exist with its key before any pod is made (operator/references.py): `get` by
# name, never list or watch; only the key names are kept, never a value. An operator that creates pods
# in a namespace can already mount any Secret there, so this adds no reach.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
{{- end }}
# Per RLJob: the trainer's ServiceAccount, a Role naming only that job's progress ConfigMap
# (<job>-progress), and their RoleBinding. The API server lets the operator grant in a Role only what it
# holds itself (get/patch on configmaps, above): no `bind` or `escalate` is needed.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end -}}
