"""A Llama without grouped-query attention that fills one v5e chip: about 542M parameters.

  spmd-plan --config=configs/llama_tpu_shape_mha.py --topology=v5e-1
  benchmarks/tpu_shapes.sh --shapes=mha       # on the chip: its MFU through spmd-train (P9-mha)

8 layers, d_model 2048, 16 query heads of 128 each with its own key/value
head (no GQA), SwiGLU width 5632, a 32000-token vocabulary, 2048-token
sequences. Why this shape: the TPU check's model (`llama_tpu_check.py`)
shares each key/value head among three query heads; this one is wider and
shallower and has full multi-head attention, so its key and value
projections are as large as the query's. Every matmul dimension is a
multiple of 128, the MXU's width (head_dim 128, d_ff 22 x 256).

6 rows a step (12,288 tokens) with bf16 compute, float32 parameters and
Adam state, layers scanned and keeping every weight matmul's output
("minimal" remat). Why 6 rows and not the 8 the check takes: on the chip
(2026-12-06, through spmd-train) this shape ran at 56.9% MFU with 8 rows
and 59.3% with 6. Recomputing the query, key and value projections
("minimal_no_qkv", as the check does) would free memory this shape does
not need, at the cost of a larger share of its FLOPs than under GQA.
"""

from configs import llama_tpu_check


def get_config():
  config = llama_tpu_check.get_config()
  config.model.num_layers = 8
  config.model.d_model = 2048
  config.model.num_heads = 16
  config.model.num_kv_heads = 16
  config.model.d_ff = 5632
  config.model.remat_policy = "minimal"
  config.global_batch = 6
  return config
