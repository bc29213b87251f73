"""Next-token cross-entropy that never holds the whole logits.

A language model's logits are [batch, length, vocab] in float32: at 8192
tokens and a 128k vocabulary that is 4 GiB per sequence, one of the largest
buffers of a step, and its gradient is another. `chunked_cross_entropy_sums`
takes the model's last hidden states and its output projection instead and
computes the loss over chunks of the sequence: each chunk's logits exist
only while that chunk is summed, and the backward pass computes them again,
chunk by chunk (a `jax.custom_vjp`: the forward pass keeps only each
token's log-normalizer, [batch, length] in float32). The projection is part
of each chunk, so the full logits are never formed, forward or backward.

The vocabulary is not chunked: a chunk of `chunk` tokens holds
`rows * chunk * vocab` logits on a device holding `rows` rows, and
`default_chunk` picks the chunk so that this stays under `CHUNK_LOGITS`
(about 128 MiB of float32 per device; the backward pass holds a few such
buffers). A length with no divisor near that is padded to a multiple of the
chunk with masked tokens. Under
tensor-parallel rules the vocabulary axis of each chunk is split over the
devices as the full logits would be.

A sequence that fits in one chunk (every byte-level model here) takes the
plain path: the logits of the whole sequence and `optax`'s cross-entropy,
the program a task without chunking compiles.

Example, any decoder's task loss from its hidden states and projection:

  >>> import jax, jax.numpy as jnp
  >>> hidden = jax.random.normal(jax.random.key(0), (2, 8, 16))
  >>> unembed = jax.random.normal(jax.random.key(1), (16, 1000))
  >>> labels = jnp.arange(16).reshape(2, 8)
  >>> mask = jnp.ones((2, 8))
  >>> chunked = chunked_cross_entropy_sums(hidden, unembed, labels, mask, chunk=2)
  >>> plain = cross_entropy_sums(hidden @ unembed, labels, mask)
  >>> bool(jnp.allclose(chunked[0], plain[0], rtol=1e-5)), float(chunked[1])
  (True, 16.0)
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from spmd import context
from spmd import rules as rules_lib
from spmd.rules import constrain
from trainers.models.matmul import matmul
from trainers.tasks import check_labels, cross_entropy_sums

CHUNK_LOGITS = 2**25
"""Logits of one chunk on one device at most (`default_chunk`): 128 MiB in float32."""

# With the sequence split over `context`, the loss runs on [context * rows,
# length / context] (`blocked`): its rows axis is split over both.
_BLOCKED_ROWS = ("length", "batch")
# The projection whole along d_model: gathered once for all chunks (under FSDP
# its d_model axis is split), not once per chunk inside the loop.
_GATHERED = (None, "vocab")
_PROJECTION = ("embed", "vocab")  # the output projection's parameter axes


def default_chunk(length: int, vocab: int, rows: int = 1) -> int:
  """The chunk for `rows` rows per device: at most `CHUNK_LOGITS` logits, `rows * chunk * vocab`.

  The longest chunk under that budget that divides `length`, unless the
  longest divisor is under half the budget (a length with no small factors,
  8191 say): then the budget itself, and `chunked_cross_entropy_sums` pads
  the length to a multiple of it, rather than loop over chunks of one token.
  A length within the budget is one chunk (the plain path).

  Example:
    >>> default_chunk(8192, 128256), default_chunk(8192, 128256, rows=8), default_chunk(128, 256)
    (256, 32, 128)
    >>> default_chunk(8191, 128256)  # prime: 8191 is padded to 8192
    261
  """
  most = max(1, CHUNK_LOGITS // (max(1, rows) * vocab))
  if length <= most:
    return length
  divisor = max(c for c in range(1, most + 1) if length % c == 0)
  return divisor if 2 * divisor >= most else most


def chunked_cross_entropy_sums(
  hidden: jax.Array,
  unembed: jax.Array,
  labels: jax.Array,
  mask: jax.Array,
  *,
  chunk: int | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """`cross_entropy_sums(hidden @ unembed, labels, mask)` without the whole logits.

  Args:
    hidden: the last hidden states [batch, length, d_model], in the compute dtype.
    unembed: the output projection [d_model, vocab] (a tied embedding's
      table transposed), as stored: it is multiplied in `hidden`'s dtype,
      the logits accumulated in float32, and its gradient, summed in
      float32, comes back in its own dtype (a float32 projection's is never
      rounded: `trainers.models.matmul`).
    labels: int [batch, length], the targets.
    mask: [batch, length], 1.0 where a target counts. Where it is 0 the label
      is ignored (HF's -100, say); a label outside `[0, vocab)` where it is
      not is a `ValueError` naming it on concrete arrays, and a NaN loss in
      a compiled step (`trainers.tasks.check_labels`), on both paths.
    chunk: tokens per chunk; it must divide `length`. None: `default_chunk`
      for the rows each device holds under the active rules (the length
      padded with masked tokens when it chose a chunk that does not divide).

  Returns:
    `(loss_sum, weight, {"accuracy": correct_sum})`, as `cross_entropy_sums`.
    The gradients reach `hidden` and `unembed`; the projection's is
    accumulated over the chunks in float32.

  Raises:
    ValueError: the shapes disagree or `chunk` does not divide the length.

  Example:
    >>> hidden = jnp.ones((1, 4, 2))
    >>> loss_sum, weight, sums = chunked_cross_entropy_sums(
    ...   hidden, jnp.zeros((2, 3)), jnp.array([[0, 1, 2, 0]]), jnp.ones((1, 4)), chunk=2)
    >>> round(float(loss_sum), 4), float(weight)  # 4 tokens, each log(3)
    (4.3944, 4.0)
  """
  if hidden.ndim != 3 or unembed.ndim != 2 or unembed.shape[0] != hidden.shape[2]:
    raise ValueError(
      f"hidden must be [batch, length, d_model] and unembed [d_model, vocab]; got "
      f"{hidden.shape=} {unembed.shape=}"
    )
  if labels.shape != hidden.shape[:2] or mask.shape != hidden.shape[:2]:
    raise ValueError(
      f"labels and mask must be [batch, length] = {hidden.shape[:2]}; got "
      f"{labels.shape=} {mask.shape=}"
    )
  length, vocab = hidden.shape[1], unembed.shape[1]
  shards = context.active_shards()
  if shards > 1 and chunk != length:
    # Each device's slice of every sequence, chunked along its own slice: no
    # chunk of the sequence belongs to one device alone, so none is gathered.
    if chunk is not None and (length // shards) % chunk:
      raise ValueError(f"{chunk=} must divide the {length // shards} tokens of each context shard")
    hidden, labels, mask = (blocked(x, shards) for x in (hidden, labels, mask))
    length, rows = hidden.shape[1], _BLOCKED_ROWS
  else:
    rows = "batch"
  if chunk is None:
    chunk = default_chunk(length, vocab, hidden.shape[0] // _row_shards(hidden.shape[0], rows))
    if length % chunk:  # no good divisor: padded with masked tokens, which add nothing
      pad = [(0, 0), (0, -length % chunk)]
      hidden = jnp.pad(hidden, [*pad, (0, 0)])
      labels, mask = jnp.pad(labels, pad), jnp.pad(mask, pad)
      length = hidden.shape[1]
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or length % chunk:
    raise ValueError(f"{chunk=} must be a positive integer dividing the length {length}")
  weight = jnp.sum(mask)
  if chunk == length:
    tokens = hidden.reshape(-1, hidden.shape[2]) if rows == "batch" else hidden
    logits = matmul(tokens, unembed, jnp.float32)
    logits = constrain(logits.reshape(*hidden.shape[:2], vocab), (rows, "length", "vocab"))
    return cross_entropy_sums(logits, labels, mask)
  check_labels(labels, mask, vocab)
  mask = mask.astype(jnp.float32)
  # JAX traces the backward pass after the loss returns, outside the rules
  # the trainer entered for the loss: they go with it, so that its chunks are
  # laid out as the forward pass's are.
  placement = rules_lib.active_rules()
  loss_sum, correct = _chunked_sums(hidden, unembed, labels, mask, chunk, placement, rows)
  return loss_sum, weight, {"accuracy": correct}


def blocked(x: jax.Array, shards: int) -> jax.Array:
  """[b, length, ...] -> [shards * b, length / shards, ...]: row s * b + r is row r's slice s.

  Free under the rules: the sequence's slices are split over `context`, so
  the new rows axis is split over (context, the batch's axes), each device
  holding one block of it.
  """
  b, length = x.shape[:2]
  x = x.reshape(b, shards, length // shards, *x.shape[2:])
  return jnp.swapaxes(x, 0, 1).reshape(shards * b, length // shards, *x.shape[3:])


def _chunk_logits(hidden: jax.Array, unembed: jax.Array, rows) -> jax.Array:
  """[b, c, d] @ [d, vocab] -> float32 [b, c, vocab], as one flat matmul (`layers.dense`'s reason)."""
  b, c, d = hidden.shape
  logits = jnp.dot(hidden.reshape(b * c, d), unembed, preferred_element_type=jnp.float32)
  return constrain(logits.reshape(b, c, -1), (rows, "length", "vocab"))


def _slice(x: jax.Array, i: jax.Array, chunk: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)


def _row_shards(batch: int, rows="batch") -> int:
  """How many pieces the active rules split the rows into (1 outside rules or in shard_map)."""
  active = rules_lib.active_rules()
  if active is None or jax.sharding.get_abstract_mesh().manual_axes:
    return 1
  rules, mesh = active
  spec = rules_lib.logical_to_spec((rows,), rules, mesh)
  entry = spec[0] if len(spec) else None
  axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
  shards = math.prod(mesh.shape[a] for a in axes)
  return shards if batch % shards == 0 else 1


def _forward(hidden, unembed, labels, mask, chunk, rows):
  """(loss_sum, correct_sum, log-normalizers [n, b, chunk]) over the chunks."""
  unembed = constrain(unembed.astype(hidden.dtype), _GATHERED)

  def body(totals, i):
    logits = _chunk_logits(_slice(hidden, i, chunk), unembed, rows)
    lse = jax.nn.logsumexp(logits, axis=-1)
    labels_c, mask_c = _slice(labels, i, chunk), _slice(mask, i, chunk)
    # The target's logit by comparison with the vocabulary's iota rather
    # than a gather: it fuses into one reduction, and a vocabulary split
    # over devices stays split.
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == labels_c[..., None]
    target = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    correct = (jnp.argmax(logits, axis=-1) == labels_c).astype(jnp.float32)
    # As the plain path: a label outside the vocabulary is ignored where the
    # mask is 0 and NaN where it is not (`check_labels` raises on concrete arrays).
    inside = (labels_c >= 0) & (labels_c < logits.shape[-1])
    losses = jnp.where(mask_c != 0, jnp.where(inside, lse - target, jnp.nan) * mask_c, 0.0)
    loss_sum, correct_sum = totals
    return (
      loss_sum + jnp.sum(losses),
      correct_sum + jnp.sum(correct * mask_c),
    ), lse

  n = hidden.shape[1] // chunk
  zero = jnp.zeros((), jnp.float32)
  (loss_sum, correct_sum), lse = jax.lax.scan(body, (zero, zero), jnp.arange(n))
  return loss_sum, correct_sum, lse


def _placed(placement: tuple[rules_lib.Rules, jax.sharding.Mesh] | None):
  """The rules and mesh of `placement` active (`spmd.rules.activation_rules`), if any."""
  return rules_lib.activation_rules(*placement) if placement else contextlib.nullcontext()


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked_sums(hidden, unembed, labels, mask, chunk, placement, rows):
  loss_sum, correct_sum, _ = _forward(hidden, unembed, labels, mask, chunk, rows)
  return loss_sum, correct_sum


def _chunked_sums_fwd(hidden, unembed, labels, mask, chunk, placement, rows):
  loss_sum, correct_sum, lse = _forward(hidden, unembed, labels, mask, chunk, rows)
  return (loss_sum, correct_sum), (hidden, unembed, labels, mask, lse)


def _chunked_sums_bwd(chunk, placement, rows, residuals, cotangents):
  with _placed(placement):
    return _backward(chunk, rows, residuals, cotangents)


def _backward(chunk, rows, residuals, cotangents):
  """The chunks again: softmax minus one-hot, times the mask, into both matmuls' gradients."""
  hidden, stored, labels, mask, lse = residuals
  g = cotangents[0]  # the accuracy is piecewise constant: no gradient
  b, length, d = hidden.shape
  unembed = constrain(stored.astype(hidden.dtype), _GATHERED)
  # The projection's gradient sums over every row. Summed across devices in
  # each chunk, it would cost one all-reduce of the whole [d_model, vocab]
  # per chunk; instead each device adds up its own rows' share in float32
  # (a leading axis, one entry per row shard, split as the rows are), and
  # the shares are summed once, after the last chunk.
  shards = _row_shards(b, rows)
  share_axes = (rows, None, "vocab")

  def body(carry, i):
    d_unembed, d_hidden = carry
    hidden_c = _slice(hidden, i, chunk)
    logits = _chunk_logits(hidden_c, unembed, rows)
    probs = jnp.exp(logits - lse[i][..., None])
    hit = (
      jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == _slice(labels, i, chunk)[..., None]
    )
    d_logits = (probs - hit) * (g * _slice(mask, i, chunk))[..., None]
    # The logits' gradient enters the two matmuls in the compute dtype, as
    # the forward's operands did; the projection's gradient adds up over the
    # chunks in float32 and is returned in its stored dtype, at the end.
    d_logits = constrain(d_logits.astype(hidden.dtype), (rows, "length", "vocab"))
    flat = d_logits.reshape(b * chunk, -1)
    d_hidden_c = jnp.dot(flat, unembed.T).reshape(b, chunk, d)
    if shards == 1:
      share = jnp.dot(hidden_c.reshape(b * chunk, d).T, flat, preferred_element_type=jnp.float32)
      share = share[None]
    else:
      split = (shards, b // shards * chunk)
      share = jnp.einsum(
        "srd,srv->sdv",
        constrain(hidden_c.reshape(*split, d), (rows, None, None)),
        constrain(d_logits.reshape(*split, -1), (rows, None, "vocab")),
        preferred_element_type=jnp.float32,
      )
    d_unembed = constrain(d_unembed + share, share_axes)
    d_hidden = jax.lax.dynamic_update_slice_in_dim(d_hidden, d_hidden_c, i * chunk, axis=1)
    return (d_unembed, d_hidden), None

  zeros = (
    constrain(jnp.zeros((shards, *unembed.shape), jnp.float32), share_axes),
    jnp.zeros_like(hidden),
  )
  (d_unembed, d_hidden), _ = jax.lax.scan(body, zeros, jnp.arange(length // chunk))
  # Summed across the row shards straight into the projection's own layout (a
  # reduce-scatter under FSDP), and before the layers' backward pass may use
  # d_hidden: XLA would otherwise hold the float32 shares, the size of the
  # whole projection, until it reduces every gradient at the step's end.
  # In the projection's stored dtype: a float32 one's gradient is never
  # rounded (XLA:TPU would move a rounding ahead of the sum across devices).
  d_unembed = constrain(d_unembed.sum(0), _PROJECTION).astype(stored.dtype)
  d_hidden, d_unembed = jax.lax.optimization_barrier((d_hidden, d_unembed))
  return d_hidden, d_unembed, None, None


_chunked_sums.defvjp(_chunked_sums_fwd, _chunked_sums_bwd)
