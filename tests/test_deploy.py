"""The deployment files agree with the code they deploy.

- every preset in ``configs/*.yaml`` is a valid ``augur serve --config`` file and a valid EngineConfig;
- the Docker image installs Augur with the Makefile's ``install`` target, the step behind the README's
  ``make serve`` / ``make test``;
- docker-compose.yml, Prometheus, nginx and Grafana are wired to each other and to Augur's /metrics;
- every metric the Grafana dashboard queries is one that server/metrics.py exports.

Each check is a small parser plus an assertion; the ``*_can_fail`` tests feed the parsers a broken input.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import yaml

from engine.config import EngineConfig
from server.cli import apply_config_file, build_parser

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
DEPLOY = CONFIGS / "deploy"
PRESETS = sorted(CONFIGS.glob("*.yaml"))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "augur.json"


# -- presets -------------------------------------------------------------------------------------------
def serve_args(*argv: str) -> Namespace:
    return apply_config_file(build_parser(), ["serve", *argv])


def engine_config(args: Namespace) -> EngineConfig:
    """EngineConfig from the flags as ``engine_config_from_args`` builds it, with placeholders for the demo
    pair instead of building it (validation only; nothing is loaded)."""
    fields = set(EngineConfig.field_names())
    values = {k: v for k, v in vars(args).items() if k in fields}
    if not values.get("model"):
        values["model"] = "placeholder/demo-target"
        if values.get("speculative_method") != "none" and not values.get("draft_model"):
            values["draft_model"] = "placeholder/demo-draft"
    return EngineConfig(**values)


def test_the_presets_are_there():
    names = {p.name for p in PRESETS}
    assert {"demo.yaml", "llama-3.1-8b-instruct.yaml", "qwen2.5-7b-instruct.yaml", "gemma-2-9b-it.yaml"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_parses_and_validates(path):
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict) and data, f"{path.name} is not a mapping of flags"
    args = serve_args("--config", str(path))  # an unknown key or a bad choice exits here
    for key, value in data.items():  # every key landed on its flag, with its value
        assert getattr(args, key.replace("-", "_")) == value, key
    config = engine_config(args)
    assert config.speculative_method == data.get("speculative-method", config.speculative_method)


@pytest.mark.parametrize(
    "name, model, draft",
    [
        ("demo.yaml", None, None),
        ("llama-3.1-8b-instruct.yaml", "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
        ("qwen2.5-7b-instruct.yaml", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("gemma-2-9b-it.yaml", "google/gemma-2-9b-it", "google/gemma-2-2b-it"),
        ("llama-3.1-70b-instruct.yaml", "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    ],
)
def test_preset_models(name, model, draft):
    args = serve_args("--config", str(CONFIGS / name))
    method = "auto" if name == "demo.yaml" else "draft"  # the demo: its draft beside the lookups
    assert (args.model, args.draft_model, args.speculative_method) == (model, draft, method)
    if model is None:  # the demo pair, reachable from outside a container
        assert (args.host, args.port) == ("0.0.0.0", 8000)
    else:
        assert args.dtype == "bfloat16"


def test_gemma_preset_runs_on_the_gemma2_family():
    """The Gemma-2 preset's model family is registered, and the preset no longer warns that it fails."""
    from engine.models import model_class_for
    from engine.models.gemma2 import Gemma2ForCausalLM

    assert model_class_for(Namespace(architectures=["Gemma2ForCausalLM"])) is Gemma2ForCausalLM
    assert "fails at start" not in (CONFIGS / "gemma-2-9b-it.yaml").read_text()


def test_command_line_overrides_the_file():
    args = serve_args("--config", str(CONFIGS / "demo.yaml"), "--port", "9999", "--max-num-seqs", "3")
    assert (args.port, args.max_num_seqs) == (9999, 3)
    assert args.host == "0.0.0.0"  # from the file: the default is 127.0.0.1
    args = serve_args("--port", "9999", "--config", str(CONFIGS / "demo.yaml"))  # order does not matter
    assert args.port == 9999


