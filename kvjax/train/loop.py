"""Training loop for small Llama-architecture models: optax AdamW, warmup + cosine, orbax resume.

The loss is next-token cross-entropy on answer tokens only. Checkpoints hold weights, optimizer
state and the step; batches depend only on (seed, step), so a resumed run continues with exactly the
losses it would have had.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax import tasks as task_registry
from kvjax import tuning
from kvjax.errors import CheckpointError, ConfigError
from kvjax.models import transformer
from kvjax.models.config import ModelConfig, RopeConfig
from kvjax.models.model import DecoderLM
from kvjax.train.data import DEFAULT_TASKS, BatchPrefetcher, TaskMixture
from kvjax.validation import orbax_path_problem


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of a training run (defaults: the embedded `kvjax-tiny` model)."""

    workdir: str = "runs/kvjax-tiny"
    steps: int = 6000
    batch_size: int = 8
    # When > 0, each batch holds this many tokens (batch size = tokens_per_batch // length), so short
    # sequences come in bigger batches and every step costs about the same.
    tokens_per_batch: int = 8192
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    lengths: tuple[int, ...] = (128, 256, 512, 768, 1024)
    curriculum_steps: int = 4000
    # Mixture entries, sampled uniformly (name one twice to double it): eval task names, or the retrieval
    # drills `drill/niah` and `drill/vt` (`kvjax.train.drills`).
    tasks: tuple[str, ...] = DEFAULT_TASKS
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 20
    # Architecture (Llama with GQA).
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    max_position_embeddings: int = 16384
    # Generalising past the trained lengths: with this probability an example's position ids jump
    # forward at a few random places so that its span reaches up to `position_span` (local order and
    # distances stay intact), so attention sees long distances without paying for long sequences.
    position_jump_prob: float = 0.5
    position_span: int = 8192
    # Weight of the plain next-token loss on every token (the answer loss has weight 1). A little of it
    # teaches copying from the repetitive haystack long before the answers are right.
    lm_loss_weight: float = 1.0
    # Share of examples that are a repeated random token segment (an induction warm-up; see data.py).
    copy_prob: float = 0.5
    # A trained Hugging Face directory to start from (its tokenizer too), grown to this architecture
    # with identity layers / heads (`kvjax.train.grow`). Used only when the workdir has no checkpoint.
    init_from: str = ""
    # Tasks whose answers are trained in a random order: their metric ignores the order, and "in the
    # text's order" is one more thing for a small model to learn (multi-value needles share one key).
    shuffle_answers: tuple[str, ...] = ("ruler/niah_multivalue",)
    # Loss weight of an answer's decisions: each item's first token (after a space or comma), the one that
    # needs the retrieval (which needle, which variable), and the comma or end token after an item (is
    # there another?). The rest of a value is copied from where it was found; at weight 1 those copies
    # dominate the answer loss, key matching learns slowly and multi-value answers stop after one value.
    item_start_weight: float = 1.0
    # Processes that build batches ahead of the training step (0: built in the loop). On a GPU the task
    # generators are the bottleneck without them; batches are the same either way.
    data_workers: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "warmup_steps", "checkpoint_every", "log_every", "num_layers", "num_heads",
                     "num_kv_heads", "seed"):
            if getattr(self, name) < (0 if name in ("warmup_steps", "seed") else 1):
                raise ConfigError(f"{name} must be {'>= 0' if name in ('warmup_steps', 'seed') else 'positive'}, "
                                  f"got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        problem = orbax_path_problem(os.path.join(self.workdir, "checkpoints"))  # its checkpoints would not restore
        if problem:
            raise ConfigError(f"workdir {self.workdir!r}: {problem}; choose another folder")
        if self.num_heads % self.num_kv_heads or (not self.head_dim and self.hidden_size % self.num_heads):
            raise ConfigError(
                "num_heads must divide by num_kv_heads, and hidden_size by num_heads unless head_dim is set"
            )
        if self.head_dim < 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be 0 or a positive even number, got {self.head_dim}")
        if not 0.0 <= self.position_jump_prob <= 1.0:
            raise ConfigError(f"position_jump_prob must be in [0, 1], got {self.position_jump_prob}")
        if self.position_span > self.max_position_embeddings:
            raise ConfigError(
                f"position_span ({self.position_span}) exceeds max_position_embeddings "
                f"({self.max_position_embeddings})"
            )
        if not 0.0 <= self.copy_prob < 1.0:
            raise ConfigError(f"copy_prob must be in [0, 1), got {self.copy_prob}")
        if self.item_start_weight <= 0:
            raise ConfigError(f"item_start_weight must be > 0, got {self.item_start_weight}")
        if self.data_workers < 0:
            raise ConfigError(f"data_workers must be >= 0, got {self.data_workers}")
        if self.lm_loss_weight < 0:
            raise ConfigError(f"lm_loss_weight must be >= 0, got {self.lm_loss_weight}")

    def rows(self, length: int) -> int:
        """Examples per batch at this sequence length."""
        return self.batch_size if self.tokens_per_batch <= 0 else max(1, self.tokens_per_batch // length)

    def model_config(self, vocab_size: int, eos_token_id: int, bos_token_id: int, pad_token_id: int) -> ModelConfig:
        return ModelConfig(
            model_type="llama", vocab_size=vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim or self.hidden_size // self.num_heads,
            rms_norm_eps=1e-5,
            rope=RopeConfig(theta=self.rope_theta), max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True, bos_token_id=bos_token_id, eos_token_ids=(eos_token_id,),
            pad_token_id=pad_token_id,
        )


#: Query rows per tile of the training attention (64 and 128 measured alike; 256 is ~1.3x slower).
ATTENTION_BLOCK = 128


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                      block: int = ATTENTION_BLOCK) -> jax.Array:
    """Causal GQA attention over the whole sequence, for training (short sequences, cheap gradients).

    Query rows are taken `block` at a time, each against the keys up to its last row only, so the
    masked upper triangle is never computed: a static triangular tiling (t / block tiles, unrolled at
    trace time) that does about half the dense work and keeps each score tile small. Per layer,
    forward + backward on the CPU: 1024 tokens 291 -> 117 ms, 4096 tokens 2098 -> 494 ms against the
    dense square. Causality follows the token index, so position ids may jump; softmax in float32.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h) * (h**-0.5)
    tiles = []
    for lo in range(0, t, block):
        hi = min(lo + block, t)
        scores = jnp.einsum("btkgh,bskh->bkgts", q[:, lo:hi], k[:, :hi], preferred_element_type=jnp.float32)
        causal = jnp.arange(hi)[None, :] <= jnp.arange(lo, hi)[:, None]
        allowed = causal[None, None, None] & valid[:, None, None, None, :hi]
        probs = jax.nn.softmax(jnp.where(allowed, scores, -1e30), axis=-1)
        tiles.append(jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v[:, :hi]))
    return jnp.concatenate(tiles, axis=1).reshape(b, t, n, h)


def train_logits(config: ModelConfig, weights: dict, rope: tuple, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """`transformer.forward` with the tiled training attention: the same function, cheaper to differentiate."""
    return transformer.forward(config, weights, rope, tokens, positions, attention=_causal_attention)


def loss_fn(config: ModelConfig, weights: dict, rope: tuple, tokens: jax.Array, positions: jax.Array,
            mask: jax.Array, lm_weight: float = 0.0) -> jax.Array:
    """Cross-entropy of the answer predictions weighted by `mask`, plus `lm_weight` x that of every token."""
    logits = train_logits(config, weights, rope, tokens, positions)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    answer = jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    if not lm_weight:
        return answer
    seen = ((positions[:, 1:] >= 0) & (positions[:, :-1] >= 0)).astype(jnp.float32)
    every = jnp.sum(losses[:, :-1] * seen) / jnp.maximum(jnp.sum(seen), 1.0)
    return answer + lm_weight * every


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.steps, cfg.warmup_steps + 1), cfg.learning_rate * 0.05
    )
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.adamw(schedule, weight_decay=cfg.weight_decay))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(4, 5))
def _train_step(config, tune, optimizer, lm_weight, weights, opt_state, rope, tokens, positions, mask):
    """One optimizer step, compiled per (config, tuning, optimizer, loss weight): the model's traced code reads
    `tune` (`tuning.use`), so a later `tuning.override` compiles its own program instead of reusing this one."""
    with tuning.use(tune):
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(config, weights, rope, tokens, positions, mask,
                                                             lm_weight)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, loss


def _checkpointer(workdir: str, keep: int = 2):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    # The handler named, so that `item_metadata` can read a checkpoint's tree before restoring it.
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options,
                                 item_handlers=ocp.StandardCheckpointHandler())


def latest_checkpoint(workdir: str) -> int | None:
    """The step of `workdir`'s latest checkpoint; None when it has none (creates nothing)."""
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        return None
    manager = _checkpointer(workdir)
    try:
        return manager.latest_step()
    finally:
        manager.close()


_RESTART = ("finish or export that run with the kvjax that wrote it, or start a new --workdir "
            "(--init_from=<exported model> continues from its weights)")


def _check_layout(manager: Any, step: int, workdir: str) -> None:
    """Refuses a checkpoint of an older weight layout, whose weights and optimizer state do not restore into
    today's: the stacked one (``layers.<name>`` arrays with a leading layer axis) and the unfused one (separate
    q / k / v, gate / up per layer)."""
    tree = manager.item_metadata(step)
    weights = (getattr(tree, "tree", tree) or {}).get("weights", {})
    stacked = sorted(k for k in weights if isinstance(k, str) and k.startswith("layers."))
    if stacked:
        raise CheckpointError(
            f"{workdir}: the checkpoint at step {step} holds stacked layer weights ({', '.join(stacked[:3])}, ...) "
            f"from a kvjax before the per-layer layout; {_RESTART}"
        )
    layers = weights.get("layers") or ()
    first = next(iter(layers.values() if isinstance(layers, dict) else layers), None)
    if isinstance(first, dict) and {"q", "gate"} & set(first):
        raise CheckpointError(
            f"{workdir}: the checkpoint at step {step} holds separate q / k / v and gate / up layer weights from a "
            f"kvjax before the fused projections (qkv, gate_up); {_RESTART}"
        )


def _check_shapes(manager: Any, step: int, workdir: str, weights: dict) -> None:
    """Refuses a checkpoint whose weights are not the shapes this run's flags make (a resume with another
    `--hidden_size`, `--num_layers`, ...), which orbax's restore answers with a traceback suggesting truncation."""
    tree = manager.item_metadata(step)
    stored = (getattr(tree, "tree", tree) or {}).get("weights", {})

    def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
        return {jax.tree_util.keystr(path): tuple(leaf.shape)
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    have, want = shapes(stored), shapes(weights)
    if have != want:
        name = next(k for k in [*want, *have] if have.get(k) != want.get(k))
        raise CheckpointError(
            f"{workdir}: the checkpoint at step {step} holds weights of another architecture (weights{name}: "
            f"{have.get(name, 'absent')} stored, {want.get(name, 'absent')} with these flags); resume with the "
            f"flags it was trained with (the last line of {os.path.join(workdir, 'runs.jsonl')}), or start a new "
            "--workdir (--init_from=<exported model> grows a trained model)"
        )


def _initial_weights(cfg: TrainConfig, config: ModelConfig) -> dict:
    """The weights of `cfg.init_from`, grown to `config` (the same function; see `kvjax.train.grow`)."""
    from kvjax.models.model import load_model
    from kvjax.train.grow import grow

    start = load_model(cfg.init_from, dtype="float32")
    return jax.tree.map(jnp.asarray, grow(start.weights(), start.config, config, seed=cfg.seed))


def _append_jsonl(workdir: str, name: str, record: dict) -> None:
    """One JSON line appended to `<workdir>/<name>`, synced so that a killed run keeps it."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, name), "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _log_launch(cfg: TrainConfig, start: int) -> None:
    """Appends this launch's step and full config to `<workdir>/runs.jsonl`: a run resumed with changed
    flags keeps its whole history next to its checkpoints."""
    record = {"start_step": start, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": dataclasses.asdict(cfg)}
    _append_jsonl(cfg.workdir, "runs.jsonl", record)


def train(cfg: TrainConfig, tokenizer: Any, *, progress: bool = True, stop_at: int | None = None,
          on_step: Callable[[int, float], None] | None = None) -> tuple[DecoderLM, list[float]]:
    """Trains (or resumes) in `cfg.workdir`; returns the model and the losses of the steps run now.

    `stop_at` ends this run early at that step (after checkpointing), as an interruption would; at or
    below the restored step it runs nothing and returns the checkpointed model (an export of a live run).
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    for name in cfg.shuffle_answers:  # not all of them need be trained, but each must be a task
        task_registry.get(name)
    mixture = TaskMixture(tokenizer, task_names=cfg.tasks, lengths=cfg.lengths, seed=cfg.seed,
                          curriculum_steps=cfg.curriculum_steps, position_jump_prob=cfg.position_jump_prob,
                          position_span=cfg.position_span, copy_prob=cfg.copy_prob,
                          shuffle_answers=[t for t in cfg.shuffle_answers if t in cfg.tasks],
                          item_start_weight=cfg.item_start_weight)
    config = cfg.model_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id)
    model = DecoderLM.random(config, seed=cfg.seed, dtype=jnp.float32, scale=0.02)
    optimizer = make_optimizer(cfg)
    weights = model.weights()
    opt_state = optimizer.init(weights)
    start = 0
    manager = _checkpointer(cfg.workdir)
    latest = manager.latest_step()
    if latest is None and cfg.init_from:
        weights = _initial_weights(cfg, config)
        opt_state = optimizer.init(weights)
    if latest is not None:
        _check_layout(manager, latest, cfg.workdir)
        _check_shapes(manager, latest, cfg.workdir, weights)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"weights": weights, "opt_state": opt_state})
        restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
        weights, opt_state, start = restored["weights"], restored["opt_state"], latest
    rope = model.rope()
    losses = []
    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    if start < end:
        _log_launch(cfg, start)
    elif stop_at is None:  # a finished run relaunched (a reused workdir): say so instead of silently exporting
        print(f"kvjax.train: {cfg.workdir} is at step {start}, not below --steps={cfg.steps}: nothing to train "
              "(raise --steps to train on, or use a new --workdir)", file=sys.stderr)
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, disable=not progress, unit="step")
    batches = BatchPrefetcher(mixture, cfg.rows, workers=cfg.data_workers if start < end else 0)
    try:
        for step in bar:
            batch = batches.batch(step, end)
            weights, opt_state, loss = _train_step(
                config, tuning.current(), optimizer, cfg.lm_loss_weight, weights, opt_state, rope,
                jnp.asarray(batch.tokens), jnp.asarray(batch.positions), jnp.asarray(batch.loss_mask),
            )
            loss = float(loss)
            losses.append(loss)
            if on_step is not None:
                on_step(step + 1, loss)
            if (step + 1) % cfg.log_every == 0:
                mean = float(np.mean(losses[-cfg.log_every:]))
                bar.set_postfix(loss=f"{mean:.4f}", length=batch.tokens.shape[1])
                # The loss curve beside the checkpoints, for runs without a progress bar (batch jobs).
                _append_jsonl(cfg.workdir, "metrics.jsonl",
                              {"step": step + 1, "loss": mean, "length": mixture.length(step)})
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end:
                manager.save(step + 1, args=ocp.args.StandardSave({"weights": weights, "opt_state": opt_state}))
    finally:
        batches.close()
    manager.wait_until_finished()
    manager.close()
    trained = DecoderLM(config, jax.tree.map(np.asarray, weights), dtype=jnp.float32)
    return trained, losses
