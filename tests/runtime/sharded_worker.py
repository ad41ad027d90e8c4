"""Run by `test_sharding.py` in a subprocess with 8 forced CPU devices (XLA_FLAGS must be set before
JAX starts): greedy generation on each mesh against one device, every method, one JSON line out.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/runtime/sharded_worker.py
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import kvjax  # noqa: E402
from kvjax import rag  # noqa: E402
from kvjax.runtime import sharding  # noqa: E402

NUM_HEADS, NUM_KV_HEADS = 8, 4
MESHES = ((8, 1), (1, NUM_KV_HEADS), (2, 4))
MAX_NEW = 4
METHODS = {
    "full": {},
    "snapkv": dict(budget=24, window_size=8),
    "lagkv": dict(budget=24, sink_size=4, lag_size=8),
    "sagekv": dict(budget=24),
    "ahakv": dict(budget=24, recent_size=4),
    "actqkv": dict(topk=3, n_init=4, n_local=16, block_size=4, window=32, repr_topk=2),
    "merging": dict(budget=24, merge_fraction=0.75),  # scatters its merged values across heads and slots
}

#: Meshes each method runs on where not all three: `full` and SnapKV cover the one-axis meshes; the rest run on
#: 2x4, which splits both the batch and the KV heads (every method's cache state is placed by the same rule).
MESHES_OF = {m: ("2x4",) for m in ("lagkv", "sagekv", "ahakv", "actqkv", "merging")} | {"samkv": ("1x4", "2x4")}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 96, n).tolist() for n in (40, 33, 57, 60, 21, 48, 50, 37)]


def _spec(x: jax.Array) -> str:
    return str(getattr(x.sharding, "spec", x.sharding))


def _weight_shards(model) -> dict[str, list[int]]:
    """The shape of one device's shard of layer 0's fused projections."""
    layer = model.weights()["layers"][0]
    return {name: list(layer[name].sharding.shard_shape(layer[name].shape)) for name in ("qkv", "gate_up")}


def main() -> None:
    from tiny import tiny_model

    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, got {jax.device_count()} (set XLA_FLAGS before JAX starts)")
    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None
    model = tiny_model(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS)
    prompts = _prompts()
    meshes = {f"{d}x{m}": sharding.make_mesh(d, m) for d, m in MESHES}
    models = {name: sharding.shard_model(model, mesh) for name, mesh in meshes.items()}
    out: list[dict] = []
    for method, args in METHODS.items():
        if only and method not in only:
            continue
        ref = kvjax.generate(model, prompts, method=method, method_args=args, max_new_tokens=MAX_NEW,
                             stop_at_eos=False)
        for name, mesh in meshes.items():
            if name not in MESHES_OF.get(method, meshes):
                continue
            got = kvjax.generate(models[name], prompts, method=method, method_args=args, max_new_tokens=MAX_NEW,
                                 stop_at_eos=False, mesh=mesh, return_cache=True)
            out.append(dict(method=method, mesh=name, ref=ref.tokens.tolist(), got=got.tokens.tolist(),
                            cache_spec=_spec(got.cache.layers[0].k),
                            devices=len(got.cache.layers[0].k.sharding.device_set),
                            weight_shards=_weight_shards(models[name])))
    if not only or "samkv" in only:
        # kvjax.rag takes no mesh: a model placed with shard_model carries the layout into its jitted
        # programs (sharding propagation), documents prefilled with it are sharded like it.
        rng = np.random.default_rng(1)
        docs_ids = [rng.integers(0, 96, n).tolist() for n in (41, 60, 52)]
        prefix, query = rng.integers(0, 96, 5).tolist(), rng.integers(0, 96, 6).tolist()
        layout = rag.BlockLayout(block_size=4, init_blocks=1, local_blocks=2)

        def answer(m):
            docs = rag.prefill_documents(m, docs_ids, layout=layout)
            res = rag.answer(m, docs, query, prefix=prefix, strategy="samkv", max_new_tokens=MAX_NEW,
                             stop_at_eos=False, return_cache=True)
            return res, docs

        ref, _ = answer(model)
        for name in MESHES_OF["samkv"]:
            got, docs = answer(models[name])
            out.append(dict(method="samkv", mesh=name, ref=[ref.tokens.tolist()], got=[got.tokens.tolist()],
                            cache_spec=_spec(docs[0].k[0]),
                            devices=len(got.cache.layers[0].k.sharding.device_set)))
    if not only or "quantized" in only:
        # A quantized cache (KIVI-2: codes, scales, ring, qlen; every leaf [B, K, ...]) placed like the rest.
        args, kv_dtype = METHODS["snapkv"], "kivi2:group_size=8:residual=8"
        ref = kvjax.generate(model, prompts, method="snapkv", method_args=args, max_new_tokens=MAX_NEW,
                             stop_at_eos=False, kv_dtype=kv_dtype)
        got = kvjax.generate(models["2x4"], prompts, method="snapkv", method_args=args, max_new_tokens=MAX_NEW,
                             stop_at_eos=False, mesh=meshes["2x4"], return_cache=True, kv_dtype=kv_dtype)
        out.append(dict(method="snapkv:kivi2", mesh="2x4", ref=ref.tokens.tolist(), got=got.tokens.tolist(),
                        cache_spec=_spec(got.cache.layers[0].k.data),
                        devices=len(got.cache.layers[0].k.residual.sharding.device_set)))
    if not only or "cli" in only:
        out += _cli_cases(meshes)
    if not only or "engine" in only:
        out += _engine_cases(model, models["2x4"], meshes["2x4"], prompts)
    if only and "families" in only:
        out += _family_cases(meshes)
    if only and "store" in only:
        out += _store_cases(model, meshes["2x4"], prompts)
    if only and "contexts" in only:
        out += _context_cases(model, models["2x4"], meshes["2x4"], prompts)
    print(json.dumps(out))


class _Letters:
    """A stand-in tokenizer: id t decodes to one of seven letters."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + t % 7) for t in ids)


