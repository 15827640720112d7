"""Build the API reference of hf-offload (HTML, from the docstrings) with pdoc.

Every public module of ``hf_offload`` and ``eval_harness`` gets a page (modules and packages whose name starts with
an underscore are left out); ``index.html`` lists them all and has a search box. The output is not committed.

    pip install -e ".[docs]"                    # pdoc
    python docs/build_api.py                    # writes docs/api/ (open docs/api/index.html)
    python docs/build_api.py --out /tmp/api
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("hf_offload", "eval_harness")


def public_modules(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Names of the public modules of ``packages``, each package before its modules.

    pdoc follows a package's ``__all__`` when it looks for submodules, and ``hf_offload``'s ``__all__`` names only
    the public classes and functions; so the modules are listed here and each is given to pdoc by name.

    Args:
        packages: importable package names.

    Returns:
        Dotted module names, e.g. ``["hf_offload", "hf_offload.attention", ...]``.
    """
    names = []
    for package in packages:
        names.append(package)
        module = importlib.import_module(package)
        for info in pkgutil.walk_packages(module.__path__, prefix=f"{package}."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                names.append(info.name)
    return names


def build(out: Path, modules: list[str] | None = None) -> list[Path]:
    """Render the API reference of ``modules`` into ``out`` (created if needed).

    Args:
        out: output folder; one ``.html`` page per module (``hf_offload/selectors.html`` for
            ``hf_offload.selectors``), plus ``index.html`` and ``search.js``.
        modules: dotted module names; default :func:`public_modules`.

    Returns:
        The written pages, one per module, in the order of ``modules``.
    """
    import pdoc.doc
    import pdoc.render

    import hf_offload
    from hf_offload import __version__

    for name in hf_offload.__all__:  # the package loads its public names on first use; pdoc reads its namespace
        getattr(hf_offload, name)

    modules = public_modules() if modules is None else modules
    pdoc.render.configure(docformat="google", footer_text=f"hf-offload {__version__}", search=True)
    docs = {name: pdoc.doc.Module.from_name(name) for name in modules}
    for name, module in docs.items():
        # pdoc's page of a package lists only the submodules named in its __all__; list every documented one.
        children = [child for child_name, child in docs.items() if child_name.rpartition(".")[0] == name]
        if children:
            module.__dict__["submodules"] = children  # the value of the cached property Module.submodules
    out.mkdir(parents=True, exist_ok=True)
    pages = []
    for name, module in docs.items():
        page = out / f"{name.replace('.', '/')}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(pdoc.render.html_module(module, docs), encoding="utf-8")
        pages.append(page)
    index = pdoc.render.html_index(docs)
    if index:
        (out / "index.html").write_text(index, encoding="utf-8")
    search = pdoc.render.search_index(docs)
    if search:
        (out / "search.js").write_text(search, encoding="utf-8")
    return pages


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python docs/build_api.py [--out DIR]``; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "api", help="output folder (default: docs/api)")
    args = parser.parse_args(argv)
    try:
        import pdoc  # noqa: F401
    except ImportError:
        print('pdoc is not installed: pip install -e ".[docs]"', file=sys.stderr)
        return 1
    pages = build(args.out)
    print(f"wrote {len(pages)} module pages to {args.out} (open {args.out / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # run from a checkout without installing the package
    sys.exit(main())
