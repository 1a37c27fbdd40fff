"""ops/k8s/cadence.yaml against cadence itself: its command line parses with the real CLI,
its probes hit real routes, its ports agree end to end, and the metric names the endpoint
picker is told to read are metrics cadence exports, of the type the EPP expects."""

from __future__ import annotations

import re

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from service.api.app import create_app
from service.api.metrics import Metrics
from service.cli import build_parser, config_from_args
from service.config import Config
from service.engine.engine import Engine
from tests.server_fixtures import REPO_ROOT
from tests.sim_worker import SimTokenizer, SimWorker

MANIFEST = REPO_ROOT / "ops" / "k8s" / "cadence.yaml"
EXPECTED = {
    ("apps/v1", "Deployment", "cadence"),
    ("v1", "Service", "cadence"),
    ("inference.networking.k8s.io/v1", "InferencePool", "cadence"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute", "cadence"),
    ("v1", "ConfigMap", "cadence-epp"),
    ("apps/v1", "Deployment", "cadence-epp"),
    ("v1", "Service", "cadence-epp"),
    ("v1", "ServiceAccount", "cadence-epp"),
    ("rbac.authorization.k8s.io/v1", "Role", "cadence-epp"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "cadence-epp"),
}


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    loaded = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    assert {(d["apiVersion"], d["kind"], d["metadata"]["name"]) for d in loaded} == EXPECTED
    return {(d["kind"], d["metadata"]["name"]): d for d in loaded}


def container(deployment: dict, name: str) -> dict:
    pod = deployment["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name)


def port_number(c: dict, port: int | str) -> int:
    """A container port by number or by name."""
    numbers = {p["name"]: p["containerPort"] for p in c["ports"]}
    return numbers[port] if isinstance(port, str) else port


def flag(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))


def cadence_config(docs: dict) -> Config:
    serve = container(docs["Deployment", "cadence"], "cadence")
    assert serve["command"] == ["cadence"] and serve["args"][0] == "serve"
    return config_from_args(build_parser().parse_args(serve["args"]))


def epp_config(docs: dict) -> dict:
    epp = container(docs["Deployment", "cadence-epp"], "epp")
    path = flag(epp["args"], "config-file")
    mount = next(m for m in epp["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(
        v for v in docs["Deployment", "cadence-epp"]["spec"]["template"]["spec"]["volumes"]
        if v["name"] == mount["name"]
    )  # fmt: skip
    config_map = docs["ConfigMap", volume["configMap"]["name"]]
    return yaml.safe_load(config_map["data"][path.removeprefix(mount["mountPath"] + "/")])


def test_the_serve_and_fetch_command_lines_parse_with_cadences_own_parser(docs: dict) -> None:
    config = cadence_config(docs)
    assert (config.host, config.port, config.device) == ("0.0.0.0", 8000, "cpu")
    fetch = container(docs["Deployment", "cadence"], "fetch-model")
    fetched = build_parser().parse_args(fetch["args"])
    assert fetched.command == "fetch-model" and fetched.cache_dir == config.cache_dir


def test_probes_ask_routes_cadence_serves_on_the_port_it_listens_on(docs: dict) -> None:
    engine = Engine(Config(), SimWorker(), SimTokenizer())
    app = create_app(Config(), engine, SimTokenizer(), "sim")  # type: ignore[arg-type]
    routes = {rule.rule for rule in app.url_map.iter_rules() if "GET" in rule.methods}
    serve = container(docs["Deployment", "cadence"], "cadence")
    probes = [serve[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")]
    for probe in probes:
        assert probe["httpGet"]["path"] in routes
        assert port_number(serve, probe["httpGet"]["port"]) == cadence_config(docs).port


def test_deployment_service_and_pool_agree_on_pods_and_ports(docs: dict) -> None:
    deployment, service = docs["Deployment", "cadence"], docs["Service", "cadence"]
    pool = docs["InferencePool", "cadence"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (deployment["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                     pool["selector"]["matchLabels"]):  # fmt: skip
        assert selector.items() <= labels.items()
    serve = container(deployment, "cadence")
    port = cadence_config(docs).port
    assert [port_number(serve, p["targetPort"]) for p in service["spec"]["ports"]] == [port]
    assert [p["number"] for p in pool["targetPorts"]] == [port]
    backend = docs["HTTPRoute", "cadence"]["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"]) == ("InferencePool", "cadence")


def test_the_pool_points_at_the_endpoint_picker_and_its_grpc_port(docs: dict) -> None:
    ref = docs["InferencePool", "cadence"]["spec"]["endpointPickerRef"]
    service = docs["Service", ref["name"]]
    epp_deployment = docs["Deployment", "cadence-epp"]
    assert service["spec"]["selector"].items() <= (
        epp_deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = container(epp_deployment, "epp")
    assert port_number(epp, port["targetPort"]) == int(flag(epp["args"], "grpc-port"))
    assert flag(epp["args"], "pool-name") == "cadence"
    account = epp_deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = docs["RoleBinding", "cadence-epp"]
    assert docs["ServiceAccount", account] and binding["subjects"][0]["name"] == account
    assert docs["Role", binding["roleRef"]["name"]]


def test_the_epp_flags_for_metric_names_are_not_used(docs: dict) -> None:
    """EPPs since GAIE v1.4.0 (and llm-d-router's) refuse to start with them."""
    args = container(docs["Deployment", "cadence-epp"], "epp")["args"]
    assert not [a for a in args if a.split("=")[0].endswith("-metric")]


def test_the_epp_reads_metrics_cadence_exports_with_the_types_it_expects(docs: dict) -> None:
    config = epp_config(docs)
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    params = extractor["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    pod_labels = docs["Deployment", "cadence"]["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["llm-d.ai/engine-type"] == engine["name"]

    metrics = Metrics()
    state = {"kv_blocks_total": 10, "kv_cache": {"block_size": 16, "num_blocks": 10,
                                                  "dtype": "bfloat16"}}  # fmt: skip
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(state).decode())}
    gauges = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec")
    for field in gauges:
        name = re.sub(r"\{.*\}$", "", engine[field])
        assert families[name].type == "gauge", field
    assert engine["loraSpec"] == ""  # cadence serves no LoRA adapters
    (info,) = families[engine["cacheInfoSpec"]].samples
    assert {"block_size", "num_gpu_blocks"} <= info.labels.keys()  # the EPP's label names

    (source,) = config["dataLayer"]["sources"]
    assert source["extractors"] == [{"pluginRef": "core-metrics-extractor"}]
    scrape = next(p for p in config["plugins"] if p["type"] == source["pluginRef"])
    assert scrape["parameters"]["path"] == "/metrics"
