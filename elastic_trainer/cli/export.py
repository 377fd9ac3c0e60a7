"""``elastic-train export``: a checkpoint's model weights as a safetensors file.

    elastic-train export CHECKPOINT_URL --to model.safetensors [--step N]
    elastic-train ... -- --init-from model.safetensors      # a new run starts from those weights

The newest complete checkpoint under ``CHECKPOINT_URL`` (or step ``N``), verified as a resume
would, gives its model's weights (``checkpoint/weights.py`` reads and writes them). The file is
written beside the target and renamed into place, so a half-written file never has its name.
"""

from __future__ import annotations

import argparse
import os
import sys

from elastic_trainer.env import EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """``elastic-train export``: parse, export, print one line; bad input: one line, status 2."""
    from elastic_trainer.checkpoint.weights import export_weights

    p = argparse.ArgumentParser(prog="elastic-train export", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint_url", metavar="CHECKPOINT_URL", help="a --checkpoint-dir: path, s3://..., any fsspec URL")
    p.add_argument("--to", required=True, metavar="PATH.safetensors", help="the file to write")
    p.add_argument("--step", type=int, default=None, help="this step instead of the newest complete one")
    args = p.parse_args(argv)
    if not args.to.endswith(".safetensors"):
        p.error(f"--to {args.to!r} must end with .safetensors")
    folder = os.path.dirname(os.path.abspath(args.to))
    if not os.path.isdir(folder):
        p.error(f"--to {args.to!r}: the folder {folder} does not exist; create it first")
    try:
        step = export_weights(args.checkpoint_url, args.to, args.step)
    except ValueError as exc:
        print(f"elastic-train export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"exported the model weights of step-{step} to {args.to}")
    return 0
