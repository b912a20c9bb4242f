"""The package's import rules, read from its source (``ast``, nothing is imported):

1. **Layers.** Imports point down the layer order that ``docs/design.md`` encodes (its
   ``layers`` block, one layer a line, bottom up) and README draws: a module imports its own
   entry and the layers below it, never a layer above, never a peer on its own line.
   Every module of ``graphstash/`` and ``raw_kernels/`` belongs to an entry.
2. **Private modules.** A module whose dotted path has a ``_part`` is private to the package
   that holds ``_part``: ``graphstash._kernels`` (the sanctioned private layer, as
   ``_saved``, ``_checks``, ``_layout``, ``_mode``) may be imported anywhere in
   ``graphstash``; ``graphstash.moe._dispatch`` only inside ``graphstash.moe``.
3. **Private names.** No ``_name`` defined in another module is imported
   (``from .experts import _forward``) or read off an imported module
   (``_kernels._import_cupy()``); dunder names (``__version__``) are public.
4. **Tools use the public API.** The tools (``graphstash/tools/``) import no private module
   of the library.
5. **No import circles.** No modules import each other in a loop (an import inside a function
   counts: it only defers the loop), but for the entries of :data:`ALLOWED_CIRCLES`, each
   with the reason it is still there.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("graphstash", "raw_kernels")
TOOLS = ("graphstash/tools/",)


def layers_block(design: str) -> list[list[str]]:
    """The entries of the ``layers`` block of docs/design.md, one list per layer, bottom up."""
    block = re.search(r"```layers\n(.*?)```", design, re.DOTALL)
    assert block, "docs/design.md has no ```layers block"
    return [line.split("#")[0].split() for line in block.group(1).splitlines()
            if line.split("#")[0].strip()]


LAYERS = layers_block((ROOT / "docs" / "design.md").read_text())


def layer_of(path: str, layers: list[list[str]]) -> tuple[int, str] | None:
    """``(layer index, entry)`` of a repository path: the longest entry that is the file
    itself or a folder holding it; None if no entry does."""
    best = None
    for index, entries in enumerate(layers):
        for entry in entries:
            if path == entry or (entry.endswith("/") and path.startswith(entry)):
                if best is None or len(entry) > len(best[1]):
                    best = (index, entry)
    return best


@dataclass(frozen=True)
class Module:
    name: str           # dotted: graphstash.moe.mlp
    path: str           # graphstash/moe/mlp.py
    package: str        # what relative imports start from
    source: str | None = None     # the text, when it is not the file's (the rules' own test)

    @property
    def tree(self) -> ast.Module:
        return ast.parse(self.source if self.source is not None else (ROOT / self.path).read_text())


def modules() -> list[Module]:
    found = []
    for top in PACKAGES:
        for file in sorted((ROOT / top).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            parts = rel[:-3].split("/")
            if parts[-1] == "__init__":
                name = ".".join(parts[:-1])
                found.append(Module(name, rel, name))
            else:
                found.append(Module(".".join(parts), rel, ".".join(parts[:-1])))
    return found


def module_path(name: str) -> str | None:
    """The repository path of a dotted module name of the packages, or None."""
    base = ROOT / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(ROOT).as_posix()
    return None


def private_owner(name: str) -> str | None:
    """The package a module is private to (the parent of its first ``_part``), or None."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def is_private_name(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imports(module: Module):
    """``(target module, imported name or None, line)`` for every import of ``module`` in
    the packages; plus a map alias -> module for the names bound to modules."""
    found, aliases = [], {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    found.append((alias.name, None, node.lineno))
                    aliases[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if module_path(sub) is not None:
                    found.append((sub, None, node.lineno))
                    aliases[alias.asname or alias.name] = sub
                else:
                    found.append((source, alias.name, node.lineno))
    return found, aliases


def violations(mods: list[Module] | None = None, layers: list[list[str]] = LAYERS) -> set[str]:
    out = set()
    for module in modules() if mods is None else mods:
        where = layer_of(module.path, layers)
        if where is None:
            out.add(f"{module.path}: in no layer of docs/design.md")
            continue
        found, aliases = imports(module)
        is_tool = module.path.startswith(TOOLS)
        for target, name, _ in found:
            target_path = module_path(target)
            if target_path is None:
                continue
            there = layer_of(target_path, layers)
            if there is not None and target != module.name:
                if there[0] > where[0]:
                    out.add(f"{module.path}: imports {target}, a layer above ({there[1]} over "
                            f"{where[1]})")
                elif there[0] == where[0] and there[1] != where[1]:
                    out.add(f"{module.path}: imports {target}, a peer of {where[1]} ({there[1]})")
            owner = private_owner(target)
            if owner is not None and not (module.name == owner
                                          or module.name.startswith(owner + ".")):
                out.add(f"{module.path}: imports {target}, private to {owner}")
            if (is_tool and owner is not None and not target_path.startswith(TOOLS)):
                out.add(f"{module.path}: tool imports private module {target}")
            if name is not None and is_private_name(name):
                out.add(f"{module.path}: imports private name {name} from {target}")
        for node in ast.walk(module.tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and is_private_name(node.attr)
                    and module_path(f"{aliases[node.value.id]}.{node.attr}") is None):
                out.add(f"{module.path}: reads private name {node.attr} of "
                        f"{aliases[node.value.id]}")
    return out


def import_graph(mods: list[Module] | None = None) -> dict[str, set[str]]:
    """``{module: the package modules it imports}``, imports inside functions included."""
    mods = modules() if mods is None else mods
    names = {m.name for m in mods}
    graph = {}
    for module in mods:
        found, _ = imports(module)
        graph[module.name] = {t for t, _, _ in found if t in names and t != module.name}
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset]:
    """The sets of modules that import each other in a loop (the strongly connected
    components of ``graph`` with more than one module; Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), set()
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# Import circles that are known and allowed for now. Each entry says why it is there and when
# it goes; a circle not listed fails the test, and so does an entry whose circle is gone.
ALLOWED_CIRCLES: set[frozenset[str]] = set()


@pytest.fixture(scope="module")
def found() -> set[str]:
    return violations()


def test_no_violations(found):
    assert sorted(found) == [], "import rules broken (see this file's docstring):\n" + \
        "\n".join(sorted(found))


def test_no_import_circles_but_the_allowed_ones():
    got = circles(import_graph())
    new = sorted(sorted(c) for c in got - ALLOWED_CIRCLES)
    gone = sorted(sorted(c) for c in ALLOWED_CIRCLES - got)
    assert new == [], f"modules that import each other in a loop: {new}"
    assert gone == [], f"allowed circles that no longer exist (remove their entries): {gone}"


def test_the_circle_check_finds_a_loop_through_a_function_level_import():
    """Modules written for the purpose: ``a`` imports ``b`` at module level, ``b`` imports
    ``a`` inside a function; and a third that only imports ``a``."""
    sample = [Module("graphstash._circle_a", "graphstash/_circle_a.py", "graphstash",
                     source="import graphstash._circle_b\n"),
              Module("graphstash._circle_b", "graphstash/_circle_b.py", "graphstash",
                     source="def f():\n    from ._circle_a import x\n    return x\n"),
              Module("graphstash._circle_c", "graphstash/_circle_c.py", "graphstash",
                     source="from ._circle_a import y\n")]
    graph = {"graphstash._circle_a": {"graphstash._circle_b"},
             "graphstash._circle_b": {"graphstash._circle_a"},
             "graphstash._circle_c": {"graphstash._circle_a"}}
    names = {m.name for m in sample}
    got = {}
    for module in sample:
        found, _ = imports(module)
        got[module.name] = {t for t, _, _ in found if t in names}
    assert got == graph
    assert circles(graph) == {frozenset({"graphstash._circle_a", "graphstash._circle_b"})}


def test_readme_draws_the_layers_of_the_design():
    """README's layer diagram names the entries of the ``layers`` block in the same order."""
    readme = (ROOT / "README.md").read_text()
    diagram = readme.split("## Concepts", 1)[1].split("```", 2)[1]
    drawn, folder = [], ""
    for line in diagram.splitlines():
        m = re.match(r"^( *)([\w./]+(?:, [\w./]+)*)(?:\s|$)", line)
        if not m:
            continue
        names = m.group(2).split(", ")
        if not m.group(1):
            folder = names[0] if names[0] == "graphstash/" else ""
        for name in names:
            path = name if not m.group(1) else folder + name
            drawn.append(path)
    order = [entry for layer in LAYERS for entry in layer]
    assert [p for p in drawn if p in order] == order


def test_the_rules_catch_what_they_should():
    """Each rule on a module written for the purpose, placed below everything (the checks
    can fail)."""
    sample = Module("graphstash._import_rules_sample", "graphstash/_import_rules_sample.py",
                    "graphstash", source="from .moe._dispatch import dispatch\n"
                                         "from .moe.experts import _forward\n"
                                         "from . import graph\n"
                                         "from . import _kernels\n"
                                         "x = _kernels._import_cupy\n")
    got = violations([sample], [[sample.path]] + LAYERS)
    assert got == {
        "graphstash/_import_rules_sample.py: imports graphstash.moe._dispatch, private to "
        "graphstash.moe",
        "graphstash/_import_rules_sample.py: imports graphstash.moe._dispatch, a layer above "
        "(graphstash/moe/ over graphstash/_import_rules_sample.py)",
        "graphstash/_import_rules_sample.py: imports graphstash.moe.experts, a layer above "
        "(graphstash/moe/ over graphstash/_import_rules_sample.py)",
        "graphstash/_import_rules_sample.py: imports private name _forward from "
        "graphstash.moe.experts",
        "graphstash/_import_rules_sample.py: imports graphstash.graph, a layer above "
        "(graphstash/graph/ over graphstash/_import_rules_sample.py)",
        "graphstash/_import_rules_sample.py: imports graphstash._kernels, a layer above "
        "(graphstash/_kernels/ over graphstash/_import_rules_sample.py)",
        "graphstash/_import_rules_sample.py: reads private name _import_cupy of "
        "graphstash._kernels",
    }


# ---- import time: nothing heavy is imported with graphstash (NOTE [import time]) ----------------
def test_import_graphstash_leaves_heavy_modules_out():
    """In a fresh process, ``import graphstash`` imports neither ``torch._dynamo`` nor CuPy nor
    Triton (NOTE [import time] in graphstash/__init__.py); naming a lazily imported name
    imports it."""
    import json
    import subprocess
    import sys

    code = ("import json, sys, graphstash\n"
            "before = [m for m in ('torch._dynamo', 'cupy', 'triton') if m in sys.modules]\n"
            "graphstash.StashConfig, graphstash.moe.budget_rows\n"
            "from graphstash import stash_activations\n"
            "print(json.dumps([before, 'graphstash.stash.context' in sys.modules,\n"
            "                  'graphstash.moe.experts' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=ROOT).stdout
    before, stash_loaded, moe_loaded = json.loads(out.strip().splitlines()[-1])
    assert before == [], f"import graphstash imported {before}"
    assert stash_loaded and moe_loaded


def test_constant_results_are_marked_as_torch_marks_them():
    """``graphstash._untraced.constant_result`` sets what ``torch.compiler.
    assume_constant_result`` sets (NOTE [constant results without dynamo]), and the kernels'
    availability carries it."""
    from graphstash import _kernels
    from graphstash._untraced import CONSTANT_RESULT_ATTRIBUTE, constant_result

    def by_torch():
        return 1

    def by_us():
        return 1

    torch_marks = dict(vars(torch.compiler.assume_constant_result(by_torch)))
    assert torch_marks == dict(vars(constant_result(by_us))) == {CONSTANT_RESULT_ATTRIBUTE: True}
    assert getattr(_kernels.availability, CONSTANT_RESULT_ATTRIBUTE) is True
