#!/usr/bin/env python
"""Train a small byte-level MoE language model on the Python standard library's sources.

A decoder-only transformer whose feed-forward blocks are `jax_ep.flax.MoE` layers, trained
with optax on a mesh of `--data x --expert` CPU devices (default 2 x 4 = 8 virtual
devices of this host). The text is every `.py` file under `sysconfig`'s stdlib path
(site-packages excluded); files whose path hashes to 0 mod 20 form a fixed held-out set.

    python examples/train_moe.py --out runs/moe            # train, plots in runs/moe
    python examples/train_moe.py --out runs/moe --resume   # continue from the last checkpoint

Writes OUT/metrics.jsonl (one JSON object per step), OUT/loss.png, OUT/expert_load.png
and orbax checkpoints in OUT/ckpt. A batch is a pure function of (seed, step), so a run
resumed from a checkpoint replays exactly the loss sequence of an uninterrupted one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (global)")
    p.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=256, help="hidden width of each expert")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--shared-experts", type=int, default=0)
    p.add_argument("--score", choices=("softmax", "sigmoid"), default="softmax")
    p.add_argument("--routing-bias", action="store_true",
                   help="aux-loss-free balancing bias (updated every step)")
    p.add_argument("--capacity", type=float, default=0,
                   help="dispatch capacity factor: rows each rank receives = f * tokens "
                        "per shard * min(top-k, expert); 0 means the layer's default (the "
                        "experts' places with --capacity-factor, else R * tokens)")
    p.add_argument("--capacity-factor", type=float, default=2.0,
                   help="places per expert as a multiple of its mean load (MoE "
                        "capacity_factor); slots past them are dropped; 0 means never drop")
    p.add_argument("--expert-matmul", choices=("auto", "tiles", "ragged_dot"),
                   default="auto", help="MoE expert_matmul (auto: tiles on CPU, "
                                        "ragged_dot on GPU)")
    p.add_argument("--aux-loss", choices=("batch", "sequence"), default="batch",
                   help="the balance loss weighted by --aux-coef (MoE aux_loss)")
    p.add_argument("--routed-scaling-factor", type=float, default=1.0,
                   help="scale of the routed experts' weights (DeepSeek-V3: 2.5)")
    p.add_argument("--dense", action="store_true",
                   help="a dense SwiGLU of width top-k * ffn in place of each MoE (the same "
                        "active FLOPs): the yardstick of `python -m jax_ep.bench "
                        "--train-step`")
    p.add_argument("--backend", choices=("auto", "ffi", "reference"), default="auto")
    p.add_argument("--dispatch-dtype", choices=("default", "fp8"), default="default",
                   help="fp8: tokens dispatched as FP8 with 1 x 128 block scales "
                        "(MoE dispatch_dtype; --hidden must be a multiple of 128)")
    p.add_argument("--data", type=int, default=2, help="data-parallel mesh size")
    p.add_argument("--expert", type=int, default=4, help="expert-parallel mesh size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--aux-coef", type=float, default=1e-2, help="load-balance loss weight")
    p.add_argument("--z-coef", type=float, default=1e-3, help="router z-loss weight")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--check-every", type=int, default=10,
                   help="jax_ep.check_errors() every N steps (GPU kernels record errors "
                        "on the device) and before every checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/train_moe")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt")
    p.add_argument("--stop-after", type=int, default=None,
                   help="checkpoint and exit after this step (simulates an interruption)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # The virtual CPU devices must be requested before jax is imported.
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (f"{_flags} --xla_force_host_platform_device_count="
                                   f"{ARGS.data * ARGS.expert}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.flax import MoE, SwiGLU  # noqa: E402

VOCAB = 256


# ----------------------------------------------------------------------------- data

def load_corpus():
    """(train bytes, eval bytes) as uint8 arrays: the stdlib's .py files, sorted by path,
    joined by a NUL byte; a file goes to eval when crc32(relative path) % 20 == 0."""
    import sysconfig
    import zlib

    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__"))
        paths += [os.path.join(d, f) for f in files if f.endswith(".py")]
    train, held = [], []
    for path in sorted(paths):
        rel = os.path.relpath(path, root)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        (held if zlib.crc32(rel.encode()) % 20 == 0 else train).append(data + b"\0")
    if not train or not held:
        raise SystemExit(f"no Python sources found under {root}")
    return (np.frombuffer(b"".join(train), np.uint8), np.frombuffer(b"".join(held), np.uint8))


def batch_at(data, seed, step, batch, seq):
    """[batch, seq + 1] int32 windows at offsets drawn from (seed, step) alone."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, batch)
    return np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)


