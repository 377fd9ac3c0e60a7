"""Tasks: what a user brings to the trainer (model, data, loss), and the built-in example.

A task is made by a *builder*, a function ``build(args) -> Task`` named on the command line
as ``--task package.module:build`` (or ``path/to/file.py:build``). ``args`` is the parsed
``argparse.Namespace`` of ``python -m elastic_trainer.train``: every trainer flag, the
example task's flags, and ``args.task_argv``, the command-line words the trainer did not
know (your task's own flags; parse them with your own ``argparse`` parser).

The trainer does everything else: seeding, devices, DDP/FSDP wrapping, the elastic sampler,
gradient accumulation, AMP, checkpoints, resume, logging. Example::

    # my_task.py
    import torch
    from elastic_trainer.tasks import Task

    def build(args):
        model = torch.nn.Linear(16, 1)
        data = torch.utils.data.TensorDataset(torch.randn(1024, 16), torch.randn(1024, 1))
        return Task(model=model, dataset=data,
                    loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]))

    # python -m elastic_trainer.train --task my_task:build --max-steps 100

The loss must be the **mean over the samples of the micro-batch** (as ``reduction="mean"``
losses are): the trainer weights each micro-batch by its share of the global batch so that
the gradient is the mean over the global batch whatever the world size.

Data too large to index (token shards in object storage, Parquet read as a stream) comes as a
``stream.ShardedSource`` in ``dataset``'s place: a list of shards read front to back by a reader
(``ParquetReader``, ``TokenFileReader`` or your own), each row turned into a sample by ``transform``
where it is read. The position is then the rest of the epoch's shard ranges, exact at any world
size and number of DataLoader workers (docs/sampler.md, "Streaming mode")::

    from elastic_trainer.stream import ParquetReader, ShardedSource

    def to_sample(row):  # {column: value}; a list column comes as a numpy array
        return torch.from_numpy(row["tokens"][:1024].astype("int64"))

    def build(args):
        source = ShardedSource.from_glob("s3://bucket/corpus/*.parquet", ParquetReader(["tokens"]),
                                         transform=to_sample, shuffle_buffer=4096)
        return Task(model=..., dataset=source, loss_fn=...)

The built-in example (``--example``, default ``reverse``) trains a ``torch.nn.Transformer``
with Adam to reverse (or ``copy``) random token sequences generated in memory from a seed: its
loss falls from ln(vocab) towards 0 within a minute on two CPU workers; ``--data parquet:URL-GLOB``
streams its sequences from Parquet shards (a ``tokens`` column of int lists) and ``--data
tokens:URL-GLOB`` from flat token files instead (``python -m elastic_trainer.tasks write-parquet
DIR`` writes the in-memory data as shards). ``--example seeds`` is the seed scripts' workload
instead: the same Transformer on random float source and target tensors (nothing to learn), in
memory or read from an HDF5 file (``--data h5:PATH``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

DEFAULT_TASK = "elastic_trainer.tasks:build_example"


@runtime_checkable
class TaskLike(Protocol):
    """What the trainer reads from a task; any object with these attributes works."""

    model: torch.nn.Module
    dataset: Any


@dataclass
class Task:
    """A training problem: the trainer runs it data-parallel, elastic and resumable.

    Give either ``loss_fn`` or ``training_step``.
    """

    model: torch.nn.Module
    """The model, on the CPU, freshly initialised (the trainer seeds the RNG before ``build``)."""
    dataset: Any
    """A map-style dataset (``__len__`` and ``__getitem__``), whose indices the elastic sampler picks;
    or a ``stream.ShardedSource``, whose shards are read front to back in ranges dealt out to the ranks."""
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    """``loss_fn(output, batch) -> loss`` where ``output = model(*forward_inputs(batch))``."""
    training_step: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    """``training_step(model, batch) -> loss``: your own forward; replaces ``loss_fn``."""
    forward_inputs: Callable[[Any], Iterable[Any]] | None = None
    """Which parts of a batch go into ``model(...)`` with ``loss_fn``; default: all but the last."""
    optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    """``optimizer_fn(params) -> optimizer``; default Adam at ``--lr``."""
    scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None
    """``scheduler_fn(optimizer) -> LR scheduler`` (stepped once per optimizer step); default none."""
    collate_fn: Callable[[list], Any] | None = None
    """The DataLoader's ``collate_fn``; default torch's."""
    fsdp_blocks: Callable[[torch.nn.Module], Iterable[torch.nn.Module]] | None = None
    """``fsdp_blocks(model) -> modules`` that ``--fsdp`` shards one by one before the root (your
    transformer blocks; modules tied to each other belong in one); default every element of the
    outermost ``nn.ModuleList``/``ModuleDict`` (``training.parallel.fsdp_blocks``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise ValueError(f"Task.model must be a torch.nn.Module, got {type(self.model).__name__}")
        from elastic_trainer.stream.source import ShardedSource

        if not isinstance(self.dataset, ShardedSource) and \
                not (hasattr(self.dataset, "__len__") and hasattr(self.dataset, "__getitem__")):
            raise ValueError("Task.dataset must be map-style (define __len__ and __getitem__) or an "
                             f"elastic_trainer.stream.ShardedSource; got {type(self.dataset).__name__}")
        if (self.loss_fn is None) == (self.training_step is None):
            raise ValueError("give the Task exactly one of loss_fn(output, batch) or training_step(model, batch)")

    def compute_loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The micro-batch loss (a scalar, the mean over the micro-batch's samples)."""
        if self.training_step is not None:
            return self.training_step(model, batch)
        if self.forward_inputs is not None:
            inputs = tuple(self.forward_inputs(batch))
        elif isinstance(batch, (tuple, list)):
            inputs = tuple(batch[:-1]) if len(batch) > 1 else tuple(batch)
        else:
            inputs = (batch,)
        return self.loss_fn(model(*inputs), batch)


def as_task(obj: Any) -> Task:
    """Accept a ``Task`` or any object with the same attributes (checked)."""
    if isinstance(obj, Task):
        return obj
    if not isinstance(obj, TaskLike):
        raise ValueError(f"a task builder returned {type(obj).__name__}, which has no model and dataset; "
                         "return elastic_trainer.tasks.Task(model=..., dataset=..., loss_fn=...)")
    return Task(**{name: getattr(obj, name, None) for name in Task.__dataclass_fields__})


def load_builder(spec: str | None) -> Callable[[argparse.Namespace], Any]:
    """Import ``package.module:function`` or ``path/to/file.py:function`` and return the function."""
    spec = spec or DEFAULT_TASK
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--task {spec!r} must look like package.module:build or path/to/file.py:build")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            if not path.is_file():
                raise ValueError(f"--task {spec!r}: the file {str(path)!r} does not exist")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[path.stem] = module
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--task {spec!r}: cannot import {module_name!r} ({exc}); check the name and that "
                         "it is importable from the working directory or PYTHONPATH") from exc
    builder = getattr(module, attr, None)
    if not callable(builder):
        raise ValueError(f"--task {spec!r}: {module_name!r} has no function {attr!r}")
    return builder


# --------------------------------------------------------------------------------------
# The built-in example: a Transformer that learns to reverse (or copy) token sequences, and the
# seed scripts' synthetic workload one flag away (``--example seeds``).

EXAMPLES = ("reverse", "copy", "seeds")
H5_DATA = ("h5",)
STREAM_DATA = ("parquet", "tokens")


def add_example_arguments(parser: argparse.ArgumentParser) -> None:
    """The example task's flags (which example, the model's sizes, the synthetic data)."""
    g = parser.add_argument_group("example task (the default --task)")
    g.add_argument("--example", choices=EXAMPLES, default="reverse",
                   help="reverse: learn to reverse token sequences (the loss falls from ln(vocab) towards 0); "
                        "copy: learn to copy them; seeds: the seed scripts' workload, random float tensors "
                        "(nothing to learn; for comparisons with those scripts) (default: reverse)")
    g.add_argument("--vocab-size", type=int, default=16, metavar="V",
                   help="reverse, copy: tokens, BOS included (default: 16)")
    g.add_argument("--d-model", type=int, default=128, metavar="D",
                   help="Transformer width; the seed scripts used 512 (default: 128)")
    g.add_argument("--nhead", type=int, default=4, metavar="N", help="attention heads (default: 4)")
    g.add_argument("--num-encoder-layers", type=int, default=2, metavar="N", help="encoder layers (default: 2)")
    g.add_argument("--num-decoder-layers", type=int, default=2, metavar="N", help="decoder layers (default: 2)")
    g.add_argument("--layers", type=int, default=None, metavar="N",
                   help="shorthand: this many encoder and decoder layers (overrides the two flags above)")
    g.add_argument("--dim-feedforward", type=int, default=512, metavar="N", help="feed-forward width (default: 512)")
    g.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="dropout; 0, so that runs at different world sizes match exactly (default: 0)")
    g.add_argument("--src-len", type=int, default=16, metavar="S",
                   help="reverse, copy: tokens per sequence; seeds: source sequence length, the seed scripts "
                        "used 1 (default: 16)")
    g.add_argument("--tgt-len", type=int, default=20, metavar="T",
                   help="seeds: target sequence length, as in the seed scripts (default: 20)")
    g.add_argument("--dataset-size", type=int, default=2048, metavar="N",
                   help="synthetic samples, as many as the seed scripts'; a streamed --data has its shards' rows "
                        "(default: 2048)")
    g.add_argument("--data-seed", type=int, default=0, metavar="N", help="seed of the synthetic data (default: 0)")
    g.add_argument("--data", default="synthetic", metavar="synthetic|h5:PATH|parquet:URL-GLOB|tokens:URL-GLOB",
                   help="where samples come from: generated in memory; seeds: an HDF5 file with datasets 'src' and "
                        "'tgt' (`python -m elastic_trainer.tasks write-h5 PATH` writes one); reverse, copy: streamed "
                        "from the Parquet files matching URL-GLOB (a path or fsspec URL; a 'tokens' column of int "
                        "lists, the first --src-len tokens of each row are a sequence; `python -m "
                        "elastic_trainer.tasks write-parquet DIR` writes some) or from flat token files of "
                        "--token-dtype, --src-len tokens a row (write-tokens) (default: synthetic)")
    g.add_argument("--shuffle-buffer", type=int, default=256, metavar="N",
                   help="parquet:, tokens: rows in one shuffle block of the stream: a reader holds this many and "
                        "visits them in a seeded order; 1 = no shuffle within the shards (default: 256)")
    g.add_argument("--token-dtype", default="uint16", metavar="DTYPE",
                   help="tokens: the numpy dtype of the token files, and of the files write-tokens writes "
                        "(default: uint16)")
    g.add_argument("--loss", choices=("ce", "mse"), default=None,
                   help="seeds: ce, the seeds' CrossEntropyLoss(output, target) with the random targets read "
                        "as class probabilities over dim 1, or mse, mean squared error (default: ce)")


