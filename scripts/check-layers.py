#!/usr/bin/env python3
"""Check that extree's files call each other only downwards.

    scripts/check-layers.py [--tap] [OBJECT_DIR ...]

Reads the symbol tables of the compiled objects (nm): a file's undefined
extree symbols are the functions and tables it uses from other files, and
each must be defined by a file of a lower layer (LAYERS, bottom first; files
of one layer may not call each other).  Default object directories: the
core's in build/core and, if built, the QEMU driver's in build/qemu.
docs/devel/extree.rst draws the same picture.  Exit status 1 on a violation.
"""
import glob
import os
import re
import subprocess
import sys

# Bottom first.  One entry per layer; a tuple holds files of one layer.
LAYERS = [
    ('extree-crc32c', 'extree-crc32c-qemu', 'extree-compress'),
    'extree-node',
    'extree-node-check',
    'extree-node-io',
    'extree-rangeset',
    ('extree-alloc', 'extree-btree'),
    'extree-btree-edit',
    'extree-btree-drop',
    'extree-reftree',
    'extree-freetree',
    'extree-spacemap',
    'extree-bitmap',
    'extree-bitmap-io',
    'extree-marklog',
    'extree-extent',
    'extree-cursor',
    ('extree-super', 'extree-snaptab'),
    'extree-init',
    'extree-txn',
    'extree-snap',
    'extree-check',
    'extree-file',
    ('extree-crypt', 'extree-codec', 'extree-dirty'),
    'extree-req',
    'extree-read',
    'extree-write',
    'extree-range',
    'extree-compressed',
    ('extree-snapshot', 'extree-create'),
    'extree',
]
# The core's top layer: the core lives in block/extree/, the driver in block/
CORE_TOP = 'extree-check'
# Driver files that stand in for a core file in QEMU's build: the core's
# CRC-32C there is QEMU's crc32c() (block/extree-crc32c-qemu.c)
CORE_STAND_INS = {'extree-crc32c-qemu'}
# The nbdkit plugin (nbdkit/), bottom first, on top of the core's public
# API alone: the functions block/extree/extree.h declares
PLUGIN_LAYERS = ['extree-nbdkit-file', 'extree-nbdkit-io', 'extree-nbdkit']


def rank_of(name):
    for i, layer in enumerate(LAYERS):
        if name == layer or (isinstance(layer, tuple) and name in layer):
            return i
    return None


def file_of(obj):
    # meson names objects block_extree_extree-node.c.o (the core, in
    # block/extree/) or block_extree-req.c.o (the driver, in block/)
    base = os.path.basename(obj)
    base = base[:-len('.c.o')] if base.endswith('.c.o') else base
    return base.split('_')[-1]


def symbols(obj):
    out = subprocess.run(['nm', obj], check=True, capture_output=True,
                         text=True).stdout
    defined, used = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == 'U':
            used.add(parts[1])
        elif len(parts) == 3 and parts[1] in 'TDRB':
            defined.add(parts[2])
    return defined, used


def public_api(top):
    """extree.h, and extree-backend.h's backends (the plugin's I/O)"""
    text = ''
    for h in ('block/extree/extree.h', 'block/extree/extree-backend.h'):
        with open(os.path.join(top, h)) as f:
            text += f.read()
    return set(re.findall(r'\b(extree_\w+)\(', text))


def check_plugin(top, objs, core_owner):
    """The plugin's files call downwards, and only the core's public API"""
    if not objs:
        return 0
    api = public_api(top)
    files = {os.path.basename(o)[:-len('.c.o')]: symbols(o) for o in objs}
    owner = {sym: name for name, (defined, _) in files.items()
             for sym in defined}
    bad = 0
    for name, (_, used) in sorted(files.items()):
        if name not in PLUGIN_LAYERS:
            print(f'# check-layers: {name}.c is in no layer (PLUGIN_LAYERS)')
            bad += 1
            continue
        me = PLUGIN_LAYERS.index(name)
        for sym in sorted(used):
            callee = owner.get(sym)
            if callee is not None and callee != name and \
                    PLUGIN_LAYERS.index(callee) >= me:
                print(f'# check-layers: {name}.c uses {sym}() of '
                      f'{callee}.c, which is not below it')
                bad += 1
            elif callee is None and sym in core_owner and sym not in api:
                print(f'# check-layers: {name}.c uses {sym}() of '
                      f'{core_owner[sym]}.c, which block/extree/extree.h '
                      'does not declare')
                bad += 1
    return bad



