"""deploy/ stays valid: the Kubernetes manifests against the Kubernetes schemas (kubernetes-validate, strict),
the nginx configuration with nginx's own `nginx -t`, and the Envoy configuration's health checks and ports
against what the engine serves."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from engine_server.server.server import SERVICE_NAME
from ladle_cli.main import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES_VERSION = "1.33"


def manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        found += [(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}", doc)
                  for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


@pytest.mark.parametrize(("name", "document"), manifests(), ids=[name for name, _ in manifests()])
def test_kubernetes_manifests_validate(name: str, document: dict[str, Any]) -> None:
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_engines_are_probed_on_their_own_health_service() -> None:
    (engine,) = [doc for _, doc in manifests() if doc["kind"] == "StatefulSet" and doc["metadata"]["name"] == "engine"]
    container = engine["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    args = container["args"]
    grace = float(args[args.index("--drain-grace") + 1]) + float(args[args.index("--shutdown-timeout") + 1])
    assert engine["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace


def test_nginx_config_passes_nginx_t(tmp_path: Path) -> None:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    assert nginx, "nginx is not installed: run `make setup` (it installs Debian's nginx-light)"
    # nginx -t resolves upstream names: the cluster's names stand for loopback here.
    conf = (DEPLOY / "nginx" / "nginx.conf").read_text().replace("engine-0.ladle-engine", "127.0.0.1").replace(
        "engine-1.ladle-engine", "127.0.0.2")
    (tmp_path / "logs").mkdir()
    (tmp_path / "nginx.conf").write_text(conf)
    checked = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", "stderr",
                              "-g", f"pid {tmp_path / 'nginx.pid'};"], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0 and "test is successful" in checked.stderr, checked.stderr


def test_envoy_config_checks_the_engine_health_service() -> None:
    config = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    (cluster,) = config["static_resources"]["clusters"]
    assert [check["grpc_health_check"]["service_name"] for check in cluster["health_checks"]] == [SERVICE_NAME]
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert {e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints} == {50051}
    assert "http2_protocol_options" in str(cluster["typed_extension_protocol_options"])


def _bytes(quantity: str) -> int:
    """A Kubernetes quantity with a binary suffix (or none) in bytes."""
    units = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity.removesuffix(suffix)) * factor)
    return int(quantity)


def test_the_gateways_disk_limits_fit_its_volume() -> None:
    """The per-project quota, the largest upload and the free-space floor fit the blob volume: one project can
    never fill it (as the default quota, 100 GiB on a 100Gi volume, did), and several fit beside each other."""
    documents = {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in manifests()}
    pod = documents["Deployment", "gateway"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    settings = {f"--{e['name'].removeprefix('LADLE_').lower().replace('_', '-')}": e["value"]
                for e in container["env"] if e["name"].startswith("LADLE_") and "value" in e}
    args = container["args"]
    settings |= {flag: args[i + 1] for i, flag in enumerate(args) if flag.startswith("--") and i + 1 < len(args)}
    (claim,) = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v["name"] == "data"]
    volume = _bytes(documents["PersistentVolumeClaim", claim]["spec"]["resources"]["requests"]["storage"])
    mib = 1024**2
    quota = int(settings["--project-max-file-bytes"])
    floor = int(float(settings["--min-free-disk-mib"]) * mib)
    largest_upload = int(float(settings.get("--max-file-mib", "200")) * mib)
    assert 0 < largest_upload <= quota and floor > 0
    assert quota + largest_upload + floor <= volume  # one project alone stays above the floor
    assert quota <= volume // 4  # and at least four fit side by side


def _secret_file(pod: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in the pod's first container, through its mounts and volumes."""
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    name = path.removeprefix(mount["mountPath"].rstrip("/") + "/")
    (key,) = [item["key"] for item in volume["secret"]["items"] if item["path"] == name]
    return volume["secret"]["secretName"], key


def test_the_engine_port_needs_the_token_the_gateways_send_and_only_gateways_reach_it() -> None:
    documents = {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in manifests()}
    engine = documents["StatefulSet", "engine"]["spec"]["template"]
    gateway = documents["Deployment", "gateway"]["spec"]["template"]
    # The flags as the `ladle` command itself parses them, each naming a file of the same Secret key.
    engine_args = build_parser().parse_args(engine["spec"]["containers"][0]["args"])
    gateway_args = build_parser().parse_args(gateway["spec"]["containers"][0]["args"])
    assert engine_args.auth_token_file and gateway_args.engine_auth_token_file
    assert _secret_file(engine["spec"], engine_args.auth_token_file) == _secret_file(
        gateway["spec"], gateway_args.engine_auth_token_file)
    # The NetworkPolicy: ingress to the engine pods only from gateway pods, only on the engine's gRPC port.
    (policy,) = [doc for (kind, _), doc in documents.items() if kind == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= engine["metadata"]["labels"].items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    grpc_port = engine_args.port
    for rule in policy["spec"]["ingress"]:
        assert [peer.keys() for peer in rule["from"]] == [{"podSelector"}] * len(rule["from"])
        for peer in rule["from"]:
            assert peer["podSelector"]["matchLabels"].items() <= gateway["metadata"]["labels"].items()
        assert [(p["protocol"], p["port"]) for p in rule["ports"]] == [("TCP", grpc_port)]
