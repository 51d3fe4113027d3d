"""Instruction data -> MDS (data/prep/instructions.py) and the loader's labels column."""

import json

import numpy as np
import pytest
import torch

from llmfoundry.data.prep import train_bpe
from llmfoundry.data.prep.docstrings import choice_task, docstring_examples
from llmfoundry.data.prep.instructions import (
    IGNORE,
    Formatter,
    Packer,
    instructions_to_mds,
    read_conversations,
)
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.data.text import StreamingTextDataset

TEXTS = ["def add(a, b):\n    return a + b\n", "Return the sum of a and b.", "### User:\n"] * 20


@pytest.fixture
def tokenizer(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(train_bpe(TEXTS, vocab_size=300).to_str())
    return str(path)


def _jsonl(path, examples):
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return str(path)


def test_only_response_tokens_and_eos_are_labelled(tokenizer):
    fmt = Formatter(tokenizer)
    ids, labels = fmt.encode(
        [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "Sum."}]
    )
    trained = labels != IGNORE
    assert np.array_equal(labels[trained], ids[trained])
    tok = fmt.prepared.tokenizer
    assert tok.decode(ids[~trained].tolist()) == "### User:\ndef add(a, b):\n\n### Assistant:\n"
    assert ids[-1] == fmt.prepared.eos_id and trained[-1]
    assert tok.decode(ids[trained].tolist()) == "Sum."


def test_pair_and_chat_forms_are_the_same_example(tmp_path):
    chat = {"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]}
    src = _jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "response": "r"}, chat])
    pair, conversation = read_conversations([src])
    assert pair == conversation == chat["messages"]


def test_packing_keeps_examples_whole_and_numbered():
    packer = Packer(seq_len=8, pad_id=0, window=2)
    examples = [np.arange(1, n + 1) for n in (5, 3, 4, 4, 2)]
    rows = []
    for ids in examples:
        rows += packer.add(ids, ids.copy())
    rows += packer.flush()
    seen = []
    for row in rows:
        for n in range(int(row["sequence_id"].max()) + 1):
            seen.append(row["tokens"][row["sequence_id"] == n].tolist())
        assert (row["labels"][row["sequence_id"] == -1] == IGNORE).all()
    assert sorted(seen) == sorted(e.tolist() for e in examples)
    assert packer.rows == 3 and packer.efficiency == pytest.approx(18 / 24)


def test_prep_writes_labels_the_loader_returns(tmp_path, tokenizer):
    examples = [
        {"prompt": f"def f{i}(x):", "response": "Return x." * (i % 3 + 1)} for i in range(30)
    ]
    examples.append(
        {
            "messages": [
                {"role": "system", "content": "Be short."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello."},
            ]
        }
    )
    examples.append({"prompt": "x" * 400, "response": "too long"})
    src = _jsonl(tmp_path / "sft.jsonl", examples)
    meta = instructions_to_mds([src], str(tmp_path / "mds"), tokenizer, 64, too_long="drop")
    assert meta["examples"] == 32 and meta["dropped_too_long"] == 1
    assert meta["packed"] and 0.5 < meta["packing_efficiency"] <= 1
    loader = StreamingDataLoader(
        StreamingTextDataset(str(tmp_path / "mds"), split="train", batch_size=4)
    )
    loader.set_epoch(0)
    fmt = Formatter(tokenizer)
    responses = 0
    for batch in loader:
        ids, labels, seq = batch["input_ids"], batch["labels"], batch["sequence_id"]
        assert ids.shape == labels.shape == seq.shape and ids.shape[1] == 64
        trained = labels != IGNORE
        assert torch.equal(labels[trained], ids[trained])
        responses += int((labels == fmt.prepared.eos_id).sum())
    assert responses == 31  # every kept example ends with a trained eos
    again = instructions_to_mds([src], str(tmp_path / "mds"), tokenizer, 64, too_long="drop")
    assert again["reused"]


def test_truncation_is_counted_and_responses_cut_away_are_dropped(tmp_path, tokenizer):
    src = _jsonl(
        tmp_path / "sft.jsonl",
        [
            {"prompt": "p " * 100, "response": "r"},
            {"prompt": "p", "response": "r " * 100},
            {"prompt": "a", "response": "b"},
        ],
    )
    meta = instructions_to_mds([src], str(tmp_path / "mds"), tokenizer, 32, pack=False)
    assert (meta["truncated"], meta["dropped_no_response"]) == (2, 1)
    assert meta["splits"]["train"]["rows"] == 2


@pytest.mark.parametrize(
    "line, message",
    [
        ({"prompt": "p"}, "'prompt' and 'response' must both be strings"),
        ({"text": "x"}, "needs 'prompt' and 'response', or 'messages'"),
        ({"messages": [{"role": "user", "content": "q"}]}, "no assistant message"),
        ({"messages": [{"role": "bot", "content": "q"}]}, "messages[0] must be"),
    ],
)
def test_bad_examples_name_the_line(tmp_path, tokenizer, line, message):
    src = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, line])
    with pytest.raises(ValueError, match="line 2") as err:
        instructions_to_mds([src], str(tmp_path / "mds"), tokenizer, 32)
    assert message in str(err.value)


