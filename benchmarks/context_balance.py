"""C3: the attention work of each `context` shard, counted from the causal block mask.

  python -m benchmarks.context_balance [--json=out.json] [--length=131072] [--shards=8] [--block=1024]

A block-sparse kernel (splash) computes a (query block, key block) pair of
causal attention when any of its entries is unmasked, and skips the rest;
its FLOPs are inside a custom call, so the compiled program's FLOPs cannot
count them. This counts them from the mask itself: each shard's query
blocks (its slice of the sequence, in the load-balanced order the step puts
it in, `spmd.context`) against the key blocks of the whole gathered
sequence, masked by the tokens' original places (`spmd.context.
causal_blocks`, which tests/test_context.py checks against splash's own
block mask). Two figures at `llama3_8b`'s 131,072-token setting on 8
shards:

- C3, the load balance: the busiest shard's blocks ÷ the mean (goal ≤ 1.1);
- C3-total: all shards' blocks ÷ one unsplit device's (goal ≤ 1.05: no
  work done twice).

The natural order's balance is in C3's detail, for what the order buys.
"""

from __future__ import annotations

import argparse

from benchmarks import common
from spmd.context import causal_blocks

GOALS = {"C3": 1.1, "C3-total": 1.05}


def counts(length: int, shards: int, block: int) -> dict[str, list[int]]:
  """Blocks per shard in the balanced and the natural order, and one unsplit device's.

  Example:
    >>> counts(16, 2, 2)
    {'balanced': [18, 18], 'natural': [10, 26], 'unsplit': [36]}
  """
  return {
    "balanced": causal_blocks(length, shards, balanced=True, block=block),
    "natural": causal_blocks(length, shards, balanced=False, block=block),
    "unsplit": causal_blocks(length, 1, balanced=False, block=block),
  }


def rows(length: int, shards: int, block: int, where: str) -> list[dict]:
  """C3 and C3-total's rows.

  Example:
    >>> [(r["id"], r["value"]) for r in rows(16, 2, 2, "m")]
    [('C3', 1.0), ('C3-total', 1.0)]
  """
  got = counts(length, shards, block)
  balanced, natural, (unsplit,) = got["balanced"], got["natural"], got["unsplit"]

  def balance(blocks: list[int]) -> float:
    return max(blocks) / (sum(blocks) / len(blocks))

  setting = f"{length:,} tokens on context={shards}, blocks of {block}"
  return [
    common.row(
      "C3",
      "causal attention blocks of the busiest `context` shard ÷ the mean (load balance)",
      balance(balanced),
      GOALS["C3"],
      True,
      f"{setting}: {max(balanced):,} vs {sum(balanced) / shards:,.0f} a shard in the balanced "
      f"order; the natural order {balance(natural):.3f} ({max(natural):,} vs "
      f"{sum(natural) / shards:,.0f})",
      where,
    ),
    common.row(
      "C3-total",
      "causal attention blocks of all `context` shards ÷ one unsplit device's (work done twice)",
      sum(balanced) / unsplit,
      GOALS["C3-total"],
      True,
      f"{setting}: {sum(balanced):,} vs {unsplit:,}",
      where,
    ),
  ]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--length", type=int, default=131072, help="llama3_8b's long setting")
  parser.add_argument("--shards", type=int, default=8)
  parser.add_argument("--block", type=int, default=1024, help="splash's block at bf16")
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  where = common.machine("counted from the block mask (no compile)")
  common.emit(rows(args.length, args.shards, args.block, where), args.json)


if __name__ == "__main__":
  main()
