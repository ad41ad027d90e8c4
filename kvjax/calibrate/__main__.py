"""Make the per-model files of the learned methods for a model kvjax runs, from calibration text of kvjax's own
synthetic tasks (nothing downloaded):

    python -m kvjax.calibrate --method=qfilter --model=kvjax-tiny --out=DIR
    python -m kvjax.calibrate --method=kvzap,duo_attention --model=smollm2-135m --out=DIR --samples=16

Writes, in the layouts the methods read: `DIR/<model>_qfilt` (`qfilter`'s `filters=`), `DIR/kvzap-linear` and
`DIR/kvzap-mlp` (`kvzap`'s `weights=`, with `model_type="linear"` / `"mlp"`), `DIR/duo_attention`
(`duo_attention`'s `patterns=`), `DIR/expected_attention_stats` (`expected_attention_stats`'s `stats=`). The same
arguments write the same bytes (fixed seed, float32 on one machine).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from kvjax.chat import CHAT_TEMPLATE_SETTINGS, ChatTemplateError, use_chat_template
from kvjax.cli import paths
from kvjax.cli.refuse import ArgumentParser, refused
from kvjax.errors import KvjaxError

METHODS = ("qfilter", "kvzap", "duo_attention", "expected_attention_stats")
#: Defaults per method: (samples, context_length). Q-Filters: the official script's 2048-token sequences (19 of
#: them there); KVzap: the official 750-1250-token texts; DuoAttention: kvpress's 50 texts; Expected Attention's
#: statistics: kvpress's are 100 texts cut to 1,000 characters (about 250 tokens), here fewer, longer prompts.
DEFAULTS = {"qfilter": (16, 2048), "kvzap": (16, 1024), "duo_attention": (16, 1024),
            "expected_attention_stats": (16, 1024)}


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m kvjax.calibrate", description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--method", required=True,
                        help=f"comma list of {', '.join(METHODS)} (each writes its own subdirectory of --out)")
    parser.add_argument("--model", required=True, help="a kvjax preset name (kvjax-tiny, smollm2-135m) or a local "
                        "Hugging Face model directory")
    parser.add_argument("--model_dir", default=None, help="where presets' directories live (as kvjax.eval)")
    parser.add_argument("--out", required=True, help="output directory (created; the files inside are replaced)")
    parser.add_argument("--samples", type=int, default=None, help="calibration prompts (default per method: "
                        + ", ".join(f"{m} {s}" for m, (s, _) in DEFAULTS.items()) + ")")
    parser.add_argument("--context_length", type=int, default=None, help="tokens per calibration prompt (default: "
                        + ", ".join(f"{m} {n}" for m, (_, n) in DEFAULTS.items()) + ")")
    parser.add_argument("--seed", type=int, default=1234, help="seed (>= 0) of the calibration prompts and of the "
                        "sampled positions (default 1234; evaluation prompts use seed 0)")
    parser.add_argument("--chat_template", choices=CHAT_TEMPLATE_SETTINGS, default="auto",
                        help="kvzap: wrap KVzip's repeat prompt in the tokenizer's chat template (auto: when the "
                        "tokenizer has one; the eval's --chat_template, which the calibrated model is then run with)")
    parser.add_argument("--kvzap_hidden_dim", type=int, default=None, help="hidden size of the KVzap-MLP "
                        "surrogate (default 512, the official training's)")
    parser.add_argument("--kvzap_epochs", type=int, default=None, help="training epochs of the KVzap-MLP surrogate "
                        "(default 15, the official training's)")
    return parser


def _check(args: argparse.Namespace) -> list[str]:
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise KvjaxError(f"--method={args.method!r}: unknown {', '.join(unknown) or 'empty'}; give one or more of "
                         f"{', '.join(METHODS)}")
    for flag in ("samples", "context_length", "kvzap_hidden_dim", "kvzap_epochs"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise KvjaxError(f"--{flag} must be > 0, got {value}")
    if args.seed < 0:  # NumPy's generators take no negative seed: a traceback after the model loaded
        raise KvjaxError(f"--seed must be >= 0, got {args.seed}")
    if args.context_length is not None and args.context_length < 16:
        raise KvjaxError(f"--context_length={args.context_length} is too short for a calibration prompt (>= 16)")
    paths.output_folder("out", args.out)
    return methods


def run(args: argparse.Namespace) -> list[pathlib.Path]:
    """Validates the arguments, loads the model and writes each method's files; returns their directories."""
    methods = _check(args)
    from kvjax.calibrate import activations, duo_attention, expected_attention_stats, kvzap, qfilter
    from kvjax.models.model import load_model
    from kvjax.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model, model_dir=args.model_dir)
    layout = _repeat_layout(tokenizer, args.chat_template) if "kvzap" in methods else None
    model = load_model(args.model, dtype="float32", model_dir=args.model_dir)
    name = args.model.rstrip("/").split("/")[-1]
    out = pathlib.Path(args.out)
    for method in methods:  # every method's length, before the first one runs
        check_length(args, method, model.config.max_position_embeddings, layout)
    written = []
    for method in methods:
        samples = args.samples or DEFAULTS[method][0]
        length = args.context_length or DEFAULTS[method][1]
        print(f"{method}: drawing {samples} calibration prompts of {length} tokens from kvjax's synthetic tasks",
              file=sys.stderr)
        prompts = activations.calibration_tokens(tokenizer, samples, length, args.seed,
                                                 special_tokens=method != "kvzap")  # kvzap: contexts, templated later
        with _progress(method, len(prompts)) as bar:
            if method == "kvzap":
                mlp = {k: v for k, v in (("hidden_dim", args.kvzap_hidden_dim), ("epochs", args.kvzap_epochs)) if v}
                written += kvzap.calibrate(model, prompts, layout, out, seed=args.seed, progress=bar.update, **mlp)
            else:
                calibrate = {"qfilter": qfilter.calibrate, "duo_attention": duo_attention.calibrate,
                             "expected_attention_stats": expected_attention_stats.calibrate}[method]
                written.append(calibrate(model, prompts, out, model_name=name, seed=args.seed, progress=bar.update))
    return written


