"""`kvjax.eval.metrics` is `kvjax.tasks.metrics` (moved with the tasks); this module replaces itself by it."""

import sys

from kvjax.tasks import metrics as _metrics

sys.modules[__name__] = _metrics
