"""What kvjax's command lines share: the flags naming a model, a method and its amount, the cache's storage and
the mesh (`kvjax.cli.flags`), the pure parsers of their values (`kvjax.cli.parse`), the checks of the places they
write (`kvjax.cli.paths`) and the one line, exit code 2, with which every one of them refuses bad input
(`kvjax.cli.refuse`).

`python -m kvjax.eval` defines them with `flags.define_shared()`; another entry point defines the same ones (with the
same help and parsing) and reads them with `flags.read_shared(FLAGS)` into a frozen `flags.Shared`.
"""
