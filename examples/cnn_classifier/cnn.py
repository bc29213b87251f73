"""A small convolutional classifier in Flax NNX, for images such as `shapes`.

3x3 convolutions (three by default), each followed by batch norm and ReLU, all
but the first with stride 2; then a global mean over the remaining pixels,
dropout and one linear layer to the class logits.

The model holds no random state: the caller passes `rngs` for dropout on each
call, so `nnx.state(model)` is only `nnx.Param` and `nnx.BatchStat`. The trainer
switches modes with `model.train()` (dropout on, batch statistics of the batch,
running averages updated) and `model.eval()` (dropout off, running averages
used and left alone). A new model is in training mode. Parameters carry no
sharding annotations; whoever places them decides.

  >>> import jax.numpy as jnp
  >>> model = CNN(num_classes=6, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 16, 16, 1)), rngs=nnx.Rngs(dropout=1)).shape
  (2, 6)
  >>> model.eval()
  >>> model(jnp.zeros((2, 16, 16, 1))).dtype
  dtype('float32')
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


class CNN(nnx.Module):
  """Convolutions with batch norm, global mean pooling, dropout, linear head.

  Args:
    num_classes: the number of logits per image.
    features: output channels of the convolutions, in order; every one after the
      first halves the height and width (stride 2).
    dropout_rate: the fraction of pooled features dropped in training mode.
    rngs: initialises the parameters; kept by neither the model nor its layers.
    in_channels: channels of the input images (1: grayscale).

  >>> model = CNN(num_classes=3, features=(8, 16), rngs=nnx.Rngs(0))
  >>> sorted({type(v).__name__ for v in jax.tree.leaves(
  ...   nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))})
  ['BatchStat', 'Param']
  """

  def __init__(
    self,
    num_classes: int,
    features: Sequence[int] = (16, 32, 64),
    dropout_rate: float = 0.1,
    *,
    rngs: nnx.Rngs,
    in_channels: int = 1,
  ):
    features = tuple(features)
    if num_classes < 1:
      raise ValueError(f"num_classes={num_classes}: expected at least 1")
    if not features or any(f < 1 for f in features):
      raise ValueError(f"features={features}: expected one or more positive channel counts")
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f"dropout_rate={dropout_rate}: expected a value in [0, 1)")
    if in_channels < 1:
      raise ValueError(f"in_channels={in_channels}: expected at least 1")
    self.num_classes = num_classes
    convs, norms = [], []
    channels = in_channels
    for i, out in enumerate(features):
      convs.append(
        nnx.Conv(
          channels,
          out,
          kernel_size=(3, 3),
          strides=1 if i == 0 else 2,
          padding="SAME",
          use_bias=False,  # batch norm's bias follows
          rngs=rngs,
        )
      )
      # Momentum 0.9 rather than 0.99: runs of a few hundred steps should end with
      # running averages that describe the trained model, not the initial one.
      norms.append(nnx.BatchNorm(out, momentum=0.9, rngs=rngs))
      channels = out
    self.convs = nnx.List(convs)
    self.norms = nnx.List(norms)
    # No rngs here: dropout keys come with each call, so the model holds no RNG state.
    self.dropout = nnx.Dropout(dropout_rate)
    self.head = nnx.Linear(channels, num_classes, rngs=rngs)

  def __call__(self, images: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Images [B, H, W, in_channels] -> float32 logits [B, num_classes].

    `rngs` supplies the dropout key and is needed in training mode only.

    >>> model = CNN(num_classes=4, rngs=nnx.Rngs(0))
    >>> model.eval()
    >>> x = jnp.ones((3, 16, 16, 1))
    >>> bool(jnp.array_equal(model(x), model(x)))
    True
    """
    x = jnp.asarray(images, jnp.float32)
    for conv, norm in zip(self.convs, self.norms):
      x = jax.nn.relu(norm(conv(x)))
    x = jnp.mean(x, axis=(1, 2))
    x = self.dropout(x, rngs=rngs)
    return self.head(x).astype(jnp.float32)
