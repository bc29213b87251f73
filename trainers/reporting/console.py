"""What a person reads on process 0's console: the progress bar and the end-of-run summary table.

Every other process builds the same bar with `enabled=False`, and it prints nothing.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, Self

import jax
import tqdm


def _short(value: float) -> str:
  if abs(value) >= 1000:
    return tqdm.tqdm.format_sizeof(value, divisor=1000)
  return f"{value:.4g}"


class Progress:
  """A tqdm progress bar over training steps, shown on process 0 only.

  `initial` is the step a resumed run starts from: the bar starts there, so
  the rate and ETA count only this run's steps. `update(step, loss=...,
  tokens_per_s=...)` moves the bar to `step` and shows the given values; they
  must be plain numbers the caller already has on the host: a jax array is a
  TypeError, because converting it here would wait for the device each step.
  With `enabled=False` nothing is printed.

  Example:
    >>> import io
    >>> out = io.StringIO()
    >>> with Progress(total_steps=100, initial=10, enabled=True, file=out) as bar:
    ...   bar.update(20, loss=2.5, tokens_per_s=12345.0)
    >>> "20/100" in out.getvalue() and "loss=2.5" in out.getvalue()
    True
  """

  def __init__(
    self,
    total_steps: int,
    initial: int = 0,
    enabled: bool = True,
    file: IO[str] | None = None,
    mininterval_s: float = 1.0,
  ) -> None:
    if not 0 <= initial <= total_steps:
      raise ValueError(f"{initial=} must be within 0..{total_steps=}")
    self.enabled = enabled
    self._bar: tqdm.tqdm | None = None
    if enabled:
      self._bar = tqdm.tqdm(
        total=total_steps,
        initial=initial,
        unit="step",
        file=sys.stderr if file is None else file,
        dynamic_ncols=True,
        mininterval=mininterval_s,
      )

  def update(self, step: int, /, **postfix: float) -> None:
    """Moves the bar to `step` (absolute, not a delta) and shows `postfix` (name -> number)."""
    if self._bar is None:
      return
    shown = {}
    for key, value in postfix.items():
      if isinstance(value, jax.Array):
        raise TypeError(
          f"Progress.update({key}=<jax.Array>): pass a host float, not a device value"
        )
      label = "tok/s" if key == "tokens_per_s" else key
      shown[label] = _short(float(value))
    self._bar.set_postfix(shown, refresh=False)
    self._bar.update(step - self._bar.n)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()


def _duration(seconds: float) -> str:
  seconds = round(seconds)
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _flops(value: float) -> str:
  for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
    if value >= scale:
      return f"{value / scale:.4g} {prefix}FLOP/s"
  return f"{value:.4g} FLOP/s"


# Summary entries in print order: key -> (label, formatter). The trainer fills
# what it has; a key it does not set (or sets to None) is left out.
_SUMMARY: dict[str, tuple[str, Callable[[Any], str]]] = {
  "steps": ("steps", lambda v: f"{int(v):,}"),
  "train_loss": ("final train loss", lambda v: f"{v:.4f}"),
  "eval_loss": ("eval loss", lambda v: f"{v:.4f}"),
  "eval_accuracy": ("eval accuracy", lambda v: f"{100 * v:.2f}%"),
  "tokens_per_s": ("tokens/s", lambda v: f"{v:,.0f}"),
  "examples_per_s": ("examples/s", lambda v: f"{v:,.0f}"),
  "real_token_share": ("real tokens per batch", lambda v: f"{100 * v:.1f}%"),
  "data_sources": ("data sources (share, epochs)", lambda v: _sources(v)),
  "mfu": ("MFU", lambda v: f"{100 * v:.1f}%"),
  "hfu": ("HFU (compiled matmul FLOPs)", lambda v: f"{100 * v:.1f}%"),
  "peak_flops_per_s": ("peak per device", _flops),
  "peak_source": ("peak source", str),
  "wall_time_s": ("wall time", _duration),
  "first_step_s": ("first step done after", _duration),
  "resumed_from": ("state from", str),
  "workdir": ("workdir", str),
  "checkpoints": ("checkpoints", str),
  "metrics": ("metrics", str),
  "tensorboard": ("tensorboard", str),
  "loss_curve": ("loss curve", str),
}


def _sources(fed: Sequence[Mapping[str, Any]]) -> str:
  """A mixture's sources: each one's share of what the run fed and its epochs."""
  return ", ".join(f"{f['source']} {100 * f['share']:.1f}% ({f['epochs']:.2f})" for f in fed)


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_summary(d: Mapping[str, Any], own_entries: Sequence[str] = ()) -> str:
  """An aligned end-of-run summary of the known entries of `d`.

  Known keys, in print order: steps, train_loss, eval_loss, the task's eval
  metrics (`eval_<name>`, whatever the names: "eval <name>" with 4
  significant digits; `eval_accuracy`, a fraction, as %), tokens_per_s (any
  `<unit>_per_s`), real_token_share, data_sources (a mixture's sources, each
  one's share and epochs), mfu (a fraction, printed as %), peak_flops_per_s,
  peak_source, wall_time_s, first_step_s, resumed_from, workdir, and the
  paths checkpoints, metrics, tensorboard, loss_curve. Entries that are absent
  or None are skipped, and so are other keys, because the same dict is also
  the trainer's result (loss history, samples), except `own_entries` (the
  hooks' entries, `Hook.end`), which come last, labelled by their names.
  Non-finite numbers print as "nan"/"inf".

  Example:
    >>> print(format_summary({"steps": 1000, "train_loss": 2.34567, "eval_mae": 0.012341,
    ...                       "mfu": 0.4123, "x": [1], "data_checked": 250},
    ...                      own_entries=["data_checked"]))
    run summary
      steps            : 1,000
      final train loss : 2.3457
      eval mae         : 0.01234
      MFU              : 41.2%
      data checked     : 250
  """
  rows = []
  table = dict(_SUMMARY)
  # Where an entry the table does not name goes: "<unit>_per_s" (any task's
  # unit) as "<unit>/s" beside the built-in rates, a task's eval metric
  # "eval_<name>" as "eval <name>" beside the eval loss.
  anchor = {}
  for key, value in d.items():
    if key in table:
      continue
    if key.endswith("_per_s") and key != "peak_flops_per_s":
      table[key] = (key[: -len("_per_s")] + "/s", lambda v: f"{v:,.0f}")
      anchor[key] = "tokens_per_s"
    elif key.startswith("eval_") and _is_number(value):
      table[key] = ("eval " + key[len("eval_") :], lambda v: f"{v:.4g}")
      anchor[key] = "eval_accuracy"
  ordered = sorted(table, key=lambda k: list(_SUMMARY).index(anchor.get(k, k)))
  for key in own_entries:  # the hooks' own, last, by their names
    if key not in table:
      table[key] = (key.replace("_", " "), lambda v: f"{v:.4g}" if _is_number(v) else str(v))
      ordered.append(key)
  for key in ordered:
    label, fmt = table[key]
    value = d.get(key)
    if value is None:
      continue
    if isinstance(value, float) and not math.isfinite(value):
      rows.append((label, str(value)))
    else:
      rows.append((label, fmt(value)))
  width = max((len(label) for label, _ in rows), default=0)
  return "\n".join(["run summary", *(f"  {label:<{width}} : {text}" for label, text in rows)])
