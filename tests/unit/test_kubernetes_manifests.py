"""deploy/kubernetes: every core manifest passes `kubernetes-validate --strict`, and so does what kustomize
renders of the base and the overlays (where kustomize is installed); the rendered pods run what the services
really accept (each container's command line and health probe parsed by the real parsers, $(VAR) expanded as
the kubelet does), share the KV segment, and expose the ports the Service, the Prometheus job and the
InferencePool name."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cache_service.server import parse_args as cache_args
from common import healthcheck
from compute_service.server import parse_args as compute_args
from gateway.server import parse_args as gateway_args
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"
VALIDATE = Path(sys.executable).with_name("kubernetes-validate")
# Whole resources (the overlays' patches are partial by design, checked once rendered).
CORE = [
    *sorted(path for path in (DEPLOY / "base").glob("*.yaml") if path.name != "kustomization.yaml"),
    DEPLOY / "overlays" / "cuda" / "gpu-claim.yaml",
    DEPLOY / "inference-extension" / "endpoint-picker.yaml",
]
TREES = ["base", "overlays/cuda", "overlays/ascend", "inference-extension"]
# The Gateway API Inference Extension's CRD kinds, for which kubernetes-validate has no schema.
CRD_KINDS = {"InferencePool"}
PARSERS = {"cache_service": cache_args, "compute_service": compute_args, "gateway": gateway_args}
POD_IP = "10.0.0.7"


def validate(*paths: Path) -> subprocess.CompletedProcess:
    argv = [str(VALIDATE), "--strict", "--quiet", *map(str, paths)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def kustomize() -> list[str] | None:
    """The kustomize build command here (v4 or newer, for `resources` and `patches`), or None."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True, timeout=60)
        found = re.search(r"Kustomize Version: v(\d+)", out.stdout)
        if found and int(found[1]) >= 4:
            return ["kubectl", "kustomize"]
    return None


needs_kustomize = pytest.mark.skipif(kustomize() is None, reason="kustomize v4+ (or kubectl with it) missing")