def test_chat_template_of_a_transformers_folder_marks_assistant_turns(tmp_path, tokenizer):
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    tok.add_special_tokens(
        [AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)]
    )
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    fmt = Formatter(str(folder))
    assert fmt.uses_chat_template
    ids, labels = fmt.encode(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ans"}]
    )
    end = tok.token_to_id("<|im_end|>")
    assert tok.token_to_id("<|im_start|>") in ids.tolist()  # encoded as one special token
    trained = labels != IGNORE
    assert hf.decode(ids[trained].tolist()) == "ans<|im_end|>\n"
    assert end in ids[trained].tolist()


def test_docstring_examples_pair_signatures_with_first_paragraphs():
    source = 'def area(w: int, h: int = 1) -> int:\n    """Area of a box.\n\n    More."""\n'
    assert list(docstring_examples(source)) == [
        {"prompt": "def area(w: int, h: int=1) -> int:", "response": "Area of a box."}
    ]


def test_prompt_is_the_untrained_text_before_the_response(tokenizer):
    fmt = Formatter(tokenizer)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ids, labels = fmt.encode(messages)
    first = int(np.argmax(labels != IGNORE))
    assert fmt.prompt(messages) == "### User:\nq\n\n### Assistant:\n"
    assert fmt.prepared.tokenizer.decode(ids[:first].tolist()) == fmt.prompt(messages)


def test_choice_task_hides_the_answer_among_others():
    examples = [{"prompt": f"def f{i}():", "response": f"Doc {i}."} for i in range(10)]
    lines = choice_task(examples, n_choices=4, seed=3)
    assert lines == choice_task(examples, n_choices=4, seed=3)
    for ex, line in zip(examples, lines, strict=True):
        assert line["query"] == ex["prompt"] and len(set(line["choices"])) == 4
        assert line["choices"][line["gold"]] == ex["response"]
    assert len({line["gold"] for line in lines}) > 1
    with pytest.raises(ValueError, match="fewer than 4 choices"):
        choice_task(examples[:3])


def test_inputs_and_output_on_an_object_store(tmp_path, tokenizer):
    import fsspec

    fs = fsspec.filesystem("memory")
    rows = [{"prompt": f"p{i}", "response": "r"} for i in range(5)]
    fs.pipe_file("/sft/in.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    meta = instructions_to_mds(["memory://sft/in.jsonl"], "memory://sft/out", tokenizer, 32)
    assert meta["examples"] == 5 and fs.exists("/sft/out/train/index.json")
    assert json.loads(fs.cat_file("/sft/out/meta.json"))["fingerprint"] == meta["fingerprint"]


def test_cli_refuses_an_example_line_past_max_example_bytes_in_one_line(
    tmp_path, tokenizer, capsys
):
    from data_prep.instructions_to_mds import main

    src = tmp_path / "big.jsonl"
    src.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n"
                   + json.dumps({"prompt": "p" * 5000, "response": "r"}) + "\n")  # fmt: skip
    argv = [str(src), "--out", str(tmp_path / "mds"), "--tokenizer", tokenizer, "--seq-len", "32"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--max-example-bytes", "4kb"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--max-example-bytes in data_prep/instructions_to_mds.py)")
    assert f"{src} line 2: longer than 4,096 bytes" in err and len(err.splitlines()) == 1
    assert main([*argv, "--max-example-bytes", "1mb"]) == 0
