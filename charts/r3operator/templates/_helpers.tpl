{{/* Names and labels shared by every template. */}}
{{- define "r3operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "r3operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "r3operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "r3operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "r3operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "r3operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: r3operator
{{- end -}}

{{- define "r3operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "r3operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "r3operator.image" -}}
{{- $repository := required "image.repository is not set: no r3operator image is published; build images/operator/Dockerfile, push it to a registry your cluster pulls from (docs/install.md, Images) and set image.repository" .Values.image.repository -}}
{{- if eq .Values.image.tag "latest" -}}
{{- fail "image.tag=latest: pin a version tag (the chart's appVersion when empty) or set image.digest; latest makes every node run whatever it pulled last" -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/*
The namespaces whose RLJobs the operator reconciles: empty in cluster mode; in namespaced mode
watch.namespaces, or the release namespace when that list is empty.
*/}}
{{- define "r3operator.watchedNamespaces" -}}
{{- if eq .Values.watch.mode "namespaced" -}}
{{- toJson (default (list .Release.Namespace) .Values.watch.namespaces) -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}