def _repeat_layout(tokenizer: Any, chat_template: str) -> tuple[list[int], list[int]]:
    """KVzap's repeat prompt layout (`kvzap.repeat_layout`) under `--chat_template`, before the weights load: a chat
    template that cannot lay out a user message is one line naming the flag that turns it off."""
    from kvjax.calibrate import kvzap

    try:
        return kvzap.repeat_layout(tokenizer, use_chat_template(tokenizer, chat_template))
    except ChatTemplateError as e:
        raise KvjaxError(f"kvzap's repeat prompt: {e}; pass --chat_template=no") from None


def check_length(args: argparse.Namespace, method: str, max_positions: int, layout: tuple | None) -> None:
    """KvjaxError when `method`'s calibration forward (its prompt; KVzap's: the context twice in KVzip's repeat prompt)
    is longer than the model's maximum context, naming the longest `--context_length` that fits."""
    length = args.context_length or DEFAULTS[method][1]
    flag = f"--context_length={length}" if args.context_length else f"{method}'s default --context_length={length}"
    if method == "kvzap":
        extra = len(layout[0]) + len(layout[1])
        if 2 * length + extra > max_positions:
            raise KvjaxError(
                f"{flag}: kvzap reads each context twice in KVzip's repeat prompt, 2 x {length} + {extra} tokens, "
                f"beyond the model's maximum context of {max_positions}; give --context_length <= "
                f"{(max_positions - extra) // 2}")
    elif length > max_positions:
        raise KvjaxError(f"{flag} exceeds the model's maximum context of {max_positions} tokens ({method}); give "
                         f"--context_length <= {max_positions}")


def _progress(method: str, total: int):
    """A progress bar on stderr over `method`'s calibration prompts (one step per forward)."""
    from tqdm import tqdm

    # every forward shown (`mininterval=0`): a forward can take less than tqdm's 0.1 s refresh (a warm program)
    return tqdm(total=total, desc=f"{method}: forward", unit="prompt", file=sys.stderr, leave=False, mininterval=0)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        run(args)
    except KvjaxError as e:
        return refused("kvjax.calibrate", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
