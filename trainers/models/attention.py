"""Causal self-attention for the built-in decoders, by one of three kernels.

`model.attention` chooses: "xla" writes attention out as einsums (the f32
scores [batch, heads, length, length] and a mask are real buffers);
"splash" runs the Pallas splash-attention kernel of
`jax.experimental.pallas.ops.tpu` (blocks of 128 to 512 tokens, the scores
never leave the chip's VMEM, segment ids for packed rows, grouped-query
heads read in place); "cudnn" runs cuDNN's flash attention through
`jax.nn.dot_product_attention(implementation="cudnn")`; "auto" takes splash
on TPU, cuDNN on GPU and XLA elsewhere. Where the chosen kernel cannot run
what was asked, XLA runs it and the log says why (`choose_kernel`):

- splash needs a sequence that is a multiple of 128 (its block size);
  on a platform other than TPU it runs in Pallas interpret mode: exact but
  slow, for checking its numerics on a CPU. Its bf16 matmuls are one bf16
  pass: under a `jax_default_matmul_precision` asking for more ("high",
  "highest", "float32", ...) Mosaic cannot compile them; its float32 ones
  are one pass or full float32 ("highest"), and Mosaic has no "high" or
  "tensorfloat32" for them. There "auto" takes XLA and an explicit "splash"
  is an error naming the setting.
- cuDNN's public API takes a causal mask but no segment ids, computes in
  bf16 or fp16 only, and takes a head_dim that is a multiple of 8 and at
  most 128 (what every GPU takes; Hopper's 256 is not used); on other
  platforms there is no cuDNN.

All kernels take queries [batch, length, heads, head_dim] and keys and
values [batch, length, kv_heads, head_dim], with `heads` a multiple of
`kv_heads` (query head i reads key/value head i // (heads // kv_heads)), and
return [batch, length, heads, head_dim] in the compute dtype. Splash is
placed on the mesh of the active logical-axis rules (`spmd.rules`) with
`jax.shard_map` over the batch and the heads, so each device runs the
kernel on its own rows and heads; XLA and cuDNN are partitioned by XLA.

With the sequence split over the mesh axis `context` (`spmd.context`),
each device all-gathers the keys and values and attends its own queries to
them, masked by each token's original place: splash in blocks of its own
slice (`splash_context_attention`, its block masks split with the queries),
else XLA (`context_attention`); cuDNN gives way to XLA there.

The choice is made when the model is traced, from the platform of the
active mesh (else JAX's default backend). Process 0 logs each new choice
once; `recorded_choices()` collects them for a caller that reports them
(`spmd-plan`).

Example:
  >>> q = jax.random.normal(jax.random.key(0), (1, 128, 4, 8))
  >>> kv = jax.random.normal(jax.random.key(1), (1, 128, 2, 8))
  >>> choose_kernel("auto", platform="cpu", length=128, dtype=q.dtype, segments=False).kernel
  'xla'
  >>> xla = attend(q, kv, kv, kernel="xla")
  >>> splash = attend(q, kv, kv, kernel="splash")  # Pallas interpret mode on a CPU
  >>> bool(jnp.allclose(xla, splash, rtol=1e-5, atol=1e-6))
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from spmd import compat
from spmd import context as context_lib
from spmd import rules as rules_lib

log = logging.getLogger(__name__)

KERNELS = ("auto", "xla", "splash", "cudnn")
"""The values of `model.attention`."""

SPLASH_PRECISIONS = (None, "default", "bfloat16")
"""The `jax_default_matmul_precision` values splash's bf16 kernel compiles under (one pass).
Each is offered in an error, so each is one JAX accepts (it no longer takes "fastest")."""

SPLASH_FLOAT32_PRECISIONS = (*SPLASH_PRECISIONS, "highest", "float32")
"""Those its float32 kernel compiles under: one pass, or full float32; Mosaic has no HIGH
("high", "tensorfloat32": three bf16 passes) and no named dot algorithms."""

SPLASH_BLOCKS = (1024, 512, 256, 128)
"""Splash's block sizes, largest first: the largest that divides the sequence is used.
On a v5e chip blocks of 1024 ran the 2048-token step faster than 512 and 256, and
2048 ran out of the kernel's VMEM (docs/performance.md, "On a TPU chip")."""

