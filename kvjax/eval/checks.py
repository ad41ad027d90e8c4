"""Every refusal a cell would meet when it starts, made for every cell of a sweep before the first one runs, and by
`--dry_run` (which reads the model's architecture, not its weights).

`check_cells(cells, model_config, config)` asks the method (or multi-context strategy) and the runtime what
`prefill` would ask, each error one line naming the flag and the method:

* the prompt length (`--context_length`) against the model's window and the method's budget;
* the cache's storage format (`--kv_dtype`): the head_dim packing, a method that needs the model-dtype cache (KVzip's
  context replay), a replay on a mesh (`--mesh`);
* the model family (`--model`): what a method or strategy cannot run on (KVzap and the multi-context strategies on
  sliding-window layers, layer indices beyond the model);
* learned files (`--method_args`): a Q-Filters / DuoAttention / KVzap file made for another model.

The question layout (`--question_first` without `--query_aware`) and a multi-context strategy on a task without
documents are refused by the config and the plan, before this.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import jax.numpy as jnp

from kvjax.errors import CheckpointError, ConfigError, KvjaxError
from kvjax.eval.cell import Cell
from kvjax.eval.config import EvalConfig
from kvjax.methods import capabilities as caps
from kvjax.methods.base import CacheSpec
from kvjax.models.config import ModelConfig
from kvjax.models.gguf import gguf_config
from kvjax.models.gguf_file import is_gguf_file
from kvjax.models.presets import GGUF_PRESETS, preset_config, resolve_model_dir
from kvjax.runtime import replay
from kvjax.runtime.generate import bucket_length, cache_capacity, check_context
from kvjax.runtime.stages import cache_layer_capacities

__all__ = ["check_cell", "check_cells", "model_config"]


def model_config(config: EvalConfig, *, weights_needed: bool) -> tuple[ModelConfig, str | None]:
    """The architecture of `--model` (config.json, a GGUF header or a preset's), without its weights, and a note
    (None, or why only the preset's architecture was read). `weights_needed`: a preset without local weights is
    refused (a run) instead of noted (`--dry_run`)."""
    name = str(config.model)
    path = pathlib.Path(name).expanduser()
    try:
        if is_gguf_file(path):
            return ModelConfig.from_hf_dict(gguf_config(path)), None
        if path.is_dir():
            return ModelConfig.from_dir(path), None
        if name.strip().lower() in GGUF_PRESETS and not weights_needed:
            return preset_config(name), None  # its weights come with a package, found when the run loads it
        try:
            return ModelConfig.from_dir(resolve_model_dir(name, model_dir=config.model_dir)), None
        except CheckpointError as e:
            if weights_needed:
                raise
            try:
                found = preset_config(name)
            except KvjaxError:
                raise e from None
            return found, "the preset's architecture: its weights are not found here, a run needs them (--model_dir)"
    except KvjaxError as e:
        raise ConfigError(f"--model={name}: {e}") from None


def check_cells(cells: Sequence[Cell], model: ModelConfig, config: EvalConfig) -> None:
    """`check_cell` for every cell (each distinct method once per length and format)."""
    seen = set()
    for cell in cells:
        what = (id(cell.method), id(cell.rag_strategy), cell.context_length, cell.kv_dtype)
        if what not in seen:
            seen.add(what)
            check_cell(cell, model, config)


def check_cell(cell: Cell, model: ModelConfig, config: EvalConfig) -> None:
    """One cell's refusals (see the module docstring), as `ConfigError`s naming the flag and the method."""
    method_flag = f"--method={cell.method_name}"
    if cell.kv_dtype is not None:
        try:
            cell.kv_dtype.check_head_dim(model.head_dim)
        except KvjaxError as e:
            raise ConfigError(f"--kv_dtype={cell.kv_dtype_name}: {e}") from None
    if cell.rag_strategy is not None:
        _check_strategy(cell, model, config, method_flag)
        return
    method, length, max_positions = cell.method, cell.context_length, model.max_position_embeddings
    method.validate(length, 1, max_positions)
    try:
        check_context(method, length, length, max_positions)
    except KvjaxError as e:
        raise ConfigError(f"--context_length={length}: {e}") from None
    try:
        method.check_model(model)
    except KvjaxError as e:
        raise ConfigError(f"{method_flag} on --model={config.model}: {e}") from None
    _check_cache(cell, model, config, method_flag)
    if caps.replays_context(method):
        _check_replay(cell, model, config, method_flag)


def _check_cache(cell: Cell, model: ModelConfig, config: EvalConfig, method_flag: str) -> None:
    """The cache `prefill` allocates for this cell, as `init_cache` checks it (a learned file's layers and heads)."""
    method, bucket = cell.method, bucket_length(cell.context_length)
    try:
        layers = cache_layer_capacities(method, bucket, 1, model.method_layers)
        spec = CacheSpec(batch=config.batch_size, kv_heads=model.num_kv_heads,
                         capacity=cache_capacity(method, bucket, 1, cell.kv_dtype is not None),
                         num_heads=model.num_heads, head_dim=model.head_dim, num_layers=model.method_layers,
                         dtype=jnp.dtype(jnp.float32), quant=cell.kv_dtype, layer_capacities=layers)
        method.check_cache_spec(spec)
    except KvjaxError as e:
        raise ConfigError(f"{method_flag} on --model={config.model}: {e}") from None


def _check_replay(cell: Cell, model: ModelConfig, config: EvalConfig, method_flag: str) -> None:
    """A context replay (KVzip): the model-dtype cache, one device, and the replay rows within the window."""
    method, length = cell.method, cell.context_length
    checks = [(f"--context_length={length}", None, None)]
    if config.mesh is not None:
        data, model_axis = config.mesh
        checks.insert(0, (f"--mesh={config.recorded_flags.get('mesh') or f'data:{data},model:{model_axis}'}", None,
                          config.mesh))
    if cell.kv_dtype is not None:
        checks.insert(0, (f"--kv_dtype={cell.kv_dtype_name}", cell.kv_dtype, None))
    for flag, quant, mesh in checks:  # one setting at a time, so the message names the flag that is refused
        try:
            replay.check(method, model, quant, mesh, length)
        except KvjaxError as e:
            raise ConfigError(f"{flag} with {method_flag}: {e}") from None


def _check_strategy(cell: Cell, model: ModelConfig, config: EvalConfig, method_flag: str) -> None:
    """A multi-context strategy: the context against the model's, and the strategy's own checks against the model
    (layer indices)."""
    if cell.context_length > model.max_position_embeddings:
        raise ConfigError(f"--context_length={cell.context_length} exceeds the model's maximum context of "
                          f"{model.max_position_embeddings} tokens")
    try:
        cell.rag_strategy.validate(None, model)  # the strategies' checks read the model only, not the request
    except KvjaxError as e:
        raise ConfigError(f"{method_flag} on --model={config.model}: {e}") from None

