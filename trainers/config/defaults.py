"""The default config: every setting the trainer reads, its default and what it does.

It is the reference the run's config is checked against (`trainers.config.checks`):
a key it lacks, or a value of another type, is an error, in config files as in
overrides, so a typo is never a silently ignored setting. Config files import
it through `configs/default.py` and change a few fields.

Example:
  >>> config = get_config()
  >>> config.train.optimizer, config.mesh.rules
  ('adamw', 'fsdp')
"""

import ml_collections

from trainers.step import optim
from trainers.tasks import lm


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  # The device assignment (spmd.mesh.create_mesh). One -1 fills the rest.
  config.mesh = ml_collections.ConfigDict()
  config.mesh.ici = "data=-1,fsdp=1,tensor=1"  # inside a slice (or the whole job)
  config.mesh.dcn = ""  # across TPU slices / GPU nodes, e.g. "data=2"
  config.mesh.rules = "fsdp"  # logical axis rules preset: dp, fsdp, fsdp_tp
  # Mesh axes that split the batch (those the mesh has): `expert` splits it
  # outside the routed layers, as MaxText's expert parallelism does.
  config.mesh.batch_axes = ("data", "fsdp", "expert")
  # Variables without sharding names (e.g. a stock nnx.Linear): "replicate", or
  # "fsdp" = split over the batch axes along their largest divisible dimension.
  config.mesh.unannotated = "replicate"

  # Global batch: the same whatever the number of hosts.
  config.global_batch = 32

  # Data: a TFDS dataset prepared in data.dir. "text_corpus" is built on
  # first use from data.source (default: this Python's standard library).
  config.data = ml_collections.ConfigDict()
  config.data.name = "text_corpus"
  config.data.source = ""  # text_corpus only: a directory, glob or "" for the stdlib
  config.data.dir = ""  # default: <workdir>/../data (shared between runs)
  # Your files as they are (the LM tasks, packed; docs/data.md): a comma-separated
  # list of PATH_OR_GLOB or PATH_OR_GLOB@WEIGHT, local or gs://, each .jsonl,
  # .jsonl.gz, .jsonl.zst, .parquet, .txt or an HF `datasets` save_to_disk folder.
  # Weights are shares of rows (none given: in proportion to each source's size).
  # Replaces data.name and data.source.
  config.data.sources = ""
  config.data.text_field = "text"  # the JSON field or column that holds each document
  # "text" (data.text_field is a document) or "prompt_completion": data.sources'
  # JSONL rows with `prompt` and `completion` strings, the loss on the completion
  # and its EOS only (docs/finetune.md).
  config.data.format = "text"
  # Sources to evaluate on instead of holding documents out of data.sources ("": hold out).
  config.data.eval_sources = ""
  # Bad rows (not JSON, no text_field, not a string, null) a source may skip; past
  # that a bad row is an error naming its file and row. The run logs what it skipped.
  config.data.skip_bad_rows = 0
  # The share held out for evaluation: of the files (text_corpus), or of each
  # source's documents (data.sources, unless data.eval_sources names its own).
  config.data.validation_percent = 2.0
  config.data.train_split = "train"
  config.data.eval_split = "validation"
  config.data.prefetch = 2
  # The LM task's tokens: "bytes" (ids = the text's bytes, vocab 256), "bpe" (a
  # byte-level BPE of model.vocab_size ids trained on first use on the text
  # corpus's train files, or on a bounded sample of every data.sources source,
  # cached in data.dir), or a path/URL to a tokenizer.json or SentencePiece
  # .model. A subword tokenizer on the text corpus needs pack.
  config.data.tokenizer = "bytes"
  # Pack documents (files, or a pre-tokenized dataset's records) framed with
  # BOS/EOS into windows of model.seq_len + 1 tokens, one record each: every
  # token used, batches with segment_ids/positions (trainers/data/prepare/packed.py).
  config.data.pack = False
  # Records per shuffle block when records hold several examples (LM windows):
  # a batch draws from this many records, each read about once per block.
  config.data.shuffle_block = 256
  # A gs:// data.dir: 0 copies the whole folder to every host before step 0;
  # N > 0 stages shards on demand into a local cache of at most N bytes a
  # process, least recently used out, and orders the records a window of
  # shards at a time (trainers/data/records/shard_cache.py). Local dirs are read in place.
  config.data.cache_bytes = 0
  # Seconds a process waits for the others at each step of preparing the data
  # (the tokenizer, each source's tokenizing, packing and publishing; a remote
  # data.dir's upload): past it, the run stops naming the step. A corpus that
  # takes longer to prepare needs more.
  config.data.prepare_timeout_s = 3600.0

  # The task: what model trains on what data, with which loss (trainers/tasks).
  # A built-in name ("lm", "classifier"), "package.module:function", or
  # "file.py:function" relative to the config file's folder.
  config.task = "lm"
  # The task's own section: its keys are the task's (for "lm", the sizes of
  # trainers.models.transformer.TransformerConfig; see trainers/tasks/lm.py).
  config.model = lm.default_model_config()

  # Optimisation (trainers/step/optim.py): an optax optimizer by name after global-norm
  # clipping, a linear warmup then a decay, and weight decay on a masked subset.
  config.train = ml_collections.ConfigDict()
  config.train.steps = 1000
  config.train.optimizer = "adamw"  # adamw, adafactor, lion, sgd
  config.train.learning_rate = 3e-3
  config.train.schedule = "cosine"  # after the warmup: cosine, linear, constant, rsqrt
  config.train.warmup_steps = 100
  config.train.end_learning_rate_fraction = 0.1  # cosine and linear end here
  config.train.weight_decay = 0.1
  # Parameters whose path ("blocks/0/attn_norm/scale") one of these regexes
  # matches get no decay: by default norms, biases and embedding tables.
  config.train.weight_decay_exclude = optim.DEFAULT_DECAY_EXCLUDE
  config.train.b1 = 0.9  # adamw, lion
  config.train.b2 = 0.95  # adamw, lion
  config.train.momentum = 0.9  # sgd (0 = none)
  config.train.nesterov = False  # sgd
  config.train.grad_clip_norm = 1.0  # 0 = no clipping
  config.train.micro_batches = 1  # gradient accumulation
  # What the step computes in, for any model (trainers/step/precision.py): "float32",
  # or "bfloat16" (parameters and batch inputs cast to bf16 inside the step;
  # parameters, optimizer state, gradients and loss sums stay float32).
  config.train.precision = "float32"
  # Sum gradients across hosts as one flat buffer: "auto" = on CPU across processes
  # with replicated parameters (gloo pays per array; see trainers/step/gradient_reduction.py).
  config.train.flat_grad_reduce = "auto"
  # How a step with a non-finite loss or gradient keeps the old state: "auto" =
  # a branch (lax.cond), except on GPU, where a conditional blocks the host every
  # step, a select (see trainers/step/train_step.py).
  config.train.nonfinite_guard = "auto"
  config.train.max_bad_steps = 5  # non-finite loss/grads this many times in a row: stop
  config.train.stop_at_step = 0  # stop early (the schedule still spans train.steps); 0 = no
  # The watchdog: no finished step for this long ends the job, naming the
  # process furthest behind (0 = off). The first step includes compilation.
  config.train.step_timeout_s = 600.0
  config.train.first_step_timeout_s = 3600.0

  # Periodic work: each hook has its own schedule (0 = never).
  # Your own hooks and wrappers (trainers/hooks/): "package.module:function" or
  # "file.py:function" beside the config file; function(config) -> Hook(s) or
  # Wrapper(s). Their settings go in hook_settings, a section the trainer does
  # not check (as config.model is the task's): each factory checks what it reads.
  config.hooks = ()
  config.hook_settings = ml_collections.ConfigDict()
  config.log_every = 10
  config.eval_every = 200
  config.eval_batches = 8  # 0 = the whole eval split
  config.eval_timeout_s = 1800.0  # an eval's own time limit in the watchdog (0 = none)
  # Evals beside the loss eval, every eval_every steps and in --mode=eval
  # (trainers/evals, docs/evals.md): named sections, e.g.
  #   config.evals.arc = ml_collections.ConfigDict(
  #       dict(kind="multiple_choice", path="arc.jsonl", layout="arc"))
  # Their keys are checked by trainers/evals/specs.py. None by default.
  config.evals = ml_collections.ConfigDict()
  # LoRA (trainers/models/lora.py, docs/finetune.md): low-rank adapters beside the
  # weights whose parameter path a pattern of `targets` matches (regexes, or a
  # model's short names: the built-in Llama's q, k, v, o, gate, up, down). Only the
  # adapters train and have optimizer state; the other weights are frozen in the
  # compute dtype. () = off.
  config.lora = ml_collections.ConfigDict()
  config.lora.targets = ""  # comma-separated, e.g. "q,k,v,o,gate,up,down"
  config.lora.rank = 16
  config.lora.alpha = 16.0  # the adapters' scale is alpha / rank
  # Of the adapters' input, in training only (peft's lora_dropout); models that
  # apply their adapters themselves only (the built-in Llama).
  config.lora.dropout = 0.0
  # A peft adapter folder (adapter_config.json, adapter_model.safetensors) to start
  # the adapters from, on the base weights of checkpoint.init_from; "" = A random, B 0.
  config.lora.init_from = ""
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every = 200
  config.checkpoint.keep = 3  # the last K ...
  config.checkpoint.keep_period = 0  # ... plus every M-th step (0 = none)
  config.checkpoint.init_from = ""  # initial weights (params, model state) from another run: workdir, checkpoints dir or step dir
  # With init_from a Hugging Face folder: True lets config.model's RoPE fields
  # (rope_theta, rope_scaling and the llama3 rope_* ones) differ from its
  # config.json and seq_len exceed its max_position_embeddings, to train
  # longer than it was trained (docs/finetune.md). The run logs each change.
  config.checkpoint.rope_override = False
  # A save's own time limit in the watchdog (0 = none); the step limit does not apply.
  config.checkpoint.save_timeout_s = 1800.0
  # Weights & Biases (trainers/reporting/tracking.py; the `wandb` extra): process 0
  # logs the metrics file's records and the summary. "" = off. A restart resumes
  # the same W&B run (its id is kept in the workdir).
  config.wandb = ml_collections.ConfigDict()
  config.wandb.project = ""
  config.wandb.entity = ""  # "" = your default entity
  config.wandb.name = ""  # "" = the workdir's name
  config.wandb.mode = ""  # online, offline, disabled; "" = WANDB_MODE, else online
  config.profile = ml_collections.ConfigDict()
  config.profile.start_step = -1  # -1 = no trace
  config.profile.num_steps = 5
  # The LM task's greedy sample at the end: this many tokens after the prompt
  # (0 = no sample). Text for a byte-level vocabulary; with a larger one and no
  # tokenizer the prompt is its UTF-8 bytes and the sample is shown as ids.
  config.sample_tokens = 96
  config.sample_prompt = "def "
  # loss.png at the end of the run, drawn by process 0 with matplotlib (about a
  # CPU second, mostly its import); False leaves it out of the run and its summary.
  config.loss_curve = True
  # Persistent compilation cache: restarts skip XLA compiles. Default: the
  # JAX_COMPILATION_CACHE_DIR environment variable, else <workdir>/../.jax_cache.
  config.compilation_cache_dir = ""
  config.transfer_guard = ""  # "disallow" makes implicit host<->device transfers errors
  return config
