"""Every command README.md and docs/*.md show, typed into bash as shown (#24).

Each scenario runs a doc's commands in order in a fresh scratch checkout (tests/readme_commands.py:
train.py and README.md copied, the rest of the tree symlinked, files a user creates landing in the
scratch directory). Training commands get `steps=2` and a run directory inside the scratch
directory appended, dry runs only the run directory, everything else nothing. A bad-input example
must exit 2 (a failing run 1) and print the error the doc shows, whitespace normalised, where `...`
stands for any text and a duration for any duration. Commands a test cannot run (a cluster, a GPU,
the network, rebuilding the venv, the suite itself) are in SKIPPED with the reason, and reported as
skipped. A command shown in a doc that is neither run nor skipped fails test_every_command_is_classified.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.readme_commands import (
    DocCommand,
    extract,
    extract_all,
    make_checkout,
    normalise,
    run_bash,
    shown_pattern,
)

COMMANDS, FILES = extract_all()


@dataclass(frozen=True)
class Step:
    command: str  # the command's key (DocCommand.key): whitespace normalised, comment cut
    append: str = ""  # what the harness appends; {run} is a directory inside the scratch directory
    expect: str = "ok"  # "ok" (exit 0), "refused" (exit 2, a config error), "failed" (exit 1), "prelude"
    produces: str | None = None  # a file the command must leave, relative to the checkout or under {run}


def train(command: str, steps: int = 2) -> Step:
    return Step(command, f"steps={steps} hydra.run.dir={{run}}", produces="{run}/metrics.json")


def sweep(command: str) -> Step:
    return Step(command, "steps=2 hydra.sweep.dir={run}", produces="{run}/summary.json")


def plan(command: str) -> Step:
    return Step(command, "hydra.run.dir={run}", produces="{run}/plan.json")


def typed(command: str, produces: str | None = None) -> Step:
    return Step(command, produces=produces)


def refused(command: str) -> Step:
    return Step(command, expect="refused")


def prelude(command: str) -> Step:
    """A line the doc's later commands run after in the same shell (`source ...`, `RUN=...`)."""
    return Step(command, expect="prelude")


def user_documents(checkout: Path) -> None:
    """What README's "Documents and a tokenizer" assumes the user has: documents and a tokenizer."""
    from tests.corpora import make_tokenizer, write_docs

    write_docs(checkout / "docs.jsonl")
    make_tokenizer(checkout / "my_tokenizer")


@dataclass(frozen=True)
class Scenario:
    name: str
    doc: str
    steps: tuple[Step, ...]
    slow: bool = False
    timeout: int = 120  # seconds per command
    files: tuple[str, ...] = ()  # files the doc shows in full, written first
    user_files: object = None  # a function making the files the doc assumes a user brings

    @property
    def runs(self) -> int:
        return sum(s.expect != "prelude" for s in self.steps)


ACTIVATE = prelude("source .venv/bin/activate")
RUN = ('RUN="optimizer=adamw lr_scheduler=cosine lr_scheduler.warmup_steps=100 clip_grad_norm=1.0 precision=bf16 '
       'eval.every=100 eval.batches=4 checkpoint.every=200 checkpoint.dir=ckpt/run1 steps=2000"')

