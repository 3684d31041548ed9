"""No import circle among the repository's own modules (read with ast, not by importing), and no
module a script on a preset does not need (imported, in a new interpreter)."""
import ast
import json
import subprocess
import sys

from conftest import ROOT

PACKAGES = ("common", "estimate", "tour", "steps")


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# packages whose modules' imports inside functions count too: a module that imports another
# only when called still needs it, and the estimator's jobs stay one a module, none calling back
EVERY_IMPORT = ("estimate", "common")


def imports_at_the_top(path, modules):
    """The repository modules `path` imports when it is imported (not inside functions, but for
    a module of EVERY_IMPORT: anywhere): `from package import submodule` is the submodule (a
    package's own __init__ runs first anyway, as for any import below it)."""
    found = set()
    tree = ast.parse(path.read_text())
    everywhere = module_name(path).split(".")[0] in EVERY_IMPORT
    for node in ast.walk(tree) if everywhere else tree.body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(modules)
            found.update(submodules or {node.module})
    return {name for name in found if name.split(".")[0] in PACKAGES}


def graph():
    paths = [ROOT / "steps.py", *[path for package in PACKAGES[:3]
                                  for path in (ROOT / package).rglob("*.py")]]
    modules = {module_name(path): path for path in paths}
    return {name: {other for other in imports_at_the_top(path, modules)
                   if other in modules and other != name and not name.startswith(other + ".")}
            for name, path in modules.items()}


def cycle(edges):
    """A list of modules that import each other in a circle, or None."""
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for other in sorted(edges[node]):
            if state.get(other) == "open":
                return trail[trail.index(other):] + [other] if other in trail else [node, other]
            if other not in state:
                found = visit(other, trail + [other])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_no_module_imports_itself_through_others():
    assert cycle(graph()) is None


def test_nothing_in_common_imports_the_estimator_but_the_dispatch_of_its_flags():
    """A script's copy needs common/ alone: --estimate and --check-estimate are dispatched by
    common/launch.py, which imports the estimator inside the call that asks for it, never as it
    is imported (parse_args refuses both flags where estimate/ is missing)."""
    importing = {name: sorted(other for other in imported if other.startswith("estimate"))
                 for name, imported in graph().items()
                 if name.startswith("common") and any(other.startswith("estimate") for other in imported)}
    assert importing == {"common.launch": ["estimate", "estimate.check"]}
    top = ast.parse((ROOT / "common" / "launch.py").read_text()).body
    assert not [node for node in top if isinstance(node, (ast.Import, ast.ImportFrom))]


# The searches (--gpu-memory's fit search, the stack's walk and chain) reach the rest of the
# estimator through the question they ask and the output they print through, nothing else: what
# they may ask is the question's to answer, and how is theirs to ignore
SEARCHES = ("estimate.search", "estimate.stack")
SEARCHES_ASK = ("estimate.question", "estimate.output")


def beyond_the_question(edges):
    """{module of the searches: [the estimator's modules it imports beyond its room, the question
    and the output]}, for the modules that import any."""
    def searching(name):
        return any(name == room or name.startswith(room + ".") for room in SEARCHES)
    found = {name: sorted(other for other in imported if other.split(".")[0] == "estimate"
                          and not searching(other) and other not in SEARCHES_ASK)
             for name, imported in edges.items() if searching(name)}
    return {name: others for name, others in found.items() if others}


def test_the_searches_reach_the_estimator_through_the_question_and_the_output_alone():
    assert beyond_the_question(graph()) == {}


def test_the_check_names_a_search_that_reaches_past_the_question():
    edges = {"estimate.search.fit": {"estimate.question", "estimate.predict", "estimate.search.grid"},
             "estimate.stack": {"estimate.output"}, "estimate.command": {"estimate.predict"}}
    assert beyond_the_question(edges) == {"estimate.search.fit": ["estimate.predict"]}


def test_the_check_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


# What a script on a preset must not import: --model's module and transformers' tables of every
# architecture (modeling_auto; transformers imports it itself once a model class is loaded)
MODEL_LOOKUP = ("common.any_model", "transformers.models.auto.modeling_auto")
IMPORTED_ON_A_PRESET = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
imported = {name: name in sys.modules for name in sys.argv[2:]}
from common.model import model_class
from common.presets import CAUSAL_LM, PRESETS, for_task
for preset in PRESETS.values():
    for task in ["classification", *(["causal-lm"] if preset.name in CAUSAL_LM else [])]:
        model_class(for_task(preset, task))
print(json.dumps({"imported": imported, "to_train": "common.any_model" in sys.modules}))
"""


def imported_on_a_preset(script):
    """{module: imported by importing `script`} for MODEL_LOOKUP, and whether finding the model
    class of every preset and task imported common.any_model (in a new interpreter)."""
    done = subprocess.run([sys.executable, "-c", IMPORTED_ON_A_PRESET, script, *MODEL_LOOKUP],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_script_on_a_preset_imports_no_table_of_every_architecture():
    found = imported_on_a_preset("04_grad_accum")
    assert found == {"imported": {name: False for name in MODEL_LOOKUP}, "to_train": False}


def test_the_import_check_sees_the_model_lookup():
    found = imported_on_a_preset("common.any_model")  # what a script that imported it would see
    assert found["imported"] == {name: True for name in MODEL_LOOKUP}