SPLASH_FLOAT32_MAX_BLOCK = 512
"""The largest splash block for float32 inputs: at 1024 the fused backward kernel asks
17.5 MiB of scoped VMEM, over the 16 MiB the v5e compiler allows, and the compile fails."""

SPLASH_RESIDUALS = "attention_core"
"""The name splash gives its residuals (its output and each row's log-sum-exp), so that a
remat policy can keep them (`trainers.models.layers.CHECKPOINT_POLICIES`) and the
backward pass does not run the attention's forward kernel again."""

SPLASH_FUSED_BACKWARD = True
"""Splash's backward pass in one kernel (dq, dk and dv together) rather than a dq
kernel and a dk/dv kernel, which recompute the scores twice: faster on a v5e chip.
Only up to `SPLASH_FUSED_BACKWARD_MAX_KEY_BLOCKS` key blocks."""

SPLASH_FUSED_BACKWARD_MAX_KEY_BLOCKS = 8
"""The most key blocks for which the backward pass is fused. The fused kernel writes
one partial query gradient per key block and sums them after, so it holds keys / block
copies of dq; the separate dq kernel holds one. With a `context` axis every device's
queries meet the whole gathered sequence's keys: hundreds of blocks, and the copies
would outweigh every other activation of the step. Up to 8 (8192 tokens in blocks of
1024) the fused kernel's speed is kept."""

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_Q_AXES = ("batch", "length", "heads", "kv")
_KV_AXES = ("batch", "length", "kv_heads", "kv")


@dataclasses.dataclass(frozen=True)
class Choice:
  """The kernel that runs (`kernel`), what was asked (`requested`) and why, for the log.

  `interpret`: splash runs in Pallas interpret mode (off TPU). `block`:
  splash's block size along the sequence.
  """

  kernel: str
  requested: str
  reason: str
  interpret: bool = False
  block: int | None = None

  def describe(self) -> str:
    """One line for the log and the plan.

    Example:
      >>> Choice("xla", "auto", "auto on cpu").describe()
      'xla (model.attention=auto: auto on cpu)'
    """
    return f"{self.kernel} (model.attention={self.requested}: {self.reason})"


def check_kernel(value: str) -> None:
  """A `ValueError` naming `model.attention` when `value` is not one of `KERNELS`.

  Example:
    >>> check_kernel("flash")
    Traceback (most recent call last):
    ...
    ValueError: model.attention='flash' is not one of ('auto', 'xla', 'splash', 'cudnn')
  """
  if value not in KERNELS:
    raise ValueError(f"model.attention={value!r} is not one of {KERNELS}")


