"""A small FileCheck: match `# CHECK:` / `# CHECK-NEXT:` / `# CHECK-NOT:` / `# CHECK-COUNT-N:` directives
against a text, in order (substring matches; `{{re}}` embeds a regular expression).

Variables, as in LLVM's FileCheck: `[[NAME:re]]` matches `re` and binds NAME to the matched text;
a later `[[NAME]]` (on the same line or any later directive) matches exactly that text. A use before
its definition, or an empty definition `[[NAME:]]`, is an error of the check file, not a mismatch."""

from __future__ import annotations

import re

_TOKEN = re.compile(r"\{\{(.*?)\}\}|\[\[(\w+)(?::(.*?))?\]\]")


def directives(source: str) -> list[tuple[str, str, int]]:
    """(kind, pattern text, count) per directive; patterns are compiled when matched (they use bindings)."""
    out = []
    for line in source.splitlines():
        m = re.match(r"\s*#\s*(CHECK(?:-NEXT|-NOT|-COUNT-(\d+))?):(.*)$", line)
        if m:
            kind = "CHECK-COUNT" if m.group(2) else m.group(1)
            out.append((kind, m.group(3).strip(), int(m.group(2) or 0)))
    return out


def _compile(text: str, bound: dict[str, str]) -> tuple[re.Pattern, list[str]]:
    """The regex of one directive under the current bindings, and the names it defines."""
    out, defines, pos = [], [], 0
    for m in _TOKEN.finditer(text):
        out.append(re.escape(text[pos:m.start()]))
        pos = m.end()
        regex, name, definition = m.groups()
        if regex is not None:
            out.append(f"(?:{regex})")
        elif definition is not None:
            assert definition, f"[[{name}:]] binds nothing: give the text to capture, e.g. [[{name}:[0-9]+]]"
            assert name not in defines, f"[[{name}:...]] defined twice in {text!r}"
            out.append(f"(?P<{name}>{definition})")
            defines.append(name)
        elif name in defines:  # defined earlier on this line
            out.append(f"(?P={name})")
        else:
            assert name in bound, f"[[{name}]] used before any [[{name}:...]] bound it, in {text!r}"
            out.append(re.escape(bound[name]))
    out.append(re.escape(text[pos:]))
    return re.compile("".join(out)), defines


def filecheck(text: str, source: str) -> None:
    """Raise AssertionError naming the first directive that fails."""
    lines = text.splitlines()
    pos = 0  # next line to search from
    last = -1
    bound: dict[str, str] = {}
    pending_not: list[re.Pattern] = []
    checks = directives(source)
    assert checks, "no CHECK directives"
    for kind, raw, n in checks:
        pat, defines = _compile(raw, bound)
        if kind == "CHECK-NOT":
            assert not defines, f"CHECK-NOT cannot bind variables: {raw!r}"
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
        if defines:  # the binding is the last match's (CHECK-COUNT) text
            got = pat.search(lines[found[-1]])
            bound.update({name: got.group(name) for name in defines})
        last = found[-1]
        pos = last + 1
    for bad in pending_not:
        hit = next((ln for ln in lines[pos:] if bad.search(ln)), None)
        assert hit is None, f"CHECK-NOT: {bad.pattern!r} matched {hit!r}"
