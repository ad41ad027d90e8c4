"""Training smoke test: 20 steps, resume from the orbax checkpoint with identical losses, export, reload."""

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from kvjax.models.char_tokenizer import build_char_tokenizer
from kvjax.train.loop import TrainConfig, train


def _cfg(workdir):
    return TrainConfig(
        workdir=str(workdir), steps=20, batch_size=2, learning_rate=3e-3, warmup_steps=4, lengths=(320,),
        curriculum_steps=0, tasks=("passkey",), checkpoint_every=10, log_every=5, hidden_size=32,
        intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, max_position_embeddings=1024,
        tokens_per_batch=0, position_span=1024,
    )


def test_train_resume_export_reload(tmp_path, capsys):
    tok = build_char_tokenizer()
    model, straight = train(_cfg(tmp_path / "a"), tok, progress=False)
    assert len(straight) == 20 and np.all(np.isfinite(straight))
    assert np.mean(straight[-5:]) < np.mean(straight[:5])  # it learns something
    again, none = train(_cfg(tmp_path / "a"), tok, progress=False)  # a finished workdir relaunched
    assert none == [] and "nothing to train" in capsys.readouterr().err
    np.testing.assert_array_equal(again.weights()["embed"], model.weights()["embed"])

    _, first = train(_cfg(tmp_path / "b"), tok, progress=False, stop_at=10)
    _, second = train(_cfg(tmp_path / "b"), tok, progress=False)  # resumes at step 10
    assert len(first) == 10 and len(second) == 10
    np.testing.assert_allclose(first + second, straight, rtol=1e-5, atol=1e-6)
    launches = [json.loads(line) for line in (tmp_path / "b" / "runs.jsonl").read_text().splitlines()]
    assert [r["start_step"] for r in launches] == [0, 10]  # each launch that trains, with its config
    assert launches[1]["config"] == json.loads(json.dumps(dataclasses.asdict(_cfg(tmp_path / "b"))))
    logged = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [5, 10, 15, 20]  # the loss curve survives the restart
    np.testing.assert_allclose([r["loss"] for r in logged], np.reshape(straight, (4, 5)).mean(1), rtol=1e-5)

    import kvjax
    from kvjax.models.export import save_hf

    out = save_hf(model.config, model.weights(), tmp_path / "export")
    tok.save_pretrained(out)
    reloaded = kvjax.load_model(out, dtype="float32")
    ids = np.asarray([tok.encode("The pass key is 12345.")])
    np.testing.assert_allclose(np.asarray(reloaded(ids)[0]), np.asarray(model(ids)[0]), atol=1e-6)
    assert kvjax.load_tokenizer(out).decode(ids[0], skip_special_tokens=True) == "The pass key is 12345."

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(out)
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)[0]), ref, atol=1e-4)


def test_an_older_layout_checkpoint_is_refused_with_one_clear_error(tmp_path):
    """A workdir checkpointed by kvjax before per-layer weights (`layers.<name>` arrays with a leading layer
    axis), or before the fused projections (separate q / k / v, gate / up), does not restore into today's
    weights: one CheckpointError naming the workdir and what to do."""
    import orbax.checkpoint as ocp

    from kvjax.errors import CheckpointError
    from kvjax.train.loop import _checkpointer

    def saved_at_step_10(name: str, weights: dict):
        cfg = _cfg(tmp_path / name)
        manager = _checkpointer(cfg.workdir)
        manager.save(10, args=ocp.args.StandardSave({"weights": weights, "opt_state": {"count": np.int32(10)}}))
        manager.wait_until_finished()
        manager.close()
        return cfg

    cfg = saved_at_step_10("old", {"embed": np.zeros((4, 32), np.float32),
                                   "layers.q": np.zeros((2, 32, 2, 16), np.float32)})
    with pytest.raises(CheckpointError, match=r"old: the checkpoint at step 10 holds stacked layer weights "
                                              r"\(layers\.q, \.\.\.\).*new --workdir"):
        train(cfg, build_char_tokenizer(), progress=False)

    # per-layer weights, but q / k / v and gate / up apart (before the fusion)
    cfg = saved_at_step_10("unfused", {"embed": np.zeros((4, 32), np.float32), "layers": (
        {"q": np.zeros((32, 2, 16), np.float32), "gate": np.zeros((32, 8), np.float32)},)})
    with pytest.raises(CheckpointError, match=r"unfused: the checkpoint at step 10 holds separate q / k / v .*"
                                              r"new --workdir"):
        train(cfg, build_char_tokenizer(), progress=False)