# The default suite runs every bad-input example and the hung-rank report, the quick start's first
# run and dry run, README's own module on its own token file, --help/--cfg, torchrun and
# scheduler=torch's dry run: 17 commands, each 4-26 s, 128 s in all on 2 cores before the last was added
# (about 105 s of CPU; a warm profile cache; the torch dry run: 9 s). Slow: sweeps,
# 8 ranks, plan=auto's searches, transformers and diffusers models (35-120 s a scenario) and, to keep
# the default suite within 3 minutes, the 15-35 s runs of kinds it already covers (text files,
# plug-ins, resume, plan=auto's lists, SLURM's local twin, a scheduler=torch run): 27 commands, about 23 minutes.
SCENARIOS = [
    # README
    Scenario("quick-start", "README.md", (ACTIVATE, train("python train.py"))),
    Scenario("quick-start-zbv-pp4-dp2", "README.md", (ACTIVATE, train("python train.py scheduler=zbv pp=4 dp=2")),
             slow=True, timeout=300),
    Scenario("quick-start-plan", "README.md", (ACTIVATE, plan("python train.py mode=plan scheduler=zbv pp=4"))),
    Scenario("quick-start-plan-auto", "README.md", (ACTIVATE, train("python train.py plan=auto")), slow=True,
             timeout=300),
    Scenario("quick-start-sweep", "README.md", (ACTIVATE, sweep("python train.py -m scheduler=gpipe,1f1b")),
             slow=True, timeout=300),
    # the user's own project directory: its models/ package, its token file, its conf/model/tiny.yaml
    Scenario("your-project", "docs/your_model.md", (
        prelude("mkdir -p myproject/models && cd myproject"),
        typed("touch models/__init__.py", produces="myproject/models/__init__.py"),
        typed("cat > models/tiny.py <<'EOF'", produces="myproject/models/tiny.py"),
        typed("python -c \"import numpy as np, pathlib, os; text = b''.join(p.read_bytes() for p in "
              "sorted(pathlib.Path(os.__file__).parent.glob('*.py'))); "
              "np.frombuffer(text, np.uint8).astype(np.uint16).tofile('train.bin')\"", produces="myproject/train.bin"),
        train("pipelaunch model=module model.module._target_=models.tiny.tiny_lm model.seq_len=64 data=tokens "
              "data.path=train.bin pp=2"),
        typed("mkdir -p conf/model && cat > conf/model/tiny.yaml <<'EOF'", produces="myproject/conf/model/tiny.yaml"),
        train("pipelaunch model=tiny data=tokens data.path=train.bin pp=4 scheduler=zbv"),
    # slow: tests/test_bring_your_own.py trains this module on a token file as typed, and
    # tests/test_project_dir.py a project's own model by its own config name
    ), slow=True, timeout=180),
    Scenario("transformers", "docs/your_model.md", (
        train("python train.py model=hf_llama_tiny scheduler=zbv pp=2 partitioner=balanced"),
        typed("python -c \"from transformers import LlamaConfig, LlamaForCausalLM; LlamaForCausalLM(LlamaConfig("
              "hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=256))"
              ".save_pretrained('llama_dir')\"", produces="llama_dir/config.json"),
        train("python train.py model=hf model.path=llama_dir model.vocab_size=256 model.seq_len=128 pp=2"),
    ), slow=True, timeout=300),
    # fine-tuning on prompt/response pairs (slow: tests/test_fine_tuning.py trains both kinds like one
    # process at 1, 4 and 8 micro-batches and dp 1 and 2)
    Scenario("fine-tuning", "docs/your_data.md", (
        typed("python -c \"from pathlib import Path; from tests.corpora import make_tokenizer; "
              "make_tokenizer(Path('chat_tok'))\"", produces="chat_tok/tokenizer.json"),
        typed("python -c \"import json; open('chat.jsonl', 'w').writelines(json.dumps({'prompt': f'Q{i}: what "
              "does the fox do?', 'response': ' jumps' * (1 + i % 12)}) + '\\n' for i in range(64))\"",
              produces="chat.jsonl"),
        train("python train.py model=gpt model.vocab_size=320 model.seq_len=48 data=chat 'data.files=[chat.jsonl]' "
              "data.tokenizer=chat_tok pp=2 microbatches=8"),
        train("python train.py model=hf_llama_tiny model.config.vocab_size=320 model.seq_len=48 model.loss=model "
              "model.labels=targets data=chat 'data.files=[chat.jsonl]' data.tokenizer=chat_tok pp=2 dp=2"),
        # micro-batches of their own lengths (tests/test_variable_lengths.py checks the property by default)
        train("python train.py model=gpt model.vocab_size=320 model.seq_len=48 data=chat 'data.files=[chat.jsonl]' "
              "data.tokenizer=chat_tok 'data.buckets=[16,32]' data.group_by_length=true pp=2 microbatches=8 "
              "scheduler=zbv"),
        plan("python train.py mode=plan model=gpt model.vocab_size=320 model.seq_len=48 data=chat "
             "'data.files=[chat.jsonl]' data.tokenizer=chat_tok 'data.buckets=[16,32]' data.group_by_length=true "
             "pp=2 microbatches=8 scheduler=zbv"),
    ), slow=True, timeout=400),
    # packed documents (slow: tests/test_packing.py checks the property by default)
    Scenario("packing", "docs/your_data.md", (
        typed("python -c \"import numpy as np; rng = np.random.default_rng(0); np.concatenate([np.append("
              "rng.integers(1, 256, n), 0) for n in rng.integers(1, 40, 2000)]).astype(np.uint16).tofile('docs.bin')\"",
              produces="docs.bin"),
        train("python train.py data=tokens data.path=docs.bin data.packing=documents data.eod_id=0 model.seq_len=64 "
              "pp=4 dp=2 zero=1 scheduler=zbv"),
        train("python train.py model=hf_llama_tiny model.seq_len=64 data=tokens data.path=docs.bin "
              "data.packing=documents data.eod_id=0 pp=2"),
    ), slow=True, timeout=300),
    # a model computing its own loss (nanoGPT's stand-in, transformers'); the last-position refusal
    Scenario("own-loss", "docs/your_model.md", (
        train("python train.py model=module model.module._target_=tests.zoo.nanogpt model.seq_len=16 "
              "model.vocab_size=64 model.loss=model pp=2"),
        train("python train.py model=hf_gpt2_tiny model.loss=model pp=2"),
    ), slow=True, timeout=300),
    Scenario("refused-last-position", "docs/your_model.md", (
        refused("python train.py model=module model.module._target_=tests.zoo.nanogpt model.seq_len=16 "
                "model.vocab_size=64 model.output=0"),)),
    Scenario("diffusers", "docs/your_model.md", (
        train("python train.py model=module model.module._target_=diffusers.UNet2DModel +model.module.sample_size=8 "
              "'+model.module.block_out_channels=[8,16]' +model.module.layers_per_block=1 "
              "+model.module.norm_num_groups=4 '+model.module.down_block_types=[DownBlock2D,DownBlock2D]' "
              "'+model.module.up_block_types=[UpBlock2D,UpBlock2D]' 'model.input.shape=[3,8,8]' "
              "model.output=sample 'model.extra_inputs=[10]' model.loss=mse data=images data.channels=3 "
              "data.image_size=8 data.task=regression data.out_channels=3 scheduler=zbv"),
        train("python train.py model=module model.module._target_=diffusers.SD3Transformer2DModel "
              "+model.module.sample_size=8 +model.module.patch_size=2 +model.module.in_channels=4 "
              "+model.module.out_channels=4 +model.module.num_layers=2 +model.module.num_attention_heads=2 "
              "+model.module.attention_head_dim=8 +model.module.joint_attention_dim=16 "
              "+model.module.caption_projection_dim=16 +model.module.pooled_projection_dim=8 "
              "+model.module.pos_embed_max_size=8 'model.input.shape=[4,8,8]' model.output=sample "
              "'model.extra_inputs=[{shape:[4,16]},{shape:[8]},{shape:[],fill:10}]' model.loss=mse data=images "
              "data.channels=4 data.image_size=8 data.task=regression data.out_channels=4"),
    ), slow=True, timeout=300),
    Scenario("documents-and-tokenizer", "docs/your_data.md", (
        train("python train.py data=hf 'data.files=[docs.jsonl]' data.tokenizer=my_tokenizer "
              "model.vocab_size=50304 pp=2"),
        typed("python -m pipelaunch.pipeline.data.prepare docs.jsonl --tokenizer my_tokenizer --out docs.bin",
              produces="docs.bin"),
        train("python train.py data=tokens data.path=docs.bin model.vocab_size=50304 pp=2"),
    ), slow=True, timeout=300, user_files=user_documents),
    # docs/corpora.md: indexed corpora, blends, a token file's cached document index (slow: about 70 s;
    # tests/test_indexed.py and tests/test_blend.py check the properties by default)
    Scenario("corpora", "docs/corpora.md", (
        typed("python -m pipelaunch.pipeline.data.prepare docs.jsonl --tokenizer my_tokenizer --out web "
              "--out-format indexed", produces="web.idx"),
        train("python train.py data=indexed data.path=web data.packing=documents data.eod_id=1 model.vocab_size=320 "
              "pp=2"),
        typed("python -m pipelaunch.pipeline.data.prepare docs.jsonl --tokenizer my_tokenizer --out code "
              "--out-format indexed", produces="code.idx"),
        train("python train.py data=indexed 'data.blend=[{path: web, weight: 0.3}, {path: code, weight: 0.7}]' "
              "model.vocab_size=320 pp=2"),
        train("python train.py data=indexed 'data.blend=[0.3,web,0.7,code]' data.packing=documents data.eod_id=1 "
              "model.vocab_size=320 pp=2"),
        typed("python -m pipelaunch.pipeline.data.prepare docs.jsonl --tokenizer my_tokenizer --out docs.bin",
              produces="docs.bin"),
        train("python train.py data=tokens data.path=docs.bin data.packing=documents data.eod_id=1 "
              "model.vocab_size=320 pp=2"),
        typed("ls docs.bin.docs-eod1-*.npy"),
    ), slow=True, timeout=300, user_files=user_documents),
    Scenario("text-files", "docs/your_data.md", (train("python train.py data=text 'data.paths=[README.md,launcher]'"),),
             slow=True),
    # the block's own steps=2000 with checkpoints at 200 and 400 is minutes of training: 2 steps, then
    # 2 more resumed from the checkpoint the first run wrote at its end
    Scenario("long-runs", "docs/long_runs.md", (
        prelude(RUN),
        train("python train.py $RUN"),
        train("python train.py $RUN resume=auto", steps=4),
    ), slow=True, timeout=300),
    Scenario("plan-auto", "docs/planner.md", (train("python train.py plan=auto model=gpt_bench pp=2"),), slow=True,
             timeout=300),
    Scenario("plan-auto-devices", "docs/planning.md", (plan("python train.py plan=auto plan.devices=4 mode=plan model=gpt_bench "
                                                     "'plan.schedulers=[1f1b,zbv]'"),), slow=True, timeout=300),
    Scenario("plan-auto-budget", "docs/planner.md",
             (train("python train.py plan=auto model=gpt_bench pp=4 memory=budget memory.cap_bytes=150e6"),),
             slow=True, timeout=300),
    Scenario("remat-auto", "docs/planner.md",
             (train("python train.py remat=auto memory=budget memory.cap_bytes=140e6 model=gpt_bench pp=4"),),
             slow=True, timeout=300),
    Scenario("refused-remat-auto-budget", "docs/planner.md",
             (refused("python train.py remat=auto memory=budget memory.cap_bytes=90e6 model=gpt_bench pp=4"),)),
    # sharded data parallel
    # slow: tests/test_zero.py trains every schedule at pp=2 dp=2 at zero 0-3 through the same launcher code
    Scenario("zero-3", "README.md", (train("python train.py pp=2 dp=2 zero=3"),), slow=True, timeout=180),
    Scenario("zero-plan", "README.md",
             (plan("python train.py mode=plan model=gpt_bench pp=2 dp=2 zero=3 scheduler=zbv"),), slow=True, timeout=300),
    # slow: tests/test_block_units.py trains zero=3 reshard=run on the V like one process
    Scenario("zero-3-run", "README.md", (train("python train.py pp=2 dp=2 zero=3 reshard=run"),), slow=True,
             timeout=180),
    Scenario("zero-auto", "README.md", (train("python train.py plan=auto 'plan.zero=[0,1,2,3]' 'plan.reshard=[use,run]' "
                                              "'plan.schedulers=[1f1b]' model=gpt_bench pp=2 dp=2 memory=budget "
                                              "memory.cap_bytes=145e6"),), slow=True, timeout=400),
    # the 70B-class model's peaks and steps, simulated: no rank, about 2 s
    Scenario("block-units-bench", "README.md", (typed("python bench/block_units.py"),)),
    Scenario("zero-hybrid", "README.md", (train("python train.py pp=1 dp=4 dp_shard=2 zero=2 scheduler=1f1b"),),
             slow=True, timeout=180),
    # slow: tests/test_tensor_parallel.py trains these layouts like one process (and the GPT at pp=2
    # tp=2 on three schedules), and bench/tensor_parallel.py plans and runs gpt_bench at pp=2 tp=2
    Scenario("tp-train", "README.md", (train("python train.py pp=2 tp=2"),), slow=True, timeout=300),
    Scenario("tp-plan", "README.md", (plan("python train.py mode=plan model=gpt_bench pp=2 tp=2"),), slow=True,
             timeout=300),
    Scenario("tp-llama", "README.md", (train("python train.py model=hf_llama_tiny pp=2 tp=2 scheduler=zbv"),),
             slow=True, timeout=300),
    Scenario("tp-zero-3", "README.md", (train("python train.py pp=1 dp=2 tp=2 zero=3"),), slow=True, timeout=300),
    # slow: tests/test_tensor_parallel.py trains it like one process and reads its collectives
    Scenario("tp-sequence", "README.md", (train("python train.py pp=2 tp=2 sequence_parallel=true"),), slow=True,
             timeout=300),
    # slow: tests/test_moe.py, tests/test_hf_moe.py and tests/test_user_moe.py train these layouts
    # like one process, and plan them, by default
    Scenario("moe-readme", "README.md", (
        train("python train.py model.experts=8 model.top_k=2 model.shared_experts=1 pp=2 dp=2 ep=2 scheduler=dualpipev"),
        train("python train.py model=hf_mixtral_tiny pp=2 dp=2 ep=2"),
        plan("python train.py mode=plan model.experts=8 pp=2 dp=2 ep=2")), slow=True, timeout=600),
    # slow: tests/test_context_parallel.py trains these layouts like one process by default
    Scenario("cp-readme", "README.md", (
        train("python train.py cp=2 pp=2 model.seq_len=64"),
        train("python train.py cp=2 cp_method=alltoall pp=2 model.seq_len=64")), slow=True, timeout=600),
    Scenario("cp-doc", "docs/long_sequences.md", (
        train("python train.py cp=2 pp=2 model.seq_len=64"),
        train("python train.py cp=2 cp_method=alltoall pp=2 model.seq_len=64"),
        train("python train.py cp=2 dp=2 pp=1 zero=3 model.seq_len=64")), slow=True, timeout=600),
    # slow: tests/test_context_parallel_models.py trains Llama and nanoGPT under cp like one process
    Scenario("cp-models-readme", "README.md", (
        train("python train.py model=hf_llama_tiny cp=2 pp=2 model.seq_len=64"),
        train("python train.py cp=2 tp=2 pp=2 sequence_parallel=true model.seq_len=64")), slow=True, timeout=300),
    Scenario("cp-tp-doc", "docs/long_sequences.md", (
        train("python train.py cp=2 tp=2 pp=2 sequence_parallel=true model.seq_len=64"),
        train("python train.py cp=2 dp=2 ep=2 pp=1 model.experts=4 model.top_k=2 model.seq_len=64")), slow=True,
             timeout=300),
    Scenario("cp-models-doc", "docs/long_sequences.md", (
        train("python train.py model=hf_llama_tiny cp=2 pp=2 model.seq_len=64"),
        train("python train.py model=module model.module._target_=tests.zoo.nanogpt +model.module.block_size=64 "
              "model.vocab_size=64 model.seq_len=64 model.loss=model cp=2 pp=2")), slow=True, timeout=300),
    # slow: Llama-3-405B-sized searches on 16,384 H100s (about a minute or more each here);
    # tests/test_context_parallel_plan.py searches cp on a small model by default
    Scenario("cp-plan-doc", "docs/long_sequences.md", (
        plan("python train.py mode=plan plan=auto plan.devices=16384 hardware=h100_sxm precision=bf16 zero=1 model=gpt model.layers=126 model.dim=16384 model.heads=128 model.vocab_size=128256 model.mlp_ratio=4 model.seq_len=131072 "
             "batch_size=128 'plan.schedulers=[1f1b,interleaved_1f1b]' 'plan.partitioners=[uniform]' 'plan.tp=[8]'"),
        plan("python train.py mode=plan hardware=h100_sxm precision=bf16 zero=1 model=gpt model.layers=126 "
             "model.dim=16384 model.heads=128 model.vocab_size=128256 model.mlp_ratio=4 model.seq_len=131072 "
             "batch_size=128 tp=8 cp=16 pp=16 dp=8 scheduler=interleaved_1f1b scheduler.stages_per_rank=4 "
             "microbatches=16 remat=auto")), slow=True, timeout=900),
    Scenario("cp-plan", "docs/planner.md", (
        plan("python train.py mode=plan plan=auto plan.devices=16384 hardware=h100_sxm precision=bf16 zero=1 model=gpt model.layers=126 model.dim=16384 model.heads=128 model.vocab_size=128256 model.mlp_ratio=4 model.seq_len=131072 "
             "batch_size=128 'plan.schedulers=[1f1b,interleaved_1f1b]' 'plan.partitioners=[uniform]' 'plan.tp=[8]'"),
        plan("python train.py mode=plan plan=auto plan.devices=16384 hardware=h100_sxm precision=bf16 zero=1 model=gpt model.layers=126 model.dim=16384 model.heads=128 model.vocab_size=128256 model.mlp_ratio=4 model.seq_len=8192 "
             "batch_size=2048 'plan.schedulers=[1f1b,interleaved_1f1b]' 'plan.partitioners=[uniform]' 'plan.tp=[8]'")),
             slow=True, timeout=900),
    # slow: tests/test_expert_search.py plans DeepSeek-V3's dimensions on the H800 by default
    Scenario("deepseek-plan", "docs/planner.md", (
        plan("python train.py mode=plan model=gpt_deepseek_v3 hardware=h800 batch_size=15360 precision=bf16 zero=1 "
             "pp=16 dp=128 ep=64 scheduler=dualpipev microbatches=120 remat=auto partitioner=uniform"),
        plan("python train.py mode=plan model=gpt_deepseek_v3 hardware=h800 batch_size=15360 precision=bf16 zero=1 "
             "plan=auto plan.devices=2048")), slow=True, timeout=600),
    Scenario("moe-doc", "docs/moe.md", (
        train("python train.py model.experts=8 model.top_k=2 model.shared_experts=1 model.dense_layers=1 pp=2 dp=2"),
        train("python train.py model.experts=8 model.top_k=2 pp=2 dp=2 ep=2 scheduler=dualpipev"),
        train("python train.py model.experts=8 model.top_k=2 pp=1 dp=4 ep=2 zero=1"),
        train("python train.py model.experts=8 model.router=sigmoid model.expert_groups=4 model.topk_groups=2 "
              "model.route_scale=2.5 pp=2 dp=2 ep=2"),
        train("python train.py model=hf_mixtral_tiny pp=2 dp=2 ep=2"),
        train("python train.py model=module model.module._target_=tests.user_moe.TinyMoELM model.vocab_size=64 "
              "model.seq_len=16 'model.ep_plan={blocks.*.bank: ep_dispatch_experts}' pp=2 dp=2 ep=2"),
        train("python train.py model.experts=8 pp=2 dp=2 ep=2 moe.capacity_factor=1.25"),
        train("python train.py model.experts=8 model.router=sigmoid pp=2 dp=2 ep=2 moe.bias_update_rate=0.001"),
        plan("python train.py mode=plan model.experts=8 pp=2 dp=2 ep=2 scheduler=dualpipev")), slow=True, timeout=900),
    Scenario("analytic-block", "docs/planner.md", (
        typed("python -m pipelaunch.pipeline.planner.measure.analytic --hardware h100_sxm --hidden 8192 --heads 64 "
              "--batch 2"), typed("python bench/analytic_layer.py"))),
    # slow: tests/test_plan_devices.py compares tp 1, 2, 4 and 8 on eight devices by default
    Scenario("tp-plan-devices", "docs/tensor_parallel.md", (
        plan("python train.py plan=auto plan.devices=8 mode=plan model.heads=8 'plan.schedulers=[1f1b]' "
             "'plan.partitioners=[uniform]' 'plan.remat=[none]' 'plan.microbatches=[8]'"),), slow=True, timeout=300),
    # slow: tests/test_hardware_plans.py plans a cluster on every hardware file by default
    Scenario("cluster-plan", "docs/planning.md", (
        plan("python train.py mode=plan plan=auto hardware=h100_sxm plan.devices=16 model.layers=24 model.dim=2048 "
             "model.heads=16 model.vocab_size=51200 model.seq_len=2048 batch_size=64 precision=bf16 "
             "'plan.schedulers=[1f1b,interleaved_1f1b]' 'plan.partitioners=[uniform]' 'plan.remat=[none]'"),),
             slow=True, timeout=600),
    # slow: about 90 s (a transformers Llama traced to its operators); tests/test_hardware_plans.py prices
    # models on every hardware file by default
    Scenario("cluster-plan-70b", "docs/planning.md", (
        plan("python train.py mode=plan model=llama3_70b pp=8 tp=8 microbatches=16 batch_size=16 hardware=h100_sxm "
             "precision=bf16 remat=full"),),
             slow=True, timeout=600),
    Scenario("scheduler-auto", "docs/planning.md", (train("python train.py scheduler=auto pp=2 microbatches=8"),),
             slow=True, timeout=300),
    Scenario("sweep-4-jobs", "docs/sweeps.md",
             (sweep("python train.py -m scheduler=gpipe,1f1b partitioner=uniform,balanced"),), slow=True,
             timeout=400),
    Scenario("sweep-matrix", "docs/sweeps.md", (sweep("python train.py -m +sweep=schedules"),), slow=True, timeout=600),
    Scenario("optuna-throughput", "docs/sweeps.md", (
        sweep("python train.py -m hydra/sweeper=optuna hydra.sweeper.n_trials=8 'microbatches=choice(2,4,8)' "
              "'scheduler=choice(1f1b,zbv)'"),), slow=True, timeout=600),
    Scenario("optuna-loss", "docs/sweeps.md", (
        sweep("python train.py -m hydra/sweeper=optuna hydra.sweeper.n_trials=8 objective=loss "
              "'optimizer.lr=tag(log,interval(1e-4,1e-2))'"),), slow=True, timeout=600),
    # slow: tests/test_cli.py's torchrun ranks join the same way by default
    Scenario("torchrun-one-machine", "docs/gpu.md", (
        Step("torchrun --standalone --nproc-per-node 2 train.py pp=2 hydra.run.dir=out/tr", "steps=2",
             produces="out/tr/metrics.json"),), slow=True),
    Scenario("submitit-local", "docs/gpu.md", (
        sweep("python train.py -m hydra/launcher=submitit_local hydra.launcher.tasks_per_node=2 pp=2"),), slow=True,
             timeout=400),
    Scenario("refused-model-unet", "docs/failures.md", (refused("python train.py model=unet"),)),
    Scenario("hung-rank-report", "docs/failures.md", (
        Step("python train.py pp=2 timeout_s=8 debug.hang_rank=1 debug.hang_step=2", "hydra.run.dir={run}",
             expect="failed"),),
        # slow: tests/test_faults.py hangs a rank with the same keys and checks the report line by line
        slow=True),
    # docs/config.md
    Scenario("help-and-config", "docs/config.md",
             (typed("python train.py --cfg job"), typed("python train.py --help"))),
    Scenario("refusals", "docs/config.md", (
        refused("python train.py scheduler=dualpipev pp=2 microbatches=2"),
        refused("python train.py batch_size=10"),
        refused("python train.py device=tpu"),
        refused("python train.py clip_grad_norm=0"),
    )),
    # docs/schedules.md: torch.distributed.pipelining's orders
    Scenario("torch-schedule-plan", "docs/schedules.md",
             (plan("python train.py mode=plan scheduler=torch scheduler.schedule=DualPipeV pp=4 microbatches=8"),)),
    Scenario("torch-schedule-train", "docs/schedules.md",
             (train("python train.py scheduler=torch scheduler.schedule=InterleavedZeroBubble "
                    "scheduler.stages_per_rank=4 pp=2"),), slow=True, timeout=300),
    # docs/design.md: the plug-ins it shows, in your own package and config directory
    Scenario("plugins", "docs/design.md", (
        train("PYTHONPATH=. python train.py hydra.searchpath=[file://$PWD/myconf] scheduler=lifo "
              "partitioner=head_first"),
        train("PYTHONPATH=. python train.py hydra.searchpath=[file://$PWD/myconf] scheduler=auto"),
    ), slow=True, timeout=300,
             files=("myplugins/__init__.py", "myconf/scheduler/lifo.yaml", "myconf/partitioner/head_first.yaml")),
    # docs/presets.md: the preset too big to train here, refused before any rank (about 10 s)
    Scenario("preset-refused", "docs/presets.md", (refused("python train.py model=llama3_70b"),)),
    # slow: Llama 3.1 70B's search of 64 H100s and Mixtral's priced experts (tests/test_presets.py
    # checks the preset's plan against the README's long command)
    Scenario("preset-plans", "docs/presets.md", (
        plan("python train.py mode=plan model=llama3_70b hardware=h100_sxm precision=bf16 plan=auto plan.devices=64"),
        plan("python train.py mode=plan model=mixtral_8x7b hardware=h100_sxm precision=bf16 pp=8 dp=8 ep=8 "
             "microbatches=8 batch_size=64 remat=full"),
    ), slow=True, timeout=600),
    # docs/planner.md
    Scenario("plan-unet", "docs/planner.md", (plan("python train.py mode=plan model=unet data=images pp=2"),)),
    Scenario("plan-llama-boundaries", "docs/planner.md", (
        plan("python train.py mode=plan model=hf_llama_tiny model.seq_len=1024 "
             "model.config.max_position_embeddings=1024 pp=4 microbatches=4 batch_size=4"),)),
    Scenario("plan-auto-dry-run", "docs/planner.md",
             (plan("python train.py plan=auto mode=plan model=gpt_bench pp=2"),), slow=True, timeout=300),
    Scenario("plan-auto-lists", "docs/planner.md", (
        train("python train.py plan=auto 'plan.schedulers=[1f1b,zbv]' 'plan.microbatches=[8,16]' "
              "'plan.remat=[none]'"),), slow=True, timeout=300),
]

