"""Every Python example of the README and docs/ runs as written.

A page's examples run in order in one namespace, as a reader would run them, with the names the prose leaves to the
reader (`model`, `tok`, `prompts`, ...) bound to the embedded `kvjax-tiny` model or a tiny Hugging Face checkpoint
(written with transformers: those tests skip without torch, as every Hugging Face-backed test does).
Only what cannot run here is edited: a path becomes a generated local file, and a length becomes a smaller one.
Each edit must find its text in the page (a changed example fails here, rather than running unedited), and every
example of every page must have a runner (a new one fails `test_every_example_has_a_runner` until it has one). Each
page's run checks what its examples promise: the answers, the cache's shape, the method's settings.

The documented command lines are checked too: each flag they pass is one that their command defines.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import subprocess
import sys

import hf_tiny
import jax
import jax.numpy as jnp
import learned_files
import numpy as np
import pytest
from cpu_flags import with_devices

import kvjax
from kvjax.errors import CheckpointError, ConfigError
from kvjax.models.char_tokenizer import save_char_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
HERE = pathlib.Path(__file__).resolve().parent


def examples(page: str) -> list[str]:
    """The ```python blocks of `page` (relative to the repository root), in order."""
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(encoding="utf-8"), flags=re.S)


def edit(code: str, *swaps: tuple[str, str]) -> str:
    """`code` with every `old` replaced by its `new`; each `old` must be there."""
    for old, new in swaps:
        assert old in code, f"the example no longer reads {old!r}; update tests/test_docs_examples.py"
        code = code.replace(old, new)
    return code


def run(code: str, scope: dict, name: str) -> dict:
    exec(compile(code, name, "exec"), scope)
    return scope


@pytest.fixture(scope="module")
def tiny():
    """The embedded model and its tokenizer, and a reader's prompts for it."""
    model, tok = kvjax.load_model("kvjax-tiny"), kvjax.load_tokenizer("kvjax-tiny")
    prompts = [tok.encode("The pass key is 42. Remember it. What is the pass key?"), tok.encode("Hello there")]
    return dict(kvjax=kvjax, jax=jax, jnp=jnp, np=np, collections=collections, model=model, tok=tok,
                prompts=prompts)


def test_readme(tmp_path):
    """The front page's usage: answers for both prompts, a cache one buffer per layer at the budget's size."""
    pytest.importorskip("torch")  # hf_tiny writes the checkpoint with transformers
    model_dir = hf_tiny.make_llama(tmp_path, name="tiny", max_position_embeddings=2048)
    save_char_tokenizer(model_dir)
    [usage] = examples("README.md")
    usage = edit(usage, ("/models/Qwen2.5-7B-Instruct", str(model_dir)), ('"bfloat16"', '"float32"'),
                 ('{"budget": 1024}', '{"budget": 8}'), ("max_new_tokens=64", "max_new_tokens=4"))
    scope = run(usage, {}, "README.md")
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    out, layer = scope["out"], scope["layer"]
    longest = max(len(p) for p in scope["prompts"])
    capacity = kvjax.methods.get("streaming_llm", budget=8).capacity(longest, 4)
    assert len(out.cache.layers) == layers and layer.pos.shape == (2, 2, capacity) and capacity < longest
    assert len(out.texts(scope["tok"])) == 2 and scope["logits"].shape[:2] == (1, len(scope["prompts"][0]))
    assert "streaming_llm" in kvjax.methods.available()


def test_engine(tiny, capsys):
    """docs/engine.md: one answer per prompt, then eight sampled answers per prompt with a log-probability a token."""
    first, rollout = examples("docs/engine.md")
    scope = dict(tiny)
    run(edit(first, ("max_prompt_tokens=4096", "max_prompt_tokens=64"), ("max_new_tokens=512", "max_new_tokens=8"),
             ("max_new_tokens=64", "max_new_tokens=4")), scope, "engine.md:0")
    printed = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in printed) == ["0", "1"] and len(scope["done"].tokens) == 4
    run(edit(rollout, ("max_prompt_tokens=4096", "max_prompt_tokens=64"), ("max_new_tokens=512", "max_new_tokens=4")),
        scope, "engine.md:1")
    groups = scope["groups"]
    assert sorted(groups) == [0, 1]
    for answers in groups.values():
        assert sorted(sample for sample, _, _ in answers) == list(range(8))
        assert all(len(tokens) == len(logprobs) == 4 for _, tokens, logprobs in answers)


def test_library(tiny, tmp_path, monkeypatch):
    """docs/library.md: a context saved, loaded and asked two questions; the per-layer API inside a model's layer
    (a prefill chunk, then one decode token); the RAG strategies over saved documents."""
    context, own_model, rag = examples("docs/library.md")
    monkeypatch.chdir(tmp_path)
    scope = dict(tiny, document="The pass key is 42. " * 8, questions=["What is the pass key?", "Which number?"])
    run(edit(context, ("max_new_tokens=64", "max_new_tokens=3")), scope, "library.md:0")
    assert (tmp_path / "report.kvctx").is_file() and len(scope["out"].texts(scope["tok"])) == 2

    b, kv, n, h, layers, t = 2, 2, 4, 16, 2, 12
    rng = np.random.default_rng(0)
    qkv = {name: jnp.asarray(rng.normal(size=(b, t, heads, h)), jnp.bfloat16)
           for name, heads in (("q", n), ("k", kv), ("v", kv))}
    lengths = np.array([t, 9])
    positions = np.where(np.arange(t)[None] < lengths[:, None], np.arange(t)[None], -1)
    scope.update(qkv, b=b, kv=kv, n=n, h=h, layers=layers, prompt_len=t, max_new=4, prompt_lengths=lengths, i=0,
                 positions=jnp.asarray(positions, jnp.int32),
                 inv_freq=1.0 / (10000.0 ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)))
    prefill, decode = own_model.split("out, layer_cache = step.decode_layer")
    run(prefill, scope, "library.md:1 (prefill)")
    assert np.asarray(scope["layer_cache"].length).tolist() == [[t] * kv, [9] * kv]
    run("cache = cache.with_layer(i, layer_cache)", scope, "library.md:1 (its last line)")
    scope.update({name: x[:, -1:] for name, x in qkv.items()}, positions=jnp.asarray(lengths[:, None], jnp.int32))
    run("out, layer_cache = step.decode_layer" + decode, scope, "library.md:1 (decode)")
    assert np.asarray(scope["cache"].layer(0).length).tolist() == [[t + 1] * kv, [10] * kv]
    assert scope["out"].shape == (b, 1, n, h)

    scope.update(passages=["Paris is in France. ", "The pass key is 42. "], question="What is the pass key?")
    run(edit(rag, ("/caches/wiki", str(tmp_path / "wiki")), ("max_new_tokens=32", "max_new_tokens=3")), scope,
        "library.md:2")
    assert scope["result"].report.strategy == "samkv" and scope["result"].report.num_documents == 2


def test_methods(tiny):
    """docs/methods.md: each construction gives the method with the settings its comment names."""
    simlayer, lukv, kvcompose, dms = examples("docs/methods.md")
    scope = dict(tiny)
    run(simlayer, scope, "methods.md:0")
    assert (scope["method"].lazy_threshold, scope["method"].n_recent) == (0.8, 256)
    scope["path"] = curve = learned_files.lukv_curve(layers=6)
    run(edit(lukv, ("/data/lukv/llama-3.1-8b/ea_0.02_sink4_win1.npy", curve)), scope, "methods.md:1")
    assert scope["method"].base == "snapkv" and scope["method"].curve == curve
    run(kvcompose, scope, "methods.md:2")
    assert scope["method"].structured is False
    run(edit(dms, ("/models/KVzap-mlp-Qwen3-8B", learned_files.kvzap_dir(layers=6, hidden_size=128))), scope,
        "methods.md:3")
    assert scope["method"].decoding and scope["method"].base == "kvzap"
    prompts = scope["prompts"][:1]
    out = kvjax.generate(scope["model"], prompts, method=scope["method"], max_new_tokens=3)
    assert len(out.tokens[0]) == 3


def test_models(tmp_path, monkeypatch):
    """docs/models.md: a preset's weights found in a local directory, by `model_dir=` or under `KVJAX_MODEL_DIR`.
    A 7B checkpoint cannot be written here, so a tiny Qwen2 stands in, and the loader's size check refusing it is
    what shows the directory was found and read (the message names it)."""
    [preset] = examples("docs/models.md")
    pytest.importorskip("torch")  # hf_tiny writes the checkpoint with transformers
    model_dir = hf_tiny.make_qwen2(tmp_path, tied=True, name="Qwen2.5-7B-Instruct")
    with pytest.raises(ConfigError, match=f"resolved to '{re.escape(str(model_dir))}', whose config.json is another "
                                          "size: hidden_size=64 \\(the preset has 3584\\)"):
        run(edit(preset, ("/models/Qwen2.5-7B-Instruct", str(model_dir))), {"kvjax": kvjax}, "models.md:0")
    assert "export KVJAX_MODEL_DIR=/models" in preset and "/models/Qwen2.5-7B-Instruct is used" in preset
    monkeypatch.setenv("KVJAX_MODEL_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=f"resolved to '{re.escape(str(model_dir))}'"):
        kvjax.load_model("qwen2.5-7b")
    monkeypatch.setenv("KVJAX_MODEL_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(CheckpointError, match="no local weights for preset 'qwen2.5-7b'"):
        kvjax.load_model("qwen2.5-7b")


def test_performance(tiny):
    """docs/performance.md: the fused decode kernel named for "auto" under `tuning.override`."""
    [override] = examples("docs/performance.md")
    scope = run(edit(override, ("max_new_tokens=64", "max_new_tokens=3")), dict(tiny), "performance.md:0")
    assert len(scope["out"].tokens) == 2 and all(len(t) == 3 for t in scope["out"].tokens)


def test_rag(tiny, tmp_path):
    """docs/rag.md: documents prefilled once, saved, loaded, answered by SamKV, and its report as a table."""
    [example] = examples("docs/rag.md")
    tok = tiny["tok"]
    ids = {f"doc{i}_ids": tok.encode(text) for i, text in
           enumerate(["Paris is in France. ", "The pass key is 42. ", "The sky is blue. "], start=1)}
    scope = dict(tiny, **ids, query_ids=tok.encode("What is the pass key?"), instruction_ids=tok.encode("Answer: "))
    run(edit(example, ("/data/corpus_cache", str(tmp_path / "corpus")), ("max_new_tokens=32", "max_new_tokens=3"),
             ("[out.report, ...]", "[out.report]")), scope, "rag.md:0")
    assert len(scope["out"].tokens) == 3 and scope["out"].report.num_documents == 3


def test_retrieval(tiny):
    """docs/retrieval.md: ActQKV with the question given apart, and from its official preset."""
    [example] = examples("docs/retrieval.md")
    tok = tiny["tok"]
    scope = dict(tiny, context_ids=tok.encode("The pass key is 42. " * 6), question_ids=tok.encode("The pass key?"))
    run(edit(example, ("max_new_tokens=64", "max_new_tokens=3")), scope, "retrieval.md:0")
    assert len(scope["out"].tokens[0]) == 3


def test_scale(tmp_path):
    """docs/scale.md: a data x model mesh on one host, then the multi-process recipe's calls (run here as one
    process, where `maybe_initialize_distributed` starts nothing), on 8 CPU devices: the same tokens as one device."""
    pytest.importorskip("torch")  # hf_tiny writes the checkpoint with transformers
    model_dir = hf_tiny.make_llama(tmp_path, name="tiny", max_position_embeddings=2048)
    one_host, many = examples("docs/scale.md")
    one_host = edit(one_host, ("/models/Llama-3.1-8B-Instruct", str(model_dir)), ('"bfloat16"', '"float32"'),
                    ('{"budget": 1024}', '{"budget": 40}'), ("max_new_tokens=64", "max_new_tokens=3"))
    many = edit(many, ("model=16", "model=2"), ('{"budget": 1024}', '{"budget": 40}'),
                ("max_new_tokens=64", "max_new_tokens=3"))
    script = "\n".join([
        "import json, jax, kvjax",
        "ids = lambda tokens: [[int(t) for t in row] for row in tokens]",
        f"model = kvjax.load_model({str(model_dir)!r})",
        "prompts = [list(range(3, 90)), list(range(5, 60))]",
        "ref = kvjax.generate(model, prompts, method='snapkv', method_args={'budget': 40}, max_new_tokens=3).tokens",
        "ref = ids(ref)",
        one_host,
        "first = ids(out.tokens)",
        many,
        "print(json.dumps({'ref': ref, 'one_host': first, 'many': ids(out.tokens), 'devices': mesh.devices.size}))",
    ])
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": with_devices(8), "KVJAX_DISTRIBUTED": "0"}
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=600, cwd=str(HERE))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ref"] == got["one_host"] == got["many"] and got["devices"] == 4
    assert [len(t) for t in got["ref"]] == [3, 3]


def test_every_example_has_a_runner():
    """A page with a Python example is run above, with as many examples as it has."""
    expected = {"README.md": 1, "docs/engine.md": 2, "docs/library.md": 3, "docs/methods.md": 4, "docs/models.md": 1,
                "docs/performance.md": 1, "docs/rag.md": 1, "docs/retrieval.md": 1, "docs/scale.md": 2}
    found = {str(p.relative_to(ROOT)): len(examples(str(p.relative_to(ROOT))))
             for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]}
    assert {page: count for page, count in found.items() if count} == expected


DOC_PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: `python -m kvjax...` or a benchmark script, then its arguments up to the end of the command
_COMMAND = re.compile(r"(?:python -m (kvjax[\w.]*)|(benchmarks/\w+\.py))((?: +[^ `;&|>]+)*)")


