"""`kvjax.chat`: one layout of a user turn for every caller (the eval, `kvjax.run`'s jobs, KVzip's repeat prompt,
KVzap's calibration), checked against the tokenizer's own rendering of a whole chat; its refusals; and the callers
that used to render the template themselves (KVzip and KVzap split on a marker without a check: a template that
raised, or dropped the message, was a jinja2 traceback or an unpacking error)."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from kvjax.calibrate import kvzap
from kvjax.calibrate.__main__ import main as calibrate_main
from kvjax.chat import ChatTemplateError, use_chat_template, user_turn
from kvjax.engine.jobs import PromptEncoder as JobEncoder
from kvjax.errors import ConfigError
from kvjax.eval.runner import PromptEncoder as EvalEncoder
from kvjax.methods.kvzip import REPEAT_TEXT, prompt_ids
from kvjax.models.tokenizer import load_tokenizer

TINY = pathlib.Path(__file__).resolve().parents[1] / "kvjax" / "assets" / "kvjax-tiny"
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
NEEDS_SYSTEM = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
RAISES = NEEDS_SYSTEM + "x"
DROPS = "{% for m in messages %}[{{ m['role'] }}]{% endfor %}"


def _tokenizer(tmp_path: pathlib.Path, template: str | None):
    """kvjax-tiny's tokenizer with `template` as its chat template (None: none)."""
    folder = tmp_path / "tok"
    folder.mkdir(parents=True)
    shutil.copy(TINY / "tokenizer.json", folder)
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(str(folder))


def test_the_user_turn_is_the_templates_text_around_a_message(tmp_path):
    tok = _tokenizer(tmp_path, CHAT)
    before, after = user_turn(tok)
    message = "the context, then a question?"
    whole = tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                    add_generation_prompt=True)
    assert before + message + after == whole
    assert before == "<|user|>\n" and after == "<|end|>\n<|assistant|>\n"


