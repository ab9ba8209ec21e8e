"""The notebooks as stored: executed in order, without errors, and checked by nbval.

`pytest --nbval notebooks` re-runs every notebook and compares each cell's output with the
stored one; these tests make sure there is something real to compare, and that the course keeps
its budgets and rules (the second half of this file): words, output lengths, source dumps, the
glossary link, gloo explained once, and every number in the text printed by an output.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
EXPECTED = ["00_launch", "01_ddp", "01b_memory", "02_collectives", "03_zero1", "04_zero2",
            "05_zero3", "06_fsdp2", "07_scaling", "08_activations", "09_past_one_node",
            "09b_built_and_saved",
            "10_bytes_to_seconds", "11_precision_and_optimizers",
            "12_meshes_and_scale", "12b_peak_without_building"]
IGNORE_MARKERS = ("NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION")


def code_cells(path: Path) -> list[dict]:
    cells = json.loads(path.read_text())["cells"]
    return [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]


def test_the_course_has_its_notebooks():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_code_cell_was_executed_in_order(path):
    counts = [c["execution_count"] for c in code_cells(path)]
    assert None not in counts, f"{path.name}: unexecuted code cells"
    assert counts == sorted(counts) and len(set(counts)) == len(counts), (
        f"{path.name}: outputs out of order {counts}")
    assert counts[0] == 1, f"{path.name}: not run from a fresh kernel"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_stored_errors(path):
    for cell in code_cells(path):
        for output in cell.get("outputs", []):
            assert output["output_type"] != "error", (path.name, "".join(cell["source"])[:80])
            if output.get("name") == "stderr":
                raise AssertionError(f"{path.name}: stderr output {''.join(output['text'])[:200]}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_most_outputs_are_compared(path):
    """Ignore-markers only where output truly varies: at most a third of the code cells."""
    cells = code_cells(path)
    ignored = [c for c in cells if any(m in "".join(c["source"]) for m in IGNORE_MARKERS)]
    assert len(ignored) * 3 <= len(cells), f"{path.name}: {len(ignored)} of {len(cells)} ignored"
    compared_outputs = sum(1 for c in cells if c not in ignored and c.get("outputs"))
    assert compared_outputs >= 3, f"{path.name}: too few compared outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_worker_function_is_defined_in_a_cell(path):
    """Spawned ranks cannot import a notebook's functions: workers live in the package."""
    for cell in code_cells(path):
        source = "".join(cell["source"])
        assert not any(line.startswith("def ") for line in source.splitlines()), (
            path.name, source[:80])


# ---- the course's budgets and rules (notes: COURSE.md, "Budgets", "Text follows outputs") -------
#
# Every check below reads the stored notebooks only (no kernel): each costs milliseconds. A
# failure names the notebook, the cell (0-based nbformat index, as Jupyter's cell order) and what
# is wrong, so that it can be fixed without re-reading the rule.

MAX_WORDS, MEAN_WORDS, MAX_CELL_WORDS, MAX_OUTPUT_LINES = 1800, 1500, 200, 25
WORD = re.compile(r"[A-Za-z0-9][\w'.-]*")  # a word, as the course's word count counts it
FENCED = re.compile(r"```.*?```", re.S)