def test_a_checkpoint_of_another_architecture_is_refused_naming_a_weight(tmp_path):
    """A workdir resumed with other architecture flags (here --hidden_size) ended in orbax's restore traceback,
    which suggests truncating the stored arrays; one CheckpointError names the first weight that differs."""
    import orbax.checkpoint as ocp

    from kvjax.errors import CheckpointError
    from kvjax.models.model import DecoderLM
    from kvjax.train.loop import _checkpointer, make_optimizer

    tok, cfg = build_char_tokenizer(), _cfg(tmp_path / "run")
    wider = dataclasses.replace(cfg, hidden_size=64).model_config(len(tok), tok.eos_token_id, tok.bos_token_id,
                                                                   tok.pad_token_id)
    weights = DecoderLM.random(wider).weights()
    manager = _checkpointer(cfg.workdir)
    manager.save(10, args=ocp.args.StandardSave({"weights": weights, "opt_state": make_optimizer(cfg).init(weights)}))
    manager.wait_until_finished()
    manager.close()
    with pytest.raises(CheckpointError, match=re.escape(
            f"run: the checkpoint at step 10 holds weights of another architecture (weights['embed']: "
            f"({len(tok)}, 64) stored, ({len(tok)}, 32) with these flags); resume with the flags it was trained with")):
        train(cfg, tok, progress=False)


def test_bpe_tokenizer_round_trips_and_splits_digits(tmp_path):
    from transformers import AutoTokenizer

    from kvjax.train.tokenizer import task_corpus, train_bpe_tokenizer

    corpus = task_corpus(["passkey", "ruler/niah_single_1"], samples_per_task=2, length_chars=2000)
    train_bpe_tokenizer(corpus, vocab_size=400).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "The pass key is 90210.\nRemember it: grumpy-cat 7!"
    ids = loaded.encode(text)
    assert ids[0] == loaded.bos_token_id and loaded.decode(ids, skip_special_tokens=True) == text
    pieces = loaded.convert_ids_to_tokens(ids)
    assert [p for p in pieces if p.isdigit()] == list("902107")  # one token per digit
    assert len(ids) < 0.7 * len(text)  # merged pieces, not characters


def test_bpe_tokenizer_spells_variable_names_letter_by_letter(tmp_path):
    """Merges of capital letters would make the corpus's own variable names single tokens that a model
    trained on other names never saw; only `VAR` stays whole. The tokenizer corpus never uses the
    evaluation's seeds."""
    import random
    import string

    from kvjax.train.data import HELD_OUT_SEEDS
    from kvjax.train.tokenizer import task_corpus, train_bpe_tokenizer

    with pytest.raises(ValueError, match="held out"):
        task_corpus(["ruler/vt"], seed=0)
    corpus = task_corpus(["ruler/vt", "drill/vt"], samples_per_task=4, length_chars=3000)
    other = task_corpus(["ruler/vt"], samples_per_task=4, length_chars=3000, seed=HELD_OUT_SEEDS + 1)
    assert corpus and other != corpus[: len(other)]
    tok = train_bpe_tokenizer(corpus * 4, vocab_size=600)
    names = [n for text in corpus for n in re.findall(r"VAR ([A-Z]{5}) =", text)]
    rng = random.Random(0)
    names += ["".join(rng.choice(string.ascii_uppercase) for _ in range(5)) for _ in range(50)]
    for name in names:
        pieces = tok.convert_ids_to_tokens(tok.encode(f"VAR {name} = VAR {name}.", add_special_tokens=False))
        assert pieces[0] == "VAR" and "\u0120VAR" in pieces
        assert _spelt(pieces[1 : pieces.index("\u0120=")], name), pieces


def test_shipped_tokenizer_spells_the_evaluations_variable_names():
    """The shipped kvjax-tiny tokenizer (repaired with `drop_capital_merges`; it had been trained on seed-0
    task text) spells every vt name of the evaluation's seeds letter by letter."""
    import kvjax
    from kvjax.eval import tasks
    from kvjax.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(Path(kvjax.__file__).parent / "assets" / "kvjax-tiny"))
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    for seed in (0, 1):
        for sample in tasks.get("ruler/vt").samples(count_tokens=count, context_length=1024, num_samples=20,
                                                    seed=seed, data_dir=None):
            for name in sample.answers:
                assert _spelt(tok.convert_ids_to_tokens(tok.encode(" " + name, add_special_tokens=False)), name)


def _spelt(pieces: list[str], name: str) -> bool:
    """`name` in one token per letter, but for the merges that build `VAR` (`VA` in `KVAXB` stays)."""
    return "".join(pieces) == "\u0120" + name and all(len(p.lstrip("\u0120")) <= 1 or p in "VAR" for p in pieces)


