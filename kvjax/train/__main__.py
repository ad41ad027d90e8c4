"""`python -m kvjax.train`: train a small Llama on the synthetic long-context tasks and export it.

    python -m kvjax.train --workdir=runs/kvjax-tiny --export_dir=kvjax/assets/kvjax-tiny

Resumes from the latest orbax checkpoint in `--workdir`; at the end writes a standard Hugging Face
directory (config.json, model.safetensors, tokenizer files) to `--export_dir`.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags, logging

from kvjax.cli import parse
from kvjax.cli.refuse import refuse
from kvjax.errors import KvjaxError

FLAGS = flags.FLAGS
NAME = "kvjax.train"
_DEFAULTS = None


def _define_flags() -> None:
    from kvjax.train.loop import TrainConfig

    for field in dataclasses.fields(TrainConfig):
        default = field.default
        help_text = f"TrainConfig.{field.name} (default {default!r})."
        if isinstance(default, bool):
            flags.DEFINE_boolean(field.name, default, help_text)
        elif isinstance(default, int):
            flags.DEFINE_integer(field.name, default, help_text)
        elif isinstance(default, float):
            flags.DEFINE_float(field.name, default, help_text)
        elif isinstance(default, tuple):
            flags.DEFINE_list(field.name, [str(x) for x in default], help_text)
        else:
            flags.DEFINE_string(field.name, default, help_text)
    flags.DEFINE_string("export_dir", None, "Write the trained model here as a Hugging Face directory.")
    flags.DEFINE_enum("tokenizer", "bpe", ["bpe", "char"], "bpe: trained on generated task text; char: characters.")
    flags.DEFINE_integer("vocab_size", 2048, "BPE vocabulary size.")
    flags.DEFINE_boolean("progress", True, "Show a progress bar.")
    flags.DEFINE_boolean(
        "export_only", False, "Train nothing: export the latest checkpoint of --workdir (e.g. of a run in progress)."
    )


_define_flags()


def _tokenizer(cfg):
    """The run's tokenizer: saved in the workdir the first time, so a resumed run reuses it."""
    import os

    from kvjax._transformers import import_transformers
    from kvjax.models.char_tokenizer import build_char_tokenizer
    from kvjax.train.data import HELD_OUT_SEEDS
    from kvjax.train.tokenizer import task_corpus, train_bpe_tokenizer

    AutoTokenizer = import_transformers().AutoTokenizer  # noqa: N806
    path = os.path.join(cfg.workdir, "tokenizer")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    if cfg.init_from:
        from kvjax.models.presets import resolve_model_dir

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(cfg.init_from)), local_files_only=True)
    elif FLAGS.tokenizer == "char":
        tokenizer = build_char_tokenizer()
    else:
        tokenizer = train_bpe_tokenizer(task_corpus(cfg.tasks, seed=HELD_OUT_SEEDS + cfg.seed), FLAGS.vocab_size)
    tokenizer.save_pretrained(path)
    return tokenizer


def _list_flag(name: str, items: list[str], kind: type) -> tuple:
    """A list flag's items as `kind`; KvjaxError naming the flag and the item that is not one."""
    out = []
    for item in items:
        try:
            out.append(kind(item))
        except ValueError:
            what = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
            raise KvjaxError(f"--{name}: {item!r} is not {what} (got --{name}={','.join(items)})") from None
    return tuple(out)


def _check_init_from(path: str) -> None:
    """`--init_from` must name a local model directory (or a preset with local weights); never a hub id."""
    from kvjax.models.presets import resolve_model_dir

    try:
        resolve_model_dir(path)
    except KvjaxError as e:
        raise KvjaxError(f"--init_from={path}: no such directory ({e})") from None


def main(argv: list[str]) -> None:
    from kvjax.models.export import save_hf
    from kvjax.train.loop import TrainConfig, latest_checkpoint, train

    if not FLAGS["verbosity"].present:  # orbax / XLA INFO lines (~90 a run) would bury the progress bar
        logging.set_verbosity(logging.WARNING)
    try:
        values = {}
        for field in dataclasses.fields(TrainConfig):
            value = FLAGS[field.name].value
            if isinstance(field.default, tuple):
                value = _list_flag(field.name, value, type(field.default[0]) if field.default else str)
            values[field.name] = value
        cfg = TrainConfig(**values)
        if cfg.init_from:
            _check_init_from(cfg.init_from)
        if FLAGS.export_only:  # before the tokenizer, which may be trained and is written into the workdir
            if not FLAGS.export_dir:
                raise KvjaxError("--export_only needs --export_dir")
            if latest_checkpoint(cfg.workdir) is None:  # else the export is the untrained initial weights
                raise KvjaxError(f"--export_only: {cfg.workdir} holds no checkpoint to export (train there first, "
                                 "without --export_only)")
        tokenizer = _tokenizer(cfg)
        model, losses = train(cfg, tokenizer, progress=FLAGS.progress, stop_at=0 if FLAGS.export_only else None)
        if FLAGS.export_dir:
            save_hf(model.config, model.weights(), FLAGS.export_dir)
            tokenizer.save_pretrained(FLAGS.export_dir)
            print(f"exported to {FLAGS.export_dir}")
    except KvjaxError as e:
        refuse(NAME, e)


def _parse_flags(argv: list[str]) -> list[str]:
    return parse.parse_flags(FLAGS, argv, NAME)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