def cells_of(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def words(text: str) -> int:
    return len(WORD.findall(FENCED.sub("", text)))


def markdown_words(path: Path) -> int:
    return sum(words(source(c)) for c in cells_of(path) if c["cell_type"] == "markdown")


def is_ignored(cell: dict) -> bool:
    return any(m in source(cell) for m in IGNORE_MARKERS)


def output_text(cell: dict) -> str:
    """What a reader of the stored notebook reads in a code cell's outputs: printed text, and
    the plain text (or HTML, tags dropped) of displayed results. Images are not text."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append("".join(out["text"]))
        elif out["output_type"] in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "text/html" in data:
                parts.append(re.sub(r"<[^>]*>", " ", "".join(data["text/html"])))
            elif "text/plain" in data and "image/png" not in data:
                parts.append("".join(data["text/plain"]))
    return "".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_markdown_budget(path):
    """At most MAX_WORDS words of markdown in a notebook, MAX_CELL_WORDS in a cell (one idea a
    cell)."""
    total = markdown_words(path)
    assert total <= MAX_WORDS, f"{path.stem}: {total:,} words of markdown (at most {MAX_WORDS:,})"
    long = [f"cell {i}: {words(source(c))} words" for i, c in enumerate(cells_of(path))
            if c["cell_type"] == "markdown" and words(source(c)) > MAX_CELL_WORDS]
    assert not long, f"{path.stem}: markdown cells over {MAX_CELL_WORDS} words: {long}"


def test_markdown_budget_on_average():
    counts = {p.stem: markdown_words(p) for p in NOTEBOOKS}
    mean = sum(counts.values()) / len(counts)
    assert mean <= MEAN_WORDS, (
        f"{mean:,.0f} words of markdown per notebook on average (at most {MEAN_WORDS:,}): "
        f"{counts}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_compared_outputs_are_short(path):
    """A compared output (no ignore marker) is read, so it fits on a screen."""
    long = [f"cell {i}: {len(output_text(c).splitlines())} lines"
            for i, c in enumerate(cells_of(path)) if c["cell_type"] == "code"
            and not is_ignored(c) and len(output_text(c).splitlines()) > MAX_OUTPUT_LINES]
    assert not long, f"{path.stem}: compared outputs over {MAX_OUTPUT_LINES} lines: {long}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_cell_links_the_glossary(path):
    first = cells_of(path)[0]
    assert first["cell_type"] == "markdown" and "](glossary.md" in source(first), (
        f"{path.stem}: cell 0 does not link the glossary ([glossary](glossary.md))")


# ---- gloo, explained once ------------------------------------------------------------------------
# A cell "explains gloo" when two or more of its sentences are about gloo or its substitutions
# (what it runs under a collective, and what its wire carries), one of them naming gloo. One
# sentence that names gloo and links to notebook 02 is a pointer, not an explanation.
GLOO_TERMS = re.compile(r"gloo|send/recv pairs?|binomial|\bN broadcasts|all-reduce of a copy|"
                        r"/proc/self/io|message headers", re.I)
GLOO_NOTEBOOKS_AT_MOST = 2
GLOO_SECTION = "What gloo runs, and what the wire counts"


def sentences(text: str) -> list[str]:
    """Sentences, where list items, table rows and headings also end one."""
    blocks = re.split(r"\n\s*\n|\n(?=\s*(?:[-*|#]|\d+\.\s))", FENCED.sub("", text))
    return [s for b in blocks for s in re.split(r"(?<=[.!?])\s+", b.replace("\n", " "))
            if s.strip()]


def explains_gloo(text: str) -> bool:
    about = [s for s in sentences(text) if GLOO_TERMS.search(s)]
    return len(about) >= 2 and any("gloo" in s.lower() for s in about)


def test_gloo_is_explained_in_at_most_two_notebooks():
    explaining = {p.stem: [i for i, c in enumerate(cells_of(p)) if c["cell_type"] == "markdown"
                           and explains_gloo(source(c))] for p in NOTEBOOKS}
    explaining = {k: v for k, v in explaining.items() if v}
    assert len(explaining) <= GLOO_NOTEBOOKS_AT_MOST, (
        f"gloo is explained in {len(explaining)} notebooks (at most {GLOO_NOTEBOOKS_AT_MOST}; "
        f"the others link notebook 02's section '{GLOO_SECTION}' in one sentence): "
        + "; ".join(f"{k} cells {v}" for k, v in explaining.items()))
    collectives = [p for p in NOTEBOOKS if p.stem.startswith("02_")]
    assert all(any(GLOO_SECTION in source(c) for c in cells_of(p)) for p in collectives), (
        f"notebook 02 has no section '{GLOO_SECTION}'")


# ---- source dumps --------------------------------------------------------------------------------
# inspect.getsource only of the lesson's own code: per notebook, the files (under zerolab/) it may
# print from, or "file:name" for one object of a file. Never plumbing (harness, launcher, the
# lesson modules' launch entries), and never an exercise's answer (ANSWERS), in any notebook.
LESSON_SOURCES = {
    "00": ("lessons/n00_launch.py",),  # the ranks' first functions are the lesson
    "01": ("ddp.py",),
    "01b": ("memory.py",),
    "02": ("comm.py", "lessons/n02_collectives.py:pass_right"),
    "03": ("zero1.py", "sharding.py"),
    "04": ("zero2.py",),
    "05": ("zero3.py", "units.py"),
    "06": ("bench/baselines.py", "zero3.py"),
    "07": (),
    "08": ("models.py", "activations.py", "zero3.py"),
    "09": ("hsdp.py", "zeropp.py", "zero3.py", "checkpoint.py", "parts/mesh.py",
           "parts/materialize.py"),
    "10": ("cost.py",),
    "12": ("tp.py",),
}
ANSWERS = {  # object -> the exercise whose answer it is
    "zerolab.theory.model_state_memory": "1.1",
    "zerolab.memory.distinct_bytes": "1.2",
    "zerolab.ddp.DDP": "1.3",
    "zerolab.lessons.n02_collectives.ring_all_gather": "2.2",
    "zerolab.sharding.flatten": "3.1",
    "zerolab.sharding.shard": "3.1",
    "zerolab.sharding.unflatten": "3.2",
    "zerolab.zero2.ZeRO2._reduce": "4.1",
    "zerolab.zero2.ZeRO2._accumulate": "4.1",
    "zerolab.zero2.ZeRO2": "4.2",
    "zerolab.zero3.ZeRO3.unshard": "5.1",
    "zerolab.zero3.ZeRO3.reshard": "5.2",
    "zerolab.zero3.ZeRO3": "5.3",
    "zerolab.parts.quantize.quantize_int8": "9.2",
    "zerolab.parts.quantize.dequantize_int8": "9.2",
}
PACKAGE = Path(__file__).resolve().parent.parent / "zerolab"


def imported_names(cells: list[dict]) -> dict[str, str]:
    """Each name the notebook's imports bind -> the dotted path it stands for."""
    names = {}
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse(source(cell))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    names[(a.asname or a.name).split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def dotted(node: ast.AST, names: dict[str, str], loops: dict[str, list]) -> list[str] | None:
    """The dotted paths an expression may stand for (a loop variable: each of its values)."""
    if isinstance(node, ast.Name):
        if node.id in loops:
            out = []
            for value in loops[node.id]:
                paths = (dotted(value, names, loops) if isinstance(value, ast.AST) else None)
                if paths is None:
                    return None
                out += paths
            return out
        return [names[node.id]] if node.id in names else None
    if isinstance(node, ast.Attribute):
        base = dotted(node.value, names, loops)
        return None if base is None else [f"{b}.{node.attr}" for b in base]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) == 2):
        base, attr = dotted(node.args[0], names, loops), node.args[1]
        if base is None:
            return None
        if isinstance(attr, ast.Constant):
            return [f"{b}.{attr.value}" for b in base]
        if isinstance(attr, ast.Name) and attr.id in loops and all(
                isinstance(v, ast.Constant) for v in loops[attr.id]):
            return [f"{b}.{v.value}" for b in base for v in loops[attr.id]]
    return None


def resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def getsource_targets(path: Path) -> list[tuple[int, str | None]]:
    """(cell index, dotted path or None where the test cannot tell) of every getsource call."""
    cells = cells_of(path)
    names, found = imported_names(cells), []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code" or "getsource" not in source(cell):
            continue
        tree = ast.parse(source(cell))
        loops = {}
        for node in ast.walk(tree):
            if (isinstance(node, ast.For) and isinstance(node.target, ast.Name)
                    and isinstance(node.iter, (ast.Tuple, ast.List))):
                loops[node.target.id] = list(node.iter.elts)
        for node in ast.walk(tree):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and (getattr(func, "attr", None) == "getsource"
                                               or getattr(func, "id", None) == "getsource"):
                paths = dotted(node.args[0], names, loops) if node.args else None
                found += [(i, p) for p in paths] if paths else [(i, None)]
    return found


def qualified(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}" if hasattr(obj, "__qualname__") else (
        obj.__name__)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_source_dumps_are_the_lessons_own_code(path):
    allowed = LESSON_SOURCES.get(path.stem.split("_")[0], ())
    wrong = []
    for i, target in getsource_targets(path):
        if target is None:
            wrong.append(f"cell {i}: getsource of something the test cannot name (write "
                         f"getsource(module.name), or loop over a tuple of them)")
            continue
        obj = inspect.unwrap(resolve(target))
        name = qualified(obj)
        if name in ANSWERS:
            wrong.append(f"cell {i}: prints {name}, exercise {ANSWERS[name]}'s answer")
            continue
        file = Path(inspect.getsourcefile(obj)).resolve()
        where = file.relative_to(PACKAGE).as_posix() if file.is_relative_to(PACKAGE) else str(file)
        if where not in allowed and f"{where}:{obj.__qualname__}" not in allowed:
            wrong.append(f"cell {i}: prints {name} from {where}, not this lesson's own code "
                         f"({', '.join(allowed) or 'none'})")
    assert not wrong, f"{path.stem}: " + "; ".join(wrong)