def choose_kernel(
  requested: str,
  *,
  platform: str,
  length: int,
  dtype: jnp.dtype,
  segments: bool,
  head_dim: int = 128,
  matmul_precision: str | None = "current",
) -> Choice:
  """The kernel that runs attention over `length` tokens on `platform`, and why.

  `segments`: the rows are packed (segment ids restrict attention to each
  document). `matmul_precision`: JAX's `jax_default_matmul_precision` the
  program is traced under ("current": its value now).

  Raises:
    ValueError: `requested` is "splash" and splash cannot compile under
      `matmul_precision` in `dtype` (`SPLASH_PRECISIONS`, for float32 `SPLASH_FLOAT32_PRECISIONS`).

  Example:
    >>> choose_kernel("auto", platform="tpu", length=8192, dtype=jnp.bfloat16, segments=True)
    Choice(kernel='splash', requested='auto', reason='TPU, 8192 tokens in blocks of 1024, segment ids', interpret=False, block=1024)
    >>> choose_kernel("auto", platform="tpu", length=8192, dtype=jnp.float32, segments=False).block
    512
    >>> choose_kernel("auto", platform="tpu", length=100, dtype=jnp.bfloat16, segments=False).reason
    'sequence 100 is not a multiple of 128, the least block of splash attention'
    >>> choose_kernel("cudnn", platform="gpu", length=64, dtype=jnp.bfloat16, segments=True).reason
    "packed rows: cuDNN's public API takes no segment ids"
  """
  check_kernel(requested)
  dtype = jnp.dtype(dtype)
  if matmul_precision == "current":
    matmul_precision = jax.config.jax_default_matmul_precision
  if requested == "auto":
    wanted = {"tpu": "splash", "gpu": "cudnn"}.get(platform, "xla")
    if wanted == "xla":
      return Choice("xla", requested, f"no fused kernel chosen on {platform}")
  else:
    wanted = requested
  if wanted == "xla":
    return Choice("xla", requested, "as asked")
  if wanted == "splash":
    # Four-byte inputs take twice the kernel's VMEM for a block of the same size.
    most = SPLASH_FLOAT32_MAX_BLOCK if dtype.itemsize >= 4 else max(SPLASH_BLOCKS)
    block = next((b for b in SPLASH_BLOCKS if length % b == 0 and b <= most), None)
    if block is None:
      why = f"sequence {length} is not a multiple of 128, the least block of splash attention"
      return Choice("xla", requested, why)
    compiles = SPLASH_FLOAT32_PRECISIONS if dtype == jnp.float32 else SPLASH_PRECISIONS
    if matmul_precision not in compiles:
      why = (
        f"jax_default_matmul_precision={matmul_precision!r} is not a precision Mosaic compiles "
        f"splash's {dtype} matmuls in ({', '.join(map(str, compiles[1:]))})"
      )
      if requested == "splash":
        raise ValueError(
          f"model.attention='splash' cannot run here: {why}; set model.attention='auto' or "
          "'xla', or trace without that precision"
        )
      return Choice("xla", requested, why)
    what = f"{length} tokens in blocks of {block}" + (", segment ids" if segments else "")
    if platform != "tpu":
      why = f"Pallas interpret mode on {platform}: exact but slow, {what}"
      return Choice("splash", requested, why, interpret=True, block=block)
    return Choice("splash", requested, f"TPU, {what}", block=block)
  if platform != "gpu":
    return Choice("xla", requested, f"cuDNN needs a GPU; this program is for {platform}")
  if segments:
    return Choice("xla", requested, "packed rows: cuDNN's public API takes no segment ids")
  if dtype not in _CUDNN_DTYPES:
    return Choice(
      "xla", requested, f"cuDNN's flash attention computes in bf16 or fp16, not {dtype}"
    )
  if head_dim % 8 or head_dim > 128:
    why = (
      f"cuDNN's flash attention takes a head_dim that is a multiple of 8 up to 128, not {head_dim}"
    )
    return Choice("xla", requested, why)
  return Choice("cudnn", requested, "GPU, causal")


def current_platform() -> str:
  """The platform of the active mesh (`spmd.rules.activation_rules`), else JAX's default.

  A plan for a TPU slice traces on a CPU machine with TPU device
  descriptions in its mesh: the mesh, not the machine, says what the program
  is for.
  """
  active = rules_lib.active_rules()
  if active is not None:
    return active[1].devices.flat[0].platform
  return jax.default_backend()


_announced: set[str] = set()
_recording = threading.local()


@contextlib.contextmanager
def recorded_choices() -> Iterator[list[Choice]]:
  """Collects, in a list, every `Choice` the models make while inside (this thread).

  Example:
    >>> with recorded_choices() as choices:
    ...   _ = attend(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8)))
    >>> [c.kernel for c in choices]
    ['xla']
  """
  stack = _recording.__dict__.setdefault("stack", [])
  stack.append([])
  try:
    yield stack[-1]
  finally:
    stack.pop()


def _announce(choice: Choice) -> None:
  """Records `choice` for `recorded_choices`, and logs it once per process (process 0)."""
  for found in getattr(_recording, "stack", []):
    if choice not in found:
      found.append(choice)
  line = choice.describe()
  if line not in _announced:
    _announced.add(line)
    if jax.process_index() == 0:
      log.warning("attention: %s", line)


def causal_mask(segment_ids: jax.Array | None, length: int) -> jax.Array:
  """bool [length, length], or [batch, length, length] with `segment_ids`: q may read s.

  Causal; with `segment_ids` [batch, length] also only within the query's
  own segment. Padding (segment 0) reads padding, so no row is empty.

  Example:
    >>> causal_mask(jnp.array([[1, 1, 2]]), 3)[0].astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
  """
  causal = jnp.tril(jnp.ones((length, length), bool))
  if segment_ids is None:
    return causal
  return causal & (segment_ids[:, :, None] == segment_ids[:, None, :])


