"""A small GPT-style decoder: embeddings, pre-LayerNorm causal blocks, final norm and LM head.

With packed documents (`data.packing=documents`) the model takes the data's position ids as a
second input: each block's attention is confined to the position's own document (a document
starts wherever the position ids do not go up by one) and the positional embedding reads them, so
each document is computed as the unpacked model computes it alone. Without them the model, its
forward and its parameter names are what they always were."""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

import torch
from torch import nn

from pipelaunch.models.moe import ROUTERS, MoE
from pipelaunch.models.spec import ModelSpec, causal_lm_loss, require_positive_ints, segments
from pipelaunch.pipeline.compute.context_parallel import attention as context_attention
from pipelaunch.pipeline.compute.context_parallel import positions as context_positions
from pipelaunch.pipeline.core import POSITION_IDS
from pipelaunch.pipeline.core.errors import ConfigError
from pipelaunch.pipeline.graph.context_parallel import local_length

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
#: how attention is computed: `sdpa`, torch's fused scaled_dot_product_attention (flash or
#: memory-efficient kernels where the device has them), or `math`, the scores materialised and
#: masked, softmaxed, dropped out and applied by separate operators, as Megatron-LM computed them
#: before fused attention (its SC21 runs) and nanoGPT does without flash: same result, more memory
#: traffic (each of the b x heads x t x t scores written and read by every step); or `context`,
#: context parallelism's (pipeline/compute/context_parallel.py): over the rank's cp group when it
#: runs one, the tokens at the rank's global positions; else the same arithmetic as sdpa
ATTENTIONS = ("sdpa", "math", "context")


class Embedding(nn.Module):
    """Token embedding plus a learned positional embedding."""

    def __init__(self, vocab_size: int, dim: int, seq_len: int, context: bool = False) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(seq_len, dim)
        self.context = context  # the tokens' positions are a cp rank's share (attention=context)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is not None:
            pos = position_ids
        else:
            pos = context_positions(tokens) if self.context else torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(pos)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor,
                       dropout_p: float) -> torch.Tensor:
    """Causal attention within each document of a packed sample ([b, heads, t, head_dim]; the
    documents where `position_ids` [b, t] restart). On CUDA, FlexAttention with a document
    BlockMask (`flex_document_attention`); elsewhere (the CPU), a boolean [b, 1, t, t] mask
    through scaled_dot_product_attention, exact and cheap at CPU sizes. torch.fx keeps this
    function whole (`fx.wrap`): the device branch is decided when it runs."""
    docs = segments(position_ids)
    if q.is_cuda:
        if dropout_p:
            raise ValueError("attention dropout on packed documents is not supported on CUDA (flex_attention has "
                             "none); set model.dropout=0")
        return flex_document_attention(q, k, v, docs, compiled=True)
    t = q.shape[-2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    mask = (docs.unsqueeze(-1) == docs.unsqueeze(-2)) & causal
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), dropout_p=dropout_p)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`model.attention=math`: causal attention (within each document when `position_ids` are
    given) with the scores materialised: (q / sqrt(d)) k^T, masked, softmax, dropout, times v."""
    t = q.shape[-2]
    hidden = q.new_ones((t, t), dtype=torch.bool).triu(1)  # made from q: a fake q (pricing) makes a fake mask
    if position_ids is not None:
        docs = segments(position_ids)
        hidden = ((docs.unsqueeze(-1) != docs.unsqueeze(-2)) | hidden).unsqueeze(1)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    probs = nn.functional.dropout(scores.masked_fill(hidden, float("-inf")).softmax(dim=-1), dropout_p)
    return probs @ v


_compiled_flex = None


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor,
                            compiled: bool = False) -> torch.Tensor:
    """FlexAttention's document mask (causal, and the same document `docs` [b, t]): the BlockMask
    holds which blocks to compute, so no t x t mask or score matrix is materialised and blocks
    between documents are skipped. `compiled`: through torch.compile, as flex_attention is meant
    to run on a GPU (its eager form materialises the scores)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - flex_attention's signature
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    t = q.shape[-2]
    block_mask = create_block_mask(mask_mod, q.shape[0], None, t, t, device=q.device)
    if compiled and _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return (_compiled_flex if compiled else flex_attention)(q, k, v, block_mask=block_mask)