CLUSTER = "needs a cluster: a second machine named node0 (tests/test_two_nodes.py runs two torchrun agents on one)"
SLURM = "needs a SLURM cluster (its local twin, hydra/launcher=submitit_local, runs: scenario submitit-local)"
GPU = "needs CUDA GPUs; this machine has none (tests/test_gpu_launch.py checks the GPU path without one)"
NETWORK = "installs packages from the network into the environment the tests run in"
SUITE = "runs the test suite, or part of it, which includes this test"
SKIPPED = {
    "python tools/preprocess_data.py --input docs.jsonl --output-prefix web --tokenizer-type HuggingFaceTokenizer "
    "--tokenizer-model my_tokenizer --append-eod --workers 8":
        "Megatron-LM's own script, in its repository (the megatron-core wheel has no tools/); tests/test_indexed.py "
        "trains on corpora megatron-core's IndexedDatasetBuilder writes",
    "python train.py data=indexed data.path=web_text_document data.packing=documents data.eod_id=1 "
    "model.vocab_size=320 pp=2":
        "reads what Megatron-LM's script above writes; the same run on prepare's web runs in scenario corpora",
    "python bench/indexed_start.py --train": "writes a 10 GB corpus and times its starts (bench/RESULTS.md)",
    "python -m pipelaunch.pipeline.planner.measure.calibrate --base auto --out $OUT/hardware_calibrated.yaml":
        "needs a GPU (make gpu-check runs it there; tests/test_hardware_files.py runs the command on the CPU)",
    "python -m pipelaunch.pipeline.planner.measure.calibrate --base auto --out f.yaml":
        "needs a GPU (make gpu-check runs it there; tests/test_hardware_files.py runs the command on the CPU)",
    "make train": "rebuilds .venv from the network, then runs `python train.py` (run here: scenario quick-start)",
    "make test": "rebuilds .venv from the network, then runs the whole suite, this test included",
    'pip install "torch==2.13.0"': NETWORK,
    'pip install -e ".[dev,hf]"': NETWORK,
    'pip install -e ".[dev]"': NETWORK,
    "pytest -q -n 2": SUITE,
    "pytest -m slow": SUITE,
    "pytest tests/test_config_fuzz.py -s": SUITE,
    "python bench/published_layouts.py": "plans ten GPT clusters of 32 to 3072 A100s (about 2 minutes here); "
                                         "bench/RESULTS.md records the table, tests/test_hardware_plans.py plans "
                                         "clusters on every hardware file",
    "python train.py mode=plan plan=auto hardware=a100_80gb plan.devices=3072 model=gpt model.layers=128 "
    "model.dim=25600 model.heads=160 model.vocab_size=51200 model.seq_len=2048 batch_size=3072":
        "plans the 1T GPT on 3072 A100s (about 2 minutes here, bench/RESULTS.md records it); "
        "tests/test_screen.py runs the same screened search on a small cluster",
    "python bench/llama3_405b.py --search": "plans Llama 3 405B's layouts and searches 16,384 H100s at two lengths "
                                            "(several minutes here), the figures in bench/RESULTS.md; its commands "
                                            "run in scenarios cp-plan and cp-plan-doc",
    "python bench/deepseek_v3.py": "plans DeepSeek-V3's dimensions on 2048 H800s twice (about 40 s), the figures "
                                   "in bench/RESULTS.md; its plans run in scenario deepseek-plan",
    "python bench/moe_overlap.py": "six real training runs at pp=2 dp=2 ep=2 (about 3 minutes), timed: run on an "
                                   "idle machine (bench/RESULTS.md)",
    "python bench/cp_memory.py": "two real training runs of gpt_bench at 1024 positions (4 ranks at cp=2): bench/"
                                 "RESULTS.md records them; tests/test_context_parallel.py checks cp's activations "
                                 "in the plan by default",
    "python bench/remat_modes.py": "twelve real training runs of gpt_bench (about 4 minutes), timed: run on an "
                                   "idle machine, bench/RESULTS.md records them; tests/test_remat_modes.py measures "
                                   "each mode's memory",
    "python bench/tensor_parallel.py": "six real training runs of gpt_bench, profiled afresh each (about 4 minutes), "
                                       "timed: run on an idle machine, bench/RESULTS.md records them",
    "python train.py $RUN pp=4 dp=2 scheduler=zbv partitioner=milp resume=ckpt/run1/step_0000400":
        "resumes from step 400 of the block's 2000-step run, minutes of training here (resuming on another "
        "layout: tests/test_long_runs.py)",
    "python -m pipelaunch.launcher.export ckpt/run1/step_0002000 exported/":
        "exports step 2000 of the block's 2000-step run, minutes of training here (export: tests/test_long_runs.py)",
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node0:29500 "
    "train.py pp=2 dp=2 hydra.run.dir=/shared/runs/two_nodes": CLUSTER,
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node0:29500 "
    "train.py device=cuda pp=2 dp=2 hydra.run.dir=/shared/runs/two_nodes": CLUSTER + "; and GPUs",
    "python train.py -m hydra/launcher=submitit_slurm hydra.launcher.nodes=2 hydra.launcher.tasks_per_node=4 "
    "hydra.launcher.gpus_per_node=4 hydra.launcher.timeout_min=600 pp=4 dp=2 device=cuda checkpoint.every=500 "
    "checkpoint.dir=/shared/ckpt/run1 resume=auto": SLURM,
    "python train.py -m hydra/launcher=submitit_slurm hydra.launcher.nodes=2 hydra.launcher.tasks_per_node=4 "
    "hydra.launcher.gpus_per_node=4 pp=4 dp=2 device=cuda checkpoint.dir=/shared/ckpt/run1 resume=auto": SLURM,
    "python train.py device=cuda scheduler=zbv pp=4 dp=2": GPU,
    "python train.py device=cuda pp=4": GPU,
    "python train.py device=cuda pp=4 dp=2": GPU,
    "CUDA_VISIBLE_DEVICES=4,5 python train.py device=cuda pp=2": GPU,
    "make gpu-check": GPU,
    "python train.py device=cuda ...": GPU + " (and `...` stands for the runs bench/gpu_smoke.py makes)",
    "python -m torch.distributed.flight_recorder.fr_trace <run dir>/logs --prefix nccl_trace_rank_":
        "reads the NCCL flight-recorder dumps of a GPU run (`<run dir>` is a placeholder)",
    "bash ../shared/gpu/prepare.sh": "downloads wheels from the network, for a GPU machine",
    "source .gpu/setup.sh && python bench/gpu_smoke.py --out $OUT": GPU + " and the .gpu/ prepare.sh builds",
    "python -m pipelaunch.launcher.export": "named in prose without its arguments (README's whole command is listed above)",
    "python train.py model=gpt_bench optimizer=adamw pp=2 dp=2 scheduler=zbv batch_size=16 microbatches=4 zero=Z":
        "Z stands for each level; bench/zero_levels.py runs it per level (bench/RESULTS.md), and "
        "tests/test_block_units.py trains every level on the V like one process",
    "python -m pipelaunch.pipeline.runtime.probe": "names, without its arguments (RANK PORT THREADS), the program the planner "
        "starts itself to price the runtime's overheads, as it does in every profiled run above",
}


