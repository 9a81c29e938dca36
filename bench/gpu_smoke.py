"""GPU smoke check: the CUDA path end to end on one GPU, through the normal launcher.

    source .gpu/setup.sh && python bench/gpu_smoke.py --out $OUT     # a GPU machine without Hydra
    make gpu-check OUT=/tmp/gpu_check                                 # a machine with the project's venv

One GPU holds one NCCL rank, so everything runs at pp=1 dp=1 on NCCL (world size 1), on
`model=gpt_bench`, each training run a `python train.py device=cuda pp=1 ...` subprocess:

1. planning in this process (precision=bf16, a profile) leaves CUDA uninitialised here, and a node
   with fewer GPUs than ranks is refused before spawning;
2. fp32 training with a profile (`predict=true`) and checkpoints: losses finite, timings in
   metrics.json (`stage_costs`, `measured_schedule_s`; CUDA events on a GPU) and trace.json,
   the CUDA allocator's peak (`max_memory_allocated`) against the plan's predicted peak;
3. the profile was taken on the GPU: the profile cache file names it (`cuda:<device name>`);
4. precision=bf16 trains, its first loss near fp32's;
5. resume from the step-3 checkpoint follows the uninterrupted losses;
6. `python -m pipelaunch.launcher.export` of the last checkpoint writes a loadable safetensors file;
7. the run started from the model's own weights: its first loss equals that of
   `torch.manual_seed(seed); build()` on the same device and batch; and nanoGPT (tests/zoo.py)
   trains with its own loss from its own constructor's weights (`model.loss=model`): its first
   loss equals its author's `m(x, y)[1]` on the device.

Writes one report, `gpu_smoke.json` (every check, its numbers, and `summary`: the same as the
text printed at the end), into `--out` (default: $OUT, else ./gpu_smoke_out). Exit code 0 when
every check passed, 1 when one failed, 2 when there is no CUDA device (the report then says so).
`--device cpu` runs the same flow on the CPU, only to check this script on a machine without one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the project importable, not installed

REPORT = "gpu_smoke.json"
STEPS = 6  # checkpoints at steps 3 and 6
BASE = ["pp=1", "dp=1", "model=gpt_bench", "batch_size=16", "microbatches=4", "warmup_steps=2", "timeout_s=180",
        "optimizer=adamw"]
RUN_TIMEOUT_S = 420


class Report:
    """Every check: name, ok, what was seen."""

    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.info: dict = {}

    def check(self, name: str, ok: bool, detail: str = "", **numbers) -> bool:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail, **numbers})
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        return bool(ok)

    def failed(self, name: str, err: BaseException) -> None:
        self.check(name, False, f"raised {type(err).__name__}: {err}",
                   traceback=traceback.format_exc(limit=6)[-3000:])

    def summary(self) -> list[str]:
        passed = sum(c["ok"] for c in self.checks)
        lines = [f"gpu smoke check: {passed}/{len(self.checks)} checks passed on {self.info.get('device_name', '?')} "
                 f"(torch {self.info.get('torch')}, CUDA {self.info.get('cuda')}, NCCL {self.info.get('nccl')})"]
        lines += [f"  {'PASS' if c['ok'] else 'FAIL'}  {c['check']}: {c['detail']}" for c in self.checks]
        return lines

    def write(self, out: Path, status: str, **extra) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        path = out / REPORT
        data = {"status": status, **self.info, **extra, "checks": self.checks,
                "summary": self.summary() if self.checks else extra.get("summary", [])}
        path.write_text(json.dumps(data, indent=1, default=str))
        return path


def _finite(values) -> bool:
    return bool(values) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _positive_numbers(value) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)] if value > 0 else []
    if isinstance(value, dict):
        return [x for v in value.values() for x in _positive_numbers(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _positive_numbers(v)]
    return []


def _nccl_version() -> str | None:
    try:
        version = torch_cuda_nccl_version()
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, (tuple, list)) else str(version)


def torch_cuda_nccl_version():
    import torch.cuda.nccl

    return torch.cuda.nccl.version()


def train(name: str, overrides: list[str], work: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path, dict]:
    """`python train.py <overrides> hydra.run.dir=<work>/<name>`; returns the process, the run
    directory and its metrics.json (empty when there is none)."""
    run_dir = work / name
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    print(f"--- {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    print(f"    exit {proc.returncode} after {time.perf_counter() - t0:.1f} s", flush=True)
    metrics_path = run_dir / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    return proc, run_dir, metrics


def _tail(proc: subprocess.CompletedProcess) -> str:
    return (proc.stderr or proc.stdout or "")[-1500:]


def check_planning(report: Report, device: str, env: dict) -> None:
    """In this process, before anything here touches CUDA: the launcher's planning of a bf16 run
    with a profile leaves CUDA uninitialised (the dtype pass runs on fake tensors, the profile in a
    child process that ends before planning does), and a node with fewer GPUs than ranks is
    refused before spawning."""
    import torch

    from pipelaunch.launcher.overrides import compose_checked as cfg_of
    from pipelaunch.launcher.validate import prepare
    from pipelaunch.pipeline.core.errors import ConfigError

    saved = os.environ.get("PIPELAUNCH_CACHE")
    os.environ["PIPELAUNCH_CACHE"] = env["PIPELAUNCH_CACHE"]
    try:
        t0 = time.perf_counter()
        plan = prepare(cfg_of([*BASE, f"device={device}", "precision=bf16", "predict=true"])).plan
        report.check("launcher planning opens no CUDA context", not torch.cuda.is_initialized(),
                     f"planned precision={plan.meta.precision} with a profile in "
                     f"{time.perf_counter() - t0:.1f} s; torch.cuda.is_initialized() in the launcher: "
                     f"{torch.cuda.is_initialized()}")
        count = torch.cuda.device_count() if device == "cuda" else 0
        if device == "cuda":
            try:
                prepare(cfg_of([*BASE, "device=cuda", f"pp={count + 1}", "microbatches=8", "batch_size=16"]),
                        profile=False)
                report.check("more ranks than GPUs refused before spawning", False,
                             f"pp={count + 1} on {count} GPU(s) was accepted")
            except ConfigError as err:
                report.check("more ranks than GPUs refused before spawning",
                             f"need {count + 1} GPUs" in str(err), str(err)[:300])
    finally:
        if saved is None:
            os.environ.pop("PIPELAUNCH_CACHE", None)
        else:
            os.environ["PIPELAUNCH_CACHE"] = saved


def check_own_weights(report: Report, metrics: dict, device: str) -> None:
    """The run started from the model as its author builds it (#33): every rank says `constructor`,
    and the run's first loss equals, within 1e-5, the loss of `torch.manual_seed(seed); build()`
    moved to this device, on the run's first batch and micro-batches, computed in this process."""
    import torch
    from hydra.utils import instantiate

    from pipelaunch.pipeline.graph.initial_weights import built_as_written

    config = metrics["config"]
    spec, data = instantiate(config["model"]), instantiate(config["data"])
    model = built_as_written(spec.build, config["seed"]).to(device)
    inputs, targets = data.batch(0, config["batch_size"])
    m = config["microbatches"]
    with torch.no_grad():
        own = sum(float(spec.loss_fn(model(x.to(device)), y.to(device))) / m
                  for x, y in zip(inputs.chunk(m), targets.chunk(m), strict=True))
    first = metrics["losses"][0]
    paths = sorted({r.get("initial_weights") for r in metrics["ranks"]})
    gap = abs(first - own) / abs(own)
    report.check("the first loss is the model's own", paths == ["constructor"] and gap <= 1e-5,
                 f"ranks' initial weights {paths}; first loss {first:.6f}, torch.manual_seed({config['seed']}); "
                 f"build() on {device}: {own:.6f} (relative gap {gap:.1e}, pass <= 1e-5)")


#: nanoGPT (tests/zoo.py's faithful stand-in) training with its own loss, `(logits, loss) = m(idx, targets)`
NANOGPT = ["pp=1", "dp=1", "model=module", "model.module._target_=tests.zoo.nanogpt", "model.seq_len=16",
           "model.vocab_size=64", "model.loss=model", "batch_size=16", "microbatches=4", "steps=2", "warmup_steps=0",
           "optimizer=sgd", "timeout_s=180"]


def check_own_loss(report: Report, device: str, work: Path, env: dict) -> None:
    """A model nobody here wrote, with its own constructor-time initialisation and its own loss,
    trains on the device from its author's weights: the run's first loss equals nanoGPT's own
    `torch.manual_seed(0); m = GPT(...); m(x, y)[1]` on the device, within 1e-5."""
    import torch
    from hydra.utils import instantiate

    from tests.zoo import nanogpt

    proc, _, metrics = train("nanogpt", [*NANOGPT, f"device={device}"], work, env)
    losses = metrics.get("losses", [])
    if not (proc.returncode == 0 and _finite(losses)):
        report.check("nanoGPT trains with its own loss and weights", False, f"exit {proc.returncode}; {_tail(proc)}")
        return
    config = metrics["config"]
    data = instantiate(config["data"])
    torch.manual_seed(config["seed"])
    model = nanogpt(vocab_size=64, block_size=16).to(device)
    inputs, targets = data.batch(0, config["batch_size"])
    m = config["microbatches"]
    with torch.no_grad():
        own = sum(float(model(x.to(device), y.to(device))[1]) / m
                  for x, y in zip(inputs.chunk(m), targets.chunk(m), strict=True))
    gap = abs(losses[0] - own) / abs(own)
    report.check("nanoGPT trains with its own loss and weights", gap <= 1e-5,
                 f"first loss {losses[0]:.6f}; nanoGPT's own m(x, y)[1] after torch.manual_seed(0) on {device}: "
                 f"{own:.6f} (relative gap {gap:.1e}, pass <= 1e-5); losses {[round(x, 4) for x in losses]}")


def run_checks(report: Report, device: str, work: Path) -> None:
    import torch

    env = {**os.environ, "PIPELAUNCH_CACHE": str(work / "profile_cache")}
    try:
        check_planning(report, device, env)
    except Exception as err:  # noqa: BLE001 - one failed check must not hide the others
        report.failed("launcher planning opens no CUDA context", err)

    if device == "cuda":  # only now may this process touch the GPU
        props = torch.cuda.get_device_properties(0)
        report.info.update(device_name=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                           memory_bytes=props.total_memory, gpus=torch.cuda.device_count(),
                           nccl=_nccl_version(),
                           bf16_supported=torch.cuda.is_bf16_supported())
    else:
        report.info.update(device_name="cpu (--device cpu: a check of this script, not of a GPU)")
    label = f"cuda:{report.info['device_name']}" if device == "cuda" else "cpu"

    common = [*BASE, f"device={device}"]
    fp32, fp32_dir, m32 = train("fp32", [*common, f"steps={STEPS}", "predict=true", "checkpoint.every=3"], work, env)
    losses = m32.get("losses", [])
    if report.check("fp32 training runs", fp32.returncode == 0 and _finite(losses) and len(losses) == STEPS,
                    f"exit {fp32.returncode}, losses {[round(x, 4) for x in losses]}"
                    + ("" if fp32.returncode == 0 else f"; stderr: {_tail(fp32)}")):
        rank = m32["ranks"][0]
        report.check("the rank ran on the device, on NCCL" if device == "cuda" else "the rank ran on the device",
                     str(rank.get("device", "")).startswith(device),
                     f"rank 0 device {rank.get('device')} (backend {'nccl' if device == 'cuda' else 'gloo'})")
        costs = _positive_numbers(m32.get("stage_costs"))
        trace = fp32_dir / "trace.json"
        events = json.loads(trace.read_text()) if trace.exists() else []
        events = events.get("traceEvents", []) if isinstance(events, dict) else events
        report.check("timings in metrics.json", bool(costs) and m32.get("step_time_s", 0) > 0
                     and m32.get("measured_schedule_s", 0) > 0 and len(events) > 0,
                     f"step_time_s {m32.get('step_time_s', 0):.4f}, measured_schedule_s "
                     f"{m32.get('measured_schedule_s', 0):.4f}, {len(costs)} positive stage_costs, "
                     f"{len(events)} trace.json events" + (" (timed by CUDA events)" if device == "cuda" else ""),
                     stage_costs=m32.get("stage_costs"), planned_step_time_s=m32.get("planned_step_time_s"))
        peak, predicted = rank.get("peak_memory_bytes"), rank.get("predicted_peak_bytes")
        above = rank.get("peak_above_start_bytes")
        ratio = above / predicted if predicted and above is not None else None
        what = "max_memory_allocated" if device == "cuda" else "peak RSS"
        mib = lambda b: f"{b / 2**20:.1f} MiB" if b is not None else "none"  # noqa: E731
        report.check("peak memory against the prediction", ratio is not None and 0.5 <= ratio <= 2.0,
                     f"{what} {mib(peak)}, {mib(above)} above the start, predicted {mib(predicted)}: "
                     + (f"{ratio:.2f}x" if ratio is not None else "no ratio") + " (pass: 0.5-2.0x)",
                     peak_memory_bytes=peak, peak_above_start_bytes=above, predicted_peak_bytes=predicted, ratio=ratio)

        try:
            check_own_weights(report, m32, device)
        except Exception as err:  # noqa: BLE001 - one failed check must not hide the others
            report.failed("the first loss is the model's own", err)

    try:
        check_own_loss(report, device, work, env)
    except Exception as err:  # noqa: BLE001 - one failed check must not hide the others
        report.failed("nanoGPT trains with its own loss and weights", err)

    cached = [json.loads(p.read_text()) for p in sorted((work / "profile_cache").glob("*.json"))]
    devices = sorted({c.get("device") for c in cached})
    report.check("profile taken on the run's device", bool(cached) and devices == [label],
                 f"{len(cached)} profile(s) in the cache, keyed by device {devices} (expected {label!r})")

    bf16, _, m16 = train("bf16", [*common, "precision=bf16", "steps=4"], work, env)
    l16 = m16.get("losses", [])
    close = bool(losses) and bool(l16) and abs(l16[0] - losses[0]) < 0.1
    report.check("precision=bf16 trains", bf16.returncode == 0 and _finite(l16) and close,
                 f"exit {bf16.returncode}, losses {[round(x, 4) for x in l16]} (fp32 first loss "
                 f"{losses[0] if losses else float('nan'):.4f})" + ("" if bf16.returncode == 0 else f"; {_tail(bf16)}"))

    step3 = fp32_dir / "checkpoints" / "step_0000003"
    resumed, _, mr = train("resume", [*common, f"steps={STEPS}", f"resume={step3}"], work, env)
    lr = mr.get("losses", [])
    gap = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(lr[3:], losses[3:], strict=False)), default=float("nan"))
    report.check("checkpoint save, then resume", resumed.returncode == 0 and mr.get("start_step") == 3
                 and len(lr) == STEPS and gap <= 1e-3,
                 f"exit {resumed.returncode}, start_step {mr.get('start_step')}, steps 3-5 "
                 f"{[round(x, 5) for x in lr[3:]]} vs uninterrupted {[round(x, 5) for x in losses[3:]]} "
                 f"(largest relative gap {gap:.1e}, pass <= 1e-3)" + ("" if resumed.returncode == 0 else f"; {_tail(resumed)}"))

    last = fp32_dir / "checkpoints" / f"step_{STEPS:07d}"
    exported = work / "exported"
    proc = subprocess.run([sys.executable, "-m", "pipelaunch.launcher.export", str(last), str(exported)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    detail = f"exit {proc.returncode}"
    ok = proc.returncode == 0 and (exported / "model.safetensors").exists()
    if ok:
        from safetensors.torch import load_file

        tensors = load_file(str(exported / "model.safetensors"))
        ok = bool(tensors) and all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())
        detail += f", {len(tensors)} tensors, {sum(t.numel() for t in tensors.values())} values, all finite: {ok}"
    else:
        detail += f"; {(proc.stderr or proc.stdout)[-1500:]}"
    report.check("python -m pipelaunch.launcher.export of the checkpoint", ok, detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_smoke_out", help="where the report goes")
    parser.add_argument("--work", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: run the same flow on the CPU, to check this script without a GPU")
    args = parser.parse_args(argv)
    out = Path(args.out)
    import torch

    report = Report()
    report.info.update(torch=torch.__version__, cuda=torch.version.cuda, python=sys.version.split()[0],
                       started=time.strftime("%Y-%m-%d %H:%M:%S"))
    if args.device == "cuda" and not torch.cuda.is_available():
        message = (f"gpu_smoke: no CUDA device is available here (torch.cuda.is_available() is False; torch "
                   f"{torch.__version__}, built for CUDA {torch.version.cuda}; CUDA_VISIBLE_DEVICES="
                   f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). This check needs one GPU; nothing was run.")
        print(message, file=sys.stderr, flush=True)
        report.write(out, "no_cuda", message=message, summary=[message])
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            run_checks(report, args.device, work)
        except Exception as err:  # noqa: BLE001 - the report still gets written
            report.failed("the smoke check itself", err)
        report.info["seconds"] = round(time.perf_counter() - t0, 1)
    ok = bool(report.checks) and all(c["ok"] for c in report.checks)
    path = report.write(out, "passed" if ok else "failed")
    print("\n".join(report.summary()), flush=True)
    print(f"report: {path}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