# ----------------------------------------------------------------------------- model

class Attention(nnx.Module):
    def __init__(self, d, heads, *, rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        B, S, D = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, S, 3 * self.heads, D // self.heads), 3,
                            axis=2)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.reshape(B, S, D))


class Block(nnx.Module):
    def __init__(self, a, *, rngs):
        self.norm1 = nnx.RMSNorm(a.hidden, rngs=rngs)
        self.attn = Attention(a.hidden, a.heads, rngs=rngs)
        self.norm2 = nnx.RMSNorm(a.hidden, rngs=rngs)
        self.experts = a.experts
        if a.dense:
            self.moe = None
            self.ffn = SwiGLU(a.hidden, a.top_k * a.ffn, rngs=rngs)
            return
        self.moe = MoE(a.hidden, a.ffn, a.experts, a.top_k, mesh_axis="expert",
                       backend=a.backend, capacity=a.capacity or None,
                       capacity_factor=a.capacity_factor or None, score=a.score,
                       routing_bias=a.routing_bias, shared_experts=a.shared_experts,
                       dispatch_dtype=None if a.dispatch_dtype == "default" else "fp8",
                       expert_matmul=a.expert_matmul, aux_loss=a.aux_loss,
                       routed_scaling_factor=a.routed_scaling_factor, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        if self.moe is None:  # --dense: no routing, so no balance terms or drops
            zero, none = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
            return x + self.ffn(self.norm2(x)), {
                "load_balance_loss": zero, "router_z_loss": zero, "dropped": none,
                "dropped_rows": none,
                "tokens_per_expert": jnp.zeros((self.experts,), jnp.int32)}
        y, aux = self.moe(self.norm2(x))
        return x + y, aux


class ByteLM(nnx.Module):
    def __init__(self, a, *, rngs):
        self.embed = nnx.Embed(VOCAB, a.hidden, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (a.seq, a.hidden)))
        self.blocks = nnx.List([Block(a, rngs=rngs) for _ in range(a.layers)])
        self.norm = nnx.RMSNorm(a.hidden, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        auxes = []
        for blk in self.blocks:
            x, aux = blk(x)
            auxes.append(aux)
        return self.embed.attend(self.norm(x)), auxes


def lm_loss(model, tokens, a):
    logits, auxes = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()
    lb = sum(x["load_balance_loss"] for x in auxes) / len(auxes)
    z = sum(x["router_z_loss"] for x in auxes) / len(auxes)
    load = jnp.stack([x["tokens_per_expert"] for x in auxes])  # [layers, E]
    # [top-k slots dropped, rows of them dropped at receive], over the layers
    dropped = sum(jnp.stack([x["dropped"], x["dropped_rows"]]) for x in auxes)
    return ce + a.aux_coef * lb + a.z_coef * z, (ce, lb, load, dropped)


def build(a, mesh):
    with jax.set_mesh(mesh):
        model = ByteLM(a, rngs=nnx.Rngs(a.seed))
        warmup = max(1, min(a.warmup, a.steps // 4))
        sched = optax.warmup_cosine_decay_schedule(0.0, a.lr, warmup,
                                                   max(a.steps, warmup + 1), a.lr * 0.1)
        tx = optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.01))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return model, opt


def make_steps(a, mesh):
    tok_sharding = jax.sharding.NamedSharding(mesh, P(("data", "expert")))

    @nnx.jit
    def train_step(model, opt, tokens):
        grad_fn = nnx.value_and_grad(lambda m: lm_loss(m, tokens, a), has_aux=True)
        (loss, (ce, lb, load, dropped)), grads = grad_fn(model)
        opt.update(model, grads)
        if a.routing_bias and not a.dense:
            for blk, l in zip(model.blocks, load):
                blk.moe.update_routing_bias(l)
        return {"loss": ce, "total_loss": loss, "lb_loss": lb, "load": load,
                "dropped": dropped[0], "dropped_rows": dropped[1]}

    @nnx.jit
    def eval_step(model, tokens):
        return lm_loss(model, tokens, a)[1][0]

    def put(x):  # host batch -> its shards, one copy per device
        return jax.device_put(x, tok_sharding)

    return train_step, eval_step, put


# ----------------------------------------------------------------------------- checkpoints

def _ckpt_manager(out):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(out, "ckpt")),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


