"""A Llama of 4096-token sequences that fills one v5e chip: about 537M parameters.

  spmd-plan --config=configs/llama_tpu_shape_long.py --topology=v5e-1
  benchmarks/tpu_shapes.sh --shapes=long      # on the chip: its MFU through spmd-train (P9-long)

9 layers, d_model 2048, 16 query heads of 128 sharing 4 key/value heads,
SwiGLU width 5632, a 32000-token vocabulary, 4096-token sequences. Why
this shape: twice the TPU check's context, so attention (its full square,
as PaLM counts it) is about a quarter of the step's model FLOPs, against
under a fifth at 2048 tokens, and splash's causal blocks carry more of the
step. Every matmul dimension is a multiple of 128, the MXU's width
(head_dim 128, d_ff 22 x 256).

4 rows a step (16,384 tokens, as many as the check's 8 rows of 2048) with
bf16 compute, float32 parameters and Adam state, layers scanned and
keeping every weight matmul's output ("minimal" remat): the compiler fits
that step in the chip's HBM without rematerializing anything on its own.
A tenth layer does not fit so; it fits only by recomputing the query, key
and value projections ("minimal_no_qkv"), which makes every step compute
them twice.
"""

from configs import llama_tpu_check


def get_config():
  config = llama_tpu_check.get_config()
  config.model.seq_len = 4096
  config.model.num_layers = 9
  config.model.d_model = 2048
  config.model.num_heads = 16
  config.model.num_kv_heads = 4
  config.model.d_ff = 5632
  config.model.remat_policy = "minimal"
  config.global_batch = 4
  return config
