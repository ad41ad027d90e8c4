"""`benchmarks/report.py --plots`: the figures from a small synthetic results folder of the real JSON layout."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("decode", "memory", "compression_overhead")


@pytest.fixture(scope="module")
def report() -> Any:
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _header(name: str) -> dict[str, Any]:
    machine = dict(
        backend="gpu",
        device_kind="NVIDIA H200",
        device_count=1,
        cpu="x86",
        cpu_cores=16,
        memory_gib=128.0,
        jax="0.0.0",
        python="3.11",
    )
    model = dict(
        name="tiny",
        dtype="float32",
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=256,
    )
    return dict(benchmark=name, machine=machine, model=model, argv=[], quick=True)


def _decode_row(context: int, method: str, budget: int | None, tps: float, ideal: float, **extra: Any) -> dict:
    return (
        dict(
            context=context,
            method=method,
            budget=budget,
            batch=1,
            steps=8,
            step_ms=1e3 / tps,
            tokens_per_s=tps,
            speedup=tps / (1000 / context * 1024),
            weight_bytes=1,
            kv_read_bytes=1,
            ideal_speedup=ideal,
            cache_capacity=budget or context,
            prefill="one_shot",
        )
        | extra
    )


def _memory_row(prompt: int, method: str, mode: str, peak: int) -> dict:
    budget = None if method == "full" else 256
    return dict(
        model="tiny",
        dtype="float32",
        method=method,
        mode=mode,
        prompt=prompt,
        budget=budget,
        chunk=256 if mode == "chunked" else None,
        capacity=budget or prompt,
        cache=1 << 20,
        weights=1 << 22,
        non_weight_peak=peak,
        non_weight_peak_vs_full_one_shot=1.0,
    )


def _overhead_row(context: int, method: str, hook_fraction: float | None) -> dict:
    return dict(
        context=context,
        method=method,
        budget=None if method == "full" else 256,
        args={},
        prefill_s=0.1,
        prefill_ratio=1.0,
        forward_s=0.1,
        full_prefill_over_forward=1.0,
        hook_s=None,
        hook_fraction=hook_fraction,
    )


def _results(folder: Path) -> Path:
    """decode / memory / compression_overhead JSON: long contexts, a synthetic `full`, skipped and unsupported rows."""
    folder.mkdir(parents=True, exist_ok=True)
    decode = [_decode_row(c, "full", None, 1000 / c * 1024, 1.0) for c in (1024, 8192)]
    decode.append(_decode_row(131072, "full", None, 8.0, 1.0, prefill="synthetic"))
    decode += [_decode_row(c, "snapkv", b, 900.0, 1.2 * c / 1024) for c in (1024, 8192, 131072) for b in (256, 1024)]
    decode += [_decode_row(c, "actqkv", 256, 500.0, 1.0) for c in (1024, 8192)]  # skipped at 131072
    analytic = [
        dict(
            model="llama-3.1-8b",
            dtype="bfloat16",
            context=32768,
            budget=256,
            weight_gib=14.0,
            full_kv_gib=4.0,
            kept_kv_gib=0.05,
            ideal_speedup=1.28,
        )
    ]
    memory = [
        _memory_row(p, m, mode, p * (4096 if mode == "one_shot" or m == "full" else 1) + (1 << 24))
        for p in (1024, 4096)
        for m in ("full", "snapkv")
        for mode in ("one_shot", "chunked")
    ]
    memory.append(
        dict(
            model="tiny",
            prompt=1024,
            method="lagkv",
            mode="chunked",
            budget=256,
            chunk=256,
            unsupported="lagkv: chunked prefill needs partition mode",
        )
    )
    overhead = [
        _overhead_row(c, m, f)
        for c in (1024, 2048)
        for m, f in (("full", None), ("snapkv", 0.1), ("h2o", 9.0), ("actqkv", None))
    ]
    for name, extra in (
        ("decode", dict(rows=decode, analytic=analytic)),
        ("memory", dict(rows=memory, measured=[])),
        ("compression_overhead", dict(rows=overhead)),
    ):
        (folder / f"{name}.json").write_text(json.dumps(_header(name) | extra))
    return folder


def test_plots_written(report: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    results, plots = _results(tmp_path / "results"), tmp_path / "plots"
    report.main(["report.py", str(results), f"--plots={plots}"])
    out = capsys.readouterr().out
    assert "### decode" in out and "### memory" in out  # the tables still print
    for name in FIGURES:
        data = (plots / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name


def test_missing_result_skips_its_figure(report: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    results, plots = _results(tmp_path / "results"), tmp_path / "plots"
    (results / "memory.json").unlink()
    written = report.write_plots(str(results), str(plots))
    assert sorted(Path(p).name for p in written) == ["compression_overhead.png", "decode.png"]
    assert not (plots / "memory.png").exists()
    assert "skipping memory.png" in capsys.readouterr().err


def test_tables_without_plots(report: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = _results(tmp_path / "results")
    report.main(["report.py", str(results)])
    assert "| 131072 | full | - |" in capsys.readouterr().out
    assert not (tmp_path / "plots").exists()


def test_missing_matplotlib_message(report: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        report.main(["report.py", str(_results(tmp_path / "results")), f"--plots={tmp_path / 'plots'}"])
