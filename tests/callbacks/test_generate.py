import pytest

from llmfoundry.callbacks import Generate


def test_missing_tokenizer_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"set tokenizer=.*leave out the samples"):
        Generate(tokenizer=str(tmp_path / "tokenizer.json"), prompts=["def "])
