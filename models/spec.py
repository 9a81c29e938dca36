"""What the pipeline needs to know about a model: how to build it, what it eats, how it is scored.

One type for every model. A chain of blocks (the GPT, the MLP) is a module whose leaf modules are
its blocks; a U-Net is a module whose leaves are its conv blocks; a Hugging Face model is a module
whose leaves are its decoder layers. The planner traces `build()` on the meta device and cuts the
graph of leaves; nothing here ever holds real weights until a rank (or the single-process
reference) materialises the parts it owns (`pipelaunch.pipeline.graph.materialize`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipelaunch.pipeline.core import IGNORE_INDEX, POSITION_IDS
from pipelaunch.pipeline.core.errors import ConfigError

if TYPE_CHECKING:
    from pipelaunch.pipeline.graph.stamp import Repeated
    from pipelaunch.pipeline.graph.trace import TracedModel

#: a model family's own per-module initialiser, e.g. transformers' `PreTrainedModel._init_weights`:
#: called as `init(root, module)` for each module, children before parents.
FamilyInit = Callable[[nn.Module, nn.Module], None]
#: a model-wide initialiser (torchtitan's `init_weights()` convention), called as `init(root)` once
WholeInit = Callable[[nn.Module], None]


@dataclass
class ModelSpec:
    """How to build, feed and score a model.

    `build()` constructs the module; the planner calls it under `torch.device("meta")`, so it must
    not read weights from disk or move tensors to a device itself. `leaf_modules` names submodules
    kept whole (never cut inside); empty means every traced operator may end a stage.
    `loss_fn(output, target)` returns the mean loss of one micro-batch over its scored items
    (`model_loss` for a model computing its own, `own_loss`: its output is the loss, from the
    targets `data_args` gives it as an input); `scored(target)` counts those items (tokens whose
    target is not IGNORE_INDEX for a token loss, else samples), so the runtime weighs each
    micro-batch's mean by its share of the global batch's items (one loss for the global batch,
    whatever the micro-batch count). `init`, when given, is the
    family's initialiser that `pipelaunch.pipeline.graph.materialize.init_by_name` runs after `reset_parameters`.
    """

    name: str
    build: Callable[[], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    input_shape: tuple[int, ...]  # per sample, e.g. (seq,) for tokens
    input_dtype: torch.dtype = torch.long
    target_shape: tuple[int, ...] = ()
    target_dtype: torch.dtype = torch.long
    leaf_modules: Sequence[str] = ()
    init: FamilyInit | None = None
    init_weights: WholeInit | None = None
    meta: dict = field(default_factory=dict)
    #: tensors read by name after initialisation, `load(tensors, aliases)` and `keys()`: pretrained
    #: weights (`pipelaunch.models.hf.SafetensorsDir`, `checkpoint = True`) or the buffers the module's own
    #: constructor computes (`pipelaunch.pipeline.graph.buffers.ConstructorBuffers`, `checkpoint = False`)
    load: Any = None
    #: writes exported weights (name -> tensor, the full model's names) in the family's own format
    #: into a directory; None: one `model.safetensors` under those names (`pipelaunch.launcher.export`)
    save: Callable[[dict[str, torch.Tensor], Path], None] | None = None
    #: what the data gives each positional input of the (traced) model, in order: `input` (the
    #: batch's inputs), `target` (its targets: a model that computes its own loss reads them) or an
    #: extra per-token field of the batch (`position_ids`: packed documents, data/packing.py)
    data_args: tuple[str, ...] = ("input",)
    #: the model's output is its own loss (`model.loss=model`); `loss_fn` is then `model_loss`
    own_loss: bool = False
    #: how tensor parallelism (tp > 1) splits the model: module-name pattern (`*` one name
    #: component) -> colwise | rowwise | vocab | replicate (pipeline/graph/tensor_parallel.py);
    #: modules no pattern names are replicated
    tp_plan: dict[str, str] = field(default_factory=dict)
    #: counts the items `loss_fn` averages over in a batch's targets (`count_tokens`,
    #: `count_samples`, `count_shifted`); None: tokens for `causal_lm_loss`, else samples
    scored: Callable[[torch.Tensor], int] | None = None
    #: why the loss cannot be weighed exactly on targets holding IGNORE_INDEX (data=chat's prompt
    #: and padding), naming what to change; None: it can (its mean is over the scored tokens)
    masked_refusal: str | None = None
    #: where the model's alike blocks are, so an export at full depth is made from one of a few
    #: blocks (`pipeline/graph/stamp.py`); None: exported whole
    repeated: Repeated | None = None

    def count_scored(self, targets: torch.Tensor) -> int:
        """The items the loss averages over in `targets` (a micro-batch's or the global batch's)."""
        if self.scored is not None:
            return self.scored(targets)
        return count_tokens(targets) if self.loss_fn is causal_lm_loss else count_samples(targets)

    @property
    def token_weighted(self) -> bool:
        """Whether the loss is a mean over scored tokens, the ignored (IGNORE_INDEX) ones left out."""
        if self.scored is not None:
            return self.scored is count_tokens
        return self.loss_fn is causal_lm_loss

    def tp_refusal(self, tp: int) -> str | None:
        """Why tensor parallelism over `tp` ranks cannot split this model (no plan, or a size it
        splits that tp does not divide, named by its config key), else None."""
        if tp == 1:
            return None
        if not self.tp_plan:
            return f"model={self.name} has no tensor-parallel plan (model.tp_plan)"
        for key, size in self.meta.get("tp_divides", {}).items():
            if size % tp:
                return f"tp={tp} does not divide {key}={size}"
        return None

    def build_meta(self) -> nn.Module:
        """The module with every tensor on the meta device: shapes only, no memory."""
        with torch.device("meta"):
            return self.build()

    @property
    def takes_tokens(self) -> bool:
        """Whether the model reads token ids (a language model), the one test of it: the data it
        takes, and what its throughput counts."""
        return self.input_dtype == torch.long

    @property
    def tokens_per_sample(self) -> int:
        """What one sample counts for in `tokens_per_s`: its sequence length for a model reading
        token ids, else 1 (an image: the throughput counts samples, `throughput_unit`). Under
        context parallelism the whole sequence, of which a rank holds 1/cp (`input_shape`)."""
        return int(self.input_shape[0]) * int(self.meta.get("context_parallel", 1)) if self.takes_tokens else 1

    @property
    def throughput_unit(self) -> str:
        """What `tokens_per_s` counts: tokens, or samples for a model not reading token ids."""
        return "tokens" if self.takes_tokens else "samples"

    @property
    def from_checkpoint(self) -> bool:
        """Whether `load` holds the model's weights (pretrained), so no initialiser's values survive."""
        return self.load is not None and bool(getattr(self.load, "checkpoint", False))

    def build_full(self, seed: int, device: torch.device | str = "cpu", by_name: bool = False) -> nn.Module:
        """The whole model with the initial weights every rank starts from: as `torch.manual_seed(seed);
        build()` makes it (the default), or initialised from (seed, names) (`by_name`); pretrained
        weights (`load` holding a checkpoint) then override what they hold."""
        from pipelaunch.pipeline.graph.initial_weights import built_as_written, load_into
        from pipelaunch.pipeline.graph.materialize import materialize

        if not by_name:
            model = built_as_written(self.build, seed)
            if self.from_checkpoint:
                load_into(model, self.load)
            return model.to(device)
        model = self.build_meta()
        materialize(model, seed, torch.device(device), family_init=self.init, load=self.load,
                    whole_init=self.init_weights)
        return model

    def example_batch(
        self, batch: int, seed: int = 0, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A deterministic random (input, target) pair of the right shapes and dtypes (token ids and
        class labels drawn below the model's vocabulary or class count)."""
        gen = torch.Generator().manual_seed(seed)
        high = int(self.meta.get("vocab_size", self.meta.get("num_classes", 2)))

        def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if dtype.is_floating_point:
                return torch.randn((batch, *shape), generator=gen).to(device=device, dtype=dtype)
            return torch.randint(0, high, (batch, *shape), generator=gen).to(device=device, dtype=dtype)

        return make(self.input_shape, self.input_dtype), make(self.target_shape, self.target_dtype)

    def meta_input(self, batch: int) -> torch.Tensor:
        """One micro-batch of input on the meta device, for tracing and shape propagation."""
        return torch.empty((batch, *self.input_shape), dtype=self.input_dtype, device="meta")

    def model_args(self, inputs: torch.Tensor, targets: torch.Tensor,
                   fields: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """The model's positional arguments for one (inputs, targets, extra fields) batch
        (`data_args`). A field the batch lacks (an example batch: profiling, shapes) is made up:
        position ids of two documents per sample, so a document mask has something to confine."""
        fields = fields or {}

        def given(what: str) -> torch.Tensor:
            if what == "input":
                return inputs
            if what == "target":
                return targets
            if what in fields:
                return fields[what]
            if what == POSITION_IDS:
                return example_position_ids(inputs)
            raise KeyError(f"the data gives no {what!r} (a model input of {self.name})")

        return tuple(given(what) for what in self.data_args)

    def meta_args(self, batch: int) -> tuple[torch.Tensor, ...]:
        """`model_args` of one micro-batch on the meta device, for tracing and shape propagation."""
        target = torch.empty((batch, *self.target_shape), dtype=self.target_dtype, device="meta")
        return self.model_args(self.meta_input(batch), target)

    def trace(self, micro_batch_size: int, model: nn.Module | None = None, repeat: bool = False) -> TracedModel:
        """The model (`model`, or a fresh one) traced on the meta device at one micro-batch's shapes,
        leaf modules kept whole: the graph the planner cuts and every rank cuts again. `repeat`: an
        export made from a cut of the model to a few of its alike blocks (`repeated`), the same
        graph where the stamp's own check holds; the planner asks for it, ranks export whole."""
        from pipelaunch.models.hf_moe import HFExperts, as_modules, opaque
        from pipelaunch.pipeline.graph.trace import trace_model

        model = self.build_meta() if model is None else model
        with opaque():  # transformers' experts modules one call each (models/hf_moe.py), which ep hooks
            traced = trace_model(model, self.meta_args(micro_batch_size), self.leaf_modules, name=self.name,
                                 repeated=self.repeated if repeat else None)
        if self.meta.get("cp_graph", 1) > 1:  # a model written without cp: its attention made to cross it
            from pipelaunch.pipeline.core import POSITION_IDS
            from pipelaunch.pipeline.graph.context_parallel import split_attention

            split_attention(traced, self.input_shape[-1], self.meta["cp_graph"],
                            POSITION_IDS if POSITION_IDS in self.data_args else None, self.leaf_modules)
        for node, path in as_modules(traced.gm, model).items():
            traced.graph.nodes[node].update(op="call_module", target=path, module=path)
        picks = {_picks(traced.gm, n) for n in traced.gm.graph.nodes
                 if n.op == "call_module" and isinstance(traced.gm.get_submodule(str(n.target)), HFExperts)}
        picks.discard(None)
        if len(picks) == 1:  # what a token computes with (the planner's MFU on activated parameters)
            self.meta.setdefault("top_k", picks.pop())
        return traced


def _picks(gm: nn.Module, node) -> int | None:  # noqa: ANN001 - an fx node
    """The experts a token picks in the experts call `node` (its top_k_index's last dimension, as
    the trace's shapes give it), noted on the module (`top_k`, which pricing reads)."""
    index = node.args[1] if len(node.args) > 1 else None
    meta = getattr(index, "meta", {})
    value = meta.get("val", meta.get("tensor_meta"))
    module = gm.get_submodule(str(node.target))
    if value is not None:
        module.top_k = int(value.shape[-1])
    return module.top_k


def segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Per position, the index of its document in its row: a new one wherever the position ids
    do not go up by one (transformers' `find_packed_sequence_indices` rule)."""
    first = position_ids[..., :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def example_position_ids(inputs: torch.Tensor) -> torch.Tensor:
    """Position ids of packed samples shaped as `inputs` [batch, seq]: two documents per sample
    (positions restarting halfway), on `inputs`' device (meta while tracing)."""
    t = inputs.shape[-1]
    pos = torch.arange(t, device=inputs.device)
    pos = pos - (pos >= t // 2).long() * (t // 2) if t > 1 else pos
    return pos.expand(*inputs.shape[:-1], t)


def require_positive_ints(**values: object) -> None:
    """Refuse a size that is not a positive integer, naming `model.<key>` (before torch meets a
    negative dimension)."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"model.{key}", f"got {value!r}; valid: a positive integer")


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the micro-batch's scored positions (targets not
    IGNORE_INDEX); the runtime weighs it by the micro-batch's share of the global batch's."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                       ignore_index=IGNORE_INDEX)


def count_tokens(targets: torch.Tensor) -> int:
    """Scored tokens: target positions that are not IGNORE_INDEX."""
    return int((targets != IGNORE_INDEX).sum())


def count_samples(targets: torch.Tensor) -> int:
    """Samples: what a per-sample mean (mse, an image's class) averages over."""
    return int(targets.shape[0])


def count_shifted(targets: torch.Tensor) -> int:
    """Positions a loss scores when it shifts the input ids itself (transformers' `labels=ids`):
    every position but the last of each sample."""
    return int(targets.shape[0]) * max(int(targets.shape[-1]) - 1, 0)


def model_loss(loss: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """The `loss_fn` of a model that computes its own loss (`ModelSpec.own_loss`): its output is
    the micro-batch's loss already, computed from the targets it was given as an input."""
    return loss
