"""User errors become one line and exit status 2; bugs keep their traceback."""

import errno
import signal

import pytest
from hydra.errors import InstantiationException

from llmfoundry.utils import errors
from llmfoundry.utils.errors import MissingInput, UserError, exit_on_user_error


def test_user_error_wrapped_by_hydra_is_one_line(capsys):
    with pytest.raises(SystemExit) as info, exit_on_user_error(debug=False):
        try:
            raise UserError("strategy=ddp needs torchrun:\n launch with torchrun")
        except UserError as err:
            raise InstantiationException("Error in call to target") from err
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: strategy=ddp needs torchrun: launch with torchrun\n"


def test_debug_keeps_the_exception():
    with pytest.raises(MissingInput), exit_on_user_error(debug=True):
        raise MissingInput("no data at /x")


def test_bugs_keep_their_traceback():
    with pytest.raises(KeyError), exit_on_user_error(debug=False):
        raise KeyError("bug")


def test_full_disk_names_the_path_and_the_fix(capsys):
    with pytest.raises(SystemExit), exit_on_user_error(debug=False):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/ckpt/model.safetensors")
    line = capsys.readouterr().err
    assert line == (
        "error: No space left on device: /runs/x/ckpt/model.safetensors; free space there or "
        "point the run at another folder\n"
    )


def test_url_passwords_are_hidden(capsys):
    with pytest.raises(SystemExit), exit_on_user_error(debug=False):
        raise MissingInput("no MDS dataset at s3://bob:hunter2@minio/b")
    assert "hunter2" not in capsys.readouterr().err


@pytest.mark.parametrize("broad", [ValueError, FileNotFoundError, LookupError, Exception])
def test_a_builtin_error_type_is_refused_as_also(broad):
    """A built-in type is what bugs raise too: catching it would print a bug as one line."""
    with (
        pytest.raises(TypeError, match="raise UserError"),
        exit_on_user_error(False, also=(broad,)),
    ):
        pass


def test_a_torchrun_rank_but_0_prints_only_if_torchrun_has_not_stopped_it(capsys, monkeypatch):
    """Rank 0 prints a user error every rank shares (tests/distributed/test_launch.py); another
    rank waits for torchrun to stop it (SIGTERM: exit 2, silent) and prints only an error of its
    own, naming its rank."""
    waited, handlers = [], {}
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(errors.time, "sleep", waited.append)
    monkeypatch.setattr(errors.signal, "signal", handlers.__setitem__)
    with pytest.raises(SystemExit) as info, exit_on_user_error(debug=False):
        raise UserError("no data at /x on this node")
    assert info.value.code == 2 and waited == [errors.PEER_GRACE_S]
    assert signal.SIGTERM in handlers
    assert capsys.readouterr().err == "error (rank 3): no data at /x on this node\n"
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit), exit_on_user_error(debug=False):
        raise UserError("no data at /x")
    assert waited == [errors.PEER_GRACE_S] and capsys.readouterr().err == "error: no data at /x\n"
