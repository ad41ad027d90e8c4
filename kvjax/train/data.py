"""Training batches from the synthetic long-context tasks of `kvjax.tasks`.

Each example is `prompt + " " + answer + </s>`, right-padded to the batch's sequence length; the loss
covers the answer tokens and the end token only. Mixture entries named `drill/...` are retrieval drills
(`kvjax.train.drills`): one context with many question / answer rounds, every answer a target. A batch
depends only on (seed, step), so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvjax import tasks as task_registry
from kvjax.errors import ConfigError
from kvjax.tasks.base import LengthError, full_prompt
from kvjax.train.drills import DRILLS, Drill

#: Task families of the embedded model (the issue's mixture).
DEFAULT_TASKS = (
    "passkey", "passkey_64", "ruler/niah_single_1", "ruler/niah_single_2", "ruler/niah_multikey_1",
    "ruler/niah_multivalue", "ruler/niah_multiquery", "ruler/vt",
)


#: Task seeds `0..HELD_OUT_SEEDS-1` are reserved for evaluation (the eval CLI's `--seed` defaults to 0).
HELD_OUT_SEEDS = 1000


@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # [B, L] int32
    positions: np.ndarray  # [B, L] int32, -1 for padding
    loss_mask: np.ndarray  # [B, L] float32, > 0 where the NEXT token is an answer token to predict (its weight)


class TaskMixture:
    """Samples a task and a length per example; lengths follow a curriculum over steps."""

    def __init__(self, tokenizer: Any, *, task_names: Sequence[str] = DEFAULT_TASKS,
                 lengths: Sequence[int] = (256, 512, 1024), seed: int = 0, curriculum_steps: int = 0,
                 position_jump_prob: float = 0.0, position_span: int = 0, copy_prob: float = 0.0,
                 shuffle_answers: Sequence[str] = (), item_start_weight: float = 1.0):
        if not task_names:
            raise ConfigError("the training mixture needs at least one task")
        if not lengths or min(lengths) <= 0:
            raise ConfigError(f"training lengths must be positive, got {list(lengths)}")
        self.tokenizer = tokenizer
        self.tasks = [self._task(n) for n in task_names]
        unknown = sorted(set(shuffle_answers) - set(task_names))
        if unknown:
            raise ConfigError(f"shuffle_answers names tasks that are not trained: {unknown}")
        self.shuffled = [name in set(shuffle_answers) for name in task_names]
        self.lengths = sorted(int(n) for n in lengths)
        self.seed = seed
        self.curriculum_steps = curriculum_steps
        self.eos = tokenizer.eos_token_id
        self.position_jump_prob = position_jump_prob
        self.copy_prob = copy_prob
        self._copy_vocab = self._frequent_tokens() if copy_prob else None
        self.position_span = position_span
        if item_start_weight <= 0:
            raise ConfigError(f"item_start_weight must be > 0, got {item_start_weight}")
        self.item_start_weight = item_start_weight
        # Tokens after which an answer item starts (those ending in a space or a comma: `" 1234567, 7654321"`),
        # tokens that start an item themselves (a word with its space, `" QWERT"` -> `" Q"`), and the tokens
        # that end an item (a comma, or the end token): whether another item follows.
        self._separators = np.zeros(len(tokenizer), bool)
        self._word_starts = np.zeros(len(tokenizer), bool)
        self._item_ends = np.zeros(len(tokenizer), bool)
        if item_start_weight != 1.0:
            for i in range(len(tokenizer)):
                text = tokenizer.decode([i])
                self._separators[i] = text.endswith((" ", ","))
                self._word_starts[i] = text.startswith(" ") and bool(text.strip())
                self._item_ends[i] = text.startswith(",")
            self._item_ends[self.eos] = True

    def _task(self, name: str) -> Any:
        if name.startswith("drill/"):
            if name not in DRILLS:
                raise ConfigError(f"unknown drill {name!r}; drills: {sorted(DRILLS)}")
            return DRILLS[name](self.tokenizer)
        return task_registry.get(name)

    def _count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def max_length(self, step: int) -> int:
        """Longest length allowed at `step`: the curriculum unlocks lengths evenly over its steps."""
        if self.curriculum_steps <= 0:
            return self.lengths[-1]
        unlocked = 1 + int(step * len(self.lengths) / self.curriculum_steps)
        return self.lengths[min(unlocked, len(self.lengths)) - 1]

    def sample_seed(self, step: int, index: int) -> int:
        """The task seed of one training example; seeds below `HELD_OUT_SEEDS` never occur in training."""
        key = zlib.crc32(f"{self.seed}/{step}/{index}".encode())
        return key + HELD_OUT_SEEDS if key < HELD_OUT_SEEDS else key

    def example(self, step: int, index: int, length: int) -> tuple[list[int], list[tuple[int, int]]]:
        """(token ids, target spans) of one training example: `ids[start:end]` of each span are trained."""
        ids, spans, _ = self._draw(step, index, length)
        return ids, spans

    def _draw(self, step: int, index: int, length: int) -> tuple[list[int], list[tuple[int, int]], bool]:
        """`example`, and whether it is a copy warm-up (whose targets are repeats, not answers)."""
        key = self.sample_seed(step, index)
        rng = np.random.default_rng(key)
        if self.copy_prob and rng.random() < self.copy_prob:
            return *self.copy_example(rng, length), True
        for task_index in rng.permutation(len(self.tasks)):  # the first task whose prompt fits `length`
            task = self.tasks[int(task_index)]
            if isinstance(task, Drill):
                try:
                    return *task.example(random.Random(int(key)), length), False
                except ValueError:
                    continue
            try:
                shuffled = self.shuffled[int(task_index)]
                sample = task.samples(
                    count_tokens=self._count, context_length=length, num_samples=1, seed=int(key), data_dir=None
                )[0]
                break
            except LengthError:
                continue
        else:
            raise ConfigError(f"no training task fits a context of {length} tokens; use longer lengths")
        prompt = self.tokenizer.encode(full_prompt(sample), add_special_tokens=True)
        answers = list(sample.answers)
        if shuffled:  # any order scores the same; a fixed one would be one more thing to learn
            answers = [answers[i] for i in rng.permutation(len(answers))]
        answer = self.tokenizer.encode(" " + ", ".join(answers), add_special_tokens=False)
        ids = prompt + answer + [self.eos]
        return ids, [(len(prompt), len(ids))], False

    def _frequent_tokens(self, count: int = 256) -> np.ndarray:
        """The `count` most frequent token ids of the tasks' text (digits, haystack words, keys): what the
        tasks copy. A small pool makes the copying circuit form sooner than random ids of the whole vocab."""
        from kvjax.tasks.base import full_prompt as text_of

        counts: dict[int, int] = {}
        for task in self.tasks:
            if isinstance(task, Drill):
                continue
            for sample in task.samples(count_tokens=self._count, context_length=1024, num_samples=2,
                                       seed=HELD_OUT_SEEDS, data_dir=None):
                for i in self.tokenizer.encode(text_of(sample), add_special_tokens=False):
                    counts[i] = counts.get(i, 0) + 1
        digits = [i for d in "0123456789" for i in self.tokenizer.encode(d, add_special_tokens=False)]
        ranked = [i for i in sorted(counts, key=lambda i: (-counts[i], i)) if i not in digits]
        return np.asarray(digits + ranked[: count - len(digits)], np.int64)

    def copy_example(self, rng: np.random.Generator, length: int) -> tuple[list[int], list[tuple[int, int]]]:
        """An induction warm-up: a random token segment repeated to `length`; the loss covers the repeats.

        Copying from context is the skill every retrieval task needs; here every repeated token teaches
        it, so it is learnt long before the sparse answer tokens alone would teach it.
        """
        # Half of them copy digit strings, whose repeated digit pairs a copy must not loop on (passkey_64).
        pool = self._copy_vocab[:10] if rng.random() < 0.5 else self._copy_vocab
        segment = rng.choice(pool, size=int(rng.integers(8, 65))).tolist()
        body = (segment * (length // len(segment) + 1))[: length - 1]
        return [self.tokenizer.bos_token_id] + body, [(1 + len(segment), length)]

    def positions(self, rng: np.random.Generator, n: int, cuts: int | None = None) -> np.ndarray:
        """0..n-1, or (with probability `position_jump_prob`) the same with forward jumps at `cuts` random
        places (default one per 64 tokens) adding up to a random total, so the last position lands anywhere
        below `position_span`."""
        cuts = max(2, n // 64) if cuts is None else cuts
        ids = np.arange(n, dtype=np.int64)
        if n < 2 or self.position_span <= n or rng.random() >= self.position_jump_prob:
            return ids.astype(np.int32)
        extra = int(rng.integers(0, self.position_span - n + 1))
        at = rng.integers(1, n, size=cuts)
        sizes = rng.multinomial(extra, np.full(cuts, 1.0 / cuts))
        jumps = np.zeros(n, np.int64)
        np.add.at(jumps, at, sizes)
        return (ids + np.cumsum(jumps)).astype(np.int32)

    def length(self, step: int) -> int:
        """The sequence length of the batch at `step` (uniform over the lengths unlocked so far)."""
        rng = np.random.default_rng(zlib.crc32(f"len/{self.seed}/{step}".encode()))
        return int(rng.choice([n for n in self.lengths if n <= self.max_length(step)]))

    def batch(self, step: int, batch_size: int, length: int | None = None) -> Batch:
        length = self.length(step) if length is None else length
        rng = np.random.default_rng(zlib.crc32(f"pos/{self.seed}/{step}".encode()))
        rows = [self._draw(step, i, length) for i in range(batch_size)]
        width = max(length, max(len(ids) for ids, _, _ in rows))  # fixed width per length: one compile each
        tokens = np.zeros((batch_size, width), np.int32)
        positions = np.full((batch_size, width), -1, np.int32)
        mask = np.zeros((batch_size, width), np.float32)
        for i, (ids, spans, is_copy) in enumerate(rows):
            tokens[i, : len(ids)] = ids
            positions[i, : len(ids)] = self.positions(rng, len(ids))
            for start, end in spans:
                mask[i, start - 1 : end - 1] = 1.0  # predict answers + </s> (or the repeats) from the token before
                if self.item_start_weight != 1.0 and not is_copy:
                    # An item's first token is the one found by retrieval (the rest is copied), and the token
                    # after its last says whether another follows: the decisions of an answer.
                    before, target = np.asarray(ids[start - 1 : end - 1]), np.asarray(ids[start:end])
                    decisions = self._separators[before] | self._word_starts[target] | self._item_ends[target]
                    mask[i, start - 1 : end - 1][decisions] = self.item_start_weight
        return Batch(tokens, positions, mask)


_WORKER_MIXTURE: TaskMixture | None = None


def _start_worker(mixture: TaskMixture) -> None:
    global _WORKER_MIXTURE
    _WORKER_MIXTURE = mixture


def _worker_batch(step: int, rows: int, length: int) -> Batch:
    return _WORKER_MIXTURE.batch(step, rows, length)


class BatchPrefetcher:
    """`mixture.batch` for steps in order, computed `ahead` steps early by `workers` processes.

    A batch depends only on (seed, step), so the batches are the ones computed inline; on a GPU the
    Python task generators would otherwise keep it waiting. `workers=0` computes each batch when asked.
    Spawned (not forked) processes: the parent holds JAX's threads.
    """

    def __init__(self, mixture: TaskMixture, rows_of: Callable[[int], int], workers: int = 0, ahead: int = 0):
        self.mixture, self.rows_of = mixture, rows_of
        self.ahead = ahead or 2 * workers
        self._pool = None
        self._pending: dict[int, Any] = {}
        if workers > 0:
            import concurrent.futures
            import multiprocessing

            self._pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                initargs=(mixture,),
            )

    def _args(self, step: int) -> tuple[int, int, int]:
        """(step, rows, length) of the batch of `step`."""
        length = self.mixture.length(step)
        return step, self.rows_of(length), length

    def batch(self, step: int, end: int) -> Batch:
        """The batch of `step`; with workers, also queues those of the steps after it, up to `end`."""
        if self._pool is None:
            return self.mixture.batch(*self._args(step))
        for later in range(step, min(step + self.ahead + 1, end)):
            if later not in self._pending:
                self._pending[later] = self._pool.submit(_worker_batch, *self._args(later))
        return self._pending.pop(step).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._pending = None, {}