def check_example_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` (one line naming the flag) for example flags that do not fit ``--example``."""
    a = example_args(args)
    kind = str(a.data).split(":", 1)[0] if ":" in str(a.data) else a.data
    if kind not in ("synthetic", *H5_DATA, *STREAM_DATA):
        raise ValueError(f"--data {a.data!r} must be 'synthetic', 'h5:PATH' (--example seeds), 'parquet:URL-GLOB' "
                         "or 'tokens:URL-GLOB' (--example reverse or copy)")
    if a.example != "seeds":
        if a.loss is not None:
            raise ValueError(f"--loss applies to --example seeds only; --example {a.example} is scored with "
                             "cross-entropy over its tokens (drop --loss, or add --example seeds)")
        if kind in H5_DATA:
            raise ValueError(f"--data {a.data} applies to --example seeds only; --example {a.example} reads token "
                             "sequences (give --data parquet:URL-GLOB or tokens:URL-GLOB, or add --example seeds)")
        if a.vocab_size < 3:
            raise ValueError(f"--vocab-size {a.vocab_size} is too small; give 3 or more (BOS and two tokens)")
    elif kind in STREAM_DATA:
        raise ValueError(f"--data {a.data} streams token sequences, for --example reverse or copy; --example seeds "
                         "reads 'synthetic' or 'h5:PATH' (drop --example seeds, or give --data h5:PATH)")
    if a.src_len < 1:
        raise ValueError(f"--src-len {a.src_len} must be a positive number")
    if a.shuffle_buffer < 1:
        raise ValueError(f"--shuffle-buffer {a.shuffle_buffer} must be at least 1 (1 = no shuffle within the shards)")


class SequenceTransformer(torch.nn.Module):
    """``torch.nn.Transformer`` with token and learned position embeddings and a vocabulary head.

    ``forward(src, tgt)`` returns the logits ``(N, L, vocab)`` for every position of ``tgt``; the
    decoder reads ``tgt`` shifted right behind ``BOS`` under a causal mask (teacher forcing), so
    position ``t`` predicts ``tgt[t]`` from the source and ``tgt[:t]`` only.
    """

    def __init__(self, transformer: torch.nn.Transformer, vocab_size: int, max_len: int) -> None:
        super().__init__()
        d_model = transformer.d_model
        self.embed = torch.nn.Embedding(vocab_size, d_model)
        self.position = torch.nn.Embedding(max_len, d_model)
        self.transformer = transformer
        self.head = torch.nn.Linear(d_model, vocab_size)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        from elastic_trainer.training.data import BOS

        bos = torch.full_like(tgt[:, :1], BOS)
        tgt_in = torch.cat([bos, tgt[:, :-1]], dim=1)
        n_src, n_tgt = src.shape[1], tgt_in.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n_tgt, device=tgt.device)
        out = self.transformer(self.embed(src) + self.position.weight[:n_src],
                               self.embed(tgt_in) + self.position.weight[:n_tgt], tgt_mask=mask, tgt_is_causal=True)
        return self.head(out)


def _token_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """Cross-entropy of every target token (the mean over the micro-batch's tokens)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), batch[1].reshape(-1))


def _example_loss(kind: str | None) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def loss_fn(output: torch.Tensor, batch: Any) -> torch.Tensor:
        target = batch[1].to(output.dtype)
        if kind == "mse":
            return F.mse_loss(output, target)
        # The seeds call CrossEntropyLoss()(output, targets) with (N, T, d) float targets: torch
        # reads dim 1 as the class dimension and the targets as class probabilities. The result is
        # a mean over the N*d positions, so a micro-batch mean as the trainer needs.
        return F.cross_entropy(output, target)
    return loss_fn


def example_args(args: argparse.Namespace | None = None) -> argparse.Namespace:
    """The example task's flag values: its defaults, overridden by whatever ``args`` has."""
    parser = argparse.ArgumentParser(add_help=False)
    add_example_arguments(parser)
    merged = parser.parse_args([])
    if args is not None:
        vars(merged).update({k: v for k, v in vars(args).items() if k in vars(merged)})
    return merged


def example_source(args: argparse.Namespace | None = None):
    """The ``stream.ShardedSource`` of a streamed ``--data`` (``parquet:`` or ``tokens:``), else None.

    Each row's first ``--src-len`` tokens are a source sequence, its target the reversal (or copy):
    ``data.TokenRows``. The drill builds it too, to replay the order the trainer must follow."""
    a = example_args(args)
    kind, _, url = str(a.data).partition(":")
    if kind not in STREAM_DATA:
        return None
    from elastic_trainer.stream import ParquetReader, ShardedSource, TokenFileReader
    from elastic_trainer.training.data import TokenRows

    reader = ParquetReader(["tokens"]) if kind == "parquet" else TokenFileReader(a.src_len, a.token_dtype)
    return ShardedSource.from_glob(url, reader, transform=TokenRows(a.src_len, a.vocab_size, a.example),
                                   shuffle_buffer=a.shuffle_buffer)


def build_example(args: argparse.Namespace | None = None) -> Task:
    """The built-in example (``--example``): reverse or copy token sequences, or the seeds' workload.

    Every variant trains the same ``torch.nn.Transformer`` (sizes from the flags) with Adam at
    the trainer's ``--lr``; its data are generated in memory from ``--data-seed``, read from an
    HDF5 file (seeds) or streamed from shards (reverse, copy: ``example_source``).
    """
    a = example_args(args)
    check_example_args(a)
    from elastic_trainer.training import data  # the example datasets

    transformer = torch.nn.Transformer(
        d_model=a.d_model, nhead=a.nhead, num_encoder_layers=a.layers or a.num_encoder_layers,
        num_decoder_layers=a.layers or a.num_decoder_layers, dim_feedforward=a.dim_feedforward,
        dropout=a.dropout, batch_first=True)
    if a.example != "seeds":
        dataset = example_source(a) or data.token_dataset(a.dataset_size, a.src_len, a.vocab_size, a.example,
                                                          a.data_seed)
        model = SequenceTransformer(transformer, a.vocab_size, a.src_len)
        return Task(model=model, dataset=dataset, loss_fn=_token_loss,
                    forward_inputs=lambda batch: (batch[0], batch[1]))
    if a.data == "synthetic":
        dataset = data.synthetic_dataset(a.dataset_size, (a.src_len, a.d_model), (a.tgt_len, a.d_model), a.data_seed)
    else:
        dataset = data.H5Dataset(a.data[3:])  # opened lazily in each process
    # As in the seeds, the model sees the source and the target (no causal mask) and is scored on the target.
    return Task(model=transformer, dataset=dataset, loss_fn=_example_loss(a.loss),
                forward_inputs=lambda batch: (batch[0], batch[1]))


def main(argv: list[str] | None = None) -> int:
    """``python -m elastic_trainer.tasks write-h5 PATH | write-parquet DIR | write-tokens DIR [flags]``:
    write the example's data (the seeds' tensors to HDF5; the token sequences as stream shards)."""
    p = argparse.ArgumentParser(prog="python -m elastic_trainer.tasks",
                                description="Write the example task's data: the seeds' tensors to an HDF5 file "
                                            "(write-h5 PATH), or the token sequences of --example reverse/copy as "
                                            "Parquet shards (write-parquet DIR) or flat token files (write-tokens DIR) "
                                            "for --data parquet:DIR/*.parquet or tokens:DIR/*.bin.")
    p.add_argument("command", choices=["write-h5", "write-parquet", "write-tokens"])
    p.add_argument("path", help="the HDF5 file, or the folder (a path or fsspec URL) the shards go to")
    p.add_argument("--shards", type=int, default=4, help="write-parquet, write-tokens: files (default: 4)")
    p.add_argument("--row-group-size", type=int, default=256, help="write-parquet: rows per row group (default: 256)")
    add_example_arguments(p)
    args = p.parse_args(argv)
    from elastic_trainer.training import data

    if args.command == "write-h5":  # the file holds the seeds' workload (--example seeds)
        out = data.write_synthetic_h5(args.path, args.dataset_size, (args.src_len, args.d_model),
                                      (args.tgt_len, args.d_model), args.data_seed)
        print(f"wrote {args.dataset_size} samples to {out}")
        return 0
    fmt = "parquet" if args.command == "write-parquet" else "tokens"
    urls = data.write_token_shards(args.path, args.dataset_size, args.src_len, args.vocab_size, args.data_seed,
                                   shards=args.shards, fmt=fmt, row_group_size=args.row_group_size,
                                   dtype=args.token_dtype)
    pattern = "*.parquet" if fmt == "parquet" else "*.bin"
    print(f"wrote {args.dataset_size} sequences of {args.src_len} tokens to {len(urls)} files: "
          f"--data {fmt}:{args.path.rstrip('/')}/{pattern}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
