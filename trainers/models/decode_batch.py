"""Batched sampling of ragged prompts with a KV cache: what `spmd-sample` runs on the devices.

`generate_batch(model, prompts, n)` continues each prompt (a list of ids,
any lengths) by up to `n` tokens in one batch. The prompts are left-padded
to the longest, so every row writes its keys and values into the same cache
slot each step (one `dynamic_update_slice`, as `decode.generate`); each row's
positions count from its own first token and its attention skips its
padding's slots (`decode.forward`'s `starts`), so a row decodes as it would
alone. The cache is sized to the call, longest prompt + `n` slots (at most
the model's `seq_len`), not to `seq_len`.

Two compiled programs: the prefill reads the prompts at once and draws each
row's first token; the decode is one `lax.while_loop` of one-token steps that
ends when every row has stopped (its `eos_id`) or after `n` tokens. A step
reads every weight matrix once and the whole cache, [layers, batch, prompt +
n, kv_heads, head_dim] keys and values (the slots not yet written are masked),
and gathers one row of the embedding table per row.

Tokens are greedy (`temperature=0`), or drawn at `temperature` among the
`top_k` largest logits (0: all) whose probabilities, largest first, sum to
`top_p` (the first always kept). Each row draws with its own seed's key
folded with the step, so its tokens do not depend on which rows share its
batch.

Example:
  >>> from flax import nnx
  >>> from trainers.models import llama
  >>> config = llama.LlamaConfig(seq_len=16, num_layers=1, d_model=32, num_heads=4,
  ...                            num_kv_heads=2, d_ff=64)
  >>> model = llama.Llama(config, rngs=nnx.Rngs(0))
  >>> out = generate_batch(model, [[1, 2, 3], [7]], 4)
  >>> out.tokens.shape, out.lengths.tolist()
  ((2, 4), [4, 4])
  >>> alone = decode.generate(model, jnp.array([[7]]), 4)
  >>> out.tokens[1].tolist() == alone[0, 1:].tolist()
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from spmd import compile_meeting
from spmd import rules as rules_lib
from trainers.models import decode, llama
from trainers.models import transformer as lm


@dataclasses.dataclass(frozen=True)
class Completions:
  """What `generate_batch` made, on the host.

  Attributes:
    tokens: int32 [B, num_tokens]: each row's new tokens, its EOS included;
      the slots after a row stopped hold `pad_id`.
    lengths: int32 [B]: each row's new tokens, its EOS included.
    compile_seconds, prefill_seconds, decode_seconds: the two programs'
      compilation, the prefill's run, the decode loop's run.
    steps: one-token steps the decode loop ran (every row's first token is the prefill's).
    platform: where the arrays were computed ("cpu", "tpu", ...).
  """

  tokens: np.ndarray
  lengths: np.ndarray
  compile_seconds: float
  prefill_seconds: float
  decode_seconds: float
  steps: int
  platform: str

  @property
  def decode_tokens_per_second(self) -> float:
    """Tokens the decode loop made (each row's, to its stop) per second of the loop."""
    made = int(np.maximum(self.lengths - 1, 0).sum())
    return made / self.decode_seconds if self.decode_seconds > 0 else 0.0


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Prompts of any lengths as int32 [B, longest], right-aligned, and each row's first slot [B].

  Example:
    >>> tokens, starts = left_pad([[5, 6, 7], [9]])
    >>> tokens.tolist(), starts.tolist()
    ([[5, 6, 7], [0, 0, 9]], [0, 2])
  """
  longest = max(len(p) for p in prompts)
  tokens = np.full((len(prompts), longest), pad_id, np.int32)
  for row, ids in enumerate(prompts):
    tokens[row, longest - len(ids) :] = ids
  return tokens, np.array([longest - len(p) for p in prompts], np.int32)


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Logits [..., vocab] with those outside the top `top_k` (0: all) and the `top_p` nucleus at -inf.

  The nucleus: the largest logits whose probabilities, largest first, reach
  `top_p`; the largest is always kept.

  Example:
    >>> logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    >>> jnp.isfinite(filter_logits(logits, 0, 0.7)).tolist()
    [True, True, False, False]
    >>> jnp.isfinite(filter_logits(logits, 3, 1.0)).tolist()
    [True, True, True, False]
  """
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # what the larger ones already hold
    kept = jnp.where(before < top_p, ordered, jnp.inf)
    logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), -jnp.inf, logits)
  return logits


