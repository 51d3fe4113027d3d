"""A served model on Kubernetes: a Deployment of server pods and a Service in front of them.

`conf/deploy/*.yaml` says where the model is, which image runs it, how many replicas with what
resources, the port, and the name of the Secret that holds the API key; `render` turns it into
the two objects as plain dicts (the API's JSON shape) and `to_yaml` into a file for
`kubectl apply -f`. The key itself is never in the config or the manifest: pods read it from the
Secret (`LLMFOUNDRY_API_KEY`, or `VLLM_API_KEY` for vLLM), so a config without one is refused.

Both probes call `/health`: readiness takes a pod out of the Service while it loads or drains,
liveness restarts one whose decode loop died. `terminationGracePeriodSeconds` leaves the server
its drain time after SIGTERM.

With `engine: vllm` the pods run `vllm serve` on the exported transformers folder (one GPU or
more) instead of `scripts/serve.py`.

A model on an object store (``s3://...`` on MinIO, R2) needs what training needed to write it:
``storage:``, the training config's block (an endpoint, a profile; `llmfoundry.utils.storage`),
reaches scripts/serve.py as ``--storage`` (vLLM, which reads object stores with its own client,
gets ``endpoint_url`` and ``profile`` as ``AWS_ENDPOINT_URL`` / ``AWS_PROFILE``); and
``storage_secret:`` names the Secret whose keys, named like the environment variables they set
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), hold the credentials, as the launcher's
``kubernetes.secret`` does for a training job. Credentials in ``storage:`` itself are refused:
the manifest would show them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmfoundry.serving.vllm import API_KEY_ENV, vllm_command
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.secrets import is_secret
from llmfoundry.utils.storage import parse_settings

__all__ = ["DeploySpec", "load_spec", "render", "to_yaml"]

API_KEY_ENV_LLMFOUNDRY = "LLMFOUNDRY_API_KEY"
ENGINES = ("llmfoundry", "vllm")


@dataclass
class SecretRef:
    """A key of a Kubernetes Secret (kubectl create secret generic NAME --from-literal=KEY=...)."""

    name: str = MISSING
    key: str = "api-key"


@dataclass
class StorageSecret:
    """The Secret holding object-store credentials, one key per environment variable it sets
    (kubectl create secret generic NAME --from-literal=AWS_ACCESS_KEY_ID=... ...); no name:
    the pods have credentials otherwise (workload identity) or need none."""

    name: str | None = None
    keys: list[str] = field(default_factory=lambda: ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The storage options vLLM's own object-store client takes, as its environment variables.
VLLM_STORAGE_ENV = {"endpoint_url": "AWS_ENDPOINT_URL", "profile": "AWS_PROFILE"}


@dataclass
class DeploySpec:
    """What conf/deploy/*.yaml holds (unknown keys are refused)."""

    name: str = MISSING
    image: str = MISSING
    model: str = MISSING  # as the pod sees it: a URL or a path on a mounted volume
    api_key_secret: SecretRef = field(default_factory=SecretRef)
    # The training config's storage: block, for a model on an object store (module docstring).
    storage: dict[str, Any] | None = None
    storage_secret: StorageSecret = field(default_factory=StorageSecret)
    engine: str = "llmfoundry"
    model_name: str | None = None
    namespace: str | None = None
    replicas: int = 1
    port: int = 8000
    gpus: int = 0
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)  # cpu: 2, memory: 8Gi
    workdir: str = "/workspace/llmfoundry"  # the repository's checkout in the image
    serve_args: list[str] = field(default_factory=list)  # more flags for scripts/serve.py
    vllm_args: list[str] = field(default_factory=list)  # more flags for `vllm serve`
    drain_timeout: int = 60


def load_spec(path: str, overrides: list[str] = (), engine: str | None = None) -> DeploySpec:
    """The spec of `path` with `key=value` overrides; the error names a bad or missing key."""
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(DeploySpec),
            OmegaConf.load(path),
            OmegaConf.from_dotlist(list(overrides)),
        )
        if engine is not None:
            merged.engine = engine
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise UserError(f"{path}: set {', '.join(missing)} (in the file or as key=value)")
        spec = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        where = f"{path}: {key}" if key else path
        raise UserError(f"{where}: {str(err).splitlines()[0]}") from None
    except yaml.YAMLError as err:  # a value YAML cannot read (a backtick, an unclosed quote)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(
            f"{path} or its overrides: YAML cannot read a value ({problem}); quote it, e.g. "
            "key='value'"
        ) from None
    assert isinstance(spec, DeploySpec)
    _check(spec)
    return spec


def _check(spec: DeploySpec) -> None:
    if spec.engine not in ENGINES:
        raise UserError(f"engine {spec.engine!r} is not one of {', '.join(ENGINES)}")
    if spec.replicas < 1 or not 0 < spec.port < 65536 or spec.gpus < 0:
        raise UserError(
            f"replicas ({spec.replicas}) must be >= 1, port ({spec.port}) in 1..65535 and gpus "
            f"({spec.gpus}) >= 0"
        )
    if spec.engine == "vllm" and spec.gpus < 1:
        raise UserError("engine vllm runs on GPUs: set gpus=1 (or more)")
    unknown = set(spec.resources) - {"requests", "limits"}
    if unknown:
        raise UserError(f"resources takes requests and limits, not {', '.join(sorted(unknown))}")
    options, overrides = parse_settings(spec.storage)
    for where, values in [("options", options), *(("overrides", o) for o in overrides.values())]:
        secret = next((k for k in values if is_secret(k)), None)
        if secret:
            raise UserError(
                f"storage.{where}: {secret!r} is a credential, which the manifest would show; "
                "put it in the Secret named by storage_secret.name instead"
            )
    names = spec.storage_secret.keys
    if spec.storage_secret.name and (not names or not all(ENV_NAME.match(n) for n in names)):
        raise UserError(
            f"storage_secret.keys: {names!r} must be environment variable names (the Secret's "
            "keys, e.g. [AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY])"
        )
    if spec.engine == "vllm" and (overrides or set(options) - set(VLLM_STORAGE_ENV)):
        raise UserError(
            "engine vllm reads object stores with its own client, which takes only "
            f"storage.options {' and '.join(VLLM_STORAGE_ENV)}; remove the other storage settings"
        )


def _container(spec: DeploySpec, name: str) -> dict[str, Any]:
    secret = {"secretKeyRef": {"name": spec.api_key_secret.name, "key": spec.api_key_secret.key}}
    options, overrides = parse_settings(spec.storage)  # (null options unset)
    if spec.engine == "vllm":
        command = vllm_command(spec.model, "0.0.0.0", spec.port, name) + list(spec.vllm_args)
        env = [{"name": API_KEY_ENV, "valueFrom": secret}]
        env += [{"name": VLLM_STORAGE_ENV[k], "value": str(v)} for k, v in options.items()]
    else:
        command = ["python", "scripts/serve.py", spec.model, "--host", "0.0.0.0"]
        command += ["--port", str(spec.port), "--model-name", name]
        command += ["--drain-timeout", str(spec.drain_timeout), *spec.serve_args]
        settings = {k: v for k, v in [("options", options), ("overrides", overrides)] if v}
        if settings:
            command += ["--storage", json.dumps(settings, sort_keys=True)]
        env = [{"name": API_KEY_ENV_LLMFOUNDRY, "valueFrom": secret}]
    storage_secret = spec.storage_secret
    if storage_secret.name:
        env += [
            {"name": key, "valueFrom": {"secretKeyRef": {"name": storage_secret.name, "key": key}}}
            for key in storage_secret.keys
        ]
    # Quantities are strings in the API; `cpu: 2` (an int in YAML) means "2".
    resources = {
        kind: {k: str(v) for k, v in values.items()} for kind, values in spec.resources.items()
    }
    if spec.gpus:
        for kind in ("requests", "limits"):
            resources.setdefault(kind, {})["nvidia.com/gpu"] = str(spec.gpus)
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    container = {
        "name": "server",
        "image": spec.image,
        "command": command,
        "env": env,
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "readinessProbe": {**probe, "initialDelaySeconds": 5, "periodSeconds": 5},
        # Loading a large model takes minutes: liveness starts late, and only restarts a pod
        # after it has failed for a minute.
        "livenessProbe": {
            **probe,
            "initialDelaySeconds": 120,
            "periodSeconds": 20,
            "failureThreshold": 3,
        },
    }
    if spec.engine == "llmfoundry":
        container["workingDir"] = spec.workdir
    if resources:
        container["resources"] = resources
    return container


def render(spec: DeploySpec) -> list[dict[str, Any]]:
    """The Deployment and the Service for `spec`, as the Kubernetes API's JSON."""
    name = spec.model_name or spec.name
    labels = {"app.kubernetes.io/name": "llmfoundry-serve", "app.kubernetes.io/instance": spec.name}
    metadata: dict[str, Any] = {"name": spec.name, "labels": labels}
    if spec.namespace:
        metadata["namespace"] = spec.namespace
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [_container(spec, name)],
                    "terminationGracePeriodSeconds": spec.drain_timeout + 10,
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": "ClusterIP",
            "selector": labels,
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return [deployment, service]


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """A multi-document YAML file for `kubectl apply -f`."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # the shared labels written out, no &anchors
            return True

    return yaml.dump_all(objects, Dumper=Dumper, sort_keys=False)
