{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "strata.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the prefix of every object name. */}}
{{- define "strata.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "strata.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "strata.selectorLabels" -}}
app.kubernetes.io/name: {{ include "strata.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of every object; `component` is set by the caller through strata.labelsFor. */}}
{{- define "strata.labels" -}}
helm.sh/chart: {{ include "strata.chart" . }}
app.kubernetes.io/name: {{ include "strata.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: strata
{{- with include "strata.stringMap" .Values.commonLabels | trim }}{{ . | nindent 0 }}{{ end }}
{{- end }}

{{/* Labels plus app.kubernetes.io/component. Usage: include "strata.labelsFor" (list . "operator") */}}
{{- define "strata.labelsFor" -}}
{{ include "strata.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "strata.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "strata.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "strata.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "strata.sidecarImage" -}}
{{- printf "%s:%s" .Values.sidecar.image.repository (default .Chart.AppVersion .Values.sidecar.image.tag) }}
{{- end }}

{{- define "strata.testImage" -}}
{{- if .Values.tests.image.repository }}
{{- printf "%s:%s" .Values.tests.image.repository (default (default .Chart.AppVersion .Values.image.tag) .Values.tests.image.tag) }}
{{- else }}
{{- include "strata.image" . }}
{{- end }}
{{- end }}

{{/* Name of the MutatingWebhookConfiguration (chart-rendered or operator-managed). */}}
{{- define "strata.webhookConfigName" -}}
{{- printf "%s.strata.dev" (include "strata.fullname" .) }}
{{- end }}

{{/* Secret holding the webhook's serving certificate (cert-manager mode). */}}
{{- define "strata.certSecretName" -}}
{{- printf "%s-webhook-tls" (include "strata.fullname" .) }}
{{- end }}

{{/* Namespaces never sent to the webhook: kube-system, the release namespace, and the listed ones. */}}
{{- define "strata.excludedNamespaces" -}}
{{- $ns := list "kube-system" .Release.Namespace }}
{{- range .Values.webhook.excludedNamespaces }}{{ $ns = append $ns . }}{{ end }}
{{- $ns | uniq | toJson }}
{{- end }}

{{/* A map of labels or annotations with every value a string (`--set a=true` gives a bool). */}}
{{- define "strata.stringMap" -}}
{{- range $key, $value := . }}
{{ $key }}: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/* Whether the replicas share a Helm-generated serving certificate (several replicas, no
cert-manager). */}}
{{- define "strata.chartTLS" -}}
{{- if and (not .Values.certManager.enabled) (gt (int .Values.replicaCount) 1) }}true{{ end }}
{{- end }}

{{/* The Service the sidecars send reports to: it selects only the leader (strata.dev/operator-role). */}}
{{- define "strata.reportsServiceName" -}}
{{- printf "%s-reports" (include "strata.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/* DNS names of the serving certificate: the webhook's and the reports' Services. */}}
{{- define "strata.tlsDNSNames" -}}
{{- $ns := .Release.Namespace }}
{{- $names := list }}
{{- range (list (include "strata.fullname" .) (include "strata.reportsServiceName" .)) }}
{{- $names = append $names (printf "%s.%s.svc" . $ns) }}
{{- $names = append $names (printf "%s.%s.svc.cluster.local" . $ns) }}
{{- end }}
{{- $names | toJson }}
{{- end }}
