"""`python -m kvjax.run`: a file of prompts through the continuous-batching engine, one output line per answer.

    python -m kvjax.run --input=prompts.jsonl --output=answers.jsonl --method=snapkv --budget=256
    python -m kvjax.run --model=smollm2-135m --input=questions.txt --output=out.jsonl --max_new_tokens=64

The model, method, budget / ratio, method arguments, storage format, mesh and chat template are the eval's flags
(one value each here). The input is JSONL (`{"id": ..., "prompt": ...}` or `"messages"`, optional per-request
settings, `kvjax.engine.jobs`; `samples` / `--samples`: several sampled answers from one prefill, a line each), a
file in OpenAI's batch format (`custom_id`, `url`, `body`: `kvjax.engine.openai_batch`; the output is then in it
too) or a text file of one prompt per line (blank lines skipped). Every line is checked before anything is computed:
a malformed line, a duplicate id, an empty prompt, a prompt longer than the model's context, an unknown field each
stop the job with exit code 2 and one line naming the line (`--dry_run` stops there, with a summary, before the
weights load). Each finished request is written as it finishes; rerunning the command after a kill skips the ids
already written, and is refused if a setting that decides an answer changed (`<output>.run.json`,
`kvjax.engine.run_record`). In a multi-process launch each process takes every `process_count`-th request and writes
`answers.001-of-004.jsonl` beside `--output=answers.jsonl` (process 1 of 4). See docs/engine.md.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

from absl import flags

from kvjax.chat import CHAT_TEMPLATE_SETTINGS
from kvjax.cli import parse, paths
from kvjax.cli.refuse import refuse
from kvjax.errors import ConfigError, KvjaxError

#: The run's own flag registry: the eval's flag names, without clashing with `kvjax.eval`'s in one process.
FLAGS = flags.FlagValues()


def _define(kind: str, name: str, default: Any, text: str, *args: Any) -> None:
    getattr(flags, f"DEFINE_{kind}")(name, default, *args, text, flag_values=FLAGS)


# The eval's flags for the model, method and storage (one value each here).
_define("string", "model", "kvjax-tiny", "Preset name (see kvjax.models.presets.available()) or a local HF directory.")
_define("string", "model_dir", None, "Local directory holding the weights of a preset model (else $KVJAX_MODEL_DIR).")
_define("enum", "dtype", "auto", "Model dtype (auto: float32 on CPU, bfloat16 elsewhere).",
        ["auto", "float32", "bfloat16"])
_define("string", "method", "full", "Registered method name (kvjax.methods.available()).")
_define("integer", "budget", None, "Tokens kept of each prompt (compressing methods).")
_define("float", "compression_ratio", None, "Fraction of each prompt removed, in [0, 1).")
_define("string", "method_args", None, "The method's hyperparameters, key=value,key=value (Python literals).")
_define("string", "kv_dtype", None, "K / V storage: model (default), int8, fp8, int4, kivi2, kivi4.")
_define("string", "mesh", None, "Device mesh, e.g. data:4,model:2 (slots on data).")
_define("enum", "chat_template", "auto", "Wrap prompts in the tokenizer's chat template.", list(CHAT_TEMPLATE_SETTINGS))
# The job.
_define("string", "input", None, "Prompts: JSONL (.jsonl / .json: kvjax's lines, or OpenAI batch lines with "
        "custom_id, answered in OpenAI's batch output format) or text, one prompt per line.")
_define("string", "output", None, "Output JSONL, appended as requests finish (resumed when it exists).")
_define("integer", "max_new_tokens", 256, "Tokens generated per request unless it gives its own.")
_define("float", "temperature", 0.0, "Sampling temperature unless a request gives its own (0: greedy).")
_define("float", "top_p", 1.0, "Nucleus mass unless a request gives its own.")
_define("integer", "seed", 0, "Sampling seed unless a request gives its own.")
_define("multi_string", "stop", None, "A stop string (repeat the flag for several): an answer ends once its text "
        "holds one, its text cut where it starts; unless a request gives its own.")
_define("boolean", "logprobs", False, "Write each generated token's log-probability (unless a request says).")
_define("integer", "samples", 1, "Answers drawn per prompt, from one prefill, unless a request says (needs a "
        "temperature > 0; one output line per sample).")
_define("boolean", "dry_run", False, "Check the flags and every input line, print what the job holds, and exit "
        "without loading the weights or writing the output.")
# The engine.
_define("integer", "slots", None, "Decode slots (default: as many as fit in device memory; 8 on CPU).")
_define("float", "memory_fraction", 0.9, "Device memory the slot count may plan for.")
_define("integer", "steps", 8, "Tokens decoded per slot between two admissions.")
_define("integer", "prefill_tokens", None, "At most this many (bucketed) prompt tokens prefilled between two "
        "decode calls, the oldest request admitted past it (default: no bound; every free slot is filled).")
_define("integer", "prefill_batch", 1, "Requests of one length bucket prefilled together.")
_define("integer", "chunk_size", None, "Prefill chunk size (as kvjax.generate's).")
_define("boolean", "share_prompts", True, "A request whose prompt equals the previous prefill's (another question "
        "about the same context) reuses its prompt pass; list a context's questions together.")
_define("string", "prompt_store", None, "A folder where each prompt pass (the prompt's prefill and compression) is "
        "kept and read back by later requests and jobs with the same prompt, model, method and sizes; outputs are "
        "unchanged (docs/engine.md, \"Prompt store\").")
_define("float", "prompt_store_max_gb", None, "Keep --prompt_store's prompt passes within this many GB (10^9 bytes): "
        "after each write the least recently used are removed, and a pass larger than this is not kept.")
_define("boolean", "progress", True, "Show a progress bar.")
_define("float", "throttle_s", 0.0, "Sleep after each written request (rate limiting; tests interrupt a job with it).")

NAME = "kvjax.run"


def parse_method_args(spec: str | None) -> dict[str, Any]:
    """`--method_args` as the eval parses it (`kvjax.cli.parse`), one value per key: a job runs one setting."""
    args = parse.parse_method_args(spec)
    for key, value in args.items():
        if isinstance(value, parse.Alternatives):
            raise ConfigError(f"--method_args sweeps {key!r} ({'|'.join(map(str, value))}): kvjax.run runs one "
                              "setting; give one value (the eval sweeps)")
    return args


def _method_args() -> dict[str, Any]:
    args = parse_method_args(FLAGS.method_args)
    for flag in ("budget", "compression_ratio"):
        value = getattr(FLAGS, flag)
        if value is None:
            continue
        if flag in args:
            raise ConfigError(f"--{flag} and --method_args={flag}=... both give the {flag}")
        args[flag] = value
    return args


def _shard_path(path: str, index: int, count: int) -> str:
    if count == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.{index:03d}-of-{count:03d}{ext or '.jsonl'}"


def run(argv: list[str]) -> int:
    """The CLI body; raises KvjaxError for bad input (main turns it into exit code 2)."""
    if len(argv) > 1:
        raise ConfigError(f"unexpected positional arguments {argv[1:]}; every option is a --flag")
    for flag in ("input", "output"):
        if not getattr(FLAGS, flag):
            raise ConfigError(f"--{flag} is required")
    if not os.path.isfile(FLAGS.input):
        raise ConfigError(f"--input {FLAGS.input!r} is not a file")
    paths.output_file("output", FLAGS.output)  # before the model loads (a shard's file sits beside it)
    if os.path.exists(FLAGS.output) and os.path.samefile(FLAGS.input, FLAGS.output):
        raise ConfigError(f"--output {FLAGS.output!r} is the --input file; answers go to a file of their own")
    from kvjax.engine import jobs, run_record, sizing
    from kvjax.engine.stops import special_problem, stop_problem

    for flag in ("max_new_tokens", "temperature", "top_p", "seed", "samples"):  # every line's defaults, as a line's
        problem = jobs.setting_problem(flag, getattr(FLAGS, flag))
        if problem:
            raise ConfigError(f"--{flag} {problem}")
    problem = stop_problem(tuple(FLAGS.stop or ()), "--stop")
    if problem:
        raise ConfigError(problem)
    if FLAGS.samples > 1 and FLAGS.temperature == 0 and not jobs.is_jsonl(FLAGS.input):  # every line's settings
        raise ConfigError(f"--samples={FLAGS.samples} at --temperature=0 would be {FLAGS.samples} identical greedy "
                          "answers per prompt; give a --temperature > 0")
    sizing.check_fraction(FLAGS.memory_fraction, "--memory_fraction")
    for flag in ("slots", "prefill_tokens", "chunk_size"):
        if getattr(FLAGS, flag) is not None and getattr(FLAGS, flag) <= 0:
            raise ConfigError(f"--{flag} must be > 0, got {getattr(FLAGS, flag)}")
    if FLAGS.slots is not None and FLAGS.samples > FLAGS.slots and not jobs.is_jsonl(FLAGS.input):
        raise ConfigError(f"--samples={FLAGS.samples} needs as many slots at once, more than --slots={FLAGS.slots}")
    if not FLAGS.throttle_s >= 0:
        raise ConfigError(f"--throttle_s must be >= 0, got {FLAGS.throttle_s}")
    for flag in ("steps", "prefill_batch"):
        if getattr(FLAGS, flag) <= 0:
            raise ConfigError(f"--{flag} must be > 0, got {getattr(FLAGS, flag)}")
    if FLAGS.prompt_store is not None:
        if os.path.exists(FLAGS.prompt_store) and not os.path.isdir(FLAGS.prompt_store):
            raise ConfigError(f"--prompt_store {FLAGS.prompt_store!r} is a file, not a folder")
    if FLAGS.prompt_store_max_gb is not None:
        if FLAGS.prompt_store is None:
            raise ConfigError("--prompt_store_max_gb sizes a prompt store; give --prompt_store too")
        if not 1 <= FLAGS.prompt_store_max_gb * 1e9 < math.inf:  # a whole number of bytes (inf: no int)
            raise ConfigError(f"--prompt_store_max_gb must be a finite number > 0, got {FLAGS.prompt_store_max_gb}")
    from kvjax.engine.engine import resolve_engine_method
    from kvjax.engine.request import check_request
    from kvjax.methods import capabilities as caps
    from kvjax.models.config import ModelConfig
    from kvjax.models.presets import resolve_model_dir
    from kvjax.models.tokenizer import load_tokenizer
    from kvjax.runtime import sharding, stages

    method = resolve_engine_method(FLAGS.method, _method_args() or None)
    mesh_sizes = sharding.parse_mesh(FLAGS.mesh) if FLAGS.mesh else None
    config = ModelConfig.from_dir(resolve_model_dir(FLAGS.model, model_dir=FLAGS.model_dir))
    stages.resolve_kv_dtype(FLAGS.kv_dtype, config.head_dim)
    method.check_model(config)
    tokenizer = load_tokenizer(FLAGS.model, model_dir=FLAGS.model_dir)
    problem = special_problem(tuple(FLAGS.stop or ()), tokenizer)  # the flag's, not blamed on the first line
    if problem:
        raise ConfigError(f"--stop: {problem}")
    encoder = jobs.PromptEncoder(tokenizer, FLAGS.chat_template)
    if caps.replays_context(method):  # KVzip's repeat prompt from the tokenizer, as kvjax.eval builds it
        try:
            method = method.with_tokenizer(tokenizer, encoder.template)
        except Exception as e:  # noqa: BLE001 (the chat template's own error, or one that drops the message)
            raise ConfigError(f"--method={method.name}: its repeat prompt cannot be built with the tokenizer's chat "
                              f"template ({type(e).__name__}: {e}); pass --chat_template=no") from None
    defaults = jobs.Defaults(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                             seed=FLAGS.seed, logprobs=FLAGS.logprobs, samples=FLAGS.samples,
                             stop=tuple(FLAGS.stop or ()))

    vocab_note = _vocab_note(tokenizer, config.vocab_size)

    def check(request: Any) -> None:  # what the engine checks, before it exists (no weights loaded yet)
        check_request(request, vocab_size=config.vocab_size, max_new_tokens=request.max_new_tokens,
                      max_stop_ids=len(request.stop_ids), sampling=True, vocab_note=vocab_note)
        if FLAGS.slots is not None and request.sample_count > FLAGS.slots:
            raise ConfigError(f"samples={request.samples} needs as many slots at once, more than --slots={FLAGS.slots}")
        problem = special_problem(request.stop, tokenizer)
        if problem:
            raise ConfigError(problem)
        total = request.sequence + (len(request.question) if caps.encodes_question(method) else 0)
        stages.check_context(method, total + request.max_new_tokens, total, config.max_position_embeddings)

    job = jobs.read_job(FLAGS.input, encoder, defaults, check)
    requests = job.requests
    if FLAGS.dry_run:
        print(_dry_run_summary(job, method.name))
        return 0

    sharding.maybe_initialize_distributed()  # multi-process launches (docs/scale.md), before any device use
    import jax

    index, count = jax.process_index(), jax.process_count()
    if FLAGS.prompt_store is not None and mesh_sizes and count > 1:
        raise ConfigError("--prompt_store reads and writes whole prompt passes from one process; it does not run "
                          "with --mesh in a multi-process launch")
    mine = requests[index::count]
    output = _shard_path(FLAGS.output, index, count)
    dtype = FLAGS.dtype if FLAGS.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    settings = _answer_settings(method, config, dtype)
    run_record.check(output, settings)  # before resume, which may cut a torn line: a refused run changes nothing
    finished = jobs.resume(output, mine, openai=FLAGS.model if job.openai else None)
    todo = jobs.remaining(mine, finished)
    if not todo:
        print(f"{NAME}: all {_count(mine)} already in {output}")
        return 0

    from kvjax.engine import Engine
    from kvjax.models.model import load_model

    model = load_model(FLAGS.model, dtype=dtype, model_dir=FLAGS.model_dir)
    mesh = None
    if mesh_sizes:
        mesh = sharding.make_mesh(mesh_sizes[sharding.DATA], mesh_sizes[sharding.MODEL])
        model = sharding.shard_model(model, mesh)
    engine = Engine(
        model, method=method, max_prompt_tokens=max(len(r.tokens) for r in todo),
        max_question_tokens=max(len(r.question) for r in todo), max_new_tokens=max(r.max_new_tokens for r in todo),
        slots=FLAGS.slots, steps=FLAGS.steps, prefill_tokens=FLAGS.prefill_tokens, prefill_batch=FLAGS.prefill_batch,
        chunk_size=FLAGS.chunk_size, kv_dtype=FLAGS.kv_dtype, mesh=mesh, sampling=any(r.temperature > 0 for r in todo),
        max_stop_ids=max(len(r.stop_ids) for r in todo), memory_fraction=FLAGS.memory_fraction,
        tokenizer=tokenizer, share_prompts=FLAGS.share_prompts, prompt_store=FLAGS.prompt_store,
        prompt_store_max_bytes=None if FLAGS.prompt_store_max_gb is None else int(FLAGS.prompt_store_max_gb * 1e9),
    )
    if not finished:
        run_record.write(output, settings)
    return _run_job(engine, todo, output, job.writer(tokenizer, FLAGS.model), skipped=len(finished))


def _vocab_note(tokenizer: Any, vocab_size: int) -> str:
    """What an out-of-vocabulary id's message adds when the tokenizer holds more tokens than the model's vocabulary:
    the line's text is fine, the two do not belong together (a tokenizer one token larger, as transformers' GGUF
    byte-level tokenizers are, passes every other id, so it is no reason to refuse the job up front)."""
    size = len(tokenizer) if callable(getattr(tokenizer, "__len__", None)) else None
    if size is None or size <= vocab_size:
        return ""
    return (f" (the tokenizer has {size} tokens, more than the model's vocabulary of {vocab_size}: is --model's "
            "tokenizer this model's own?)")


def _answer_settings(method: Any, config: Any, dtype: str) -> dict[str, Any]:
    """What decides an answer, as `kvjax.engine.run_record` keeps it beside the output (keys named as the flags)."""
    from kvjax.models.fingerprint import config_digest

    return {
        "model": os.path.abspath(FLAGS.model) if os.path.isdir(FLAGS.model) else FLAGS.model,  # `d/` is `./d`
        "model_config_sha256": config_digest(config),
        "dtype": dtype, "method": method.name, "method_args": method.hyperparameters(),
        "kv_dtype": FLAGS.kv_dtype or "model", "chat_template": FLAGS.chat_template, "chunk_size": FLAGS.chunk_size,
        **{flag: getattr(FLAGS, flag) for flag in ("max_new_tokens", "temperature", "top_p", "seed", "logprobs",
                                                    "samples")},
        "stop": list(FLAGS.stop or ()),
    }


def _count(requests: list, note: str = "") -> str:
    """The job's size: `3 requests`, or `3 requests (12 answers)` when some draw several samples; `note` joins the
    parentheses."""
    answers = sum(r.sample_count for r in requests)
    notes = ([f"{answers} answers"] if answers != len(requests) else []) + ([note] if note else [])
    text = f"{len(requests)} request{'s' if len(requests) != 1 else ''}"
    return f"{text} ({'; '.join(notes)})" if notes else text


def _dry_run_summary(job: Any, method: str) -> str:
    """What a checked job holds: its requests' prompt lengths and answers, and what runs them."""
    requests = job.requests
    prompts = sorted(len(r.tokens) + len(r.question) for r in requests)
    spread = f"{prompts[0]}" if prompts[0] == prompts[-1] else \
        f"{prompts[0]}-{prompts[-1]} (median {prompts[len(prompts) // 2]})"
    sampled = sum(r.temperature > 0 for r in requests)
    stopping = sum(bool(r.stop) for r in requests)
    stops = f", {stopping} with stop strings" if stopping else ""
    chats = sum(e == "chat" for e in job.endpoints.values())
    texts = len(job.endpoints) - chats
    kind = f" (OpenAI batch: {chats} chat, {texts} completion{'s' if texts != 1 else ''})" if job.openai else ""
    return (f"{NAME}: dry run: {_count(requests)}{kind} of {FLAGS.input} checked; prompts of {spread} tokens, at most "
            f"{max(r.max_new_tokens for r in requests)} new tokens each, {sampled} sampled{stops}; {FLAGS.model}, "
            f"{method}, kv_dtype {FLAGS.kv_dtype or 'model'}; no weights loaded, {FLAGS.output} not written")


