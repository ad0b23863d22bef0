"""The Helm chart (configs/deploy/helm/augur) and its plain rendering deploy what the server expects.

- the chart renders with Helm's own Go template engine (helm_python binds Helm's SDK; no helm binary)
  for several value sets, and every rendered object validates, strictly (unknown fields fail), against
  the Kubernetes OpenAPI schemas that kubernetes_validate bundles;
- the facts that matter are asserted on the parsed objects: one Deployment, Service and ConfigMap per
  model, replicas, GPU limits, /health probes, scrape annotations, llm-d's labels, volumes, and a config
  file that Augur's own CLI loader accepts;
- the example values files mirror configs/*.yaml, and configs/deploy/kubernetes/augur.yaml is the
  chart's current rendering;
- ``helm lint`` passes, and the ``*_can_fail`` tests feed each validator a broken input.

After changing the chart, regenerate the plain manifest:  .venv/bin/python tests/test_kubernetes.py
"""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")  # ships for linux x86_64 only
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from test_deploy import DOCKERFILE, SERVICES, engine_config, exported_samples, serve_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
CHART_DIR = CONFIGS / "deploy" / "helm" / "augur"
PLAIN = CONFIGS / "deploy" / "kubernetes" / "augur.yaml"
REGENERATE = ".venv/bin/python tests/test_kubernetes.py"
KUBE_VERSION = "1.33"  # a recent release; the schemas are kubernetes_validate's own copies
RELEASE = "augur"
CONFIG_PATH = "/etc/augur/config.yaml"
PORT = 8000
# Kubernetes' label syntax: values up to 63 of [A-Za-z0-9_.-], alphanumeric at both ends (or empty);
# keys an optional DNS-subdomain prefix and such a name.
LABEL_VALUE = re.compile(r"(|[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)")
LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")


def read_yaml(path: Path):
    return yaml.safe_load(path.read_text())


PRESET_VALUES = {p.name[len("values-") : -len(".yaml")]: p for p in sorted(CHART_DIR.glob("values-*.yaml"))}
PRESET_VALUES.pop("cpu")  # an overlay for CPU nodes, not a preset


# -- rendering -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as c:
        yield c


def render(chart, values: dict | None = None, release: str = RELEASE) -> list[dict]:
    """Every object the chart renders (NOTES.txt aside), as parsed YAML."""
    manifests = chart.render(values or {}, name=release, namespace="default")
    return [
        doc
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def pod_labels(deployment: dict) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def volumes(deployment: dict) -> dict[str, dict]:
    return {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}


def mounts(deployment: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in container(deployment)["volumeMounts"]}


def model_entry(preset: str, **overrides) -> dict:
    (entry,) = read_yaml(PRESET_VALUES[preset])["models"]
    return {**entry, **overrides}


VALUE_SETS = {
    "defaults": {},
    "two-models": {
        "models": [
            model_entry("llama-3.1-8b-instruct", replicas=2),
            model_entry("qwen2.5-7b-instruct", replicas=3),
        ]
    },
    "hostpath": {
        "storage": {
            "models": {"type": "hostPath", "hostPath": {"path": "/srv/models"}},
            "cache": {"type": "hostPath", "hostPath": {"path": "/srv/augur-cache"}},
        }
    },
    "cpu": read_yaml(CHART_DIR / "values-cpu.yaml"),
    "api-key": {
        "apiKey": {"existingSecret": "augur-api-key"},
        "hfToken": {"existingSecret": "hf-token", "key": "HF_TOKEN"},
    },
    "servicemonitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    # Per-model overrides of the defaults, 0 included; a shared existing claim for the cache.
    "overrides": {
        "storage": {"cache": {"pvc": {"existingClaim": "shared-cache"}}},
        "models": [
            {"name": "big", "gpus": 2, "config": {"model": "/models/my-llama", "max-num-seqs": 8}},
            {
                "name": "small",
                "gpus": 0,
                "replicas": 0,
                "storage": {"cache": {"type": "emptyDir"}},
                "probes": {"startup": {"failureThreshold": 30}},
                "podLabels": {"llm-d.ai/guide": "augur"},
            },
        ],
    },
    **{f"preset-{name}": read_yaml(path) for name, path in PRESET_VALUES.items()},
}


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, list[dict]]:
    return {name: render(chart, values) for name, values in VALUE_SETS.items()}