def doc_layers(top):
    """The layers docs/devel/extree.rst draws, bottom first: each line of
    its picture between the two rulers that names files is one layer"""
    with open(os.path.join(top, 'docs/devel/extree.rst')) as f:
        text = f.read()
    start = text.index('---- layers, top first')
    end = text.index('---- bottom', start)
    layers = []
    for line in text[start:end].splitlines()[1:]:
        # a layer's line: its files first, from column 6
        if not re.match(r'      extree', line):
            continue
        names = []
        for word in line.split():
            if not word.endswith('.c'):
                break
            names.append(word[:-2])
        layers.append(tuple(names))
    return layers[::-1]


def check_doc(top):
    """The picture lists exactly LAYERS and PLUGIN_LAYERS, in order"""
    want = [layer if isinstance(layer, tuple) else (layer,)
            for layer in LAYERS] + [(p,) for p in PLUGIN_LAYERS]
    have = doc_layers(top)
    if have != want:
        print('# check-layers: docs/devel/extree.rst draws other layers '
              'than LAYERS:')
        for i in range(max(len(have), len(want))):
            h = have[i] if i < len(have) else ()
            w = want[i] if i < len(want) else ()
            if h != w:
                print(f'#   {i}: drawn {" ".join(h) or "-"}, '
                      f'enforced {" ".join(w) or "-"}')
        return 1
    return 0

def main():
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = sys.argv[1:]
    tap = bool(args) and args[0] == '--tap'
    if tap:
        args = args[1:]
    dirs = args or [
        os.path.join(top, 'build/core/libextree-core.a.p'),
        os.path.join(top, 'build/qemu/libblock.a.p'),
    ]
    objs, plugin_objs = [], []
    for d in dirs:
        objs += glob.glob(os.path.join(d, 'block_extree*.c.o'))
        plugin_objs += glob.glob(os.path.join(d, 'extree-nbdkit*.c.o'))
    if not objs:
        print('check-layers: no objects found in', ' '.join(dirs))
        return 1
    files = {}
    bad = 0
    for o in objs:
        name = file_of(o)
        files[name] = symbols(o)
        # the path tells core from driver: the core in block/extree/
        in_core_dir = os.path.basename(o).startswith('block_extree_')
        rank = rank_of(name)
        if rank is not None and name not in CORE_STAND_INS and \
                in_core_dir != (rank <= rank_of(CORE_TOP)):
            print(f'# check-layers: {name}.c is a '
                  f'{"core" if rank <= rank_of(CORE_TOP) else "driver"} '
                  f'file but lives in {"block/extree/" if in_core_dir else "block/"}')
            bad += 1
    owner = {}
    for name, (defined, _) in files.items():
        for sym in defined:
            owner[sym] = name
    for name, (_, used) in sorted(files.items()):
        me = rank_of(name)
        if me is None:
            print(f'# check-layers: {name}.c is in no layer (LAYERS)')
            bad += 1
            continue
        for sym in sorted(used):
            callee = owner.get(sym)
            if callee is None or callee == name:
                continue
            if rank_of(callee) >= me:
                print(f'# check-layers: {name}.c uses {sym}() of {callee}.c, '
                      'which is not below it')
                bad += 1
    bad += check_plugin(top, plugin_objs, owner)
    bad += check_doc(top)
    print(f'# check-layers: {len(files) + len(plugin_objs)} files, {bad} '
          'upward or sideways calls or differences from the picture')
    if tap:
        print('1..1')
        print(f'{"not ok" if bad else "ok"} 1 - layers: calls go downwards')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
