#!/usr/bin/env python3
"""List functions longer than a limit in crates/*/src (default 100 lines).

A function may be longer if a comment line starting with `// long:` sits
within the three lines above its signature and says why.
Usage: scripts/long-functions.py [LIMIT] [PATH...]
"""
import re, sys, pathlib

limit = int(sys.argv[1]) if len(sys.argv) > 1 else 100
roots = [pathlib.Path(p) for p in sys.argv[2:]] or sorted(pathlib.Path('crates').glob('*/src'))
fn_re = re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(unsafe\s+)?(async\s+)?fn\s+(\w+)')
found = 0
for root in roots:
    for path in sorted(root.rglob('*.rs')):
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = fn_re.match(lines[i])
            if not m:
                i += 1
                continue
            depth, started, j = 0, False, i
            while j < len(lines):
                code = re.sub(r'//.*', '', lines[j])
                code = re.sub(r'"([^"\\]|\\.)*"', '""', code)
                code = re.sub(r"'([^'\\]|\\.)'", "''", code)
                for ch in code:
                    if ch == '{':
                        depth += 1; started = True
                    elif ch == '}':
                        depth -= 1
                if started and depth <= 0:
                    break
                if not started and code.rstrip().endswith(';'):
                    break
                j += 1
            length = j - i + 1
            reason = any(l.strip().startswith('// long:') for l in lines[max(0, i - 3):i])
            if started and length > limit and not reason:
                print(f'{length:5} {path}:{i + 1} {m.group(6)}')
                found += 1
            i += 1
sys.exit(1 if found else 0)