def shown(doc: str, key: str) -> DocCommand:
    found = [c for c in COMMANDS if c.doc == doc and c.key == key]
    assert found, f"{doc} no longer shows `{key}`"
    return found[0]


def test_every_command_is_classified() -> None:
    """Each command the docs show is run by a scenario or skipped with a reason, and each entry
    here is still shown somewhere."""
    run = {step.command for s in SCENARIOS for step in s.steps}
    classified = run | set(SKIPPED)
    unclassified = [f"{c.where_shown}: {c.key}" for c in COMMANDS if c.key not in classified]
    assert not unclassified, (
        "commands the docs show that tests/test_readme_commands.py neither runs (SCENARIOS) nor skips "
        "(SKIPPED, with the reason):\n" + "\n".join(unclassified))
    keys = {c.key for c in COMMANDS}
    stale = sorted(classified - keys)
    assert not stale, "classified here but no longer shown in README.md or docs/*.md:\n" + "\n".join(stale)
    assert not run & set(SKIPPED), sorted(run & set(SKIPPED))
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)


def test_scenarios_follow_their_doc() -> None:
    """A scenario's commands are its doc's, in the doc's order; the files it writes are its doc's."""
    for s in SCENARIOS:
        lines = [shown(s.doc, step.command).line for step in s.steps]
        assert lines == sorted(lines), f"{s.name}: not in {s.doc}'s order: {lines}"
        for path in s.files:
            assert [f for f in FILES if f.doc == s.doc and f.path == path], f"{s.doc} no longer shows {path}"


