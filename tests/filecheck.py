"""A small FileCheck: match `# CHECK:` / `# CHECK-NEXT:` / `# CHECK-NOT:` / `# CHECK-COUNT-N:` directives
against a text, in order (substring matches; `{{re}}` embeds a regular expression)."""

from __future__ import annotations

import re


def _pattern(s: str) -> re.Pattern:
    s = re.sub(r"\[\[\w*:\]\]", "", s)  # `[[NAME:]]` labels are documentation only
    parts = re.split(r"\{\{(.*?)\}\}", s.strip())
    return re.compile("".join(re.escape(p) if i % 2 == 0 else p for i, p in enumerate(parts)))


def directives(source: str) -> list[tuple[str, re.Pattern | None, int]]:
    out = []
    for line in source.splitlines():
        m = re.match(r"\s*#\s*(CHECK(?:-NEXT|-NOT|-COUNT-(\d+))?):(.*)$", line)
        if m:
            kind = "CHECK-COUNT" if m.group(2) else m.group(1)
            out.append((kind, _pattern(m.group(3)), int(m.group(2) or 0)))
    return out


def filecheck(text: str, source: str) -> None:
    """Raise AssertionError naming the first directive that fails."""
    lines = text.splitlines()
    pos = 0  # next line to search from
    last = -1
    pending_not: list[re.Pattern] = []
    checks = directives(source)
    assert checks, "no CHECK directives"
    for kind, pat, n in checks:
        if kind == "CHECK-NOT":
            pending_not.append(pat)
            continue
        if kind == "CHECK-NEXT":
            idx = last + 1
            assert idx < len(lines) and pat.search(lines[idx]), \
                f"CHECK-NEXT: {pat.pattern!r} not on the line after {lines[last]!r}"
            found = [idx]
        elif kind == "CHECK-COUNT":
            found = [i for i in range(pos, len(lines)) if pat.search(lines[i])][:n]
            assert len(found) == n, f"CHECK-COUNT-{n}: {pat.pattern!r} found {len(found)} times"
        else:
            found = [next((i for i in range(pos, len(lines)) if pat.search(lines[i])), None)]
            assert found[0] is not None, f"CHECK: {pat.pattern!r} not found after line {pos}"
        for bad in pending_not:
            hit = next((lines[i] for i in range(pos, found[0]) if bad.search(lines[i])), None)
            assert hit is None, f"CHECK-NOT: {bad.pattern!r} matched {hit!r}"
        pending_not = []
        last = found[-1]
        pos = last + 1
    for bad in pending_not:
        hit = next((ln for ln in lines[pos:] if bad.search(ln)), None)
        assert hit is None, f"CHECK-NOT: {bad.pattern!r} matched {hit!r}"
