"""`python -m kvjax.eval --kv_dtype=...`: the cache's storage format sweeps like any flag, is part of each cell's
identity (a model-dtype cell keeps the name it had before the flag existed), reaches `prefill` and the shared-prefill
path, and the pivot shows the stored bits per value beside each score. Oracles: `kvjax.generate(..., kv_dtype=)`
on the same prompts, the bits formula of the scheme table (kvjax/quant/spec.py), a resume with a changed stored
setting refused. The CLI runs in this process (its `main` called with argv) on the embedded kvjax-tiny model."""

from __future__ import annotations

import json
import pathlib

import pytest

from kvjax.eval import __main__ as cli
from kvjax.eval.cell import CellKey

BASE = ["--model=kvjax-tiny", "--task=passkey", "--context_length=200", "--max_samples=2", "--progress=false"]
KV_DTYPES = ("model", "int8", "kivi2")


def _cli(*args: str) -> int:
    """Runs the CLI's `main` on `args` in this process; its exit code."""
    cli.FLAGS.unparse_flags()
    try:
        argv = cli._parse_flags(["kvjax.eval", *args])
        cli.main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def _cells(out: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in out.iterdir() if p.is_dir() and p.name != "plots")


def _records(cell: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in (cell / "predictions.jsonl").read_text().splitlines() if x.strip()]


def _by_kv_dtype(out: pathlib.Path) -> dict[str, pathlib.Path]:
    cells = {}
    for cell in _cells(out):
        config = json.loads((cell / "config.json").read_text())
        cells[config["cell"].get("kv_dtype") or "model"] = cell
        assert config["kv_dtype"] == (config["cell"].get("kv_dtype") or "model")
    return cells


def _oracle(kv_dtype: str) -> tuple[dict[str, str], dict[str, int]]:
    """Predictions and cache bytes of `kvjax.generate` / `prefill` with `kv_dtype` on the CLI's prompts, one sample
    at a time (the CLI's --batch_size=1)."""
    from kvjax import generate, load_model
    from kvjax.eval import tasks
    from kvjax.eval.runner import PromptEncoder
    from kvjax.models.tokenizer import load_tokenizer
    from kvjax.runtime.generate import prefill

    model, tokenizer = load_model("kvjax-tiny", dtype="float32"), load_tokenizer("kvjax-tiny")
    encoder = PromptEncoder(tokenizer, "auto")
    task = tasks.get("passkey", tokenizer=tokenizer)
    samples = task.samples(count_tokens=encoder.count_tokens, context_length=200, num_samples=2, seed=0, data_dir=None)
    texts, nbytes = {}, {}
    for sample in samples:
        context, question = encoder.encode(task, sample, query_aware=False)
        out = generate(model, [context], question_ids=[question], max_new_tokens=sample.max_new_tokens,
                       kv_dtype=kv_dtype)
        n = min(int(out.num_tokens[0]), sample.max_new_tokens)
        texts[sample.id] = tokenizer.decode([int(t) for t in out.tokens[0][:n]], skip_special_tokens=True)
        state = prefill(model, [context], question_ids=[question], max_new_tokens=sample.max_new_tokens,
                        kv_dtype=kv_dtype)
        nbytes[sample.id] = state.cache.nbytes
    return texts, nbytes


def _bits(kv_dtype: str, head_dim: int) -> float:
    """Bits per value from the scheme table: codes, a bfloat16 scale (+ zero point for the asymmetric schemes) per
    token and head; KIVI's keys one scale + zero per channel over 64 tokens, averaged over keys and values."""
    per_token = {"int8": 16 / head_dim, "int4": 32 / head_dim, "kivi2": 32 / head_dim, "kivi4": 32 / head_dim}
    code = {"int8": 8, "fp8": 8, "int4": 4, "kivi2": 2, "kivi4": 4}[kv_dtype]
    if kv_dtype.startswith("kivi"):
        return ((code + 32 / 64) + (code + per_token[kv_dtype])) / 2
    return code + per_token.get(kv_dtype, 0.0)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv_sweep")
    code = _cli(f"--output_dir={out}", "--method=full", f"--kv_dtype={','.join(KV_DTYPES)},int8",
                "--shared_prefill=no", *BASE)
    assert code == 0
    return out


@pytest.mark.slow
def test_sweep_gives_one_cell_per_kv_dtype_equal_to_generate(swept):
    cells = _by_kv_dtype(swept)
    assert sorted(cells) == sorted(KV_DTYPES)  # the repeated int8 is one cell
    model_cell = CellKey(model="kvjax-tiny", method="full", task="passkey", context_length=200, dtype="float32")
    assert cells["model"].name == model_cell.name()  # the name it had before --kv_dtype existed
    assert "__kv-int8__" in cells["int8"].name and "__kv-kivi2__" in cells["kivi2"].name
    for kv_dtype, cell in cells.items():
        want, nbytes = _oracle(kv_dtype)
        records = _records(cell)
        assert {r["id"]: r["prediction"] for r in records} == want, kv_dtype
        assert {r["id"]: r["cache_bytes"] for r in records} == nbytes, kv_dtype
    full = _records(cells["model"])[0]["cache_bytes"]
    assert _records(cells["int8"])[0]["cache_bytes"] < full and _records(cells["kivi2"])[0]["cache_bytes"] < full