def test_extraction_reads_each_shell_form() -> None:
    """Comments, heredocs, continuations, `$ ` prompts with their output, inline commands, files
    shown side by side."""
    markdown = "\n".join([
        "Run `python train.py pp=4` or `make` (one word: not a command); `python -m",
        "pipelaunch.launcher.export a b` spans lines.",
        "```bash",
        "# a comment line",
        "python train.py a=1 \\",
        "    'b=[1, 2]'   # a trailing comment, 'quoted # not a comment' before it: c='#x'",
        "cat > f.py <<'EOF'",
        "x = 1  # kept",
        "EOF",
        "```",
        "```",
        "$ python train.py bad=1",
        "error (config error): it",
        "```",
        "```yaml",
        "# a/one.yaml        # b/two.yaml",
        "k: 1                j: 2",
        "                    i: 3",
        "```",
    ])
    commands, files = extract("X.md", markdown)
    assert [(c.where, c.text) for c in commands] == [
        ("inline", "python train.py pp=4"),
        ("inline", "python -m pipelaunch.launcher.export a b"),
        ("bash", "python train.py a=1     'b=[1, 2]'"),
        ("bash", "cat > f.py <<'EOF'\nx = 1  # kept\nEOF"),
        ("prompt", "python train.py bad=1"),
    ]
    assert commands[3].key == "cat > f.py <<'EOF'" and commands[4].output == "error (config error): it"
    assert [(f.path, f.text) for f in files] == [("a/one.yaml", "k: 1\n"), ("b/two.yaml", "j: 2\ni: 3\n")]
    assert shown_pattern("rank 0: step 2, for 9.9 s ... [RECV_B(0,0<1)] 0B0").search(
        "x rank 0: step 2, for 12.25 s SEND_F(0,1>1) [RECV_B(0,0<1)] 0B0 y")
    assert shown_pattern("cap by 27.0 MiB; [...] remat=auto").search("cap by 27.0 MiB; more text remat=auto")
    assert not shown_pattern("cap by 27.0 MiB").search("cap by 27.5 MiB")


