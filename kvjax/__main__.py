"""`python -m kvjax`: the commands kvjax installs, a line each (each takes `--help`)."""

from __future__ import annotations

import sys

from kvjax.cli.refuse import refused

#: Every `python -m` entry point, in the order a user meets them, with what it does.
COMMANDS = {
    "kvjax.eval": "evaluate methods on long-context tasks (sweeps, resumable results; docs/eval.md)",
    "kvjax.eval.report": "tables and plots from eval results; --compare diffs two result folders",
    "kvjax.eval.leaderboard": "the score-vs-compression-ratio leaderboard from eval results (docs/leaderboard.md)",
    "kvjax.eval.archive": "pack a leaderboard panel's run folders into one .runs.tar.xz",
    "kvjax.run": "a file of prompts through the continuous-batching engine, JSONL out (docs/engine.md)",
    "kvjax.calibrate": "the learned methods' per-model files: Q-Filters, KVzap, DuoAttention, ExpectedAttention stats",
    "kvjax.models.gguf_assemble": "find or assemble a GGUF preset's file (SmolLM2-135M, Gemma 3 270M)",
    "kvjax.demo": "a short generation demo with compressed caches on a random tiny model",
    "kvjax.train": "train a small Llama on the synthetic tasks and export it",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args not in (["-h"], ["--help"]):
        meant = f"kvjax.{args[0]}"
        example = f"python -m {meant} --help" if meant in COMMANDS else "python -m kvjax.eval --help"
        return refused("kvjax", f"takes no arguments, got {' '.join(args)!r}; a command runs as "
                                f"python -m kvjax.<command>, e.g. {example}")
    width = max(map(len, COMMANDS))
    print("kvjax's commands (python -m <command> --help for each):")
    for command, what in COMMANDS.items():
        print(f"  {command:<{width}}  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
