"""`kvjax._process.pid_alive`, which the GGUF conversion's temp-dir cleanup and the eval's cell claims share."""

import os
import subprocess
import sys

from kvjax._process import pid_alive


def test_a_finished_process_is_dead_and_this_one_alive():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid)
    assert pid_alive(os.getpid())


def test_pids_that_name_no_single_process_count_as_alive():
    # os.kill reads 0 and negatives as process groups: nothing that cannot be checked is taken over
    assert pid_alive(0) and pid_alive(-1)