def _choose(logits, seeds, step, temperature, top_k, top_p):
  """int32 [B] tokens from logits [B, vocab]: each row with its own seed's key folded with `step`."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  keys = jax.vmap(jax.random.key)(seeds)
  logits = filter_logits(logits.astype(jnp.float32) / temperature, top_k, top_p)
  draw = lambda row, key: jax.random.categorical(jax.random.fold_in(key, step), row)  # noqa: E731
  return jax.vmap(draw)(logits, keys).astype(jnp.int32)


def _rules_context(rules, mesh):
  # Decoding holds whole sequences: a mesh's `context` axis is gathered, not split.
  if not rules:
    return contextlib.nullcontext()
  return rules_lib.activation_rules(rules_lib.whole_sequence(rules), mesh)


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8, 9, 10))
def _prefill(
  graphdef, state, tokens, starts, keys, max_len, temperature, top_k, top_p, rules, mesh
):
  with _rules_context(rules, mesh):
    model = nnx.merge(graphdef, state)
    cache = decode.init_cache(decode.cache_shape(model.config), tokens.shape[0], max_len)
    # Only the last slot's logits are needed: every row's prompt ends there.
    logits, cache = decode.forward(model, tokens, cache, jnp.int32(0), starts, last_only=True)
    return _choose(logits[:, -1], keys, 0, temperature, top_k, top_p), cache


@functools.partial(jax.jit, static_argnums=(0, 7, 8, 9, 10, 11, 12, 13, 14))
def _decode(
  graphdef, state, first, cache, starts, keys, prompt_len,
  num_tokens, temperature, top_k, top_p, eos_id, pad_id, rules, mesh,
):  # fmt: skip
  with _rules_context(rules, mesh):
    model = nnx.merge(graphdef, state)
    batch = first.shape[0]
    out = jnp.full((batch, num_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    done = first == eos_id if eos_id is not None else jnp.zeros((batch,), bool)
    lengths = jnp.ones((batch,), jnp.int32)

    def more(carry):
      i, _, _, done, _ = carry
      return (i < num_tokens) & ~jnp.all(done)

    def step(carry):
      i, out, cache, done, lengths = carry
      last = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
      logits, cache = decode.forward(model, last, cache, prompt_len + i - 1, starts)
      nxt = _choose(logits[:, 0], keys, i, temperature, top_k, top_p)
      nxt = jnp.where(done, pad_id, nxt)
      out = jax.lax.dynamic_update_index_in_dim(out, nxt, i, axis=1)
      lengths = lengths + (~done).astype(jnp.int32)
      if eos_id is not None:
        done = done | (nxt == eos_id)
      return i + 1, out, cache, done, lengths

    start = (jnp.int32(1), out, cache, done, lengths)
    i, out, _, _, lengths = jax.lax.while_loop(more, step, start)
    return out, lengths, i - 1


def _placed(arrays, mesh):
  """The inputs on the mesh, whole on every device (each process gives the same values)."""
  if mesh is None:
    return tuple(jnp.asarray(a) for a in arrays)
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return tuple(jax.device_put(a, whole) for a in arrays)


def _on_host(x: jax.Array) -> np.ndarray:
  """The whole array on this host, also where other processes hold parts of it."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _check(model, prompts, num_tokens, max_len, temperature, top_k, top_p, seeds, eos_id):
  if not isinstance(model, llama.Llama | lm.TransformerLM):
    raise TypeError(f"no cached decoding for {type(model).__name__}: Llama or TransformerLM")
  config = model.config
  if not prompts:
    raise ValueError("prompts is empty: give one list of token ids or more")
  for row, ids in enumerate(prompts):
    if len(ids) < 1:
      raise ValueError(f"prompt {row} is empty: a prompt needs 1 token or more")
    bad = [t for t in ids if not 0 <= int(t) < config.vocab_size]
    if bad:
      raise ValueError(
        f"prompt {row} has token id {bad[0]}, outside vocab_size={config.vocab_size}"
      )
  longest = max(len(p) for p in prompts)
  needed = longest + num_tokens
  max_len = needed if max_len is None else max_len
  if num_tokens < 1 or needed > max_len or max_len > config.seq_len:
    raise ValueError(
      f"the longest prompt ({longest} tokens) + {num_tokens=} is {needed} slots; "
      f"it needs num_tokens >= 1 and {needed} <= {max_len=} <= seq_len={config.seq_len}"
    )
  if temperature < 0 or not 0 <= top_k <= config.vocab_size or not 0 < top_p <= 1:
    raise ValueError(
      f"{temperature=} must be >= 0, {top_k=} in 0..{config.vocab_size} (vocab_size), "
      f"{top_p=} in (0, 1]"
    )
  if seeds is not None and len(seeds) != len(prompts):
    raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: one a row")
  if eos_id is not None and not 0 <= eos_id < config.vocab_size:
    raise ValueError(f"{eos_id=} is outside vocab_size={config.vocab_size}")
  return max_len


