"""Run by `test_pallas_sharded.py` in a subprocess with 8 forced CPU devices (XLA_FLAGS must be set before
JAX starts). One JSON line out, a list of checks `{case, mesh, ok, error, ...}`.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/pallas/sharded_kernels_worker.py ops
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/pallas/sharded_kernels_worker.py generate

`ops`: every kernel-backed op with `implementation="pallas"` (interpret mode) under meshes 2x4, 8x1 and 1x4
(and 1x8, which does not divide the 4 KV heads: heads run whole on every device) against the
single-device XLA result; `per_shard` says whether each `pallas_call` of the traced program sits inside a
`shard_map`, `shard_shapes` gives the per-shard shape of every `shard_map`'s first operand.
`generate`: greedy tokens with every op forced to its kernel, 2x4 mesh against one device.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from pallas_cases import assert_close, make_cache  # noqa: E402

from kvjax import cache as kvc  # noqa: E402
from kvjax import tuning  # noqa: E402
from kvjax.methods.quest import page_bounds  # noqa: E402
from kvjax.ops import _impl, _shard, attention, blocks, fused_decode, gather, scoring, select  # noqa: E402
from kvjax.runtime import sharding  # noqa: E402

B, K, G, C, H, T = 8, 4, 2, 40, 16, 12
PAGE, NB = 4, 9  # Quest page size; memory blocks of the block-retrieval representatives
N = K * G
MESHES = {"2x4": (2, 4), "8x1": (8, 1), "1x4": (1, 4), "1x8": (1, 8)}
REPLICATED_ONLY = ("decode_attention",)  # cases also run on 1x8 (model does not divide K)


def _inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, C + 1, (B, K))
    lengths[1, 2] = 0  # an empty head
    lengths[3] = C
    cache = make_cache(rng, lengths, C, H)
    k, v, pos, stored = cache.arrays(jnp.float32, poisoned=False)
    q_pos = np.stack([np.arange(C - T, C)] * B).astype(np.int32)
    q_pos[2, -5:] = -1  # right padding
    q_pos[5] = np.arange(4, 4 + T)
    return dict(
        rng=rng, k=k, v=v, pos=pos, stored=stored, lengths=lengths,
        q=jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32), q_pos=jnp.asarray(q_pos),
        q1=jnp.asarray(rng.standard_normal((B, N, H)), jnp.float32),
        q1_pos=jnp.asarray(np.where(np.arange(B) == 6, -1, C - 1 - np.arange(B)), jnp.int32),
        head_valid=jnp.asarray(np.asarray(stored)[:, :, None, :] & (rng.random((B, K, G, C)) > 0.3)),
        scale=jnp.asarray(rng.uniform(0.1, 0.4, (B, T)), jnp.float32),
        scores=jnp.asarray(rng.integers(0, 5, (B, K, C)), jnp.float32),  # few values: many ties
        q_scores=jnp.asarray(rng.standard_normal((B, N, C)), jnp.float32),
        protect=jnp.asarray(rng.random((B, K, C)) > 0.9),
        budget=jnp.asarray(rng.integers(0, C, (B, K)), jnp.int32),
        rep=jnp.asarray(rng.standard_normal((B, NB, N * H)), jnp.float32),
        formed=jnp.asarray(np.r_[NB, 0, rng.integers(0, NB + 1, B - 2)], jnp.int32),
        k_new=jnp.asarray(rng.standard_normal((B, 1, K, H)), jnp.float32),
        v_new=jnp.asarray(rng.standard_normal((B, 1, K, H)), jnp.float32),
    )


def _cases(x: dict) -> dict[str, tuple[Callable, str]]:
    """name -> (fn(implementation) -> outputs, how to compare)."""
    k, v, pos, stored = x["k"], x["v"], x["pos"], x["stored"]
    cache = kvc.init(B, K, C, H, jnp.float32, score=True, attend=True).replace(
        k=k, v=v, pos=pos, length=jnp.asarray(x["lengths"], jnp.int32), score=x["scores"] * 0.5,
        attend=stored & x["protect"])
    lo, hi = page_bounds(k, stored, PAGE)  # Quest's page summaries, [B, K, P, H]
    pages = jnp.asarray(-(-x["lengths"] // PAGE), jnp.int32)
    q_pages = x["q1"].reshape(B, K, G, H)
    plain = kvc.init(B, K, C, H, jnp.float32).replace(k=k, v=v, pos=pos, length=jnp.asarray(x["lengths"], jnp.int32))
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(H // 2, dtype=jnp.float32) / (H // 2)))
    return {
        "decode_append_attention": (lambda impl: fused_decode.decode_append_attention(
            x["q1"][:, None], x["k_new"], x["v_new"], x["q1_pos"][:, None] + 1, plain, inv_freq=inv_freq,
            sliding_window=30, implementation=impl), "close"),
        "decode_attention": (lambda impl: attention.decode_attention(
            x["q1"], x["q1_pos"], k, v, pos, stored, return_weights=True, implementation=impl), "close"),
        "decode_attention[per-query-head,window]": (lambda impl: attention.decode_attention(
            x["q1"], x["q1_pos"], k, v, pos, x["head_valid"], sliding_window=9, implementation=impl), "close"),
        "window_scores[mean,scale]": (lambda impl: scoring.window_scores(
            x["q"], x["q_pos"], k, pos, stored, window=5, row_reduce="mean", scale=x["scale"],
            implementation=impl), "close"),
        "window_scores[per-query-head]": (lambda impl: scoring.window_scores(
            x["q"], x["q_pos"], k, pos, stored, window=1, group_reduce=None, implementation=impl), "close"),
        "accumulated_scores[max]": (lambda impl: scoring.accumulated_scores(
            x["q"], x["q_pos"], k, pos, stored, group_reduce="max", implementation=impl), "close"),
        "pool1d[avg]": (lambda impl: scoring.pool1d(x["scores"], 5, "avg", valid=stored, implementation=impl),
                        "close"),
        "pool1d[max,2d]": (lambda impl: scoring.pool1d(
            x["scores"][:, 0], 3, "max", valid=stored[:, 0], implementation=impl), "finite"),
        "topk_keep": (lambda impl: select.topk_keep(
            x["scores"], stored, x["budget"], capacity=24, protect=x["protect"], positions=pos,
            implementation=impl), "select"),
        "topk_keep[per-query-head]": (lambda impl: select.topk_keep(
            x["q_scores"], select.to_query_heads(stored, G), x["budget"][:, 0], capacity=16,
            implementation=impl), "select"),
        "keep_top[topk+gather]": (lambda impl: gather.keep_top(
            cache, x["scores"], x["budget"], capacity=24, protect=x["protect"], implementation=impl), "cache"),
        "page_scores[mean,live]": (lambda impl: blocks.page_scores(
            q_pages, lo, hi, num_pages=pages, group_reduce="mean", implementation=impl), "close"),
        "page_scores[per-query-head]": (lambda impl: blocks.page_scores(
            q_pages, lo, hi, implementation=impl), "close"),
        "representative_scores[cosine,live]": (lambda impl: blocks.representative_scores(
            x["q1"].reshape(B, N * H), x["rep"], num_blocks=x["formed"], kind="cosine", implementation=impl),
            "close"),
        "representative_scores[dot]": (lambda impl: blocks.representative_scores(
            x["q1"].reshape(B, N * H), x["rep"], implementation=impl), "close"),
    }


def _compare(got, want, how: str) -> None:
    if how == "close":
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert_close(g, w, jnp.float32)
    elif how == "finite":  # max pooling over an empty row stays -inf in both
        g, w = np.asarray(got), np.asarray(want)
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w))
        assert_close(np.where(np.isfinite(w), g, 0), np.where(np.isfinite(w), w, 0), jnp.float32)
    elif how == "select":
        (g_idx, g_cnt), (w_idx, w_cnt) = got, want
        np.testing.assert_array_equal(np.asarray(g_cnt), np.asarray(w_cnt))
        live = np.arange(w_idx.shape[-1]) < np.asarray(w_cnt)[..., None]
        np.testing.assert_array_equal(np.where(live, g_idx, 0), np.where(live, w_idx, 0))
    else:  # a compressed cache: kept rows bit-identical, rows past the count unspecified
        stored = np.asarray(kvc.stored_mask(want))
        for name in ("k", "v", "pos", "length", "score", "attend"):
            g, w = np.asarray(getattr(got, name), np.float32), np.asarray(getattr(want, name), np.float32)
            if name in ("k", "v"):
                g, w = g[stored], w[stored]
            np.testing.assert_array_equal(g, w, err_msg=name)


def _sub_jaxprs(value: Any) -> list:
    if hasattr(value, "eqns"):
        return [value]
    if hasattr(value, "jaxpr") and hasattr(value, "consts"):  # a ClosedJaxpr
        return [value.jaxpr]
    if isinstance(value, tuple | list):
        return [j for v in value for j in _sub_jaxprs(v)]
    return []


def _kernels_per_shard(jaxpr: Any, inside: bool = False) -> list[bool]:
    """For each `pallas_call` of the program, whether it runs inside a `shard_map`."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(inside)
            continue
        for sub in (j for v in eqn.params.values() for j in _sub_jaxprs(v)):
            found += _kernels_per_shard(sub, inside or eqn.primitive.name == "shard_map")
    return found


