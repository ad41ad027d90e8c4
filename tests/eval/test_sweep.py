"""`python -m kvjax.eval` sweeps with one shared prefill per batch: the same predictions as the cells run one by one."""

import json
import pathlib
import sys

import pytest

pytest.importorskip("torch")

import hf_tiny  # noqa: E402
from cli_inprocess import run_cmd  # noqa: E402

from kvjax.eval import sweep  # noqa: E402
from kvjax.eval.runner import Setting  # noqa: E402
from kvjax.models.char_tokenizer import save_char_tokenizer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Cells replayed alone against the sweep: one from the shared forward (SnapKV, with a scoped argument) and one
#: from the second forward with the question at the end (Quest).
CELLS = [("snapkv", "32"), ("quest", "24")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = hf_tiny.make_llama(tmp_path_factory.mktemp("m"), name="tiny", max_position_embeddings=1024)
    save_char_tokenizer(path)
    return path


def _run(model_dir, out, *extra):
    cmd = [
        sys.executable, "-m", "kvjax.eval", f"--model={model_dir}", f"--output_dir={out}", "--task=passkey",
        "--context_length=400", "--max_samples=3", "--batch_size=2", "--progress=false", *extra,
    ]
    proc = run_cmd(cmd)  # in this process (tests/cli_inprocess.py): the same entry point, exit code and output
    assert proc.returncode == 0, proc.stderr
    return proc


def _predictions(out) -> dict[str, list[dict]]:
    runs = {}
    for run in sorted(p for p in pathlib.Path(out).iterdir() if (p / "predictions.jsonl").is_file()):  # not plots/
        records = [json.loads(x) for x in (run / "predictions.jsonl").read_text().splitlines() if x.strip()]
        runs[run.name] = sorted(records, key=lambda r: r["id"])
    return runs


@pytest.mark.slow
def test_shared_sweep_predicts_byte_identically_to_cells_run_one_by_one(model_dir, tmp_path):
    # One run: six cells of one (task, length) in a ragged batch, one prefill forward per batch, and two Quest
    # cells that share a second forward with the question at the end of the prompt.
    _run(model_dir, tmp_path / "sweep", "--method=snapkv,streaming_llm,knorm,quest", "--budget=32,24",
         "--method_args=snapkv.window_size=8")
    swept = _predictions(tmp_path / "sweep")
    assert len(swept) == 8
    assert all(r["shared_prefill"] and "shared_forward_s" in r["timings"] for rs in swept.values() for r in rs)
    # The same cells one by one, each replayed alone (--shared_prefill=yes).
    alone = {}
    for method, budget in CELLS:
        out = tmp_path / f"{method}{budget}"
        scoped = ["--method_args=snapkv.window_size=8"] if method == "snapkv" else []
        _run(model_dir, out, f"--method={method}", f"--budget={budget}", *scoped, "--shared_prefill=yes")
        alone.update(_predictions(out))
    assert set(alone) <= set(swept)
    for name, records in alone.items():
        assert [r["prediction"] for r in records] == [r["prediction"] for r in swept[name]], name
        assert [r["scores"] for r in records] == [r["scores"] for r in swept[name]], name
        assert [r["kept_tokens"] for r in records] == [r["kept_tokens"] for r in swept[name]], name
    # The ordinary per-cell prefill (no sharing) predicts the same text on this model (rounding apart).
    ordinary = tmp_path / "ordinary"
    _run(model_dir, ordinary, "--method=snapkv,streaming_llm,knorm,quest", "--budget=32,24",
         "--method_args=snapkv.window_size=8", "--shared_prefill=no")
    plain = _predictions(ordinary)
    assert not any(r.get("shared_prefill") for rs in plain.values() for r in rs)
    assert {n: [r["prediction"] for r in rs] for n, rs in plain.items()} == {
        n: [r["prediction"] for r in rs] for n, rs in swept.items()
    }


def test_which_cells_share():
    from kvjax import methods

    def cell(name, task="passkey", length=400, **args):
        return Setting(name, methods.get(name, **args), task, length)

    settings = [
        cell("snapkv", budget=64), cell("knorm", budget=64),  # share
        cell("h2o", budget=64, length=800),  # alone at its length: auto runs it the ordinary way
        cell("infllm"),  # retrieval in windows: never
        cell("quest", budget=64),  # the question in the prompt: shares only with its own kind
        cell("quest", budget=32), cell("quest", budget=32, length=800),
    ]
    assert sweep.shared_cells(settings, "auto", chunk_size=None, mesh=None) == {0, 1, 4, 5}
    assert sweep.shared_cells(settings, "yes", chunk_size=None, mesh=None) == {0, 1, 2, 4, 5, 6}
    assert sweep.shared_cells(settings, "no", chunk_size=None, mesh=None) == set()
    assert sweep.shared_cells(settings, "auto", chunk_size=64, mesh=None) == set()  # chunked prefill


def test_shared_sweep_resumes_each_cell_where_it_stopped(model_dir, tmp_path):
    out = tmp_path / "out"
    # A finished prefix: SnapKV alone on the first 2 samples.
    _run(model_dir, out, "--method=snapkv", "--budget=32", "--method_args=snapkv.window_size=8", "--max_samples=2",
         "--shared_prefill=yes")
    before = _predictions(out)
    (snap_name,) = before
    # The sweep adds the third sample to SnapKV and all three to StreamingLLM, each exactly once.
    _run(model_dir, out, "--method=snapkv,streaming_llm", "--budget=32", "--method_args=snapkv.window_size=8")
    after = _predictions(out)
    assert len(after) == 2
    for name, records in after.items():
        ids = [r["id"] for r in records]
        assert len(ids) == 3 and len(set(ids)) == 3, name
    kept = {r["id"]: r for r in after[snap_name]}
    assert all(kept[r["id"]] == r for r in before[snap_name])  # the finished records are kept as they were


@pytest.mark.slow
def test_kvzip_and_dms_cells_share_one_prefill_per_batch(model_dir, tmp_path):
    """KVzip's budgets share the forward and one context replay per batch (each cell charged the replay's time);
    DMS over KVzap reads hidden states, which the recording then keeps; `key=a|b` sweeps an argument, a budget
    included. The sweep predicts what the ordinary per-cell prefill predicts."""
    from kvzap_weights import write_kvzap

    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    weights = tmp_path / "kvzap"
    write_kvzap(weights, layers=config["num_hidden_layers"], input_dim=config["hidden_size"],
                output_dim=config["num_key_value_heads"], hidden_dim=8)
    args = ("--method=kvzip,dms", "--method_args=kvzip.chunk_size=128,kvzip.budget=96|48,dms.threshold=0.0|0.4|0.0,"
            f"dms.base_args={{'weights':'{weights}'}}")
    _run(model_dir, tmp_path / "sweep", *args)
    swept = _predictions(tmp_path / "sweep")
    assert len(swept) == 4  # two budgets, two thresholds (a repeated value is one cell)
    assert all(r["shared_prefill"] for rs in swept.values() for r in rs)
    kvzip = {n: rs for n, rs in swept.items() if "kvzip" in n}
    for records in kvzip.values():
        assert all(r["timings"]["replay_s"] > 0 for r in records)
        assert all(r["timings"]["prefill_s"] >= r["timings"]["shared_forward_s"] + r["timings"]["replay_s"]
                   for r in records)
    _run(model_dir, tmp_path / "plain", *args, "--shared_prefill=no")
    plain = _predictions(tmp_path / "plain")
    assert not any(r.get("shared_prefill") for rs in plain.values() for r in rs)
    for field in ("prediction", "kept_tokens"):
        assert {n: [r[field] for r in rs] for n, rs in plain.items()} == \
            {n: [r[field] for r in rs] for n, rs in swept.items()}, field
    kept = {n: [r["kept_tokens"] for r in rs] for n, rs in swept.items()}
    assert len({str(k) for k in kept.values()}) == 4  # every cell keeps something else: the comparison can fail


def test_a_group_records_the_layer_inputs_its_cells_read_and_no_other(monkeypatch):
    """`run_group` asks the recording for what its cells' methods read: hidden states (`L * B * T * D` values) only
    in a group with a cell that reads them (the recording is stopped at once: no model runs)."""
    from types import SimpleNamespace

    from kvzap_weights import FIXTURE

    from kvjax import methods
    from kvjax.eval import shared
    from kvjax.runtime import shared_prefill

    asked = []

    class Recorded(Exception):
        pass

    def record(model, contexts, **kwargs):
        asked.append(kwargs["layer_inputs"])
        raise Recorded

    monkeypatch.setattr(shared_prefill, "record", record)
    sample = SimpleNamespace(id="0", max_new_tokens=4)
    encoder = SimpleNamespace(tokenizer=None, encode=lambda task, s, query_aware: ([1, 2, 3], [4]))
    snapkv, h2o = methods.get("snapkv", budget=64), methods.get("h2o", budget=64)
    crit = methods.get("criticalkv", budget=64)
    kvzap = methods.get("kvzap", budget=64, weights=str(FIXTURE))
    dms = methods.get("dms", threshold=0.0, base_args={"weights": str(FIXTURE)})
    groups = [[snapkv, crit], [snapkv, h2o], [snapkv, kvzap], [dms, crit]]
    for group in groups:
        cells = [SimpleNamespace(setting=SimpleNamespace(method=m), task="passkey", samples=[sample],
                                 run_dir=SimpleNamespace(done_ids=set)) for m in group]
        with pytest.raises(Recorded):
            shared.run_group(model=None, encoder=encoder, cells=cells, batch_size=2, query_aware=False, seed=0)
    assert asked == [frozenset(), {"attention_lse"}, {"hidden"}, {"hidden"}]