def _grouped(q: jax.Array, k: jax.Array, mask: jax.Array) -> tuple[jax.Array, str, str, jax.Array]:
  """Queries, their einsum axes, the scores' axes and the mask, laid out for grouped heads.

  Query head i reads key/value head i // group: the heads axis splits as
  (kv_heads, group), so no K/V copy per query head is materialised. Plain
  multi-head attention (groups of one) keeps 4-D operands: a size-1 group
  axis made XLA:CPU copy the scores and their gradients for layout.
  """
  b, length, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  if heads == kv_heads:
    return q, "bqhk", "bhqs", mask[..., None, :, :]
  q = q.reshape(b, length, kv_heads, heads // kv_heads, head_dim)
  return q, "bqhgk", "bhgqs", mask[..., None, None, :, :]


def _weights(q: jax.Array, k: jax.Array, mask: jax.Array, q_axes: str, s_axes: str) -> jax.Array:
  # Scores and softmax in float32 whatever the compute dtype: bf16 scores
  # lose the small differences that decide which tokens get attention.
  logits = jnp.einsum(f"{q_axes},bshk->{s_axes}", q, k, preferred_element_type=jnp.float32)
  logits = logits * k.shape[-1] ** -0.5
  # A finite minimum rather than -inf: no NaN even if a row were all masked.
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(logits, axis=-1)


def attention_weights(q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
  """XLA's attention weights, float32 [batch, heads, query, key], for `mask` [L, L] or [b, L, L].

  Example:
    >>> q = jnp.ones((1, 3, 2, 4))
    >>> attention_weights(q, q[:, :, :1], causal_mask(None, 3))[0, 1, 2].tolist()
    [0.3333333432674408, 0.3333333432674408, 0.3333333432674408]
  """
  b, length, heads, _ = q.shape
  grouped, q_axes, s_axes, mask = _grouped(q, k, mask)
  return _weights(grouped, k, mask, q_axes, s_axes).reshape(b, heads, length, k.shape[1])


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Attention written out: f32 scores, `mask` ([L, L] or [batch, L, L]), softmax, weighted sum.

  Example:
    >>> q = jnp.ones((1, 3, 2, 4))
    >>> xla_attention(q, q[:, :, :1], q[:, :, :1], causal_mask(None, 3)).shape
    (1, 3, 2, 4)
  """
  grouped, q_axes, s_axes, mask = _grouped(q, k, mask)
  probs = _weights(grouped, k, mask, q_axes, s_axes).astype(q.dtype)
  y = jnp.einsum(f"{s_axes},bshk->{q_axes}", probs, v)
  return y.reshape(q.shape)


def splash_modules():
  """(splash_attention_kernel, splash_attention_mask): Pallas's splash modules.

  Imported on first use, not with this module: every process that builds a
  model imports this one, and most (every CPU run) never take splash.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask

  return kernel, mask


def _block_sizes(block: int, key_length: int):
  """splash's `BlockSizes`, each `block`, for keys of `key_length` tokens.

  The backward is fused as `SPLASH_FUSED_BACKWARD` says, for at most
  `SPLASH_FUSED_BACKWARD_MAX_KEY_BLOCKS` key blocks.

  Example:
    >>> [_block_sizes(1024, n).use_fused_bwd_kernel for n in (8192, 131072)]
    [True, False]
  """
  splash, _ = splash_modules()
  fused = SPLASH_FUSED_BACKWARD and key_length // block <= SPLASH_FUSED_BACKWARD_MAX_KEY_BLOCKS
  return splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=None if fused else block,
    block_kv_dq=None if fused else block,
    use_fused_bwd_kernel=fused,
  )


def _splash_local(q, k, v, segment_ids, *, block: int, interpret: bool) -> jax.Array:
  """Splash attention on one device's rows and heads: [b, L, h, d] in, the same out."""
  splash, splash_mask = splash_modules()
  _, length, heads, _ = q.shape
  # The kernel object holds its block masks as arrays, so it is made in the
  # trace that uses it; the masks themselves are computed once per shape
  # (splash caches them in numpy).
  sizes = _block_sizes(block, length)
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((length, length))] * heads)
  # Heads a multiple of kv_heads is grouped-query attention in the kernel
  # itself: query head i reads key/value head i // (heads // kv_heads).
  kernel = splash.make_splash_mha(
    mask,
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
    residual_checkpoint_name=SPLASH_RESIDUALS,
  )
  return _run_splash(kernel, q, k, v, segment_ids, segment_ids)


