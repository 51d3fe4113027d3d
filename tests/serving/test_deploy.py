"""conf/deploy/*.yaml -> a Deployment and a Service the official Kubernetes client accepts;
scripts/serve.py --engine vllm refuses clearly where vLLM or an exported folder is missing."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import yaml

from llmfoundry.serving.deploy import load_spec, render
from llmfoundry.serving.vllm import vllm_command
from llmfoundry.utils import storage
from tests.k8s import validated

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "conf" / "deploy" / "demo.yaml")
VLLM = str(ROOT / "conf" / "deploy" / "vllm.yaml")
SECRET_VALUE = "sk-do-not-render-me"


def script(name: str):
    return runpy.run_path(str(ROOT / "scripts" / f"{name}.py"), run_name=name)["main"]


@pytest.fixture(autouse=True)
def _kubernetes():
    pytest.importorskip("kubernetes")


def test_render_demo_deployment_and_service(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMFOUNDRY_API_KEY", SECRET_VALUE)
    out = tmp_path / "serve.yaml"
    assert (
        script("deploy")(
            [
                "render",
                DEMO,
                "image=reg/llmfoundry:1",
                "replicas=3",
                "resources.limits.cpu=6",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    text = out.read_text()
    assert SECRET_VALUE not in text
    deployment, service = yaml.safe_load_all(text)
    assert validated(deployment, "V1Deployment") == deployment
    assert validated(service, "V1Service") == service
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert pod["terminationGracePeriodSeconds"] > 60  # the drain fits before SIGKILL
    (container,) = pod["containers"]
    assert container["command"][:5] == [
        "python",
        "scripts/serve.py",
        "s3://my-bucket/runs/demo/checkpoints",
        "--host",
        "0.0.0.0",
    ]
    assert "--max-concurrent" in container["command"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["env"] == [
        {
            "name": "LLMFOUNDRY_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "llmfoundry-api-key", "key": "api-key"}},
        },
        *STORAGE_SECRET_ENV,
    ]
    assert "--storage" not in container["command"]  # no endpoint set: the environment's store
    assert container["resources"]["limits"] == {"cpu": "6", "memory": "8Gi"}
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]


# The demo's storage_secret: the pods' object-store credentials, from the Secret's keys.
STORAGE_SECRET_ENV = [
    {"name": key, "valueFrom": {"secretKeyRef": {"name": "llmfoundry-storage", "key": key}}}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
]


def test_a_model_on_an_s3_compatible_store_gets_its_storage_settings_and_credentials():
    endpoint = "storage.options.endpoint_url=http://minio.minio:9000"
    deployment, _ = render(load_spec(DEMO, ["image=x", endpoint, "storage.options.profile=r"]))
    assert validated(deployment, "V1Deployment") == deployment
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["env"][1:] == STORAGE_SECRET_ENV
    # The pods' scripts/serve.py reads the model with the settings, as the training run wrote it.
    serve = runpy.run_path(str(ROOT / "scripts" / "serve.py"), run_name="serve")
    args = serve["parse_args"](container["command"][2:])
    assert args.model == "s3://my-bucket/runs/demo/checkpoints"
    storage.configure_settings(storage.load_settings(args.storage))
    assert storage.options_for(args.model) == {
        "endpoint_url": "http://minio.minio:9000",
        "profile": "r",
    }
    # vLLM's own client gets them as its environment variables.
    spec = load_spec(VLLM, ["model=s3://my-bucket/hf", endpoint])
    (container,) = render(spec)[0]["spec"]["template"]["spec"]["containers"]
    assert container["env"][1:] == [
        {"name": "AWS_ENDPOINT_URL", "value": "http://minio.minio:9000"},
        *STORAGE_SECRET_ENV,
    ]
    # Without a Secret (workload identity), no credentials are referenced.
    deployment, _ = render(load_spec(DEMO, ["image=x", "storage_secret.name=null"]))
    assert [e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]] == [
        "LLMFOUNDRY_API_KEY"
    ]


def test_engine_vllm_serves_the_hf_folder_on_a_gpu(capsys):
    spec = load_spec(DEMO, ["image=vllm/vllm-openai:v1", "model=/models/hf", "gpus=2"], "vllm")
    deployment, _ = render(spec)
    assert validated(deployment, "V1Deployment") == deployment
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == vllm_command("/models/hf", "0.0.0.0", 8000, "mpt-demo")
    assert container["command"][:3] == ["vllm", "serve", "/models/hf"]
    assert container["env"][0]["name"] == "VLLM_API_KEY"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert script("deploy")(["render", VLLM, "model=s3://b/hf"]) == 0
    assert "--max-model-len" in capsys.readouterr().out


def test_validation_catches_a_misspelt_field():
    deployment, _ = render(load_spec(DEMO, ["image=x"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    assert validated(deployment, "V1Deployment") != deployment


@pytest.mark.parametrize(
    ("config", "overrides", "engine", "message"),
    [
        (DEMO, [], None, "set image"),
        (VLLM, [], None, "set model"),
        (DEMO, ["image=x", "replica=2"], None, "Key 'replica' not in"),
        (DEMO, ["image=x", "api_key_secret.name=null"], None, "api_key_secret.name"),
        (DEMO, ["image=x"], "vllm", "engine vllm runs on GPUs: set gpus=1"),
        (DEMO, ["image=x", "port=0"], None, "port (0) in 1..65535"),
        (DEMO, ["image=x", "resources.limit.cpu=1"], None, "not limit"),
        (DEMO, ["image=x", "storage.option.x=1"], None, "storage.option: unknown key"),
        (DEMO, ["image=x", "storage.options.secret=s"], None, "'secret' is a credential"),
        (DEMO, ["image=x", "storage_secret.keys=[a-b]"], None, "storage_secret.keys"),
        (VLLM, ["model=s3://b/x", "storage.options.anon=true"], None, "only storage.options"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(config, overrides, engine, message):
    with pytest.raises(ValueError) as err:
        load_spec(config, overrides, engine)
    assert message in str(err.value)


def test_server_binds_loopback_unless_told():
    parse = runpy.run_path(str(ROOT / "scripts" / "serve.py"), run_name="serve")["parse_args"]
    assert parse(["ckpt"]).host == "127.0.0.1"


def refused(argv: list[str], capsys) -> str:
    """serve.py's one-line refusal (exit 2) of `argv`."""
    with pytest.raises(SystemExit) as exit_:
        script("serve")(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_serve_engine_vllm_refusals(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLMFOUNDRY_API_KEY", raising=False)
    assert "is not one; export the checkpoint first" in refused(
        [str(tmp_path), "--engine", "vllm"], capsys
    )
    (tmp_path / "config.json").write_text("{}")
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    assert "pip install 'llmfoundry[vllm]'" in refused([str(tmp_path), "--engine", "vllm"], capsys)


def test_serve_engine_vllm_command_maps_our_flags_and_refuses_the_rest():
    serve = runpy.run_path(str(ROOT / "scripts" / "serve.py"), run_name="serve")
    args = serve["parse_args"](
        ["hf/", "--engine", "vllm", "--dtype", "bf16", "--max-concurrent", "8", "--port", "9000"]
    )
    command = serve["vllm_args"](args, "mpt")
    assert command[:3] == ["vllm", "serve", "hf/"]
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert command[command.index("--max-num-seqs") + 1] == "8"
    assert command[command.index("--port") + 1] == "9000"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    limited = serve["parse_args"](["hf/", "--engine", "vllm", "--max-tokens", "64"])
    with pytest.raises(ValueError, match="--max-tokens apply to --engine llmfoundry only"):
        serve["vllm_args"](limited, "mpt")
    with_storage = serve["parse_args"](["hf/", "--engine", "vllm", "--storage", "{options: {}}"])
    with pytest.raises(ValueError, match="--storage apply to --engine llmfoundry only"):
        serve["vllm_args"](with_storage, "mpt")
