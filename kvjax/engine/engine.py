"""The continuous-batching loop: decode a few tokens for every live slot, retire the finished, prefill and insert
the waiting, repeat (see `kvjax.engine` and docs/engine.md)."""

from __future__ import annotations

import dataclasses
import heapq
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from kvjax import methods as kvm
from kvjax import tuning
from kvjax.chat import ChatTemplateError, has_chat_template
from kvjax.engine import schedule, sizing, stops
from kvjax.engine import slots as sl
from kvjax.engine.decode import decode_call
from kvjax.engine.prompt_store import PromptStore
from kvjax.engine.request import Completion, Request, check_request
from kvjax.errors import ConfigError, KvjaxError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import Method
from kvjax.quant.spec import KVQuant
from kvjax.runtime import replay, sharding, stages
from kvjax.runtime.compile_cache import ensure_compilation_cache
from kvjax.runtime.generate import decode_program_key
from kvjax.validation import as_int
from kvjax.validation import eos_ids as checked_eos_ids


@dataclasses.dataclass
class Progress:
    """What the loop reports after each decode call: answers finished / to give (a request's samples counted one by
    one), tokens generated, slots in use and the slot count, seconds since `run` started, and the seconds spent in
    prefill and in decode so far."""

    done: int
    total: int
    tokens: int
    live: int
    slots: int
    elapsed_s: float
    prefill_s: float
    decode_s: float


@dataclasses.dataclass
class _Live:
    request: Request
    sample: int
    start: float
    prefill_s: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    stop: str | None = None  # the stop string that ended it


def _prompt_key(plan: stages.PrefillPlan) -> bytes:
    """What a prompt pass depends on besides the engine's constants: the padded prompt rows and their lengths (a
    question the method reads inside the prompt is in the rows), and the tuning in force (`kvjax.tuning`, which a
    caller may change between two `next()` calls of one `Engine.run`)."""
    first = b"" if plan.question_first_lengths is None else np.asarray(plan.question_first_lengths).tobytes()
    return b"|".join((np.asarray(plan.tokens.shape).tobytes(), plan.tokens.tobytes(),
                      np.asarray(plan.lengths).tobytes(), first, str(plan.chunk).encode(),
                      repr(tuning.current()).encode()))


def resolve_engine_method(method: str | Method, method_args: dict | None) -> Method:
    """A registered method (name + hyperparameters, or an instance); a multi-context RAG strategy is refused in one
    line: it takes documents and a query, not one prompt."""
    if isinstance(method, str) and method not in kvm.available():
        from kvjax import rag

        if method in rag.available():
            raise ConfigError(f"{method} is a multi-context strategy (documents + a query), not a single-prompt "
                              "method: the engine runs kvjax.methods.available(); use kvjax.rag.answer for it")
    return stages.resolve_method(method, method_args)


def _deleted(tree: Any) -> bool:
    """Whether any array of `tree` was deleted (donated to a program that then failed)."""
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(tree))


def _with_repeat_prompt(method: Method, tokenizer: Any) -> Method:
    """A context-replay method (KVzip) given without its repeat prompt takes it from the engine's tokenizer, in the
    chat template's user turn when the tokenizer has one (`kvjax.run --chat_template=auto`'s rule): the paper's
    prompt, not the bare context. A tokenizer that cannot encode leaves the method as it is."""
    if not callable(getattr(tokenizer, "encode", None)):
        return method
    try:
        return method.with_tokenizer(tokenizer, has_chat_template(tokenizer))
    except ChatTemplateError as e:
        raise ConfigError(f"method {method.name!r}: its repeat prompt cannot be built ({e}); give the method "
                          "with its prompt: method.with_tokenizer(tokenizer, chat_template=False)") from None


