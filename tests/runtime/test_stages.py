"""Prefill's host-side plan and the capability members the runtime calls.

Oracles: the layouts `generate.prefill` documents (question fed uncompressed after the prompt, read by a
`QuestionReader` as the end of its prompt, or also before it; a context replay holding the prompt whole), written
out by hand for small inputs; and the runtime's source, read with `ast`, for the members it calls on a
`ContextReplay` method. Behaviour of the stages themselves is frozen by tests/test_golden.py.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
from tiny import tiny_config

from kvjax import methods
from kvjax.methods import capabilities as caps
from kvjax.methods.base import Method
from kvjax.runtime import stages

SMALL = dict(n_init=2, n_local=8, block_size=4, window=8, repr_topk=2)
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]
QUESTIONS = [[9, 10], [11]]


def test_a_question_is_fed_after_the_compressed_prompt():
    plan = stages.plan(tiny_config(), PROMPTS, method="snapkv", method_args={"budget": 4, "window_size": 2},
                       max_new_tokens=3, question_ids=QUESTIONS)
    assert plan.bucket == 16 and plan.chunk == 16 and plan.fresh and not plan.replays
    np.testing.assert_array_equal(plan.lengths, [5, 3])
    np.testing.assert_array_equal(plan.tokens[0, :6], [1, 2, 3, 4, 5, 0])
    np.testing.assert_array_equal(plan.positions[1, :4], [0, 1, 2, -1])
    assert plan.has_question and plan.question_bucket == 16 and not plan.question_first
    np.testing.assert_array_equal(plan.question_lengths, [2, 1])
    assert plan.capacity == plan.method.capacity(16, 3)
    assert plan.context == 16 + 16 + 3
    assert plan.rope_length == 7  # the longest prompt + question


def test_a_question_reader_reads_the_question_inside_its_prompt():
    plan = stages.plan(tiny_config(), PROMPTS, method="quest", method_args={"budget": 8, "page_size": 4},
                       max_new_tokens=2, question_ids=QUESTIONS)
    assert not plan.has_question and plan.question is None
    np.testing.assert_array_equal(plan.lengths, [7, 4])
    np.testing.assert_array_equal(plan.tokens[1, :5], [6, 7, 8, 11, 0])


def test_a_question_first_method_gets_the_question_on_both_sides():
    plan = stages.plan(tiny_config(), PROMPTS, method="qllm", method_args={"topk": 2, **SMALL},
                       max_new_tokens=2, question_ids=QUESTIONS)
    assert plan.question_first and not plan.fresh
    np.testing.assert_array_equal(plan.question_first_lengths, [2, 1])
    np.testing.assert_array_equal(plan.lengths, [9, 5])
    np.testing.assert_array_equal(plan.tokens[0, :9], [9, 10, 1, 2, 3, 4, 5, 9, 10])
    assert plan.rope_length == 9


def test_a_context_replay_holds_the_prompt_whole_and_reserving_resizes_only_the_cache():
    args = {"budget": 4, "chunk_size": 16, "repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10]}
    plan = stages.plan(tiny_config(), PROMPTS, method="kvzip", method_args=args, max_new_tokens=2)
    assert plan.replays
    bigger = plan.reserving(40)
    assert bigger.capacity == plan.method.capacity(16, 40) > plan.capacity
    assert bigger.bucket == plan.bucket and bigger.context == plan.context + 38
    np.testing.assert_array_equal(bigger.tokens, plan.tokens)


def _method_attributes(tree: ast.AST) -> set[str]:
    """Every `method.<name>` read in a module."""
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "method"}


def test_context_replay_declares_every_member_the_runtime_calls():
    runtime = pathlib.Path(stages.__file__).parent
    called = _method_attributes(ast.parse((runtime / "replay.py").read_text()))
    for path in runtime.glob("*.py"):
        called |= {name for name in _method_attributes(ast.parse(path.read_text())) if name.startswith("replay_")}
    declared = {name for name in dir(caps.ContextReplay) if not name.startswith("__")} | set(dir(Method))
    assert called - {"name"} <= declared, sorted(called - declared)
    assert {"replay_width", "replay_rows", "replay_scores", "replay_compress"} <= called
    # The registered context-replay method implements each of them.
    kvzip = type(methods.get("kvzip", budget=4, repeat_ids=[1], continue_ids=[2], suffix_ids=[3]))
    for name in called & set(vars(caps.ContextReplay)):
        assert getattr(kvzip, name) is not getattr(caps.ContextReplay, name), name