def render(tree: str, tmp_path: Path) -> tuple[Path, list[dict]]:
    out = subprocess.run([*kustomize(), str(DEPLOY / tree)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = tmp_path / f"{tree.replace('/', '-')}.yaml"
    path.write_text(out.stdout)
    return path, list(yaml.safe_load_all(out.stdout))


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_core_manifests_pass_strict_validation(path):
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_strict_validation_refuses_an_unknown_field(tmp_path):
    deployment = yaml.safe_load((DEPLOY / "base" / "deployment.yaml").read_text())
    deployment["spec"]["template"]["spec"]["containers"][0]["comand"] = ["python"]
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(deployment))
    assert validate(tmp_path / "typo.yaml").returncode != 0


@needs_kustomize
@pytest.mark.parametrize("tree", TREES)
def test_rendered_trees_pass_strict_validation(tmp_path, tree):
    path, docs = render(tree, tmp_path)
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr
    unvalidated = set(re.findall(r"Couldn't find schema for kind (\w+)", result.stdout + result.stderr))
    assert unvalidated == {doc["kind"] for doc in docs} & CRD_KINDS, "only the CRD kinds go unchecked"


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(NAME) expansion of a container's command line from its env."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), value)


def containers(docs: list[dict]) -> dict[str, dict]:
    (deployment,) = (d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pagedserve")
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def argv_of(container: dict) -> list[str]:
    """The container's command line as it runs: `python -m MODULE FLAGS...`, $(NAME) expanded."""
    env = {e["name"]: e.get("value", POD_IP) for e in container.get("env", [])}
    argv = [expand(arg, env) for arg in container["command"] + container["args"]]
    assert argv[:2] == ["python", "-m"], argv
    return argv


def command_line(container: dict) -> tuple[str, object]:
    """The service module a container runs and its flags, parsed by that service's parser."""
    argv = argv_of(container)
    return argv[2], PARSERS[argv[2]](argv[3:])


@needs_kustomize
def test_the_pods_run_what_the_services_accept(tmp_path):
    _, docs = render("base", tmp_path)
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    by_name = containers(docs)
    args = {name: command_line(c)[1] for name, c in by_name.items()}
    assert [command_line(c)[0] for c in by_name.values()] == ["cache_service", "compute_service", "gateway"]
    assert args["cache"].kv_events_endpoint == "tcp://*:5557"
    assert args["cache"].kv_events_topic == f"kv@{POD_IP}@SmolLM2-135M-Instruct"
    assert args["gateway"].http_metrics == "on"
    assert (args["gateway"].cache_target, args["gateway"].compute_target) == (
        "127.0.0.1:50052",
        "127.0.0.1:50053",
    )
    for name, identity in (("cache", "cache"), ("compute", "compute")):
        probe = by_name[name]["readinessProbe"]["exec"]["command"]
        check = healthcheck.parser().parse_args(probe[3:])
        assert (check.target, check.internal_certs, check.identity) == (
            f"127.0.0.1:{args[name].port}",
            "/certs",
            identity,
        )
        assert args[name].internal_certs == "/certs"
    assert by_name["gateway"]["readinessProbe"]["grpc"] == {
        "port": 50051,
        "service": "pagedserve.v1.Generation",
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kv"]["emptyDir"]["medium"] == "Memory"
    for name, container in by_name.items():
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/certs"]]["secret"]["secretName"] == f"pagedserve-{name}-certs", (
            "its own Secret"
        )
        assert (mounts.get("/dev/shm") == "kv") == (name != "gateway"), "cache and compute share the segment"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports[f"metrics-{name}"] == args[name].metrics_port
    assert by_name["cache"]["ports"][1:] == [
        {"name": "kv-events", "containerPort": 5557},
        {"name": "kv-replay", "containerPort": 5558},
    ]


@needs_kustomize
def test_the_service_the_budget_and_the_scrape_job_find_the_pods(tmp_path):
    _, docs = render("base", tmp_path)
    by_kind = {d["kind"]: d for d in docs}
    labels = by_kind["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert by_kind["Service"]["spec"]["selector"].items() <= labels.items()
    assert by_kind["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for c in containers(docs).values() for p in c["ports"]}
    assert {p["targetPort"] for p in by_kind["Service"]["spec"]["ports"]} <= port_names
    job = yaml.safe_load(by_kind["ConfigMap"]["data"]["prometheus.yml"])["scrape_configs"][0]
    keep = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert re.fullmatch(
        keep["__meta_kubernetes_pod_label_app_kubernetes_io_name"], labels["app.kubernetes.io/name"]
    )
    scraped = {n for n in port_names if re.fullmatch(keep["__meta_kubernetes_pod_container_port_name"], n)}
    assert scraped == {"metrics-cache", "metrics-compute", "metrics-gateway"}


@needs_kustomize
@pytest.mark.parametrize(("overlay", "device"), [("overlays/cuda", "cuda:0"), ("overlays/ascend", "npu:0")])
def test_the_overlays_put_pool_and_model_on_one_device(tmp_path, overlay, device):
    _, docs = render(overlay, tmp_path)
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True, "IPC handles need one PID namespace"
    by_name = containers(docs)
    for name in ("cache", "compute"):
        argv = argv_of(by_name[name])
        assert argv[argv.index("--kv-device") + 1] == device
    if overlay.endswith("cuda"):
        (claim,) = pod["resourceClaims"]
        claim_users = [
            n for n, c in by_name.items() if c["resources"].get("claims") == [{"name": claim["name"]}]
        ]
        assert claim_users == ["cache", "compute"], "one GPU claim, shared"
        templates = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
        assert [t["metadata"]["name"] for t in templates] == [claim["resourceClaimTemplateName"]]
    else:
        for name in ("cache", "compute"):
            assert by_name[name]["resources"]["limits"]["huawei.com/Ascend910"] == "1"


@needs_kustomize
def test_the_inference_pool_targets_the_gateways_http_metrics(tmp_path):
    _, base = render("base", tmp_path)
    _, docs = render("inference-extension", tmp_path)
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    gateway = command_line(containers(base)["gateway"])[1]
    assert pool["spec"]["targetPorts"] == [{"number": gateway.http_port}] and gateway.http_metrics == "on"
    labels = next(d for d in base if d["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = next(d for d in docs if d["kind"] == "Service")
    picker = pool["spec"]["endpointPickerRef"]
    assert (picker["name"], picker["port"]["number"]) == (
        service["metadata"]["name"],
        service["spec"]["ports"][0]["port"],
    )
    config = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["default-plugins.yaml"])
    declared = {plugin["type"] for plugin in config["plugins"]}
    assert {ref["pluginRef"] for ref in config["schedulingProfiles"][0]["plugins"]} == declared