def save_checkpoint(mgr, step, model, opt):
    import orbax.checkpoint as ocp

    state = {"model": nnx.to_pure_dict(nnx.state(model)),
             "opt": nnx.to_pure_dict(nnx.state(opt))}
    mgr.save(step, args=ocp.args.StandardSave(state), force=True)
    mgr.wait_until_finished()


def restore_checkpoint(mgr, model, opt):
    """Loads the latest checkpoint into model/opt in place; returns its step (0: none)."""
    import orbax.checkpoint as ocp

    step = mgr.latest_step()
    if step is None:
        return 0
    ms, os_ = nnx.state(model), nnx.state(opt)
    target = {"model": nnx.to_pure_dict(ms), "opt": nnx.to_pure_dict(os_)}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=x.sharding), target)
    restored = mgr.restore(step, args=ocp.args.StandardRestore(target))
    nnx.replace_by_pure_dict(ms, restored["model"])
    nnx.replace_by_pure_dict(os_, restored["opt"])
    nnx.update(model, ms)
    nnx.update(opt, os_)
    return int(step)


# ----------------------------------------------------------------------------- plots

def plot(out, records):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in records])
    loss = np.array([r["loss"] for r in records])
    ev = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, loss, color="tab:blue", alpha=0.35, lw=1, label="train loss (per step)")
    w = max(1, min(20, len(loss) // 10))
    if len(loss) >= w:
        smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1:], smooth, color="tab:blue", lw=2, label=f"train loss ({w}-step mean)")
    if ev:
        ax.plot(*zip(*ev), "o-", color="tab:orange", lw=2, label="held-out loss")
    ax.axhline(np.log(VOCAB), color="gray", ls=":", lw=1, label="uniform bytes (ln 256)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title("Byte-level MoE LM on the Python stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=110)
    plt.close(fig)

    load = np.array([r["expert_load"] for r in records], np.float64)  # [steps, layers, E]
    share = load / load.sum(axis=-1, keepdims=True)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True,
                                 gridspec_kw={"height_ratios": [1, 1.3]})
    for layer in range(load.shape[1]):
        ratio = load[:, layer].max(-1) / load[:, layer].mean(-1)
        a1.plot(steps, ratio, lw=1, label=f"layer {layer}")
    a1.axhline(1.0, color="gray", ls=":", lw=1)
    dropped = np.array([r.get("dropped", 0) for r in records])
    if dropped.any():
        a1b = a1.twinx()
        a1b.fill_between(steps, dropped, color="gray", alpha=0.2, lw=0)
        a1b.set_ylabel("rows dropped (all layers, shaded)", color="gray")
        a1b.tick_params(axis="y", colors="gray")
        a1b.set_ylim(bottom=0)
    a1.set_ylabel("max / mean expert load")
    a1.set_title("Expert load (top-k slots per expert, per step)")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    mean_share = share.mean(axis=1)  # over layers: [steps, E]
    im = a2.imshow(mean_share.T, aspect="auto", origin="lower", cmap="viridis",
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, load.shape[2] - 0.5),
                   interpolation="nearest")
    a2.set_ylabel("expert")
    a2.set_xlabel("step")
    a2.set_title("share of slots per expert (mean over layers; uniform = "
                 f"{1 / load.shape[2]:.3f})")
    fig.colorbar(im, ax=a2, orientation="horizontal", pad=0.18, fraction=0.06)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "expert_load.png"), dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def read_metrics(path, upto):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if r["step"] <= upto]