# ---- text follows outputs ------------------------------------------------------------------------
# Every number a markdown cell states is printed, within the text's rounding, by a compared code
# cell's output in the same section (from one `## ` heading to the next), unless it is
#   in $math$ (a formula), in `code` (a constant the code sets, a name), in a sentence holding a
#   markdown link to a cited source (http...), or a reference: "notebook 03", "section 2",
#   "§5.2", "Figure 1", "Table 1", "Exercise 3.1", "rank 0", "step 2", a heading's own number, a
#   list enumerator, a year, a version ("torch 2.13"), a link's text to another notebook.
# A number glued to a letter is part of a name or a symbol (ZeRO-1, fp32, GPT-2, 7B, 16Ψ, 10⁹),
# not a quantity; "1.5x" is a quantity. Outputs of cells with an ignore marker do not count:
# they vary from run to run, and nothing would notice the text going stale.
MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$", re.S)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*)\)")
REFERENCE = re.compile(
    r"(?:\b(?:notebooks?|sections?|figures?|fig\.|tables?|exercises?|items?|cells?|steps?|"
    r"ranks?|chunks?|buckets?|blocks?|parts?|stages?|phases?|levels?|nodes?|units?|"
    r"micro-batch(?:es)?|lines?|rows?|columns?|questions?|chapters?|(?:torch|pytorch|python|"
    r"cuda|nccl|gloo|linux|jupyterlab))\s+|§\s*)"
    r"\d+(?:\.\d+)*[a-z]?(?:\s*(?:,|and|or|to|-|–|…|\.\.\.)\s*\d+(?:\.\d+)*[a-z]?)*", re.I)
HEADING_NUMBER = re.compile(r"^(\s*#+\s*)\d+(?:\.\d+)*\.?", re.M)
ENUMERATOR = re.compile(r"^(\s*)\d+\.(?=\s)", re.M)
EXERCISE_ID = re.compile(r"\*\*\d+\.\d+\b")  # **3.1** or **3.1 `flat_shard`**: an exercise's id
YEAR = re.compile(r"(?<![\d,.])(?:19\d\d|20[0-3]\d)(?![\d,.]\d)")
NUMBER = re.compile(r"(?<![\w.,/^])(?<![A-Za-z]-)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?"
                    r"(?=[xX×]\b|[xX×]$|[^\w]|$)")
ANY_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")


