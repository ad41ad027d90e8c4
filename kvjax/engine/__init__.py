"""Continuous batching over compressed caches: a fixed number of decode slots, each holding one request's cache
at the method's capacity (docs/engine.md).

    from kvjax.engine import Engine, Request
    engine = Engine(model, method="snapkv", method_args={"budget": 256}, max_prompt_tokens=4096,
                    max_new_tokens=512)
    for done in engine.run([Request(id=i, tokens=ids, max_new_tokens=64) for i, ids in enumerate(prompts)]):
        print(done.id, done.tokens)

The loop: decode `steps` tokens for every live slot in one jitted call (each slot's own limit and stop ids),
retire the finished, prefill waiting requests (the runtime's prefill stages, oldest first, as many as there are
free slots) and insert their caches with one jitted, donated insert. `python -m kvjax.run` runs a file of
prompts through it.
"""

from kvjax.engine.engine import Engine, Progress
from kvjax.engine.request import Completion, Request

__all__ = ["Completion", "Engine", "Progress", "Request"]
