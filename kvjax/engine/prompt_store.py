"""The engine's prompt passes kept on disk (`Engine(prompt_store=DIR)`, `kvjax.run --prompt_store=DIR`).

A prompt pass (the prompt's prefill and compression, before the question: `stages.through_prompt`) is the costly
part of a long-context request. The engine holds the last one for the next prefill (`share_prompts`); the store
keeps every one in a file (`kvjax.runtime.pass_file`), so a context whose questions are spread through a job, or a
job run again (other questions, seeds, samples or stop strings), reads its pass back instead of computing it. A file
is named by a SHA-256 of everything the pass depends on: the model's fingerprint, the method and its
hyperparameters, the storage format, the backend and the jax / kvjax versions, the prompt rows, the sizes the plan
gave them (bucket, chunk, cache sizes, which follow the engine's `max_new_tokens`, sliding-window rings), the RoPE's
values, the tuning in force when the pass runs and the mesh's shape (a pass computed on a one-process mesh is read
back placed as the engine places its own). A pass read back is the one the engine would compute, bit for
bit, so the outputs are unchanged. A file that cannot be read (damaged, truncated, another version) is computed
again and replaced, with a warning; one that cannot be written is skipped, with a warning.

A long context's pass is large (its compressed cache: gigabytes for an 8B model at 32K), so a store may be given a
size (`max_bytes`): after each write the least recently used pass files of the folder (read or written longest
ago) are removed until the folder's pass files fit, and a pass larger than the whole size is not kept. Only files
named as passes are counted or removed; anything else in the folder is left as it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import re
import time
from typing import Any

import jax
import numpy as np

import kvjax
from kvjax import tuning
from kvjax._process import pid_alive
from kvjax.errors import CheckpointError, ConfigError
from kvjax.methods.base import Method, per_example_budget
from kvjax.models.fingerprint import fingerprint_of
from kvjax.quant.spec import KVQuant
from kvjax.runtime import pass_file, sharding, stages, step

FORMAT = "kvjax.prompt_pass"
FORMAT_VERSION = 1
_WHAT = "kvjax prompt-pass file"
#: A pass file's name (`PromptStore.path`): what the store counts and removes, and nothing else in its folder.
PASS_NAME = re.compile(r"[0-9a-f]{40}\.safetensors")
#: A pass file being written (`pass_file.write`'s temporary name, with the writer's pid).
PARTIAL_NAME = re.compile(r"\.[0-9a-f]{40}\.safetensors\.kvjax-tmp-(\d+)")
#: A partial file untouched this long, whose writer is gone, was left by a killed process.
ABANDONED_AFTER_S = 600.0
log = logging.getLogger(__name__)


class PromptStore:
    """Prompt passes of one model, method and storage format in the folder `folder` (created where missing); with
    `max_bytes`, the folder's pass files are kept within that many bytes, the least recently used removed first."""

    def __init__(self, folder: str | os.PathLike, model: Any, method: Method, quant: KVQuant | None,
                 max_bytes: int | None = None, mesh: Any = None) -> None:
        self.folder = pathlib.Path(folder).expanduser().absolute()
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(f"prompt_store {self.folder} is a file, not a folder")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int | np.integer)
                                      or max_bytes <= 0):
            raise ConfigError(f"prompt_store_max_bytes must be a positive number of bytes, got {max_bytes!r}")
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        if mesh is not None and mesh.is_multi_process:
            raise ConfigError("a prompt store reads and writes whole prompt passes from one process; it does not run "
                              "on a mesh that spans processes")
        self.mesh = mesh
        self.model, self.method = model, method
        self.identity = json.dumps({
            "format": FORMAT, "version": FORMAT_VERSION, "model": fingerprint_of(model),
            "method": pass_file.method_record(method), "kv_dtype": None if quant is None else quant.name,
            "backend": jax.default_backend(), "jax": jax.__version__,
            "kvjax": kvjax.__version__, "mesh": None if mesh is None else dict(mesh.shape),
        }, sort_keys=True)
        self.read = self.written = self.removed = self.too_large = 0
        self.abandoned = _remove_abandoned(self.folder)

    def path(self, plan: stages.PrefillPlan) -> pathlib.Path:
        """The file of `plan`'s prompt pass. Of the plan's lengths it names what the pass reads: the cache's sizes,
        each sliding-window ring's (not the sequence length it came from) and the RoPE's values (LongRoPE's factors
        depend on the length, nothing else's do)."""
        config = self.model.config
        rings = [None if w is None else step.ring_capacity(w, plan.context) for w in config.layer_windows]
        sizes = [plan.bucket, plan.chunk, plan.capacity, plan.layer_capacities, rings, plan.batch,
                 None if plan.question_first_lengths is None else plan.question_first_lengths.tolist()]
        h = hashlib.sha256(self.identity.encode())
        h.update(json.dumps(sizes).encode())
        h.update(repr(tuning.current()).encode())  # read when the pass is traced (a caller may change it mid-job)
        for x in jax.tree.leaves(self.model.rope(plan.rope_length)):
            h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
        h.update(np.ascontiguousarray(plan.tokens, np.int64).tobytes())
        h.update(np.ascontiguousarray(plan.lengths, np.int64).tobytes())
        return self.folder / f"{h.hexdigest()[:40]}.safetensors"

    def load(self, plan: stages.PrefillPlan, weights: dict) -> stages.Prefilling | None:
        """`plan`'s prompt pass from its file, or None (no file, or one that cannot be read: warned)."""
        path = self.path(plan)
        if not path.exists():
            return None
        try:
            meta, tensors = pass_file.read(path, FORMAT, FORMAT_VERSION, _WHAT)
            if meta.get("identity") != self.identity:
                raise CheckpointError(f"{path}: written for another model, method or setting")
            cache, last_hidden = pass_file.cache_and_hidden(path, tensors, meta, self.model, plan, verify=True)
        except CheckpointError as e:
            log.warning("kvjax prompt store: %s; computing the prompt pass again", e)
            return None
        self.read += 1
        _touch(path)  # used now: the last to be removed
        budget = per_example_budget(plan.method, plan.lengths)
        if self.mesh is not None:  # placed as `stages.allocate` places a pass computed on the mesh
            put = stages.placer(self.mesh)
            cache, last_hidden, budget = sharding.shard_cache(cache, self.mesh), put(last_hidden), put(budget)
        return stages.Prefilling(cache=cache, last_hidden=last_hidden, lengths=plan.lengths, budget=budget,
                                 weights=weights, rope=self.model.rope(plan.rope_length), mesh=self.mesh)

    def save(self, plan: stages.PrefillPlan, prompted: stages.Prefilling) -> None:
        """Writes `plan`'s prompt pass (a file system error is warned and skipped: the job goes on), then keeps the
        folder within `max_bytes`."""
        path = self.path(plan)
        size = sum(x.nbytes for x in jax.tree.leaves((prompted.cache, prompted.last_hidden)))
        if self.max_bytes is not None and size > self.max_bytes:
            self._too_large(path, size)
            return
        try:
            pass_file.write(path, prompted.cache, prompted.last_hidden, {},
                            {"format": FORMAT, "version": FORMAT_VERSION, "identity": self.identity})
        except OSError as e:
            log.warning("kvjax prompt store: cannot write %s (%s); the job goes on without it", path,
                        e.strerror or e)
            return
        self.written += 1
        if self.max_bytes is not None:
            self._fit(keep=path)

    def pass_files(self) -> list[tuple[int, str, int]]:
        """`(last used, name, bytes)` of each pass file in the folder, least recently used first (a file another
        process removes meanwhile is left out)."""
        files = []
        for path in self.folder.glob("*.safetensors"):
            if PASS_NAME.fullmatch(path.name):
                try:
                    st = path.stat()
                except OSError:
                    continue
                files.append((st.st_mtime_ns, path.name, st.st_size))
        return sorted(files)

    def _fit(self, keep: pathlib.Path) -> None:
        """Removes the least recently used pass files until the folder's fit in `max_bytes`, `keep` (the pass just
        written) only if it alone does not fit."""
        files = self.pass_files()
        total = sum(size for _, _, size in files)
        for _, name, size in files:  # least recently used first
            if total <= self.max_bytes:
                return
            if name != keep.name and _remove(self.folder / name):
                total -= size
                self.removed += 1
        if total > self.max_bytes and _remove(keep):  # its own header took it past the size
            self.written -= 1
            self._too_large(keep, next((size for _, name, size in files if name == keep.name), total))

    def _too_large(self, path: pathlib.Path, size: int) -> None:
        if not self.too_large:
            log.warning("kvjax prompt store: a prompt pass of %.1f MB is larger than the store's %.1f MB, so it is "
                        "not kept (%s); the job goes on", size / 1e6, self.max_bytes / 1e6, path.name)
        self.too_large += 1


def _remove_abandoned(folder: pathlib.Path) -> int:
    """Removes the partial pass files a killed writer left in `folder` (its pid gone, the file untouched for
    `ABANDONED_AFTER_S`): no size bound counts them, so they would stay for good. Returns how many."""
    removed = 0
    now = time.time()
    for path in folder.glob(".*.kvjax-tmp-*") if folder.is_dir() else ():
        match = PARTIAL_NAME.fullmatch(path.name)
        try:
            stale = match is not None and now - path.stat().st_mtime > ABANDONED_AFTER_S
        except OSError:
            continue
        if stale and not pid_alive(int(match.group(1))) and _remove(path):
            removed += 1
    return removed


def _remove(path: pathlib.Path) -> bool:
    """Removes `path` (True), or warns (False); one another process removed first counts as removed."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("kvjax prompt store: cannot remove %s (%s)", path, e.strerror or e)
        return False
    return True


def _touch(path: pathlib.Path) -> None:
    """Marks `path` used now (its modification time: access times are often not kept)."""
    try:
        os.utime(path)
    except OSError:
        pass


__all__ = ["FORMAT", "FORMAT_VERSION", "PARTIAL_NAME", "PASS_NAME", "PromptStore"]
