"""Evaluation: benchmark tasks, metrics, resumable result storage and reports.

* ``kvjax.eval.tasks``   -- task registry (RULER, passkey, needle, LongBench, InfiniteBench, multidoc).
* ``kvjax.eval.metrics`` -- the papers' scoring functions (string match, QA F1, ROUGE-L, code similarity...).
* ``kvjax.eval.results`` -- ``RunDir``: append-only ``predictions.jsonl`` with crash-safe resume.
* ``kvjax.eval.report``  -- ``python -m kvjax.eval.report <dirs>``: tables (Markdown / CSV) and plots.

Nothing here downloads anything: synthetic tasks are generated locally, benchmark data is read from local
files in the published formats.
"""
