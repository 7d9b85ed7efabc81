{{- /*
The operator's RBAC rules, derived from what its code calls; nothing else is granted. The
comment above each rule names the code that needs it; tests/deploy/test_chart.py holds the same
list, so a new rule needs a deliberate test change.

Cluster-wide (watchNamespaces empty): clusterrole.yaml grants every rule below in one ClusterRole.
Namespaced: role.yaml grants the object rules in a Role in each watched namespace, and
clusterrole.yaml grants only the reads that exist solely at cluster scope (CRDs, namespace names).
*/ -}}
{{- define "corefleet.rbac.objectRules" -}}
# Rank pods: kopf indexes and watches them (main.py rank_pods, rank_pod_event); the reconcile
# creates, annotates (disruption guard) and deletes them (reconcile.py, controller.py _execute).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, patch, delete]
# Children of an engine: indexed by kopf (main.py CHILD_KINDS), created and patched to the
# current spec (reconcile.py _children_actions). They are never deleted by the operator: owner
# references hand them to the garbage collector.
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [list, watch, create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, watch, create, patch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch, create, patch]
# The coordinators' HorizontalPodAutoscaler (spec.coordinator.autoscaling): indexed, created and
# patched like the other children, and deleted when the spec drops autoscaling (reconcile.py
# OPTIONAL_KINDS), since left behind it would keep resizing the coordinator Deployment.
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list, watch, create, patch, delete]
# The CURVE key Secret: indexed by kopf and created once; never patched (reconcile.py skips it).
# get: the coordinator's API key Secret (spec.coordinator.apiKeySecretRef), read to call the
# coordinator's /admin/engines (controller.py _api_key).
- apiGroups: [""]
  resources: [secrets]
  verbs: [list, watch, create, get]
# The model volume's claim is read to report a missing one (controller.py _volume_missing).
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get]
# The engines: kopf lists and watches them and patches its annotations and finalizer
# (settings.py configure); the status is written through the status subresource
# (controller.py _write_status).
- apiGroups: [corefleet.dev]
  resources: [inferenceengines]
  verbs: [list, watch, patch]
- apiGroups: [corefleet.dev]
  resources: [inferenceengines/status]
  verbs: [patch]
# Children carry owner references with blockOwnerDeletion (resources.py _meta), which the
# OwnerReferencesPermissionEnforcement admission plugin allows only with update on the owner's
# finalizers.
- apiGroups: [corefleet.dev]
  resources: [inferenceengines/finalizers]
  verbs: [update]
# Events about engines (controller.py _post through kopf.event) are created, never read.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
{{- define "corefleet.rbac.crdRules" -}}
# kopf lists and watches CRDs to notice served resources appearing or going (its resource
# observer); it falls back to one scan at startup, with a warning, without this.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}
{{- /* The operator's ServiceAccount, the subject of every binding. */}}
{{- define "corefleet.rbac.subjects" -}}
- kind: ServiceAccount
  name: {{ include "corefleet.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end }}