@pytest.mark.timeout(30)
def test_runner_kills_what_outlives_its_command(tmp_path) -> None:
    """Past its timeout a command's process group is killed, and a process that left the group
    (setsid) is found by the marker in its environment and killed too; one left running after the
    command exits is reported."""
    hung = run_bash("setsid sleep 60 & sleep 60", tmp_path, timeout=1)
    assert hung.timed_out and hung.left_behind == []
    assert marked_processes_gone(hung)
    left = run_bash("setsid sleep 60 &", tmp_path, timeout=10, grace_s=0.5)
    assert not left.timed_out and left.returncode == 0 and len(left.left_behind) == 1
    assert marked_processes_gone(left)


def marked_processes_gone(result, within_s: float = 5.0) -> bool:
    """Every process the run left behind is dead (gone, or a zombie): a SIGKILL lands within
    moments, later on a loaded machine, so poll for a few seconds."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [pid for pid in result.left_behind if _alive(pid)]
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, ProcessLookupError):
        return False


def check_output(step: Step, command: DocCommand, out: str) -> None:
    """The output the doc shows under a `$ ` command: an error in full (as a pattern); a
    successful run's lines without digits (headers: its numbers vary run to run)."""
    if not command.output:
        return
    if step.expect in ("refused", "failed"):
        assert shown_pattern(command.output).search(normalise(out)), (
            f"{command.where_shown} shows\n{command.output}\nbut the command printed\n{out[-4000:]}")
        return
    real = normalise(out)
    for line in command.output.splitlines():
        if line.strip() and line.strip() != "..." and not re.search(r"\d", line):
            assert normalise(line) in real, f"{command.where_shown} shows the line {line!r}; printed:\n{out[-4000:]}"