def _shard_shapes(jaxpr: Any) -> list[list[int]]:
    """The per-shard shape of the first operand of each `shard_map` of the program (nested ones too)."""
    shapes = []
    for eqn in jaxpr.eqns:
        subs = [j for v in eqn.params.values() for j in _sub_jaxprs(v)]
        if eqn.primitive.name == "shard_map":
            shapes += [list(sub.invars[0].aval.shape) for sub in subs]
        for sub in subs:
            shapes += _shard_shapes(sub)
    return shapes


def _run_ops() -> list[dict]:
    x = _inputs()
    cases = _cases(x)
    out = []
    for case, (fn, how) in cases.items():
        want = jax.jit(lambda fn=fn: fn("xla"))()
        for name, (d, m) in MESHES.items():
            if name == "1x8" and not case.startswith(REPLICATED_ONLY):
                continue
            mesh = sharding.make_mesh(d, m)

            def under_mesh(fn=fn, mesh=mesh):
                with sharding.kernel_mesh(mesh):  # entered while tracing, as generate does
                    return fn("pallas")

            row = dict(case=case, mesh=name, ok=False, error="", per_shard=[], shard_shapes=[])
            try:
                jaxpr = jax.make_jaxpr(under_mesh)().jaxpr
                row["per_shard"], row["shard_shapes"] = _kernels_per_shard(jaxpr), _shard_shapes(jaxpr)
                _compare(jax.jit(under_mesh)(), want, how)
                row["ok"] = True
            except Exception:  # reported to the test, which prints it
                row["error"] = traceback.format_exc()[-3000:]
            out.append(row)
    out.append(_jax_context_mesh(cases))
    out.append(_inside_a_shard_map(x))
    return out


