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

A routed MLP's experts (`trainers.models.moe`) are one HF tensor per expert
(`...experts.{e}.w1.weight`, the Hub's layout for Mixtral and Qwen2-MoE),
stacked along our experts axis, the next after the layers'. The names differ
by family, so `layout_for` takes the config.json's `model_type`:

  ours (blocks/mlp/...)  mixtral (block_sparse_moe.)  qwen2_moe (mlp.)
  router                 gate.weight                  gate.weight
  expert_gate            experts.{e}.w1.weight        experts.{e}.gate_proj.weight
  expert_up              experts.{e}.w3.weight        experts.{e}.up_proj.weight
  expert_down            experts.{e}.w2.weight        experts.{e}.down_proj.weight
  shared/gate, up, down  -                            shared_expert.{gate,up,down}_proj.weight
  shared_gate [d_model]  -                            shared_expert_gate.weight [1, d_model]

Example:
  >>> layout = layout_for("blocks/attn/query", scanned=True)
  >>> layout.hf_name(3), layout.per_layer
  ('model.layers.3.self_attn.q_proj.weight', True)
  >>> layout.hf_shape((64, 4, 16))  # ours [d_model, heads, head_dim]
  (64, 64)
  >>> layout_for("blocks/1/mlp/down", scanned=False).hf_name(None)
  'model.layers.1.mlp.down_proj.weight'
  >>> experts = layout_for("blocks/mlp/expert_down", scanned=True, family="mixtral")
  >>> experts.hf_name(3, expert=5), experts.stacked_axes
  ('model.layers.3.block_sparse_moe.experts.5.w2.weight', 2)
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
  per_expert: bool = False  # stacked: one HF tensor per expert along the next axis

  @property
  def stacked_axes(self) -> int:
    """Our leading axes that each index one HF tensor (layers, experts); the rest map to its axes."""
    return int(self.per_layer) + int(self.per_expert)

  def hf_name(self, layer: int | None, expert: int | None = None) -> str:
    return self.template.format(i=self.layer if layer is None else layer, e=expert)

  def hf_name_at(self, stack: tuple[int, ...]) -> str:
    """The HF tensor at `stack`, our indices along the `stacked_axes` (layer first, then expert)."""
    layer = stack[0] if self.per_layer else None
    expert = stack[-1] if self.per_expert else None
    return self.hf_name(layer, expert)

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
      if not group:  # an HF dimension of 1 that ours has not
        out.append(slice(0, 1))
        continue
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
      if not group:  # the HF dimension of 1, dropped by the reshape
        continue
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
_LINEAR = ((1, 0), ((0,), (1,)))  # HF [out, in] -> ours [in, out]
# The routed MLP's parameters by family (module docstring's table).
_MOE_BLOCK = {
  "mixtral": {
    "mlp/router": ("block_sparse_moe.gate.weight", *_LINEAR, False),
    "mlp/expert_gate": ("block_sparse_moe.experts.{e}.w1.weight", *_LINEAR, True),
    "mlp/expert_up": ("block_sparse_moe.experts.{e}.w3.weight", *_LINEAR, True),
    "mlp/expert_down": ("block_sparse_moe.experts.{e}.w2.weight", *_LINEAR, True),
  },
  "qwen2_moe": {
    "mlp/router": ("mlp.gate.weight", *_LINEAR, False),
    "mlp/expert_gate": ("mlp.experts.{e}.gate_proj.weight", *_LINEAR, True),
    "mlp/expert_up": ("mlp.experts.{e}.up_proj.weight", *_LINEAR, True),
    "mlp/expert_down": ("mlp.experts.{e}.down_proj.weight", *_LINEAR, True),
    "mlp/shared/gate": ("mlp.shared_expert.gate_proj.weight", *_LINEAR, False),
    "mlp/shared/up": ("mlp.shared_expert.up_proj.weight", *_LINEAR, False),
    "mlp/shared/down": ("mlp.shared_expert.down_proj.weight", *_LINEAR, False),
    # ours [d_model], HF's Linear(d_model, 1) [1, d_model]: the 1 is an empty group
    "mlp/shared_gate": ("mlp.shared_expert_gate.weight", (0,), ((), (0,)), False),
  },
}
MOE_FAMILIES = tuple(_MOE_BLOCK)
_TOP = {
  "token_embed": ("model.embed_tokens.weight", (0, 1), ((0,), (1,))),
  "final_norm/scale": ("model.norm.weight", (0,), ((0,),)),
  "unembed": ("lm_head.weight", (1, 0), ((0,), (1,))),
}
TIED_OUTPUT = "lm_head.weight"  # present in some tied checkpoints; the embedding serves


def _block_entry(name: str, family: str) -> tuple | None:
  """(HF name, perm, groups, per_expert) of a block parameter `name` in `family`'s checkpoints."""
  if name in _BLOCK:
    return (*_BLOCK[name], False)
  return _MOE_BLOCK.get(family, {}).get(name)


def layout_for(key: str, scanned: bool, family: str = "llama") -> Layout:
  """The layout of our parameter `key` (as `trainers.checkpoints.export.flatten` names it).

  `family`: the checkpoint's config.json `model_type`; it names the routed
  MLP's tensors (`MOE_FAMILIES`), and nothing else.

  Raises:
    ValueError: a parameter with no HF counterpart in `family` (naming both).
  """
  if key in _TOP:
    name, perm, groups = _TOP[key]
    return Layout(name, perm, groups)
  parts = key.split("/")
  if parts[0] == "blocks":
    if scanned and (entry := _block_entry("/".join(parts[1:]), family)):
      name, perm, groups, per_expert = entry
      return Layout(_LAYER + name, perm, groups, per_layer=True, per_expert=per_expert)
    if not scanned and len(parts) > 2 and parts[1].isdigit():
      if entry := _block_entry("/".join(parts[2:]), family):
        name, perm, groups, per_expert = entry
        return Layout(_LAYER + name, perm, groups, layer=int(parts[1]), per_expert=per_expert)
  if any(part.startswith(("expert_", "router", "shared")) for part in parts):
    raise ValueError(
      f"parameter {key!r} (a routed MLP's) has no Hugging Face counterpart in a {family!r} "
      f"checkpoint: routed Llamas are written as {' or '.join(MOE_FAMILIES)}"
    )
  raise ValueError(f"parameter {key!r} has no Hugging Face counterpart (not a Llama parameter)")
