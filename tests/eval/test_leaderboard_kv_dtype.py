"""The quantized-cache leaderboard panel: its config (configs/leaderboard_kv_dtype.py) plans valid cells, and the
renderer gives every storage format its own line naming the format and its bits per value, the full cache's too."""

from __future__ import annotations

import json
import pathlib
import runpy

import pytest

from kvjax import methods
from kvjax.cli import parse
from kvjax.eval import leaderboard
from kvjax.eval.tasks import expand
from kvjax.quant import parse_kv_dtype

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "leaderboard_kv_dtype.py"


def test_config_plans_every_method_at_every_scheme():
    get_config = runpy.run_path(str(CONFIG))["get_config"]
    for model, length in (("kvjax-tiny", "1024"), ("smollm2-135m", "2048")):
        cfg = get_config(model)
        assert cfg.model == model and cfg.context_length == length and cfg.max_samples == 20
        assert cfg.compression_ratio == "0.25,0.5,0.75,0.875" and not cfg.query_aware
        assert cfg.output_dir == f"results/leaderboard_kv_dtype/{model}"
        names = cfg.method.split(",")
        assert names == ["full", "snapkv", "streaming_llm", "lagkv"]
        for name in names[1:]:  # each registered, and valid at every ratio
            for ratio in cfg.compression_ratio.split(","):
                methods.get(name, compression_ratio=float(ratio))
        schemes = parse.kv_dtype_names(cfg.kv_dtype)
        assert schemes == [None, "int8", "fp8", "int4", "kivi4", "kivi2"]
        for scheme in schemes[1:]:
            parse_kv_dtype(scheme).check_head_dim(64)  # SmolLM2-135M's head_dim
        assert len(expand(cfg.task)) == 10 and all(t.startswith("ruler/") for t in expand(cfg.task))
    with pytest.raises(ValueError, match="unknown quantized-cache leaderboard model"):
        get_config("qwen3-8b")


def _run(out: pathlib.Path, method: str, ratio, kv_dtype, bits: float, score: float) -> None:
    tag = kv_dtype or "model"
    d = out / f"ruler-vt__1024__tiny__{method}__{ratio}__{tag}"
    d.mkdir(parents=True)
    fields = dict(model="tiny", method=method, budget=None, compression_ratio=ratio, task="ruler/vt",
                  context_length=1024, query_aware=False, method_args={})
    key = dict(fields, chat_template="auto", chunk_size=None, data_dir=None, dtype="float32", kv_dtype=kv_dtype,
               max_new_tokens=None, question_first=False, seed=0)
    (d / "config.json").write_text(json.dumps(dict(fields, cell=key, kv_dtype=tag)))
    with open(d / "predictions.jsonl", "w") as f:
        for i in range(2):
            f.write(json.dumps(dict(id=str(i), task="ruler/vt", method=method, metric="string_match_all",
                                    scores={"string_match_all": score}, kept_tokens=500, context_tokens=1000,
                                    question_tokens=20, kv_bits_per_value=bits)) + "\n")


def test_each_storage_is_its_own_line_with_its_bits(tmp_path):
    """Two formats: the full cache and SnapKV each get one line per format, ``[kv_dtype=..., <bits> b]``, each
    method's lines together, the widest format first; a panel of one format keeps the plain names."""
    for kv_dtype, bits, score in ((None, 32.0, 1.0), ("int8", 8.5, 1.0), ("kivi2", 2.75, 0.0)):
        _run(tmp_path, "full", None, kv_dtype, bits, score)
        _run(tmp_path, "snapkv", 0.5, kv_dtype, bits, score)
    table = leaderboard.cells(leaderboard.load_runs([str(tmp_path)]))
    lines = list(table["tiny @ 1024"])
    assert set(lines) == {f"{m} [kv_dtype={k}, {b} b]" for m in ("full", "snapkv")
                          for k, b in (("model", "32"), ("int8", "8.5"), ("kivi2", "2.75"))}
    md = leaderboard.render_leaderboard(table)
    rows = [row.split(" | ")[0][2:] for row in md.splitlines() if row.startswith("| full") or row.startswith("| snap")]
    assert rows == ["full [kv_dtype=model, 32 b]", "full [kv_dtype=int8, 8.5 b]", "full [kv_dtype=kivi2, 2.75 b]",
                    "snapkv [kv_dtype=model, 32 b]", "snapkv [kv_dtype=int8, 8.5 b]", "snapkv [kv_dtype=kivi2, 2.75 b]"]
    assert "| full [kv_dtype=kivi2, 2.75 b] | 0.0 · 500 (49%) · n=2 |" in md
    styles = leaderboard.line_styles(table)  # a plot style per (method, format)
    assert len(styles) == 3 and len(set(styles.values())) == 3
    plot = leaderboard.plot_leaderboard(table, str(tmp_path / "board.png"))
    assert pathlib.Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one = tmp_path / "one"
    _run(one, "full", None, "int8", 8.5, 1.0)
    _run(one, "snapkv", 0.5, "int8", 8.5, 1.0)
    assert set(leaderboard.cells(leaderboard.load_runs([str(one)]))["tiny @ 1024"]) == {"full", "snapkv"}