def _run_job(engine: Any, todo: list, output: str, lines: Any, *, skipped: int) -> int:
    """Runs the requests, appending each output line `lines` gives for a finished answer."""
    import json

    from tqdm import tqdm

    started = time.perf_counter()
    last: list = [None]
    answers = sum(r.sample_count for r in todo)
    bar = tqdm(total=answers, desc=f"{engine.method.name} x{engine.slots} slots", unit="answer" if answers >
               len(todo) else "req",
               disable=not FLAGS.progress, file=sys.stderr, dynamic_ncols=True)

    def progress(p: Any) -> None:
        last[0] = p
        bar.set_postfix_str(f"{p.tokens / max(p.elapsed_s, 1e-9):.1f} tok/s, {p.live}/{p.slots} slots", refresh=False)

    with open(output, "a", encoding="utf-8") as f, bar:
        for done in engine.run(todo, progress=progress):
            for line in lines(done):
                f.write(json.dumps(line) + "\n")
            f.flush()
            bar.update(1)
            if FLAGS.throttle_s > 0:
                time.sleep(FLAGS.throttle_s)
    p = last[0]
    took = time.perf_counter() - started
    tokens = p.tokens if p is not None else 0
    print(f"{NAME}: {_count(todo, f'{skipped} already done')}, {tokens} tokens in {took:.1f} s "
          f"({tokens / max(took, 1e-9):.1f} tok/s; prefill {p.prefill_s:.1f} s, decode {p.decode_s:.1f} s) "
          f"on {engine.slots} slots -> {output}")
    if engine.store is not None:
        store = engine.store
        print(f"{NAME}: prompt store {store.folder}: {store.read} prompt passes read, {store.written} computed and "
              f"written" + ("" if store.max_bytes is None else
                            f", {store.removed} least recently used removed, {store.too_large} too large to keep "
                            f"(the folder's passes: {sum(f[2] for f in store.pass_files()) / 1e9:.3f} of "
                            f"{store.max_bytes / 1e9:g} GB)"))
    return 0


def _parse_flags(argv: list[str]) -> list[str]:
    return parse.parse_flags(FLAGS, argv, NAME, doc=__doc__)


def main(argv: list[str]) -> None:
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # keep JAX's backend INFO lines out of the output
    try:
        sys.exit(run(argv))
    except KvjaxError as e:
        refuse(NAME, e)
    except OSError as e:
        refuse(NAME, f"{e.filename or FLAGS.output}: {e.strerror or e}")
    except KeyboardInterrupt:
        print(f"\n{NAME}: interrupted; rerun the command to resume", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main(_parse_flags(sys.argv))
