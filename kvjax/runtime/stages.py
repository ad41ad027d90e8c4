"""Prefill as a short pipeline of named stages over a host-side plan.

`plan` decides everything on the host, before anything is traced: the inputs checked, the question's layout (fed
uncompressed after the compressed prompt, read by the method as the end of the prompt, or also before it), the
length bucket and chunk size, the cache's capacity (per layer, and the sliding-window rings' context), and which
passes run. The device work is then

    allocate -> prompt -> [context replay] -> [question] -> finish

each stage a function of the plan and the `Prefilling` the previous one handed on (`run` chains them;
`kvjax.runtime.generate.prefill` is `plan` + `run`). A caller that needs one stage differently (the engine sizes the
cache for its slots with `PrefillPlan.reserving`; the shared-prefill replay fills the cache from a recording and
then reuses `append_question`) composes the same pieces.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax import methods as kvm
from kvjax import tuning
from kvjax.cache import KVCache, ModelCache
from kvjax.errors import ConfigError, KvjaxError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import CacheSpec, Method, per_example_budget
from kvjax.quant.spec import KVQuant, parse_kv_dtype
from kvjax.runtime import forward, replay, sharding, step
from kvjax.runtime.forward import final_logits
from kvjax.validation import as_int, token_ids, token_rows

Array = jax.Array

#: The method that keeps every token: the prompt pass of a context-replay method, the question pass, the rings.
KEEP_ALL = kvm.get("full")


@dataclasses.dataclass
class PrefillState:
    """What `prefill` hands to `decode`."""

    cache: ModelCache
    logits: Array  # [B, V] float32 logits of each example's last prompt token
    prompt_lengths: np.ndarray
    budget: Array  # [B] int32
    method: Method
    mesh: Any = None  # the jax.sharding.Mesh prefill ran on (decode defaults to it)
    rope: Any = None  # the RoPE prefill rotated with (LongRoPE's factors are picked once); None: model.rope()
    max_new_tokens: int | None = None  # the new tokens the cache has room for (decode refuses more); None: unchecked


# ---- host-side helpers ------------------------------------------------------------------------------------------

def bucket_length(n: int, minimum: int = 16, multiple: int = 1) -> int:
    """Power of two up to 4096, then multiples of 4096; rounded up to `multiple`."""
    b = max(minimum, 1 << (max(n, 1) - 1).bit_length()) if n <= 4096 else -(-n // 4096) * 4096
    return -(-b // multiple) * multiple


def token_batch(input_ids: Any, prompt_lengths: Any, *, allow_empty: bool = False,
                name: str = "input_ids") -> tuple[np.ndarray, np.ndarray]:
    """Right-padded `[B, T]` int64 tokens and `[B]` int32 lengths from an array or a list of lists (ids checked by
    the shared `kvjax.validation.token_rows`; the vocabulary range is checked on the real tokens later)."""
    tokens, ragged_lengths = token_rows(input_ids, name, allow_empty_rows=allow_empty)
    if ragged_lengths is not None:
        lengths = ragged_lengths
        if prompt_lengths is not None and not np.array_equal(np.asarray(prompt_lengths), lengths):
            raise KvjaxError(f"prompt_lengths {np.asarray(prompt_lengths).tolist()} disagree with the ragged rows' "
                             f"lengths {np.asarray(lengths).tolist()}")
    elif prompt_lengths is None:
        lengths = np.full(tokens.shape[0], tokens.shape[1])
    else:
        lengths = np.asarray(prompt_lengths).reshape(-1)
        if lengths.dtype == np.bool_ or not np.issubdtype(lengths.dtype, np.integer):
            raise KvjaxError(f"prompt_lengths must be integers, got {lengths.dtype} values {prompt_lengths!r}")
        if lengths.shape[0] != tokens.shape[0]:
            raise KvjaxError(
                f"prompt_lengths has {lengths.shape[0]} entries but input_ids has batch {tokens.shape[0]}"
            )
        if (lengths > tokens.shape[1]).any():
            raise KvjaxError(
                f"prompt_lengths {lengths.tolist()} exceed the padded prompt length {tokens.shape[1]}"
            )
    if not allow_empty and (lengths <= 0).any():
        raise KvjaxError(f"empty prompt: every prompt needs at least one token, got lengths {lengths.tolist()}")
    return tokens, lengths.astype(np.int32)


def concat_rows(tokens: np.ndarray, lengths: np.ndarray, extra: np.ndarray,
                extra_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded rows `tokens[:lengths] + extra[:extra_lengths]` and their lengths."""
    total = (lengths + extra_lengths).astype(np.int32)
    out = np.zeros((tokens.shape[0], max(1, int(total.max()))), np.int64)
    for i, (n, m) in enumerate(zip(lengths, extra_lengths, strict=True)):
        out[i, :n] = tokens[i, :n]
        out[i, n : n + m] = extra[i, :m]
    return out, total


