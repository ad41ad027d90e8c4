"""`--batch_size` changes nothing a result records (issue 60 item 2): kept tokens are read when a sample finishes.

Oracle: the eval's own records at `--batch_size=1` (every sample alone). At batch sizes 3 and 8 every method that
evicts while decoding must record, per sample, the same prediction, `kept_tokens` and `kept_generated_tokens`, and
each cell's metrics the same mean kept tokens (the reports read those). Before the fix a sample that finished early
went on decoding padding until its batch's longest answer ended, and those steps evicted prompt tokens (TOVA on
niah_single_2 @64 recorded 79 kept tokens at batch 1, 36 at batch 8). Precondition checked: the samples' answers end
at different steps (EOS), before the task's limit.

CI runs one method per decode path (TOVA: an attention observer evicting; StreamingLLM: in-place eviction;
`decoding`: the general path, a decode hook compacting the cache); tests/runtime/test_decode_frozen.py checks the
frozen cache itself for every such method, leaf by leaf. `KVJAX_BATCH_KEPT=all` runs every method that evicts while
decoding through the eval (about 4 CPU-minutes).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

pytest.importorskip("torch")

from cli_inprocess import run_eval  # noqa: E402
from golden_cases import METHODS  # noqa: E402
from tiny import tiny_config  # noqa: E402

from kvjax import methods  # noqa: E402
from kvjax.methods import capabilities as caps  # noqa: E402

EOS_CHAR = "9"  # a character the random model below writes at various steps of these answers


def _decode_evicting() -> list[str]:
    return sorted(n for n, a in METHODS.items()
                  if not methods.get(n, **a).decode_appends_only and not caps.gathers(methods.get(n, **a)))


REPRESENTATIVE = ["decoding", "streaming_llm", "tova"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvjax.models.char_tokenizer import build_char_tokenizer, save_char_tokenizer
    from kvjax.models.export import save_hf
    from kvjax.models.model import DecoderLM

    path = tmp_path_factory.mktemp("model")
    vocab = save_char_tokenizer(path)
    eos = build_char_tokenizer().convert_tokens_to_ids(EOS_CHAR)
    config = tiny_config(vocab_size=vocab, max_position_embeddings=1024, eos_token_ids=(eos,))
    save_hf(config, DecoderLM.random(config, seed=0, scale=0.3).weights(), path)
    return path


def _args(names: list[str]) -> str:
    items = []
    for name in names:
        for key, value in METHODS[name].items():
            items.append(f"{name}.{key}={value!r}")
    return ",".join(items)


def _records(out: pathlib.Path) -> dict[str, dict]:
    cells = {}
    for run in sorted(p for p in out.iterdir() if (p / "predictions.jsonl").is_file()):
        lines = (run / "predictions.jsonl").read_text().splitlines()
        records = {r["id"]: r for r in map(json.loads, lines)}
        cells[run.name] = (records, json.loads((run / "metrics.json").read_text()))
    return cells


@pytest.mark.slow
def test_kept_tokens_do_not_depend_on_the_batch_size(model_dir, tmp_path):
    every = _decode_evicting()
    assert len(every) >= 11 and set(REPRESENTATIVE) <= set(every)
    names = every if os.environ.get("KVJAX_BATCH_KEPT") == "all" else REPRESENTATIVE
    runs = {}
    for batch in (1, 3, 8):
        proc = run_eval(f"--model={model_dir}", f"--output_dir={tmp_path / str(batch)}", "--task=passkey",
                        "--context_length=320", "--max_samples=8", f"--batch_size={batch}",
                        f"--method={','.join(names)}", f"--method_args={_args(names)}", "--progress=false")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[batch] = _records(tmp_path / str(batch))
    assert len(runs[1]) == len(names) and runs[1].keys() == runs[3].keys() == runs[8].keys()
    lengths = {len(r["prediction"]) for records, _ in runs[1].values() for r in records.values()}
    assert len(lengths) > 2, f"answers must end at different steps: lengths {sorted(lengths)}"
    for cell, (alone, metrics) in runs[1].items():
        for batch in (3, 8):
            records, batch_metrics = runs[batch][cell]
            assert records.keys() == alone.keys()
            for sid, want in alone.items():
                got = records[sid]
                for field in ("prediction", "kept_tokens", "kept_generated_tokens"):
                    assert got[field] == want[field], (cell, batch, sid, field, got[field], want[field])
            for key in ("mean_kept_tokens", "mean_kept_fraction"):
                assert batch_metrics[key] == metrics[key], (cell, batch, key)
