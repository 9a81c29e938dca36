"""The commands README.md and docs/*.md show, extracted as a user would type them, and a runner that
types them into bash in a scratch checkout (tests/test_readme_commands.py says what runs and why).

Extracted: every command of a fenced shell block (```bash; `# comment` lines dropped, a trailing
`# comment` cut, backslash continuations joined as bash joins them, a heredoc kept whole with its
body), every `$ command` line of another fence (with the output shown under it), a line of another
fence that starts with a command word, and inline code that is a whole command (its first word,
after any `VAR=value`, is one of COMMAND_WORDS). Files the docs show in full (a ```python or
```yaml fence whose first line is `# <path>`; two files side by side in one fence are split at the
second `# <path>`) are extracted too, for the commands that use them.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))

COMMAND_WORDS = {"python", "python3", "make", "torchrun", "pip", "pytest", "bash", "source", "cat"}
SHELL_FENCES = {"bash", "sh", "shell", "console"}
FILE_FENCES = {"python", "py", "yaml", "yml", "toml", "json"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)


@dataclass(frozen=True)
class DocCommand:
    doc: str  # "README.md", "docs/config.md"
    line: int  # 1-based line of its first line
    text: str  # what bash is given: continuations joined, a trailing comment cut, a heredoc whole
    where: str  # "bash" (shell fence), "prompt" (`$ ` in another fence), "fence" (other fence), "inline"
    output: str | None = None  # the output a `$ ` prompt block shows under the command

    @property
    def key(self) -> str:
        """One line naming the command: whitespace normalised (a heredoc: its first line)."""
        first = self.text.split("\n", 1)[0] if _HEREDOC.search(self.text.split("\n", 1)[0]) else self.text
        return " ".join(first.split())

    @property
    def where_shown(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class DocFile:
    doc: str
    line: int
    path: str  # as the doc names it, relative to the checkout
    text: str


def strip_comment(line: str) -> str:
    """`line` without a trailing shell comment (a `#` starting a word, outside quotes)."""
    quote = None
    escaped = False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def is_command(text: str) -> bool:
    words = text.split()
    while words and _ASSIGNMENT.fullmatch(words[0]):
        words = words[1:]
    return bool(words) and words[0] in COMMAND_WORDS


def shell_commands(lines: list[str]) -> list[tuple[int, str]]:
    """(index of its first line, text) of each command in a shell fence's lines."""
    found = []
    i = 0
    while i < len(lines):
        start = i
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        parts = [line]
        while parts[-1].rstrip().endswith("\\") and i + 1 < len(lines):
            parts[-1] = parts[-1].rstrip()[:-1]
            i += 1
            parts.append(lines[i])
        text = strip_comment("".join(parts))
        heredoc = _HEREDOC.search(text)
        if heredoc:
            body = []
            while i + 1 < len(lines):
                i += 1
                body.append(lines[i])
                if lines[i].strip() == heredoc.group(2):
                    break
            else:
                raise ValueError(f"heredoc {heredoc.group(2)} is not closed: {text}")
            text = "\n".join([text, *body])
        found.append((start, text))
        i += 1
    return found


def prompt_commands(lines: list[str]) -> list[tuple[int, str, str]]:
    """(index, command, output shown under it) of each `$ ` line of an output fence."""
    found = []
    for i, line in enumerate(lines):
        if line.startswith("$ "):
            parts, j = [line[2:]], i
            while parts[-1].rstrip().endswith("\\") and j + 1 < len(lines):  # continued as bash would
                parts[-1] = parts[-1].rstrip()[:-1]
                j += 1
                parts.append(lines[j])
            out = []
            for later in lines[j + 1:]:
                if later.startswith("$ "):
                    break
                out.append(later)
            found.append((i, strip_comment("".join(parts)), "\n".join(out).strip("\n")))
    return found


def split_files(lines: list[str]) -> list[tuple[str, str]]:
    """The files a fence shows: its first line names them (`# path`, one or two side by side)."""
    if not lines or not lines[0].lstrip().startswith("#"):
        return []
    heads = [(m.start(), m.group(1)) for m in re.finditer(r"#\s*(\S+\.\w+)", lines[0])]
    if not heads or not all("/" in name or "." in name for _, name in heads):
        return []
    columns = [start for start, _ in heads] + [None]
    files = []
    for (start, name), end in zip(heads, columns[1:], strict=True):
        body = [(line[start:end] if end is not None else line[start:]).rstrip() for line in lines[1:]]
        files.append((name, "\n".join(body).strip("\n") + "\n"))
    return files


def _inline_spans(text: str) -> list[tuple[int, str]]:
    """(offset, content) of inline code spans in text outside fences."""
    return [(m.start(2), m.group(2)) for m in _INLINE.finditer(text)]


