"""P11: the TPU check's Llama step ÷ a hand-written `jax.jit` Llama step with the same kernel and remat.

  python -m benchmarks.tpu_llama [--rows=4] [--rounds=6] [--steps=2] [--json=FILE]   # on the chip
  python -m benchmarks.tpu_llama --tiny --rows=2 --rounds=2 --steps=1                # on a CPU

P10 on the chip (`benchmarks/llama.py` is its CPU form): the model of
`configs/llama_tpu_check.py` (501M, bf16 compute over float32 parameters,
scanned layers, remat "minimal"), our real step (`make_state`,
`make_train_step`: the task's loss, clipping, adamw, the non-finite guard,
the metrics) against a Llama written directly in JAX, no Flax: the layers'
float32 weights stacked and applied by `lax.scan` under `jax.checkpoint` with
the same policy, each layer's weights cast to bf16 inside the scanned body
(as MaxText's layers cast theirs), so that, as in ours, each layer's weight
gradients leave the layer in float32 and are stacked and handed to the
optimizer in float32; RMSNorm and RoPE in float32, SwiGLU, the same splash kernel
(`attention.splash_attention`, the block the product picks) and the same
chunked cross-entropy (`losses.chunked_cross_entropy_sums`), then
`optax.clip_by_global_norm` + `optax.adamw` with the same hyperparameters,
schedule and decay mask, state donated. Both start from the same weights;
their first losses must agree before anything is timed. Alternating rounds,
median of the per-round ratios. Goal <= 1.02.

Both states live on the chip at once (5.6 GiB each at 501M), so P11 runs
at fewer rows than P9 (`--rows`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.tpu_check_config import check_config  # noqa: E402
from spmd.layout import batch_sharding  # noqa: E402
from trainers.models import attention  # noqa: E402
from trainers.models.layers import CHECKPOINT_POLICIES  # noqa: E402
from trainers.step.mesh import build_mesh  # noqa: E402
from trainers.step.state import make_state  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import llama as llama_task  # noqa: E402
from trainers.tasks import make_task  # noqa: E402
from trainers.tasks.losses import chunked_cross_entropy_sums  # noqa: E402

# bf16 compute: the two programs may order a few sums differently.
LOSS_RTOL = 2e-3
_DECAYED = {"query", "key", "value", "out", "gate", "up", "down", "unembed"}


class Side:
  """A step and its state, carried from round to round (the state is donated).

  `benchmarks/llama.py`'s, which cannot be imported here: it pins JAX to the CPU.
  """

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


def hand_params(params: dict) -> dict:
  """Our (scanned) parameters, copied into plain nested dicts of arrays."""
  b = params["blocks"]
  copy = lambda x: jnp.array(x, copy=True)  # noqa: E731 (ours is donated later)
  out = {
    "embed": copy(params["token_embed"]),
    "attn_norm": copy(b["attn_norm"]["scale"]),
    "query": copy(b["attn"]["query"]),
    "key": copy(b["attn"]["key"]),
    "value": copy(b["attn"]["value"]),
    "out": copy(b["attn"]["out"]),
    "mlp_norm": copy(b["mlp_norm"]["scale"]),
    "gate": copy(b["mlp"]["gate"]),
    "up": copy(b["mlp"]["up"]),
    "down": copy(b["mlp"]["down"]),
    "final_norm": copy(params["final_norm"]["scale"]),
  }
  if "unembed" in params:
    out["unembed"] = copy(params["unembed"])
  return out


def hand_loss(config):
  """`(params, batch) -> (loss_sum, weight, correct_sum)`: the Llama in plain JAX, its chunked loss."""
  model = llama_task.llama_config(config)
  dt = jnp.bfloat16 if config.train.precision == "bfloat16" else jnp.float32
  length, head_dim = model.seq_len, model.head_dim
  choice = attention.choose_kernel(
    "splash",
    platform=attention.current_platform(),
    length=length,
    dtype=dt,
    segments=False,
    head_dim=head_dim,
  )

  def rms_norm(x, scale):
    y = x.astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + model.norm_eps)
    return (y * scale.astype(jnp.float32)).astype(dt)

  def rope(x, sin, cos):  # x [b, l, h, k]; the two halves of a head rotate together
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dt)

  def layer(x, p, sin, cos):  # x [b*l, d]
    p = jax.tree.map(lambda a: a.astype(dt), p)  # this layer's float32 weights, cast here
    rows = x.shape[0] // length
    d = model.d_model

    def heads(h, w):  # [b*l, d] @ [d, h, k] -> [b, l, h, k]
      return (h @ w.reshape(d, -1)).reshape(rows, length, *w.shape[1:])

    h = rms_norm(x, p["attn_norm"])
    q = rope(heads(h, p["query"]), sin, cos)
    k = rope(heads(h, p["key"]), sin, cos)
    v = heads(h, p["value"])
    y = attention.splash_attention(q, k, v, block=choice.block, interpret=choice.interpret)
    # The names ours gives the products a policy may keep by name ("minimal_no_qkv").
    x = x + checkpoint_name(y.reshape(rows * length, -1) @ p["out"].reshape(-1, d), "attention_out")
    h = rms_norm(x, p["mlp_norm"])
    gate, up = checkpoint_name(h @ p["gate"], "mlp_gate"), checkpoint_name(h @ p["up"], "mlp_up")
    return x + (jax.nn.silu(gate) * up) @ p["down"]

  policy = CHECKPOINT_POLICIES[model.remat_policy]

  def loss_sums(params, batch):
    # Float32 weights go in: each product casts its own (the layers in the
    # scanned body, the chunked loss inside its projection), as ours do.
    p = params
    tokens = batch["inputs"]
    inv_freq = model.rope_theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq
    sin, cos = jnp.sin(angles)[None, :, None], jnp.cos(angles)[None, :, None]
    x = p["embed"][tokens.reshape(-1)].astype(dt)
    names = ("attn_norm", "query", "key", "value", "out", "mlp_norm", "gate", "up", "down")
    body = lambda x, lp: (layer(x, lp, sin, cos), None)  # noqa: E731
    if policy is not None:
      body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    x, _ = jax.lax.scan(body, x, {n: p[n] for n in names})
    hidden = rms_norm(x, p["final_norm"]).reshape(*tokens.shape, -1)
    unembed = p["unembed"] if "unembed" in p else p["embed"].T
    loss_sum, weight, sums = chunked_cross_entropy_sums(
      hidden, unembed, batch["targets"], batch["mask"]
    )
    return loss_sum.astype(jnp.float32), weight, sums["accuracy"]

  return loss_sums


def hand_optimizer(config) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` + `optax.adamw`: our hyperparameters, schedule and decay mask."""
  train = config.train
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    train.learning_rate,
    train.warmup_steps,
    max(train.steps, train.warmup_steps + 1),
    train.learning_rate * train.end_learning_rate_fraction,
  )
  return optax.chain(
    optax.clip_by_global_norm(train.grad_clip_norm),
    optax.adamw(
      schedule,
      b1=train.b1,
      b2=train.b2,
      weight_decay=train.weight_decay,
      mask=lambda params: {n: n in _DECAYED for n in params},
    ),
  )