def test_train_logits_equal_the_inference_forward():
    """The tiled training attention is the model's attention: same logits as `transformer.forward`."""
    import jax.numpy as jnp

    from kvjax.models import transformer
    from kvjax.models.model import DecoderLM
    from kvjax.train.loop import train_logits

    cfg = TrainConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    config = cfg.model_config(vocab_size=50, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = DecoderLM.random(config, seed=3, dtype=jnp.float32, scale=0.2)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 50, (2, 40)), jnp.int32)
    # Jumping positions, and a padded tail in the second row.
    positions = np.cumsum(rng.integers(1, 30, (2, 40)), axis=1).astype(np.int32)
    positions[1, 31:] = -1
    positions = jnp.asarray(positions)
    got = train_logits(config, model.weights(), model.rope(), tokens, positions)
    want = transformer.forward(config, model.weights(), model.rope(), tokens, positions)
    np.testing.assert_allclose(np.asarray(got)[0], np.asarray(want)[0], atol=2e-5)
    np.testing.assert_allclose(np.asarray(got)[1, :31], np.asarray(want)[1, :31], atol=2e-5)


def _numpy_causal_attention(q, k, v, valid):
    """Naive float64 reference: every query row against every earlier valid key (GQA by repetition)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    groups = n // k.shape[2]
    out = np.zeros_like(q)
    for i in range(b):
        for head in range(n):
            kh, vh = k[i, :, head // groups], v[i, :, head // groups]
            for row in range(t):
                seen = [j for j in range(row + 1) if valid[i, j]]
                s = kh[seen] @ q[i, row, head] / np.sqrt(h)
                p = np.exp(s - s.max())
                out[i, row, head] = (p / p.sum()) @ vh[seen]
    return out


@pytest.mark.parametrize("block", [16, 40, 128])
def test_tiled_training_attention_matches_numpy_and_dense_gradients(block):
    """Triangular tiles (here 3 with a ragged last one, or one) give the dense causal attention and its grads."""
    import jax
    import jax.numpy as jnp

    from kvjax.train.loop import _causal_attention

    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 40, heads, 8)), jnp.float32) for heads in (4, 2, 2))
    valid = np.ones((2, 40), bool)
    valid[1, 29:] = False  # a padded tail
    got = np.asarray(_causal_attention(q, k, v, jnp.asarray(valid), block=block))
    want = _numpy_causal_attention(q, k, v, valid)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    np.testing.assert_allclose(got[1, :29], want[1, :29], atol=1e-5)

    def total(fn):
        return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, jnp.asarray(valid)))), argnums=(0, 1, 2))(q, k, v)

    tiled = total(lambda *a: _causal_attention(*a, block=block))
    dense = total(lambda *a: _causal_attention(*a, block=40))  # one tile: the whole square
    for a, b in zip(tiled, dense, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_position_jumps_keep_order_and_span():
    from kvjax.train.data import TaskMixture

    mix = TaskMixture(build_char_tokenizer(), task_names=("passkey",), position_jump_prob=1.0, position_span=5000)
    rng = np.random.default_rng(1)
    spans = []
    for _ in range(50):
        pos = mix.positions(rng, 300)
        steps = np.diff(pos)
        assert pos[0] == 0 and np.all(steps >= 1) and pos[-1] < 5000
        assert np.sum(steps > 1) <= 16  # jumps at a few places; local distances intact elsewhere
        spans.append(pos[-1])
    assert max(spans) > 2500  # long distances are seen
    never = TaskMixture(build_char_tokenizer(), task_names=("passkey",), position_jump_prob=0.0, position_span=5000)
    np.testing.assert_array_equal(never.positions(rng, 300), np.arange(300))


def test_tokens_per_batch_sets_rows_per_length(tmp_path):
    from kvjax.errors import ConfigError

    cfg = TrainConfig(tokens_per_batch=4096, lengths=(256, 1024))
    assert (cfg.rows(256), cfg.rows(1024), cfg.rows(8192)) == (16, 4, 1)
    assert TrainConfig(tokens_per_batch=0, batch_size=3).rows(1024) == 3
    with pytest.raises(ConfigError, match="position_span"):
        TrainConfig(position_span=20000, max_position_embeddings=16384)
    with pytest.raises(ConfigError, match="position_jump_prob"):
        TrainConfig(position_jump_prob=1.5)


def test_training_never_uses_the_evaluation_seeds(monkeypatch):
    """Held-out evaluation: task seeds below HELD_OUT_SEEDS (the eval CLI uses --seed=0) never occur in training."""
    import zlib

    from kvjax.train import data

    mix = data.TaskMixture(build_char_tokenizer(), task_names=("passkey",))
    seeds = [mix.sample_seed(step, i) for step in range(3000) for i in range(32)]
    assert min(seeds) >= data.HELD_OUT_SEEDS
    monkeypatch.setattr(data.zlib, "crc32", lambda b: 7 if b == b"0/5/1" else zlib.crc32(b))
    assert mix.sample_seed(5, 1) == 7 + data.HELD_OUT_SEEDS


def test_copy_examples_repeat_a_segment_and_train_on_the_repeats():
    from kvjax.train.data import TaskMixture

    tok = build_char_tokenizer()
    mix = TaskMixture(tok, task_names=("passkey",), lengths=(200,), copy_prob=0.99)
    pool = set(mix._copy_vocab.tolist())
    assert set(tok.encode("0123456789", add_special_tokens=False)) <= pool  # the digits the tasks copy
    batch = mix.batch(0, 6, 200)
    copies = 0
    for tokens, mask in zip(batch.tokens, batch.loss_mask, strict=True):
        first = int(np.argmax(mask))
        if mask.sum() < 100:
            continue  # a task example (copy_prob < 1)
        copies += 1
        period = first  # tokens[1..period] is the segment, then it repeats
        assert tokens[0] == tok.bos_token_id and 8 <= period <= 64
        np.testing.assert_array_equal(tokens[1 + period :], tokens[1 : 200 - period])
        assert set(tokens[1:].tolist()) <= pool
        assert np.all(mask[first:199] == 1) and mask[:first].sum() == 0
    assert copies >= 4


def test_shuffled_answers_keep_the_values_and_change_only_their_order():
    from kvjax.errors import ConfigError
    from kvjax.eval import tasks
    from kvjax.train.data import TaskMixture

    tok = build_char_tokenizer()
    name = "ruler/niah_multivalue"
    plain = TaskMixture(tok, task_names=[name], lengths=(1200,))
    mixed = TaskMixture(tok, task_names=[name], lengths=(1200,), shuffle_answers=[name])
    reordered = 0
    for index in range(6):
        key = plain.sample_seed(0, index)
        sample = tasks.get(name).samples(count_tokens=plain._count, context_length=1200, num_samples=1,
                                         seed=key, data_dir=None)[0]
        (ids, [(n, _)]), (ids_mixed, [(n_mixed, _)]) = plain.example(0, index, 1200), mixed.example(0, index, 1200)
        assert ids[:n] == ids_mixed[:n_mixed]  # the same prompt
        in_order = tok.decode(ids[n:], skip_special_tokens=True).strip().split(", ")
        shuffled = tok.decode(ids_mixed[n_mixed:], skip_special_tokens=True).strip().split(", ")
        assert in_order == list(sample.answers) and sorted(shuffled) == sorted(sample.answers)
        reordered += shuffled != in_order
    assert reordered >= 3
    with pytest.raises(ConfigError, match="passkey"):
        TaskMixture(tok, task_names=[name], lengths=(1200,), shuffle_answers=["passkey"])


def test_a_misspelt_shuffle_answers_task_is_refused(tmp_path):
    from kvjax.errors import ConfigError

    cfg = dataclasses.replace(_cfg(tmp_path), shuffle_answers=("ruler/niah_multivalu",))
    with pytest.raises(ConfigError, match="did you mean ruler/niah_multivalue"):
        train(cfg, build_char_tokenizer(), progress=False)
    assert not (tmp_path / "checkpoints").exists()


def test_prefetching_workers_build_the_same_batches(tmp_path):
    """Batches built ahead by worker processes are the ones built inline: a batch depends on (seed, step)."""
    from kvjax.train.data import BatchPrefetcher, TaskMixture

    mix = TaskMixture(build_char_tokenizer(), task_names=("passkey", "ruler/niah_single_1"), lengths=(320, 480),
                      seed=3, position_jump_prob=0.5, position_span=1024, copy_prob=0.2)
    rows = lambda length: 960 // length  # noqa: E731
    inline = BatchPrefetcher(mix, rows)
    ahead = BatchPrefetcher(mix, rows, workers=2)
    try:
        widths = set()
        for step in range(6):
            want, got = inline.batch(step, 6), ahead.batch(step, 6)
            widths.add(want.tokens.shape)
            for field in ("tokens", "positions", "loss_mask"):
                np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
        assert len(widths) == 2  # both lengths (and so both batch sizes) came up
    finally:
        ahead.close()
    with pytest.raises(Exception, match="data_workers"):
        dataclasses.replace(_cfg(tmp_path), data_workers=-1)