def _inside_a_shard_map(x: dict) -> dict:
    """Called inside the caller's own `shard_map` over (`data`, `model`), the kernel runs on the block as is."""
    mesh = sharding.make_mesh(2, 4)
    row = dict(case="decode_attention[inside shard_map]", mesh="2x4", ok=False, error="", per_shard=[],
               shard_shapes=[])
    args = (x["q1"], x["q1_pos"], x["k"], x["v"], x["pos"], x["stored"])
    try:
        want = attention.decode_attention(*args, implementation="xla")

        def block(*args):
            with sharding.kernel_mesh(mesh):
                return attention.decode_attention(*args, implementation="pallas")

        bh = P("data", "model")
        specs = (bh, P("data"), bh, bh, bh, bh)
        fn = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=bh, check_vma=False)
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
        row["per_shard"], row["shard_shapes"] = _kernels_per_shard(jaxpr), _shard_shapes(jaxpr)
        _compare(jax.jit(fn)(*args), want, "close")
        row["ok"] = True
    except Exception:
        row["error"] = traceback.format_exc()[-3000:]
    return row


def _jax_context_mesh(cases: dict) -> dict:
    """Without `kernel_mesh`, JAX's own context mesh (`jax.set_mesh`) is picked up."""
    fn, how = cases["decode_attention"]
    row = dict(case="decode_attention[jax.set_mesh]", mesh="2x4", ok=False, error="", per_shard=[], shard_shapes=[])
    try:
        want = fn("xla")
        with jax.set_mesh(sharding.make_mesh(2, 4)):
            jaxpr = jax.make_jaxpr(lambda: fn("pallas"))().jaxpr
            row["per_shard"], row["shard_shapes"] = _kernels_per_shard(jaxpr), _shard_shapes(jaxpr)
            got = jax.jit(lambda: fn("pallas"))()
        _compare(got, want, how)
        row["ok"] = True
    except Exception:
        row["error"] = traceback.format_exc()[-3000:]
    return row


def _run_generate() -> list[dict]:
    """snapkv (window_scores, pool1d, topk_keep, gather_kept; the fused decode kernel in the model) with "auto"
    forced to the kernels through the tuning's `auto_pallas`, on a 2x4 mesh and on one device."""
    from tiny import tiny_model

    import kvjax

    wrapped: list[str] = []
    shard_map = _shard._shard_map

    def counting(fn, *args, **kwargs):
        wrapped.append(getattr(fn, "__qualname__", repr(fn)))
        return shard_map(fn, *args, **kwargs)

    _shard._shard_map = counting
    model = tiny_model(num_heads=N, num_kv_heads=K)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 96, n).tolist() for n in (30, 21, 37, 40)]
    kw = dict(method="snapkv", method_args=dict(budget=16, window_size=4), max_new_tokens=3, stop_at_eos=False)
    xla = kvjax.generate(model, prompts, **kw).tokens.tolist()
    with tuning.override(auto_pallas=_impl.PALLAS_OPS):
        one = kvjax.generate(model, prompts, **kw).tokens.tolist()
        mesh = sharding.make_mesh(2, 4)
        wrapped.clear()  # from here on: the kernels the mesh run put in shard_map
        got = kvjax.generate(sharding.shard_model(model, mesh), prompts, mesh=mesh, **kw).tokens.tolist()
    return [dict(case="generate[snapkv]", mesh="2x4", xla=xla, one=one, got=got, wrapped=sorted(set(wrapped)))]


def main() -> None:
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, got {jax.device_count()} (set XLA_FLAGS before JAX starts)")
    what = sys.argv[1] if len(sys.argv) > 1 else "ops"
    print(json.dumps(_run_ops() if what == "ops" else _run_generate()))


if __name__ == "__main__":
    main()