def _run_splash(kernel, q, k, v, q_ids=None, kv_ids=None) -> jax.Array:
  """`kernel` (a splash MHA kernel) on [b, L, h, d] queries, keys and values; [b, L, h, d] out.

  `q_ids`, `kv_ids`: the queries' and the keys' segment ids [b, L], or None.
  """
  splash, _ = splash_modules()
  # Splash leaves the 1/sqrt(head_dim) to its caller; [b, L, h, d] -> [b, h, L, d].
  q = jnp.swapaxes(q * jnp.asarray(q.shape[3] ** -0.5, q.dtype), 1, 2)
  k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  if q_ids is None:
    y = jax.vmap(kernel)(q, k, v)
  else:
    y = jax.vmap(lambda q, k, v, a, b: kernel(q, k, v, segment_ids=splash.SegmentIds(a, b)))(
      q, k, v, q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    )
  return jnp.swapaxes(y, 1, 2)


def splash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array | None = None,
  *,
  block: int = 128,
  interpret: bool = False,
) -> jax.Array:
  """Causal splash attention, placed with `shard_map` on the mesh of the active rules.

  Each device runs the kernel on its rows (the mesh axes of "batch") and
  heads (of "heads" and "kv_heads", which must be the same axes so that each
  device holds the key/value heads its query heads read). Outside any rules,
  or inside a `shard_map` (the arrays are already a device's own), the kernel
  runs on the arrays as they are.

  Raises:
    ValueError: the rules split the sequence or head_dim (splash reads
      whole sequences), or split query and key/value heads differently.

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (2, 128, 2, 8))
    >>> ids = jnp.array([[1] * 64 + [2] * 64, [1] * 128])
    >>> y = splash_attention(q, q, q, ids, interpret=True)
    >>> bool(jnp.allclose(y, xla_attention(q, q, q, causal_mask(ids, 128)), atol=1e-5))
    True
  """
  local = lambda q, k, v, s=None: _splash_local(q, k, v, s, block=block, interpret=interpret)  # noqa: E731
  active = rules_lib.active_rules()
  if active is None or jax.sharding.get_abstract_mesh().manual_axes:
    return local(q, k, v, segment_ids)
  rules, mesh = active
  q_spec = rules_lib.logical_to_spec(_Q_AXES, rules, mesh)
  kv_spec = rules_lib.logical_to_spec(_KV_AXES, rules, mesh)
  padded_q, padded_kv = (tuple(s) + (None,) * (4 - len(s)) for s in (q_spec, kv_spec))
  if padded_q[1] is not None or padded_q[3] is not None:
    raise ValueError(
      f"splash attention splits rows and heads only, but the rules split the queries "
      f"{_Q_AXES} as {q_spec}: map 'length' and 'kv' to no mesh axis, or use model.attention='xla'"
    )
  if padded_q[2] != padded_kv[2] or padded_q[0] != padded_kv[0]:
    raise ValueError(
      f"splash attention needs the query heads and key/value heads split alike, but the rules "
      f"give queries {q_spec} and keys/values {kv_spec}"
    )
  rules_lib.check_divisible("splash attention queries", q.shape, q_spec, mesh)
  rules_lib.check_divisible("splash attention keys", k.shape, kv_spec, mesh)
  rows = jax.sharding.PartitionSpec(padded_q[0])
  args, specs = (q, k, v), (q_spec, kv_spec, kv_spec)
  if segment_ids is not None:
    args, specs = (*args, segment_ids), (*specs, rows)
  placed = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)
  return placed(*args)


