"""The shape of the product code: its size, longest functions and widest signatures.

    python .ci/code_shape.py            # api/, service/, trainers/ of this checkout
    python .ci/code_shape.py --top 15 --root /path/to/another/checkout

A function's length is its lines from `def` to its last line (docstring and comments included);
its width is its parameters, `self` and `cls` left out. Reading only: nothing is imported or run.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("api", "service", "trainers")


@dataclass(frozen=True)
class Function:
    where: str
    lines: int
    params: int


def functions(root: Path) -> tuple[list[Function], int]:
    found: list[Function] = []
    total_lines = 0
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text()
            total_lines += len(source.splitlines())
            for node in ast.walk(ast.parse(source)):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
                params = len([name for name in names if name not in ("self", "cls")])
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append(Function(f"{path.relative_to(root)}:{node.name}", lines, params))
    return found, total_lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--top", type=int, default=10)
    options = parser.parse_args()
    found, total_lines = functions(options.root)
    print(f"{total_lines} lines in {', '.join(PACKAGES)}; {len(found)} functions")
    print(
        f"functions over 50 lines: {sum(f.lines > 50 for f in found)}; over 7 parameters: "
        f"{sum(f.params > 7 for f in found)}"
    )
    print("\nlongest functions (lines)")
    for function in sorted(found, key=lambda f: (-f.lines, f.where))[: options.top]:
        print(f"  {function.lines:4d}  {function.where}")
    print("\nwidest signatures (parameters)")
    for function in sorted(found, key=lambda f: (-f.params, f.where))[: options.top]:
        print(f"  {function.params:4d}  {function.where}")


if __name__ == "__main__":
    main()
