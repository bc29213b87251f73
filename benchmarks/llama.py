"""P10: our Llama train step against a plain `jax.jit` Llama step written by hand, and its FLOP/s.

  python -m benchmarks.llama [--rounds=10] [--steps=2] [--json=out.json]

The peer shape (MaxText's small Llama on one CPU device): float32, d_model
512, 4 layers, 4 heads of 128 (plain multi-head: 4 key/value heads), SwiGLU
width 2048, sequences of 256 tokens, batch 8, a byte vocabulary (256 ids),
untied output projection. One process, one CPU device, in one run:

  P10  our step time ÷ the hand-written step's: the `llama` task's real step
       (`make_state`, `make_train_step`: the task's loss, clipping, adamw,
       the non-finite guard, the step's metrics) against a Llama written
       directly in JAX (no Flax): RMSNorm, RoPE, SwiGLU, causal attention,
       mean cross-entropy, `optax.clip_by_global_norm` + `optax.adamw` with
       the same hyperparameters, schedule and decay mask, state donated.
       Both start from the same weights (ours, copied into the hand-written
       pytree) and must agree on the first steps' losses before anything is
       timed. Alternating rounds, median of the per-round ratios. Goal <= 1.02.
       The detail gives both step times and our model FLOP/s:
       `flops_per_token * tokens_per_step / step_time`, with PaLM's
       `flops_per_token = 6 N + 12 L d T` (N the parameters in matmuls, i.e.
       all but the token embedding; L layers, d d_model, T seq_len;
       `trainers.models.llama.flops_per_token`).

Both sides apply the layers one after the other with no rematerialisation
(`scan_layers=False`, as `configs/llama_tiny.py`): what one writes by hand at
four layers. `--scan` times ours with the layers scanned and rematerialised
instead (the 8B config's layout), against the same hand-written step.
`--global-batch`, `--seq-len` and `--num-layers` shrink the shape for a
quick check that the script runs (`tests/test_benchmarks.py`).
"""

from __future__ import annotations

import argparse
import os
import time

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import common  # noqa: E402
from configs import default  # noqa: E402
from spmd.layout import batch_sharding  # noqa: E402
from spmd.mesh import create_mesh  # noqa: E402
from trainers.models import llama  # noqa: E402
from trainers.step.state import make_state  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import llama as llama_task  # noqa: E402
from trainers.tasks import make_task  # noqa: E402

LOSS_RTOL = 1e-5


def peer_config(args: argparse.Namespace):
  """The `llama` task's config at the peer shape (with any shrinking flags applied)."""
  config = default.get_config()
  config.task = "llama"
  config.model = llama_task.default_model_config()
  config.model.update(
    vocab_size=256,  # bytes, the default data's
    d_model=512,
    num_layers=args.num_layers or 4,
    num_heads=4,
    num_kv_heads=4,
    d_ff=2048,
    seq_len=args.seq_len or 256,
    param_dtype="float32",
    tie_embeddings=False,
    scan_layers=args.scan,
    remat_policy="minimal" if args.scan else "none",
  )
  config.global_batch = args.global_batch or 8
  config.mesh.ici = "data=-1"
  return config


# ---------------------------------------------------------------------------
# The hand-written side: plain JAX, a dict per layer, no Flax anywhere.


def hand_params(params: dict, scan: bool) -> dict:
  """Our parameters, copied into the hand-written pytree (a list of layer dicts)."""
  blocks = params["blocks"]
  if scan:
    count = blocks["attn"]["query"].shape[0]
    layers = [jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(count)]
  else:
    layers = [blocks[i] for i in range(len(blocks))]
  copy = lambda x: jnp.array(x, copy=True)  # noqa: E731 (ours is donated later)
  return {
    "embed": copy(params["token_embed"]),
    "layers": [
      {
        "attn_norm": copy(b["attn_norm"]["scale"]),
        "wq": copy(b["attn"]["query"]),
        "wk": copy(b["attn"]["key"]),
        "wv": copy(b["attn"]["value"]),
        "wo": copy(b["attn"]["out"]),
        "mlp_norm": copy(b["mlp_norm"]["scale"]),
        "gate": copy(b["mlp"]["gate"]),
        "up": copy(b["mlp"]["up"]),
        "down": copy(b["mlp"]["down"]),
      }
      for b in layers
    ],
    "final_norm": copy(params["final_norm"]["scale"]),
    "unembed": copy(params["unembed"]),
  }


def hand_decay_mask(params: dict) -> dict:
  """Weight decay on the matrices, not on the norms or the embedding (as ours)."""
  decayed = {"wq", "wk", "wv", "wo", "gate", "up", "down", "unembed"}
  return {
    k: [{n: n in decayed for n in layer} for layer in v] if k == "layers" else k in decayed
    for k, v in params.items()
  }