def _engine_cases(model, sharded, mesh, prompts: list[list[int]]) -> list[dict]:
    """The engine with its 4 slots on `data` (2) and the KV heads on `model` (4), against `generate` of each prompt
    alone on one device: SnapKV (appends in place) and TOVA (per-example decode state, evicting while decoding)."""
    from kvjax.engine import Engine, Request

    out, refs = [], {}
    for method in ("snapkv", "tova"):
        args = METHODS.get(method, dict(budget=24))
        requests = [Request(id=i, tokens=tuple(p), max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)]
        engine = Engine(sharded, method=method, method_args=args, max_prompt_tokens=max(map(len, prompts)),
                        max_new_tokens=MAX_NEW, slots=4, steps=2, mesh=mesh)
        done = {c.id: c.tokens for c in engine.run(requests)}
        ref = [kvjax.generate(model, [p], method=method, method_args=args, max_new_tokens=MAX_NEW).tokens[0].tolist()
               for p in prompts]
        refs[method] = ref
        out.append(dict(method=f"engine:{method}", mesh="2x4", ref=ref, got=[done[i] for i in range(len(prompts))],
                        cache_spec=_spec(engine.cache.layers[0].k),
                        devices=len(engine.cache.layers[0].k.sharding.device_set)))
    # An unsharded model given with the mesh: the engine places it once, so a prompt pass (held for the same prompt's
    # second request) reads the engine's weights, not a copy of its own; each prompt twice, against `generate`.
    from kvjax.runtime import stages

    held, through = [], stages.through_prompt
    stages.through_prompt = lambda *a, **k: held.append(through(*a, **k)) or held[-1]
    try:
        requests = [Request(id=f"{i}.{n}", tokens=tuple(p), max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)
                    for n in range(2)]
        engine = Engine(model, method="snapkv", method_args=METHODS["snapkv"], max_prompt_tokens=max(map(len, prompts)),
                        max_new_tokens=MAX_NEW, slots=4, steps=2, mesh=mesh)
        done = {c.id: c.tokens for c in engine.run(requests)}
    finally:
        stages.through_prompt = through
    ours = jax.tree.leaves(engine.weights)
    out.append(dict(method="engine:shared", mesh="2x4", ref=[r for r in refs["snapkv"] for _ in range(2)],
                    got=[done[f"{i}.{n}"] for i in range(len(prompts)) for n in range(2)], passes=len(held),
                    held_is_engines=all(all(a is b for a, b in zip(ours, jax.tree.leaves(h.weights), strict=True))
                                        for h in held),
                    cache_spec=_spec(engine.cache.layers[0].k),
                    devices=len(engine.cache.layers[0].k.sharding.device_set)))
    # Two sampled answers per prompt from one prefill (the insert gathers a row into two slots on `data`), ended by
    # a stop string (the host ends a slot on `data`), against the same requests through the engine on one device.
    args = METHODS["snapkv"]
    requests = [Request(id=i, tokens=tuple(p), max_new_tokens=MAX_NEW, temperature=0.9, seed=i, samples=2,
                        stop=("d",)) for i, p in enumerate(prompts)]
    answers = []
    for m, on in ((model, None), (sharded, mesh)):
        engine = Engine(m, method="snapkv", method_args=args, max_prompt_tokens=max(map(len, prompts)),
                        max_new_tokens=MAX_NEW, slots=4, steps=2, mesh=on, sampling=True, tokenizer=_Letters())
        done = sorted(engine.run(requests), key=lambda c: (c.id, c.sample))
        answers.append([c.tokens for c in done])
    out.append(dict(method="engine:samples", mesh="2x4", ref=answers[0], got=answers[1],
                    cache_spec=_spec(engine.cache.layers[0].k), stopped=sum(c.stop is not None for c in done),
                    devices=len(engine.cache.layers[0].k.sharding.device_set)))
    return out


