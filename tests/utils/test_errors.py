"""User errors become one line and exit status 2; bugs keep their traceback."""

import errno

import pytest
from hydra.errors import InstantiationException

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