def stated_numbers(text: str) -> list[tuple[str, float, int, str]]:
    """(as written, value, decimals, where) of each number the markdown states as a quantity."""
    text = HEADING_NUMBER.sub(r"\1", FENCED.sub(" ", text))
    text = ENUMERATOR.sub(r"\1", EXERCISE_ID.sub(" ", text))
    text = CODE.sub(" ", MATH.sub(" ", text)).replace("**", "")
    found = []
    for sentence in sentences(text):
        links = LINK.findall(sentence)
        if any(target.startswith(("http://", "https://")) for _, target in links):
            continue  # a cited source's figures: (d)
        sentence = LINK.sub(" ", sentence)  # another notebook's name, the glossary: references
        sentence = YEAR.sub(" ", REFERENCE.sub(" ", sentence))
        for m in NUMBER.finditer(sentence):
            whole, frac = m.group(1), m.group(2) or ""
            where = " ".join(sentence[max(0, m.start() - 40):m.end() + 30].split())
            found.append((whole + frac, float(whole.replace(",", "") + frac),
                          len(frac) - 1 if frac else 0, where))
    return found


def printed_numbers(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in ANY_NUMBER.findall(text)]


def matches(value: float, decimals: int, printed: list[float]) -> bool:
    tolerance = 0.5 * 10 ** -decimals + 1e-9
    return any(abs(p - value) <= tolerance for p in printed)


def sections_of(path: Path) -> list[dict]:
    """Sections: a heading, its markdown (cell index, text) and the numbers its compared outputs
    print. A markdown cell that holds a `## ` heading is cut there."""
    out = [{"heading": "(before the first ## heading)", "markdown": [], "printed": []}]
    for i, cell in enumerate(cells_of(path)):
        if cell["cell_type"] == "markdown":
            for part in re.split(r"(?m)^(?=## )", source(cell)):
                if part.startswith("## "):
                    out.append({"heading": part.splitlines()[0], "markdown": [],
                                "printed": []})
                if part.strip():
                    out[-1]["markdown"].append((i, part))
        elif not is_ignored(cell):
            out[-1]["printed"] += printed_numbers(output_text(cell))
    return out


def unprinted_numbers(path: Path) -> list[str]:
    wrong = []
    for section in sections_of(path):
        for i, text in section["markdown"]:
            for written, value, decimals, where in stated_numbers(text):
                if not matches(value, decimals, section["printed"]):
                    wrong.append(f"cell {i}, section '{section['heading']}': {written} "
                                 f"(\"...{where}...\")")
    return wrong


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_text_follows_outputs(path):
    wrong = unprinted_numbers(path)
    assert not wrong, (
        f"{path.stem}: {len(wrong)} numbers in the markdown that no compared output of their "
        f"section prints (within the text's rounding), and that are not marked as $math$, "
        f"`code`, a cited source's figure or a reference:\n  " + "\n  ".join(wrong))


def test_the_number_check_reads_the_rules_right():
    """The checker itself, on small texts: what counts as a stated number, and what matches."""
    stated = [w for w, _, _, _ in stated_numbers(
        "## 4. Run it\n1. Rank 0 sends 3.1 ms, 1.5x and 28,032 bytes on 4 ranks (notebook 03, "
        "§5.2, Exercise 3.1, torch 2.13, 2020). $16\\Psi$ and `N = 4` and ZeRO-1, fp32, 7B, "
        "16Ψ. [The paper](https://arxiv.org/abs/1910.02054) says 120 GB.\n- **9.2 `f`**: ok")]
    assert stated == ["3.1", "1.5", "28,032", "4"]
    assert matches(3.1, 1, [3.14]) and matches(1.5, 1, [1.497]) and matches(9, 0, [8.6])
    assert not matches(3.1, 1, [3.2]) and not matches(448624, 0, [448512])
    assert explains_gloo("gloo has no reduce-scatter. It runs N broadcasts instead.")
    assert not explains_gloo("On gloo, see [notebook 02](02_collectives.ipynb). Then go on.")