def models_of(chart, values: dict) -> list[dict]:
    return values.get("models") or chart.values["models"]


# -- every object is valid Kubernetes -----------------------------------------------------------------------
@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, name):
    kinds = []
    for doc in rendered[name]:
        kinds.append(doc["kind"])
        if doc["kind"] == "ServiceMonitor":  # a CRD: no schema here (its shape is tested below)
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    assert {"Deployment", "Service", "ConfigMap"} <= set(kinds)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_one_deployment_service_and_configmap_per_model(chart, rendered, name):
    docs = rendered[name]
    expected = {f"{RELEASE}-{m['name']}" for m in models_of(chart, VALUE_SETS[name])}
    for kind in ("Deployment", "Service", "ConfigMap"):
        assert set(of_kind(docs, kind)) == expected, kind
    for deployment in of_kind(docs, "Deployment").values():
        assert volumes(deployment)["config"]["configMap"]["name"] == deployment["metadata"]["name"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_label_is_valid(rendered, name):
    def check(labels: dict) -> None:
        for key, value in labels.items():
            assert LABEL_KEY.fullmatch(key) and isinstance(value, str) and LABEL_VALUE.fullmatch(value), (key, value)

    for doc in rendered[name]:
        check(doc["metadata"].get("labels", {}))
        if doc["kind"] == "Deployment":
            check(pod_labels(doc))
            check(doc["spec"]["selector"]["matchLabels"])


def test_label_check_can_fail():
    assert not LABEL_VALUE.fullmatch("meta-llama/Llama-3.1-8B-Instruct")  # a slash
    assert not LABEL_VALUE.fullmatch("a" * 64)
    assert not LABEL_VALUE.fullmatch("-demo")
    assert not LABEL_KEY.fullmatch("llm-d.ai/")


# -- the container: command, config, probes, resources --------------------------------------------------
@pytest.mark.parametrize("name", VALUE_SETS)
def test_config_is_accepted_by_augurs_own_loader(rendered, name, tmp_path):
    """The ConfigMap's config.yaml, with the container's own arguments, is a valid ``augur serve``
    command line and EngineConfig."""
    configmaps = of_kind(rendered[name], "ConfigMap")
    for deployment in of_kind(rendered[name], "Deployment").values():
        c = container(deployment)
        assert c["command"] == ["augur", "serve"]
        assert c["args"][:6] == ["--config", CONFIG_PATH, "--host", "0.0.0.0", "--port", str(PORT)]
        assert mounts(deployment)[str(Path(CONFIG_PATH).parent)]["name"] == "config"
        data = yaml.safe_load(configmaps[deployment["metadata"]["name"]]["data"][Path(CONFIG_PATH).name])
        path = tmp_path / f"{deployment['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(data))
        args = serve_args(*[str(path) if a == CONFIG_PATH else a for a in c["args"]])
        for key, value in data.items():
            if key not in ("host", "port"):  # the command line's own values win
                assert getattr(args, key.replace("-", "_")) == value, key
        assert (args.host, args.port) == ("0.0.0.0", PORT)
        engine_config(args)  # raises on an invalid combination


def test_the_chart_runs_the_container_as_compose_does(rendered):
    (deployment,) = of_kind(rendered["defaults"], "Deployment").values()
    augur = SERVICES["augur"]
    assert container(deployment)["args"][: len(augur["command"])] == augur["command"]
    shm = volumes(deployment)[mounts(deployment)["/dev/shm"]["name"]]["emptyDir"]
    assert augur["shm_size"] == "1gb" and shm == {"medium": "Memory", "sizeLimit": "1Gi"}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_probes_get_health_on_the_container_port(rendered, name):
    healthcheck = dict(DOCKERFILE)["HEALTHCHECK"]
    start_period_s = 60 * int(re.search(r"--start-period=(\d+)m", healthcheck).group(1))
    for deployment in of_kind(rendered[name], "Deployment").values():
        c = container(deployment)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"http": PORT}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health" and ports.get(get["port"], get["port"]) == PORT, probe
        startup = c["startupProbe"]
        allowance_s = startup["periodSeconds"] * startup["failureThreshold"]
        if deployment["metadata"]["name"] != f"{RELEASE}-small":  # the override shortens it on purpose
            # At least the image's own start period: the first demo start builds the pair.
            assert allowance_s >= start_period_s