def test_shared_prefill_path_quantizes_each_cell(tmp_path, swept):
    """The shared-prefill sweep (`prefill_from(..., kv_dtype=)`) stores each cell in its format: the same cache
    bytes as the per-cell prefill and the same greedy answers on this model."""
    assert _cli(f"--output_dir={tmp_path}", "--method=full", f"--kv_dtype={','.join(KV_DTYPES)}",
                "--shared_prefill=yes", *BASE) == 0
    shared, alone = _by_kv_dtype(tmp_path), _by_kv_dtype(swept)
    for kv_dtype in KV_DTYPES:
        records = _records(shared[kv_dtype])
        assert all(r["shared_prefill"] for r in records)
        assert {r["id"]: r["cache_bytes"] for r in records} == {r["id"]: r["cache_bytes"]
                                                                for r in _records(alone[kv_dtype])}, kv_dtype
        assert {r["id"]: r["prediction"] for r in records} == {r["id"]: r["prediction"]
                                                               for r in _records(alone[kv_dtype])}, kv_dtype


def test_pivot_shows_bits_per_value_beside_each_score(swept, capsys):
    from kvjax.eval import report
    from kvjax.eval.runs import load_runs
    from kvjax.models.model import load_model

    head_dim = load_model("kvjax-tiny", dtype="float32").config.head_dim
    for kv_dtype, cell in _by_kv_dtype(swept).items():
        want = 32.0 if kv_dtype == "model" else _bits(kv_dtype, head_dim)
        assert [r["kv_bits_per_value"] for r in _records(cell)] == [pytest.approx(want)] * 2
        assert json.loads((cell / "metrics.json").read_text())["mean_kv_bits_per_value"] == pytest.approx(want)
    pivot = report.render_pivot(load_runs([str(swept)]))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in pivot.splitlines() if line.startswith("| full")}
    assert list(rows) == ["full [kv_dtype=model]", "full [kv_dtype=int8]", "full [kv_dtype=kivi2]"]  # widest first
    for kv_dtype in KV_DTYPES:
        want = 32.0 if kv_dtype == "model" else _bits(kv_dtype, head_dim)
        assert f", {want:.3g} b)" in rows[f"full [kv_dtype={kv_dtype}]"]
    assert "b: stored bits per cached key / value" in pivot


def test_pivot_without_a_quantized_cache_is_unchanged(swept):
    from kvjax.eval import report
    from kvjax.eval.runs import load_runs

    runs = [r for r in load_runs([str(swept)]) if r.extras.get("kv_dtype") is None]
    assert " b)" not in report.render_pivot(runs)


@pytest.mark.parametrize("value, needle", [
    ("int3", "'int3'"),
    ("model,,int8", "empty entry"),
    ("kivi2:group_size=64:residual=32", "residual=32"),
    ("int8:group_size=32", "group_size"),
    ("kivi4:window=3", "'window=3'"),
])
def test_bad_kv_dtype_is_one_line_and_exit_2(tmp_path, capsys, value, needle):
    code = _cli(f"--output_dir={tmp_path}", f"--kv_dtype={value}", "--dry_run", *BASE)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvjax.eval: error: --kv_dtype") and needle in lines[0], err
    assert not list(tmp_path.iterdir())


def test_resume_into_a_cell_of_another_kv_dtype_is_refused(tmp_path, capsys):
    assert _cli(f"--output_dir={tmp_path}", "--method=full", "--kv_dtype=int8", *BASE) == 0
    (cell,) = _cells(tmp_path)
    config = json.loads((cell / "config.json").read_text())
    config["cell"]["kv_dtype"] = "int4"  # a directory holding another format's results under this cell's name
    (cell / "config.json").write_text(json.dumps(config))
    before = (cell / "predictions.jsonl").read_bytes()
    capsys.readouterr()
    code = _cli(f"--output_dir={tmp_path}", "--method=full", "--kv_dtype=int8", *BASE[:-2], "--max_samples=3",
                "--progress=false")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert "kv_dtype='int4' (this command: 'int8')" in line
    assert (cell / "predictions.jsonl").read_bytes() == before


def test_stored_keys_without_kv_dtype_load_as_the_model_dtype():
    """Archived cells (before the flag) have no kv_dtype: they read back as model-dtype cells with the same digest."""
    key = CellKey(model="m", method="snapkv", task="t", context_length=9, budget=4, dtype="bfloat16")
    stored = key.as_dict()
    assert "kv_dtype" not in stored
    assert CellKey.from_config({"cell": stored}) == key
    assert CellKey(**{**stored, "kv_dtype": "model"}).name() == key.name()
    quantized = CellKey(**{**stored, "kv_dtype": "KIVI2:group_size=32:residual=64"})
    assert quantized.kv_dtype == "kivi2:group_size=32:residual=64" and quantized.digest() != key.digest()
    assert CellKey.from_config({"cell": quantized.as_dict()}) == quantized
