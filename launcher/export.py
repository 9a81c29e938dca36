"""Export a checkpoint's weights as one consolidated safetensors file, in a single process.

    python -m pipelaunch.launcher.export outputs/run/checkpoints/step_0001000 exported/

The checkpoint (DCP, written by any number of ranks under any layout) is read by name into one
state dict, without a process group; `model=hf` runs get a `save_pretrained` directory
(config.json + model.safetensors) that `transformers.AutoModelForCausalLM.from_pretrained` loads,
other models one `model.safetensors` under the model's own parameter names. Nothing is unpickled.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from pipelaunch.launcher.plugins import build_plugin
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.runtime import checkpoint


def model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a checkpoint, under the full model's names."""
    stored = {k: v for k, v in checkpoint.stored_tensors(path).items() if k.startswith("model/")}
    state = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in stored.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return {key.removeprefix("model/"): t for key, t in state.items()}


def export(path: str | Path, out: str | Path) -> Path:
    """Write checkpoint `path`'s weights into directory `out`; returns the directory."""
    path, out = Path(path), Path(out)
    if not checkpoint.is_complete(path):
        raise ConfigError("checkpoint", f"{path} is not a complete checkpoint (a step_<N> directory with .metadata "
                                        f"and {checkpoint.META})")
    meta = checkpoint.read_meta(path)
    tensors = model_tensors(path)
    spec = build_plugin("model", meta["model_config"]).build() if meta.get("model_config") else None
    if spec is not None and spec.save is not None:
        spec.save(tensors, out)
    else:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelaunch.launcher.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a step_<N> checkpoint directory")
    parser.add_argument("out", help="the directory to write")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
