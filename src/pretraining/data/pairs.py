"""(docstring, code) pairs from Python source, for contrastive training: `docstring_pairs` turns each
documented function, method or class into (the first paragraph of its docstring, its code without the
docstring), as CodeSearchNet does."""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath

from pretraining.data.documents import Document

MIN_DOCSTRING_WORDS = 3
TEST_DIRECTORIES = frozenset({"test", "tests", "idle_test"})


@dataclass
class PairCounts:
    """What `docstring_pairs` found, for the manifest's provenance."""

    files: int = 0
    test_files: int = 0
    unparsable_files: int = 0
    documented: int = 0
    trivial_docstrings: int = 0  # fewer than MIN_DOCSTRING_WORDS words, or just the signature
    excluded_names: int = 0  # dunders and tests
    pairs: int = 0


def docstring_pairs(documents: Iterable[Document], counts: PairCounts | None = None) -> Iterator[Document]:
    """(docstring, code) pairs of the documented functions, methods and classes of Python files.

    The query is the docstring's first paragraph (at least MIN_DOCSTRING_WORDS words, not
    just the signature); the passage is the definition's source with every docstring in it
    removed (its own and those of nested definitions, which are other pairs' queries), or
    the task would be string matching. As in CodeSearchNet, dunder methods and tests (by
    name or by directory) are left out. Files that are not Python (or not UTF-8) yield nothing.
    """
    counts = counts if counts is not None else PairCounts()
    for document in documents:
        if document.texts is None or not document.source_id.endswith(".py"):
            continue
        counts.files += 1
        if TEST_DIRECTORIES.intersection(PurePosixPath(document.source_id.split(":", 1)[-1]).parts):
            counts.test_files += 1
            continue
        # ast counts \r and \r\n as line ends; after this, so does splitting on \n alone.
        source = document.texts["txt"].replace("\r\n", "\n").replace("\r", "\n")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            counts.unparsable_files += 1
            continue
        code = SourceBytes(source)
        for qualname, kind, node in definitions(tree):
            docstring = ast.get_docstring(node)
            if not docstring:
                continue
            counts.documented += 1
            name = qualname.rsplit(".", 1)[-1]
            if (name.startswith("__") and name.endswith("__")) or name.lower().startswith("test"):
                counts.excluded_names += 1
                continue
            query = docstring.split("\n\n", 1)[0].strip()
            if len(query.split()) < MIN_DOCSTRING_WORDS or query.startswith(f"{name}("):
                counts.trivial_docstrings += 1
                continue
            counts.pairs += 1
            texts = {"query.txt": query, "passage.txt": code.without_docstrings(node)}
            yield Document(document.source_id, texts, {"name": qualname, "kind": kind})


Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def definitions(tree: ast.AST, prefix: str = "", in_class: bool = False) -> Iterator[tuple[str, str, Definition]]:
    """(qualified name, kind, node) of every function, method and class, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, Definition):
            qualname = f"{prefix}{node.name}"
            kind = "class" if isinstance(node, ast.ClassDef) else "method" if in_class else "function"
            yield qualname, kind, node
            yield from definitions(node, f"{qualname}.", isinstance(node, ast.ClassDef))
        else:
            yield from definitions(node, prefix, in_class)


class SourceBytes:
    """A source file as UTF-8 bytes, addressed as ast does: (1-based line, byte column). The line
    offsets are found once (`ast.get_source_segment` splits the whole file at every call)."""

    def __init__(self, source: str) -> None:
        self.data = source.encode()
        self.line_starts = [0, *(match.end() for match in re.finditer(b"\n", self.data))]

    def offset(self, line: int, column: int) -> int:
        return self.line_starts[line - 1] + column

    def segment(self, node: Definition) -> str:
        """The definition's source from the start of its first line (only indentation precedes `def` or
        `class` there), dedented."""
        assert node.end_lineno is not None and node.end_col_offset is not None
        code = self.data[self.line_starts[node.lineno - 1] : self.offset(node.end_lineno, node.end_col_offset)]
        return textwrap.dedent(code.decode())

    def without_docstrings(self, node: Definition) -> str:
        """The definition's source (decorators included), dedented, with every docstring inside it cut out."""
        assert node.end_lineno is not None and node.end_col_offset is not None
        start = self.line_starts[min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1]
        documented = (d for d in ast.walk(node) if isinstance(d, Definition) and ast.get_docstring(d) is not None)
        pieces, cursor = [], start
        for cut_start, cut_end in sorted(self._docstring_span(d) for d in documented):
            pieces.append(self.data[cursor:cut_start])
            cursor = cut_end
        pieces.append(self.data[cursor : self.offset(node.end_lineno, node.end_col_offset)])
        return textwrap.dedent(b"".join(pieces).decode()).rstrip()

    def _docstring_span(self, node: Definition) -> tuple[int, int]:
        """Byte range of the docstring; its whole lines when nothing else shares them."""
        docstring = node.body[0]
        assert docstring.end_lineno is not None and docstring.end_col_offset is not None
        begin = self.offset(docstring.lineno, docstring.col_offset)
        end = self.offset(docstring.end_lineno, docstring.end_col_offset)
        line_start = self.line_starts[docstring.lineno - 1]
        line_end = self.data.find(b"\n", end)
        line_end = len(self.data) if line_end < 0 else line_end
        if self.data[line_start:begin].strip() or self.data[end:line_end].strip():
            return begin, end
        return line_start, line_end + 1
