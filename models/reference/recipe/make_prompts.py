"""Write eval_prompts.jsonl: deterministic chunks (150-400 chars, cut at line boundaries) of the held-out files.
Each prompt starts at a top-level/method `def` or `class` line and includes its signature and docstring start."""
import json
import os
import re

from common import HELDOUT, PAIR, list_files, read_text

PER_FILE = {"textwrap.py": 2, "shlex.py": 2}   # others: 1  -> 10 prompts


def chunks(text, n):
    lines = text.splitlines(keepends=True)
    out = []
    for need_doc in (True, False):
        out = _collect(lines, need_doc)
        if out:
            break
    if not out:
        return []
    # spread picks deterministically over the file
    step = max(1, len(out) // n)
    return [out[min(len(out) - 1, k * step + step // 2)] for k in range(n)]


def _collect(lines, need_doc):
    starts = [i for i, l in enumerate(lines) if re.match(r"\s*(def|class) \w", l)
              and not l.lstrip().startswith("def _")]
    out = []
    for i in starts:
        buf = ""
        for l in lines[i:]:
            if len(buf) + len(l) > 400:
                break
            buf += l
        if len(buf) >= 150 and ('"""' in buf or not need_doc):
            out.append(buf)
    return out


def main():
    _, held = list_files()
    paths = dict(held)
    with open(os.path.join(PAIR, "eval_prompts.jsonl"), "w") as fh:
        for f in HELDOUT:
            for p in chunks(read_text(paths[f]), PER_FILE.get(f, 1)):
                fh.write(json.dumps({"file": f, "prompt": p}) + "\n")


if __name__ == "__main__":
    main()
