"""An English evaluation text that every Python installation already has offline.

The standard library ships the Python language reference as plain text for `help()` in
``pydoc_data/topics.py`` (a dict of topic name -> reST-like text, ~450,000 characters).
Its prose paragraphs are human-written English that the model did not generate, so they make
a fair perplexity text without downloading a data set.  We keep unindented paragraphs
(prose), unwrap their lines, and drop headings, grammar rules and code examples (indented).

    python -m kvserve.evaluation.sample_text OUT.txt

The text depends on the Python version (the reference changes between releases); record the
version next to any number measured on it (`sample_text_source()` says which).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_UNDERLINE_CHARS = set("*=-~^#")


def _is_heading(lines: list[str]) -> bool:
    """A title followed by a line of '*' or '=' (how pydoc renders section headings)."""
    return len(lines) == 2 and set(lines[1].strip()) <= _UNDERLINE_CHARS


def _prose_paragraphs(topic_text: str) -> list[str]:
    """Unwrapped prose paragraphs of one topic: no headings, no indented blocks."""
    paragraphs = []
    for block in topic_text.split("\n\n"):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines or lines[0][:1].isspace() or _is_heading(lines):
            continue
        paragraphs.append(" ".join(line.strip() for line in lines))
    return paragraphs


def python_reference_prose() -> str:
    """The prose of the language reference, topics in sorted order, one paragraph a line pair."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        paragraphs.extend(_prose_paragraphs(topics[name]))
    return "\n\n".join(paragraphs) + "\n"


def sample_text_source() -> str:
    """Where the text came from, to print next to measurements made on it."""
    version = ".".join(str(part) for part in sys.version_info[:3])
    return f"pydoc_data/topics.py prose of Python {version}"


def write_sample_text(path: Path) -> int:
    """Write the prose to `path`; returns the number of characters written."""
    text = python_reference_prose()
    path.write_text(text, encoding="utf-8")
    return len(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.evaluation.sample_text",
        description="Write the prose of Python's bundled language reference to a text file.",
    )
    parser.add_argument("out", type=Path, help="Output .txt file.")
    args = parser.parse_args(argv)
    num_chars = write_sample_text(args.out)
    print(f"wrote {num_chars:,} characters ({sample_text_source()}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
