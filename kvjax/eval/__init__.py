"""Evaluation: benchmark tasks, metrics, resumable result storage and reports.

* ``kvjax.eval.tasks``   -- task registry (RULER, passkey, needle, LongBench, InfiniteBench, multidoc, the
  generated multidoc/synthetic).
* ``kvjax.eval.metrics`` -- the papers' scoring functions (string match, QA F1, ROUGE-L, code similarity...).
* ``kvjax.eval.cell``    -- ``CellKey``: every setting that changes a result, one key for run directories,
  resume, report and leaderboard (docs/eval.md).
* ``kvjax.eval.results`` -- ``RunDir``: append-only ``predictions.jsonl`` with crash-safe resume.
* ``kvjax.eval.claims``  -- one claim per cell, so processes sharing an output folder never repeat a sample.
* ``kvjax.eval.report``  -- ``python -m kvjax.eval.report <dirs>``: tables (Markdown / CSV) and plots.

Nothing here downloads anything: synthetic tasks are generated locally, benchmark data is read from local
files in the published formats.
"""