def _store_cases(model, mesh, prompts: list[list[int]]) -> list[dict]:
    """The engine's prompt store on the 2x4 mesh (run only when asked: `store`): a job asking each of four prompts
    twice, its repeats apart (so only the store lets them skip their pass), with an empty store, then again over
    it, against the same job on the mesh without a store; each pass read back is placed as the computed one."""
    import tempfile

    from kvjax.engine import Engine, Request
    from kvjax.engine.prompt_store import PromptStore
    from kvjax.runtime import stages

    requests = [Request(id=f"{i}.{n}", tokens=tuple(prompts[i]), max_new_tokens=MAX_NEW) for n in range(2)
                for i in range(4)]
    computed, loaded, through, load = [], [], stages.through_prompt, PromptStore.load
    stages.through_prompt = lambda *a, **k: computed.append(through(*a, **k)) or computed[-1]
    PromptStore.load = lambda self, *a: (lambda got: got is not None and loaded.append(got) or got)(load(self, *a))
    out = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            runs = {}
            for name, store in (("plain", None), ("first", folder), ("again", folder)):
                before = len(computed), len(loaded)
                engine = Engine(model, method="snapkv", method_args=METHODS["snapkv"], max_new_tokens=MAX_NEW,
                                max_prompt_tokens=max(map(len, prompts)), slots=4, steps=2, mesh=mesh,
                                prompt_store=store)
                done = {c.id: c.tokens for c in engine.run(requests)}
                runs[name] = dict(tokens=[done[r.id] for r in requests], computed=len(computed) - before[0],
                                  read=len(loaded) - before[1])
            one_device = PromptStore(folder, model, engine.method, None).identity
    finally:
        stages.through_prompt, PromptStore.load = through, load

    def placed_alike(got) -> bool:
        """Every leaf of a pass read back (cache, last hidden state, budget) placed as the computed pass's of its
        shapes (the same prompt's)."""
        ours = jax.tree.leaves((got.cache, got.last_hidden, got.budget))
        for pass_ in computed:
            theirs = jax.tree.leaves((pass_.cache, pass_.last_hidden, pass_.budget))
            if [x.shape for x in theirs] == [x.shape for x in ours]:
                return all(isinstance(a, jax.Array) and a.sharding.is_equivalent_to(b.sharding, a.ndim)
                           for a, b in zip(ours, theirs, strict=True))
        return False

    for name in ("first", "again"):
        out.append(dict(method=f"store:{name}", mesh="2x4", ref=runs["plain"]["tokens"], got=runs[name]["tokens"],
                        computed=runs[name]["computed"], read=runs[name]["read"],
                        placed_alike=all(map(placed_alike, loaded)),
                        cache_spec=_spec(loaded[-1].cache.layers[0].k),
                        devices=len(loaded[-1].cache.layers[0].k.sharding.device_set),
                        own_key=one_device != engine.store.identity))
    return out