def extract(doc: str, markdown: str | None = None) -> tuple[list[DocCommand], list[DocFile]]:
    """The commands and files of `doc` (its text: `markdown`, or the file under ROOT)."""
    raw = ((ROOT / doc).read_text() if markdown is None else markdown).split("\n")
    commands: list[DocCommand] = []
    files: list[DocFile] = []
    prose = []  # the document with fences blanked, for inline code
    i = 0
    while i < len(raw):
        m = _FENCE.match(raw[i])
        if not m:
            prose.append(raw[i])
            i += 1
            continue
        indent, marker, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        body_start = i + 1
        j = body_start
        while j < len(raw) and not raw[j].strip().startswith(marker):
            j += 1
        body = [line[indent:] if not line[:indent].strip() else line.lstrip() for line in raw[body_start:j]]
        if lang in SHELL_FENCES:
            for k, text in shell_commands(body):
                commands.append(DocCommand(doc, body_start + k + 1, text, "bash"))
        elif lang in FILE_FENCES:
            for path, text in split_files(body):
                files.append(DocFile(doc, body_start + 1, path, text))
        else:
            prompts = prompt_commands(body)
            for k, text, output in prompts:
                commands.append(DocCommand(doc, body_start + k + 1, text, "prompt", output))
            if not prompts:
                for k, line in enumerate(body):
                    if line == line.lstrip() and is_command(line):
                        commands.append(DocCommand(doc, body_start + k + 1, strip_comment(line), "fence"))
        prose.extend([""] * (j + 1 - i))
        i = j + 1
    text = "\n".join(prose)
    for offset, span in _inline_spans(text):
        if "\n\n" in span:
            continue
        one_line = " ".join(span.replace("\\|", "|").split())
        if is_command(one_line) and len(one_line.split()) > 1:
            commands.append(DocCommand(doc, text.count("\n", 0, offset) + 1, one_line, "inline"))
    commands.sort(key=lambda c: c.line)
    return commands, files


def extract_all() -> tuple[list[DocCommand], list[DocFile]]:
    commands, files = [], []
    for doc in DOCS:
        c, f = extract(doc)
        commands += c
        files += f
    return commands, files


# ---------------------------------------------------------------- running them


def make_checkout(dest: Path) -> Path:
    """A user's checkout: train.py and README.md copied (a run may read or write beside them),
    every other top-level entry of the repository, and the .venv `make` built, a symlink to this
    tree's. Files a user creates land in `dest`, never in this tree."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("train.py", "README.md"):
        (dest / name).write_bytes((ROOT / name).read_bytes())
    links = ("conf", "launcher", "pipeline", "models", "pipelaunch", "bench", "docs", "tests", "Makefile", "pyproject.toml", ".venv")
    for name in links:
        (dest / name).symlink_to(ROOT / name)
    return dest


def command_env(marker: str) -> dict[str, str]:
    """The user's shell after `source .venv/bin/activate`: the venv's bin first on PATH. No
    PYTHONPATH (commands that want one set it themselves); the hub offline (no network here)."""
    venv = ROOT / ".venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline",
               WANDB_SILENT="true", README_HARNESS_RUN=marker)
    return env


def marked_processes(marker: str) -> set[int]:
    """Processes whose environment carries `marker` (every descendant of a command run here,
    whatever session or group it moved to)."""
    needle = f"README_HARNESS_RUN={marker}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@dataclass
class Result:
    command: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    cpu_seconds: float  # user + system time of its processes (what others' load on the machine does not change)
    timed_out: bool
    left_behind: list[int]

    def tail(self, chars: int = 4000) -> str:
        return (f"$ {self.command}\nexit {self.returncode} after {self.seconds:.1f} s ({self.cpu_seconds:.1f} s CPU)\n"
                f"--- stdout\n{self.stdout[-chars:]}\n--- stderr\n{self.stderr[-chars:]}")


def run_bash(script: str, cwd: Path, timeout: float, prelude: str = "", grace_s: float = 10.0) -> Result:
    """`script` typed into bash in `cwd` (after `prelude`, e.g. a variable the doc set earlier),
    with a timeout; on timeout its process group is killed, and any process it left behind
    (found by a marker in its environment) is reported and killed."""
    marker = uuid.uuid4().hex
    start = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # files, not pipes: a process left behind holding the output open must not keep us waiting
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(["bash", "-c", prelude + script], cwd=cwd, env=command_env(marker), text=True,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            _kill(marked_processes(marker))
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    seconds = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    deadline = time.monotonic() + grace_s  # a rank's exit may trail the launcher's by a moment
    left = marked_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = marked_processes(marker)
    _kill(left)
    return Result(script, proc.returncode, stdout, stderr, seconds, cpu, timed_out, sorted(left))


def normalise(text: str) -> str:
    return " ".join(text.split())


def shown_pattern(shown: str) -> re.Pattern:
    """The output a doc shows as a pattern over the real output, whitespace normalised: `...` (or
    `[...]`) stands for any text and a duration (`9.9 s`, `8000ms`) for any duration; the rest is
    literal."""
    parts = re.split(r"(\[\.\.\.\]|\.\.\.|\d+(?:\.\d+)? ?(?:s|ms)\b)", normalise(shown))
    out = []
    for k, part in enumerate(parts):
        if k % 2 == 0:
            out.append(re.escape(part))
        elif part in ("...", "[...]"):
            out.append(".*?")
        else:
            out.append(r"\d+(?:\.\d+)? ?(?:s|ms)\b")
    return re.compile("".join(out), re.DOTALL)
