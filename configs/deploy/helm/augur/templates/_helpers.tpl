{{/*
The chart name, for app.kubernetes.io/name.
*/}}
{{- define "augur.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every object name: the release name, with the chart name added unless it is already in it
(release `augur` gives `augur`, release `prod` gives `prod-augur`).
*/}}
{{- define "augur.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "augur.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Labels on every object.
*/}}
{{- define "augur.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "augur.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
Deep merge for the per-model overrides, as YAML: keys of .over win over .base even when they are 0, false
or "" (sprig's merge and mergeOverwrite skip such values, so `gpus: 0` would be lost); maps merge key by
key, anything else (lists included) is replaced.
*/}}
{{- define "augur.merge" -}}
{{- $out := deepCopy .base -}}
{{- range $key, $value := .over -}}
{{- $current := get $out $key -}}
{{- if and (kindIs "map" $value) (kindIs "map" $current) -}}
{{- $_ := set $out $key (include "augur.merge" (dict "base" $current "over" $value) | fromYaml) -}}
{{- else -}}
{{- $_ := set $out $key $value -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
The models, each with the top-level defaults under its own keys, as YAML {models: [...]}. Names are
checked here, once for every template: they become part of object names and DNS names.
*/}}
{{- define "augur.models" -}}
{{- $defaults := pick .Values
    "image" "imagePullSecrets" "replicas" "nodes" "gpus" "gpuResource" "resources" "strategy"
    "nodeSelector" "tolerations" "affinity" "podLabels" "podAnnotations" "env" "extraArgs"
    "podSecurityContext" "securityContext" "shmSize" "probes" "storage" -}}
{{- if not .Values.models -}}
{{- fail "models: list at least one model to serve" -}}
{{- end -}}
{{- $fullname := include "augur.fullname" . -}}
{{- $seen := dict -}}
{{- $models := list -}}
{{- range $i, $model := .Values.models -}}
{{- $name := required (printf "models[%d].name is required" $i) $model.name | toString -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "models[%d].name %q: use lowercase letters, digits and '-', starting with a letter" $i $name) -}}
{{- end -}}
{{- if gt (len (printf "%s-%s" $fullname $name)) 63 -}}
{{- fail (printf "models[%d].name %q: %s-%s is longer than a Service name may be (63)" $i $name $fullname $name) -}}
{{- end -}}
{{- if hasKey $seen $name -}}
{{- fail (printf "models[%d].name %q is used twice" $i $name) -}}
{{- end -}}
{{- $_ := set $seen $name true -}}
{{- $models = append $models (include "augur.merge" (dict "base" $defaults "over" $model) | fromYaml) -}}
{{- end -}}
{{- toYaml (dict "models" $models) -}}
{{- end -}}

{{/*
Per-model helpers below take (dict "root" $ "model" <resolved model>).
*/}}
{{- define "augur.modelFullname" -}}
{{- printf "%s-%s" (include "augur.fullname" .root) .model.name -}}
{{- end -}}

{{/*
Selector labels: stable for the life of a release (a Deployment's selector cannot change).
*/}}
{{- define "augur.selectorLabels" -}}
app.kubernetes.io/name: {{ include "augur.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
augur/model: {{ .model.name }}
{{- end -}}

{{- define "augur.modelLabels" -}}
{{ include "augur.labels" .root }}
augur/model: {{ .model.name }}
{{- end -}}

{{/*
The llm-d.ai/model label value: the name the server answers to (served-model-name; else the model's
last path component, as `augur serve` names it; else augur-demo), made a valid label value: at most 63
of [A-Za-z0-9_.-], beginning and ending with a letter or digit. `modelLabel` overrides the source.
*/}}
{{- define "augur.modelLabelValue" -}}
{{- $config := .config | default dict -}}
{{- $served := coalesce (get $config "served-model-name") (get $config "served_model_name") -}}
{{- $fromModel := "" -}}
{{- with get $config "model" }}{{ $fromModel = base (toString .) }}{{ end -}}
{{- $source := coalesce .modelLabel $served $fromModel "augur-demo" | toString -}}
{{- $value := regexReplaceAll "[^A-Za-z0-9_.-]+" $source "-" | trunc 63 -}}
{{- $value = regexReplaceAll "^[^A-Za-z0-9]+|[^A-Za-z0-9]+$" $value "" -}}
{{- $value | default .name -}}
{{- end -}}

{{/*
Labels llm-d's router reads on model-server pods. An InferencePool selects its pods by labels; llm-d's
guides and its modelservice chart use llm-d.ai/inferenceServing="true" (spelt
llm-d.ai/inference-serving since 2026; both are set) and llm-d.ai/model. The endpoint picker's metrics
extractor picks the metric names to scrape by llm-d.ai/engine-type (by
inference.networking.k8s.io/engine-type in the upstream Gateway API Inference Extension's picker).
*/}}
{{- define "augur.llmdLabels" -}}
{{- if .root.Values.llmd.enabled -}}
llm-d.ai/inferenceServing: "true"
llm-d.ai/inference-serving: "true"
llm-d.ai/model: {{ include "augur.modelLabelValue" .model | quote }}
llm-d.ai/engine-type: {{ .root.Values.llmd.engineType | quote }}
inference.networking.k8s.io/engine-type: {{ .root.Values.llmd.engineType | quote }}
{{- end -}}
{{- end -}}

{{/*
A pod volume from a storage entry: (dict "name" <volume> "spec" <storage.X> "claim" <name of the
claim the chart creates>).
*/}}
{{- define "augur.volume" -}}
- name: {{ .name }}
{{- if eq .spec.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .spec.pvc.existingClaim | default .claim }}
{{- else if eq .spec.type "hostPath" }}
  hostPath:
    path: {{ required (printf "storage.%s.hostPath.path is required with type hostPath" .name) .spec.hostPath.path }}
    {{- with .spec.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- else if eq .spec.type "emptyDir" }}
  emptyDir:
    {{- if .spec.emptyDir.sizeLimit }}
    sizeLimit: {{ .spec.emptyDir.sizeLimit }}
    {{- else }} {}
    {{- end }}
{{- else }}
{{- fail (printf "storage.%s.type %q: use pvc, hostPath or emptyDir" .name .spec.type) }}
{{- end }}
{{- end -}}