def context_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None
) -> jax.Array:
  """XLA attention with the sequence split over `context` (`spmd.context`), by the active rules.

  Inside a `shard_map` over the rules' layout of the queries and keys
  (rows, sequence, heads), each device all-gathers the keys and values
  (and the segment ids) along the sequence's mesh axes and attends its own
  queries to all of them, masked causally by the tokens' original places
  (`spmd.context.token_index`: the step's balanced order) and by segment.
  Query head i reads key/value head i // group, as in `xla_attention`.

  Raises:
    ValueError: the rules split head_dim, or split the rows or heads of the
      queries and of the keys differently.
  """
  rules, mesh = rules_lib.active_rules()
  q_spec, kv_spec, rows, sequence = _context_specs(q, k, rules, mesh)
  index = jnp.asarray(context_lib.token_index(q.shape[1]))

  def local(q, k, v, q_index, k_index, ids=None):
    k = jax.lax.all_gather(k, sequence, axis=1, tiled=True)
    v = jax.lax.all_gather(v, sequence, axis=1, tiled=True)
    mask = k_index[None, :] <= q_index[:, None]
    if ids is not None:
      all_ids = jax.lax.all_gather(ids, sequence, axis=1, tiled=True)
      mask = mask & (ids[:, :, None] == all_ids[:, None, :])
    return xla_attention(q, k, v, mask)

  P = jax.sharding.PartitionSpec
  args, specs = (q, k, v, index, index), (q_spec, kv_spec, kv_spec, P(sequence), P())
  if segment_ids is not None:
    args, specs = (*args, segment_ids), (*specs, P(rows, sequence))
  placed = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec)
  return placed(*args)


@functools.cache
def _placed_causal_mask() -> type | None:
  """The class of `_placed_mask`, on splash's lazy-mask base (`spmd.compat`), or None without it."""
  base = compat.splash_lazy_mask_base()
  if base is None:
    return None

  class PlacedCausalMask(base):
    """Causal by each query's original place (`q_sequence`) against keys in their natural order.

    Splash computes a partial block's mask in the kernel from `q_sequence`,
    which `q_seq_shards` splits with the queries, and the keys' positions
    (0..L-1): so the queries stay in the balanced order, the keys are put
    back in theirs, and each device skips the blocks its queries never read.
    """

    def __init__(self, places: np.ndarray):
      length = len(places)
      super().__init__((length, length), lambda q, k: q >= k)
      self.q_sequence = np.asarray(places, np.int32)

    def __eq__(self, other: object):
      return isinstance(other, type(self)) and np.array_equal(self.q_sequence, other.q_sequence)

    def __hash__(self):
      return hash((type(self), self.q_sequence.tobytes()))

  return PlacedCausalMask


def splash_context_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array | None = None,
  *,
  block: int = 128,
  interpret: bool = False,
) -> jax.Array:
  """Splash attention with the sequence split over `context`, by the active rules.

  As `context_attention`: keys, values and segment ids all-gathered along the
  sequence's mesh axes. The kernel's block masks are split with the
  queries (`q_seq_shards`), so each device computes only the blocks its own
  queries read, by their original places (`spmd.context.token_index`).
  """
  splash, splash_mask = splash_modules()
  rules, mesh = rules_lib.active_rules()
  q_spec, kv_spec, rows, sequence = _context_specs(q, k, rules, mesh)
  heads = q.shape[2] // _axes_size(mesh, tuple(q_spec)[2] if len(q_spec) > 2 else None)
  shards = _axes_size(mesh, sequence)
  places = context_lib.token_index(q.shape[1])
  natural = np.argsort(places)  # where each key of the natural order sits in the gathered one
  mask = splash_mask.MultiHeadMask([_placed_causal_mask()(places)] * heads)
  kernel = splash.make_splash_mha(
    mask,
    block_sizes=_block_sizes(block, k.shape[1]),
    head_shards=1,
    q_seq_shards=shards,
    interpret=interpret,
    residual_checkpoint_name=SPLASH_RESIDUALS,
  )
  P = jax.sharding.PartitionSpec
  kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(None, sequence)))

  def local(kernel, q, k, v, ids=None):
    k, v = (jax.lax.all_gather(x, sequence, axis=1, tiled=True)[:, natural] for x in (k, v))
    all_ids = None
    if ids is not None:
      all_ids = jax.lax.all_gather(ids, sequence, axis=1, tiled=True)[:, natural]
    return _run_splash(kernel, q, k, v, ids, all_ids)

  args, specs = (kernel, q, k, v), (kernel_spec, q_spec, kv_spec, kv_spec)
  if segment_ids is not None:
    args, specs = (*args, segment_ids), (*specs, P(rows, sequence))
  placed = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)
  return placed(*args)