def test_gpu_limits(rendered):
    def gpus(docs: list[dict]) -> dict[str, object]:
        return {
            name: container(d)["resources"].get("limits", {}).get("nvidia.com/gpu")
            for name, d in of_kind(docs, "Deployment").items()
        }

    assert gpus(rendered["defaults"]) == {"augur-demo": 1}
    assert set(gpus(rendered["two-models"]).values()) == {1}
    assert gpus(rendered["cpu"]) == {"augur-demo": None}  # no GPU at all
    cpu = container(of_kind(rendered["cpu"], "Deployment")["augur-demo"])
    assert cpu["image"] == "augur:cpu" and "nvidia.com/gpu" not in cpu["resources"].get("requests", {})
    assert gpus(rendered["overrides"]) == {"augur-big": 2, "augur-small": None}  # 0 overrides the default 1


def test_gpu_resource_name_and_scheduling_pass_through(chart):
    values = {
        "gpuResource": "amd.com/gpu",
        "nodeSelector": {"gpu": "mi300x"},
        "tolerations": [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {}},
    }
    (deployment,) = of_kind(render(chart, values), "Deployment").values()
    spec = deployment["spec"]["template"]["spec"]
    assert container(deployment)["resources"]["limits"]["amd.com/gpu"] == 1
    assert "nvidia.com/gpu" not in container(deployment)["resources"]["limits"]
    assert (spec["nodeSelector"], spec["tolerations"], spec["affinity"]) == (
        values["nodeSelector"],
        values["tolerations"],
        values["affinity"],
    )


def test_defaults(rendered):
    docs = rendered["defaults"]
    (deployment,) = of_kind(docs, "Deployment").values()
    c = container(deployment)
    assert deployment["spec"]["replicas"] == 1
    assert (c["image"], c["imagePullPolicy"]) == ("augur:latest", "IfNotPresent")  # `docker build -t augur .`
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no extra GPU for a rollout
    assert not any(e["name"] in ("AUGUR_API_KEY", "HF_TOKEN") for e in c["env"])
    assert not of_kind(docs, "ServiceMonitor")


def test_replicas_and_presets_of_two_models(rendered):
    deployments = of_kind(rendered["two-models"], "Deployment")
    assert {n: d["spec"]["replicas"] for n, d in deployments.items()} == {
        "augur-llama-3-1-8b": 2,
        "augur-qwen2-5-7b": 3,
    }
    configs = {
        n: yaml.safe_load(c["data"]["config.yaml"]) for n, c in of_kind(rendered["two-models"], "ConfigMap").items()
    }
    assert configs["augur-llama-3-1-8b"] == read_yaml(CONFIGS / "llama-3.1-8b-instruct.yaml")
    assert configs["augur-qwen2-5-7b"] == read_yaml(CONFIGS / "qwen2.5-7b-instruct.yaml")
    claims = set(of_kind(rendered["two-models"], "PersistentVolumeClaim"))
    assert claims == {"augur-llama-3-1-8b-cache", "augur-qwen2-5-7b-cache"}  # a cache per model


