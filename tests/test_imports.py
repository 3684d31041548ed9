"""No import circle among the repository's own modules (read with ast, not by importing)."""
import ast

from conftest import ROOT

PACKAGES = ("common", "estimate", "tour", "steps")


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_at_the_top(path, modules):
    """The repository modules `path` imports when it is imported (not inside functions):
    `from package import submodule` is the submodule (a package's own __init__ runs first
    anyway, as for any import below it)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
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


def test_the_check_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