def resolve_method(method: str | Method, method_args: dict | None) -> Method:
    """A registered name (+ its hyperparameters) or a `Method` instance -> the method."""
    if isinstance(method, Method):
        if method_args:
            raise ConfigError("pass hyperparameters either in the Method instance or method_args, not both")
        return method
    if not isinstance(method, str):
        raise ConfigError(f"method must be a registered name or a Method, got {type(method).__name__}")
    if method_args is not None and not isinstance(method_args, dict):
        raise ConfigError(f"method_args must be a dict of hyperparameters, got {type(method_args).__name__}")
    return kvm.get(method, **(method_args or {}))


def resolve_kv_dtype(kv_dtype: str | KVQuant | None, head_dim: int) -> KVQuant | None:
    """`kv_dtype=` checked for a model's head_dim (before anything is traced): None for the model dtype."""
    quant = parse_kv_dtype(kv_dtype)
    if quant is not None:
        quant.check_head_dim(head_dim)
    return quant


def cache_capacity(method: Method, bucket: int, max_new_tokens: int, quantized: bool = False) -> int:
    """The slots a prefill of `bucket` tokens allocates: the method's capacity, rounded up to
    `Tuning.cache_slot_multiple` for a method whose decode only appends (and a cache in the model dtype)."""
    capacity = method.capacity(bucket, max_new_tokens)
    multiple = tuning.current().cache_slot_multiple
    if multiple > 1 and method.decode_appends_only and not quantized:
        capacity = -(-capacity // multiple) * multiple
    return capacity


#: The prompt length at which a method's per-layer sizes are grouped (`cache_layer_capacities`): long enough that
#: each size is its share of the prompt, not of `max_new_tokens` or a rounding.
GROUPING_PROMPT = 1 << 20


def cache_layer_capacities(method: Method, bucket: int, max_new_tokens: int,
                           num_layers: int) -> tuple[int, ...] | None:
    """The slots each managed layer allocates for a prefill of `bucket` tokens (None: every layer at
    `cache_capacity`). Each distinct size compiles its own prefill program, so the layers are grouped once per method
    and `Tuning.layer_slack`: the groups `merge_sizes` makes of the method's sizes at a `GROUPING_PROMPT`-token
    prompt (`Method.layer_capacities`). A layer then takes its group's largest size at this bucket: groups that do
    not depend on the bucket keep every layer's size monotone in the bucket, so a shorter prompt's cache fits a longer
    one's (the engine's slots)."""
    sizes = method.layer_capacities(bucket, max_new_tokens, num_layers)
    slack = tuning.current().layer_slack
    if sizes is None or slack <= 0:
        return sizes
    group = merge_sizes(tuple(method.layer_capacities(GROUPING_PROMPT, 0, num_layers)), float(slack))
    largest = {g: max(size for size, other in zip(sizes, group, strict=True) if other == g) for g in set(group)}
    return tuple(largest[g] for g in group)


@functools.lru_cache(maxsize=256)
def merge_sizes(sizes: tuple[int, ...], slack: float) -> tuple[int, ...]:
    """`sizes` rounded up onto the fewest distinct values that add at most `slack` x their sum (0: unchanged), and of
    those the least total. The values are sizes of `sizes`: the distinct ones, sorted, split into runs, each run
    rounded up to its largest; a dynamic program over the split points gives the least total for each run count."""
    values = sorted(set(sizes))
    if slack <= 0 or len(values) == 1:
        return tuple(sizes)
    allowed = sum(sizes) * (1.0 + slack)
    layers = np.cumsum([0] + [sizes.count(v) for v in values])  # layers[i]: layers of the i smallest sizes

    def run_cost(i: int, j: int) -> int:  # values[i..j] all rounded up to values[j]
        return int(layers[j + 1] - layers[i]) * values[j]

    # best[j]: the least total of values[0..j] in the runs so far, the last run ending at j; starts[r][j]: where the
    # last of r + 1 runs begins
    best, starts = [run_cost(0, j) for j in range(len(values))], [[0] * len(values)]
    while best[-1] > allowed:  # one more run (ends when every value is a run of its own: the sum itself)
        row, begin = [], []
        for j in range(len(values)):
            cost, i = min(((best[i - 1] + run_cost(i, j), i) for i in range(1, j + 1)), default=(best[j], 0))
            row.append(cost)
            begin.append(i)
        best = row
        starts.append(begin)
    tops, j = [], len(values) - 1
    for begin in reversed(starts):
        if j < 0:
            break
        tops.append(values[j])
        j = begin[j] - 1
    tops.sort()
    return tuple(next(t for t in tops if t >= s) for s in sizes)


def init_cache(method: Method, config: Any, batch: int, capacity: int, dtype: Any,
               kv_dtype: str | KVQuant | None = None, *, context: int | None = None,
               layer_capacities: tuple[int, ...] | None = None) -> ModelCache:
    """An empty per-layer cache for `method` on a model with `config` (what `prefill` allocates): `capacity` slots
    on the layers without a window, a ring on each sliding-window layer (`step.ring_capacity`: its window, or
    `context`, the most tokens a sequence will hold, when that is smaller); `kv_dtype`: its K / V storage (see
    `prefill`); each managed layer at `capacity` slots, or at its own `layer_capacities`
    (`Method.layer_capacities`)."""
    quant = resolve_kv_dtype(kv_dtype, config.head_dim)
    spec = CacheSpec(
        batch=batch, kv_heads=config.num_kv_heads, capacity=capacity, num_heads=config.num_heads,
        head_dim=config.head_dim, num_layers=config.method_layers, dtype=jnp.dtype(dtype), quant=quant,
        layer_capacities=layer_capacities,
    )
    rings = tuple(None if w is None else step.ring_capacity(w, context) for w in config.layer_windows)
    return step.init_cache(method, spec, rings)


def batch_leaves(empty: Callable[[int], ModelCache]) -> tuple[bool, ...]:
    """Which leaves of the caches `empty(batch)` makes (in `jax.tree.leaves` order) have the batch axis first: those
    whose leading dimension follows the batch (constants such as a learned file's weights in the shared state do
    not). Read from `jax.eval_shape` at two batch sizes: nothing is allocated."""
    one, two = (jax.tree.leaves(jax.eval_shape(lambda b=b: empty(b))) for b in (1, 2))
    return tuple(a.ndim > 0 and b.ndim > 0 and (a.shape[0], b.shape[0]) == (1, 2) for a, b in zip(one, two,
                                                                                                   strict=True))


def check_context(method: Method, needed: int, prompt: int, max_positions: int) -> None:
    """Refuses sequences past the model window unless the method's attention distance stays within it.

    `needed`: prompt + new tokens; `prompt`: the prompt alone (for the message). The eval CLI calls it for
    every cell of a sweep before the first one runs."""
    reach = caps.max_attended_distance(method)
    if reach is not None and reach >= max_positions:
        raise KvjaxError(f"{method.name}: attends distances up to {reach}, beyond the model's {max_positions}")
    if reach is None and needed > max_positions:
        bounded = ", ".join(m for m in kvm.available() if _bounded(m))
        what = f"prompt of {prompt} tokens + {needed - prompt} new tokens" if needed > prompt else (
            f"a sequence of {needed} tokens (prompt and answer)")  # the eval's context length counts its answers
        raise KvjaxError(
            f"{what} exceeds the model's maximum context of "
            f"{max_positions}; methods whose attention never spans more than the window can go past it: {bounded}"
        )


def _bounded(name: str) -> bool:
    try:
        return caps.max_attended_distance(kvm.get(name)) is not None
    except (ConfigError, TypeError):  # a method that needs hyperparameters to be built
        return False


# ---- the plan ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """Everything a prefill decided on the host: what each stage runs, on arrays of which shapes."""

    method: Method
    quant: KVQuant | None
    tokens: np.ndarray  # [B, bucket] int32 padded prompt rows (a question the method reads is inside them)
    positions: np.ndarray  # [B, bucket] int32, -1 = padding
    lengths: np.ndarray  # [B] int32 prompt lengths as prefilled
    question: np.ndarray | None  # [B, Q] question ids fed uncompressed after the prompt pass (None: no such pass)
    question_lengths: np.ndarray | None  # [B]
    question_first_lengths: np.ndarray | None  # [B] lengths of a question that also opens the prompt (Q-LLM)
    bucket: int  # the prompt rows' padded length
    chunk: int  # tokens per prompt chunk (`bucket`: one shot)
    question_bucket: int  # the question pass's padded length (0: none)
    max_new_tokens: int  # the generation the cache is sized for
    capacity: int  # slots of each managed layer after the prompt pass
    layer_capacities: tuple[int, ...] | None  # or per layer (`Method.layer_capacities`)
    rope_length: int  # the longest sequence before decode (LongRoPE picks its factors from it)
    ring_context: int | None = None  # sizes the sliding-window rings instead of `context` (`reserving`)

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def replays(self) -> bool:
        """A context-replay method (KVzip) scores after an uncompressed prompt pass: the prompt is held whole."""
        return caps.replays_context(self.method)

    @property
    def question_first(self) -> bool:
        return self.question_first_lengths is not None

    @property
    def has_question(self) -> bool:
        return self.question_bucket > 0

    @property
    def context(self) -> int:
        """The most tokens a sequence holds: what a sliding-window layer's ring is sized for."""
        if self.ring_context is not None:
            return self.ring_context
        return self.bucket + self.question_bucket + self.max_new_tokens

    @property
    def fresh(self) -> bool:
        """One chunk into an empty cache attends over its own keys only (no scan over the empty slots)."""
        return self.chunk >= self.bucket and not self.question_first and step.attends_own_chunk(self.method)

    @property
    def ring_fresh(self) -> bool:
        """A sliding-window layer's ring acts as the full cache does, whatever the method."""
        return self.chunk >= self.bucket and step.attends_own_chunk(KEEP_ALL)

    def reserving(self, max_new_tokens: int, ring_context: int | None = None) -> PrefillPlan:
        """The same prefill with its cache sized for `max_new_tokens` new tokens (at least the planned ones) and its
        sliding-window rings for sequences of `ring_context` tokens (at least this plan's): the engine allocates every
        request's cache for its slots' longest generation, so one bucket is one shape."""
        if max_new_tokens < self.max_new_tokens:
            raise ValueError(f"reserving({max_new_tokens}) is below the planned {self.max_new_tokens} new tokens")
        if ring_context is not None and ring_context < self.bucket + self.question_bucket + max_new_tokens:
            raise ValueError(f"reserving(ring_context={ring_context}) is below this plan's sequences")
        capacity = cache_capacity(self.method, self.bucket, max_new_tokens, quantized=self.quant is not None)
        layers = None if self.layer_capacities is None else \
            cache_layer_capacities(self.method, self.bucket, max_new_tokens, len(self.layer_capacities))
        return dataclasses.replace(self, max_new_tokens=max_new_tokens, capacity=capacity, layer_capacities=layers,
                                   ring_context=ring_context)


def _question_batch(config: Any, tokens: np.ndarray, question_ids: Any) -> tuple[Any, Any]:
    """`question_ids` as right-padded rows and lengths (None, None without a question), checked."""
    if question_ids is None:
        return None, None
    q_tokens, q_lengths = token_batch(question_ids, None, allow_empty=True, name="question_ids")
    if q_tokens.shape[0] != tokens.shape[0]:
        raise KvjaxError(f"question_ids has {q_tokens.shape[0]} rows but the batch has {tokens.shape[0]}")
    token_ids(q_tokens[np.arange(q_tokens.shape[1])[None] < q_lengths[:, None]], "question_ids", config.vocab_size)
    return q_tokens, q_lengths


def _question_layout(config: Any, method: Method, tokens: np.ndarray, lengths: np.ndarray, q_tokens: Any,
                     q_lengths: Any, max_new_tokens: int):
    """Where the question goes: `(prompt tokens, lengths, question fed after compression or None, the lengths of a
    question that also opens the prompt or None, the longest sequence before decode)`. A `QuestionReader` reads it
    as the end of its prompt (and, with `encodes_question`, as its start too: Q-LLM's layout); every other method
    gets it uncompressed after the compressed prompt. The sequence is checked against the model's context here."""
    total = lengths + (q_lengths if q_lengths is not None else 0)
    question_first = q_tokens is not None and caps.encodes_question(method) and int(q_lengths.max()) > 0
    if question_first:
        total = total + q_lengths
    check_context(method, int(total.max()) + max_new_tokens, int(total.max()), config.max_position_embeddings)
    if q_tokens is not None and caps.question_in_prompt(method):
        # Retrieval methods read the question as the end of the prompt, window by window.
        tokens, lengths = concat_rows(tokens, lengths, q_tokens, q_lengths)
        if question_first:  # and, for Q-LLM's question vector, as its start
            tokens, lengths = concat_rows(q_tokens, q_lengths, tokens, lengths)
        q_tokens = None
    after = q_tokens is not None and int(q_lengths.max()) > 0
    return (tokens, lengths, (q_tokens, q_lengths) if after else None, q_lengths if question_first else None,
            int(total.max()))


def _bucketed(tokens: np.ndarray, lengths: np.ndarray, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """`[B, bucket]` int32 rows (padding: 0) and their positions (padding: -1)."""
    padded = np.zeros((tokens.shape[0], bucket), np.int32)
    width = min(tokens.shape[1], bucket)
    padded[:, :width] = np.where(np.arange(width)[None] < lengths[:, None], tokens[:, :width], 0)
    positions = np.where(np.arange(bucket)[None] < lengths[:, None], np.arange(bucket)[None], -1).astype(np.int32)
    return padded, positions


def plan(config: Any, input_ids: Any, *, method: str | Method = "full", max_new_tokens: int = 1,
         prompt_lengths: Any = None, chunk_size: int | None = None, method_args: dict | None = None,
         question_ids: Any = None, mesh: Any = None, kv_dtype: str | KVQuant | None = None) -> PrefillPlan:
    """The host-side plan of `prefill` (arguments as `kvjax.runtime.generate.prefill`'s): every input checked, in
    the order the messages promise, before anything is traced."""
    method = resolve_method(method, method_args)
    quant = resolve_kv_dtype(kv_dtype, config.head_dim)
    tokens, lengths = token_batch(input_ids, prompt_lengths)
    q_tokens, q_lengths = _question_batch(config, tokens, question_ids)
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens", minimum=1)
    tokens, lengths, after, first, rope_length = _question_layout(config, method, tokens, lengths, q_tokens,
                                                                  q_lengths, max_new_tokens)
    longest = int(lengths.max())
    token_ids(tokens[np.arange(tokens.shape[1])[None] < lengths[:, None]], "input_ids", config.vocab_size)
    if chunk_size is not None:
        chunk_size = as_int(chunk_size, "chunk_size", minimum=1)
    method.validate(longest, max_new_tokens, config.max_position_embeddings)
    method.check_model(config)
    if chunk_size is not None:  # a chunk past the prompt's bucket is the whole prompt (not a bigger program)
        chunk_size = min(int(chunk_size), bucket_length(longest))
    if chunk_size is None:
        chunk_size = method.prefill_window()
    bucket = bucket_length(longest, multiple=chunk_size or 1)
    padded, positions = _bucketed(tokens, lengths, bucket)
    capacity = cache_capacity(method, bucket, max_new_tokens, quantized=quant is not None)
    layer_capacities = cache_layer_capacities(method, bucket, max_new_tokens, config.method_layers)
    if caps.replays_context(method):
        replay.check(method, config, quant, mesh, longest)
    return PrefillPlan(
        method=method, quant=quant, tokens=padded, positions=positions, lengths=lengths,
        question=None if after is None else after[0], question_lengths=None if after is None else after[1],
        question_first_lengths=first, bucket=bucket, chunk=chunk_size or bucket,
        question_bucket=0 if after is None else bucket_length(int(after[1].max())), max_new_tokens=max_new_tokens,
        capacity=capacity, layer_capacities=layer_capacities, rope_length=rope_length,
    )


# ---- the stages -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Prefilling:
    """What one stage hands the next: the cache so far and what every pass reads."""

    cache: ModelCache
    last_hidden: Any  # [B, D] each example's hidden state at its last token so far
    lengths: np.ndarray  # [B] tokens each sequence holds (the question's added by its pass)
    budget: Any  # [B] int32 tokens each example keeps (`per_example_budget`)
    weights: dict
    rope: Any
    mesh: Any = None

    @property
    def put(self) -> Callable[[Any], Any]:
        return placer(self.mesh)


def placer(mesh: Any) -> Callable[[Any], Any]:
    """Host batch-first arrays -> what the jitted programs take: the host arrays themselves without a mesh
    (a jitted call transfers them; an explicit `device_put` compiles a tiny program per shape, ~20 ms each on a
    first call), sharded device arrays (B on the mesh's `data` axis) with one."""
    if mesh is None:
        return np.asarray
    return functools.partial(sharding.shard_batch, mesh=mesh)


def allocate(model: Any, plan: PrefillPlan, mesh: Any = None) -> Prefilling:
    """The empty cache (at the method's capacity, or at the whole bucket for a context replay), the per-example
    budgets and the weights, placed on `mesh` when one is given."""
    config = model.config
    cache = init_cache(plan.method, config, plan.batch, plan.bucket if plan.replays else plan.capacity, model.dtype,
                       plan.quant, context=plan.context,
                       layer_capacities=None if plan.replays else plan.layer_capacities)
    budget = per_example_budget(plan.method, plan.lengths)  # host int32 [B]: the jitted programs take it as is
    weights, rope = model.weights(), model.rope(plan.rope_length)
    last_hidden = np.zeros((plan.batch, config.hidden_size), jnp.dtype(model.dtype))
    if mesh is not None:
        put = placer(mesh)
        weights = sharding.shard_weights(weights, mesh)
        cache = sharding.shard_cache(cache, mesh)
        budget, last_hidden = put(budget), put(last_hidden)
    return Prefilling(cache=cache, last_hidden=last_hidden, lengths=plan.lengths, budget=budget, weights=weights,
                      rope=rope, mesh=mesh)


def prompt(config: Any, plan: PrefillPlan, run: Prefilling) -> Prefilling:
    """The prompt, chunk by chunk, through the model and the method (a context-replay method's prompt is kept
    whole, for its replay to score: `prompt_method`); a question-first layout marks the question's length on every
    layer first."""
    cache = run.cache
    if plan.question_first:
        cache = _mark_question(config, plan.method, cache, run.put(np.asarray(plan.question_first_lengths, np.int32)))
    last_hidden, cache = prefill_chunks(
        config, prompt_method(plan.method), run.weights, run.rope, cache, plan.tokens, plan.positions,
        plan.lengths, plan.chunk, run.budget, run.last_hidden, run.put, run.mesh, fresh=plan.fresh,
        ring_fresh=plan.ring_fresh,
    )
    return dataclasses.replace(run, cache=cache, last_hidden=last_hidden)


def prompt_method(method: Method) -> Method:
    """The method whose hooks the prompt pass runs: `method` itself, or for a context replay (which holds the prompt
    whole) its `prompt_scorer` (Fast KVzip's gates), by default `full`."""
    if not caps.replays_context(method):
        return method
    scorer = method.prompt_scorer()
    return KEEP_ALL if scorer is None else scorer


def context_replay(config: Any, plan: PrefillPlan, run: Prefilling) -> Prefilling:
    """A `ContextReplay` method reads the prompt again and compacts every layer into its capacity."""
    cache = replay.run(config, plan.method, run.weights, run.rope, run.cache, plan.tokens, plan.lengths, run.budget,
                       plan.capacity)
    return dataclasses.replace(run, cache=cache)


def question(model: Any, plan: PrefillPlan, run: Prefilling) -> Prefilling:
    """The question, uncompressed, after the compressed prompt."""
    last_hidden, cache, lengths = append_question(model, run.cache, plan.question, plan.question_lengths,
                                                  run.lengths, run.budget, run.last_hidden, run.weights, run.mesh,
                                                  run.rope)
    return dataclasses.replace(run, cache=cache, last_hidden=last_hidden, lengths=lengths)


def finish(config: Any, plan: PrefillPlan, run: Prefilling) -> PrefillState:
    """The last token's logits: what decode samples its first token from."""
    logits = final_logits(config, run.weights, run.last_hidden)
    return PrefillState(cache=run.cache, logits=logits, prompt_lengths=run.lengths, budget=run.budget,
                        method=plan.method, mesh=run.mesh, rope=run.rope, max_new_tokens=plan.max_new_tokens)


def run(model: Any, plan: PrefillPlan, mesh: Any = None) -> PrefillState:
    """Every stage of `plan`: allocate -> prompt -> [context replay] -> [question] -> finish."""
    return after_prompt(model, plan, through_prompt(model, plan, mesh))


def through_prompt(model: Any, plan: PrefillPlan, mesh: Any = None) -> Prefilling:
    """The stages that read the prompt rows only: allocate -> prompt -> [context replay]. Their result depends on
    `plan.tokens`, `plan.lengths` and the cache's shape alone, so requests with the same prompt rows and other
    questions can share it (`after_prompt` on a copy: `kvjax.engine`)."""
    state = prompt(model.config, plan, allocate(model, plan, mesh))
    if plan.replays:
        state = context_replay(model.config, plan, state)
    return state


def after_prompt(model: Any, plan: PrefillPlan, run: Prefilling) -> PrefillState:
    """The rest of the prefill: [question] -> finish. The question pass writes into `run`'s cache (its programs are
    donated the sliding-window rings); `copied(run)` keeps a shared prompt's."""
    if plan.has_question:
        run = question(model, plan, run)
    return finish(model.config, plan, run)


@jax.jit
def _copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


def copied(run: Prefilling) -> Prefilling:
    """`run` with its own copy of the cache (one program; on a mesh the copy keeps the cache's sharding)."""
    return dataclasses.replace(run, cache=_copy(run.cache))


# ---- the passes' device work ------------------------------------------------------------------------------------

@jax.jit
def pick_last(hidden: Array, last_index: Array, last_hidden: Array) -> Array:
    """Keeps each example's hidden state at its last prompt token, wherever that chunk falls."""
    width = hidden.shape[1]
    in_chunk = (last_index >= 0) & (last_index < width)
    picked = jnp.take_along_axis(hidden, jnp.clip(last_index, 0, width - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where(in_chunk[:, None], picked.astype(last_hidden.dtype), last_hidden)


def prefill_chunks(config: Any, method: Method, weights: dict, rope: tuple, cache: ModelCache, padded: np.ndarray,
                   positions: np.ndarray, lengths: np.ndarray, chunk: int, budget: Any, last_hidden: Any, put: Any,
                   mesh: Any, fresh: bool = False, ring_fresh: bool = False) -> tuple[Array, ModelCache]:
    """Every chunk of a padded prompt through the model: each example's last hidden state and the cache."""
    bucket = padded.shape[1]
    for start in range(0, bucket, chunk):
        hidden, cache = forward.prefill_chunk(
            config, weights, rope, method, cache, put(padded[:, start : start + chunk]),
            put(positions[:, start : start + chunk]), budget, final_chunk=start + chunk >= bucket, fresh=fresh,
            ring_fresh=ring_fresh, mesh=mesh,
        )
        last_hidden = pick_last(hidden, put(np.asarray(lengths - 1 - start, np.int32)), last_hidden)
    return last_hidden, cache


def append_question(model: Any, cache: ModelCache, q_tokens: np.ndarray, q_lengths: np.ndarray, lengths: np.ndarray,
                    budget: Any, last_hidden: Any, weights: dict, mesh: Any = None,
                    rope: Any = None) -> tuple[Any, ModelCache, np.ndarray]:
    """Appends question tokens after the compressed prompt, keeping all of them (a sliding-window layer's ring was
    sized for them): `(last hidden states, the cache, the sequences' new lengths)`."""
    config = model.config
    q_bucket = bucket_length(int(q_lengths.max()))
    padded = np.zeros((q_tokens.shape[0], q_bucket), np.int32)
    padded[:, : q_tokens.shape[1]] = q_tokens
    steps = np.arange(q_bucket)[None]
    positions = np.where(steps < q_lengths[:, None], lengths[:, None] + steps, -1).astype(np.int32)
    # The question attends K / V / positions only (the `full` method keeps everything and reads no method state):
    # run it on the bare layers, so the methods whose compressed caches have one shape share these programs,
    # then put the method's fields back, padded as `kvc.extend` pads them. A retrieval mask (`attend`) would
    # change the attention, so such a cache goes through whole; a sliding-window layer's ring is left as it is.
    managed = [w is None for w in config.layer_windows]
    bare = all(layer.attend is None for layer, m in zip(cache.layers, managed, strict=True) if m)
    work = cache
    if bare:
        work = cache.replace(layers=tuple(KVCache(x.k, x.v, x.pos, x.length) if m else x
                                          for x, m in zip(cache.layers, managed, strict=True)))
    work = _extend(config, work, q_bucket)
    put = placer(mesh)
    if mesh is not None:
        work = sharding.shard_cache(work, mesh)
    rope = model.rope() if rope is None else rope
    last_hidden, work = prefill_chunks(config, KEEP_ALL, weights, rope, work, padded, positions, q_lengths,
                                       q_bucket, budget, last_hidden, put, mesh)
    if bare:
        work = cache.replace(layers=tuple(
            new.replace(score=_question_scores(old.score, old.length, q_bucket), state=old.state) if m else new
            for new, old, m in zip(work.layers, cache.layers, managed, strict=True)))
    return last_hidden, work, (lengths + q_lengths).astype(np.int32)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _mark_question(config: Any, method: Method, cache: ModelCache, lengths: Array) -> ModelCache:
    """`method.mark_question` on every layer the method manages (the prompt opens with a question of `lengths`
    `[B]` tokens); the sliding-window layers' rings are left alone."""
    layers = tuple(layer if w is not None else method.mark_question(layer, lengths)
                   for layer, w in zip(cache.layers, config.layer_windows, strict=True))
    return cache.replace(layers=layers)


@functools.partial(jax.jit, static_argnums=2)
def _question_scores(score: Array | None, length: Array, extra: int) -> Array | None:
    """A layer's score accumulator after the question: as it was on the slots held before, 0 on the question's
    (what `kvc.append` writes there) and beyond."""
    if score is None:
        return None
    padded = jnp.pad(score, ((0, 0), (0, 0), (0, extra)))
    return jnp.where(jnp.arange(padded.shape[-1]) < length[..., None], padded, 0.0)


@functools.partial(jax.jit, static_argnums=(0, 2))  # no donation: every output buffer is larger
def _extend(config: Any, cache: ModelCache, extra: int) -> ModelCache:
    """Every layer the method manages with `extra` more empty slots (room for the question's tokens); a
    sliding-window layer's ring already has its room (`prefill` sized it for the question)."""
    layers = tuple(layer if w is not None else kvc.extend(layer, extra)
                   for layer, w in zip(cache.layers, config.layer_windows, strict=True))
    return cache.replace(layers=layers)