EXPECTED_EXIT = {"ok": 0, "refused": 2, "failed": 1}


def run_scenario(s: Scenario, tmp: Path) -> None:
    checkout = make_checkout(tmp / "checkout")
    for path in s.files:
        (f,) = [f for f in FILES if f.doc == s.doc and f.path == path]
        (checkout / path).parent.mkdir(parents=True, exist_ok=True)
        (checkout / path).write_text(f.text)
    if s.user_files is not None:
        s.user_files(checkout)
    prelude = "set -e\n"
    for i, step in enumerate(s.steps):
        command = shown(s.doc, step.command)
        if step.expect == "prelude":
            prelude += command.text + "\n"
            continue
        run = tmp / "runs" / str(i)
        typed_in = command.text + (" " + step.append.format(run=run) if step.append else "")
        result = run_bash(typed_in, checkout, timeout=s.timeout, prelude=prelude)
        print(f"{command.where_shown}: exit {result.returncode}, {result.seconds:.1f} s "
              f"({result.cpu_seconds:.1f} s CPU): {command.key[:100]}")
        assert not result.timed_out, f"{command.where_shown}: still running after {s.timeout} s\n{result.tail()}"
        assert not result.left_behind, f"{command.where_shown}: left processes {result.left_behind}\n{result.tail()}"
        assert result.returncode == EXPECTED_EXIT[step.expect], f"{command.where_shown}:\n{result.tail()}"
        if step.expect == "refused":
            assert result.stderr.startswith("error (config error): "), result.tail()
            assert "Traceback" not in result.stderr, result.tail()
        check_output(step, command, result.stdout + "\n" + result.stderr)
        if step.produces:
            made = Path(step.produces.format(run=run))
            assert (checkout / made).exists(), f"{command.where_shown}: wrote no {made}\n{result.tail()}"


def scenario_params():
    for s in SCENARIOS:
        marks = [pytest.mark.timeout(s.timeout * s.runs + 120)]
        if s.slow:
            marks.append(pytest.mark.slow)
        yield pytest.param(s, marks=marks, id=s.name)


@pytest.mark.parametrize("scenario", list(scenario_params()))
def test_doc_commands_run_as_typed(scenario: Scenario, tmp_path) -> None:
    run_scenario(scenario, tmp_path)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("key", sorted(SKIPPED))
def test_doc_commands_not_run_here(key: str) -> None:
    pytest.skip(f"`{key}`: {SKIPPED[key]}")
