"""What can be proven of deploy/k8s without a cluster: every overlay renders (`kubectl kustomize`),
every core object validates against Kubernetes' own schemas (`kubernetes-validate --strict`), the
KEDA objects against KEDA's CRD schemas (vendored, deploy/k8s/schemas/keda), and the invariants
hold that a schema cannot see: the drain fits the grace period, a worker's GPUs are its tensor
parallel size, the autoscaler's query is thinkbatch/autoscale.py's, no secret is written down,
and every Secret key the pods read is one scripts/k8s_secrets.py makes."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.helpers import ROOT
from thinkbatch.autoscale import pending_work_sql
from thinkbatch.settings import Settings

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("trial", "managed", "example-qwen3-32b")
KEDA = K8S / "schemas" / "keda"
KEDA_KINDS = ("ScaledObject", "TriggerAuthentication")
# The oldest Kubernetes the manifests are checked against, and the newest kubernetes-validate
# ships (its release number): both must accept every core object.
K8S_VERSIONS = ("1.30", "1.37")
# The UID both images run as (Dockerfile).
IMAGE_UID = 10001
# Env vars that carry a secret: never a literal value in a manifest.
SECRET_ENV = re.compile(r"(PASSWORD|TOKEN|SECRET|AUTH|_URL)$")
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed: the overlays cannot be rendered"
)


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def objects(kind: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    for overlay in OVERLAYS:
        for obj in render(overlay):
            if kind is None or obj["kind"] == kind:
                yield overlay, obj


def named(overlay: str, kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in render(overlay) if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj)
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def workers() -> Iterator[tuple[str, dict[str, Any]]]:
    for overlay, obj in objects("Deployment"):
        if obj["metadata"]["labels"]["app.kubernetes.io/component"] == "worker":
            yield overlay, obj


def worker_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (worker,) = [c for c in pod_spec(deployment)["containers"] if c["name"] == "worker"]
    return worker


# --- rendering and schemas ---------------------------------------------------------------------


def test_every_overlay_renders_into_one_namespace() -> None:
    for overlay in OVERLAYS:
        docs = render(overlay)
        assert docs, overlay
        assert {d["metadata"].get("namespace") for d in docs} == {"thinkbatch"}, overlay
        ids = [(d["kind"], d["metadata"]["name"]) for d in docs]
        assert len(ids) == len(set(ids)), overlay


@pytest.mark.slow  # kubernetes-validate loads its schemas anew each run: ~5 s for the six
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_validate_strictly_against_kubernetes_schemas(
    overlay: str, version: str, tmp_path: Path
) -> None:
    core = [d for d in render(overlay) if d["kind"] not in KEDA_KINDS]
    manifest = tmp_path / f"{overlay}.yaml"
    manifest.write_text(yaml.safe_dump_all(core))
    tool = Path(sys.executable).parent / "kubernetes-validate"
    assert tool.exists(), "install the dev group (pip install --group dev)"
    out = subprocess.run(
        [str(tool), "--strict", "-k", version, str(manifest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    # Every object was checked against a schema (an unknown kind is only a warning).
    passed = re.findall(r"^INFO .* passed for resource", out.stdout, re.MULTILINE)
    assert len(passed) == len(core), out.stdout + out.stderr
    assert "WARN" not in out.stdout + out.stderr


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """KEDA's schema with unknown fields refused: the API server would silently prune them
    (structural schemas), so a misspelt field would simply do nothing."""
    schema = dict(schema)
    if schema.get("type") == "object" and "properties" in schema:
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            schema["additionalProperties"] = False
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = _strict(schema[key])
    return schema


@cache
def keda_schema(kind: str, version: str) -> dict[str, Any]:
    plural = {"ScaledObject": "scaledobjects", "TriggerAuthentication": "triggerauthentications"}
    crd = yaml.safe_load((KEDA / f"keda.sh_{plural[kind]}.yaml").read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _strict(served["schema"]["openAPIV3Schema"])


def test_keda_objects_validate_against_kedas_crd_schemas() -> None:
    checked = set()
    for overlay, obj in objects():
        if obj["kind"] not in KEDA_KINDS:
            continue
        group, version = obj["apiVersion"].split("/")
        assert group == "keda.sh", obj["apiVersion"]
        jsonschema.validate(obj, keda_schema(obj["kind"], version))
        checked.add((overlay, obj["kind"]))
        if obj["kind"] == "ScaledObject":  # a CEL rule of the CRD, which jsonschema cannot run
            assert obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"]
    assert {kind for _, kind in checked} == set(KEDA_KINDS)
    assert {overlay for overlay, _ in checked} == set(OVERLAYS)


def test_the_keda_schema_check_refuses_a_misspelt_field() -> None:
    (_, scaled) = next(objects("ScaledObject"))
    bad = json.loads(json.dumps(scaled))
    bad["spec"]["cooldownPeriods"] = 60
    with pytest.raises(jsonschema.ValidationError, match="cooldownPeriods"):
        jsonschema.validate(bad, keda_schema("ScaledObject", "v1alpha1"))


def test_the_vendored_keda_crds_are_the_release_the_readme_names() -> None:
    readme = (KEDA / "README.md").read_text()
    assert "v2.20.2" in readme and "68a5b5028f35b22d50597c69819ab32c4e92f21a" in readme
    for path in sorted(KEDA.glob("*.yaml")):
        assert hashlib.sha256(path.read_bytes()).hexdigest() in readme, path.name
        assert f"`config/crd/bases/{path.name}`" in readme


# --- the workers ---------------------------------------------------------------------------------


def test_a_workers_gpus_are_its_tensor_parallel_size() -> None:
    sizes = set()
    for overlay, deployment in workers():
        worker = worker_container(deployment)
        tp = int(env_of(worker)["THINKBATCH_TENSOR_PARALLEL_SIZE"])
        resources = worker["resources"]
        assert int(resources["limits"]["nvidia.com/gpu"]) == tp, (overlay, deployment)
        assert int(resources["requests"]["nvidia.com/gpu"]) == tp, (overlay, deployment)
        sizes.add(tp)
    assert sizes == {1, 2}  # the base's Qwen3-8B and the Qwen3-32B component both checked


def _prestop_wait(container: dict[str, Any]) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"], command
    script = command[2]
    # It starts the worker's drain itself (SIGTERM to PID 1, the worker), then holds the pod.
    assert script.startswith("kill -TERM 1;"), script
    (seconds,) = re.findall(r"\bsleep (\d+)$", script)
    return int(seconds)


def test_the_drain_fits_in_the_prestop_wait_and_the_grace_period() -> None:
    default = Settings(_env_file=None).shutdown_timeout_s
    for overlay, deployment in workers():
        worker = worker_container(deployment)
        drain = float(env_of(worker).get("THINKBATCH_SHUTDOWN_TIMEOUT_S", default))
        wait = _prestop_wait(worker)
        grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert wait >= drain + 10, (overlay, wait, drain)
        assert grace >= wait + 10, (overlay, grace, wait)
        # The settings must accept what the manifest sets.
        assert Settings(_env_file=None, shutdown_timeout_s=drain).shutdown_timeout_s == drain
        # The image's command, so that PID 1 is the worker the hook signals.
        assert "command" not in worker and "args" not in worker


def test_worker_probes_use_its_metrics_port_from_the_settings() -> None:
    for overlay, deployment in workers():
        worker = worker_container(deployment)
        env = env_of(worker)
        settings = Settings(
            _env_file=None,
            worker_metrics_port=env["THINKBATCH_WORKER_METRICS_PORT"],
            worker_metrics_host=env["THINKBATCH_WORKER_METRICS_HOST"],
        )
        assert settings.worker_metrics_host == "0.0.0.0"  # noqa: S104 - kubelet probes the pod IP
        (port,) = [p for p in worker["ports"] if p["name"] == "metrics"]
        assert port["containerPort"] == settings.worker_metrics_port, overlay
        for probe in ("startupProbe", "livenessProbe"):
            get = worker[probe]["httpGet"]
            assert (get["path"], get["port"]) == ("/metrics", "metrics"), (overlay, probe)


def test_a_worker_is_never_scaled_away_while_it_loads() -> None:
    for overlay, scaled in objects("ScaledObject"):
        spec = scaled["spec"]
        deployment = named(overlay, "Deployment", spec["scaleTargetRef"]["name"])
        startup = worker_container(deployment)["startupProbe"]
        load_s = startup.get("initialDelaySeconds", 0) + (
            startup["periodSeconds"] * startup["failureThreshold"]
        )
        assert spec["cooldownPeriod"] > load_s, (overlay, spec["cooldownPeriod"], load_s)
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] > load_s
        # Zero when there is no work, one as soon as an item waits.
        assert spec["minReplicaCount"] == 0
        (trigger,) = spec["triggers"]
        assert trigger["metadata"]["activationTargetQueryValue"] == "0"
        assert int(trigger["metadata"]["targetQueryValue"]) > 0


def test_the_scalers_query_is_autoscale_py_s_for_the_workers_model() -> None:
    seen = set()
    for overlay, scaled in objects("ScaledObject"):
        deployment = named(overlay, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
        env = env_of(worker_container(deployment))
        served = env.get("THINKBATCH_SERVED_MODEL_NAME") or env["THINKBATCH_MODEL"]
        # A set that serves adapters scales on their items too.
        adapters = json.loads(env.get("THINKBATCH_LORA_ADAPTERS", "{}"))
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "postgresql"
        assert trigger["metadata"]["query"] == pending_work_sql(served, *adapters), overlay
        # KEDA reads the pods' own database URL.
        auth = named(overlay, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        assert auth["spec"]["secretTargetRef"] == [
            {"parameter": "connection", "name": "thinkbatch-database", "key": "url"}
        ]
        seen.add(served)
    # Every worker Deployment has exactly one ScaledObject.
    for overlay, deployment in workers():
        targets = [
            s["spec"]["scaleTargetRef"]["name"] for o, s in objects("ScaledObject") if o == overlay
        ]
        assert targets.count(deployment["metadata"]["name"]) == 1, overlay
    assert seen == {"Qwen/Qwen3-8B", "Qwen/Qwen3-32B"}


def worker_settings(deployment: dict[str, Any]) -> dict[str, Any]:
    """The names a worker set serves, as its settings read them from its env."""
    env = env_of(worker_container(deployment))
    return {
        "model": env["THINKBATCH_MODEL"],
        "served_model_name": env.get("THINKBATCH_SERVED_MODEL_NAME"),
        "lora_adapters": json.loads(env.get("THINKBATCH_LORA_ADAPTERS", "{}")),
    }


def test_the_api_accepts_every_model_its_workers_load() -> None:
    for overlay in OVERLAYS:
        config = named(overlay, "ConfigMap", "thinkbatch-config")["data"]
        models = {
            name
            for o, d in workers()
            if o == overlay
            for name in Settings(_env_file=None, **worker_settings(d)).served_names
        }
        # The API accepts each set's model and adapters, also while it is scaled to zero, and
        # its default model is one of them.
        settings = Settings(
            _env_file=None,
            model=config["THINKBATCH_MODEL"],
            served_models=json.loads(config["THINKBATCH_SERVED_MODELS"]),
        )
        assert set(settings.configured_models) == models, overlay
        assert settings.model_name in models, overlay
    assert len({d["metadata"]["name"] for o, d in workers() if o == "example-qwen3-32b"}) == 2


def test_each_model_is_downloaded_at_a_pinned_revision_and_loaded_from_it() -> None:
    for overlay, deployment in workers():
        spec = pod_spec(deployment)
        worker = worker_container(deployment)
        model = env_of(worker)["THINKBATCH_MODEL"]
        revision = json.loads(env_of(worker)["THINKBATCH_ENGINE_EXTRA_ARGS"])["revision"]
        assert re.fullmatch(r"[0-9a-f]{40}", revision), revision  # a commit, never a branch
        assert env_of(worker)["HF_HUB_OFFLINE"] == "1"  # workers never download
        (wait,) = [c for c in spec["initContainers"] if c["name"] == "wait-for-model"]
        assert env_of(wait) == {"HF_REPO": model, "HF_REVISION": revision}
        jobs = [
            j for o, j in objects("Job")
            if o == overlay and j["metadata"]["labels"]["app.kubernetes.io/component"] == "download"
            and env_of(pod_spec(j)["containers"][0])["HF_REPO"] == model
        ]  # fmt: skip
        (job,) = jobs
        download = pod_spec(job)["containers"][0]
        assert env_of(download)["HF_REVISION"] == revision
        script = download["command"][2]
        assert 'hf download "$HF_REPO" --revision "$HF_REVISION" &&' in script
        # The job's mark and the worker's wait name the same file.
        mark = '"/hf/thinkbatch-ready/$(echo "$HF_REPO" | tr / _)@$HF_REVISION"'
        assert f"touch {mark}" in script and f"[ -f {mark} ]" in wait["command"][2]
        for pod in (spec, pod_spec(job)):
            (volume,) = [v for v in pod["volumes"] if v["name"] == "hf-cache"]
            claim = named(overlay, "PersistentVolumeClaim", volume["persistentVolumeClaim"][
                "claimName"])  # fmt: skip
            assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        for container in (worker, download, wait):
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts["/hf"] == "hf-cache"  # the image's HF_HOME (Dockerfile)
        shm = "/dev/shm"  # noqa: S108 - the pod's shared memory, an emptyDir of its own
        assert {m["mountPath"] for m in worker["volumeMounts"]} == {"/hf", "/cache", shm}


def test_each_worker_has_a_disruption_budget() -> None:
    for overlay, deployment in workers():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        budgets = [
            b for o, b in objects("PodDisruptionBudget")
            if o == overlay and b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]  # fmt: skip
        assert len(budgets) == 1, (overlay, deployment["metadata"]["name"])
        assert budgets[0]["spec"]["maxUnavailable"] == 1


# --- the API, the migration, Flower --------------------------------------------------------------


def test_the_api_is_probed_on_readyz_and_healthz() -> None:
    for overlay in OVERLAYS:
        deployment = named(overlay, "Deployment", "thinkbatch-api")
        (api,) = pod_spec(deployment)["containers"]
        assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
        (port,) = api["ports"]
        assert port["containerPort"] == 8000  # api/gunicorn.conf.py's bind
        assert api["readinessProbe"]["httpGet"]["port"] == port["name"]
        service = named(overlay, "Service", "thinkbatch-api")
        assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"][
            "labels"].items()  # fmt: skip


def test_the_api_and_the_workers_wait_for_the_migration() -> None:
    for overlay in OVERLAYS:
        migrate = named(overlay, "Job", "thinkbatch-migrate")
        (job,) = pod_spec(migrate)["containers"]
        assert job["command"] == ["alembic", "upgrade", "head"]
        waiting = [named(overlay, "Deployment", "thinkbatch-api")]
        waiting += [d for o, d in workers() if o == overlay]
        for deployment in waiting:
            (wait,) = [
                c for c in pod_spec(deployment)["initContainers"] if c["name"] == "wait-for-schema"
            ]
            assert wait["command"] == ["python", "-m", "thinkbatch.schema_ready"]
            # The same image as the pod's own container: the migrations it waits for are the
            # ones its code was built with.
            assert wait["image"] == pod_spec(deployment)["containers"][0]["image"]


def test_flower_is_behind_basic_auth_from_a_secret() -> None:
    for overlay in OVERLAYS:
        (flower,) = pod_spec(named(overlay, "Deployment", "thinkbatch-flower"))["containers"]
        (auth,) = [e for e in flower["env"] if e["name"] == "FLOWER_BASIC_AUTH"]
        assert auth["valueFrom"]["secretKeyRef"] == {
            "name": "thinkbatch-flower",
            "key": "basic-auth",
        }
        assert "--basic-auth" not in " ".join(flower["command"])  # never on the command line


# --- secrets and users ----------------------------------------------------------------------------


def test_no_secret_is_written_in_any_manifest() -> None:
    for overlay, obj in objects():
        # Secrets are made by scripts/k8s_secrets.py, with fresh values, or by the operator.
        assert obj["kind"] != "Secret", overlay
        if "template" not in obj.get("spec", {}):
            continue
        for container in containers(obj):
            for var in container.get("env", []):
                if SECRET_ENV.search(var["name"]):
                    assert "value" not in var, (overlay, obj["metadata"]["name"], var)
                    assert "secretKeyRef" in var["valueFrom"], (overlay, var)
            assert "envFrom" not in container or all(
                "secretRef" not in source for source in container["envFrom"]
            )
    for path in K8S.rglob("*.yaml"):
        assert "stringData" not in path.read_text(), path


def _referenced_keys(overlay: str) -> set[tuple[str, str]]:
    keys = set()
    for obj in render(overlay):
        if "template" not in obj.get("spec", {}):
            continue
        for container in containers(obj):
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    keys.add((ref["name"], ref["key"]))
    for _, auth in [(o, a) for o, a in objects("TriggerAuthentication") if o == overlay]:
        keys |= {(r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
    return keys


def _made_keys(items: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(s["metadata"]["name"], k) for s in items for k in s["stringData"]}


def _secrets(*args: str) -> tuple[list[dict[str, Any]], str]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "k8s_secrets.py"), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    assert (listed["apiVersion"], listed["kind"]) == ("v1", "List")
    items: list[dict[str, Any]] = listed["items"]
    return items, out.stderr


MANAGED_ARGS = (
    "managed",
    "--database-url", "postgresql+psycopg://tb:pw@db.example.net:5432/tb?sslmode=require",
    "--redis-url", "redis://:pw@cache.example.net:6379/0",
)  # fmt: skip


def test_the_secrets_script_makes_every_key_the_pods_read() -> None:
    trial, said = _secrets("trial")
    assert _referenced_keys("trial") <= _made_keys(trial)
    managed, _ = _secrets(*MANAGED_ARGS)
    for overlay in ("managed", "example-qwen3-32b"):
        assert _referenced_keys(overlay) <= _made_keys(managed)
    # Flower's credentials are shown once, on stderr, not in what goes to kubectl's log.
    (flower,) = [s for s in trial if s["metadata"]["name"] == "thinkbatch-flower"]
    assert flower["stringData"]["basic-auth"] in said


def test_the_trials_urls_reach_its_own_services_with_its_passwords() -> None:
    trial, _ = _secrets("trial")
    data = {s["metadata"]["name"]: s["stringData"] for s in trial}
    database, redis = data["thinkbatch-database"], data["thinkbatch-redis"]
    settings = Settings(_env_file=None, database_url=database["url"], redis_url=redis["url"])
    assert settings.database_url and settings.redis_url
    db, rd = settings.database_url.hosts()[0], settings.redis_url
    # The Services by their namespaced names: KEDA's operator, in a namespace of its own,
    # connects with the same URL.
    assert (db["host"], db["port"], db["password"]) == (
        "thinkbatch-postgres.thinkbatch.svc", 5432, database["password"],
    )  # fmt: skip
    assert (rd.host, rd.port, rd.password) == (
        "thinkbatch-redis.thinkbatch.svc", 6379, redis["password"],
    )  # fmt: skip
    for host, port in ((db["host"], db["port"]), (rd.host, rd.port)):
        name, namespace, _ = str(host).split(".")
        service = named("trial", "Service", name)
        assert service["metadata"]["namespace"] == namespace
        assert [p["port"] for p in service["spec"]["ports"]] == [port]
    elsewhere = _secrets("trial", "--namespace", "batch")[0][0]["stringData"]["url"]
    assert "@thinkbatch-postgres.batch.svc:5432/" in elsewhere
    # KEDA's pgx reads the same URL: postgresql://, no SQLAlchemy driver suffix.
    assert database["url"].startswith("postgresql://")
    # Fresh each time: nothing to guess, nothing committed.
    again = {s["metadata"]["name"]: s["stringData"] for s in _secrets("trial")[0]}
    for name in data:
        assert set(data[name].values()).isdisjoint(again[name].values()), name
    assert len(database["password"]) >= 40


def test_the_secrets_script_takes_managed_urls_as_keda_reads_them() -> None:
    managed, _ = _secrets(*MANAGED_ARGS)
    data = {s["metadata"]["name"]: s["stringData"] for s in managed}
    url = data["thinkbatch-database"]["url"]
    assert url == "postgresql://tb:pw@db.example.net:5432/tb?sslmode=require"
    assert Settings(_env_file=None, database_url=url).database_url is not None
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "k8s_secrets.py"), "managed",
         "--database-url", "mysql://tb:pw@db/tb", "--redis-url", "redis://cache:6379/0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--database-url" in out.stderr and not out.stdout


@pytest.mark.slow  # kubernetes-validate, as above
@pytest.mark.parametrize("args", [("trial",), MANAGED_ARGS])
def test_the_secrets_validate_against_kubernetes_schemas(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    items, _ = _secrets(*args)
    manifest = tmp_path / "secrets.yaml"
    manifest.write_text(yaml.safe_dump_all(items))
    tool = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run(
        [str(tool), "--strict", "-k", K8S_VERSIONS[-1], str(manifest)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.count("passed") == len(items), out.stdout


def test_thinkbatchs_pods_run_as_the_images_user() -> None:
    for overlay, obj in objects():
        if "template" not in obj.get("spec", {}):
            continue
        component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
        security = pod_spec(obj)["securityContext"]
        assert security["runAsNonRoot"] is True, (overlay, obj["metadata"]["name"])
        if component not in ("postgres", "redis"):  # the trial's services run as their images'
            assert security["runAsUser"] == IMAGE_UID, (overlay, obj["metadata"]["name"])
        for container in containers(obj):
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.count(f"USER {IMAGE_UID}:{IMAGE_UID}\n") == 2


def test_the_download_and_wait_scripts_are_valid_shell() -> None:
    for _, obj in objects():
        if "template" not in obj.get("spec", {}):
            continue
        for container in containers(obj):
            command = container.get("command", [])
            if command[:2] == ["sh", "-c"]:
                out = subprocess.run(["sh", "-n", "-c", command[2]], capture_output=True)
                assert out.returncode == 0, (command, out.stderr)
                assert shlex.split(command[2])  # quotes balance


def test_the_docs_overlay_blocks_set_the_images_and_the_storage_class(tmp_path: Path) -> None:
    """docs/deploy-kubernetes.md's own blocks, added to a copy of the trial overlay as its step 2
    says, point every thinkbatch container at the registry and the cache at the class."""
    docs = (ROOT / "docs" / "deploy-kubernetes.md").read_text()
    block = docs.split("The two blocks step 2 adds", 1)[1].split("```yaml\n", 1)[1]
    block = block.split("```", 1)[0]
    copy = tmp_path / "deploy" / "k8s"
    shutil.copytree(K8S, copy)
    mine = copy / "overlays" / "mine"
    shutil.copytree(copy / "overlays" / "trial", mine)
    kustomization = mine / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text() + block)
    assert KUBECTL is not None
    out = subprocess.run([KUBECTL, "kustomize", str(mine)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    docs_render = [d for d in yaml.safe_load_all(out.stdout) if d]
    images = {
        c["image"] for d in docs_render if "template" in d.get("spec", {}) for c in containers(d)
    }
    assert images == {
        "REGISTRY/thinkbatch-api:TAG", "REGISTRY/thinkbatch-worker:TAG", "postgres:17", "redis:7",
    }  # fmt: skip
    (claim,) = [d for d in docs_render if d["metadata"]["name"] == "thinkbatch-hf-cache"]
    assert claim["spec"]["storageClassName"] == "YOUR-RWX-CLASS"