def _context_cases(model, sharded, mesh, prompts: list[list[int]]) -> list[dict]:
    """A context compressed once and asked four questions on the 2x4 mesh (run only when asked: `contexts`), against
    one device: in memory, and saved then loaded on the mesh and on one device (either way round)."""
    import tempfile

    questions = [p[:n] for p, n in zip(prompts[1:5], (5, 9, 3, 7), strict=True)]
    out = []
    for name, args, kv_dtype in (("snapkv", METHODS["snapkv"], None), ("snapkv:kivi2", METHODS["snapkv"],
                                                                       "kivi2:group_size=8:residual=8")):
        def context(m, on, name=name, args=args, kv_dtype=kv_dtype):
            return kvjax.compress_context(m, prompts[0], method=name.split(":")[0], method_args=args,
                                          max_new_tokens=MAX_NEW,
                                          max_question_tokens=16, kv_dtype=kv_dtype, mesh=on)

        ref = kvjax.ask(model, context(model, None), questions).tokens.tolist()
        ctx = context(sharded, mesh)
        from kvjax.runtime import stages

        asked, after = [], stages.after_prompt  # what the question pass is handed: the rows placed on `data`

        def recorded(m, plan, run, asked=asked, after=after):
            asked.append((_spec(jax.tree.leaves(run.cache.layers[0].k)[0]), run.mesh is mesh))
            return after(m, plan, run)

        stages.after_prompt = recorded
        try:
            got = kvjax.ask(sharded, ctx, questions, return_cache=True)
        finally:
            stages.after_prompt = after
        with tempfile.TemporaryDirectory() as folder:
            kvjax.save_context(ctx, f"{folder}/mesh.kvjax")
            kvjax.save_context(context(model, None), f"{folder}/one.kvjax")
            from_mesh = kvjax.ask(model, kvjax.load_context(f"{folder}/mesh.kvjax", model), questions)
            onto_mesh = kvjax.load_context(f"{folder}/one.kvjax", sharded, mesh=mesh)
            answered = kvjax.ask(sharded, onto_mesh, questions)
        k = got.cache.layers[0].k
        k = k.data if hasattr(k, "data") else k
        out.append(dict(method=f"context:{name}", mesh="2x4", ref=ref, got=got.tokens.tolist(),
                        from_mesh=from_mesh.tokens.tolist(), onto_mesh=answered.tokens.tolist(),
                        context_spec=_spec(jax.tree.leaves(ctx.cache.layers[0].k)[0]),
                        placed_alike=all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in zip(
                            jax.tree.leaves((onto_mesh.cache, onto_mesh.last_hidden)),
                            jax.tree.leaves((ctx.cache, ctx.last_hidden)), strict=True)),
                        cache_spec=_spec(k), devices=len(k.sharding.device_set), asked=asked))
    return out


def _family_cases(meshes: dict) -> list[dict]:
    """Qwen3 (QK-norm) and a Gemma-3-style model (a local layer's ring, then a global layer) with SnapKV on the
    global layers: the 2x4 mesh against one device (run only when asked: `families`)."""
    from tiny import tiny_gemma3, tiny_model

    family_models = {"qwen3": tiny_model(model_type="qwen3", num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS),
                     "gemma3": tiny_gemma3(window=16, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS)}
    prompts = _prompts()
    out = []
    for family, model in family_models.items():
        ref = kvjax.generate(model, prompts, method="snapkv", method_args=METHODS["snapkv"], max_new_tokens=MAX_NEW,
                             stop_at_eos=False)
        for name, mesh in meshes.items():
            if name != "2x4":  # the batch on data and the KV heads on model at once
                continue
            got = kvjax.generate(sharding.shard_model(model, mesh), prompts, method="snapkv",
                                 method_args=METHODS["snapkv"], max_new_tokens=MAX_NEW, stop_at_eos=False, mesh=mesh,
                                 return_cache=True)
            out.append(dict(method=f"{family}:snapkv", mesh=name, ref=ref.tokens.tolist(), got=got.tokens.tolist(),
                            cache_spec=_spec(got.cache.layers[0].k), capacities=[x.capacity for x in got.cache.layers],
                            devices=len(got.cache.layers[0].k.sharding.device_set)))
    return out


def _cli_cases(meshes: dict) -> list[dict]:
    """`python -m kvjax.eval --mesh=...` (its `run`, in this process) against the same eval on one device."""
    import tempfile

    from tiny import tiny_config

    from kvjax.eval import __main__ as cli
    from kvjax.models.char_tokenizer import save_char_tokenizer
    from kvjax.models.export import save_hf
    from kvjax.models.model import DecoderLM

    with tempfile.TemporaryDirectory() as tmp:  # the model and both evals' folders, removed after
        model_dir = os.path.join(tmp, "model")
        vocab = save_char_tokenizer(model_dir)
        config = tiny_config(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, vocab_size=vocab,
                             max_position_embeddings=1024)
        save_hf(config, DecoderLM.random(config, seed=0, scale=0.3).weights(), model_dir)

        def predictions(tag: str, *extra: str) -> list[str]:
            cli.FLAGS.unparse_flags()
            cli.FLAGS(["kvjax.eval", f"--model={model_dir}", f"--output_dir={tmp}/{tag}", "--task=passkey",
                       "--context_length=320", "--max_samples=4", "--batch_size=4", "--method=snapkv", "--budget=48",
                       "--method_args=window_size=8", "--progress=false", *extra])
            cli.run(["kvjax.eval"])
            (run,) = [d for d in os.listdir(f"{tmp}/{tag}") if os.path.isfile(f"{tmp}/{tag}/{d}/predictions.jsonl")]
            with open(f"{tmp}/{tag}/{run}/predictions.jsonl") as f:
                return [json.loads(line)["prediction"] for line in f if line.strip()]

        ref = predictions("one")
        got = predictions("mesh", "--mesh=data:2,model:4")
        return [dict(method="cli:snapkv", mesh="2x4", ref=ref, got=got, cache_spec="", devices=8)]


if __name__ == "__main__":
    main()
