#!/usr/bin/env python3
"""Checks the links of the repository's documentation: README.md and docs/*.md.

Every relative link ([text](target), ![alt](target), [ref]: target) must name
a file or directory of the repository (tracked, or new and not ignored by
git), may not leave it (no ../ above the root, no absolute local path), and a
#fragment into a markdown file must be one of its headings (GitHub's anchors).
Paths written as inline code (`engine/engine.h`, `scripts/package.sh --help`)
that start with one of the repository's top-level folders must exist too.
Links with a scheme (https:, mailto:) are not followed.

Usage: check_links.py [REPO_ROOT]   (default: two folders up from this file)
Exit status 0 when every link holds, 1 otherwise (each broken one listed).
"""
import os
import re
import subprocess
import sys

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def strip_fences(text):
    """The text without its fenced code blocks (``` or ~~~, indented or not)."""
    out = []
    fence = None
    for line in text.splitlines(keepends=True):
        marker = line.lstrip()[:3]
        if fence is None and marker in ("```", "~~~"):
            fence = marker
        elif fence is not None and marker == fence and line.strip() == line.strip()[0] * len(
                line.strip()):
            fence = None
        elif fence is None:
            out.append(line)
    return "".join(out)


def repo_files(root):
    """Paths (files and their folders) that belong to the repository."""
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True, capture_output=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return None  # not a git checkout: existence on disk decides
    paths = set()
    for f in filter(None, out.split("\0")):
        if not os.path.exists(os.path.join(root, f)):
            continue  # deleted in the work tree
        paths.add(f)
        d = os.path.dirname(f)
        while d:
            paths.add(d)
            d = os.path.dirname(d)
    return paths


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    with open(path, encoding="utf-8") as f:
        text = strip_fences(f.read())
    seen = {}
    result = set()
    for h in HEADING.findall(text):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        result.add(s if n == 0 else f"{s}-{n}")
    return result


def check(root):
    root = os.path.realpath(root)
    known = repo_files(root)
    docs = ["README.md"] + sorted(
        os.path.join("docs", f) for f in os.listdir(os.path.join(root, "docs"))
        if f.endswith(".md"))
    top = sorted(d for d in os.listdir(root)
                 if os.path.isdir(os.path.join(root, d)) and d != ".git"
                 and (known is None or d in known))
    code_path = re.compile(r"^(?:%s)/[A-Za-z0-9_.+/-]*$" % "|".join(map(re.escape, top)))

    def exists(rel):
        if known is not None:
            return rel in known
        return os.path.exists(os.path.join(root, rel))

    errors = []
    checked = 0
    for doc in docs:
        with open(os.path.join(root, doc), encoding="utf-8") as f:
            text = f.read()
        prose = strip_fences(text)
        spans = [m.group(2).strip() for m in CODE_SPAN.finditer(prose)]
        prose = CODE_SPAN.sub("", prose)
        here = os.path.dirname(doc)
        targets = LINK.findall(prose) + REFDEF.findall(prose)
        for target in targets:
            if SCHEME.match(target):
                continue
            checked += 1
            path, _, fragment = target.partition("#")
            if path.startswith("/") or path.startswith("~"):
                errors.append(f"{doc}: link '{target}' is an absolute path outside the repository")
                continue
            rel = os.path.normpath(os.path.join(here, path)) if path else doc
            if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
                errors.append(f"{doc}: link '{target}' leaves the repository")
                continue
            if not exists(rel):
                errors.append(f"{doc}: link '{target}': no {rel} in the repository")
                continue
            if fragment and rel.endswith(".md") and fragment not in anchors(
                    os.path.join(root, rel)):
                errors.append(f"{doc}: link '{target}': {rel} has no heading #{fragment}")
        for span in spans:
            words = span.split()
            if not words:
                continue
            word = words[0].rstrip(":,;.")
            if not code_path.match(word) or any(c in word for c in "*<>{}$"):
                continue
            checked += 1
            if not exists(os.path.normpath(word)):
                errors.append(f"{doc}: `{span}` names {word}, which is not in the repository")
    return checked, errors


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    checked, errors = check(root)
    for e in errors:
        print(e)
    if errors:
        print(f"check_links: {len(errors)} of {checked} links and paths are broken")
        return 1
    print(f"check_links: {checked} links and paths hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
