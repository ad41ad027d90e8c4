"""Training smoke test: 20 steps, resume from the orbax checkpoint with identical losses, export, reload."""

import numpy as np
import pytest

from kvjax.models.char_tokenizer import build_char_tokenizer
from kvjax.train.loop import TrainConfig, train


def _cfg(workdir):
    return TrainConfig(
        workdir=str(workdir), steps=20, batch_size=2, learning_rate=3e-3, warmup_steps=4, lengths=(320,),
        curriculum_steps=0, tasks=("passkey",), checkpoint_every=10, log_every=5, hidden_size=32,
        intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, max_position_embeddings=1024,
    )


def test_train_resume_export_reload(tmp_path):
    tok = build_char_tokenizer()
    model, straight = train(_cfg(tmp_path / "a"), tok, progress=False)
    assert len(straight) == 20 and np.all(np.isfinite(straight))
    assert np.mean(straight[-5:]) < np.mean(straight[:5])  # it learns something

    _, first = train(_cfg(tmp_path / "b"), tok, progress=False, stop_at=10)
    _, second = train(_cfg(tmp_path / "b"), tok, progress=False)  # resumes at step 10
    assert len(first) == 10 and len(second) == 10
    np.testing.assert_allclose(first + second, straight, rtol=1e-5, atol=1e-6)

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
