"""Where each of our Llama's parameters lives in a Hugging Face checkpoint, and in what layout.

HF's linear layers store `weight` as [out, in]; ours are [in, out] with the
heads split out ([d_model, heads, head_dim] for the query). Each of our
parameters is its HF tensor reshaped (`view`: HF's first or last dimension
split into heads and head_dim, a free row-major reshape) and transposed
(`perm`): `ours = hf.reshape(view).transpose(perm)`.

RoPE needs no permutation: our `apply_rope` rotates the two halves of each
head (HF's `rotate_half`), the layout HF's Llama checkpoints are stored in.

Per-layer tensors (`model.layers.{i}...`) are stacked along our first axis
when the layers are scanned (`blocks/attn/query` [layers, ...]), or named by
layer when not (`blocks/0/attn/query`).

Example:
  >>> layout = layout_for("blocks/attn/query", scanned=True)
  >>> layout.hf_name(3), layout.per_layer
  ('model.layers.3.self_attn.q_proj.weight', True)
  >>> layout.hf_shape((64, 4, 16))  # ours [d_model, heads, head_dim]
  (64, 64)
  >>> layout_for("blocks/1/mlp/down", scanned=False).hf_name(None)
  'model.layers.1.mlp.down_proj.weight'
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  """One parameter's HF tensor (a `{i}` for the layer) and how its axes map to ours."""

  template: str
  perm: tuple[int, ...]  # ours = view.transpose(perm)
  groups: tuple[tuple[int, ...], ...]  # the view's dimensions that make each HF dimension
  per_layer: bool = False  # stacked: one HF tensor per layer along our first axis
  layer: int | None = None  # unrolled: this layer's

  def hf_name(self, layer: int | None) -> str:
    return self.template.format(i=self.layer if layer is None else layer)

  def view_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape with the heads split out, from our (one layer's) shape."""
    view = [0] * len(ours)
    for axis, size in zip(self.perm, ours):
      view[axis] = size
    return tuple(view)

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for our (one layer's) shape."""
    view = self.view_shape(ours)
    return tuple(math.prod(view[d] for d in group) for group in self.groups)

  def hf_index(self, ours: tuple[int, ...], index: tuple[slice, ...]) -> tuple[slice, ...]:
    """The part of the HF tensor to read for our (one layer's) `index`: whole heads, no more."""
    view = self.view_shape(ours)
    view_index = [slice(None)] * len(view)
    for axis, s in zip(self.perm, index):
      view_index[axis] = s
    out = []
    for group in self.groups:
      # Only the outermost split dimension narrows the read; its inner ones
      # are cut after the reshape (`to_ours`).
      first, inner = group[0], math.prod(view[d] for d in group[1:])
      start, stop, _ = view_index[first].indices(view[first])
      out.append(slice(start * inner, stop * inner))
    return tuple(out)

  def to_ours(
    self, part: np.ndarray, ours: tuple[int, ...], index: tuple[slice, ...]
  ) -> np.ndarray:
    """Our `index` of the parameter, from the HF part `hf_index` read."""
    view = self.view_shape(ours)
    view_index = [slice(None)] * len(view)
    for axis, s in zip(self.perm, index):
      view_index[axis] = s
    shape = []
    for group in self.groups:
      start, stop, _ = view_index[group[0]].indices(view[group[0]])
      shape.append(stop - start)
      shape.extend(view[d] for d in group[1:])
    inner = [slice(None)] * len(view)
    for group in self.groups:
      for d in group[1:]:
        inner[d] = view_index[d]
    return part.reshape(shape)[tuple(inner)].transpose(self.perm)

  def to_hf(self, value: np.ndarray) -> np.ndarray:
    """The whole HF tensor from our (one layer's) whole parameter."""
    inverse = tuple(np.argsort(self.perm))
    return np.ascontiguousarray(value.transpose(inverse)).reshape(self.hf_shape(value.shape))


_LAYER = "model.layers.{i}."
_SPLIT_FIRST = ((0, 1), (2,))  # [heads * head_dim, d_model] -> view [heads, head_dim, d_model]
# Our name within a block -> (HF name after model.layers.{i}., perm, groups).
_BLOCK = {
  "attn/query": ("self_attn.q_proj.weight", (2, 0, 1), _SPLIT_FIRST),
  "attn/key": ("self_attn.k_proj.weight", (2, 0, 1), _SPLIT_FIRST),
  "attn/value": ("self_attn.v_proj.weight", (2, 0, 1), _SPLIT_FIRST),
  # [d_model, heads * head_dim] -> view [d_model, heads, head_dim]; ours [heads, head_dim, d_model]
  "attn/out": ("self_attn.o_proj.weight", (1, 2, 0), ((0,), (1, 2))),
  "attn/query_bias": ("self_attn.q_proj.bias", (0, 1), ((0, 1),)),
  "attn/key_bias": ("self_attn.k_proj.bias", (0, 1), ((0, 1),)),
  "attn/value_bias": ("self_attn.v_proj.bias", (0, 1), ((0, 1),)),
  "attn_norm/scale": ("input_layernorm.weight", (0,), ((0,),)),
  "mlp_norm/scale": ("post_attention_layernorm.weight", (0,), ((0,),)),
  "mlp/gate": ("mlp.gate_proj.weight", (1, 0), ((0,), (1,))),
  "mlp/up": ("mlp.up_proj.weight", (1, 0), ((0,), (1,))),
  "mlp/down": ("mlp.down_proj.weight", (1, 0), ((0,), (1,))),
}
_TOP = {
  "token_embed": ("model.embed_tokens.weight", (0, 1), ((0,), (1,))),
  "final_norm/scale": ("model.norm.weight", (0,), ((0,),)),
  "unembed": ("lm_head.weight", (1, 0), ((0,), (1,))),
}
TIED_OUTPUT = "lm_head.weight"  # present in some tied checkpoints; the embedding serves


def layout_for(key: str, scanned: bool) -> Layout:
  """The layout of our parameter `key` (as `trainers.checkpoints.export.flatten` names it).

  Raises:
    ValueError: a parameter with no HF counterpart (naming it).
  """
  if key in _TOP:
    name, perm, groups = _TOP[key]
    return Layout(name, perm, groups)
  parts = key.split("/")
  if parts[0] == "blocks":
    if scanned and "/".join(parts[1:]) in _BLOCK:
      name, perm, groups = _BLOCK["/".join(parts[1:])]
      return Layout(_LAYER + name, perm, groups, per_layer=True)
    if not scanned and len(parts) > 2 and parts[1].isdigit() and "/".join(parts[2:]) in _BLOCK:
      name, perm, groups = _BLOCK["/".join(parts[2:])]
      return Layout(_LAYER + name, perm, groups, layer=int(parts[1]))
  raise ValueError(f"parameter {key!r} has no Hugging Face counterpart (not a Llama parameter)")