def generate_batch(
  model: nnx.Module,
  prompts: Sequence[Sequence[int]],
  num_tokens: int,
  *,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seeds: Sequence[int] | None = None,
  eos_id: int | None = None,
  pad_id: int = 0,
  max_len: int | None = None,
  rules: rules_lib.Rules = (),
  mesh: jax.sharding.Mesh | None = None,
) -> Completions:
  """Up to `num_tokens` new tokens after each of `prompts` (lists of ids, ragged), in one batch.

  Args:
    model: a `Llama` or `TransformerLM`, its parameters on one device or on `mesh`.
    prompts: each row's ids, 1 or more each.
    num_tokens: new tokens a row makes at most; longest prompt + num_tokens <= max_len.
    temperature, top_k, top_p: 0 is greedy; else drawn at `temperature` among
      the `top_k` largest (0: all) within the `top_p` nucleus (1: all).
    seeds: each row's `jax.random` seed (default: the row's index).
    eos_id: a row stops after it makes this id; None: every row makes `num_tokens`.
    pad_id: what a stopped row's later slots (and the prompts' padding) hold.
    max_len: the cache's slots; default longest prompt + num_tokens, at most `seq_len`.
    rules, mesh: constrain the cache and activations by these rules on this
      mesh (the parameters' mesh); the batch must divide over its batch axes.

  Raises:
    ValueError: a bad argument, named with its value.
  """
  max_len = _check(model, prompts, num_tokens, max_len, temperature, top_k, top_p, seeds, eos_id)
  tokens, starts = left_pad(prompts, pad_id)
  seeds = range(len(prompts)) if seeds is None else seeds
  keys = np.array(seeds, np.uint32)  # made into keys inside the programs
  graphdef, state = nnx.split(model)
  sampling = (float(temperature), int(top_k), float(top_p))
  tokens, starts, keys = _placed((tokens, starts, keys), mesh)
  prompt_len = jnp.int32(tokens.shape[1])
  # Compiled ahead, so that each program's run is timed without its compilation.
  timed = time.perf_counter()
  # Together: a host that compiles later must not leave the others waiting
  # past the collectives' own deadline at the first run (spmd.compile_meeting).
  prefill = compile_meeting.compile_together(
    "generate's prefill",
    _prefill,
    graphdef,
    state,
    tokens,
    starts,
    keys,
    max_len,
    *sampling,
    tuple(rules),
    mesh,
  )
  compile_seconds = time.perf_counter() - timed
  timed = time.perf_counter()
  first, cache = jax.block_until_ready(prefill(state, tokens, starts, keys))
  prefill_seconds = time.perf_counter() - timed
  timed = time.perf_counter()
  static = (num_tokens, *sampling, eos_id, pad_id, tuple(rules), mesh)
  run = compile_meeting.compile_together(
    "generate's decode", _decode, graphdef, state, first, cache, starts, keys, prompt_len, *static
  )
  compile_seconds += time.perf_counter() - timed
  timed = time.perf_counter()
  out, lengths, steps = jax.block_until_ready(run(state, first, cache, starts, keys, prompt_len))
  decode_seconds = time.perf_counter() - timed
  return Completions(
    tokens=_on_host(out),
    lengths=_on_host(lengths),
    compile_seconds=compile_seconds,
    prefill_seconds=prefill_seconds,
    decode_seconds=decode_seconds,
    steps=int(steps),
    platform=next(iter(out.devices())).platform,
  )