def main(a):
    from tqdm import tqdm

    n = a.data * a.expert
    if len(jax.devices()) < n:
        raise SystemExit(f"need {n} devices for a {a.data} x {a.expert} mesh, have "
                         f"{len(jax.devices())}; set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={n}")
    if (a.batch * a.seq) % n or a.batch % n:
        raise SystemExit(f"--batch ({a.batch}) must be a multiple of data*expert={n}")
    if a.experts % a.expert:
        raise SystemExit(f"--experts ({a.experts}) must be a multiple of --expert "
                         f"({a.expert})")
    os.makedirs(a.out, exist_ok=True)
    if not a.resume and os.path.isdir(os.path.join(a.out, "ckpt")):
        # A fresh run in an old OUT starts over rather than colliding with old steps.
        import shutil
        print(f"starting fresh: removing the checkpoints of an earlier run in {a.out} "
              "(pass --resume to continue it)", flush=True)
        shutil.rmtree(os.path.join(a.out, "ckpt"))
    mesh = jax.make_mesh((a.data, a.expert), ("data", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:n])
    train, held = load_corpus()
    model, opt = build(a, mesh)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    mgr = _ckpt_manager(a.out)
    start = 0
    if a.resume:
        with jax.set_mesh(mesh):
            start = restore_checkpoint(mgr, model, opt)
    metrics_path = os.path.join(a.out, "metrics.jsonl")
    records = read_metrics(metrics_path, start) if start else []
    with open(metrics_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)

    from jax_ep.ops import resolve_backend

    print(f"byte-level MoE LM: {a.layers} layers, width {a.hidden}, {a.experts} experts "
          f"(top-{a.top_k}, ffn {a.ffn}), {n_params / 1e6:.2f}M params; mesh data={a.data} "
          f"x expert={a.expert}; backend {resolve_backend(a.backend)}; corpus "
          f"{len(train) / 1e6:.1f} MB train / {len(held) / 1e6:.2f} MB held out"
          + (f"; resumed at step {start}" if start else ""), flush=True)

    train_step, eval_step, put = make_steps(a, mesh)
    eval_batches = [batch_at(held, a.seed + 1_000_003, i, a.batch, a.seq)
                    for i in range(a.eval_batches)]
    tokens_per_step = a.batch * a.seq
    end = a.steps if a.stop_after is None else min(a.steps, a.stop_after)
    bar = tqdm(total=a.steps, initial=start, disable=a.no_progress, unit="step",
               dynamic_ncols=True, file=sys.stdout)
    t_start = time.perf_counter()
    with jax.set_mesh(mesh), open(metrics_path, "a") as mf:
        for step in range(start + 1, end + 1):
            tokens = put(batch_at(train, a.seed, step, a.batch, a.seq))
            t0 = time.perf_counter()
            m = jax.device_get(train_step(model, opt, tokens))
            dt = time.perf_counter() - t0
            load = np.asarray(m["load"])
            rec = {"step": step, "loss": float(m["loss"]),
                   "tokens_per_s": tokens_per_step / dt,
                   "max_expert_load": int(load.max(axis=-1).max()),
                   "mean_expert_load": float(load.mean()),
                   "load_balance_loss": float(m["lb_loss"]),
                   "dropped": int(m["dropped"]),
                   "dropped_rows": int(m["dropped_rows"]),
                   "expert_load": load.tolist()}
            if step % a.eval_every == 0 or step == a.steps:
                rec["eval_loss"] = float(np.mean([float(eval_step(model, put(b)))
                                                  for b in eval_batches]))
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            records.append(rec)
            bar.update(1)
            post = {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
            if "eval_loss" in rec:
                post["eval"] = f"{rec['eval_loss']:.3f}"
            bar.set_postfix(post, refresh=False)
            saving = step % a.ckpt_every == 0 or step == end
            if saving or step % a.check_every == 0:
                # a failed EP call on a GPU is NaN/-1 on the device and an error here;
                # never checkpoint a state it touched
                jax_ep.check_errors(step=step)
            if saving:
                save_checkpoint(mgr, step, model, opt)
    bar.close()
    mgr.close()
    wall = time.perf_counter() - t_start
    if not records:
        print("nothing to do: the checkpoint is already at --steps")
        return records
    plot(a.out, records)
    losses = [r["loss"] for r in records]
    k = min(10, len(losses))
    first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    slots = len(records) * a.layers * a.batch * a.seq * a.top_k
    dropped = sum(r.get("dropped", 0) for r in records)
    dropped_rows = sum(r.get("dropped_rows", 0) for r in records)
    print(f"trained steps {start + 1}..{end} in {wall:.0f}s; over steps "
          f"{records[0]['step']}..{records[-1]['step']}: "
          f"mean loss first {k}: {first:.3f}, last {k}: {last:.3f} "
          f"({100 * last / first:.0f}% of first)"
          + (f"; held-out loss {evals[-1]:.3f}" if evals else "")
          + f"; {(end - start) / wall:.2f} steps/s; dropped {dropped} of {slots} top-k "
          f"slots ({100 * dropped / slots:.2f}%; {dropped_rows} rows dropped at receive)")
    print(f"metrics: {os.path.abspath(metrics_path)}")
    print(f"plots:   {os.path.abspath(os.path.join(a.out, 'loss.png'))}")
    print(f"         {os.path.abspath(os.path.join(a.out, 'expert_load.png'))}")
    return records


if __name__ == "__main__":
    main(ARGS)
