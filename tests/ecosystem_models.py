"""Models a user brings, wrapped by hand as a new user would (test fixtures, not the `model=hf` group):
transformers' GPT-2, diffusers' UNet2DModel, and a module whose tensors have no `reset_parameters`.

No `torch.manual_seed` anywhere: the same weights on every rank must come from the project's
initialisation by name (transformers' own `_init_weights` for the first two)."""

from __future__ import annotations

import torch
from torch import nn

from pipelaunch.models.hf import CausalLM, transformers_init
from pipelaunch.models.spec import ModelSpec, causal_lm_loss


def gpt2(vocab_size: int = 64, seq_len: int = 16, layers: int = 4, dim: int = 32, heads: int = 4,
         name: str = "hf_gpt2") -> ModelSpec:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab_size, n_positions=seq_len,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return ModelSpec(name=name, build=lambda: CausalLM(GPT2LMHeadModel(config)), loss_fn=causal_lm_loss,
                     input_shape=(seq_len,), target_shape=(seq_len,), init=transformers_init,
                     meta={"vocab_size": vocab_size, "seq_len": seq_len})


class Denoise(nn.Module):
    """A diffusion U-Net at a fixed timestep, returning its `.sample`."""

    def __init__(self, model: nn.Module, timestep: int) -> None:
        super().__init__()
        self.model, self.timestep = model, timestep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, self.timestep).sample


def unet2d(image_size: int = 8, in_channels: int = 3, out_channels: int = 3, timestep: int = 10,
           name: str = "hf_unet", task: str = "regression") -> ModelSpec:
    from diffusers import UNet2DModel

    def build() -> nn.Module:
        return Denoise(UNet2DModel(sample_size=image_size, in_channels=in_channels, out_channels=out_channels,
                                   block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
                                   down_block_types=("DownBlock2D", "DownBlock2D"),
                                   up_block_types=("UpBlock2D", "UpBlock2D")), timestep)

    return ModelSpec(name=name, build=build, loss_fn=nn.functional.mse_loss,
                     input_shape=(in_channels, image_size, image_size), input_dtype=torch.float32,
                     target_shape=(out_channels, image_size, image_size), target_dtype=torch.float32,
                     meta={"image_size": image_size, "task": task})


class ScaledMix(nn.Module):
    """A block with no `reset_parameters`: a bare weight matrix, a gain and an offset."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(dim, dim))
        self.scale = nn.Parameter(torch.ones(dim))
        self.offset = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ self.mix) * self.scale + self.offset


def bare(vocab_size: int = 64, seq_len: int = 8, dim: int = 16, layers: int = 4, name: str = "bare") -> ModelSpec:
    """Embedding, `layers` ScaledMix blocks, a head: most tensors get the documented fallback."""
    from collections import OrderedDict

    def build() -> nn.Module:
        blocks = [("embed", nn.Embedding(vocab_size, dim))]
        blocks += [(f"mix{i}", ScaledMix(dim)) for i in range(layers)]
        blocks.append(("head", nn.Linear(dim, vocab_size)))
        return nn.Sequential(OrderedDict(blocks))

    leaves = ["embed", *[f"mix{i}" for i in range(layers)], "head"]
    return ModelSpec(name=name, build=build, loss_fn=causal_lm_loss, input_shape=(seq_len,),
                     target_shape=(seq_len,), leaf_modules=leaves, meta={"vocab_size": vocab_size, "seq_len": seq_len})


def token_mlp(vocab_size: int = 64, dim: int = 16, layers: int = 4) -> nn.Module:
    """A plain nn.Module (not a spec): embedding, tanh MLP layers, projection to logits."""
    mods: list[nn.Module] = [nn.Embedding(vocab_size, dim)]
    for _ in range(layers):
        mods += [nn.Linear(dim, dim), nn.Tanh()]
    mods.append(nn.Linear(dim, vocab_size))
    return nn.Sequential(*mods)