torch.fx.wrap("document_attention")
torch.fx.wrap("context_attention")
torch.fx.wrap("context_positions")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. The query, key and value projections are separate and
    the forward reads the head count from their outputs (`-1`), so a tensor-parallel rank holding
    `heads / tp` heads runs the same code on its shards (docs/tensor_parallel.md)."""

    def __init__(self, dim: int, heads: int, dropout: float, attention: str = "sdpa") -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.dim={dim} must be divisible by model.heads={heads}")
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout
        self.math, self.context = attention == "math", attention == "context"

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        dropout = self.dropout if self.training else 0.0
        if self.context:
            y = context_attention(q, k, v, position_ids, dropout)
        elif self.math:
            y = math_attention(q, k, v, dropout, position_ids)
        elif position_ids is None:
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:  # packed documents: each attends within its own
            y = document_attention(q, k, v, position_ids, dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class DecoderBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); the MLP a mixture of
    experts where `moe` gives its settings (models/moe.py)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0, attention: str = "sdpa",
                 moe: dict | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout, attention)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MoE(dim, **moe) if moe else nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(),
                                                             nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + (self.attn(self.ln1(x)) if position_ids is None else self.attn(self.ln1(x), position_ids))
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
    data_packing: str | None = None,
    attention: str = "sdpa",
    experts: int = 0,
    top_k: int = 2,
    expert_dim: int | None = None,
    shared_experts: int = 0,
    dense_layers: int = 0,
    router: str = "softmax",
    expert_groups: int = 1,
    topk_groups: int = 1,
    route_scale: float = 1.0,
    aux_loss_coef: float = 0.01,
    capacity_factor: float | None = None,
    bias_update_rate: float | None = None,
    context_parallel: int = 1,
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

    `tp_plan`: how tp > 1 splits it (null: `TP_PLAN`, Megatron's split). `data_packing`: the data's
    packing (`documents`: the model takes the data's position ids too, see the module docstring).
    `attention`: `ATTENTIONS` (the same arithmetic each way).

    `experts` > 0: the blocks after the first `dense_layers` have a mixture-of-experts MLP
    (models/moe.py): `experts` routed SwiGLU experts of width `expert_dim` (default mlp_ratio x dim),
    each token to `top_k` of them by a `router` (softmax, or DeepSeek-V3's sigmoid with
    `expert_groups` / `topk_groups` and `route_scale`), `shared_experts` more every token passes
    through, and the auxiliary load-balancing loss at `aux_loss_coef`; `capacity_factor` (set by
    `moe.capacity_factor`) drops the slots past each expert's capacity, as GShard and Switch do;
    `bias_update_rate` (set by `moe.bias_update_rate`) moves the sigmoid router's correction bias
    after each optimizer step, DeepSeek-V3's auxiliary-loss-free balancing (`moe.update_bias`);
    `context_parallel` (set by `cp`): the ranks a sequence is split over (`_context`)."""
    _check_shape(vocab_size, dim, layers, heads, seq_len, mlp_ratio, dropout, granularity, attention)
    attention, local = _context(attention, seq_len, context_parallel)
    moe = _moe_settings(dim, mlp_ratio, layers, experts, top_k, expert_dim, shared_experts, dense_layers, router,
                        expert_groups, topk_groups, route_scale, aux_loss_coef, capacity_factor, bias_update_rate)
    blocks = [("embed", partial(Embedding, vocab_size, dim, seq_len, attention == "context"))]
    blocks += [(f"layer{i}", partial(DecoderBlock, dim, heads, mlp_ratio, dropout, attention,
                                     moe if experts and i >= dense_layers else None)) for i in range(layers)]
    blocks.append(("head", partial(LMHead, dim, vocab_size)))
    packed = (data_packing or "none") != "none"  # documents or stream: the data's position ids
    model_class = (PackedTiedGPT if tie_embeddings else PackedGPT) if packed else (TiedGPT if tie_embeddings else None)
    return ModelSpec(
        name=name,
        build=partial(_built, model_class, blocks),
        loss_fn=causal_lm_loss,
        input_shape=(local,),
        input_dtype=torch.long,
        target_shape=(local,),
        target_dtype=torch.long,
        leaf_modules=_leaf_modules([n for n, _ in blocks], granularity,
                                   [f"layer{i}.mlp" for i in range(dense_layers, layers)] if experts else []),
        meta={"vocab_size": vocab_size, "seq_len": seq_len, "dim": dim, "context_parallel": context_parallel,
              "heads": heads, "dropout": dropout, "tp_divides": {"model.heads": heads, "model.vocab_size": vocab_size},
              **({"experts": experts, "top_k": top_k, "moe_layers": layers - dense_layers, "router": router,
                  "capacity_factor": capacity_factor, "bias_update_rate": moe["bias_update_rate"]} if experts else {})},
        tp_plan=dict(TP_PLAN if tp_plan is None else tp_plan),
        data_args=("input", POSITION_IDS) if packed else ("input",),
    )


def _check_shape(vocab_size: int, dim: int, layers: int, heads: int, seq_len: int, mlp_ratio: int, dropout: float,
                 granularity: str, attention: str) -> None:
    """The dense settings, each checked, naming its `model.` key."""
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
    if attention not in ATTENTIONS:
        raise ConfigError("model.attention", f"got {attention!r}; valid: sdpa (torch's fused attention), math (the "
                                             "scores materialised, as Megatron-LM before fused attention), context "
                                             "(over a context-parallel group where the rank runs one)")