def test_object_names_follow_the_release(chart):
    docs = render(chart, release="prod")
    (deployment,) = of_kind(docs, "Deployment").values()
    assert deployment["metadata"]["name"] == "prod-augur-demo"
    assert set(of_kind(docs, "PersistentVolumeClaim")) == {"prod-augur-demo-cache"}
    assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "prod"


def test_volumes_and_mounts(rendered):
    (deployment,) = of_kind(rendered["defaults"], "Deployment").values()
    m, v = mounts(deployment), volumes(deployment)
    assert m["/models"]["readOnly"] is True and not m["/cache"].get("readOnly", False)
    assert v[m["/models"]["name"]] == {"name": "models", "emptyDir": {}}
    claim = v[m["/cache"]["name"]]["persistentVolumeClaim"]["claimName"]
    pvcs = of_kind(rendered["defaults"], "PersistentVolumeClaim")
    assert set(pvcs) == {claim} == {"augur-demo-cache"}
    assert pvcs[claim]["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert "storageClassName" not in pvcs[claim]["spec"]  # the cluster's default class
    # The image's user owns the volumes; AUGUR_HOME and HF_HOME are under the cache, as in the image.
    assert deployment["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 1000
    assert re.search(r"\bAUGUR_UID=1000\b", " ".join(a for w, a in DOCKERFILE if w == "ARG"))
    env = {e["name"]: e.get("value") for e in container(deployment)["env"]}
    image_env = " ".join(a for w, a in DOCKERFILE if w == "ENV")
    for key in ("AUGUR_HOME", "HF_HOME"):
        assert env[key].startswith("/cache/") and f"{key}={env[key]}" in image_env

    (deployment,) = of_kind(rendered["hostpath"], "Deployment").values()
    v = volumes(deployment)
    assert v["models"]["hostPath"] == {"path": "/srv/models", "type": "Directory"}
    assert v["cache"]["hostPath"]["path"] == "/srv/augur-cache"
    assert mounts(deployment)["/models"]["readOnly"] is True
    assert not of_kind(rendered["hostpath"], "PersistentVolumeClaim")

    deployments = of_kind(rendered["overrides"], "Deployment")
    assert volumes(deployments["augur-big"])["cache"]["persistentVolumeClaim"]["claimName"] == "shared-cache"
    assert volumes(deployments["augur-small"])["cache"] == {"name": "cache", "emptyDir": {}}
    assert not of_kind(rendered["overrides"], "PersistentVolumeClaim")  # the existing claim is not created


def test_per_model_overrides_merge_with_the_defaults(rendered):
    small = of_kind(rendered["overrides"], "Deployment")["augur-small"]
    assert small["spec"]["replicas"] == 0
    startup = container(small)["startupProbe"]
    assert startup["failureThreshold"] == 30 and startup["periodSeconds"] == 10  # the rest stays
    assert pod_labels(small)["llm-d.ai/guide"] == "augur"


def test_api_key_and_hf_token_from_secrets(rendered):
    (deployment,) = of_kind(rendered["api-key"], "Deployment").values()
    env = {e["name"]: e for e in container(deployment)["env"]}
    assert env["AUGUR_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "augur-api-key", "key": "api-key"}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert 'os.environ.get("AUGUR_API_KEY")' in (ROOT / "server" / "cli.py").read_text()


# -- Prometheus and llm-d -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", VALUE_SETS)
def test_scrape_annotations(rendered, name):
    for deployment in of_kind(rendered[name], "Deployment").values():
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(container(deployment)["ports"][0]["containerPort"])
        assert annotations["prometheus.io/path"] == "/metrics"


def test_service_monitor(rendered):
    docs = rendered["servicemonitor"]
    (monitor,) = of_kind(docs, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+[smh]", endpoint["interval"])
    selector = monitor["spec"]["selector"]["matchLabels"]
    for service in of_kind(docs, "Service").values():
        assert selector.items() <= service["metadata"]["labels"].items()
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_llmd_labels_and_selectors_match_the_pods(rendered, name):
    docs = rendered[name]
    deployments, services = of_kind(docs, "Deployment"), of_kind(docs, "Service")
    for deployment_name, deployment in deployments.items():
        labels = pod_labels(deployment)
        assert labels["llm-d.ai/inferenceServing"] == labels["llm-d.ai/inference-serving"] == "true"
        assert labels["llm-d.ai/engine-type"] == labels["inference.networking.k8s.io/engine-type"] == "augur"
        assert labels["llm-d.ai/model"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        service = services[deployment_name]
        assert service["spec"]["ports"] == [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}]
        for other_name, other in deployments.items():  # each Service selects its own model's pods only
            selected = service["spec"]["selector"].items() <= pod_labels(other).items()
            assert selected == (other_name == deployment_name)


def test_llmd_model_label_is_the_served_name_made_a_label_value(chart, rendered):
    def model_labels(docs):
        return {n: pod_labels(d)["llm-d.ai/model"] for n, d in of_kind(docs, "Deployment").items()}

    assert model_labels(rendered["defaults"]) == {"augur-demo": "augur-demo"}
    assert model_labels(rendered["two-models"]) == {
        "augur-llama-3-1-8b": "meta-llama-Llama-3.1-8B-Instruct",
        "augur-qwen2-5-7b": "Qwen-Qwen2.5-7B-Instruct",
    }
    assert model_labels(rendered["overrides"])["augur-big"] == "my-llama"  # as `augur serve` names it
    long_name = "org/" + "x" * 80
    values = {"models": [{"name": "a", "config": {"served-model-name": long_name}}, {"name": "b", "modelLabel": "_B_"}]}
    labels = model_labels(render(chart, values))
    assert labels["augur-a"] == ("org-" + "x" * 80)[:63] and labels["augur-b"] == "B"
    values = {"llmd": {"enabled": False}}
    labels = pod_labels(of_kind(render(chart, values), "Deployment")["augur-demo"])
    assert not any(k.startswith(("llm-d.ai/", "inference.networking.k8s.io/")) for k in labels)


def test_llmd_metric_names_in_the_docs_are_exported(chart):
    """docs/kubernetes.md tells llm-d's endpoint picker which of Augur's metrics to read; they exist."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "core-metrics-extractor" in b)
    plugins = yaml.safe_load(block)["plugins"]
    (extractor,) = [p for p in plugins if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    assert engine["name"] == chart.values["llmd"]["engineType"]
    specs = [v for k, v in engine.items() if k.endswith("Spec")]
    assert len(specs) == 3 and set(specs) <= exported_samples()


# -- the example values files and the plain manifest ------------------------------------------------------
def test_every_example_values_file_mirrors_its_preset():
    assert set(PRESET_VALUES) == {
        "llama-3.1-8b-instruct",
        "llama-3.1-70b-instruct",
        "qwen2.5-7b-instruct",
        "gemma-2-9b-it",
    }
    for preset, path in PRESET_VALUES.items():
        (entry,) = read_yaml(path)["models"]
        assert entry["config"] == read_yaml(CONFIGS / f"{preset}.yaml"), f"{path.name} differs from the preset"
    (demo,) = read_yaml(CHART_DIR / "values.yaml")["models"]
    assert demo["config"] == read_yaml(CONFIGS / "demo.yaml"), "values.yaml's demo differs from configs/demo.yaml"


@pytest.mark.parametrize("preset", PRESET_VALUES)
def test_preset_renders_to_its_config_file(rendered, preset):
    (configmap,) = of_kind(rendered[f"preset-{preset}"], "ConfigMap").values()
    assert yaml.safe_load(configmap["data"]["config.yaml"]) == read_yaml(CONFIGS / f"{preset}.yaml")


# -- several hosts: a LeaderWorkerSet group a replica ----------------------------------------------------
MULTI_HOST = {
    "storage": {
        "models": {"type": "hostPath", "hostPath": {"path": "/srv/models"}},
        "cache": {"type": "hostPath", "hostPath": {"path": "/srv/augur-cache"}},
    },
    "models": [
        {
            "name": "big",
            "nodes": 2,
            "gpus": 8,
            "replicas": 2,
            "config": {"model": "/models/llama-70b", "tensor-parallel-size": 16},
        }
    ],
}


def _as_deployment(name: str, template: dict) -> dict:
    """A LeaderWorkerSet's pod template inside a Deployment: the shape kubernetes_validate has a schema for."""
    labels = template["metadata"]["labels"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": labels}, "template": template},
    }


def test_a_model_over_several_nodes_is_a_leader_worker_set(chart, tmp_path):
    """``nodes: 2``: one LeaderWorkerSet (no Deployment) whose leader serves HTTP with rank 0 and whose
    workers run headless; the Service reaches the leaders only; both pod templates are valid pods, and
    the leader's and a worker's arguments (LWS's variables filled in) are valid ``augur serve`` lines
    that put them on ranks 0-7 and 8-15 of 16, meeting at the leader."""
    docs = render(chart, MULTI_HOST)
    assert not of_kind(docs, "Deployment")
    (lws,) = of_kind(docs, "LeaderWorkerSet").values()
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 2
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    for role, template in (("leader", leader), ("worker", worker)):
        kubernetes_validate.validate(_as_deployment(f"big-{role}", template), KUBE_VERSION, strict=True)
        (c,) = template["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    lead, work = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    assert lead["ports"] == [{"name": "http", "containerPort": PORT, "protocol": "TCP"}]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(lead)
    assert "ports" not in work and not {"startupProbe", "readinessProbe", "livenessProbe"} & set(work)
    (service,) = of_kind(docs, "Service").values()
    selector = service["spec"]["selector"].items()
    assert selector <= leader["metadata"]["labels"].items()
    assert not selector <= worker["metadata"]["labels"].items()
    config = tmp_path / "config.yaml"
    config.write_text(of_kind(docs, "ConfigMap")["augur-big"]["data"]["config.yaml"])
    lws_env = {"$(LWS_GROUP_SIZE)": "2", "$(LWS_LEADER_ADDRESS)": "augur-big-0.augur-big"}
    for c, index in ((lead, "0"), (work, "1")):
        env = {**lws_env, "$(LWS_WORKER_INDEX)": index}
        argv = [str(config) if a == CONFIG_PATH else env.get(a, a) for a in c["args"]]
        cfg = engine_config(serve_args(*argv))
        assert (cfg.tensor_parallel_size, cfg.nnodes, cfg.node_rank) == (16, 2, int(index))
        assert (cfg.master_addr, cfg.master_port) == ("augur-big-0.augur-big", 29500)


def test_nodes_times_gpus_must_be_the_tensor_parallel_size(chart):
    values = copy.deepcopy(MULTI_HOST)
    values["models"][0]["config"]["tensor-parallel-size"] = 8
    why = "nodes 2 x gpus 8 is 16 GPUs a replica, but its config's tensor-parallel-size is 8"
    with pytest.raises(Exception, match=why):
        render(chart, values)


KIND_ORDER = ["ConfigMap", "PersistentVolumeClaim", "Service", "Deployment", "ServiceMonitor"]
HEADER = f"""\
# Augur for `kubectl apply -f` without Helm: the chart configs/deploy/helm/augur rendered with its default
# values as release `{RELEASE}` (the demo model on one GPU, a 100Gi cache claim from the default StorageClass).
# Generated, do not edit: change the chart, then run  {REGENERATE}
# (tests/test_kubernetes.py checks that this file is the chart's current rendering). See docs/kubernetes.md.
"""


class BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's config file) as literal blocks, as a person would write them."""


BlockDumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def plain_manifest(chart) -> str:
    docs = sorted(render(chart), key=lambda d: (KIND_ORDER.index(d["kind"]), d["metadata"]["name"]))
    return HEADER + "".join("---\n" + yaml.dump(d, Dumper=BlockDumper, sort_keys=False) for d in docs)


def test_plain_manifest_is_the_current_rendering(chart):
    text = PLAIN.read_text()
    assert text.startswith(HEADER), f"the header changed; regenerate: {REGENERATE}"
    expected = [d for d in yaml.safe_load_all(plain_manifest(chart)) if d]
    assert [d for d in yaml.safe_load_all(text) if d] == expected, (
        f"{PLAIN.relative_to(ROOT)} is not the chart's current rendering; regenerate: {REGENERATE}"
    )


def test_chart_app_version_is_augurs():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert str(read_yaml(CHART_DIR / "Chart.yaml")["appVersion"]) == version


# -- helm lint, and the checks failing on broken input ----------------------------------------------------
@pytest.mark.parametrize("name", ["defaults", "two-models", "servicemonitor"])
def test_helm_lint_passes(name):
    report = helm.lint(CHART_DIR, VALUE_SETS[name], strict=True, kube_version=f"v{KUBE_VERSION}.0")
    assert not report["errors"], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]  # no warning or error


def test_helm_lint_can_fail(tmp_path):
    broken = tmp_path / "augur"
    shutil.copytree(CHART_DIR, broken)
    chart_yaml = read_yaml(broken / "Chart.yaml")
    del chart_yaml["version"]
    (broken / "Chart.yaml").write_text(yaml.safe_dump(chart_yaml))
    report = helm.lint(broken)
    assert any(m["severity"] == 3 for m in report["messages"]) or report["errors"]


def test_kubernetes_validate_can_fail(rendered):
    (deployment,) = of_kind(rendered["defaults"], "Deployment").values()
    kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)
    port_as_string = copy.deepcopy(deployment)
    container(port_as_string)["ports"][0]["containerPort"] = str(PORT)
    unknown_field = copy.deepcopy(deployment)
    container(unknown_field)["readinessProbe"]["httpGets"] = {"path": "/health"}
    no_containers = copy.deepcopy(deployment)
    del no_containers["spec"]["template"]["spec"]["containers"]
    for broken in (port_as_string, unknown_field, no_containers):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


def test_helm_render_can_fail(tmp_path):
    broken = tmp_path / "augur"
    shutil.copytree(CHART_DIR, broken)
    (broken / "templates" / "broken.yaml").write_text('{{ include "augur.no-such-template" . }}\n')
    with helm.Chart.load(broken) as c, pytest.raises(helm.HelmRenderError, match="no-such-template"):
        c.render({}, name=RELEASE)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"gpu": 0}, "gpu"),  # a misspelt key: the schema allows none it does not know
        ({"models": [{"name": "demo", "replica": 2}]}, "replica"),
        ({"models": [{"name": "Llama-8B"}]}, "pattern"),
        ({"gpus": -1}, "minimum"),
        ({"storage": {"cache": {"type": "nfs"}}}, "must be one of"),
    ],
)
def test_values_schema_rejects_bad_values(chart, values, message):
    with pytest.raises(helm.HelmValuesError, match=message):
        render(chart, values)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"models": [{"name": "a"}, {"name": "a"}]}, "used twice"),
        ({"storage": {"cache": {"type": "hostPath"}}}, "hostPath.path is required"),
        ({"models": [{"name": "m" + "x" * 49}], "fullnameOverride": "y" * 20}, "longer than"),
    ],
)
def test_templates_reject_bad_values_with_a_message(chart, values, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        render(chart, values)


if __name__ == "__main__":
    with helm.Chart.load(CHART_DIR) as c:
        PLAIN.write_text(plain_manifest(c))
    print(f"wrote {PLAIN.relative_to(ROOT)}")