def hand_written_step(config):
  """`(state, batch) -> (state, loss)`: Llama, cross-entropy, clip + adamw, jitted, donated."""
  model, train = config.model, config.train
  eps, theta = model.norm_eps, model.rope_theta

  def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale

  def rope(x, sin, cos):  # x [b, l, h, k]; the two halves of a head rotate together
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

  def forward(params, tokens):
    _, length = tokens.shape
    head_dim = model.d_model // model.num_heads
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq  # [l, k/2]
    sin, cos = jnp.sin(angles)[None, :, None], jnp.cos(angles)[None, :, None]
    causal = jnp.tril(jnp.ones((length, length), bool))
    # The residual stream as one [tokens, d] matrix, so every weight matmul
    # and its gradient is a plain 2-D product (a 3-D operand costs XLA:CPU a
    # transpose per weight gradient).
    batch, d = tokens.shape[0], model.d_model

    def heads(h, w):  # [b*l, d] @ [d, h, k] -> [b, l, h, k]
      return (h @ w.reshape(d, -1)).reshape(batch, length, *w.shape[1:])

    x = params["embed"][tokens.reshape(-1)]
    for p in params["layers"]:
      h = rms_norm(x, p["attn_norm"])
      q = rope(heads(h, p["wq"]), sin, cos)
      k = rope(heads(h, p["wk"]), sin, cos)
      v = heads(h, p["wv"])
      scores = jnp.einsum("bqhk,bshk->bhqs", q, k) * head_dim**-0.5
      scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
      attn = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v)
      x = x + attn.reshape(batch * length, -1) @ p["wo"].reshape(-1, d)
      h = rms_norm(x, p["mlp_norm"])
      x = x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
    logits = rms_norm(x, params["final_norm"]) @ params["unembed"]
    return logits.reshape(batch, length, -1)

  def loss_fn(params, batch):
    logits = forward(params, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    train.learning_rate,
    train.warmup_steps,
    max(train.steps, train.warmup_steps + 1),
    train.learning_rate * train.end_learning_rate_fraction,
  )
  tx = optax.chain(
    optax.clip_by_global_norm(train.grad_clip_norm),
    optax.adamw(
      schedule, b1=train.b1, b2=train.b2, weight_decay=train.weight_decay, mask=hand_decay_mask
    ),
  )

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state}, loss

  return jax.jit(step, donate_argnums=0), tx


# ---------------------------------------------------------------------------


def random_batch(config, mesh):
  """Random byte tokens on the device: inputs, the next tokens as targets, all counted."""
  spec = batch_sharding(mesh, ("data",))
  rows, length = config.global_batch, config.model.seq_len
  tokens = np.random.default_rng(0).integers(0, 256, (rows, length + 1), np.int32)
  return {
    "inputs": jax.device_put(tokens[:, :-1], spec),
    "targets": jax.device_put(tokens[:, 1:], spec),
    "mask": jax.device_put(np.ones((rows, length), np.float32), spec),
  }


class Side:
  """A step and its state, carried from round to round (the state is donated)."""

  def __init__(self, step, state, loss_of):
    self.step, self.state, self.loss_of = step, state, loss_of

  def run(self, n: int) -> float:
    """Seconds per step over `n` steps."""
    start = time.perf_counter()
    for _ in range(n):
      self.state, out = self.step(self.state, self.batch)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n

  def losses(self, n: int) -> list[float]:
    out = []
    for _ in range(n):
      self.state, metrics = self.step(self.state, self.batch)
      out.append(float(self.loss_of(metrics)))
    return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--steps", type=int, default=2, help="steps per round and side")
  parser.add_argument("--scan", action="store_true", help="ours with scanned, remat'd layers")
  parser.add_argument("--global-batch", type=int)
  parser.add_argument("--seq-len", type=int)
  parser.add_argument("--num-layers", type=int)
  parser.add_argument("--json")
  args = parser.parse_args()

  config = peer_config(args)
  model_config = llama_task.llama_config(config)
  mesh = create_mesh(config.mesh.ici)
  task = make_task(config)
  setup = make_state(task.model, config, mesh, ("data",), task.optimizer)
  batch = random_batch(config, mesh)
  ours_step = make_train_step(setup, task, config, mesh, ("data",))
  theirs_step, tx = hand_written_step(config)
  state = setup.init()
  params = hand_params(state["params"], model_config.scan_layers)
  ours = Side(ours_step, state, lambda m: m["loss"])
  theirs = Side(theirs_step, {"params": params, "opt_state": tx.init(params)}, lambda m: m)
  ours.batch = theirs.batch = batch

  # The same model, loss and optimizer: the losses of the first steps agree
  # (the first from the same weights, the next after the same updates).
  a, b = ours.losses(3), theirs.losses(3)
  if not np.allclose(a, b, rtol=LOSS_RTOL, atol=0):
    raise SystemExit(f"the two steps disagree: ours {a}, hand-written {b} (rtol {LOSS_RTOL})")
  ours.run(1), theirs.run(1)  # warm up once more after the checks
  ratio, step_a, step_b = common.alternate(
    lambda: ours.run(args.steps), lambda: theirs.run(args.steps), args.rounds
  )

  tokens = config.global_batch * model_config.seq_len
  per_token = llama.flops_per_token(model_config)
  flops_a, flops_b = per_token * tokens / step_a, per_token * tokens / step_b
  n = llama.param_count(model_config) - model_config.vocab_size * model_config.d_model
  layout = "scanned, remat minimal" if model_config.scan_layers else "unrolled, no remat"
  shape = (
    f"Llama f32, d 512, {model_config.num_layers} layers, 4 heads x 128, MLP 2048, "
    f"vocab 256 untied, batch {config.global_batch} x {model_config.seq_len}, ours {layout}"
  )
  detail = (
    f"{shape}: {step_a * 1e3:.0f} vs {step_b * 1e3:.0f} ms; first losses agree "
    f"({a[0]:.6f} vs {b[0]:.6f}); ours {flops_a / 1e9:.1f} GFLOP/s "
    f"(hand-written {flops_b / 1e9:.1f}) = (6N + 12·L·d·T) x {tokens} tokens ÷ step time, "
    f"N = {n / 1e6:.2f}M (all but the embedding), {per_token / 1e6:.1f} MFLOP per token"
  )
  row = common.row(
    "P10",
    "our Llama step ÷ a hand-written `jax.jit` Llama step (peer shape, 1 CPU device)",
    ratio,
    1.02,
    True,
    detail,
    common.machine("1 process x 1 CPU device"),
  )
  common.emit([row], args.json)
  if os.environ.get("BENCH_VERBOSE"):
    print(f"loss check: ours {a}, hand-written {b}")


if __name__ == "__main__":
  main()
