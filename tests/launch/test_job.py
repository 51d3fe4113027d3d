"""The job file: schema checked with the training config's one-line errors; GPUs -> nodes."""

from pathlib import Path

import pytest

from llmfoundry.config import ConfigError
from llmfoundry.launch import load_job, plan
from llmfoundry.launch.job import Compute

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "conf/job" / "tiny.yaml"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_example_job_loads_and_overrides_apply():
    job = load_job(EXAMPLE, ["compute.gpus=24", "slurm.partition=h100", "name=big"])
    assert job.name == "big"
    assert job.compute.gpus == 24
    assert job.slurm.partition == "h100"
    assert job.train == ["max_duration=300ba"]


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("name: a\ncompute: {gpu: 8}", [], "compute.gpu: unknown key; did you mean 'gpus'?"),
        ("name: a\ncompute: {gpus: eight}", [], "compute.gpus: expected int, got 'eight'"),
        ("name: a\ncompute: {gpus: -8}", [], "compute.gpus: must be >= 0, got -8"),
        ("name: My_Run", [], "name: 'My_Run' must be lowercase letters"),
        ("image: x", [], "missing required key(s) name"),
        ("name: a\nenv: {TOKEN: x}\nsecrets: [TOKEN]", [], "env.TOKEN: also listed in secrets"),
        ("name: a\nenv: {N: 1}", [], "env.N: expected a string, got 1; quote it"),
        ("name: a\nsecrets: [not-a-name]", [], "secrets: 'not-a-name' is not a valid"),
        ("name: a\ntrain: [--lr]", [], "train: '--lr' is not a key=value override"),
        ("name: a\nsetup: [1]", [], "setup: expected strings, got 1; quote it"),
        ("name: a\ncode: {branch: main}", [], "code.branch/commit: set code.repo"),
        ("name: a", ["slurm.partiton=x"], "slurm.partiton: unknown key; did you mean 'partition'?"),
        # A line break in any field rendered as an #SBATCH line would run as shell on the node.
        (
            'name: a\nslurm: {partition: "gpu\\ntouch /tmp/pwned"}',
            [],
            "slurm.partition: 'gpu\\ntouch",
        ),
        ('name: a\nslurm: {account: "me\\nid"}', [], "slurm.account: 'me\\nid' is not a Slurm"),
        (
            'name: a\nslurm: {time: "1:00:00\\nid"}',
            [],
            "slurm.time: '1:00:00\\nid' is not a Slurm time",
        ),
        ("name: a\nslurm: {time: 2 days}", [], "slurm.time: '2 days' is not a Slurm time limit"),
        (
            'name: a\ncompute: {memory: "8G\\nid"}',
            [],
            "compute.memory: '8G\\nid' is not a memory size",
        ),
        (
            'name: a\nslurm: {directives: ["--qos=high\\nid"]}',
            [],
            "slurm.directives: '--qos=high\\nid' is not one",
        ),
        ("name: a\nslurm: {directives: [qos=high]}", [], "slurm.directives: 'qos=high' is not one"),
        ("name: a", ["slurm.partition=`id`"], "or its overrides: YAML cannot read a value (found"),
        # Values that would be written in clear into the rendered script and manifest.
        ("name: a\nenv: {WANDB_API_KEY: abc}", [], "env.WANDB_API_KEY: named like a secret"),
        ("name: a\nenv: {HF_TOKEN: abc}", [], "list HF_TOKEN under secrets: instead"),
        (
            "name: a\ncode: {repo: 'https://me:ghp_x@github.com/o/r'}",
            [],
            "code.repo: the URL holds a password",
        ),
        # A token alone reads as the user name of an https URL.
        ("name: a\ncode: {repo: 'https://ghp_x@github.com/o/r'}", [], "secrets: [GIT_TOKEN]"),
        (
            "name: a\ntrain: ['load_path=s3://AKIA:pw@b/x']",
            [],
            "train: 'load_path=s3://<redacted>@b/x' holds credentials in a URL",
        ),
        ("name: a\ntrain: [+storage.options.secret=pw]", [], "read it in the override"),
        ("name: a\ntrain: ['data.remote=https://tok@host/d']", [], "through secrets: (e.g."),
        (
            "name: a",
            ["env.DATABASE_URL=postgres://u:pass@db/x"],
            "env.DATABASE_URL: 'postgres://<redacted>@db/x' holds credentials in a URL",
        ),
        (
            "name: a\nenv: {PIP_EXTRA_INDEX_URL: 'https://tok@pypi.example.com/simple'}",
            [],
            "list PIP_EXTRA_INDEX_URL under secrets: instead",
        ),
        ("name: a\nenv: {REDIS: 'redis://:pw@cache:6379'}", [], "env.REDIS: 'redis://<redacted>@"),
        ('name: a\noutputs: "runs\\nid"', [], "outputs: 'runs\\nid' is not a folder or URL"),
        ("name: a\noutputs: ''", [], "outputs: '' is not a folder or URL"),
        ("name: a\noutputs: 's3://k:pw@b/r'", [], "outputs: 's3://<redacted>@b/r' holds"),
    ],
)
def test_bad_job_files_get_one_line_errors(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError) as info:
        load_job(write(tmp_path, text), overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_slurm_fields_in_their_usual_forms_load(tmp_path):
    job = load_job(
        write(tmp_path, "name: a"),
        ["slurm.partition=h100,a100", "slurm.account=proj-42", "slurm.time=2-00:00:00",
         "compute.memory=512G", "slurm.directives=[--qos=high,--constraint=h100&ib]"],
    )  # fmt: skip
    assert job.slurm.directives == ["--qos=high", "--constraint=h100&ib"]
    plain = load_job(write(tmp_path, "name: a\nenv: {TOKENIZERS_PARALLELISM: 'false'}"))
    assert plain.env == {"TOKENIZERS_PARALLELISM": "false"}
    users = {"DB": "postgres://me@db/x", "REMOTE": "ssh://git@github.com/o/r"}  # no secret
    assert (
        load_job(write(tmp_path, "name: a"), [f"env.{k}={v}" for k, v in users.items()]).env
        == users
    )
    assert load_job(write(tmp_path, "name: a\ncode: {repo: 'https://github.com/o/r'}")).code.repo
    ssh = load_job(write(tmp_path, "name: a\ncode: {repo: 'ssh://git@github.com/o/r'}"))
    assert ssh.code.repo == "ssh://git@github.com/o/r"  # a user name, no secret
    from_env = "+storage.options.secret='${oc.env:S3_SECRET}'"
    assert load_job(write(tmp_path, "name: a"), train=[from_env]).train == [from_env]
    for time in ("1-12", "1-12:30", "UNLIMITED"):  # (30:00 unquoted is YAML 1.1 for 1800)
        assert load_job(write(tmp_path, "name: a"), [f"slurm.time={time}"]).slurm.time == time


def test_missing_job_file_says_where_to_look(tmp_path):
    with pytest.raises(ConfigError, match="no job file at .*conf/job/tiny.yaml"):
        load_job(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("compute", "default", "expected"),
    [
        (Compute(gpus=24), 8, (3, 8)),
        (Compute(gpus=24, gpus_per_node=4), 8, (6, 4)),
        (Compute(gpus=4), 8, (1, 4)),
        (Compute(gpus=8), 8, (1, 8)),
        (Compute(gpus=16, nodes=2), 8, (2, 8)),
        (Compute(gpus=0, procs_per_node=2), 8, (1, 2)),
        (Compute(gpus=0, procs_per_node=4, nodes=3), 8, (3, 4)),
    ],
)
def test_gpus_become_nodes_times_processes(compute, default, expected):
    layout = plan(compute, default)
    assert (layout.nodes, layout.procs_per_node) == expected
    assert layout.world_size == expected[0] * expected[1]


@pytest.mark.parametrize(
    ("compute", "max_nodes", "message"),
    [
        (Compute(gpus=12), None, "12 GPUs do not fill whole nodes of 8; ask for 8 or 16"),
        (
            Compute(gpus=16, nodes=3),
            None,
            "compute.nodes: 3 nodes, but 16 GPUs on nodes of 8 make 2",
        ),
        (Compute(gpus=16), 1, "needs 2 nodes but this backend runs on 1"),
        (Compute(gpus=0, nodes=2), 1, "compute.nodes: needs 2 nodes"),
    ],
)
def test_impossible_requests_are_refused(compute, max_nodes, message):
    with pytest.raises(ConfigError) as info:
        plan(compute, 8, max_nodes=max_nodes)
    assert message in str(info.value)
