"""Evaluation: benchmark tasks, metrics, resumable result storage and reports.

* ``python -m kvjax.eval`` -- config (``config``: ``EvalConfig``) -> plan (``plan``: the cells) -> run (``checks``:
  every refusal before the first cell; ``sweep``: the run; ``runner``: one cell; ``shared``: cells sharing a prefill).
* ``kvjax.tasks`` (also importable as ``kvjax.eval.tasks``) -- task registry (RULER, passkey, needle, LongBench,
  InfiniteBench, multidoc, the generated multidoc/synthetic) and ``kvjax.tasks.metrics`` (``kvjax.eval.metrics``),
  the papers' scoring functions; below the eval, where training and calibration read them too.
* ``kvjax.eval.cell``    -- ``Cell`` (a planned cell) and ``CellKey``: every setting that changes a result, one key
  for run directories, resume, report and leaderboard (docs/eval.md).
* ``kvjax.eval.results`` -- ``RunDir``: append-only ``predictions.jsonl`` with crash-safe resume.
* ``kvjax.eval.claims``  -- one claim per cell, so processes sharing an output folder never repeat a sample.
* ``kvjax.eval.runs``    -- ``Run`` and ``load_runs``: saved runs read back (directories and archives), merged per cell.
* ``kvjax.eval.plots``   -- score against ratio or budget, needle heatmaps (matplotlib).
* ``kvjax.eval.report``  -- ``python -m kvjax.eval.report <dirs>``: tables (Markdown / CSV) and the plots.

Nothing here downloads anything: synthetic tasks are generated locally, benchmark data is read from local
files in the published formats.
"""