def documented_commands() -> list[tuple[str, str, str]]:
    """`(page, command, arguments)` of every `python -m kvjax...` and `benchmarks/*.py` command of the READMEs and
    docs/: in fenced blocks (continuation lines joined, comments cut) and in inline code."""
    found = []
    for page in DOC_PAGES:
        text = page.read_text(encoding="utf-8")
        lines = [line.split(" #", 1)[0] for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
                 for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
        lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for line in lines:
            for m in _COMMAND.finditer(line):
                found.append((str(page.relative_to(ROOT)), m.group(1) or m.group(2), m.group(3)))
    return found


_FLAG = re.compile(r"--(\[no\])?([a-z][a-z0-9_]*)")

#: Prints `{script: its --help text, or None where --help fails}` for the scripts named, all in one process (the
#: benchmark scripts are argparse's; each started alone would import jax again).
_SCRIPT_HELP = """
import contextlib, io, json, os, runpy, sys
helps = {}
for path in sys.argv[1:]:
    sys.argv, text = [path, "--help"], io.StringIO()
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python path` has it
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    helps[path] = text.getvalue() if code in (0, None) else None
print(json.dumps(helps))
"""


def script_flags(scripts: list[str]) -> dict[str, set[str] | None]:
    """The flags each script's `--help` lists (None: it has no help)."""
    proc = subprocess.run([sys.executable, "-c", _SCRIPT_HELP, *scripts], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    helps = json.loads(proc.stdout.strip().splitlines()[-1])
    return {path: None if text is None else {name for _, name in _FLAG.findall(text)} for path, text in helps.items()}


def module_flags(argv: list[str], asked: str) -> set[str] | None:
    """The flags that `python -m argv`'s `asked` help (`--help`, or absl's `--helpfull`) lists (None: no such help)."""
    proc = subprocess.run([sys.executable, "-m", *argv, asked], capture_output=True, text=True, cwd=str(ROOT),
                          timeout=120)
    return {name for _, name in _FLAG.findall(proc.stdout)} if proc.returncode == 0 else None


def test_documented_commands_name_only_their_flags():
    """Each flag a documented command passes is one its command defines (`--noX` for a boolean `X`), so a renamed
    or removed flag cannot stay in the docs."""
    commands = documented_commands()
    assert len(commands) > 60
    assert {command for _, command, _ in commands} >= {"kvjax.eval", "kvjax.run", "kvjax.train", "kvjax.calibrate",
                                                       "benchmarks/decode.py", "benchmarks/kvpress_agreement.py"}
    passed = collections.defaultdict(list)  # command (with a subcommand) -> (page, flag) of each flag it is given
    for page, command, args in commands:
        argv = [command]
        if command == "kvjax.eval.archive" and (sub := re.match(r" +([a-z]+)\b", args)):
            argv.append(sub.group(1))  # a subcommand's own flags
        passed[" ".join(argv)] += [(page, flag) for flag in re.findall(r"(?:^| |\[)--([a-z][a-z0-9_]*)", args)]
    passed = {name: uses for name, uses in passed.items() if uses}
    scripts = script_flags([name for name in passed if name.endswith(".py")])
    wrong = []
    for name, uses in passed.items():
        defined: set[str] = set()
        # absl's --help lists the main module's flags only; --helpfull every flag
        for asked in ("--help",) if name.endswith(".py") else ("--help", "--helpfull"):
            found = scripts[name] if name.endswith(".py") else module_flags(name.split(), asked)
            assert found is not None, f"{name} {asked} failed"
            defined |= found
            missing = [(page, flag) for page, flag in uses
                       if flag not in defined and not (flag.startswith("no") and flag[2:] in defined)]
            if not missing:
                break
        wrong += [f"{page}: {name} has no --{flag}" for page, flag in missing]
    assert not wrong, "\n".join(wrong)
