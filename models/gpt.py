"""A small GPT-style decoder: embeddings, pre-LayerNorm causal blocks, final norm and LM head."""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

import torch
from torch import nn

from pipelaunch.models.spec import ModelSpec, causal_lm_loss, require_positive_ints
from pipelaunch.pipeline.core.errors import ConfigError

#: where a planner may cut the model: between blocks, also between a block's attention and MLP
#: halves, or between any two traced operators
GRANULARITIES = ("block", "sublayer", "op")
#: Megatron's split of the GPT over tp ranks: the embedding and the head by vocabulary (the loss
#: computed on the shards), attention by heads, the MLP by its hidden width
TP_PLAN = {"embed.tokens": "vocab", "layer*.attn.q": "colwise", "layer*.attn.k": "colwise",
           "layer*.attn.v": "colwise", "layer*.attn.proj": "rowwise", "layer*.mlp.0": "colwise",
           "layer*.mlp.2": "rowwise", "head.proj": "vocab"}
#: a decoder block's leaf modules at `granularity="sublayer"`
SUBLAYER_PARTS = ("ln1", "attn", "ln2", "mlp")


class Embedding(nn.Module):
    """Token embedding plus a learned positional embedding."""

    def __init__(self, vocab_size: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(seq_len, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(pos)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. The query, key and value projections are separate and
    the forward reads the head count from their outputs (`-1`), so a tensor-parallel rank holding
    `heads / tp` heads runs the same code on its shards (docs/tensor_parallel.md)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.dim={dim} must be divisible by model.heads={heads}")
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class DecoderBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Final LayerNorm and a bias-free projection to the vocabulary."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def gpt(
    vocab_size: int = 256,
    dim: int = 64,
    layers: int = 8,
    heads: int = 4,
    seq_len: int = 32,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    name: str = "gpt",
    tie_embeddings: bool = False,
    granularity: str = "block",
    tp_plan: dict[str, str] | None = None,
) -> ModelSpec:
    """Blocks, in order: `embed`, `layer0` .. `layer{layers-1}`, `head` (the leaf modules).

    With `tie_embeddings` the LM head's projection *is* the token embedding matrix: the stages
    holding the embedding and the head each get a copy and their gradients are summed.

    Why finer granularities: with 8 blocks and a head that costs more than a block, block-sized
    cuts cannot balance 2 or 4 stages. `granularity="sublayer"` keeps each block's LayerNorms,
    attention and MLP whole, so a cut may also fall at the residual stream between the attention
    and MLP halves, where only one tensor of the block's input size crosses; `"op"` keeps no leaf
    modules, so a cut may fall between any two operators (inside the MLP, where the crossing
    tensor is 4x larger, too). Same weights, same arithmetic as `granularity="block"`.

    `tp_plan`: how tp > 1 splits it (null: `TP_PLAN`, Megatron's split)."""
    require_positive_ints(vocab_size=vocab_size, dim=dim, layers=layers, heads=heads, seq_len=seq_len,
                          mlp_ratio=mlp_ratio)
    if dim % heads:
        raise ConfigError("model.heads", f"model.dim={dim} is not divisible by model.heads={heads}; each head gets "
                                         f"dim / heads channels (e.g. heads={max(h for h in range(1, heads + 1) if dim % h == 0)})")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError("model.dropout", f"got {dropout!r}; valid: a probability in [0, 1)")
    if granularity not in GRANULARITIES:
        raise ConfigError("model.granularity", f"must be one of {', '.join(GRANULARITIES)}, got {granularity!r} "
                                               "(block: cut between decoder blocks; sublayer: also between a block's "
                                               "attention and MLP; op: cut between any operators)")
    blocks = [("embed", partial(Embedding, vocab_size, dim, seq_len))]
    blocks += [(f"layer{i}", partial(DecoderBlock, dim, heads, mlp_ratio, dropout)) for i in range(layers)]
    blocks.append(("head", partial(LMHead, dim, vocab_size)))
    return ModelSpec(
        name=name,
        build=partial(_tied_model if tie_embeddings else sequential, blocks),
        loss_fn=causal_lm_loss,
        input_shape=(seq_len,),
        input_dtype=torch.long,
        target_shape=(seq_len,),
        target_dtype=torch.long,
        leaf_modules=_leaf_modules([n for n, _ in blocks], granularity),
        meta={"vocab_size": vocab_size, "seq_len": seq_len, "dim": dim,
              "tp_divides": {"model.heads": heads, "model.vocab_size": vocab_size}},
        tp_plan=dict(TP_PLAN if tp_plan is None else tp_plan),
    )


def _leaf_modules(blocks: list[str], granularity: str) -> list[str]:
    """The modules tracing keeps whole (a cut never falls inside one) at this granularity."""
    if granularity == "block":
        return blocks
    if granularity == "sublayer":
        return [leaf for b in blocks
                for leaf in ([f"{b}.{part}" for part in SUBLAYER_PARTS] if b.startswith("layer") else [b])]
    return []


class TiedGPT(nn.Sequential):
    """The blocks in order, with the head's projection tied to the token embedding. The tied tensor
    is initialised by its first owner (`embed.tokens`, the canonical name) and the head's init after
    it writes it again: every rank and the reference apply the same rule, so they agree."""

    def tie(self) -> None:
        self.head.proj.weight = self.embed.tokens.weight


def sequential(blocks) -> nn.Module:
    """A chain of named blocks: the model whose leaf modules are its blocks."""
    return nn.Sequential(OrderedDict((n, f()) for n, f in blocks))


def _tied_model(blocks) -> nn.Module:
    model = TiedGPT(OrderedDict((n, f()) for n, f in blocks))
    model.tie()
    return model
