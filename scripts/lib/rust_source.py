"""What the tree checkers (check-layers, check-file-length) agree a Rust file's
code is: the `.rs` files under a folder, which of them only tests include
(`#[cfg(test)] mod tests;`, `#[cfg(test)] #[path = "…"] mod …`), and a file's
text without its comments and its inline test module (by convention the
file's tail)."""

import os
import re

TEST_PATH = re.compile(r"#\[cfg\(test\)\]\s*#\[path\s*=\s*\"([^\"]+)\"\]")
TEST_FILE_MODULE = re.compile(r"#\[cfg\(test\)\]\s*(?:#\[[^\n]*\]\s*)*(?:pub(?:\([a-z]+\))?\s+)?mod\s+(\w+)\s*;")
TEST_MODULE = re.compile(r"^#\[cfg\(test\)\]\s*\n(\s*#\[[^\n]*\]\s*\n)*\s*(pub(\([a-z]+\))?\s+)?mod\s+\w+\s*[{;]", re.M)


def rust_files(folder):
    """Every `.rs` file under `folder`, path -> text, in a stable order."""
    files = {}
    for d, _, names in sorted(os.walk(folder)):
        for n in sorted(names):
            if n.endswith(".rs"):
                path = os.path.normpath(os.path.join(d, n))
                with open(path, encoding="utf-8") as f:
                    files[path] = f.read()
    return files


def test_only(files):
    """The paths of `files` that only a `#[cfg(test)]` module declaration includes."""
    out = set()
    for path, text in files.items():
        folder, name = os.path.split(path)
        included = TEST_PATH.findall(text)
        for rel in included:
            out.add(os.path.normpath(os.path.join(folder, rel)))
        if included:
            continue
        # `#[cfg(test)] mod tests;`: tests.rs beside a mod.rs, or in the folder named after the file.
        base = folder if name in ("mod.rs", "lib.rs", "main.rs") else os.path.join(folder, name[:-3])
        for module in TEST_FILE_MODULE.findall(text):
            out.add(os.path.normpath(os.path.join(base, module + ".rs")))
            out.add(os.path.normpath(os.path.join(base, module, "mod.rs")))
    return out


def code_of(text):
    """The text up to its inline test module, comments blanked; lines keep their numbers."""
    m = TEST_MODULE.search(text)
    if m:
        text = text[: m.start()]
    text = re.sub(r"/\*.*?\*/", lambda c: "\n" * c.group(0).count("\n"), text, flags=re.S)
    return "\n".join(re.sub(r"//.*$", "", line) for line in text.splitlines())
