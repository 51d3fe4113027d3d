"""Object-store settings in one place, as a user of MinIO, R2 or moto sets them.

Only the endpoint is configured (data_prep's ``--storage``, the training config's ``storage:``
block; credentials in the environment); no ``data.storage_options``, no ``AWS_ENDPOINT_URL``.
Without the setting every ``s3://`` URL would go to AWS. The whole path goes through it: data
prep writes the shards and the tokenizer to the bucket, mds_tools verifies them there, training
reads the data, the generate callback reads the tokenizer, and checkpoints are saved to and
resumed from the bucket.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs scripts in subprocesses; `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "foundry-storage-e2e"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    env.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_storage_block_reaches_data_tokenizer_checkpoints_and_data_prep(s3_endpoint, tmp_path):
    s3fs = pytest.importorskip("s3fs")
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key="testing", secret="testing")
    fs.mkdir(BUCKET)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, path in enumerate(sorted((ROOT / "llmfoundry").rglob("*.py"))[:12]):
        (corpus / f"doc{i}.txt").write_text(path.read_text())
    run("data_prep/text_to_tokens.py", str(corpus), "--train-tokenizer", "--vocab-size", "300",
        "--out", str(tmp_path / "tokens.bin"), "--no-progress", cwd=ROOT)  # fmt: skip
    settings = f"{{options: {{endpoint_url: '{s3_endpoint}'}}}}"
    mds = f"s3://{BUCKET}/mds"
    run("data_prep/tokens_to_mds.py", str(tmp_path / "tokens.bin"), "--out", mds,
        "--seq-len", "32", "--val-rows", "8", "--no-progress", "--storage", settings, cwd=ROOT)  # fmt: skip
    settings_file = tmp_path / "storage.yaml"
    settings_file.write_text(f"options:\n  endpoint_url: {s3_endpoint}\n")
    verified = run(
        "data_prep/mds_tools.py", "verify", mds, "--storage", str(settings_file), cwd=ROOT
    )
    assert "FAILED" not in verified.stdout and verified.stdout.count(": OK") == 2

    def train(*extra: str) -> subprocess.CompletedProcess:
        return run(
            str(ROOT / "scripts" / "train.py"),
            f"storage.options.endpoint_url={s3_endpoint}",
            f"data.remote={mds}",
            f"data.local={tmp_path / 'cache'}",
            "model.d_model=32",
            "model.n_heads=2",
            "model.n_layers=1",
            "model.max_seq_len=32",
            "model.vocab_size=300",
            "global_train_batch_size=4",
            "scheduler.t_warmup=1ba",
            "eval_interval=2ba",
            "eval_subset_num_batches=1",
            "callbacks.generate.max_new_tokens=4",
            "loggers=[console]",
            "run_name=s3run",
            f"save_folder=s3://{BUCKET}/runs/s3run",
            "save_interval=2ba",
            "autoresume=true",
            *extra,
            cwd=tmp_path,
        )

    first = train("max_duration=2ba")
    assert "--- sample" in first.stdout  # the tokenizer came from s3://.../mds/tokenizer.json
    assert fs.cat(f"{BUCKET}/runs/s3run/latest").decode().strip() == "ep0-ba2"
    resumed = train("max_duration=4ba")
    assert "ep0-ba2" in resumed.stdout + resumed.stderr  # resumed from the bucket's checkpoint
    assert fs.cat(f"{BUCKET}/runs/s3run/latest").decode().strip() == "ep0-ba4"
