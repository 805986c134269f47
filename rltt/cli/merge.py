"""``rltt merge CHECKPOINT OUT [--format rltt|ouro]``: a LoRA run's checkpoint as one plain model.

The checkpoint's shared adapters are folded into its weights (``W + alpha/r · B A``, in fp32,
rounded once: `rltt.model.adapters.merge_adapters_`) and the result is written as an rltt model
directory (``--format rltt``, loadable by every rltt command) or an Ouro checkpoint
(``--format ouro``, for an Ouro-shaped model; its ``auto_map`` points transformers at Ouro's code on
the hub). The tokenizer is copied when the checkpoint has one.
"""

from __future__ import annotations

import argparse

#: ``--format`` -> how the merged model is written
FORMATS = ("rltt", "ouro")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``merge`` sub-command."""
    parser = subparsers.add_parser("merge", help="fold a LoRA checkpoint's adapters into a plain model",
                                   description=__doc__.split("\n\n")[1])
    parser.add_argument("checkpoint", help="a checkpoint directory of a LoRA run (RUN_DIR/checkpoints/step_N)")
    parser.add_argument("out", help="the directory to write (must not exist)")
    parser.add_argument("--format", choices=FORMATS, default="rltt")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rltt.errors import RlttError
    from rltt.model import load_looped
    from rltt.model.adapters import merge_adapters_
    from rltt.model.ouro import save_ouro

    source, out = Path(args.checkpoint), Path(args.out)
    if not (source / "config.json").exists():
        raise RlttError(f"rltt merge: {source} holds no config.json (a checkpoint directory of a LoRA run)")
    if out.exists():
        raise RlttError(f"rltt merge: {out} exists; choose a new directory")
    model = load_looped(source)
    if not model.config.lora_rank:
        raise RlttError(f"rltt merge: {source} holds no LoRA adapters (config lora_rank is 0)")
    merge_adapters_(model)
    if args.format == "ouro":
        save_ouro(model, out, key="--format ouro")
    else:
        model.save_pretrained(out, safe_serialization=True)
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(out)
    except (OSError, ValueError):
        pass  # no tokenizer in the checkpoint: the weights alone
    print(f"rltt merge: wrote the merged model to {out} ({args.format} format)")
    return 0
