{{/*
A model's pod template: (dict "root" $ "model" <resolved model> "fullname" <its objects' name> "labels"
<pod labels> "resources" <container resources> "role" <single | leader | worker>). A Deployment's pods
are "single"; a LeaderWorkerSet group's (`nodes` > 1) are one "leader", which serves HTTP with
tensor-parallel rank 0, and "worker"s, which run their ranks headless (no port, no probes).
*/}}
{{- define "augur.podTemplate" -}}
{{- $Values := .root.Values }}
{{- $model := .model }}
{{- $fullname := .fullname }}
{{- $podLabels := .labels }}
{{- $resources := .resources }}
{{- $role := .role }}
{{- with $model }}
metadata:
  labels:
    {{- toYaml $podLabels | nindent 4 }}
  annotations:
    # A changed config restarts the pods (a ConfigMap edit alone would not).
    checksum/config: {{ toYaml (.config | default dict) | sha256sum }}
    {{- if $Values.metrics.podAnnotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: "8000"
    prometheus.io/path: /metrics
    {{- end }}
    {{- with .podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- with .imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .podSecurityContext | nindent 4 }}
  {{- with .nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: augur
      image: "{{ .image.repository }}:{{ .image.tag }}"
      imagePullPolicy: {{ .image.pullPolicy }}
      command: ["augur", "serve"]
      # The flags after --config override the file's.
      args:
        - --config
        - /etc/augur/config.yaml
        - --host
        - 0.0.0.0
        - --port
        - "8000"
        {{- if ne $role "single" }}
        # One replica spans the group's pods: LeaderWorkerSet tells each its index and the leader's address.
        - --nnodes
        - $(LWS_GROUP_SIZE)
        - --node-rank
        - $(LWS_WORKER_INDEX)
        - --master-addr
        - $(LWS_LEADER_ADDRESS)
        - --master-port
        - "29500"
        {{- end }}
        {{- range .extraArgs }}
        - {{ . | quote }}
        {{- end }}
      {{- if ne $role "worker" }}
      ports:
        - name: http
          containerPort: 8000
          protocol: TCP
      {{- end }}
      env:
        # The image sets these too; the volume mounts below depend on them.
        - name: AUGUR_HOME
          value: /cache/augur
        - name: HF_HOME
          value: /cache/huggingface
        {{- with $Values.apiKey.existingSecret }}
        - name: AUGUR_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $Values.apiKey.key }}
        {{- end }}
        {{- with $Values.hfToken.existingSecret }}
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $Values.hfToken.key }}
        {{- end }}
        {{- with .env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        {{- toYaml .securityContext | nindent 8 }}
      {{- if ne $role "worker" }}
      startupProbe:
        httpGet:
          path: /health
          port: http
        {{- toYaml .probes.startup | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /health
          port: http
        {{- toYaml .probes.readiness | nindent 8 }}
      livenessProbe:
        httpGet:
          path: /health
          port: http
        {{- toYaml .probes.liveness | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: config
          mountPath: /etc/augur
          readOnly: true
        - name: models
          mountPath: /models
          readOnly: true
        - name: cache
          mountPath: /cache
        - name: shm
          mountPath: /dev/shm
  volumes:
    - name: config
      configMap:
        name: {{ $fullname }}
    {{- range $volume := list "models" "cache" }}
    {{- $claim := printf "%s-%s" $fullname $volume }}
    {{- include "augur.volume" (dict "name" $volume "spec" (get $model.storage $volume) "claim" $claim) | nindent 4 }}
    {{- end }}
    - name: shm
      emptyDir:
        medium: Memory
        {{- with .shmSize }}
        sizeLimit: {{ . }}
        {{- end }}
{{- end }}
{{- end -}}