def test_bare_on_and_off_in_a_file_are_the_flags_values(tmp_path):
    """YAML reads a bare ``on`` / ``off`` as a boolean; for an on/off flag it means the word."""
    path = tmp_path / "switches.yaml"
    path.write_text("engine-process: off\ncompile: on\n")
    args = serve_args("--config", str(path))
    assert (args.engine_process, args.compile) == ("off", "on")


def test_unknown_key_is_an_error_that_names_it(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("max-num-seqs: 8\nnum-gpu-blocks: 4\n")
    with pytest.raises(SystemExit) as e:
        serve_args("--config", str(path))
    assert e.value.code == 2
    assert "num-gpu-blocks" in capsys.readouterr().err


def test_preset_validation_can_fail(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: some/model\nkv-cache-memory-fraction: 1.5\n")
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        engine_config(serve_args("--config", str(path)))


# -- Dockerfile, Makefile, README ----------------------------------------------------------------------
def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        current = ""
    return out


def make_rules(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """target -> (prerequisites, recipe lines), for the plain ``target: deps`` rules of a Makefile.
    Conditionals (``ifeq``, ``ifneq``, ``else``, ``endif``…) inside a recipe do not end it."""
    rules: dict[str, tuple[list[str], list[str]]] = {}
    target = None
    for line in text.splitlines():
        if line.startswith("\t") and target is not None:
            rules[target][1].append(line.strip())
            continue
        if re.match(r"^(ifn?eq|ifn?def|else|endif)\b", line):
            continue
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*:(?!=)(.*)$", line)
        target = None
        if m and not m.group(1).startswith("."):
            target = m.group(1)
            rules[target] = (m.group(2).split(), [])
    return rules


def install_runs(instructions: list[tuple[str, str]]) -> list[str]:
    return [args for word, args in instructions if word == "RUN" and re.search(r"\bmake\b.*\binstall\b", args)]


DOCKERFILE = dockerfile_instructions((ROOT / "Dockerfile").read_text())
MAKE_RULES = make_rules((ROOT / "Makefile").read_text())


def test_docker_installs_with_the_makefile_install_target():
    runs = install_runs(DOCKERFILE)
    assert len(runs) == 1, f"expected one `make install` RUN line, found {runs}"
    argv = shlex.split(runs[0])
    assert argv[:2] == ["make", "install"] and "VENV=none" in argv
    # No second way in: the image installs nothing with pip itself (the base image's torch stays).
    assert not [a for w, a in DOCKERFILE if w == "RUN" and "pip install" in a]
    # `make install` runs `install-now` (always in the image, VENV=none; in a virtualenv when its stamp is stale).
    assert "install" in MAKE_RULES and any("pip install" in line for line in MAKE_RULES["install-now"][1])
    dry = subprocess.run(["make", "-n", "install", "VENV=none"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "pip install" in dry.stdout


def test_readme_commands_depend_on_the_same_install_target():
    readme = (ROOT / "README.md").read_text()
    for target in ("serve", "test"):
        assert f"make {target}" in readme
        assert "install" in MAKE_RULES[target][0], f"`make {target}` does not run `make install`"


def test_install_parsers_can_fail():
    assert install_runs(dockerfile_instructions("FROM x\nRUN pip install \\\n  -e .\n")) == []
    assert make_rules("test: lint\n\tpytest\nX := y\n") == {"test": (["lint"], ["pytest"])}
    assert make_rules("a:\nifeq (x,y)\n\tone\nendif\n\ttwo\n") == {"a": ([], ["one", "two"])}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_docker_extras_give_pip_a_valid_requirement():
    """The image's EXTRAS reach ``pip install -e .[EXTRAS]``: an empty value gives ``.[]``, which pip rejects."""
    args = dict(a.partition("=")[::2] for w, a in DOCKERFILE if w == "ARG")
    run = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], ""), install_runs(DOCKERFILE)[0]))
    dry = subprocess.run(["make", "-n", *run[1:]], cwd=ROOT, capture_output=True, text=True, check=True)
    assert re.search(r"pip install .*-e \"?\.(\[\w[\w,]*\])?\"?$", dry.stdout, re.M), dry.stdout
    assert ".[]" not in dry.stdout


def make_variable(name: str) -> str:
    m = re.search(rf"^{name}\s*[:?]?=\s*(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"the Makefile sets no {name}"
    return m.group(1).strip()


def test_docker_image_torch_is_the_one_the_tests_run():
    """The base image brings no torch of its own (a pytorch/pytorch base brought 2.6 while everything
    was tested on 2.13): the torch in the image is the Makefile's pin, from the index TORCH_INDEX_URL names."""
    base = next(a for w, a in DOCKERFILE if w == "ARG" and a.startswith("BASE_IMAGE=")).partition("=")[2]
    assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", base), base
    assert re.fullmatch(r"\d+\.\d+\.\d+", make_variable("TORCH_VERSION"))
    run = shlex.split(install_runs(DOCKERFILE)[0])
    assert "TORCH_INDEX_URL=${TORCH_INDEX_URL}" in run
    install = " ".join(MAKE_RULES["install-now"][1])
    assert '"torch==$(TORCH_VERSION)"' in install and "--index-url $(TORCH_INDEX_URL)" in install


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_torch_index_reaches_only_the_torch_install():
    dry = subprocess.run(
        ["make", "-n", "install", "VENV=none", "TORCH_INDEX_URL=https://example.invalid/whl/cu126"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    torch_line = next(line for line in dry.splitlines() if "torch==" in line)
    assert f'"torch=={make_variable("TORCH_VERSION")}" --index-url https://example.invalid/whl/cu126' in torch_line
    assert [line for line in dry.splitlines() if "index-url" in line] == [torch_line]


def test_tests_run_on_the_pinned_torch():
    import torch

    pinned = make_variable("TORCH_VERSION")
    if torch.__version__.split("+")[0] != pinned:
        pytest.skip(f"this environment has torch {torch.__version__}; the image and CI install {pinned}")
    assert torch.__version__.startswith(pinned)


def test_dockerfile_runs_the_server_as_a_service():
    words = {w for w, _ in DOCKERFILE}
    args = dict(DOCKERFILE)
    assert json.loads(args["ENTRYPOINT"]) == ["augur", "serve"]
    assert json.loads(args["CMD"]) == ["--host", "0.0.0.0", "--port", "8000"]
    assert json.loads(args["VOLUME"]) == ["/models", "/cache"]
    assert args["USER"] == "augur" and args["EXPOSE"] == "8000"
    assert "HEALTHCHECK" in words and "http://127.0.0.1:8000/health" in args["HEALTHCHECK"]
    env = " ".join(a for w, a in DOCKERFILE if w == "ENV")
    assert "AUGUR_HOME=/cache/augur" in env and "HF_HOME=/cache/huggingface" in env


# -- docker compose, Prometheus, nginx, Grafana ---------------------------------------------------------
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
REPLICAS = sorted(n for n, s in SERVICES.items() if re.fullmatch(r"augur-\d+", n))


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with VAR unset."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def mounts(service: dict) -> dict[str, str]:
    """container path -> host path (or volume name), defaults interpolated."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = interpolate(spec).split(":")[:2]
        out[target] = source
    return out


def gpu_devices(service: dict) -> list[dict]:
    return service["deploy"]["resources"]["reservations"]["devices"]


def nginx_upstreams(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """upstream name -> (server addresses, other directives)."""
    text = re.sub(r"#[^\n]*", "", text)
    out = {}
    for name, body in re.findall(r"\bupstream\s+(\S+)\s*\{([^}]*)\}", text):
        directives = [d.strip() for d in body.split(";") if d.strip()]
        servers = [d.split()[1] for d in directives if d.split()[0] == "server"]
        out[name] = (servers, [d for d in directives if d.split()[0] != "server"])
    return out


def test_compose_services_and_gpu():
    assert {"augur", "prometheus", "grafana"} <= set(SERVICES)
    augur = SERVICES["augur"]
    assert "profiles" not in augur  # the single server is the default
    assert augur["build"]["dockerfile"] == "Dockerfile"
    (gpu,) = gpu_devices(augur)
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert "8000" in " ".join(map(str, augur["ports"]))
    m = mounts(augur)
    assert "/models" in m and "/cache" in m
    assert m["/etc/augur/config.yaml"] == "./configs/demo.yaml"
    assert augur["command"][:2] == ["--config", "/etc/augur/config.yaml"]


def test_compose_bind_mounts_exist():
    for name, service in SERVICES.items():
        for target, source in mounts(service).items():
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source} (mounted at {target}) is missing"
            else:
                assert source in COMPOSE.get("volumes", {}), f"{name}: volume {source} is not declared"


def test_replicas_profile_one_gpu_each_behind_nginx_least_conn():
    assert len(REPLICAS) >= 2
    gpus = []
    for name in REPLICAS:
        service = SERVICES[name]
        assert service["profiles"] == ["replicas"]
        (gpu,) = gpu_devices(service)
        assert gpu["driver"] == "nvidia" and len(gpu["device_ids"]) == 1
        gpus += gpu["device_ids"]
        assert service["command"] == SERVICES["augur"]["command"]
    assert len(set(gpus)) == len(gpus), f"replicas share a GPU: {gpus}"

    nginx = SERVICES["nginx"]
    assert nginx["profiles"] == ["replicas"] and nginx["image"].startswith("nginx")
    conf_path = mounts(nginx)["/etc/nginx/nginx.conf"]
    conf = (ROOT / conf_path).read_text()
    (servers, directives) = nginx_upstreams(conf)["augur"]
    assert "least_conn" in directives
    assert sorted(s.split(":")[0] for s in servers) == REPLICAS
    assert re.search(r"proxy_pass\s+http://augur\s*;", conf)
    assert re.search(r"proxy_buffering\s+off\s*;", conf)  # SSE chunks go out as they come
    read_timeout = re.search(r"proxy_read_timeout\s+(\d+)s\s*;", conf)
    assert read_timeout and int(read_timeout.group(1)) >= 600


def test_sharded_profile_gives_one_server_every_gpu_and_a_sharding_preset():
    """The `sharded` profile: one server over all the host's GPUs, the same command as the single server,
    its default config a preset whose tensor-parallel size the model's heads and vocabulary allow."""
    import transformers

    from engine.models import model_class_for
    from engine.parallel import TensorParallel

    service = SERVICES["augur-sharded"]
    assert service["profiles"] == ["sharded"]
    (gpu,) = gpu_devices(service)
    assert gpu["driver"] == "nvidia" and gpu["count"] == "all" and "gpu" in gpu["capabilities"]
    assert service["command"] == SERVICES["augur"]["command"]
    assert "8000" in " ".join(map(str, service["ports"]))
    m = mounts(service)
    assert "/models" in m and "/cache" in m
    args = serve_args("--config", str(ROOT / m["/etc/augur/config.yaml"]))
    config = engine_config(args)
    assert config.tensor_parallel_size > 1 and config.draft_tensor_parallel_size == 1
    # Llama 3.1 70B's shapes (its config.json; one layer of its 80), built on the meta device at that size:
    # a size that did not divide its heads, KV heads, MLP or vocabulary would raise here.
    shapes = transformers.LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=1, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    with torch.device("meta"):
        for rank in range(config.tensor_parallel_size):
            model_class_for(shapes)(shapes, 16, tp=TensorParallel(rank, config.tensor_parallel_size))
    with pytest.raises(ValueError, match="does not divide"), torch.device("meta"):  # (the check can fail)
        model_class_for(shapes)(shapes, 16, tp=TensorParallel(0, 3))


def test_nginx_parser_can_fail():
    assert nginx_upstreams("upstream a { server x:1; }") == {"a": (["x:1"], [])}
    assert nginx_upstreams("upstream a { # least_conn;\n server x:1; }")["a"][1] == []


def prometheus_targets(config: dict) -> set[str]:
    """host:port/path of every static target."""
    return {
        f"{t}{job.get('metrics_path', '/metrics')}"
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for t in static["targets"]
    }


def test_prometheus_scrapes_every_augur_metrics_endpoint():
    prometheus = SERVICES["prometheus"]
    config = yaml.safe_load((ROOT / mounts(prometheus)["/etc/prometheus/prometheus.yml"]).read_text())
    targets = prometheus_targets(config)
    for name in ["augur", *REPLICAS, "augur-sharded"]:
        assert f"{name}:8000/metrics" in targets, f"Prometheus does not scrape {name}"
    assert prometheus_targets({"scrape_configs": [{"static_configs": [{"targets": ["x:1"]}]}]}) == {"x:1/metrics"}


def test_grafana_provisions_the_prometheus_datasource_and_dashboard():
    m = mounts(SERVICES["grafana"])
    provisioning = ROOT / m["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "augur.yml").read_text())["providers"]
    dashboards_dir = provider["options"]["path"]
    assert (ROOT / m[dashboards_dir] / DASHBOARD.name).samefile(DASHBOARD)
    panels = json.loads(DASHBOARD.read_text())["panels"]
    sources = [p["datasource"] for p in panels if "datasource" in p]
    sources += [t["datasource"] for p in panels for t in p.get("targets", []) if "datasource" in t]
    assert sources and {s["uid"] for s in sources} == {datasource["uid"]}


# -- the Grafana dashboard ------------------------------------------------------------------------------
SUFFIXES = ("_bucket", "_total", "_sum", "_count")
METRICS_SOURCE = (ROOT / "server" / "metrics.py").read_text()


def dashboard_metrics(text: str) -> set[str]:
    return set(re.findall(r"augur_[a-z_]+", text))


def base_name(metric: str) -> str:
    for suffix in SUFFIXES:
        if metric.endswith(suffix):
            return metric[: -len(suffix)]
    return metric


def unknown_metrics(names: set[str]) -> set[str]:
    """Names whose base is not declared in server/metrics.py (as a quoted metric name)."""
    return {n for n in names if f'"{base_name(n)}"' not in METRICS_SOURCE}


def exported_samples() -> set[str]:
    """Every sample name the server's registry can export: counters as ``_total``, histograms as
    ``_bucket``/``_sum``/``_count``, gauges by their name."""
    from server.metrics import Metrics

    out = set()
    for family in Metrics("m").registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        out |= {family.name + s for s in suffixes}
    return out


def test_dashboard_is_valid_json_with_the_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    joined = " ".join(exprs)
    for metric in (
        "augur_spec_decode_acceptance_rate",
        "augur_spec_decode_mean_acceptance_length",
        "augur_generation_tokens_per_second",
        "rate(augur_generation_tokens_total",
        "augur_num_requests_running",
        "augur_num_requests_waiting",
        "augur_kv_cache_usage_ratio",
    ):
        assert metric in joined, metric
    for histogram in ("augur_time_to_first_token_seconds_bucket", "augur_inter_token_latency_seconds_bucket"):
        for q in ("0.5", "0.9", "0.99"):
            pattern = rf"^histogram_quantile\({q},.*\brate\({histogram}\b"
            assert any(re.search(pattern, e) for e in exprs), (histogram, q)


def test_dashboard_queries_only_metrics_the_server_exports():
    text = DASHBOARD.read_text()
    names = dashboard_metrics(text)
    assert names
    assert not unknown_metrics(names)
    exprs = " ".join(t["expr"] for p in json.loads(text)["panels"] for t in p.get("targets", []))
    assert dashboard_metrics(exprs) <= exported_samples()


def test_dashboard_metric_check_can_fail():
    names = dashboard_metrics('rate(augur_decode_steps_total[1m]) + augur_kv_cache_usage_ratio{m="x"}')
    assert unknown_metrics(names) == {"augur_decode_steps_total"}
    assert "augur_kv_cache_usage_ratio_total" not in exported_samples()