def _axes_size(mesh: jax.sharding.Mesh, entry) -> int:
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  return int(np.prod([mesh.shape[a] for a in axes]))


def _context_specs(q, k, rules, mesh):
  """(query spec, key spec, rows' mesh axes, sequence's mesh axes) for attention across context."""
  q_spec = rules_lib.logical_to_spec(_Q_AXES, rules, mesh)
  kv_spec = rules_lib.logical_to_spec(_KV_AXES, rules, mesh)
  padded_q, padded_kv = (tuple(s) + (None,) * (4 - len(s)) for s in (q_spec, kv_spec))
  if padded_q[3] is not None or padded_q[:3] != padded_kv[:3]:
    raise ValueError(
      f"attention across context shards needs the queries and keys/values split alike along "
      f"rows, sequence and heads, and head_dim whole; the rules give queries {q_spec} and "
      f"keys/values {kv_spec}"
    )
  rules_lib.check_divisible("attention queries", q.shape, q_spec, mesh)
  rules_lib.check_divisible("attention keys", k.shape, kv_spec, mesh)
  return q_spec, kv_spec, padded_q[0], padded_q[1]


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal attention by cuDNN's flash attention (GPU, bf16/fp16), through JAX's public API."""
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array | None = None,
  *,
  kernel: str = "auto",
) -> jax.Array:
  """Causal attention by the kernel `choose_kernel` picks for `kernel` here.

  Args:
    q: queries [batch, length, heads, head_dim], in the compute dtype.
    k, v: keys and values [batch, length, kv_heads, head_dim].
    segment_ids: int [batch, length] for packed rows (attention stays inside
      a segment), or None.
    kernel: one of `KERNELS` (`model.attention`).

  Example:
    >>> q = jnp.ones((2, 5, 4, 8))
    >>> attend(q, q[:, :, :2], q[:, :, :2], jnp.array([[1, 1, 2, 2, 0]] * 2)).shape
    (2, 5, 4, 8)
  """
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[2] % k.shape[2]:
    raise ValueError(
      f"attention wants q [b, l, heads, d] and k, v [b, l, kv_heads, d] with kv_heads "
      f"dividing heads; got {q.shape=} {k.shape=} {v.shape=}"
    )
  length = q.shape[1]
  shards = context_lib.active_shards()
  if shards > 1:
    # Each device's queries against the whole sequence's keys: splash in
    # blocks of its own slice, or XLA (cuDNN takes no such mask).
    choice = choose_kernel(
      kernel,
      platform=current_platform(),
      length=length // shards,
      dtype=q.dtype,
      segments=segment_ids is not None,
      head_dim=q.shape[3],
    )
    split = f"the sequence split over {shards} context devices"
    if choice.kernel == "splash" and _placed_causal_mask() is None:
      split += f" (this JAX's splash lacks {compat.SPLASH_MASKS}._ComputableMask)"
      choice = dataclasses.replace(choice, kernel="xla")
    if choice.kernel == "splash":
      choice = dataclasses.replace(choice, reason=f"{choice.reason}; {split}")
      _announce(choice)
      return splash_context_attention(
        q, k, v, segment_ids, block=choice.block, interpret=choice.interpret
      )
    choice = Choice("xla", kernel, split if choice.kernel != "xla" else f"{choice.reason}; {split}")
    _announce(choice)
    return context_attention(q, k, v, segment_ids)
  choice = choose_kernel(
    kernel,
    platform=current_platform(),
    length=length,
    dtype=q.dtype,
    segments=segment_ids is not None,
    head_dim=q.shape[3],
  )
  _announce(choice)
  if choice.kernel == "splash":
    return splash_attention(q, k, v, segment_ids, block=choice.block, interpret=choice.interpret)
  if choice.kernel == "cudnn":
    return cudnn_attention(q, k, v)
  index = context_lib.token_index(length)
  if (index != np.arange(length)).any():
    # A whole sequence in the balanced order (a shard_map made the mesh axes
    # manual): masked by the tokens' original places.
    index = jnp.asarray(index)
    mask = index[None, :] <= index[:, None]
    if segment_ids is not None:
      mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return xla_attention(q, k, v, mask)
  return xla_attention(q, k, v, causal_mask(segment_ids, length))