def hand_written_step(config):
  """`(state, batch) -> (state, loss)`: the Llama, its mean loss, clip + adamw; jitted, donated."""
  loss_sums, tx = hand_loss(config), hand_optimizer(config)

  def loss_fn(params, batch):
    loss_sum, weight, _ = loss_sums(params, batch)
    return loss_sum / weight

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

  return jax.jit(step, donate_argnums=0), tx


def compare(config, rounds: int, steps: int) -> dict:
  """P11 for `config`: the losses' check, then alternating rounds; the figures as a dict."""
  task = make_task(config)
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes, task.optimizer)
  ours_step = make_train_step(setup, task, config, mesh, axes)
  theirs_step, tx = hand_written_step(config)
  rows, length = config.global_batch, config.model.seq_len
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (rows, length + 1))
  spec = batch_sharding(mesh, axes)
  batch = {
    "inputs": jax.device_put(tokens[:, :-1].astype(np.int32), spec),
    "targets": jax.device_put(tokens[:, 1:].astype(np.int32), spec),
    "mask": jax.device_put(np.ones((rows, length), np.float32), spec),
  }
  state = setup.init()
  params = hand_params(state["params"])
  ours = Side(ours_step, state, lambda m: m["loss"])
  theirs = Side(theirs_step, {"params": params, "opt_state": tx.init(params)}, lambda m: m)
  ours.batch = theirs.batch = batch
  a, b = ours.losses(3), theirs.losses(3)
  agree = bool(np.allclose(a, b, rtol=LOSS_RTOL, atol=0))
  out = {"rows": rows, "losses_ours": a, "losses_hand": b, "losses_agree": agree}
  if not agree:
    return out
  ours.run(1), theirs.run(1)
  ratio, step_a, step_b = common.alternate(
    lambda: ours.run(steps), lambda: theirs.run(steps), rounds
  )
  out.update(p11=ratio, ours_step_s=step_a, hand_step_s=step_b, rounds=rounds, steps=steps)
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--tiny", action="store_true", help="a CPU-sized model (its test)")
  args = parser.parse_args(argv)
  result = compare(check_config(args.rows, args.tiny), args.rounds, args.steps)
  print(result)
  return 0 if result["losses_agree"] else 1


if __name__ == "__main__":
  sys.exit(main())
