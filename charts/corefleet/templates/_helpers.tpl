{{/*
Naming and labels shared by every template.

Names are cut to 63 characters because Kubernetes object names that end up in labels or DNS
(Service names, label values) must be valid DNS labels, which allow at most 63 characters. A
trailing "-" left by the cut is removed, since a DNS label may not end with one.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "corefleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name: fullnameOverride, else "<release>-<chart>", else just the release name
when it already contains the chart name (so `helm install corefleet` gives "corefleet").
*/}}
{{- define "corefleet.fullname" -}}
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

{{/* "<chart>-<version>" for the helm.sh/chart label ("+" is not allowed in label values). */}}
{{- define "corefleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels that select the operator pods; they never change after the install. */}}
{{- define "corefleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "corefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of every object the chart renders (the CRD excepted: it is rendered as in crds/). */}}
{{- define "corefleet.labels" -}}
helm.sh/chart: {{ include "corefleet.chart" . }}
{{ include "corefleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: corefleet
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "corefleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "corefleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image reference; the tag defaults to the chart's appVersion, never "latest". */}}
{{- define "corefleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Whether the replicas elect a leader through kopf peering (more than one replica). */}}
{{- define "corefleet.peering" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{ end }}
{{- end }}
