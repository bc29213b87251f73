"""A routed MLP (mixture of experts) for the built-in Llama: top-k routing, dropless dispatch.

Each token's router logits (float32, `x @ router`) pick `top_k` of
`num_experts` SwiGLU experts; the token's output is the experts' outputs
weighted by their gates, plus an optional shared expert every token takes.

Gates:
  "softmax": softmax over all experts' logits, then the top k of those
    probabilities; with `norm_topk` they are renormalised to sum to 1, which
    equals a softmax over the k chosen logits (Mixtral; Qwen2-MoE's
    `norm_topk_prob=True`). Without it the k probabilities are kept as they
    are (Qwen1.5/Qwen2-MoE's default `norm_topk_prob=False`).
  "sigmoid": a sigmoid of each logit, the top k of those scores, renormalised
    with `norm_topk` (DeepSeek-V3, without its bias for selection or its
    routed scaling factor).

Dispatch is dropless: the (token, choice) pairs are sorted by expert, each
expert multiplies its contiguous group (`jax.lax.ragged_dot` with the group
sizes), and the outputs are put back in token order and combined with the
gates. No token is dropped, so training, evals and decoding route the same.
Under the mesh rules (`spmd.rules.activation_rules`) the tokens form one
group per batch shard, each routed and sorted on its own device. Where the
rules split the experts over a mesh axis (`expert`), each device holds its
experts alone and the tokens of its expert group are all-gathered to it and
their outputs reduce-scattered back (`_expert_parallel`).

The shared expert (Qwen2-MoE, DeepSeek) is a SwiGLU of width `shared_d_ff`;
with `shared_gate` its output is scaled by `sigmoid(x @ shared_gate)` per
token (Qwen2-MoE), else added as is (DeepSeek).

Auxiliary losses (`RouterStats`, over the tokens of the call):
  load balancing (Switch Transformer, Fedus et al. 2021):
    `num_experts * sum_i f_i * P_i`, with f_i the fraction of the tokens'
    k choices that go to expert i (sums to 1) and P_i the mean over tokens
    of the router's probability for expert i (softmax; for sigmoid gates
    the scores normalised over the experts). 1.0 when perfectly balanced.
    Hugging Face's Mixtral counts f_i without dividing by k: its value is
    `top_k` times this one.
  z-loss (ST-MoE, Zoph et al. 2022): the mean over tokens of
    `logsumexp(logits) ** 2`.

Parameters (with the Llama's `blocks/mlp/` before them; logical axes):

  router            [d_model, experts]        (embed, experts)
  expert_gate, expert_up [experts, d_model, d_ff] (experts, embed, mlp)
  expert_down       [experts, d_ff, d_model]  (experts, mlp, embed)
  shared/gate, up   [d_model, shared_d_ff]    (embed, mlp)   (shared_d_ff > 0)
  shared/down       [shared_d_ff, d_model]    (mlp, embed)
  shared_gate       [d_model]                 (embed,)       (and shared_gate)

Example:
  >>> import jax.numpy as jnp
  >>> layer = MoE(MoEConfig(d_model=8, num_experts=4, top_k=2, d_ff=16), rngs=nnx.Rngs(0))
  >>> y, stats = layer.routed(jnp.ones((2, 3, 8)))
  >>> y.shape, stats.expert_share.shape, float(stats.dropped)
  ((2, 3, 8), (4,), 0.0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spmd import rules
from spmd.rules import constrain
from trainers.models import attention, param
from trainers.models.layers import dense, fan_in_init

GATES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Sizes of one routed MLP; a `ValueError` naming the field for a bad one.

  Example:
    >>> MoEConfig(d_model=8, num_experts=4, top_k=5, d_ff=16)
    Traceback (most recent call last):
    ...
    ValueError: moe_top_k=5 must be at most moe_experts=4
  """

  d_model: int
  num_experts: int
  top_k: int
  d_ff: int
  gate: str = "softmax"
  norm_topk: bool = True
  shared_d_ff: int = 0
  shared_gate: bool = True
  param_dtype: str = "float32"
  chunk_bytes: int = 0
  """0: each device's routed rows go through the experts at once. Else in equal chunks,
  one after the other, whose hidden layer ([rows, d_ff]) takes at most this many bytes
  where the rows halve evenly (`_chunk_rows`), each rematerialised on its own in the
  backward pass: for a layer rematerialised whole (the Llama's `remat_policy="full"`),
  whose backward pass would otherwise hold every row's hidden layers at once. Where
  the `expert` axis splits the experts (`_expert_parallel`) the rows go at once."""

  def __post_init__(self):
    # Named as the Llama's config fields name them, where the errors are met.
    for name, value in (("moe_experts", self.num_experts), ("moe_top_k", self.top_k)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    if isinstance(self.d_ff, bool) or not isinstance(self.d_ff, int) or self.d_ff < 1:
      raise ValueError(f"moe_d_ff={self.d_ff!r} must be a positive integer")
    shared = self.shared_d_ff
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
      raise ValueError(f"moe_shared_d_ff={shared!r} must be a non-negative integer")
    if self.top_k > self.num_experts:
      raise ValueError(f"moe_top_k={self.top_k} must be at most moe_experts={self.num_experts}")
    if self.gate not in GATES:
      raise ValueError(f"moe_gate={self.gate!r} must be one of {GATES}")
    for name, value in (("moe_norm_topk", self.norm_topk), ("moe_shared_gate", self.shared_gate)):
      if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")


class RouterStats(NamedTuple):
  """One routed layer's auxiliary losses and load, over the tokens it routed (float32)."""

  load_balancing_loss: jax.Array
  """`num_experts * sum_i f_i * P_i` (1.0 when balanced)."""
  z_loss: jax.Array
  """Mean over tokens of `logsumexp(logits) ** 2`."""
  expert_share: jax.Array
  """[experts]: the fraction of the tokens' choices each expert took (sums to 1)."""
  dropped: jax.Array
  """The fraction of choices dropped: 0, since dispatch is dropless."""


def route(
  logits: jax.Array, top_k: int, gate: str, norm_topk: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`(experts, gates, probs)` of float32 router logits [tokens, num_experts].

  `experts` int32 [tokens, top_k] are the chosen experts, best first;
  `gates` [tokens, top_k] their weights; `probs` [tokens, num_experts] the
  router's probabilities for the load-balancing loss (see the module).

  Example:
    >>> logits = jnp.log(jnp.array([[1.0, 2.0, 3.0, 4.0]]))
    >>> experts, gates, _ = route(logits, 2, "softmax", norm_topk=True)
    >>> experts.tolist(), [round(g, 6) for g in gates[0].tolist()]
    ([[3, 2]], [0.571429, 0.428571])
  """
  if gate == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    probs = scores
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  # A stable sort along the experts' axis rather than `lax.top_k`: XLA's
  # TopK gathers a batch-split operand onto every device before it runs, a
  # sort along an unsplit axis stays local. Ties go to the lower index, as
  # top_k's do.
  experts = jnp.argsort(-scores, axis=-1, stable=True)[..., :top_k]
  # Each choice's score picked by a one-hot select and a sum rather than a
  # gather: a TPU gathers one scalar at a time, and the gather's gradient is a
  # scatter-add; the select and its gradient are elementwise, and as exact
  # (one term of each sum is not zero).
  chosen = experts[..., None] == jnp.arange(scores.shape[-1])
  gates = jnp.sum(jnp.where(chosen, scores[..., None, :], 0.0), axis=-1)
  if norm_topk:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return experts.astype(jnp.int32), gates, probs


def router_stats(
  logits: jax.Array, experts: jax.Array, probs: jax.Array, num_experts: int
) -> RouterStats:
  """The auxiliary losses and the load of one routing (`route`'s outputs, float32).

  Any leading axes (groups of tokens) are tokens too: the stats are over all.

  Example:
    >>> logits = jnp.zeros((4, 2))  # every expert equally likely
    >>> stats = router_stats(logits, jnp.array([[0], [0], [1], [1]]), jax.nn.softmax(logits), 2)
    >>> float(stats.load_balancing_loss), round(float(stats.z_loss), 6)
    (1.0, 0.480453)
  """
  leading = tuple(range(experts.ndim))  # every axis but the experts': [..., tokens, k]
  counts = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=leading)
  share = counts / experts.size
  mean_probs = jnp.mean(probs.reshape(-1, num_experts), axis=0)
  balance = num_experts * jnp.sum(share * mean_probs)
  z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
  return RouterStats(balance, z_loss, share, jnp.zeros((), jnp.float32))


def _expert_init(in_axis: int, out_axis: int):
  """LeCun normal over each expert's input dimension (the experts axis is a batch axis)."""
  return nnx.initializers.variance_scaling(
    1.0, "fan_in", "normal", in_axis=in_axis, out_axis=out_axis, batch_axis=(0,)
  )


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`x` [rows, in] sorted by group, times each group's `w` [groups, in, out], in x's dtype.

  As `trainers.models.matmul.matmul` does for a dense weight: a wider `w`
  (float32 under the bfloat16 policy) is cast inside a custom VJP, so its
  gradient, a sum over each group's rows, is accumulated in float32 and
  returned in `w`'s dtype, never rounded to the compute dtype first.

  Example:
    >>> x, w = jnp.ones((3, 2)), jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
    >>> grouped_matmul(x, w, jnp.array([1, 2], jnp.int32)).tolist()
    [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]
  """
  tiling = weight_gradient_tiling(x.shape[0], x.shape[1], w.shape[2], w.shape[0])
  # Static, chosen here where the program's platform is known (a plan for a TPU
  # traces on a CPU machine): tgmm's tile, and whether it runs interpreted.
  tgmm = None if tiling is None else (tiling, attention.current_platform() != "tpu")
  rows_tiles = None if tgmm is None else row_tilings(x.shape[0], x.shape[1], w.shape[2], w.shape[0])
  if _varying(x):
    # Inside a shard_map that checks what varies over its axes, JAX refuses
    # megablox's kernel (its output's shape does not say): XLA's ragged dot.
    # The routed shard_maps turn the check off where tgmm runs (`_checks_vma`).
    tgmm = rows_tiles = None
  if jnp.dtype(w.dtype) == jnp.dtype(x.dtype) and tgmm is None:
    return jax.lax.ragged_dot(x, w, group_sizes)
  kernels = (tgmm, rows_tiles)
  # Inside a shard_map, a weight the same on every device (invariant) times
  # rows that differ (varying) has a gradient that differs per device until
  # summed: made varying here, its gradient is summed by the cast's transpose,
  # and the custom VJP's gradient has its input's type.
  missing = tuple(sorted(_varying(x) - _varying(w)))
  if missing:
    w = jax.lax.pcast(w, missing, to="varying")
  return _narrowed_grouped(x, w, group_sizes, kernels)


def _varying(x: jax.Array) -> frozenset:
  """The manual mesh axes x differs over (inside a shard_map; outside: none)."""
  manual = getattr(jax.typeof(x), "manual_axis_type", None)  # JAX 0.10; `vma` before it
  return frozenset(manual.varying if manual is not None else getattr(jax.typeof(x), "vma", ()))


WEIGHT_GRADIENT_KERNEL = "auto"
"""Which kernel sums each group's weight gradient (the rows of a group contracted):
"tgmm", megablox's grouped kernel, over each group's own rows; "xla", XLA's
`ragged_dot_general`, which libtpu lowers densely over the groups (every group's
weight against every row: experts ÷ top_k times the FLOPs); "auto", tgmm where the
program is for a TPU and its shapes tile (`weight_gradient_tiling`), else XLA. A
split step's routing runs in a shard_map, which then does not check what varies
over its axes (`_checks_vma`). On a v5e chip tgmm gave the same gradients bit for
bit and a faster step (docs/performance.md, E-P9). Elsewhere tgmm runs
interpreted: for tests only."""

# tgmm's tiles, largest first: rows, the weight's input and output widths. At
# 1024 x 512 x 1024 a tile's operands and float32 sums fit a v5e core's scoped
# VMEM; 512 x 1024 x 1024 did not.
_TGMM_TILES = ((1024, 512, 256, 128), (512, 256, 128), (1024, 512, 256, 128))


def weight_gradient_tiling(
  rows: int, d_in: int, d_out: int, groups: int
) -> tuple[int, int, int] | None:
  """tgmm's (rows, in, out) tile for these shapes if it sums the weight gradients, else None.

  A tile of rows is at most a group's even share: tgmm computes each tile a
  group boundary crosses once for each of its groups, at most a tile more
  a group.

  Example:
    >>> with _kernel("tgmm"):
    ...   weight_gradient_tiling(32768, 1536, 1024, groups=8)
    (1024, 512, 1024)
    >>> with _kernel("tgmm"):
    ...   weight_gradient_tiling(1024, 256, 512, groups=4)
    (256, 256, 512)
    >>> with _kernel("tgmm"):
    ...   weight_gradient_tiling(100, 1536, 1024, groups=8) is None  # no tile divides 100
    True
  """
  kernel = WEIGHT_GRADIENT_KERNEL
  if kernel == "auto":
    kernel = "tgmm" if attention.current_platform() == "tpu" else "xla"
  if kernel == "xla":
    return None
  fitting = _fitting_tiles(_TGMM_TILES, rows, d_in, d_out, groups)
  return tuple(t[0] for t in fitting) if all(fitting) else None


def _fitting_tiles(tiles, rows: int, k: int, n: int, groups: int) -> list[list[int]]:
  """For rows, k and n, the sizes of `tiles` (three tuples, largest first) that divide it;
  a tile of rows at most a group's even share (a kernel visits a tile that a group
  boundary crosses once for each of its groups)."""
  return [
    [t for t in sizes if size % t == 0 and t <= share]
    for sizes, size, share in zip(tiles, (rows, k, n), (rows // groups, k, n))
  ]


ROW_KERNEL = "auto"
"""Which kernel multiplies the rows by their group's weight, forward and for the rows'
gradient, where tgmm sums the weight gradients (`weight_gradient_tiling`): "xla",
XLA's ragged dot (libtpu's own grouped matmul); "gmm", megablox's grouped kernel;
"auto", gmm where the program is for a TPU. On a v5e chip gmm made the routed
step faster than libtpu's grouped matmul (docs/performance.md, E-P9)."""

# gmm's tiles, largest first: rows, the contracted width, the output width.
_GMM_TILES = ((1024, 512, 256, 128), (1024, 512, 256, 128), (1024, 512, 256, 128))
# Under the 16 MiB a TPU core's kernels may take by default, with room for
# Mosaic's own scratch.
_GMM_VMEM_BYTES = 12 * 2**20


def _gmm_vmem_bytes(tm: int, tk: int, tn: int) -> int:
  """gmm's VMEM for one tile: both bfloat16 operands twice (double-buffered), its float32
  sums, and its output twice."""
  return 2 * 2 * (tm * tk + tk * tn) + 4 * tm * tn + 2 * 2 * tm * tn


def row_tilings(
  rows: int, d_in: int, d_out: int, groups: int
) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
  """gmm's tiles for the forward [rows, d_in] x [d_in, d_out] and the rows' gradient, or None.

  None where the kernel is XLA's (`ROW_KERNEL`) or no tile divides the shapes. A tile
  of rows is at most a group's even share, as tgmm's (`weight_gradient_tiling`).

  Example:
    >>> with _kernel("tgmm", rows="gmm"):
    ...   row_tilings(32768, 1536, 1024, groups=8)
    ((1024, 512, 1024), (1024, 1024, 512))
  """
  kernel = ROW_KERNEL
  if kernel == "auto":
    kernel = "gmm" if attention.current_platform() == "tpu" else "xla"
  if kernel != "gmm":
    return None

  def tile(k: int, n: int):
    tm, tk, tn = _fitting_tiles(_GMM_TILES, rows, k, n, groups)
    if not (tm and tk and tn):
      return None
    # The widest tiles whose double-buffered bfloat16 operands, float32 sums and
    # output fit the core's scoped VMEM; the wider of the two widths narrows first.
    while _gmm_vmem_bytes(tm[0], tk[0], tn[0]) > _GMM_VMEM_BYTES:
      widest = tk if tk[0] >= tn[0] else tn
      if len(widest) == 1:
        return None
      widest.pop(0)
    return tm[0], tk[0], tn[0]

  forward, backward = tile(d_in, d_out), tile(d_out, d_in)
  return (forward, backward) if forward and backward else None


def _checks_vma(rows: int, d_model: int, d_ff: int, groups: int) -> bool:
  """Whether a routed shard_map may check what varies over its axes: not where tgmm runs.

  Its grouped matmuls are [rows, d_model] by [groups, d_model, d_ff] (gate,
  up) and [rows, d_ff] by [groups, d_ff, d_model] (down), on one device's
  shapes. JAX refuses megablox's kernel inside a shard_map that checks (the
  kernel's output shape does not say what varies), so a shard_map where tgmm
  sums a weight gradient runs unchecked, as MaxText's does. Unchecked, JAX
  transposes as it did before the check existed, and as exactly: the gradient
  of an input whose spec leaves out a mesh axis (the weights, over the batch
  axes) is summed over that axis once, at the shard_map's edge; an output's
  cotangent is divided by the size of the axes its spec leaves out and summed
  back by psum's transpose, an all-reduce of the cotangent that the checked
  transpose does without. So the check stays on where XLA's ragged dot runs.
  """
  shapes = ((d_model, d_ff), (d_ff, d_model))
  return all(weight_gradient_tiling(rows, a, b, groups) is None for a, b in shapes)


@contextlib.contextmanager
def _kernel(name: str, rows: str | None = None):
  """`WEIGHT_GRADIENT_KERNEL` (and `ROW_KERNEL`) set inside (for the examples and tests)."""
  global WEIGHT_GRADIENT_KERNEL, ROW_KERNEL
  before = WEIGHT_GRADIENT_KERNEL, ROW_KERNEL
  WEIGHT_GRADIENT_KERNEL, ROW_KERNEL = name, rows or ROW_KERNEL
  try:
    yield
  finally:
    WEIGHT_GRADIENT_KERNEL, ROW_KERNEL = before


# The weight's gradient: x [rows, in] and the cotangent [rows, out] contracted
# over the rows of each group (the rows are the ragged dimension) -> [groups, in, out].
_WEIGHT_GRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def _rows_times(x, w, group_sizes, kernels, *, backward: bool = False) -> jax.Array:
  """Each group's rows of x times its w (transposed for the rows' gradient), in x's dtype.

  `kernels`: (tgmm's, gmm's tiles); gmm's tiles None for XLA's ragged dot (forward only).
  """
  tgmm, rows_tiles = kernels
  if rows_tiles is None:
    return jax.lax.ragged_dot(x, w, group_sizes)
  megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  return megablox.gmm(
    x,
    w,
    group_sizes.astype(jnp.int32),
    preferred_element_type=x.dtype,
    tiling=rows_tiles[1 if backward else 0],
    transpose_rhs=backward,
    interpret=tgmm[1],
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _narrowed_grouped(x: jax.Array, w: jax.Array, group_sizes: jax.Array, kernels) -> jax.Array:
  return _rows_times(x, w.astype(x.dtype), group_sizes, kernels)


def _narrowed_grouped_fwd(x, w, group_sizes, kernels):
  narrow = w.astype(x.dtype)
  marker = jnp.zeros((0,), w.dtype)  # carries w's dtype into the backward pass
  return _rows_times(x, narrow, group_sizes, kernels), (x, narrow, group_sizes, marker)


def _narrowed_grouped_bwd(kernels, residuals, g):
  x, narrow, group_sizes, marker = residuals
  if kernels[1] is None:
    _, x_vjp = jax.vjp(lambda x: jax.lax.ragged_dot(x, narrow, group_sizes), x)
    (dx,) = x_vjp(g)
  else:
    dx = _rows_times(g, narrow, group_sizes, kernels, backward=True)
  weight_grad = _weight_gradient(x, g, group_sizes, kernels[0])
  return dx, weight_grad.astype(marker.dtype), None


def _weight_gradient(x: jax.Array, g: jax.Array, group_sizes: jax.Array, tgmm) -> jax.Array:
  """Each group's x [rows, in] contracted with g [rows, out] over its rows: [groups, in, out], f32.

  `tgmm`: (tgmm's tile, interpreted or not), or None for XLA's ragged dot.
  """
  if tgmm is None:
    return jax.lax.ragged_dot_general(
      x, g, group_sizes, _WEIGHT_GRAD_DIMS, preferred_element_type=jnp.float32
    )
  # The module itself: the package's `gmm` attribute is its grouped-matmul function.
  megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  return megablox.tgmm(
    x.swapaxes(0, 1),
    g,
    group_sizes.astype(jnp.int32),
    preferred_element_type=jnp.float32,
    tiling=tgmm[0],
    interpret=tgmm[1],
  )


_narrowed_grouped.defvjp(_narrowed_grouped_fwd, _narrowed_grouped_bwd)


class SwiGLU(nnx.Module):
  """`down(silu(gate(x)) * up(x))` of width `d_ff`: the shared expert."""

  def __init__(self, d_model: int, d_ff: int, param_dtype: jnp.dtype, *, rngs: nnx.Rngs):
    self.gate = param(rngs, fan_in_init(0, 1), (d_model, d_ff), ("embed", "mlp"), param_dtype)
    self.up = param(rngs, fan_in_init(0, 1), (d_model, d_ff), ("embed", "mlp"), param_dtype)
    self.down = param(rngs, fan_in_init(0, 1), (d_ff, d_model), ("mlp", "embed"), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.silu(dense(x, self.gate[...])) * dense(x, self.up[...])
    return dense(h, self.down[...])


class MoE(nnx.Module):
  """The routed MLP: x [..., d_model] -> y [..., d_model] (see the module)."""

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    self.config = config
    d, e, f = config.d_model, config.num_experts, config.d_ff
    pdt = jnp.dtype(config.param_dtype)
    self.router = param(rngs, fan_in_init(0, 1), (d, e), ("embed", "experts"), pdt)
    self.expert_gate = param(rngs, _expert_init(1, 2), (e, d, f), ("experts", "embed", "mlp"), pdt)
    self.expert_up = param(rngs, _expert_init(1, 2), (e, d, f), ("experts", "embed", "mlp"), pdt)
    self.expert_down = param(rngs, _expert_init(1, 2), (e, f, d), ("experts", "mlp", "embed"), pdt)
    if config.shared_d_ff:
      self.shared = SwiGLU(d, config.shared_d_ff, pdt, rngs=rngs)
      if config.shared_gate:
        self.shared_gate = param(rngs, fan_in_init(0, ()), (d,), ("embed",), pdt)

  def __call__(self, x: jax.Array) -> jax.Array:
    """The output alone (decoding and evals: dispatch is dropless, so it routes as training)."""
    return self.routed(x)[0]

  def routed(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
    """The output, in x's dtype, and the routing's `RouterStats` over x's tokens."""
    config = self.config
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    weights = (self.expert_gate[...], self.expert_up[...], self.expert_down[...])
    # The router in float32: in bfloat16 near-equal logits swap their order,
    # and the exponentials of the gates and z-loss lose their bits.
    router = self.router[...].astype(jnp.float32)
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router)
    if x.ndim == 3:  # [batch, length, d]; other shapes are routed as one group
      logits = constrain(logits, ("batch", "length", None))
    experts, gates, probs = route(logits, config.top_k, config.gate, config.norm_topk)
    stats = router_stats(logits, experts, probs, config.num_experts)
    layout = _expert_layout(x.shape, config.num_experts)
    if layout is not None:
      # Expert parallel: each device routes its own tokens and sends them to
      # the devices that hold their experts (`_expert_parallel`).
      y = _expert_parallel(layout, x, experts, gates, *weights).reshape(-1, d)
    else:
      y = _routed_per_device(x, experts, gates, weights, config.chunk_bytes)
    y = y.astype(x.dtype)
    if config.shared_d_ff:
      shared = self.shared(tokens)
      if config.shared_gate:
        scale = jax.nn.sigmoid(
          jnp.dot(tokens.astype(jnp.float32), self.shared_gate[...].astype(jnp.float32))
        )
        shared = (shared.astype(jnp.float32) * scale[:, None]).astype(x.dtype)
      y = y + shared
    return y.reshape(*lead, d), stats


def _routed_per_device(x, experts, gates, weights, chunk_bytes: int = 0) -> jax.Array:
  """Every expert on every device: x [..., d] and its routing, float32 [n, d] out.

  Each device sorts and runs its own rows, inside a `shard_map` over the
  mesh: sorted over the whole batch, the tokens would be gathered onto
  every device and every device would run every token's experts. The
  experts' weights come whole along d_model (gathered over fsdp, as an FSDP
  layer's are) and split along d_ff as the rules split `mlp`, whose partial
  sums are added. Why not `jax.vmap` over per-device groups of rows: it
  gives the grouped matmuls a batch dimension, which libtpu's grouped
  matmul refuses ("number of batch dimensions should be 0"), so no routed
  model compiled for more than one TPU chip.
  """
  d, k = x.shape[-1], experts.shape[-1]
  layout = _per_device_layout(x.shape)
  if layout is None:
    flat = (x.reshape(-1, d), experts.reshape(-1, k), gates.reshape(-1, k))
    return _dispatch(*flat, *weights, chunk_bytes=chunk_bytes)
  mesh, t, mlp_axes = layout
  up = jax.sharding.PartitionSpec(None, None, mlp_axes or None)
  down = jax.sharding.PartitionSpec(None, mlp_axes or None, None)

  def local(x, experts, gates, w_gate, w_up, w_down):
    flat = (x.reshape(-1, d), experts.reshape(-1, k), gates.reshape(-1, k))
    y = _dispatch(*flat, w_gate, w_up, w_down, chunk_bytes=chunk_bytes)
    if mlp_axes:
      y = jax.lax.psum(y, mlp_axes)
    return y.reshape(*x.shape[:-1], d)

  rows = math.prod(x.shape[:-1]) // _devices(mesh, t) * k
  d_ff = weights[0].shape[2] // _devices(mesh, mlp_axes)
  # The grouped matmuls' rows: a chunk's where the rows go in chunks.
  rows = _chunk_rows(rows, d_ff, x.dtype, chunk_bytes)
  check = _checks_vma(rows, d, d_ff, weights[0].shape[0])
  placed = jax.shard_map(
    local, mesh=mesh, in_specs=(t, t, t, up, up, down), out_specs=t, check_vma=check
  )
  return placed(x, experts, gates, *weights).reshape(-1, d)


def _dispatch(
  tokens: jax.Array,
  experts: jax.Array,
  gates: jax.Array,
  w_gate: jax.Array,
  w_up: jax.Array,
  w_down: jax.Array,
  chunk_bytes: int = 0,
) -> jax.Array:
  """The experts' SwiGLU of tokens [n, d] routed to `experts` [n, k], combined by `gates` (f32).

  Dropless: each (token, choice) pair sorted by expert, so each expert's
  rows are one contiguous group of the grouped matmuls; in chunks of rows
  with `chunk_bytes` (`MoEConfig.chunk_bytes`).
  """
  top_k, num_experts = experts.shape[-1], w_gate.shape[0]
  # Pairs in (choice, token) order: pair c * n + t is token t's choice c, so
  # that the experts' outputs, put back, are [top_k, n, d], whole [n, d]
  # blocks a choice. In (token, choice) order they were [n, top_k, d], whose
  # second-to-last axis of 2 a TPU tiles by 8: a relayout copy of every
  # output (and its float32 widening) on the chip (E-P9, docs/performance.md).
  flat = experts.T.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  unsort = jnp.argsort(order)
  sizes = group_sizes(flat, num_experts)
  rows = _token_copies(top_k, tokens, order, unsort)
  chunk = _chunk_rows(rows.shape[0], w_gate.shape[2], rows.dtype, chunk_bytes)
  if chunk == rows.shape[0]:
    gate = checkpoint_name(grouped_matmul(rows, w_gate, sizes), "mlp_gate")
    up = checkpoint_name(grouped_matmul(rows, w_up, sizes), "mlp_up")
    out = grouped_matmul(jax.nn.silu(gate) * up, w_down, sizes)
    weights = gates.T  # each choice's block weighed as it is summed
  else:
    # In chunks (a layer rematerialised whole): each row weighed by its gate
    # before the down projection, not its output after it. The gate's gradient
    # is then the row's hidden layer times the hidden layer's gradient, which
    # the backward pass computes anyway, so no gradient needs the expert's
    # output; weighed after it, the rematerialised backward pass ran the down
    # projection again and held its output, put back in token order, beside
    # the hidden layers at the layer's peak. Only here: it gathers each pair's
    # gate one scalar at a time, which a TPU runs slowly (E-P9's step, whose
    # policy keeps the hidden layers, weighs the outputs instead).
    weight = _permuted(gates.T.reshape(-1), order, unsort)
    out = _chunked_expert_mlp(chunk, rows, weight, sizes, w_gate, w_up, w_down)
    weights = None
  # Back in (choice, token) order by the inverse permutation: a gather, not a scatter.
  out = _permuted(out, unsort, order).reshape(top_k, tokens.shape[0], -1)
  return _sum_of_choices(out, weights)


def _expert_mlp(rows, weight, sizes, w_gate, w_up, w_down) -> jax.Array:
  """Each group's SwiGLU of `rows` [rows, d] sorted by group, each row weighed by its gate
  before the down projection (see `_dispatch`)."""
  gate = checkpoint_name(grouped_matmul(rows, w_gate, sizes), "mlp_gate")
  up = checkpoint_name(grouped_matmul(rows, w_up, sizes), "mlp_up")
  hidden = jax.nn.silu(gate) * up
  hidden = (hidden.astype(jnp.float32) * weight[:, None]).astype(hidden.dtype)
  return grouped_matmul(hidden, w_down, sizes)


CHUNK_BYTES = 2**28
"""`MoEConfig.chunk_bytes` under the Llama's full remat (`LlamaConfig.moe_config`). A chunk's
backward pass holds about five of its hidden layers at once (the gate's and the up
projection's, recomputed, and the gradients); smaller chunks hold less, and each adds a
tile of rows for every group boundary inside it to the grouped matmuls' work."""


def _chunk_rows(rows: int, d_ff: int, dtype, chunk_bytes: int) -> int:
  """Rows in a chunk of `_chunked_expert_mlp`: `rows` halved while a chunk's hidden layer
  [rows, d_ff] takes more than `chunk_bytes` (0: no limit) and the halves stay whole
  multiples of 1024 rows (a tile of tgmm's).

  Example:
    >>> _chunk_rows(294912, 14336, jnp.bfloat16, 2**28), _chunk_rows(294912, 14336, jnp.bfloat16, 0)
    (9216, 294912)
    >>> _chunk_rows(3000, 14336, jnp.bfloat16, 2**20)  # no even halves of whole tiles
    3000
  """
  chunk, itemsize = rows, jnp.dtype(dtype).itemsize
  while chunk_bytes and chunk * d_ff * itemsize > chunk_bytes and chunk % 2048 == 0:
    chunk //= 2
  return chunk


def _chunked_expert_mlp(chunk, rows, weight, sizes, w_gate, w_up, w_down) -> jax.Array:
  """`_expert_mlp` over `rows` in chunks of `chunk` rows, a `lax.scan` over them.

  Each chunk's groups are the parts of the groups inside it. The chunks'
  bodies are rematerialised whatever the layer's remat policy saves: their
  backward pass recomputes one chunk's hidden layers at a time, where the
  whole rows' would be held at once.
  """
  count, bounds = rows.shape[0] // chunk, jnp.cumsum(sizes)
  start = jnp.arange(count, dtype=sizes.dtype)[:, None] * chunk
  inside = jnp.minimum(bounds, start + chunk) - jnp.maximum(bounds - sizes, start)
  chunk_sizes = jnp.maximum(inside, 0).astype(jnp.int32)

  def body(carry, xs):
    return carry, _expert_mlp(*xs, w_gate, w_up, w_down)

  body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
  xs = (rows.reshape(count, chunk, -1), weight.reshape(count, chunk), chunk_sizes)
  return jax.lax.scan(body, None, xs)[1].reshape(rows.shape[0], -1)


def group_sizes(ids: jax.Array, groups: int) -> jax.Array:
  """int32 [groups]: how many of `ids` (any shape) are each of 0 .. groups - 1.

  A comparison with each group and a sum, not `jnp.bincount`: a scatter-add
  of ones, which a TPU runs one element at a time.

  Example:
    >>> group_sizes(jnp.array([2, 0, 2, 3]), 3).tolist()
    [1, 0, 2]
  """
  return jnp.sum(ids.reshape(-1, 1) == jnp.arange(groups), axis=0, dtype=jnp.int32)


# The two row shuffles of the dispatch, with the backward JAX cannot see: it
# transposes a gather to a scatter-add, slow on a TPU (E-P9,
# docs/performance.md), where both are a permutation and its inverse, so
# their gradients are gathers too.
@jax.custom_vjp
def _permuted(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
  """`x[index]` for a permutation `index` whose inverse is `inverse`."""
  return x[index]


def _permuted_fwd(x, index, inverse):
  return x[index], inverse


def _permuted_bwd(inverse, g):
  return g[inverse], None, None


_permuted.defvjp(_permuted_fwd, _permuted_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _token_copies(top_k: int, tokens: jax.Array, order: jax.Array, unsort: jax.Array) -> jax.Array:
  """`tokens[order % n]`: each of n tokens' `top_k` copies, in the pairs' `order`.

  `order` is a permutation of the k n pairs in (choice, token) order and
  `unsort` its inverse. The gradient puts the copies back by `unsort` and
  sums each token's k of them, in float32.
  """
  return tokens[order % tokens.shape[0]]


def _token_copies_fwd(top_k, tokens, order, unsort):
  return tokens[order % tokens.shape[0]], unsort


def _token_copies_bwd(top_k, unsort, g):
  copies = g[unsort].reshape(top_k, -1, g.shape[-1])
  return _sum_of_choices(copies).astype(g.dtype), None, None


def _sum_of_choices(blocks: jax.Array, weights: jax.Array | None = None) -> jax.Array:
  """The float32 sum of `blocks` [k, n, d] over k, each block weighed by `weights` [k, n].

  Written as k slices so that XLA widens each inside one fused loop; a
  reduction or a dot over the stacked blocks made the TPU write a float32
  copy of all of them first.
  """
  total = None
  for c in range(blocks.shape[0]):
    term = blocks[c].astype(jnp.float32)
    if weights is not None:
      term = term * weights[c][:, None]
    total = term if total is None else total + term
  return total


_token_copies.defvjp(_token_copies_fwd, _token_copies_bwd)


@dataclasses.dataclass(frozen=True)
class _ExpertLayout:
  """Where a routed layer's tokens and experts live under the active rules (expert parallel)."""

  mesh: jax.sharding.Mesh
  tokens: jax.sharding.PartitionSpec  # x [batch, length, d] and its routing [batch, length, k]
  up: jax.sharding.PartitionSpec  # expert_gate, expert_up [experts, d_model, d_ff]
  down: jax.sharding.PartitionSpec  # expert_down [experts, d_ff, d_model]
  expert_axes: tuple[str, ...]  # the mesh axes that split the experts
  gathered: bool  # the tokens are split over them too (else each holds them all)
  mlp_axes: tuple[str, ...]  # the mesh axes that split d_ff (partial sums to add)


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _expert_layout(shape: tuple[int, ...], num_experts: int) -> _ExpertLayout | None:
  """The expert-parallel layout of x [batch, length, d], or None where it does not apply.

  None outside the rules, inside a shard_map, where the rules put `experts`
  on no mesh axis (of size > 1), for inputs other than [batch, length, d], or
  where the rows or the sequence do not split evenly (a decoding step's few
  rows): then every device runs every expert (`_routed_per_device`).
  """
  found = _token_split(shape)
  if found is None:
    return None
  active_rules, mesh, padded = found
  spec = lambda names: rules.logical_to_spec(names, active_rules, mesh)  # noqa: E731
  up, down = spec(("experts", None, "mlp")), spec(("experts", "mlp"))
  expert_axes = _axes(up[0] if len(up) else None)
  if not expert_axes:
    return None
  if num_experts % math.prod(mesh.shape[a] for a in expert_axes):
    raise ValueError(
      f"moe_experts={num_experts} is not divisible by the {expert_axes} mesh axes "
      f"of {dict(mesh.shape)} that split the experts"
    )
  split = set(_axes(padded[0])) | set(_axes(padded[1]))
  if not set(expert_axes) <= split and split & set(expert_axes):
    return None  # tokens split over some of the expert axes only: no layout here
  return _ExpertLayout(
    mesh=mesh,
    tokens=jax.sharding.PartitionSpec(*padded),
    up=jax.sharding.PartitionSpec(*up),
    down=jax.sharding.PartitionSpec(*down),
    expert_axes=expert_axes,
    gathered=set(expert_axes) <= split,
    mlp_axes=_axes(up[2] if len(up) > 2 else None),
  )


def _expert_parallel(layout: _ExpertLayout, x, experts, gates, w_gate, w_up, w_down) -> jax.Array:
  """The routed experts' output [batch, length, d] in x's dtype, each expert on its own devices.

  Inside a `shard_map` over the whole mesh, each device holds its rows'
  tokens and routing, and the weights of its `experts / E` experts (E: the
  expert axes' size), whole along d_model (gathered over fsdp as an FSDP
  layer's are) and split along d_ff as the rules split `mlp`. The tokens of
  the E devices of an expert group are all-gathered among them; each device
  runs its own experts on the (token, choice) pairs routed to them, weights
  each output by its gate, and the outputs are summed back onto the devices
  the tokens came from by a reduce-scatter over the expert group (and
  summed over the `mlp` axes, which hold partial sums). Dropless: the
  grouped matmuls take a static `tokens * E * min(top_k, experts / E)` rows,
  the most a device's experts can be sent.

  Why an all-gather and not an all-to-all: an all-to-all of static buffers
  moves, dropless, a worst-case block of `tokens * min(top_k, experts / E)`
  rows to each other device, at least what the all-gather moves (`tokens`
  rows to each); XLA's ragged all-to-all, which moves only the routed rows,
  does not run on CPU. docs/training.md gives the bytes.
  """
  top_k = experts.shape[-1]

  def local(x, experts, gates, w_gate, w_up, w_down):
    shape, d = x.shape, x.shape[-1]
    tokens, experts, gates = x.reshape(-1, d), experts.reshape(-1, top_k), gates.reshape(-1, top_k)
    group = layout.expert_axes
    if layout.gathered:
      tokens, experts, gates = (
        jax.lax.all_gather(a, group, axis=0, tiled=True) for a in (tokens, experts, gates)
      )
    mine = w_gate.shape[0]  # this device's experts: mine * index .. mine * (index + 1) - 1
    owned = experts - mine * jax.lax.axis_index(group)
    owned = jnp.where((owned >= 0) & (owned < mine), owned, mine).reshape(-1)  # mine: elsewhere
    bound = tokens.shape[0] * min(top_k, mine)
    order = jnp.argsort(owned, stable=True)[:bound]
    sizes = group_sizes(owned, mine)  # the index `mine` (other devices' experts) is left out
    rows = tokens[order // top_k]
    gate = checkpoint_name(grouped_matmul(rows, w_gate, sizes), "mlp_gate")
    up = checkpoint_name(grouped_matmul(rows, w_up, sizes), "mlp_up")
    out = grouped_matmul(jax.nn.silu(gate) * up, w_down, sizes)
    # Rows past the groups (choices of other devices' experts) weigh nothing.
    weight = jnp.where(jnp.arange(bound) < jnp.sum(sizes), gates.reshape(-1)[order], 0.0)
    y = (
      jnp.zeros(tokens.shape, jnp.float32)
      .at[order // top_k]
      .add(out.astype(jnp.float32) * weight[:, None])
    )
    y = y.astype(x.dtype)
    if layout.gathered:
      y = jax.lax.psum_scatter(y, group, scatter_dimension=0, tiled=True)
    else:
      y = jax.lax.psum(y, group)
    if layout.mlp_axes:
      y = jax.lax.psum(y, layout.mlp_axes)
    return y.reshape(shape)

  t, mesh, (num_experts, d, d_ff) = layout.tokens, layout.mesh, w_gate.shape
  # One device's grouped matmuls: its bound of rows, its experts, its share of d_ff.
  group = _devices(mesh, layout.expert_axes)
  tokens = math.prod(x.shape[:-1]) // _devices(mesh, t) * (group if layout.gathered else 1)
  mine = num_experts // group
  local_d_ff = d_ff // _devices(mesh, layout.mlp_axes)
  placed = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(t, t, t, layout.up, layout.up, layout.down),
    out_specs=t,
    check_vma=_checks_vma(tokens * min(top_k, mine), d, local_d_ff, mine),
  )
  return placed(x, experts, gates, w_gate, w_up, w_down)


def _devices(mesh: jax.sharding.Mesh, spec) -> int:
  """How many devices split an array over the mesh axes `spec` names (a spec or axes)."""
  return math.prod(mesh.shape[a] for entry in spec for a in _axes(entry))


def _token_split(shape: tuple[int, ...]):
  """`(rules, mesh, the tokens' spec along batch and length)` for x [batch, length, d], or None.

  None outside the rules, inside a shard_map, for inputs other than
  [batch, length, d], or where the rows or the sequence do not split evenly
  over their mesh axes (a decoding step's few rows).
  """
  active = rules.active_rules()
  if active is None or jax.sharding.get_abstract_mesh().manual_axes or len(shape) != 3:
    return None
  active_rules, mesh = active
  tokens = (*rules.logical_to_spec(("batch", "length"), active_rules, mesh), None, None)[:2]
  for dim, entry in enumerate(tokens):
    if shape[dim] % math.prod(mesh.shape[a] for a in _axes(entry)):
      return None
  return active_rules, mesh, tokens


def _per_device_layout(shape: tuple[int, ...]):
  """`(mesh, tokens' spec, mlp axes)` for routing x [batch, length, d] per device, or None.

  None where `_token_split` is, or where no device count above 1 splits the
  tokens: then they are routed as one group.
  """
  found = _token_split(shape)
  if found is None:
    return None
  active_rules, mesh, tokens = found
  if math.prod(mesh.shape[a] for entry in tokens for a in _axes(entry)) == 1:
    return None
  up = rules.logical_to_spec(("experts", None, "mlp"), active_rules, mesh)
  mlp_axes = _axes(up[2] if len(up) > 2 else None)
  return mesh, jax.sharding.PartitionSpec(*tokens), mlp_axes


def active_params(config: MoEConfig) -> int:
  """Parameters one token multiplies by: the router, `top_k` experts and the shared expert.

  Example:
    >>> active_params(MoEConfig(d_model=8, num_experts=4, top_k=2, d_ff=16, shared_d_ff=4))
    904
  """
  shared = 3 * config.d_model * config.shared_d_ff
  if config.shared_d_ff and config.shared_gate:
    shared += config.d_model
  experts = config.top_k * 3 * config.d_model * config.d_ff
  return config.d_model * config.num_experts + experts + shared


def total_params(config: MoEConfig) -> int:
  """Every parameter of `MoE(config)`.

  Example:
    >>> total_params(MoEConfig(d_model=8, num_experts=4, top_k=2, d_ff=16, shared_d_ff=4))
    1672
  """
  extra = config.num_experts - config.top_k
  return active_params(config) + extra * 3 * config.d_model * config.d_ff
