"""Import cycles of the wgpu_train package, from grimp's import graph (every import, those inside functions
too): the strongly connected groups of modules, and those of packages (a module counted in its package).

    python tools/import_cycles.py            # the groups, largest first, and their counts
"""
from __future__ import annotations

import sys

import grimp


def strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's groups with more than one node, largest first."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(root: str):
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for n in nodes:
        if n not in index:
            visit(n)
    return sorted(groups, key=lambda g: (-len(g), g))


def main() -> int:
    graph = grimp.build_graph("wgpu_train")
    modules = sorted(m for m in graph.modules if not graph.is_module_squashed(m))
    module_edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i != m} for m in modules}
    packages = {m: (m if any(o.startswith(m + ".") for o in modules) else m.rpartition(".")[0]) for m in modules}
    package_edges: dict[str, set[str]] = {}
    for m, targets in module_edges.items():
        for t in targets:
            a, b = packages[m], packages[t]
            if a != b and not b.startswith(a + ".") and not a.startswith(b + "."):   # a package and its parent
                package_edges.setdefault(a, set()).add(b)
    for title, nodes, edges in (("module", modules, module_edges),
                                ("package", sorted(set(packages.values())), package_edges)):
        groups = strongly_connected(nodes, edges)
        print(f"{title} cycles: {len(groups)} (largest spans {max(map(len, groups), default=0)} {title}s)")
        for g in groups:
            print(f"  {len(g)}: {', '.join(g)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
