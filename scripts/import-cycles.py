#!/usr/bin/env python3
"""Find file-level import cycles inside each crate of the workspace.

A file imports another when it names a path `crate::a::b` (in a `use`
line or inline) that resolves to that file: the longest prefix of the path
that is a module of the crate. `super::` and `self::` paths are resolved
relative to the file. A module's mod.rs re-exporting its children does not
count as importing them (declaring a child is not a dependency on it).
Prints every cycle (strongly connected component with more than one file)
and exits 1 if there is one.
Usage: scripts/import-cycles.py [CRATE_SRC_DIR...]
"""
import pathlib, re, sys

def modules(src):
    """module path (tuple) -> file"""
    mods = {}
    for path in src.rglob('*.rs'):
        rel = path.relative_to(src).with_suffix('')
        parts = list(rel.parts)
        if parts[-1] in ('lib', 'main') and len(parts) == 1:
            parts = []
        elif parts[-1] == 'mod':
            parts = parts[:-1]
        mods[tuple(parts)] = path
    return mods

def file_module(src, path):
    rel = path.relative_to(src).with_suffix('')
    parts = list(rel.parts)
    if parts[-1] in ('lib', 'main') and len(parts) == 1:
        return ()
    if parts[-1] == 'mod':
        return tuple(parts[:-1])
    return tuple(parts)

path_re = re.compile(r'\b(crate|super|self)((?:::\w+)+)')

use_re = re.compile(r'\buse\s+([^;]*);')

def split_top(text):
    """Split a use-tree group's contents at its top-level commas."""
    parts, depth, cur = [], 0, ''
    for ch in text:
        if ch == '{':
            depth += 1
        elif ch == '}':
            depth -= 1
        if ch == ',' and depth == 0:
            parts.append(cur)
            cur = ''
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]

def flatten(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e'] (renames
    dropped, `self` in a group naming the group's own path). A tree that
    does not parse (the regex caught prose) gives nothing."""
    tree = re.sub(r'\s+as\s+\w+', '', tree)
    tree = re.sub(r'\s+', '', tree)
    brace = tree.find('{')
    if brace < 0:
        return [re.sub(r'::self$', '', tree)]
    if not tree.endswith('}') or tree.count('{') != tree.count('}'):
        return []
    prefix = tree[:brace]
    out = []
    for part in split_top(tree[brace + 1:-1]):
        for flat in flatten(part):
            out.append(prefix.rstrip(':') if flat == 'self' else prefix + flat)
    return out

def paths_in(text):
    """Every crate/super/self path the file names: inline ones, and each
    leaf of a grouped `use a::{B, c::D}` (the group's own prefix alone
    would resolve to the module that holds the group, not the leaf)."""
    flat = []
    for m in use_re.finditer(text):
        if '{' in m.group(1):
            flat.extend(flatten(m.group(1)))
    text = use_re.sub(lambda m: ';' if '{' in m.group(1) else m.group(0), text)
    return list(path_re.finditer(text + '\n' + '\n'.join(flat)))

reexport_re = re.compile(r'pub(?:\([^)]*\))?\s+use\s+(\w+)::(\{[^}]*\}|\w+)\s*;')

def reexports(mods):
    """(module, item) -> child module, for `pub use child::{Item, ...}` in a
    module's own file: naming `module::Item` depends on the child only."""
    out = {}
    for mod, path in mods.items():
        for m in reexport_re.finditer(path.read_text()):
            child = mod + (m.group(1),)
            if child not in mods:
                continue
            items = m.group(2).strip('{}').split(',')
            for item in items:
                item = item.strip().split(' as ')[-1].strip()
                if item:
                    out[(mod, item)] = child
    return out

def resolve(mods, base, segments, rex):
    for n in range(len(segments), -1, -1):
        cand = base + tuple(segments[:n])
        if cand in mods:
            if n < len(segments) and (cand, segments[n]) in rex:
                return rex[(cand, segments[n])]
            return cand
    return None

def graph(src):
    mods = modules(src)
    rex = reexports(mods)
    edges = {p: set() for p in mods.values()}
    for mod, path in mods.items():
        text = path.read_text()
        # Drop comments and string literals roughly.
        text = re.sub(r'//[^\n]*', '', text)
        is_mod_rs = path.name in ('mod.rs', 'lib.rs', 'main.rs')
        for m in paths_in(text):
            head, tail = m.group(1), m.group(2).split('::')[1:]
            if head == 'crate':
                base = ()
            elif head == 'self':
                base = mod if is_mod_rs else mod[:-1] + (mod[-1],) if False else mod
                if not is_mod_rs:
                    base = mod
            else:  # super
                base = mod if is_mod_rs else mod[:-1]
                base = base[:-1]
                while tail and tail[0] == 'super':
                    base = base[:-1]
                    tail = tail[1:]
            target = resolve(mods, base, tail, rex)
            if target is None:
                continue
            tfile = mods[target]
            if tfile == path:
                continue
            # A parent naming its own child module (re-exports) is structure,
            # not a dependency.
            if target[:len(mod)] == mod and len(target) > len(mod) and is_mod_rs:
                continue
            edges[path].add(tfile)
    return edges

def sccs(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)
    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            out.append(comp)
    for v in edges:
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]

roots = [pathlib.Path(p) for p in sys.argv[1:]] or sorted(pathlib.Path('crates').glob('*/src'))
bad = 0
for src in roots:
    for comp in sccs(graph(src)):
        bad += 1
        print(f'cycle in {src}: ' + ' <-> '.join(sorted(str(p.relative_to(src)) for p in comp)))
if bad == 0:
    print('no file-level import cycles in', ', '.join(str(r) for r in roots))
sys.exit(1 if bad else 0)