@pytest.mark.parametrize("template, message", [
    (RAISES, "cannot render a user message (TemplateError: a system message first)"),
    (DROPS, "leaves out the user message's text"),
], ids=["raises", "drops"])
def test_a_template_that_cannot_lay_out_a_user_message_is_refused(tmp_path, template, message):
    tok = _tokenizer(tmp_path, template)
    with pytest.raises(ChatTemplateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        user_turn(tok)
    # KVzip's and KVzap's repeat prompts were a jinja2 traceback (RAISES) or "not enough values to unpack" (DROPS)
    with pytest.raises(ChatTemplateError, match="chat template"):
        prompt_ids(tok)
    with pytest.raises(ChatTemplateError, match="chat template"):
        kvzap.repeat_layout(tok)
    assert prompt_ids(tok, chat_template=False)["context_start"] == 0  # the template off: no rendering at all


@pytest.mark.parametrize("template, setting, expected", [
    (CHAT, "auto", True), (CHAT, "yes", True), (CHAT, "no", False), (None, "auto", False), (None, "no", False),
], ids=["template-auto", "template-yes", "template-no", "none-auto", "none-no"])
def test_the_settings(tmp_path, template, setting, expected):
    assert use_chat_template(_tokenizer(tmp_path, template), setting) is expected


def test_yes_without_a_template_and_an_unknown_setting_are_refused(tmp_path):
    tok = _tokenizer(tmp_path, None)
    with pytest.raises(ConfigError, match="--chat_template=yes but the tokenizer has no chat template"):
        use_chat_template(tok, "yes")
    with pytest.raises(ConfigError, match="--chat_template must be one of auto, yes, no, got 'sometimes'"):
        use_chat_template(tok, "sometimes")


def test_every_caller_lays_out_the_same_user_turn(tmp_path):
    """The eval's prompt, a job line's prompt, KVzip's repeat prompt and KVzap's calibration prompt all put the
    template's text before and after the user's text as the tokenizer renders a whole chat."""
    tok = _tokenizer(tmp_path, CHAT)
    before, after = (tok.encode(t, add_special_tokens=False) for t in user_turn(tok))
    body = "some context"
    whole = tok.encode(tok.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False)
    assert JobEncoder(tok, "auto").encode(body, None, None) == (whole, [])
    assert EvalEncoder(tok, "auto")._layout == user_turn(tok)
    ids = prompt_ids(tok)
    assert ids["context_start"] == len(before) and ids["suffix_ids"] == after
    opening, middle = kvzap.repeat_layout(tok)
    assert opening == before and middle == tok.encode(REPEAT_TEXT, add_special_tokens=False) + after


def test_a_job_encoder_refuses_prompts_but_renders_messages_under_a_template_that_needs_a_system_turn(tmp_path):
    """A template that refuses a lone user message still renders a chat that starts with a system message: the job
    refuses its 'prompt' lines, each naming the way out, and takes its 'messages' lines."""
    tok = _tokenizer(tmp_path, NEEDS_SYSTEM + CHAT)
    encoder = JobEncoder(tok, "auto")
    for _ in range(2):  # rendered once, refused every time
        with pytest.raises(ValueError, match="cannot render a user message .*: give the prompt as 'messages', or "
                                             "turn the template off with --chat_template=no"):
            encoder.encode("a prompt", None, None)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids, question = encoder.encode(None, chat, None)
    assert question == [] and tok.decode(ids).startswith("<|system|>")


def test_calibrate_refuses_a_broken_template_before_the_weights_load_and_takes_chat_template_no(tmp_path, capsys,
                                                                                                 monkeypatch):
    """`kvjax.calibrate --method=kvzap` on a model whose template refuses a user message: one line naming
    --chat_template=no (was a jinja2 traceback after the weights loaded); with that flag, the repeat prompt is the
    template-free one."""
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": RAISES}))
    import kvjax.models.model

    def no_load(*args, **kwargs):
        raise AssertionError("the weights loaded before the template was checked")

    monkeypatch.setattr(kvjax.models.model, "load_model", no_load)
    assert calibrate_main(["--method=kvzap", f"--model={model}", f"--out={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvzap's repeat prompt: the tokenizer's chat template cannot render a user " \
        "message (TemplateError: a system message first); pass --chat_template=no" in err, err
    seen, layout = [], kvzap.repeat_layout
    monkeypatch.setattr(kvzap, "repeat_layout", lambda tok, chat: seen.append(chat) or layout(tok, chat))
    with pytest.raises(AssertionError, match="the weights loaded"):  # past the template, to the weights
        calibrate_main(["--method=kvzap", f"--model={model}", f"--out={tmp_path / 'o'}", "--chat_template=no"])
    assert seen == [False]


def test_an_engine_builds_kvzips_repeat_prompt_with_its_tokenizer(tmp_path):
    """`Engine(method="kvzip", tokenizer=...)` replayed the bare context (a KVzip other than the eval's and
    `kvjax.run`'s) unless the caller built the prompt: it now takes it from the tokenizer, in the chat template's turn
    when there is one; a method given with its prompt, or a tokenizer that only decodes, leaves it as it is."""
    from kvjax import methods
    from kvjax.engine import Engine
    from kvjax.models.model import load_model

    model = load_model("kvjax-tiny")

    def engine(method, tokenizer):
        return Engine(model, method=method, max_prompt_tokens=32, max_new_tokens=4, slots=1, tokenizer=tokenizer)

    bare = methods.get("kvzip", budget=8)
    for template, chat in ((None, False), (CHAT, True)):
        tok = _tokenizer(tmp_path / str(chat), template)
        built = engine(bare, tok).method
        assert built == bare.with_tokenizer(tok, chat) and built.repeat_ids and built != bare
    given = methods.get("kvzip", budget=8, repeat_ids=[5], continue_ids=[6], suffix_ids=[7])
    assert engine(given, tok).method == given

    class DecodeOnly:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    assert engine(bare, DecodeOnly()).method == bare
    with pytest.raises(ConfigError, match="method 'kvzip': its repeat prompt cannot be built .*leaves out the user "
                                          "message's text.*with_tokenizer"):
        engine(bare, _tokenizer(tmp_path / "drops", DROPS))