def _context(attention: str, seq_len: int, cp: int) -> tuple[str, int]:
    """Under cp > 1: the attention that crosses the cp group (`attention=context`), and the
    positions a rank traces and runs (1/cp of them: `input_shape`)."""
    if cp == 1:
        return attention, seq_len
    if attention == "math":
        raise ConfigError("model.attention", f"math materialises the scores of the whole sequence, which cp={cp} "
                                             "splits over its ranks; valid with cp > 1: sdpa or context (the same: "
                                             "attention over the cp group)")
    return "context", local_length(seq_len, cp)


def _leaf_modules(blocks: list[str], granularity: str, moe: list[str] = ()) -> list[str]:
    """The modules tracing keeps whole (a cut never falls inside one) at this granularity; a
    mixture of experts (`moe`) always: its routing reads values (which expert a token picks)."""
    if granularity == "block":
        return blocks
    if granularity == "sublayer":
        return [leaf for b in blocks
                for leaf in ([f"{b}.{part}" for part in SUBLAYER_PARTS] if b.startswith("layer") else [b])]
    return list(moe)


def _moe_settings(dim: int, mlp_ratio: int, layers: int, experts: int, top_k: int, expert_dim: int | None,
                  shared: int, dense_layers: int, router: str, groups: int, topk_groups: int, route_scale: float,
                  aux_loss_coef: float, capacity_factor: float | None = None,
                  bias_update_rate: float | None = None) -> dict:
    """The MoE layers' settings (models/moe.py `MoE`), each checked, naming its `model.` key."""
    if not experts:
        if capacity_factor is not None:
            raise ConfigError("moe.capacity_factor", f"{capacity_factor} is set, but the model has no experts "
                                                     "(model.experts=0): set model.experts, or moe.capacity_factor=null")
        return {}
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
                                        or capacity_factor <= 0):
        raise ConfigError("moe.capacity_factor", f"got {capacity_factor!r}; valid: null (dropless: every routed slot "
                                                 "is computed) or a number > 0, each expert taking at most "
                                                 "ceil(capacity_factor x tokens x top_k / experts) slots of a "
                                                 "micro-batch (1.0: an even share; Switch trains with 1.0-1.25)")
    require_positive_ints(experts=experts, top_k=top_k, expert_groups=groups, topk_groups=topk_groups)
    if top_k > experts:
        raise ConfigError("model.top_k", f"{top_k} is more than the model's {experts} experts (model.experts)")
    if router not in ROUTERS:
        raise ConfigError("model.router", f"got {router!r}; valid: {', '.join(ROUTERS)}")
    if experts % groups or topk_groups > groups or (groups > 1 and experts // groups < 2):
        raise ConfigError("model.expert_groups", f"{groups} groups of the {experts} experts (model.topk_groups="
                                                 f"{topk_groups}): the groups must divide the experts, hold 2 or "
                                                 "more each, and be at least topk_groups")
    if not 0 <= dense_layers < layers:
        raise ConfigError("model.dense_layers", f"{dense_layers}; valid: 0 to model.layers - 1 = {layers - 1}")
    return {"hidden": expert_dim or mlp_ratio * dim, "experts": experts, "top_k": top_k, "shared": shared,
            "router": router, "groups": groups, "topk_groups": topk_groups, "route_scale": route_scale,
            "aux_loss_coef": aux_loss_coef, "capacity_factor": capacity_factor,
            # only the sigmoid router has a correction bias (launcher/validate.py refuses the others)
            "bias_update_rate": (bias_update_rate or None) if router == "sigmoid" else None}


class TiedGPT(nn.Sequential):
    """The blocks in order, with the head's projection tied to the token embedding. The tied tensor
    is initialised by its first owner (`embed.tokens`, the canonical name) and the head's init after
    it writes it again: every rank and the reference apply the same rule, so they agree."""

    def tie(self) -> None:
        self.head.proj.weight = self.embed.tokens.weight


class PackedGPT(nn.Sequential):
    """The blocks in order, each given the packed documents' position ids beside its input (the
    embedding's positions, the attention's document mask); the same modules, so the same
    parameter names, as the unpacked model's."""

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = self.embed(tokens, position_ids)
        for name, block in self.named_children():
            if name.startswith("layer"):
                x = block(x, position_ids)
        return self.head(x)


class PackedTiedGPT(TiedGPT):
    """PackedGPT with the head tied to the token embedding."""

    forward = PackedGPT.forward


def sequential(blocks) -> nn.Module:
    """A chain of named blocks: the model whose leaf modules are its blocks."""
    return nn.Sequential(OrderedDict((n, f()) for n, f in blocks))


def _built(model_class: type[nn.Sequential] | None, blocks) -> nn.Module:
    """The blocks in `model_class` (None: a plain nn.Sequential), tied if it ties."""
    if model_class is None:
        return sequential(blocks)
    model = model_class(OrderedDict((n, f()) for n, f in blocks))
    if isinstance(model, TiedGPT):
        model.tie()
    return model
