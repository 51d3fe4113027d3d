"""Chat templates render as transformers renders them, within a bound on what they build: a
template that would build past it (as a constant, or for given messages) is refused before it
builds it, through every entry point that renders templates (serving and data prep).

The bombs build 32-128 MB where nothing bounds them (a few tenths of a second), so the tests
fail on code without the bound rather than exhaust the machine."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from llmfoundry.data.prep import train_bpe
from llmfoundry.data.prep.instructions import Formatter
from llmfoundry.serving.tokenizer import ChatTemplateError, load_served_tokenizer
from llmfoundry.tokenizers.tokenizer import EOS_TOKEN
from llmfoundry.utils.errors import UserError

transformers = pytest.importorskip("transformers")

TEXTS = ["hello world, hello template\n", "<|im_start|>user\nhi<|im_end|>\n"] * 20
BIG = 1 << 26  # past the bound (TEMPLATE_CHARS), small enough to build where nothing bounds it
# Behind a special token (a template is given them when it is tried at load, too).
CONSTANT_BOMB = (
    "{{ eos_token + '\\n' }}{% set a = 'x' * " + str(BIG) + " %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(TEXTS, vocab_size=300).save(str(path))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token=EOS_TOKEN, bos_token=EOS_TOKEN
    )


@pytest.fixture
def folder_with(tmp_path, hf_tokenizer):
    """A transformers tokenizer folder whose config carries `template`."""

    def make(template: str):
        folder = tmp_path / "hf"
        hf_tokenizer.chat_template = template
        hf_tokenizer.save_pretrained(folder)
        return str(folder)

    return make


def test_a_constant_bomb_is_refused_at_load_unbuilt(folder_with):
    folder = folder_with(CONSTANT_BOMB)
    start = time.monotonic()
    with pytest.raises(UserError, match=r"hf builds more than \d+ characters .*\(at '\*'\)"):
        load_served_tokenizer(folder)
    with pytest.raises(UserError, match="builds more than"):
        Formatter(folder)  # data prep's entry point
    # jinja2 folds the constant when it compiles: a fraction of a second without it, seconds
    # (and 1.4 GB at 10**9) with it; generous, so a loaded machine passes
    assert time.monotonic() - start < 30


# Each builds 64-68 MB for a first message of 64 characters, by another road, and little for
# the one-word message a template is tried on at load.
RUNTIME_BOMBS = {
    "repetition": "{{ 'x' * (messages[0].content|length * 2**20) }}",
    "list repetition": "{{ [messages[0].content] * (messages[0].content|length * 2**14) }}",
    "concatenation in a loop": (
        "{% set ns = namespace(s='x') %}{% for i in range(messages[0].content|length // 2 - 6) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
    ),
    "addition in a loop": (
        "{% set ns = namespace(s='x') %}{% for i in range(messages[0].content|length // 2 - 6) %}"
        "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}"
    ),
    "output": (
        "{% set s = messages[0].content * 2**12 %}"
        "{% for i in range(messages[0].content|length * 4) %}{{ s }}{% endfor %}"
    ),
    "template text": (
        "{% for i in range(messages[0].content|length * 2**8) %}" + "t" * 4096 + "{% endfor %}"
    ),
    "macro output": (
        "{% macro m(s) %}{% for i in range(256) %}{{ s }}{% endfor %}{% endmacro %}"
        "{{ m(messages[0].content * (messages[0].content|length * 64))|length }}"
    ),
    "join": "{{ ([messages[0].content] * (messages[0].content|length * 2**14))|join('') }}",
    "center": "{{ messages[0].content|center(messages[0].content|length * 2**20) }}",
    "indent": "{{ ((messages[0].content ~ '\n') * 4096)|indent(messages[0].content|length * 2**8) }}",
    "tojson": "{{ [[[messages[0].content]]]|tojson(indent=messages[0].content|length * 2**16) }}",
    "str method": "{{ messages[0].content.ljust(messages[0].content|length * 2**20) }}",
    "percent format": "{{ '%*s' % (messages[0].content|length * 2**20, 'x') }}",
    "str.format": "{{ '{:>{}}'.format('x', messages[0].content|length * 2**20) }}",
    "format filter": "{{ '%*s'|format(messages[0].content|length * 2**20, 'x') }}",
    "replace": "{{ (messages[0].content * 1024)|replace('y', 'z' * 1024) }}",
    "expandtabs": "{{ ('\\t' * (messages[0].content|length * 16)).expandtabs(2**16) }}",
    "to_bytes": "{{ (1).to_bytes(messages[0].content|length * 2**20, 'big')|length }}",
}
LONG = [{"role": "user", "content": "y" * 64}]


@pytest.mark.parametrize("template", RUNTIME_BOMBS.values(), ids=RUNTIME_BOMBS.keys())
def test_a_bomb_for_given_messages_is_refused_before_it_builds(folder_with, template):
    folder = folder_with(template)
    tokenizer = load_served_tokenizer(folder)  # the one-word probe builds little
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError, match=r"built more than \d+ characters"):
            tokenizer.render_chat(LONG)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**25, f"{peak / 2**20:.0f} MiB held before the refusal"


def test_data_prep_renders_in_the_same_bounds(folder_with):
    template = RUNTIME_BOMBS["concatenation in a loop"]
    formatter = Formatter(folder_with(template))
    with pytest.raises(ChatTemplateError, match="built more than"):
        formatter.encode([*LONG, {"role": "assistant", "content": "z"}])


def test_the_bound_is_below_the_bombs():
    from llmfoundry.data.prep.chat_template import TEMPLATE_CHARS

    assert TEMPLATE_CHARS * 2 < BIG


def test_integers_are_bounded():
    from llmfoundry.data.prep.chat_template import ChatTemplate

    template = ChatTemplate("{{ 10 ** ((messages[0].content|length - 2) * 10**5) }}", "test")
    with pytest.raises(ChatTemplateError, match="an integer of .* bits from '\\*\\*'"):
        template.render(LONG, add_generation_prompt=True)


def test_a_template_does_not_build_its_constants_when_it_compiles():
    """jinja2 folds constant expressions when it compiles, outside any budget."""
    from llmfoundry.data.prep.chat_template import ChatTemplate

    tracemalloc.start()
    try:
        template = ChatTemplate(
            '{% if messages|length > 1 %}{{ "x" * 2**27 }}{% endif %}ok', "test"
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**24
    assert template.render(LONG, add_generation_prompt=True) == "ok"


# Templates of the kinds models ship: ChatML, Llama 2 (raise_exception, bos_token, slicing),
# tools as JSON, namespace and loop controls, `{% generation %}`.
TEMPLATES = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
        "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}"
        "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
        "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
        "{% endif %}{% endfor %}"
    ),
    "tools and namespace": (
        "{%- set ns = namespace(found=false, n=0) -%}"
        "{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.found = true -%}"
        "{%- continue -%}{%- endif -%}{%- set ns.n = ns.n + 1 -%}"
        "[{{ loop.index }}/{{ ns.n }}] {{ m.role|upper }}: {{ m.content|trim|tojson }}\n"
        "{%- if loop.last %}{{ {'tools': [1, 2.5, none, 'a<b'], 'k': (1, 2)}|tojson(indent=2) }}"
        "{{ dict(a=1)|items|list }} {{ '%s-%05.1f' % ('x', 3.14159) }} "
        "{{ '{}+{:>4}'.format('a', 7) }} {{ ['a', 'b']|join(', ') }} {{ range(3)|list }}"
        "{%- endif -%}{%- endfor -%}{{ ns.found }}"
    ),
    "generation": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{{ eos_token }}{% endgeneration %}{% else %}{{ m.content ~ ' ' }}{% endif %}{% endfor %}"
    ),
}
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": " hi <there> "},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "more"},
]


@pytest.mark.parametrize("template", TEMPLATES.values(), ids=TEMPLATES.keys())
@pytest.mark.parametrize("prompt", [True, False])
def test_templates_render_as_transformers_renders_them(hf_tokenizer, template, prompt):
    from llmfoundry.data.prep.chat_template import ChatTemplate

    expected = hf_tokenizer.apply_chat_template(
        CONVERSATION, chat_template=template, tokenize=False, add_generation_prompt=prompt
    )
    rendered = ChatTemplate(template, "test").render(
        CONVERSATION, prompt, hf_tokenizer.special_tokens_map
    )
    assert rendered == expected


def test_a_refusal_names_the_template_error():
    from llmfoundry.data.prep.chat_template import ChatTemplate

    template = ChatTemplate(TEMPLATES["llama2"], "test")
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="refused these messages: Conversation roles"):
        template.render(two_users, True, {"bos_token": "<s>", "eos_token": "</s>"})