class Engine:
    """A fixed number of decode slots over one model, method and storage format (see docs/engine.md).

    `max_prompt_tokens`, `max_question_tokens`, `max_new_tokens`: the longest request the slots hold (a request's own
    `max_new_tokens` may be smaller). `slots`: the slot count (None: as many as fit in `memory_fraction` of the
    device's memory, `sizing.slots_for_memory`; 8 on a device that reports no limit). `steps`: tokens decoded per
    slot between two admissions. `prefill_tokens`: a bound on an iteration's prefill (bucketed prompt tokens;
    default none: every free slot is filled); `prefill_batch`: requests of one bucket prefilled together (default 1:
    a request's prefill is then the very program `generate` runs for it alone). `chunk_size`, `kv_dtype`, `mesh` as
    `kvjax.generate`'s (slots on the mesh's `data` axis). `eos_token_id`: ids that end every request (default the
    model's). `sampling`: compile the sampling step (needed by requests with temperature > 0; greedy requests give the
    same tokens either way). `tokenizer`: what decodes answers for requests' stop strings (`decode(ids,
    skip_special_tokens=True)`, as a Hugging Face tokenizer's); a context-replay method (KVzip) given without its
    repeat prompt builds it with the tokenizer, in its chat template when it has one (`kvjax.run`'s default).
    `keep_positions`: each completion carries its cache's kept positions (tests, analysis). `share_prompts`: a
    prefill whose prompt rows equal the previous prefill's (the same context with another question, or the same
    prompt again) reuses that prefill's prompt pass and runs only its question (the engine holds the last prompt
    pass: one prefill's cache); outputs are unchanged.
    `prompt_store`: a folder where each prompt pass is kept and read back by later prefills and jobs with the same
    prompt rows, model, method and sizes (`kvjax.engine.prompt_store`); outputs are unchanged.
    `prompt_store_max_bytes`: the store's pass files kept within that many bytes (the least recently used removed).
    """

    def __init__(self, model: Any, *, method: str | Method = "full", method_args: dict | None = None,
                 max_prompt_tokens: int, max_new_tokens: int, max_question_tokens: int = 0,
                 slots: int | None = None, steps: int = 8, prefill_tokens: int | None = None, prefill_batch: int = 1,
                 chunk_size: int | None = None, kv_dtype: str | KVQuant | None = None, mesh: Any = None,
                 eos_token_id: int | Iterable[int] | None = None, sampling: bool = False, max_stop_ids: int = 8,
                 memory_fraction: float = 0.9, tokenizer: Any = None, keep_positions: bool = False,
                 share_prompts: bool = True, prompt_store: str | os.PathLike | None = None,
                 prompt_store_max_bytes: int | None = None) -> None:
        ensure_compilation_cache()
        config = model.config
        self.model, self.mesh = model, mesh
        self.method = resolve_engine_method(method, method_args)
        self.quant = stages.resolve_kv_dtype(kv_dtype, config.head_dim)
        self.max_prompt_tokens = as_int(max_prompt_tokens, "max_prompt_tokens", minimum=1)
        self.max_question_tokens = as_int(max_question_tokens, "max_question_tokens", minimum=0)
        self.max_new_tokens = as_int(max_new_tokens, "max_new_tokens", minimum=1)
        self.steps = as_int(steps, "steps", minimum=1)
        self.prefill_batch = as_int(prefill_batch, "prefill_batch", minimum=1)
        self.max_stop_ids = as_int(max_stop_ids, "max_stop_ids", minimum=0)
        if chunk_size is not None:
            chunk_size = as_int(chunk_size, "chunk_size", minimum=1)
        self.chunk_size = chunk_size
        for name, flag in (("sampling", sampling), ("keep_positions", keep_positions)):
            if not isinstance(flag, bool):
                raise KvjaxError(f"{name} must be True or False, got {flag!r}")
        sizing.check_fraction(memory_fraction)
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise KvjaxError(f"tokenizer must have a decode(ids, skip_special_tokens=True) method, got "
                             f"{type(tokenizer).__name__}")
        if tokenizer is not None and caps.replays_context(self.method):
            self.method = _with_repeat_prompt(self.method, tokenizer)
        if not isinstance(share_prompts, bool):
            raise KvjaxError(f"share_prompts must be True or False, got {share_prompts!r}")
        self.sampling, self.keep_positions, self.tokenizer = sampling, keep_positions, tokenizer
        self.share_prompts = share_prompts
        self._held: tuple[bytes, stages.Prefilling] | None = None  # the last prompt pass, by its prompt rows
        self.method.check_model(config)
        self._check_sizes(config)
        if caps.replays_context(self.method):
            replay.check(self.method, config, self.quant, mesh, self.max_prompt_tokens)
        if mesh is not None:
            sharding.check_mesh(mesh)
        eos = tuple(config.eos_token_ids or ()) if eos_token_id is None else checked_eos_ids(eos_token_id,
                                                                                              config.vocab_size)
        self.eos = tuple(int(t) for t in eos)
        one = sl.layout(config, self.method, self.quant, model.dtype, slots=1,
                        max_prompt_tokens=self.max_prompt_tokens, max_question_tokens=self.max_question_tokens,
                        max_new_tokens=self.max_new_tokens, chunk_size=chunk_size)
        if slots is None:
            slots = sizing.slots_for_memory(model, one.slot_bytes(), bucket=one.bucket,
                                            prefill_batch=self.prefill_batch, fraction=memory_fraction,
                                            held=share_prompts, prompt_pass_bytes=one.prompt_pass_bytes())
            if mesh is not None:  # whole slots per `data` shard
                data = mesh.shape[sharding.DATA]
                slots = max(data, slots // data * data)
        slots = as_int(slots, "slots", minimum=1)
        if mesh is not None and slots % mesh.shape[sharding.DATA]:
            raise KvjaxError(f"slots={slots} is not a multiple of the mesh's data axis ({mesh.shape[sharding.DATA]})")
        self.layout = dataclasses.replace(one, slots=slots)
        self.prefill_tokens = None if prefill_tokens is None else as_int(prefill_tokens, "prefill_tokens", minimum=1)
        if mesh is not None:  # placed once: each prefill's `allocate` (and a held prompt pass) finds them placed
            self.model = sharding.shard_model(model, mesh)
        self.weights = self.model.weights()
        self.rope = model.rope(self.layout.context)
        if prompt_store_max_bytes is not None and prompt_store is None:
            raise ConfigError("prompt_store_max_bytes sizes a prompt store; give prompt_store too")
        self.store = None if prompt_store is None else PromptStore(prompt_store, model, self.method, self.quant,
                                                                   prompt_store_max_bytes, mesh)
        self.cache: Any = None
        self.state: Any = None
        self._running = False  # a run is under way: its slots are in use until it ends or its caller closes it

    def _check_sizes(self, config: Any) -> None:
        """Refuses, at construction, a method or a size no request could run with (the slots would be sized for
        it): the method's hyperparameters against the model (`Method.validate`), a `max_prompt_tokens` prompt with
        one new token and a one-token prompt with `max_new_tokens` new ones against the model's context
        (`stages.check_context`)."""
        longest, new = self.max_prompt_tokens, self.max_new_tokens
        self.method.validate(longest, new, config.max_position_embeddings)
        for name, value, prompt, answer in (("max_prompt_tokens", longest, longest, 1),
                                            ("max_new_tokens", new, 1, new)):
            try:
                stages.check_context(self.method, prompt + answer, prompt, config.max_position_embeddings)
            except KvjaxError as e:
                raise KvjaxError(f"{name}={value}: no request could run with it: {e}") from None

    @property
    def slots(self) -> int:
        return self.layout.slots

    # ---- requests -----------------------------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """Refuses a request the slots cannot run (before anything is traced), naming it and the reason."""
        config = self.model.config
        check_request(request, vocab_size=config.vocab_size, max_new_tokens=self.max_new_tokens,
                      max_stop_ids=self.max_stop_ids, sampling=self.sampling)
        name = f"request {request.id!r}"
        if request.stop and self.tokenizer is None:
            raise KvjaxError(f"{name}: stop strings need the engine's tokenizer (Engine(..., tokenizer=...))")
        problem = stops.special_problem(request.stop, self.tokenizer)
        if problem:
            raise KvjaxError(f"{name}: {problem}")
        if request.sample_count > self.slots:
            raise KvjaxError(f"{name}: {request.sample_count} samples need as many slots at once; the engine "
                             f"has {self.slots}")
        if len(request.tokens) > self.max_prompt_tokens:
            raise KvjaxError(f"{name}: prompt of {len(request.tokens)} tokens exceeds the engine's "
                             f"max_prompt_tokens={self.max_prompt_tokens}")
        if len(request.question) > self.max_question_tokens:
            raise KvjaxError(f"{name}: question of {len(request.question)} tokens exceeds the engine's "
                             f"max_question_tokens={self.max_question_tokens}")
        total = request.sequence + (len(request.question) if caps.encodes_question(self.method) and request.question
                                    else 0)
        try:
            stages.check_context(self.method, total + request.max_new_tokens, total, config.max_position_embeddings)
        except KvjaxError as e:
            raise KvjaxError(f"{name}: {e}") from None

    def _plan(self, group: list[Request]) -> stages.PrefillPlan:
        questions = [list(r.question) for r in group] if any(r.question for r in group) else None
        plan = stages.plan(self.model.config, [list(r.tokens) for r in group], method=self.method,
                           max_new_tokens=max(r.max_new_tokens for r in group), question_ids=questions,
                           chunk_size=self.chunk_size, kv_dtype=self.quant, mesh=self.mesh)
        # One RoPE for every slot: LongRoPE's factors are picked once, for the slots' longest sequence.
        plan = dataclasses.replace(plan, rope_length=self.layout.context)
        return plan.reserving(self.max_new_tokens, ring_context=self.layout.context)

    def _prefill(self, group: list[Request]) -> stages.PrefillState:
        """The group's prefill; its prompt pass taken from the last prefill when their prompt rows are the same."""
        plan = self._plan(group)
        key = _prompt_key(plan) if self.share_prompts else None
        if self._held is None or self._held[0] != key:
            self._held = None  # before the new pass: memory for one
            prompted = self._prompt_pass(plan)
            if key is not None:
                self._held = (key, prompted)
        else:
            prompted = self._held[1]
        if self._held is not None and plan.has_question:  # the question pass writes into the cache it is given
            prompted = stages.copied(prompted)
        return stages.after_prompt(self.model, plan, prompted)

    def _prompt_pass(self, plan: stages.PrefillPlan) -> stages.Prefilling:
        """`plan`'s prompt pass: from the prompt store where it holds it, else computed (and stored)."""
        if self.store is None:
            return stages.through_prompt(self.model, plan, self.mesh)
        prompted = self.store.load(plan, self.weights)
        if prompted is None:
            prompted = stages.through_prompt(self.model, plan, self.mesh)
            self.store.save(plan, prompted)
        return prompted

    def _shape(self, request: Request) -> tuple[int, int]:
        """A request's prefill shape (bucket, question bucket): requests of one shape share a prefill program."""
        plan = self._plan([request])
        return plan.bucket, plan.question_bucket

    # ---- the loop -----------------------------------------------------------------------------------------------
    def _allocate(self) -> None:
        if self.cache is not None:
            return
        stop_width = len(self.eos) + self.max_stop_ids
        cache = self.layout.empty(self.slots)
        state = sl.empty_slots(self.slots, self.model.config.vocab_size, max(1, stop_width))
        if self.mesh is not None:
            cache = sharding.shard_cache(cache, self.mesh)
            state = jax.tree.map(lambda x: sharding.shard_batch(x, self.mesh), state)
        self.cache, self.state = cache, state

    def _rows(self, group: list[Request], prefilled: stages.PrefillState, source: np.ndarray,
              samples: list[int]) -> sl.Slots:
        """The slot state of each sample of `group`: sample i takes its request's row `source[i]` of the prefill."""
        stop = np.full((len(group), self.state.stop.shape[1]), -1, np.int32)
        for i, r in enumerate(group):
            ids = list(self.eos) + list(r.stop_ids)
            stop[i, : len(ids)] = ids
        rows = len(source)
        return sl.Slots(
            logits=prefilled.logits[source],
            lengths=np.asarray(prefilled.prompt_lengths, np.int32)[source],
            budget=np.asarray(jax.device_get(prefilled.budget), np.int32)[source], count=np.zeros(rows, np.int32),
            max_new=np.asarray([r.max_new_tokens for r in group], np.int32)[source], active=np.ones(rows, bool),
            stop=stop[source], temperature=np.asarray([r.temperature for r in group], np.float32)[source],
            top_p=np.asarray([r.top_p for r in group], np.float32)[source],
            seed=np.asarray([r.seed for r in group], np.uint32)[source],
            sample=np.asarray(samples, np.uint32),
        )

    def run(self, requests: Iterable[Request], progress: Callable[[Progress], None] | None = None
            ) -> Iterator[Completion]:
        """Runs every request (each checked first, before anything is traced) and yields each completion as it
        finishes (a request of several samples: one per sample). Ids must be unique. One run at a time: a run
        started while another is unfinished (its iterator neither exhausted nor closed) is refused, as both would
        write the same slots."""
        if progress is not None and not callable(progress):
            raise KvjaxError(f"progress must be a function of a Progress (or None), got {type(progress).__name__}")
        if self._running:
            raise KvjaxError("this engine's previous run is still in progress (its slots hold its requests): "
                             "iterate it to the end or close() it before starting another run")
        requests = list(requests)
        seen: set = set()
        for request in requests:
            if not isinstance(request, Request):
                raise KvjaxError(f"the engine runs Request objects, got {type(request).__name__}")
            try:
                twice = request.id in seen
            except TypeError:  # a list, a dict: the engine keys its requests by id
                raise KvjaxError(f"request id {request.id!r} must be hashable (a string, a number, a tuple), got "
                                 f"{type(request.id).__name__}") from None
            if twice:
                raise KvjaxError(f"request id {request.id!r} appears twice")
            seen.add(request.id)
            self.check(request)
        self._allocate()
        shapes: dict[Any, tuple[int, int]] = {}

        def shape(request: Request) -> tuple[int, int]:
            if request.id not in shapes:
                shapes[request.id] = self._shape(request)
            return shapes[request.id]

        total = sum(r.sample_count for r in requests)
        waiting = deque(requests)
        free = list(range(self.slots))  # a heap: the lowest free slot first
        live: dict[int, _Live] = {}
        done = tokens = 0
        started = time.perf_counter()
        prefill_s = decode_s = 0.0
        tune = tuning.current()
        self._running = True
        try:
            while waiting or live:
                admitted = schedule.admit(waiting, len(free), self.prefill_tokens, lambda r: shape(r)[0] + shape(r)[1],
                                          width=lambda r: r.sample_count)
                for group in schedule.groups(admitted, shape, self.prefill_batch):
                    start = time.perf_counter()
                    prefilled = self._prefill(group)
                    sl.check_fits(self.layout, prefilled.cache)
                    jax.block_until_ready(prefilled.logits)
                    took = time.perf_counter() - start
                    prefill_s += took
                    members = [(row, r, i) for row, r in enumerate(group) for i in r.sample_indices]
                    source = np.asarray([row for row, _, _ in members], np.int32)
                    index = [heapq.heappop(free) for _ in members]
                    self.cache, self.state = sl.insert(
                        self.layout, self.cache, self.state, prefilled.cache,
                        self._rows(group, prefilled, source, [i for _, _, i in members]), source,
                        np.asarray(index, np.int32), mesh=self.mesh)
                    del prefilled  # before the next group's prefill: `sizing` plans memory for one at a time
                    now = time.perf_counter()
                    for slot, (_, request, sample) in zip(index, members, strict=True):
                        live[slot] = _Live(request, sample, now, took / len(members))
                start = time.perf_counter()
                self.cache, self.state, out, logprobs, kept, generated = decode_call(
                    self.model.config, decode_program_key(self.method), self.steps, self.sampling, tune, self.weights,
                    self.rope, self.cache, self.state, mesh=self.mesh)
                out, logprobs, active, kept, generated = jax.device_get(
                    (out, logprobs, self.state.active, kept, generated))
                now = time.perf_counter()
                decode_s += now - start
                ended = np.zeros(self.slots, bool)  # slots a stop string ends here (the device still runs them)
                finished = []
                for slot in sorted(live):
                    entry = live[slot]
                    row = out[slot]
                    emitted = row >= 0
                    before = len(entry.tokens)
                    entry.tokens.extend(int(t) for t in row[emitted])
                    entry.logprobs.extend(float(x) for x in logprobs[slot][emitted])
                    if entry.request.stop:
                        hit = stops.first_stop(entry.tokens, entry.request.stop, self._text, checked=before)
                        if hit is not None:
                            count, entry.stop = hit
                            del entry.tokens[count:], entry.logprobs[count:]
                            ended[slot] = active[slot]
                    tokens += len(entry.tokens) - before
                    if entry.stop is not None or not active[slot]:
                        finished.append(slot)
                if ended.any():  # before anything is yielded: a caller that stops iterating leaves no slot running
                    self.state = sl.end(self.state, ended)
                positions = None
                if self.keep_positions and finished:
                    positions = jax.device_get([layer.pos for layer in self.cache.layers])  # not the K / V
                for slot in finished:
                    entry = live.pop(slot)
                    heapq.heappush(free, slot)
                    done += 1
                    yield self._completion(entry, now, float(kept[slot]), float(generated[slot]),
                                           None if positions is None else [p[slot] for p in positions])
                if progress is not None:
                    progress(Progress(done=done, total=total, tokens=tokens, live=len(live), slots=self.slots,
                                      elapsed_s=time.perf_counter() - started, prefill_s=prefill_s, decode_s=decode_s))
        finally:
            self._running = False
            self._held = None  # a caller that stops iterating frees it too
            self._end_abandoned(list(live))

    def _end_abandoned(self, slots: list[int]) -> None:
        """Slots still generating when a run stops early (its caller stopped iterating, or an error) stop on the
        device too, so the next run's steps are not spent on them. Where the state cannot be read (an error inside
        the donated decode step, or an insert that failed after its slots were donated: out of memory on a device,
        with no slot live), the next run allocates fresh slots."""
        if self.state is not None and _deleted((self.cache, self.state)):
            self.cache = self.state = None
            return
        if not slots or self.state is None:
            return
        ended = np.zeros(self.slots, bool)
        ended[slots] = True
        self.state = sl.end(self.state, ended)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _completion(self, entry: _Live, now: float, kept: float, generated: float, positions: Any) -> Completion:
        request = entry.request
        stop_ids = set(self.eos) | set(request.stop_ids)
        reason = "stop" if entry.stop is not None or (entry.tokens and entry.tokens[-1] in stop_ids) else "length"
        kept_positions = None
        if positions is not None:
            kept_positions = [[sorted(int(p) for p in head if p >= 0) for head in layer] for layer in positions]
        return Completion(
            id=request.id, tokens=entry.tokens, finish_reason=reason, prompt_tokens=request.sequence,
            kept_tokens=kept, kept_generated_tokens=generated, prefill_s=entry.prefill_s, decode_s=now - entry.start,
            logprobs=entry.logprobs if request.logprobs else None, positions=kept_positions,
            sample=None if request.samples == 1 else entry.sample, stop=entry.stop,
        )
