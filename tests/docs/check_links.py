#!/usr/bin/python3
"""docs_links: every relative link in README.md and docs/*.md leads somewhere.

A link `[text](path)`, `[text](path#anchor)`, `[text](#anchor)`, an image `![alt](path)` or a
reference definition `[name]: path` must name a file or directory of the repository, and an
anchor into a markdown file must match one of its headings, by GitHub's rules (lower case,
punctuation dropped, spaces to hyphens, -1, -2, ... for repeats). Links in code (fenced blocks,
`inline code`) are not links. Web links (http, https, mailto) are not fetched.

    tests/docs/check_links.py --source REPOSITORY_ROOT
"""
import argparse
import functools
import os
import re
import sys
import urllib.parse

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target) and ![alt](target), with an optional "title"; text may hold `code` or brackets
# one level deep.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", re.I)


def pages(root):
    """The documentation pages: README.md and every markdown file under docs/."""
    root = os.path.realpath(root)
    found = [os.path.join(root, "README.md")]
    for folder, _, files in os.walk(os.path.join(root, "docs")):
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".md")]
    return [p for p in found if os.path.isfile(p)]


def prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)[0] * len(match.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
                fence = None
            continue
        yield number, line


def slug(heading):
    """GitHub's anchor for a heading's text: rendered text, lower case, punctuation dropped."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)   # a link shows its text
    text = re.sub(r"<[^>]+>", "", text)                       # inline HTML
    text = re.sub(r"(\*\*|__|\*)", "", text)                  # emphasis markers
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path):
    """Every anchor a markdown file offers: its headings' slugs (repeats numbered) and HTML ids."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    seen, found = {}, set()
    for _, line in prose_lines(text):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def targets(text):
    """(line number, link target) of every link outside code."""
    for number, line in prose_lines(text):
        line = INLINE_CODE.sub("", line)
        for match in INLINE_LINK.finditer(line):
            yield number, match.group(1)
        match = REFERENCE.match(line)
        if match:
            yield number, match.group(1)


def check(root, page):
    """Problems with the links of one page, as messages."""
    root = os.path.realpath(root)
    with open(page, encoding="utf-8") as f:
        text = f.read()
    where = os.path.relpath(page, root)
    problems = []
    for number, target in targets(text):
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # empty, or a URL with a scheme (http, https, mailto): not fetched
        path, _, anchor = target.partition("#")
        path = urllib.parse.unquote(path)
        if path.startswith("/"):
            problems.append(f"{where}:{number}: '{target}': an absolute path; link relative to the page")
            continue
        resolved = os.path.realpath(os.path.join(os.path.dirname(page), path)) if path else page
        if os.path.commonpath([resolved, root]) != root:
            problems.append(f"{where}:{number}: '{target}' leads out of the repository")
            continue
        if not os.path.exists(resolved):
            problems.append(f"{where}:{number}: '{target}': no such file or directory")
            continue
        if anchor and resolved.endswith(".md") and os.path.isfile(resolved):
            if urllib.parse.unquote(anchor) not in anchors(resolved):
                known = ", ".join(sorted(anchors(resolved)))
                problems.append(f"{where}:{number}: '{target}': no heading '#{anchor}' in "
                                f"{os.path.relpath(resolved, root)} (it has: {known})")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="the repository's root")
    args = parser.parse_args()
    checked = pages(args.source)
    problems = [p for page in checked for p in check(args.source, page)]
    for problem in problems:
        print(problem)
    print(f"docs_links: {len(checked)} pages, {len(problems)} broken links")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
